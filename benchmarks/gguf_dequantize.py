"""How fast diffusers' GGUF dequantize runs, per ggml type: the rates behind
`policies.DEQUANTIZE_VALUES_PER_S` (docs/quantized.md, GGUF).

For each type diffusers loads, a weight of ``--rows`` x ``--cols`` logical values (seeded random
blocks: the work does not depend on the values) is dequantized as ``GGUFLinear`` does it at every
call, ``dequantize_gguf_tensor(weight).to(torch.float32)``, ``--repeats`` times; the fastest call
gives the rate in logical values per second. It also prints the dtype the dequantize returns
(`policies.DEQUANTIZED_DTYPE`), the peak bytes per value alive inside the dequantize (every tensor
it makes, counted by a dispatch mode from its creation until its last reference dies, the packed
weight left out: `policies.DEQUANTIZE_PEAK_BYTES`, on a 64 x 1024 weight), and the tables' figures
beside the measured ones. On the CPU (the
default) with ``--threads`` threads; ``--device cuda`` times it on a GPU (synchronised).

    python benchmarks/gguf_dequantize.py                # the table's figures (256 x 4096, 1 thread)
    python benchmarks/gguf_dequantize.py --quick        # a smaller weight, a check that it runs
"""

from __future__ import annotations

import argparse
import time
import weakref
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchferry import policies


class _Live(TorchDispatchMode):
    """Counts the bytes of the storages the operations under it make, alive at once: their peak."""

    def __init__(self, known: torch.Tensor) -> None:
        super().__init__()
        self.known = known.untyped_storage().data_ptr()
        self.now = self.peak = 0
        self.refs: dict[int, list[int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == self.known or storage.nbytes() == 0:
                continue
            if key not in self.refs:
                self.refs[key] = [0, storage.nbytes()]
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            self.refs[key][0] += 1
            weakref.finalize(t, self._dead, key)
        return out

    def _dead(self, key: int) -> None:
        ref = self.refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            self.now -= ref[1]
            del self.refs[key]


def peak_bytes_per_value(rows: int = 64, cols: int = 1024) -> dict[str, float]:
    """Per type: the peak bytes per logical value alive inside ``dequantize_gguf_tensor``."""
    import gguf
    from diffusers.quantizers.gguf.utils import (
        SUPPORTED_GGUF_QUANT_TYPES,
        GGUFParameter,
        dequantize_gguf_tensor,
    )

    out: dict[str, float] = {}
    for kind in SUPPORTED_GGUF_QUANT_TYPES:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
        weight = GGUFParameter(torch.from_numpy(raw), quant_type=kind)
        live = _Live(weight)
        with live:
            made = dequantize_gguf_tensor(weight)
        del made
        out[kind.name] = live.peak / (rows * cols)
    return out


def measure(rows: int, cols: int, repeats: int, device: str) -> list[tuple[str, str, float]]:
    """(type, dequantized dtype, logical values per second) for each type diffusers loads."""
    import gguf
    from diffusers.quantizers.gguf.utils import (
        SUPPORTED_GGUF_QUANT_TYPES,
        GGUFParameter,
        dequantize_gguf_tensor,
    )

    out: list[tuple[str, str, float]] = []
    for kind in SUPPORTED_GGUF_QUANT_TYPES:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
        weight = GGUFParameter(torch.from_numpy(raw).to(device), quant_type=kind)
        made = dequantize_gguf_tensor(weight)
        best = float("inf")
        for _ in range(repeats):
            if device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            dequantize_gguf_tensor(weight).to(torch.float32)
            if device != "cpu":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        out.append((kind.name, str(made.dtype).removeprefix("torch."), rows * cols / best))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="a 32 x 512 weight, 2 calls")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, cols, repeats = (32, 512, 2) if args.quick else (args.rows, args.cols, args.repeats)
    print(
        f"dequantize_gguf_tensor(w).to(float32): {rows} x {cols} values, fastest of {repeats}, {args.device}"
    )
    peaks = peak_bytes_per_value()
    print(f"{'type':<8} {'dequantized':<12} {'measured':>14} {'table':>14} {'peak B/value':>13} {'table':>6}")
    for name, dtype, rate in measure(rows, cols, repeats, args.device):
        table = policies.DEQUANTIZE_VALUES_PER_S.get(name)
        shown = "-" if table is None else f"{table / 1e6:.0f} Mval/s"
        peak = policies.DEQUANTIZE_PEAK_BYTES.get(name)
        print(
            f"{name:<8} {dtype:<12} {rate / 1e6:>8.0f} Mval/s {shown:>14} {peaks[name]:>13.2f} "
            f"{'-' if peak is None else f'{peak:.2f}':>6}"
        )


if __name__ == "__main__":
    main()
