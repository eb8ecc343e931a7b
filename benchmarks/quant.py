"""One transfer-bound schedule over the same model at full width and at 8 bits, side by side.

The model is a diffusers ``WanTransformer3DModel`` with wide blocks and few tokens, so moving a
block's weights takes longer than computing it (transfer-bound). Its compute dtype is float32 on the
CPU and bfloat16 on CUDA. It runs under ``torchferry.offload(strategy="layerwise",
prefetch_depth=1)`` in each form:

- ``full``: the model as built;
- ``float8 storage``: ``storage_dtype=torch.float8_e4m3fn``, torchferry's own layerwise casting;
- ``torchao int8``: ``quantize_(model, Int8WeightOnlyConfig())``;
- ``torchao float8``: ``quantize_(model, Float8WeightOnlyConfig())`` (CUDA needs compute
  capability 8.9 or newer);
- ``quanto qint8``: ``quantize(model, weights=qint8); freeze(model)``;
- ``gguf Q8_0``, ``gguf Q4_K``: the model written as a GGUF file and opened with
  ``torchferry.from_single_file`` under a host budget of 80% of the file, so the file tier reads
  packs from the ``.gguf`` (``benchmarks/_gguf_forms.py``; its JSON adds the file tier's reads per step).

Each form runs on its own copy of the model, with its own session, and the forms are timed
round-robin in one run, so machine noise falls on all of them alike. Each form's output under the
session is checked against the same form run without torchferry (``torch.equal``).

For each form the script reports:

- the bytes the session copied to the device per step (counted at the copies) and the bytes of its
  host store;
- the step time (min, median and max, one transformer forward);
- the cost of re-pointing a block: its inner tensors at a slot and back, measured on a CPU
  session;
- the impl exchange of its wrapper tensors on a device session ([Note: wrapper tensors] in
  ``torchferry/runtime/memory/_wrappers.py``), as one wait plus one evict of a block.

On the CPU the "device" is host memory, so a copy is a memcpy. The quantized forms then pay their
CPU kernels (dequantizing at every matmul), which a GPU does not: on the CPU the bytes are the
figures to read, and ``gpu_check.py``'s ``quantized`` row gives the step times on a GPU.

On the CPU a second table (``quant_files.py``) reads the same transformer, with 16 blocks
(``--file-blocks``), from checkpoint folders diffusers saved (full, torchao int8, quanto qint8)
through ``torchferry.from_pretrained``, with a host budget for three blocks beside the file tier's
buffers, so most blocks stay in the files: the bytes the file tier reads per step are the quantized
bytes. The
script prints the tables and writes ``benchmarks/results/quant.json``.

    python benchmarks/quant.py [--repeats 10] [--blocks 8] [--threads 1] [--quick] [--no-files]
"""

from __future__ import annotations

import argparse
import importlib
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import _common as common  # first: puts the repository root on sys.path
import _gguf_forms
import quant_files
import torch

import torchferry

#: Wide blocks, few tokens: a block's bytes dwarf its compute (hidden 512 on the CPU, 2048 on CUDA).
CPU_SIZE = {"heads": 4, "head_dim": 128, "ffn": 2048, "blocks": 8}
GPU_SIZE = {"heads": 16, "head_dim": 128, "ffn": 8192, "blocks": 8}
QUICK_SIZE = {"heads": 2, "head_dim": 32, "ffn": 128, "blocks": 3}


def build(size: dict[str, int], dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The Wan transformer of ``size``, its weights a function of ``seed``, in ``dtype``."""
    wan: Any = importlib.import_module("diffusers").WanTransformer3DModel
    torch.manual_seed(seed)
    model: torch.nn.Module = wan(
        patch_size=(1, 2, 2),
        num_attention_heads=size["heads"],
        attention_head_dim=size["head_dim"],
        in_channels=4,
        out_channels=4,
        text_dim=64,
        freq_dim=64,
        ffn_dim=size["ffn"],
        num_layers=size["blocks"],
        rope_max_seq_len=32,
    )
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def inputs(device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Latents of 8 tokens after patching (1 x 4 x 2 x 4 x 4), a timestep, 4 text tokens."""
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 4, 2, 4, 4, generator=g).to(device, dtype),
        "timestep": torch.tensor([500], device=device),
        "encoder_hidden_states": torch.randn(1, 4, 64, generator=g).to(device, dtype),
    }


def _int8(model: torch.nn.Module) -> dict[str, Any]:
    q = importlib.import_module("torchao.quantization")
    q.quantize_(model, q.Int8WeightOnlyConfig())
    return {}


def _float8(model: torch.nn.Module) -> dict[str, Any]:
    q = importlib.import_module("torchao.quantization")
    q.quantize_(model, q.Float8WeightOnlyConfig())
    return {}


def _quanto(model: torch.nn.Module) -> dict[str, Any]:
    q = importlib.import_module("optimum.quanto")
    q.quantize(model, weights=q.qint8)
    q.freeze(model)
    return {}


#: Each form: what it does to the model, returning the extra ``offload`` options it needs.
FORMS: dict[str, Callable[[torch.nn.Module], dict[str, Any]]] = {
    "full": lambda m: {},
    "float8 storage": lambda m: {"storage_dtype": torch.float8_e4m3fn},
    "torchao int8": _int8,
    "torchao float8": _float8,
    "quanto qint8": _quanto,
}


@contextmanager
def _counted(session: Any) -> Iterator[list[int]]:
    """Count the bytes ``session`` copies host-to-device (``copy_in``), per step run meanwhile."""
    moved: list[int] = [0]
    streams = session.engine.streams
    copy_in = streams.copy_in

    def counting(dst: Any, dst_bytes: torch.Tensor, src: torch.Tensor) -> None:
        moved[0] += src.numel()
        copy_in(dst, dst_bytes, src)

    streams.copy_in = counting
    try:
        yield moved
    finally:
        del streams.copy_in


def _middle_pack(session: Any) -> Any:
    """The host pack of the model's middle block."""
    blocks = session.plan.topology.component("").blocks
    return session.engine.store.packs[blocks[len(blocks) // 2].path]


def _repoint_us(session: Any, repeats: int = 200) -> float:
    """Microseconds to point one streamed block's tensors at a slot and back (``Pack.point`` twice)."""
    pack = _middle_pack(session)
    slot = torch.empty(pack.nbytes, dtype=torch.uint8)
    views = tuple(piece.view(slot) for piece in pack.pieces)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            pack.point(views)
            pack.point(pack.host_views)
        samples.append((time.perf_counter() - start) / repeats)
    return min(samples) * 1e6


def _exchange_us(session: Any, repeats: int = 200) -> tuple[float, int]:
    """Microseconds of the impl exchanges of one block's wrapper tensors for one wait and one evict on
    a device session, and how many wrappers the block has (0 and 0 for plain tensors).

    `Wrapper.follow` is timed alone (its inner tensors stay where they are): the exchange is the same
    whatever the device, and re-pointing the inner tensors is `_repoint_us`."""
    wrappers = _middle_pack(session).wrappers
    if not wrappers:
        return 0.0, 0
    here, there = torch.device("cpu"), torch.device("meta")
    for w in wrappers:  # the twin is built at the first move; time the moves after it
        w.follow(there)
        w.follow(here)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            for w in wrappers:
                w.follow(there)
            for w in wrappers:
                w.follow(here)
        samples.append((time.perf_counter() - start) / repeats)
    for w in wrappers:  # the twin was built over host tensors: the session builds its own when it needs one
        w.twin, w.twin_device = None, None
    return min(samples) * 1e6, len(wrappers)


def compare(
    device: torch.device, *, quick: bool = False, repeats: int = 10, blocks: int | None = None
) -> dict[str, Any]:
    """Every form under one layerwise (depth 1) schedule on ``device``: bytes, times, identity.

    Returns ``{"size", "dtype", "forms": {name: figures}}``; a form that cannot run here (a package
    missing, float8 kernels on an older GPU) has ``skipped`` and why.
    """
    importlib.import_module("diffusers").utils.logging.set_verbosity_error()  # its float32-modules note
    cuda = device.type == "cuda"
    size = dict(QUICK_SIZE if quick else GPU_SIZE if cuda else CPU_SIZE)
    if blocks is not None:
        size["blocks"] = blocks
    dtype = torch.bfloat16 if cuda else torch.float32
    x = inputs(device, dtype)
    forms: dict[str, dict[str, Any]] = {}
    calls: dict[str, Callable[[], object]] = {}
    with ExitStack() as stack, warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        for name, apply in FORMS.items():
            try:
                model = build(size, dtype)
                options = apply(model)
                reference = _plain(model, x, device, options, size)
            except Exception as exc:  # a package missing, kernels this device lacks
                forms[name] = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            session = stack.enter_context(
                torchferry.offload(model, strategy="layerwise", prefetch_depth=1, device=device, **options)
            )
            moved = stack.enter_context(_counted(session))
            out = _forward(model, x, device)
            before = moved[0]
            again = _forward(model, x, device)
            exchange, wrappers = _exchange_us(session)
            forms[name] = {
                "identical": bool(torch.equal(out, reference) and torch.equal(again, reference)),
                "bytes_per_step": moved[0] - before,
                "host_bytes": session.host_bytes,
                "block_bytes": session.plan.topology.component("").blocks[0].nbytes,
                "repoint_us_per_block": _repoint_us(session),
                "exchange_us_per_block": exchange,
                "wrappers_per_block": wrappers,
            }
            calls[name] = _stepper(model, x, device)
        _gguf_forms.add(
            forms, calls, stack, model=lambda: build(size, torch.float32), dtype=dtype, device=device,
            forward=lambda m: _forward(m, x, device), counted=_counted,
        )  # fmt: skip
        if calls:
            timed = common.round_robin(calls, repeats, warmup=1)
            for name, stats in timed.items():
                forms[name]["step"] = stats.to_json()
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "device": str(device), "forms": forms}


def _forward(model: torch.nn.Module, x: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(**x, return_dict=False)[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out.cpu()


def _plain(
    model: torch.nn.Module,
    x: dict[str, torch.Tensor],
    device: torch.device,
    options: dict[str, Any],
    size: dict[str, int],
) -> torch.Tensor:
    """The form's output without torchferry, resident on ``device`` (for float8 storage: diffusers'
    layerwise casting of the same model, built again); the model is back on the CPU after."""
    if "storage_dtype" in options:
        dtype = next(model.parameters()).dtype
        model = build(size, dtype)
        model.enable_layerwise_casting(storage_dtype=options["storage_dtype"], compute_dtype=dtype)
    model.to(device)
    try:
        return _forward(model, x, device)
    finally:
        model.to("cpu")


def _stepper(
    model: torch.nn.Module, x: dict[str, torch.Tensor], device: torch.device
) -> Callable[[], object]:
    def step() -> object:
        return _forward(model, x, device)

    return step


def report(result: dict[str, Any]) -> str:
    """The side-by-side table of `compare`'s result."""
    forms = result["forms"]
    full = forms.get("full", {}).get("bytes_per_step")
    rows = []
    for name, f in forms.items():
        if "skipped" in f:
            rows.append([name, "skipped", f["skipped"][:60], "-", "-", "-", "-", "-", "-"])
            continue
        step = f["step"]
        share = f"{f['bytes_per_step'] / full:.2f}" if full else "-"
        rows.append(
            [
                name,
                f["identical"],
                common.fmt_bytes(f["bytes_per_step"]),
                share,
                common.fmt_bytes(f["host_bytes"]),
                f"{common.fmt_seconds(step['min_s'])} / {common.fmt_seconds(step['median_s'])} / "
                f"{common.fmt_seconds(step['max_s'])}",
                f"{f['repoint_us_per_block']:.1f}",
                f"{f['exchange_us_per_block']:.1f} ({f['wrappers_per_block']})",
            ]
        )
    headers = [
        "form",
        "identical",
        "moved/step",
        "x full",
        "host store",
        "step min / median / max",
        "re-point us/block",
        "exchange us/block (wrappers)",
    ]
    return common.table(headers, [r[: len(headers)] for r in rows])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds (after one warm-up round)")
    parser.add_argument("--blocks", type=int, help="blocks of the model (default 8)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (pinned)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--quick", action="store_true", help="a 3-block tiny model, 2 rounds: a smoke run")
    parser.add_argument("--no-files", action="store_true", help="skip the rows read from checkpoint folders")
    parser.add_argument("--file-blocks", type=int, help="blocks of the model read from folders (default 16)")
    parser.add_argument("--out", type=Path, default=common.RESULTS / "quant.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 2
    common.pin_threads(args.threads)
    load_before = common.load_average()
    result = compare(torch.device(args.device), quick=args.quick, repeats=args.repeats, blocks=args.blocks)
    if args.device == "cpu" and not args.no_files:
        size = dict(QUICK_SIZE if args.quick else CPU_SIZE)
        size["blocks"] = args.file_blocks or (size["blocks"] if args.quick else 16)
        x = inputs(torch.device("cpu"), torch.float32)
        result["files"] = quant_files.files(build(size, torch.float32), x, size["blocks"], args.repeats)
        result["files_blocks"] = size["blocks"]
    result["load_before"], result["load_after"] = load_before, common.load_average()
    size = result["size"]
    print(
        f"quant.py: WanTransformer3DModel, {size['blocks']} blocks, hidden "
        f"{size['heads'] * size['head_dim']}, ffn {size['ffn']}, {result['dtype']} on {result['device']}; "
        "layerwise depth 1; "
        f"{args.repeats} round-robin rounds; {common.fmt_load(load_before)} before, "
        f"{common.fmt_load(result['load_after'])} after"
    )
    print(report(result))
    if "files" in result:
        blocks = result["files_blocks"]
        print(f"read from checkpoint folders ({blocks} blocks; from_pretrained, host budget for 3 blocks):")
        print(quant_files.report(result["files"]))
    common.write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
