"""A child process for host-memory tests: open a toy pipeline from its checkpoint with the file tier,
run it while sampling anonymous RSS, and write the output and the figures for the parent.

    python tests/runtime/host_child.py CHECKPOINT OUT_DIR --hidden H --blocks N [--host-memory BYTES]

It prints nothing on success; the parent reads ``OUT_DIR/figures.json`` and ``OUT_DIR/out.pt``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import torchferry  # noqa: E402
from torchferry.testing import toy  # noqa: E402

PROMPT, STEPS = "a ferry at dawn", 2


def rss_anon() -> int:
    """Anonymous resident memory of this process, in bytes (Linux): RssAnon plus RssShmem, since the
    host store's buffers are shared anonymous mappings, which the kernel counts in RssShmem."""
    text = Path("/proc/self/status").read_text()
    found = re.findall(r"^Rss(?:Anon|Shmem):\s+(\d+) kB", text, re.MULTILINE)
    return sum(int(n) for n in found) * 1024


class Sampler(threading.Thread):
    """Samples RssAnon every millisecond until stopped; keeps the peak."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = rss_anon()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def stop(self) -> int:
        self._done.set()
        self.join()
        self.peak = max(self.peak, rss_anon())
        return self.peak


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--host-memory", type=int, default=None)
    parser.add_argument("--plain", action="store_true", help="load every weight into memory instead")
    parser.add_argument("--auto", action="store_true", help="offload(pipe, checkpoint=, device='cpu') alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    if args.plain:  # the ordinary way: the whole model in anonymous memory
        pipe = toy.load_checkpoint(toy.build(0, hidden=args.hidden, blocks=args.blocks), args.checkpoint)
        torch.save(pipe(PROMPT, steps=STEPS), out / "out.pt")
        return 0
    pipe = toy.build_empty(hidden=args.hidden, blocks=args.blocks)
    baseline = rss_anon()
    sampler = Sampler()
    sampler.start()
    options: dict[str, object] = {} if args.host_memory is None else {"host_memory": args.host_memory}
    if not args.auto:
        options["strategy"] = "layerwise"
    with torchferry.offload(pipe, device="cpu", checkpoint=args.checkpoint, **options) as session:
        opened = rss_anon()
        image = pipe(PROMPT, steps=STEPS)
        report = session.report()
    peak = sampler.stop()
    torch.save(image, out / "out.pt")
    figures = {
        "baseline_anon": baseline,
        "opened_anon": opened,
        "peak_anon": peak,
        "host_budget": report.host_budget,
        "host_budget_source": report.host_budget_source,
        "host_bytes": report.host_bytes,
        "peak_host_bytes": report.peak_host_bytes,
        "device_peak_bytes": session.peak_device_bytes,
        "file_packs": report.file_packs,
        "device_budget": report.budget,
        "device_budget_source": report.budget_source,
        "policy": report.policy,
        "file_read_bytes": report.file_read_bytes,
        "modes": sorted(set(session.engine.store.tier.reader.modes.values()))
        if session.engine.store.tier is not None
        else [],
    }
    (out / "figures.json").write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
