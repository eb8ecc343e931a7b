"""Time and peak host memory to get a ~1 GB safetensors checkpoint ready, torchferry vs ordinary loading.

Run ``python benchmarks/load.py`` (``--hidden``/``--layers`` change the model size). A bf16 model of
transformer-like blocks is saved as two shards plus an index (the layout diffusers writes) in a temp
folder; then each path runs in its own child process, which reports its wall time and its peak
resident set (``resource.getrusage(RUSAGE_SELF).ru_maxrss``, cross-checked with ``VmHWM``):

- ``torchferry``: the runtime path. The model is built under ``torchferry.meta_parameters()`` (its
  parameters take no memory) inside a one-DiT pipeline, and ``torchferry.offload(pipeline,
  checkpoint=<index>, checkpoint_prefix_map=...)`` validates the checkpoint and fills the session's
  host store (one packed buffer per block, read from mapped windows of the files), which every
  parameter then views.
- ``reader``: `CheckpointReader.read_into` alone into one packed buffer per block, no module (the
  floor the runtime path can reach).
- ``ordinary``: build the module, ``safetensors.torch.load_file`` every shard, ``load_state_dict``.
- ``ordinary-meta``: the careful variant: module on the meta device, ``load_state_dict(assign=True)``.
- ``diffusers``: ``ModelMixin.from_pretrained`` then ``enable_group_offload`` (block level, CPU
  onload since no accelerator is assumed), when diffusers is importable.

A second table loads a diffusers pipeline folder (a ``WanPipeline`` holding a bf16
``WanTransformer3DModel`` of about the same size, saved with ``save_pretrained`` in shards), when
diffusers is importable:

- ``from_pretrained``: ``torchferry.from_pretrained(WanPipeline, folder)``: the pipeline built on
  meta from the configs, its weights read straight from the files into the session's host store.
- ``pipe``: ``WanPipeline.from_pretrained(folder)`` alone (no offloading).
- ``pipe+offload``: ``WanPipeline.from_pretrained(folder)`` then ``torchferry.offload(pipe)``: the
  pipeline's own tensors and the host store are both alive while the store fills.

Each child then reads every byte once (``+touch``, a per-tensor word sum that must agree across
paths): safetensors returns tensors viewing a file mapping, so the meta and diffusers paths only page
their weights in then, and stay file-backed (not pinnable, evictable) where torchferry's buffers are
private memory in the runtime's packed layout.

The parent process imports nothing heavy, so its own memory cannot leak into a child's peak (Linux
folds the spawning process's high-water mark into ``ru_maxrss`` across ``vfork``+``exec``). Files
are read from the page cache (they were just written), so times measure copying, not the disk.
Results print as a table and are written to ``benchmarks/results/load.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

HERE = Path(__file__).resolve().parent
MODES = ("torchferry", "reader", "ordinary", "ordinary-meta", "diffusers")
FOLDER_MODES = ("from_pretrained", "pipe", "pipe+offload")
PIPELINE = "pipeline"
SHARDS = 2
WEIGHTS = "diffusion_pytorch_model"


# -- the model (only imported in children) -----------------------------------------------------------


def _model_classes(diffusers: bool = False) -> tuple[Any, Any]:
    """The block and model classes; with ``diffusers``, the model also gets diffusers' mixins.

    Only the diffusers child imports diffusers, so the other children's memory baseline is torch's.
    """
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            bf16 = torch.bfloat16
            self.norm1 = nn.LayerNorm(hidden, dtype=bf16)
            self.qkv = nn.Linear(hidden, 3 * hidden, dtype=bf16)
            self.out = nn.Linear(hidden, hidden, dtype=bf16)
            self.norm2 = nn.LayerNorm(hidden, dtype=bf16)
            self.fc1 = nn.Linear(hidden, 4 * hidden, dtype=bf16)
            self.fc2 = nn.Linear(4 * hidden, hidden, dtype=bf16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm1(x)
            q, k, v = self.qkv(h).chunk(3, dim=-1)
            attn = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
            x = x + self.out(attn)
            mlp: torch.Tensor = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))
            return x + mlp

    base: tuple[type, ...] = (nn.Module,)
    register: Any = None
    if diffusers:
        from diffusers.configuration_utils import ConfigMixin, register_to_config
        from diffusers.models.modeling_utils import ModelMixin

        base = (ModelMixin, ConfigMixin)
        register = register_to_config

    class Model(*base):  # type: ignore[misc]
        config_name = "config.json"

        def __init__(self, hidden: int = 1024, layers: int = 40) -> None:
            super().__init__()
            self.proj_in = nn.Linear(64, hidden, dtype=torch.bfloat16)
            self.blocks = nn.ModuleList(Layer(hidden) for _ in range(layers))
            self.proj_out = nn.Linear(hidden, 64, dtype=torch.bfloat16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.proj_in(x)
            for block in self.blocks:
                x = block(x)
            out: torch.Tensor = self.proj_out(x)
            return out

    if register is not None:
        Model.__init__ = register(Model.__init__)  # type: ignore[method-assign]
    return Layer, Model


def _touch(tensors: Any) -> tuple[int, float]:
    """Read every byte once: lazily mapped weights become resident, and the sum proves the bytes agree.

    The sum is taken per tensor over 8-byte words (wrapping), so it does not depend on how tensors
    are laid out across buffers; ``tensors`` are the model's tensors (or views into packed buffers).
    """
    import torch

    start = time.perf_counter()
    total = 0
    for t in tensors:
        flat = t.reshape(-1).view(torch.uint8)
        words = flat.numel() - flat.numel() % 8
        if words and flat.storage_offset() % 8 == 0:
            total += int(flat[:words].view(torch.int64).sum())
            flat = flat[words:]
        total += int(flat.sum(dtype=torch.int64))
    return total % 2**64, time.perf_counter() - start


def _peak() -> dict[str, int]:
    """Peak resident bytes of this process: ru_maxrss (KiB on Linux) and /proc's VmHWM."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    hwm = 0
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return {"ru_maxrss": maxrss, "vm_hwm": hwm}


# -- children ---------------------------------------------------------------------------------------


def _generate(folder: Path, hidden: int, layers: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    _, model_cls = _model_classes()
    with torch.device("meta"):
        meta = model_cls(hidden=hidden, layers=layers)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in meta.state_dict().items()}
    keys = list(shapes)
    per = (len(keys) + SHARDS - 1) // SHARDS
    weight_map: dict[str, str] = {}
    total = 0
    gen = torch.Generator().manual_seed(0)
    for s in range(SHARDS):
        name = f"{WEIGHTS}-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = {}
        for k in keys[s * per : (s + 1) * per]:
            shape, dtype = shapes[k]
            part[k] = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
            weight_map[k] = name
            total += part[k].nbytes
        save_file(part, str(folder / name), metadata={"format": "pt"})
        del part
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{WEIGHTS}.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = {"_class_name": "Model", "hidden": hidden, "layers": layers}
    (folder / "config.json").write_text(json.dumps(config))
    files = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return {"tensor_bytes": total, "file_bytes": files, "tensors": len(keys)}


def _load_torchferry(folder: Path, hidden: int, layers: int) -> dict[str, Any]:
    """The runtime path: a meta-built model, ``torchferry.offload(..., checkpoint=...)``."""
    from torch import nn

    import torchferry

    _, model_cls = _model_classes()
    model_cls._layerwise_offload_blocks_attrs = ("blocks",)

    class Pipeline(nn.Module):
        _dit_modules: ClassVar[list[str]] = ["transformer"]
        _encoder_modules: ClassVar[list[str]] = []
        _vae_modules: ClassVar[list[str]] = []

        def __init__(self, transformer: nn.Module) -> None:
            super().__init__()
            self.transformer = transformer

    baseline = _peak()
    start = time.perf_counter()
    with torchferry.meta_parameters():
        pipeline = Pipeline(model_cls(hidden=hidden, layers=layers))
    session = torchferry.offload(
        pipeline,
        strategy="layerwise",
        device="cpu",
        checkpoint=folder / f"{WEIGHTS}.safetensors.index.json",
        checkpoint_prefix_map={"transformer.": ""},
    )
    seconds = time.perf_counter() - start
    held = session.host_bytes
    assert not any(t.is_meta for t in pipeline.parameters())
    checksum, touch = _touch(pipeline.transformer.state_dict().values())
    peak = _peak()  # ready and read; closing (giving every tensor its own storage) is not loading
    session.close()
    return {
        "peak": peak,
        "peak_after_close": _peak(),
        "seconds": seconds,
        "touch_seconds": touch,
        "checksum": checksum,
        "baseline": baseline,
        "held_bytes": held,
    }


def _load_reader(folder: Path, hidden: int, layers: int) -> dict[str, Any]:
    """The reader alone: one packed buffer per block from `CheckpointReader.read_into`, no module."""
    import torch

    from torchferry.runtime import CheckpointReader
    from torchferry.topology import Block, TensorSpec

    _, model_cls = _model_classes()
    with torch.device("meta"):
        meta = model_cls(hidden=hidden, layers=layers)
    specs = [
        TensorSpec(name=k, shape=tuple(v.shape), dtype=str(v.dtype).removeprefix("torch."))
        for k, v in meta.state_dict().items()
    ]
    blocks = [
        Block(path=f"blocks.{i}", tensors=[s for s in specs if s.name.startswith(f"blocks.{i}.")])
        for i in range(layers)
    ]
    rest = [s for s in specs if not s.name.startswith("blocks.")]
    del meta
    baseline = _peak()
    start = time.perf_counter()
    with CheckpointReader(folder / f"{WEIGHTS}.safetensors.index.json") as reader:
        reader.validate(specs)
        buffers = []
        for block in blocks:
            buffer = torch.empty(block.nbytes, dtype=torch.uint8)
            reader.read_into(block.layout, buffer)
            buffers.append(buffer)
        remainder = {s.name: reader.read_tensor(s.name) for s in rest}
    seconds = time.perf_counter() - start
    held = sum(b.numel() for b in buffers) + sum(t.nbytes for t in remainder.values())
    views = [
        buf[off : off + spec.nbytes]
        for block, buf in zip(blocks, buffers, strict=True)
        for spec, off in block.layout
    ]
    checksum, touch = _touch([*views, *remainder.values()])
    return {
        "seconds": seconds,
        "touch_seconds": touch,
        "checksum": checksum,
        "baseline": baseline,
        "held_bytes": held,
    }


def _load_ordinary(folder: Path, hidden: int, layers: int, meta: bool) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    _, model_cls = _model_classes()
    baseline = _peak()
    start = time.perf_counter()
    if meta:
        with torch.device("meta"):
            model = model_cls(hidden=hidden, layers=layers)
    else:
        model = model_cls(hidden=hidden, layers=layers)
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    model.load_state_dict(state, assign=meta)
    del state
    seconds = time.perf_counter() - start
    held = sum(t.nbytes for t in model.state_dict().values())
    checksum, touch = _touch(model.state_dict().values())
    return {
        "seconds": seconds,
        "touch_seconds": touch,
        "checksum": checksum,
        "baseline": baseline,
        "held_bytes": held,
    }


def _load_diffusers(folder: Path) -> dict[str, Any]:
    import torch

    try:
        import diffusers
    except ImportError as exc:
        return {"skipped": f"diffusers is not importable ({exc})"}
    _, model_cls = _model_classes(diffusers=True)
    baseline = _peak()
    start = time.perf_counter()
    model = model_cls.from_pretrained(str(folder), torch_dtype=torch.bfloat16)
    cpu = torch.device("cpu")
    model.enable_group_offload(
        onload_device=cpu, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1
    )
    seconds = time.perf_counter() - start
    held = sum(t.nbytes for t in model.state_dict().values())
    checksum, touch = _touch(model.state_dict().values())
    return {
        "seconds": seconds,
        "touch_seconds": touch,
        "checksum": checksum,
        "baseline": baseline,
        "held_bytes": held,
        "note": f"diffusers {diffusers.__version__}, group offload block_level onto CPU",
    }


def _generate_pipeline(folder: Path, hidden: int, layers: int) -> dict[str, Any]:
    """A WanPipeline folder (transformer and scheduler only) of about the custom model's size."""
    import torch

    try:
        import diffusers
    except ImportError as exc:
        return {"skipped": f"diffusers is not importable ({exc})"}
    torch.manual_seed(0)
    with torch.device("meta"):
        transformer = _wan(diffusers, hidden, layers)
    transformer = transformer.to_empty(device="cpu").to(torch.bfloat16)
    keep = transformer._keep_in_fp32_modules
    for name, param in transformer.named_parameters():  # as from_pretrained(torch_dtype=bf16) keeps them
        if any(k in name.split(".") for k in keep):
            param.data = param.data.float()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in transformer.state_dict().values():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
    pipe = diffusers.WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    target = folder / PIPELINE
    pipe.save_pretrained(str(target), max_shard_size="256MB")
    files = sum(p.stat().st_size for p in target.rglob("*.safetensors"))
    shards = len(list(target.rglob("*.safetensors")))
    return {"file_bytes": files, "shards": shards, "tensors": len(transformer.state_dict())}


def _wan(diffusers: Any, hidden: int, layers: int) -> Any:
    # A Wan block holds about 16 hidden² weights, the benchmark model's 12: 3/4 of the layers match it.
    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=hidden // 128,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=256,
        freq_dim=256,
        ffn_dim=4 * hidden,
        num_layers=max(1, layers * 3 // 4),
    )


def _load_folder(folder: Path, mode: str) -> dict[str, Any]:
    """One way of loading the pipeline folder; the transformer's bytes are touched and summed."""
    import torch

    import torchferry

    try:
        import diffusers
    except ImportError as exc:
        return {"skipped": f"diffusers is not importable ({exc})"}
    target = str(folder / PIPELINE)
    extra = {"tokenizer": None, "text_encoder": None, "vae": None, "transformer_2": None}
    wan = diffusers.WanPipeline  # diffusers imports lazily: the pipeline's modules load here, not below
    baseline = _peak()
    start = time.perf_counter()
    session = None
    if mode == "from_pretrained":
        session = torchferry.from_pretrained(
            diffusers.WanPipeline, target, strategy="layerwise", device="cpu"
        )
        pipe = session.pipeline
    else:
        pipe = wan.from_pretrained(target, torch_dtype=torch.bfloat16, **extra)
        if mode == "pipe+offload":
            session = torchferry.offload(pipe, strategy="layerwise", device="cpu")
    seconds = time.perf_counter() - start
    held = (
        session.host_bytes
        if session is not None
        else sum(t.nbytes for t in pipe.transformer.state_dict().values())
    )
    checksum, touch = _touch(pipe.transformer.state_dict().values())
    peak = _peak()
    if session is not None:
        session.close()
    return {
        "peak": peak,
        "seconds": seconds,
        "touch_seconds": touch,
        "checksum": checksum,
        "baseline": baseline,
        "held_bytes": held,
    }


def _child(mode: str, folder: Path, hidden: int, layers: int) -> None:
    if mode == "generate":
        result = _generate(folder, hidden, layers)
    elif mode == "generate-pipeline":
        result = _generate_pipeline(folder, hidden, layers)
    elif mode in FOLDER_MODES:
        result = _load_folder(folder, mode)
    elif mode == "torchferry":
        result = _load_torchferry(folder, hidden, layers)
    elif mode == "reader":
        result = _load_reader(folder, hidden, layers)
    elif mode in ("ordinary", "ordinary-meta"):
        result = _load_ordinary(folder, hidden, layers, meta=mode == "ordinary-meta")
    else:
        result = _load_diffusers(folder)
    result.setdefault("peak", _peak())
    print(json.dumps(result))


# -- parent -----------------------------------------------------------------------------------------


def _spawn(mode: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--folder", str(folder)]
    command += ["--hidden", str(args.hidden), "--layers", str(args.layers)]
    # The child imports torchferry from this checkout, not whichever one is installed.
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800, env=env)
    if done.returncode != 0:
        return {"failed": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output"}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _best(done: list[dict[str, Any]]) -> dict[str, Any]:
    timed = [r for r in done if "seconds" in r]
    if not timed:
        return done[0]
    best = min(timed, key=lambda r: r["seconds"] + r["touch_seconds"])
    best["all_seconds"] = [round(r["seconds"] + r["touch_seconds"], 3) for r in timed]
    best["peak"]["ru_maxrss"] = max(r["peak"]["ru_maxrss"] for r in timed)
    best["peak"]["vm_hwm"] = max(r["peak"]["vm_hwm"] for r in timed)
    return best


def _print_table(rows: dict[str, dict[str, Any]], ckpt: int) -> None:
    """One table of load paths over the same files; 'bytes ok' compares their checksums."""
    header = (
        f"{'path':<16} {'load':>7} {'+touch':>7} {'peak RSS':>10} {'RSS/ckpt':>9} {'(peak-base)/ckpt':>17}"
        f" {'bytes ok':>8}"
    )
    sums = {row["checksum"] for row in rows.values() if "checksum" in row}
    print(header)
    print("-" * len(header))
    for mode, row in rows.items():
        if "seconds" not in row:
            print(f"{mode:<16} skipped: {row.get('skipped') or row.get('failed')}")
            continue
        peak = row["peak"]["ru_maxrss"]
        base = row["baseline"]["ru_maxrss"]
        row["peak_over_checkpoint"] = peak / ckpt
        row["net_over_checkpoint"] = (peak - base) / ckpt
        row["bytes_match"] = len(sums) == 1
        print(
            f"{mode:<16} {row['seconds']:>6.2f}s {row['touch_seconds']:>6.2f}s {_gib(peak):>10} "
            f"{peak / ckpt:>8.2f}x {(peak - base) / ckpt:>16.2f}x {'yes' if len(sums) == 1 else 'NO':>8}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--modes", default=",".join((*MODES, *FOLDER_MODES)))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "load.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.folder, args.hidden, args.layers)
        return
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - {*MODES, *FOLDER_MODES})
    if unknown:
        raise SystemExit(
            f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join((*MODES, *FOLDER_MODES))}"
        )
    with tempfile.TemporaryDirectory(prefix="torchferry-load-") as tmp:
        folder = Path(tmp)
        made = _spawn("generate", folder, args)
        if "failed" in made:
            raise SystemExit(f"could not generate the checkpoint: {made['failed']}")
        ckpt = made["file_bytes"]
        pipeline: dict[str, Any] = {}
        if any(m in FOLDER_MODES for m in modes):
            pipeline = _spawn("generate-pipeline", folder, args)
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for _ in range(args.repeat):
            for mode, done in runs.items():
                if mode in FOLDER_MODES and "file_bytes" not in pipeline:
                    done.append({"skipped": pipeline.get("skipped") or pipeline.get("failed")})
                    continue
                done.append(_spawn(mode, folder, args))
        rows = {mode: _best(done) for mode, done in runs.items() if mode in MODES}
        folder_rows = {mode: _best(done) for mode, done in runs.items() if mode in FOLDER_MODES}
    print(f"checkpoint: {_gib(ckpt)} in {SHARDS} shards ({made['tensors']} tensors), bf16, from page cache")
    _print_table(rows, ckpt)
    if folder_rows and "file_bytes" in pipeline:
        print()
        print(
            f"pipeline folder: WanPipeline, {_gib(pipeline['file_bytes'])} in {pipeline['shards']} shards "
            f"({pipeline['tensors']} tensors), bf16, from page cache"
        )
        _print_table(folder_rows, pipeline["file_bytes"])
    elif folder_rows:
        print(f"pipeline folder: skipped: {pipeline.get('skipped') or pipeline.get('failed')}")
    print(f"best of {args.repeat} runs each (fresh child processes, interleaved)")
    print("load: until the call returns; +touch: then reading every byte once (lazy mappings page in)")
    print("base: the child's peak RSS after its imports (torch), before loading starts")
    report = {
        "checkpoint_bytes": ckpt,
        "tensor_bytes": made["tensor_bytes"],
        "hidden": args.hidden,
        "layers": args.layers,
        "shards": SHARDS,
        "repeat": args.repeat,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "target": "torchferry peak RSS <= 1.2x checkpoint bytes",
        "rows": rows,
        "pipeline_folder": {
            "file_bytes": pipeline.get("file_bytes"),
            "shards": pipeline.get("shards"),
            "rows": folder_rows,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
