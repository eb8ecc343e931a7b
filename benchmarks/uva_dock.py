"""Could a CUDA session dock its packs as a CPU session does? The experiment behind issue 40's last lever.

A CUDA session moves a streamed block by re-pointing each of its tensors at the block's slot at the
block's wait, and back at its host copy at its evict (`Pack.point`: the 27 tensors of a Wan block,
twice a step), because a CPU tensor cannot read device memory. A CPU session exchanges one storage per
move instead ([Note: docking] in ``torchferry/runtime/memory/_pack.py``), for a fraction of the host
time. With unified addressing a CUDA tensor can view pinned host memory: were each streamed tensor a
CUDA tensor over its host buffer between uses, a CUDA move could be one storage exchange too. This
script measures what that would give and what it would cost, on a stack of blocks of 27 tensors (13
linear layers and a scale), their host buffers allocated and pinned as the host store's are
(`HostMemory`; ``cudaHostRegister`` on CUDA), streamed through a ring of two slots on one stream:

- the host time of a block's two moves, re-pointed and docked: bare (a warm loop over one block) and
  in place (the least host time to issue a forward, less the resident model's, forms alternating
  round by round; on CUDA the copies are queued, so this holds the moves, the two hooks that make
  them and the copy's issue, the same in both forms but for the moves);
- bit identity of a forward each way with the resident model's;
- what reads of a weight between steps give when it is a CUDA tensor over host memory (``.cpu()``, a
  device copy from it, a kernel's sum of its bits) against its host bytes, each read's error kept if
  it raises, and how fast each reads a large buffer, beside a device buffer and a pinned
  host-to-device copy; and the device's two attributes that decide whether it can (unified
  addressing, and the host pointer usable for registered memory). A run on pageable memory (pinning
  refused) stops before the reads, whose answer would not hold for the host store.

On CUDA the measuring runs in a child process, so a sticky CUDA error (an illegal address, were the
device unable to read registered memory through the host pointer) cannot end the caller's CUDA
context; gpu_check's ``uva dock`` row runs it so. On the CPU the same logic runs in process (the
"mapped" storage is a second storage over the host buffer, which is what a CPU session docks), as the
smoke test CI runs.

    python benchmarks/uva_dock.py [--cpu] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import _common as common  # first: puts the repository root on sys.path
import torch
from torch import nn

from torchferry.runtime.machine._probe import _best_seconds, _sync
from torchferry.runtime.memory._pack import _FOREIGN as FOREIGN
from torchferry.runtime.memory._pack import _SET_DATA as SET_DATA
from torchferry.runtime.memory._pack import SWAP, _consume
from torchferry.runtime.memory._pinning import CudaPinner, HostMemory, _loaded

#: Linear layers per block: 13 weights, 13 biases and a scale make the 27 tensors of a Wan block.
LINEARS = 13
#: Each tensor's offset in its block's buffer, as the host store aligns them.
ALIGN = 256
#: (blocks, hidden, tokens, rounds, bare loop repeats, MiB read by the throughput figures)
SIZES = {
    ("cuda", False): (24, 256, 16, 30, 2000, 256),
    ("cuda", True): (8, 128, 8, 8, 300, 32),
    ("cpu", False): (24, 64, 8, 20, 2000, 16),
    ("cpu", True): (6, 32, 4, 4, 200, 2),
}


class Block(nn.Module):
    """13 linear layers, each followed by a tanh, and a scale: 27 tensors."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(LINEARS))
        self.scale = nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear in self.linears:
            x = torch.tanh(linear(x))
        return x * self.scale


def stack(blocks: int, hidden: int, seed: int = 0) -> nn.Sequential:
    """``blocks`` blocks, weights a function of ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(*(Block(hidden) for _ in range(blocks))).eval()


def layout(block: nn.Module) -> tuple[list[int], int]:
    """Each parameter's offset in its block's buffer (``ALIGN``-aligned), and the buffer's size."""
    offsets, at = [], 0
    for p in block.parameters():
        offsets.append(at)
        at += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
    return offsets, at


def views(flat: torch.Tensor, block: nn.Module, offsets: list[int]) -> list[torch.Tensor]:
    """Views of ``flat`` (bytes) shaped as ``block``'s parameters, at ``offsets``."""
    return [
        flat.narrow(0, at, p.numel() * p.element_size()).view(p.dtype).view(p.shape)
        for p, at in zip(block.parameters(), offsets, strict=True)
    ]


def over(storage: torch.UntypedStorage, device: torch.device, nbytes: int) -> torch.Tensor:
    """A flat byte tensor on ``device`` over ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))


class Streamed:
    """``model``'s blocks streamed through a ring of two slots on the current stream: at each block's
    forward pre hook its host buffer is copied into its slot (queued, from pinned memory on CUDA) and
    the block moves there; at its forward hook it moves back. ``docked``: its tensors view one storage
    over the host buffer (a CUDA storage over the host pointer on CUDA), exchanged with a storage over
    the slot at each move; else each tensor is re-pointed, host views to slot views and back, as a
    CUDA session moves a block now. On one stream every copy into a slot is queued after the kernels
    of the block that used the slot before, so no event is needed."""

    def __init__(self, model: nn.Sequential, device: torch.device, memory: HostMemory, docked: bool) -> None:
        blocks = list(model)
        offsets, nbytes = layout(blocks[0])
        self.nbytes = nbytes
        self.slots = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.slot_storages = [FOREIGN(s.data_ptr(), device, nbytes) for s in self.slots]
        self.slot_views = [views(s, blocks[0], offsets) for s in self.slots]
        self.hosts: list[torch.Tensor] = []
        self.host_views: list[list[torch.Tensor]] = []
        self.mapped: list[torch.UntypedStorage] = []
        self.handles: list[Any] = []
        for i, block in enumerate(blocks):
            host = memory.alloc(f"{'docked' if docked else 'repointed'} {i}", nbytes)
            host_views = views(host, block, offsets)
            params = list(block.parameters())
            with torch.no_grad():
                for v, p in zip(host_views, params, strict=True):
                    v.copy_(p.detach().to("cpu"))
            if docked:
                mapped = FOREIGN(host.data_ptr(), device, nbytes)
                for p, v in zip(params, views(over(mapped, device, nbytes), block, offsets), strict=True):
                    p.data = v
                self.mapped.append(mapped)
            else:
                _consume(map(SET_DATA, params, host_views))
            self.hosts.append(host)
            self.host_views.append(host_views)
            self.handles += self._hooks(i, block, params, docked)

    def _hooks(self, i: int, block: nn.Module, params: list[nn.Parameter], docked: bool) -> list[Any]:
        slot, host = self.slots[i % 2], self.hosts[i]
        if docked:
            mapped, at_slot = self.mapped[i], self.slot_storages[i % 2]

            def dock(module: nn.Module, args: Any) -> None:
                slot.copy_(host, non_blocking=True)
                SWAP(mapped, at_slot)

            def undock(module: nn.Module, args: Any, out: Any) -> None:
                SWAP(mapped, at_slot)

            return [block.register_forward_pre_hook(dock), block.register_forward_hook(undock)]
        slot_views, host_views = self.slot_views[i % 2], self.host_views[i]

        def point(module: nn.Module, args: Any) -> None:
            slot.copy_(host, non_blocking=True)
            _consume(map(SET_DATA, params, slot_views))

        def back(module: nn.Module, args: Any, out: Any) -> None:
            _consume(map(SET_DATA, params, host_views))

        return [block.register_forward_pre_hook(point), block.register_forward_hook(back)]


def probed(streamed: Streamed, model: nn.Sequential) -> tuple[list[Any], list[bool]]:
    """Forward pre hooks on ``model``'s blocks, run after ``streamed``'s: whether every weight a block
    runs with is inside its slot (bytes read from host memory would give the same output, so the
    output alone cannot tell that a move happened). Their handles, and a list each call appends to."""
    seen: list[bool] = []
    handles = []
    for i, block in enumerate(model):
        low = streamed.slots[i % 2].data_ptr()

        def check(module: nn.Module, args: Any, low: int = low) -> None:
            seen.append(all(low <= p.data_ptr() < low + streamed.nbytes for p in module.parameters()))

        handles.append(block.register_forward_pre_hook(check))
    return handles, seen


def _bits(t: torch.Tensor) -> int:
    """The sum of ``t``'s 32-bit words as integers, computed where ``t`` is (order does not matter)."""
    return int(t.contiguous().view(torch.int32).to(torch.int64).sum().item())


def bare(streamed: Streamed, block: nn.Module, repeats: int, docked: bool) -> float:
    """Seconds for block 0's two moves (there and back), in a warm loop, per block."""
    params = list(block.parameters())
    mapped = streamed.mapped[0] if docked else None
    at_slot, slot_views, host_views = (
        streamed.slot_storages[0],
        streamed.slot_views[0],
        streamed.host_views[0],
    )
    began = time.perf_counter()
    if mapped is not None:
        for _ in range(repeats):
            SWAP(mapped, at_slot)
            SWAP(mapped, at_slot)
    else:
        for _ in range(repeats):
            _consume(map(SET_DATA, params, slot_views))
            _consume(map(SET_DATA, params, host_views))
    return (time.perf_counter() - began) / repeats


#: The reads of a docked weight between forwards, copies first: a kernel that faults on host memory
#: ends the process's CUDA context, a copy refused for its kind raises and leaves it working.
READS = (".cpu()", "device copy", "kernel sum")


def read(how: str, p: torch.Tensor, host: torch.Tensor, device: torch.device) -> bool:
    """Whether weight ``p`` read ``how`` gives the bits of its host bytes ``host``."""
    if how == "kernel sum":
        return p.device == device and _bits(p.detach()) == _bits(host)
    got = p.detach().cpu() if how == ".cpu()" else torch.empty_like(p, device=device).copy_(p.detach()).cpu()
    return torch.equal(got.view(torch.int32), host.view(torch.int32))


def reads(
    streamed: Streamed,
    block: nn.Module,
    device: torch.device,
    found: dict[str, Any],
    save: Callable[[], object],
) -> None:
    """Block 0's weights between forwards (CUDA tensors over host memory, docked on CUDA), read each
    way in `READS`, into ``found``: whether every weight gave its host bytes, or the error the read
    raised; ``save`` after each."""
    for how in READS:
        try:
            found[how] = all(
                read(how, p, host, device)
                for p, host in zip(block.parameters(), streamed.host_views[0], strict=True)
            )
        except Exception as exc:
            found[how] = f"{type(exc).__name__}: {exc}"
        save()


def throughput(
    device: torch.device, memory: HostMemory, mib: int, found: dict[str, Any], save: Callable[[], object]
) -> None:
    """Bytes per second to read ``mib`` MiB, into ``found`` (or the error each raised): a kernel over
    device memory and over host memory viewed as a device tensor, a copy from that view to the CPU
    (into memory allocated before) and to the device, and a pinned host-to-device copy; ``save``
    after each."""
    nbytes = mib << 20
    host = memory.alloc("throughput", nbytes)
    try:
        host.fill_(1)
        mapped = over(FOREIGN(host.data_ptr(), device, nbytes), device, nbytes).view(torch.int32)
        on_device = torch.ones(nbytes // 4, dtype=torch.int32, device=device)
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        on_cpu = torch.empty(nbytes // 4, dtype=torch.int32)
        forms: dict[str, Callable[[], object]] = {
            "pinned host-to-device copy": lambda: target.copy_(host, non_blocking=True),
            "kernel over device memory": on_device.sum,
            "copy to the CPU from host memory": lambda: on_cpu.copy_(mapped),
            "device copy from host memory": lambda: target.view(torch.int32).copy_(mapped),
            "kernel over host memory": mapped.sum,  # (last: see `READS`)
        }
        for name, fn in forms.items():
            try:
                found[name] = nbytes / _best_seconds(device, fn, 3)
            except Exception as exc:
                found[name] = f"{type(exc).__name__}: {exc}"
            save()
    finally:
        memory.release("throughput")


def attributes(device: torch.device) -> dict[str, int | None]:
    """What decides whether a device reads registered host memory at its host address: unified
    addressing, and "can use the host pointer for registered memory" (the CUDA runtime's
    ``cudaDeviceGetAttribute`` 41 and 91), from the ``libcudart`` torch loaded; ``None`` where unknown."""
    found: dict[str, int | None] = {"unified_addressing": None, "host_pointer_for_registered_memory": None}
    for path in _loaded("libcudart.so"):
        try:
            get = ctypes.CDLL(path).cudaDeviceGetAttribute
        except (OSError, AttributeError):
            continue
        for name, attribute in (("unified_addressing", 41), ("host_pointer_for_registered_memory", 91)):
            value = ctypes.c_int(-1)
            if get(ctypes.byref(value), attribute, device.index or 0) == 0:
                found[name] = value.value
        break
    return found


def measure(
    device: torch.device, *, quick: bool = False, save: Callable[[dict[str, Any]], object] | None = None
) -> dict[str, Any]:
    """The experiment on ``device``, in this process (see the module's docstring). ``save`` gets the
    result so far after each phase (the forwards and their timing, the reads between forwards, the
    read rates), so a phase that ends the process leaves what came before it."""
    if SWAP is None or FOREIGN is None:
        raise RuntimeError(f"torch {torch.__version__} has no storage exchange or foreign storage")
    blocks, hidden, tokens, rounds, repeats, mib = SIZES[device.type, quick]
    cuda = device.type == "cuda"
    if cuda and device.index is None:  # (a storage over a pointer names its device whole)
        device = torch.device("cuda", torch.cuda.current_device())
    memory = HostMemory(CudaPinner() if cuda else None)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).to(device)
    forms: dict[str, nn.Sequential] = {"resident": stack(blocks, hidden).to(device)}
    streamed: dict[str, Streamed] = {}
    for name, docked in (("re-pointed", False), ("docked", True)):
        forms[name] = stack(blocks, hidden)
        streamed[name] = Streamed(forms[name], device, memory, docked)
    if cuda and not memory.pinned:  # (pageable memory would answer another question)
        raise RuntimeError(f"the host buffers could not be pinned: {memory.failure}")
    result: dict[str, Any] = {
        "device": str(device),
        "blocks": blocks,
        "tensors_per_block": 2 * LINEARS + 1,
        "block_bytes": streamed["docked"].nbytes,
        "pinned": memory.pinned,
        "device_attributes": attributes(device) if cuda else {},
    }
    with torch.no_grad():
        want = forms["resident"](x).cpu()
        result["bit_identical"], result["in_slot"] = {}, {}
        for name, moved in streamed.items():
            handles, seen = probed(moved, forms[name])
            result["bit_identical"][name] = torch.equal(forms[name](x).cpu(), want)
            result["in_slot"][name] = len(seen) == blocks and all(seen)
            for handle in handles:
                handle.remove()
        enqueue: dict[str, list[float]] = {name: [] for name in forms}
        for r in range(rounds):
            for name in forms if r % 2 == 0 else reversed(forms):
                _sync(device)
                began = time.perf_counter()
                forms[name](x)
                enqueue[name].append(time.perf_counter() - began)
                _sync(device)
        for name in streamed:
            result["bit_identical"][name] &= torch.equal(forms[name](x).cpu(), want)
    least = {name: min(samples) for name, samples in enqueue.items()}
    result["enqueue_per_block_us"] = {
        name: asdict(common.Stats.of([s / blocks * 1e6 for s in samples]))
        for name, samples in enqueue.items()
    }
    result["in_place_per_block_us"] = {
        name: (least[name] - least["resident"]) / blocks * 1e6 for name in streamed
    }
    result["bare_moves_per_block_us"] = {
        name: bare(streamed[name], forms[name][0], repeats, name == "docked") * 1e6 for name in streamed
    }

    def saving() -> None:
        if save is not None:
            save(result)

    saving()
    docked_block = forms["docked"][0]
    result["weights_between_forwards"] = {"device": str(next(docked_block.parameters()).device), "read": {}}
    reads(streamed["docked"], docked_block, device, result["weights_between_forwards"]["read"], saving)
    result["read_bytes_per_s"] = {}
    throughput(device, memory, mib, result["read_bytes_per_s"], saving)
    return result


def _said(ok: bool | str) -> str:
    return ("right" if ok else "WRONG") if isinstance(ok, bool) else f"FAILED ({ok})"


def _rate(rate: float | str) -> str:
    return f"{rate / 1e9:.2f} GB/s" if isinstance(rate, float) else f"FAILED ({rate})"


def report(result: dict[str, Any]) -> str:
    """The result as a table and a few lines (as far as it got)."""
    if "bare_moves_per_block_us" not in result:
        why = result.get("failed", "nothing measured")
        return f"uva_dock on {result.get('device', '?')}: no figures ({why})"
    rows = [
        [
            name,
            f"{result['bare_moves_per_block_us'][name]:.2f}",
            f"{result['in_place_per_block_us'][name]:.2f}",
            "yes" if result["bit_identical"][name] else "NO",
            "yes" if result["in_slot"][name] else "NO",
        ]
        for name in ("re-pointed", "docked")
    ]
    between = result.get("weights_between_forwards", {"device": "?", "read": {}})
    lines = [
        f"uva_dock on {result['device']}: {result['blocks']} blocks of {result['tensors_per_block']} tensors "
        f"({common.fmt_bytes(result['block_bytes'])}), host buffers pinned: {result['pinned']}",
        common.table(
            [
                "a block's two moves",
                "bare us/block",
                "in place us/block over resident",
                "bit-identical",
                "read from its slot",
            ],
            rows,
        ),
        f"weights between forwards, docked: device {between['device']}; read "
        + (", ".join(f"{how} {_said(ok)}" for how, ok in between["read"].items()) or "not reached"),
        "reads: "
        + (
            ", ".join(f"{how} {_rate(rate)}" for how, rate in result.get("read_bytes_per_s", {}).items())
            or "not reached"
        ),
    ]
    if result["device"] == "cpu":
        lines.append(
            "(on the CPU copies and compute are synchronous and a slot's bytes are warm from their copy, so "
            "in place figures hold the copy and can fall below resident; the figures that matter are CUDA's)"
        )
    if "failed" in result:
        lines.append(f"FAILED after that: {result['failed']}")
    return "\n".join(lines)


def isolated(
    device: torch.device, *, quick: bool, out: Path, timeout: float, child: bool | None = None
) -> dict[str, Any]:
    """`measure` on ``device``: in a child process on CUDA, or where ``child`` says so (its JSON at
    ``out``, written after each phase), in this one elsewhere. A child that failed leaves what it
    measured before, and ``failed``: why, with the last lines it printed."""
    if not (device.type == "cuda" if child is None else child):
        return measure(device, quick=quick)
    out.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--out", str(out)]
    command += (["--quick"] if quick else []) + ([] if device.type == "cuda" else ["--cpu"])
    failed: str | None = None
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-12:]
            failed = f"the child exited with {done.returncode}: " + " | ".join(tail)
    except subprocess.TimeoutExpired:
        failed = f"the child ran past {timeout:g} s"
    found: dict[str, Any] = {"device": str(device)}
    try:
        found = json.loads(out.read_text())
    except FileNotFoundError:
        pass
    except json.JSONDecodeError:  # (cut off mid-write by the timeout)
        failed = f"{failed}; its JSON was cut off" if failed else "its JSON was cut off"
    found.pop("machine", None)
    if failed is not None:
        found["failed"] = failed
    return found


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is present")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--out", type=Path, default=common.RESULTS / "uva_dock.json", help="the JSON file")
    parser.add_argument("--child", action="store_true", help="measure in this process (CUDA's child)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _arguments(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda") if cuda else torch.device("cpu")
    if not cuda:
        common.pin_threads(1)
    if args.child or not cuda:
        result = measure(device, quick=args.quick, save=lambda found: common.write_json(args.out, found))
    else:
        result = isolated(device, quick=args.quick, out=args.out, timeout=300)
        common.write_json(args.out, result)
    print(report(result))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
