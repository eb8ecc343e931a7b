"""The file tier against its targets, side by side in one run: memory, read throughput, overlap.

A toy pipeline whose checkpoint is 2.5x the host budget is opened with ``host_memory=`` so most of
its packs stay in the checkpoint, read on demand into staging slots (``policies.tiers``), and:

1. **Memory.** In fresh child processes (``--child``), anonymous resident memory (RssAnon + RssShmem:
   the host store's buffers are shared anonymous mappings) is sampled every millisecond from before
   the session opens to after its last step. Target: the peak grows by at most the host budget plus
   a fixed overhead, measured here as what remains after the session's own figures (its host buffers,
   and on a CPU device its device slots, which are host memory too); outputs equal the plain model's.
2. **Read throughput.** The file tier's reader reads every file-tier pack of one step (its own
   reads, as the session planned them, into its own staging slots, two at a time) after the page
   cache is dropped for the files (``posix_fadvise DONTNEED``), against a raw sequential read of the
   same files by the same method (``runtime._readrate.sequential_read``: the same system calls,
   chunks, threads and buffered/direct mode), interleaved, min/median/max over repeats. Target: the
   file tier at least 90% of the raw read.
3. **Overlap.** Steady DiT forwards of the same layerwise schedule with everything in host memory
   (``compute``: on a CPU device it includes the host-to-device copies, which run on the compute
   thread) and with the file tier, traced; ``read`` is the file tier's bytes per forward at the
   steady read rate (the page cache warm, as in a steady state where the checkpoint fits it).
   Targets: the file tier's step at most 1.1 x max(compute, read); `policies.simulate` of the file
   tier's schedule, with the cost model calibrated from the host-tier trace and the measured read
   rate, within 15% of the measured step.

``--quick`` is the CI smoke run (a small toy, two repeats). `gpu_row` is the file tier's row of
``benchmarks/gpu_check.py`` (disk -> pinned staging -> device).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common as common
import attrs
import torch
from _common import RESULTS, Stats, fmt_bytes, write_json

import torchferry
from torchferry import policies, topology
from torchferry.testing import toy

PROMPT = "a ferry at dawn"
#: Model sizes (hidden width, DiT blocks) and denoising steps per call.
FULL = {"hidden": 1024, "blocks": 16, "steps": 4}
QUICK = {"hidden": 512, "blocks": 10, "steps": 2}
#: The checkpoint is this many times the host budget.
RATIO = 2.5
#: Targets.
READ_SHARE = 0.90
OVERLAP = 1.10
SIM_ERROR = 0.15
#: The overhead allowed beyond the session's own figures (a stated bound, measured below).
OVERHEAD_BOUND = 64 << 20


def spread(values: Sequence[float]) -> dict[str, float]:
    """Min, median and max of ``values``."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def _mmm(d: dict[str, float], fmt: Any) -> str:
    return "/".join(fmt(d[k]) for k in ("min", "median", "max"))


def anon_bytes() -> int:
    """RssAnon + RssShmem of this process (Linux), in bytes."""
    text = Path("/proc/self/status").read_text()
    return sum(int(n) for n in re.findall(r"^Rss(?:Anon|Shmem):\s+(\d+) kB", text, re.MULTILINE)) * 1024


# ------------------------------------------------------------------------------------- the child
def child(args: argparse.Namespace) -> int:
    """Open the checkpoint with the file tier, sample anonymous memory, run, write the figures."""
    torch.set_num_threads(1)
    pipe = toy.build_empty(hidden=args.hidden, blocks=args.blocks)
    baseline = anon_bytes()
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anon_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with torchferry.offload(
        pipe, device="cpu", strategy="layerwise", checkpoint=args.checkpoint, host_memory=args.host_memory
    ) as session:
        with torch.no_grad():
            image = pipe(PROMPT, steps=args.steps)
        report = session.report()
        device_peak = session.peak_device_bytes
        running = max(peak[0], anon_bytes())  # the session's peak, before close gives tensors back
    done.set()
    sampler.join()
    peak[0] = max(peak[0], anon_bytes())
    torch.save(image, Path(args.out) / "out.pt")
    figures = {
        "grown": running - baseline,
        "grown_with_close": peak[0] - baseline,
        "host_budget": report.host_budget,
        "peak_host_bytes": report.peak_host_bytes,
        "device_peak_bytes": device_peak,
        "file_packs": report.file_packs,
    }
    (Path(args.out) / "figures.json").write_text(json.dumps(figures))
    return 0


def memory(
    checkpoint: Path, shape: dict[str, int], budget: int, want: torch.Tensor, repeats: int
) -> dict[str, Any]:
    rows = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            command = [
                sys.executable,
                __file__,
                "--child",
                str(checkpoint),
                out,
                "--hidden",
                str(shape["hidden"]),
                "--blocks",
                str(shape["blocks"]),
                "--steps",
                str(shape["steps"]),
                "--host-memory",
                str(budget),
            ]
            env = {**os.environ, "PYTHONWARNINGS": "ignore"}
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"child failed:\n{done.stderr[-3000:]}")
            figures = json.loads((Path(out) / "figures.json").read_text())
            figures["identical"] = bool(torch.equal(torch.load(Path(out) / "out.pt"), want))
        figures["overhead"] = figures["grown"] - figures["peak_host_bytes"] - figures["device_peak_bytes"]
        rows.append(figures)
    overhead = [r["overhead"] for r in rows]
    grown = [r["grown"] for r in rows]
    device = max(r["device_peak_bytes"] for r in rows)
    return {
        "runs": rows,
        "grown": spread(grown),
        "overhead": spread(overhead),
        "bound": budget + device + OVERHEAD_BOUND,
        "ok": all(r["identical"] for r in rows) and max(grown) <= budget + device + OVERHEAD_BOUND,
    }


# ------------------------------------------------------------------------------------ throughput
def _tier_pass(session: torchferry.Session) -> tuple[int, float]:
    """Read every file-tier pack of the session, in ring order, through its two staging slots (on a
    CPU device, which has none, into two buffers of the largest pack, as its device slots would be)."""
    tier = session.engine.store.tier
    assert tier is not None
    largest = max(r.nbytes for r in tier.reads.values())
    staging = [s.buffer.data for s in tier.staging.values()]
    slots = staging or [torch.empty(largest, dtype=torch.uint8) for _ in range(2)]
    tickets: list[Any] = [None] * len(slots)
    start = time.perf_counter()
    nbytes = 0
    for i, read in enumerate(tier.reads.values()):
        k = i % len(slots)
        if tickets[k] is not None:
            tickets[k].wait()
        tickets[k] = tier.reader.submit(read, slots[k])
        nbytes += read.file_bytes
    for ticket in tickets:
        if ticket is not None:
            ticket.wait()
    return nbytes, time.perf_counter() - start


def throughput(checkpoint: Path, shape: dict[str, int], budget: int, repeats: int) -> dict[str, Any]:
    from torchferry.runtime.machine._readrate import drop_cache, sequential_read

    out: dict[str, Any] = {}
    for mode in ("buffered", "direct"):
        os.environ["TORCHFERRY_READ"] = mode
        pipe = toy.build_empty(hidden=shape["hidden"], blocks=shape["blocks"])
        with torchferry.offload(
            pipe, device="cpu", strategy="layerwise", checkpoint=str(checkpoint), host_memory=budget
        ) as session:
            tier = session.engine.store.tier
            assert tier is not None
            files = sorted({c.file for r in tier.reads.values() for c in r.chunks})
            raw, mine = [], []
            for _ in range(repeats):
                rate = sequential_read(files, direct=mode == "direct")
                raw.append(rate.bytes_per_s)
                drop_cache(files)
                nbytes, seconds = _tier_pass(session)
                mine.append(nbytes / seconds)
            modes = sorted(set(tier.reader.modes.values()))
        out[mode] = {
            "raw": spread(raw),
            "tier": spread(mine),
            "share_median": statistics.median(mine) / statistics.median(raw),
            "share_min": min(mine) / min(raw),
            "files": len(files),
            "reader_modes": modes,
        }
    os.environ.pop("TORCHFERRY_READ", None)
    return out


# --------------------------------------------------------------------------------------- overlap
def _traced(session: torchferry.Session, pipe: Any, calls: int, steps: int) -> list[Any]:
    traces = []
    for _ in range(calls):
        with session.trace("transformer", skip=1) as tracer, torch.no_grad():
            pipe(PROMPT, steps=steps)
        traces.append(tracer.result)
    return traces


def overlap(checkpoint: Path, shape: dict[str, int], budget: int, rounds: int) -> dict[str, Any]:
    from torchferry.policies import calibrate, measure
    from torchferry.runtime.machine._readrate import sequential_read

    steps = max(shape["steps"], 2)
    host_pipe = toy.build_empty(hidden=shape["hidden"], blocks=shape["blocks"])
    file_pipe = toy.build_empty(hidden=shape["hidden"], blocks=shape["blocks"])
    os.environ["TORCHFERRY_READ"] = "buffered"
    try:
        with (
            torchferry.offload(
                host_pipe, device="cpu", strategy="layerwise", checkpoint=str(checkpoint)
            ) as hs,
            torchferry.offload(
                file_pipe, device="cpu", strategy="layerwise", checkpoint=str(checkpoint), host_memory=budget
            ) as fs,
        ):
            for p in (host_pipe, file_pipe):  # warm: the page cache holds the checkpoint from here on
                with torch.no_grad():
                    p(PROMPT, steps=steps)
            host_traces: list[Any] = []
            file_traces: list[Any] = []
            for _ in range(rounds):  # round robin, so machine load falls on both alike
                host_traces += _traced(hs, host_pipe, 1, steps)
                file_traces += _traced(fs, file_pipe, 1, steps)
            tier = fs.engine.store.tier
            assert tier is not None
            files = sorted({c.file for r in tier.reads.values() for c in r.chunks})
            warm = max(sequential_read(files, direct=False, drop=False).bytes_per_s for _ in range(3))
            schedule = file_traces[0].schedule
            read_bytes = policies.file_read_bytes(schedule)
            best = min(host_traces, key=lambda t: t.wall_s)
            cost = calibrate([measure(best, hs.plan)], h2d_bytes_per_s=float("inf"))
            predicted = policies.simulate(schedule, attrs.evolve(cost, read_bytes_per_s=warm)).makespan_s
    finally:
        os.environ.pop("TORCHFERRY_READ", None)
    compute = Stats.of([t.wall_s for t in host_traces])
    filed = Stats.of([t.wall_s for t in file_traces])
    read_s = read_bytes / warm
    bound = OVERLAP * max(compute.min, read_s)
    return {
        "compute": compute.to_json(),
        "file_tier": filed.to_json(),
        "read_bytes": read_bytes,
        "read_bytes_per_s": warm,
        "read_s": read_s,
        "ratio": filed.min / max(compute.min, read_s),
        "predicted_s": predicted,
        "prediction_error": predicted / filed.min - 1,
        "ok_overlap": filed.min <= bound,
        "ok_prediction": abs(predicted / filed.min - 1) <= SIM_ERROR,
    }


# ------------------------------------------------------------------------------ the gpu_check row
def _other_gpu_contexts(device: torch.device) -> list[int] | None:
    """Indices of GPUs other than ``device`` on which this process holds a CUDA context (from
    ``nvidia-smi``); ``None`` with fewer than two GPUs or no ``nvidia-smi`` (nothing to check)."""
    import subprocess

    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return None
    try:
        gpus = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    index = {u.strip(): int(i) for i, u in (line.split(",", 1) for line in gpus.splitlines() if "," in line)}
    mine = device.index if device.index is not None else torch.cuda.current_device()
    found = set()
    for line in apps.splitlines():
        pid, _, uuid = line.partition(",")
        if pid.strip() == str(os.getpid()) and index.get(uuid.strip(), mine) != mine:
            found.add(index[uuid.strip()])
    return sorted(found)


def gpu_row(check: Any) -> dict[str, Any]:
    """gpu_check's file-tier row: the DiT opened from a checkpoint with a third of it in host memory,
    read from the drive (O_DIRECT, page cache dropped) into pinned staging slots and copied to the
    device. Bit identity with the resident run, the step, achieved read and H2D rates, and overlap
    (the share of the read time the step hides)."""
    from dataclasses import replace

    from torchferry.runtime.machine._readrate import drop_cache, sequential_read

    gpu_check = sys.modules[type(check).__module__]
    size = replace(check.size, blocks=min(check.size.blocks, 8))
    if not check.cuda:
        size = replace(size, hidden=512, heads=4, blocks=8, tokens=16)
    torch.manual_seed(0)
    ref = gpu_check.Pipe(gpu_check.DiT(size, device=torch.device("cpu"), dtype=check.dtype)).eval()
    g = torch.Generator(device=check.device).manual_seed(1)
    kw: dict[str, Any] = {"generator": g, "device": check.device, "dtype": check.dtype}
    inputs = (
        torch.randn(size.batch, size.tokens, size.hidden, **kw),
        torch.randn(size.batch, size.hidden, **kw),
    )
    folder = Path(tempfile.mkdtemp(prefix="torchferry-file-tier-"))
    path = folder / "dit.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    with torch.no_grad():
        ref.to(check.device)
        want = ref(*inputs).to("cpu")
        ref.to("cpu")
    size_bytes = path.stat().st_size
    budget = _least_budget(_empty(gpu_check, size, check.dtype), size_bytes // 3)
    figures: dict[str, Any] = {"checkpoint_bytes": size_bytes, "host_budget": budget}
    for mode in ("direct", "buffered"):
        os.environ["TORCHFERRY_READ"] = mode
        try:
            pipe = _empty(gpu_check, size, check.dtype)
            with torchferry.offload(
                pipe, device=check.device, strategy="layerwise", checkpoint=str(path), host_memory=budget
            ) as session:
                tier = session.engine.store.tier
                if tier is None:
                    raise RuntimeError("no pack went to the file tier")

                def run(pipe: Any = pipe) -> torch.Tensor:
                    with torch.no_grad():
                        out: torch.Tensor = pipe(*inputs)
                    return out

                # Once, before timing, and only for buffered reads (O_DIRECT bypasses the page cache):
                # a drop inside the timed step would leave the device idle and count as read time.
                if mode == "buffered":
                    drop_cache([str(path)])
                before = tier.reader.bytes_read
                stats, out = gpu_check.time_steps(run, size, check.device)
                per_step = (tier.reader.bytes_read - before) / (size.warmup + size.steps)
                with session.trace("transformer", skip=0) as tracer:
                    run()
                trace = tracer.result
                figures[mode] = {
                    "identical": bool(torch.equal(out, want)),
                    "median_s": stats.median,
                    "min_s": stats.min,
                    "read_bytes_per_step": per_step,
                    "reader_modes": sorted(set(tier.reader.modes.values())),
                    "copy_busy_s": trace.busy_s("copy"),
                    "achieved_h2d_bytes_per_s": (
                        sum(op.nbytes for op in trace.schedule.ops if op.kind in ("load", "stage"))
                        / trace.busy_s("copy")
                        if trace.busy_s("copy") > 0
                        else None
                    ),
                    "pinned": session.engine.store.pinned,
                    "other_gpu_contexts": _other_gpu_contexts(check.device),
                }
                if figures[mode]["other_gpu_contexts"]:
                    raise RuntimeError(
                        f"the file tier's reader threads made CUDA contexts on GPU(s) "
                        f"{figures[mode]['other_gpu_contexts']}, not only on {check.device}"
                    )
        finally:
            os.environ.pop("TORCHFERRY_READ", None)
    raw = sequential_read([str(path)], direct=True)
    hidden = None
    with torchferry.offload(
        _empty(gpu_check, size, check.dtype), device=check.device, strategy="layerwise", checkpoint=str(path)
    ) as plain:
        pipe_plain = plain.pipeline

        def run_plain() -> torch.Tensor:
            with torch.no_grad():
                out: torch.Tensor = pipe_plain(*inputs)
            return out

        host_stats, _ = gpu_check.time_steps(run_plain, size, check.device)
    direct = figures["direct"]
    read_s = direct["read_bytes_per_step"] / raw.bytes_per_s
    if read_s > 0:
        hidden = max(0.0, min(1.0, 1 - (direct["min_s"] - host_stats.min) / read_s))
    figures.update(
        identical=all(figures[m]["identical"] for m in ("direct", "buffered")),
        median_s=direct["median_s"],
        host_tier_min_s=host_stats.min,
        achieved_read_bytes_per_s=direct["read_bytes_per_step"] / direct["min_s"]
        if direct["min_s"]
        else None,
        raw_direct_read_bytes_per_s=raw.bytes_per_s,
        achieved_h2d_bytes_per_s=direct["achieved_h2d_bytes_per_s"],
        read_hidden_fraction=hidden,
    )
    for p in folder.iterdir():
        p.unlink()
    folder.rmdir()
    return figures


def _least_budget(pipe: Any, start: int) -> int:
    """The first budget from ``start`` up (in steps of an eighth) that the file tier can meet."""
    topo = topology.discover(pipe)
    budget = start
    while True:
        plan = topology.resolve(topo, topology.OffloadConfig(strategy="layerwise", host_memory_bytes=budget))
        try:
            policies.tiers(plan)
            return budget
        except torchferry.PlanError:
            budget += max(start // 8, 1 << 20)


def _empty(gpu_check: Any, size: Any, dtype: torch.dtype) -> Any:
    from torchferry.runtime import meta_parameters

    with meta_parameters():
        return gpu_check.Pipe(gpu_check.DiT(size, device=torch.device("cpu"), dtype=dtype)).eval()


# ------------------------------------------------------------------------------------------ main
def render(result: dict[str, Any]) -> str:
    m = result["memory"]
    gb = lambda x: f"{x / 1e9:.2f}"  # noqa: E731
    lines = [
        f"memory: checkpoint {fmt_bytes(result['checkpoint_bytes'])}, host budget "
        f"{fmt_bytes(result['budget'])} ({result['checkpoint_bytes'] / result['budget']:.1f}x), "
        f"{result['file_packs']} packs in the file tier; anonymous RSS grew {_mmm(m['grown'], fmt_bytes)} "
        f"(min/median/max of {len(m['runs'])} runs); overhead beyond the host buffers and device slots "
        f"{_mmm(m['overhead'], fmt_bytes)} (bound {fmt_bytes(OVERHEAD_BOUND)}); "
        f"outputs identical: {all(r['identical'] for r in m['runs'])}"
    ]
    rows = [
        [mode, _mmm(t["raw"], gb), _mmm(t["tier"], gb), f"{t['share_median']:.0%}", f"{t['share_min']:.0%}"]
        for mode, t in result["throughput"].items()
    ]
    headers = ["read", "raw GB/s min/med/max", "file tier GB/s min/med/max", "share (medians)", "(mins)"]
    lines.append(common.table(headers, rows))
    o = result["overlap"]
    lines.append(
        f"overlap: compute (host tier) {o['compute']['min_s'] * 1e3:.1f} ms, read {o['read_s'] * 1e3:.1f} ms "
        f"({fmt_bytes(o['read_bytes'])} at {o['read_bytes_per_s'] / 1e9:.2f} GB/s), file tier "
        f"{o['file_tier']['min_s'] * 1e3:.1f} ms (min; median {o['file_tier']['median_s'] * 1e3:.1f} ms) = "
        f"{o['ratio']:.2f} x max(compute, read); simulated {o['predicted_s'] * 1e3:.1f} ms "
        f"({o['prediction_error'] * 100:+.1f}%)"
    )
    return "\n".join(lines)


def verdict(result: dict[str, Any]) -> list[str]:
    problems = []
    m = result["memory"]
    if not m["ok"]:
        problems.append(f"memory: grew {fmt_bytes(m['grown']['max'])} over the bound {fmt_bytes(m['bound'])}")
    for mode, t in result["throughput"].items():
        if t["share_median"] < READ_SHARE:
            problems.append(f"{mode} reads: file tier at {t['share_median']:.0%} of the raw read (median)")
    o = result["overlap"]
    if not o["ok_overlap"]:
        problems.append(f"overlap: file tier step {o['ratio']:.2f} x max(compute, read)")
    if not o["ok_prediction"]:
        problems.append(f"prediction off by {o['prediction_error'] * 100:+.1f}%")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small toy, two repeats (for CI)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats of each measurement")
    parser.add_argument("--out", default=None, help="where the JSON goes (default benchmarks/results)")
    parser.add_argument("--child", nargs=2, metavar=("CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--host-memory", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.checkpoint, args.out = args.child
        return child(args)
    common.pin_threads(1)
    shape = QUICK if args.quick else FULL
    repeats = args.repeats or (2 if args.quick else 5)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="torchferry-host-tier-") as scratch:
        ref = toy.build(0, hidden=shape["hidden"], blocks=shape["blocks"])
        checkpoint = Path(scratch) / "toy.safetensors"
        toy.save_checkpoint(ref, checkpoint)
        with torch.no_grad():
            want = ref(PROMPT, steps=shape["steps"])
        del ref
        size = checkpoint.stat().st_size
        budget = int(size / RATIO)
        plan = topology.resolve(
            topology.discover(toy.build_empty(hidden=shape["hidden"], blocks=shape["blocks"])),
            topology.OffloadConfig(strategy="layerwise", host_memory_bytes=budget),
        )
        tiers = policies.tiers(plan)
        result: dict[str, Any] = {
            "machine": common.machine(),
            "shape": shape,
            "checkpoint_bytes": size,
            "budget": budget,
            "file_packs": len(tiers.file),
            "host_bytes": tiers.host_bytes,
            "memory": memory(checkpoint, shape, budget, want, repeats),
            "throughput": throughput(checkpoint, shape, budget, repeats),
            "overlap": overlap(checkpoint, shape, budget, repeats),
        }
    result["seconds"] = time.perf_counter() - start
    result["load_average"] = os.getloadavg()
    print(render(result))
    problems = verdict(result)
    load = ", ".join(f"{x:.1f}" for x in result["load_average"])
    print(f"\n{result['seconds']:.0f} s, load average {load}")
    print(f"file tier within its targets: {'yes' if not problems else 'NO'}")
    for p in problems:
        print(f"  {p}")
    out = write_json(
        os.path.join(args.out or str(RESULTS), "host_tier.json"), {**result, "problems": problems}
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
