"""Regenerate the shipped tensor specs of torchferry's known public models.

Usage::

    python tools/gen_known_specs.py [MODEL_CONFIGS_JSON] [OUT_DIR]

Reads the published config values in ``model_configs.json`` (default: ``../shared/models/
model_configs.json`` next to the repository), builds every component on the meta device with
diffusers / transformers exactly as ``from_pretrained(torch_dtype=torch.bfloat16)`` would (built
under a bf16 default dtype; state-dict tensors cast to bf16 except the class's
``_keep_in_fp32_modules``, which stay fp32; non-persistent buffers as constructed), and writes one
``<id>.json.gz`` per model into ``torchferry/topology/known/``.

Needs ``diffusers`` and ``transformers``; run it only to refresh the data. The tests and the library
read the written files and never import either package for them.

File format (version 1), all names relative to their owner:

- ``components``: list of ``{path, kind, class, library, rest, stacks, templates}``;
  ``rest`` is the component's non-block tensors, ``templates`` the distinct block layouts, and
  ``stacks`` a list of rings ``{attrs, blocks: [[attr, index, template], ...]}``.
- A tensor is ``[name, shape, dtype, flag, aliases]`` with ``flag`` 0 = parameter,
  1 = persistent buffer, 2 = non-persistent buffer.
- ``variants``: ``{name: component}`` alternative components (``vae@0.9.1``) in the same form.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = REPO.parent / "shared" / "models" / "model_configs.json"
DEFAULT_OUT = REPO / "torchferry" / "topology" / "known"
FORMAT_VERSION = 1

#: Components another model's file should borrow (id -> {path: (source id, source component)}).
BORROWED = {
    "ltx-video-13b-0.9.7": {
        "text_encoder": ("ltx-video-2b", "text_encoder"),
        "vae": ("ltx-video-2b", "vae@0.9.5"),
    }
}


def _kind(path: str) -> str:
    if path.startswith("transformer"):
        return "dit"
    if path.startswith("text_encoder"):
        return "encoder"
    if path.startswith("vae"):
        return "vae"
    raise ValueError(f"cannot tell the kind of component {path!r}")


def _build(entry: dict[str, Any]) -> torch.nn.Module:
    """Instantiate one component on the meta device under a bf16 default dtype."""
    config = dict(entry["config"])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            if entry["library"] == "diffusers":
                import diffusers

                cls = getattr(diffusers, entry["diffusers_class"])
                return cls.from_config(config)  # type: ignore[no-any-return]
            import transformers

            cls = getattr(transformers, entry["transformers_class"])
            config.pop("architectures", None)
            cfg = cls.config_class(**config)
            return cls(cfg)  # type: ignore[no-any-return]
    finally:
        torch.set_default_dtype(previous)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _loaded_dtype(name: str, tensor: torch.Tensor, keep_fp32: list[str]) -> str:
    """The dtype ``from_pretrained(torch_dtype=bf16)`` leaves a state-dict tensor in."""
    if not tensor.is_floating_point():
        return _dtype_name(tensor.dtype)
    if any(m in name.split(".") for m in keep_fp32):
        return "float32"
    return "bfloat16"


def _specs(model: torch.nn.Module, keep_fp32: list[str]) -> list[list[Any]]:
    """Every tensor of ``model`` once: ``[name, shape, dtype, flag, aliases]`` in module order."""
    owners: dict[int, list[Any]] = {}
    out: list[list[Any]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        key = id(p)
        if key in owners:
            owners[key][4].append(name)
            continue
        spec = [name, list(p.shape), _loaded_dtype(name, p, keep_fp32), 0, []]
        owners[key] = spec
        out.append(spec)
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for buf_name, b in module._buffers.items():
            if b is None:
                continue
            name = f"{mod_name}.{buf_name}" if mod_name else buf_name
            key = id(b)
            if key in owners:
                owners[key][4].append(name)
                continue
            persistent = buf_name not in module._non_persistent_buffers_set
            dtype = _loaded_dtype(name, b, keep_fp32) if persistent else _dtype_name(b.dtype)
            spec = [name, list(b.shape), dtype, 1 if persistent else 2, []]
            owners[key] = spec
            out.append(spec)
    return out


def _relative(spec: list[Any], prefix: str) -> list[Any]:
    cut = len(prefix) + 1
    return [spec[0][cut:], spec[1], spec[2], spec[3], [a[cut:] for a in spec[4]]]


def _component(path: str, entry: dict[str, Any]) -> dict[str, Any]:
    model = _build(entry)
    # transformers' own _keep_in_fp32_modules apply to fp16 loads only; bf16 loads are uniform.
    keep: list[str] = []
    if entry["library"] == "diffusers":
        keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    specs = _specs(model, keep)
    block_attrs = list(entry["measured"]["blocks"])
    # Which block owns each tensor: the longest "attr.index" prefix.
    block_paths: list[tuple[str, str, int]] = []
    for attr in block_attrs:
        container = model.get_submodule(attr)
        for i in range(len(container)):  # type: ignore[arg-type]
            block_paths.append((f"{attr}.{i}", attr, i))
    by_block: dict[str, list[list[Any]]] = {p: [] for p, _, _ in block_paths}
    rest: list[list[Any]] = []
    for spec in specs:
        owner = next((p for p, _, _ in block_paths if spec[0].startswith(p + ".")), None)
        if owner is None:
            rest.append(spec)
        else:
            by_block[owner].append(_relative(spec, owner))
    templates: list[list[list[Any]]] = []
    index: dict[str, int] = {}

    def template_of(tensors: list[list[Any]]) -> int:
        key = json.dumps(tensors)
        if key not in index:
            index[key] = len(templates)
            templates.append(tensors)
        return index[key]

    blocks = [[attr, i, template_of(by_block[p])] for p, attr, i in block_paths]
    kind = _kind(path)
    if kind == "dit":
        stacks = [{"attrs": block_attrs, "blocks": blocks}] if blocks else []
    else:
        stacks = [{"attrs": [a], "blocks": [b for b in blocks if b[0] == a]} for a in block_attrs]
    return {
        "path": path.split("@", maxsplit=1)[0],
        "kind": kind,
        "class": entry["diffusers_class"] or entry["transformers_class"],
        "library": entry["library"],
        "rest": rest,
        "stacks": stacks,
        "templates": templates,
    }


def main(argv: list[str]) -> int:
    configs = Path(argv[1]) if len(argv) > 1 else DEFAULT_CONFIGS
    out_dir = Path(argv[2]) if len(argv) > 2 else DEFAULT_OUT
    data = json.loads(configs.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    built: dict[tuple[str, str], dict[str, Any]] = {}
    for model_id, model in data.items():
        if model_id.startswith("_"):
            continue
        for path, entry in model.items():
            if not path.startswith("_"):
                built[(model_id, path)] = _component(path, entry)
                print(f"built {model_id} / {path}", file=sys.stderr)
    for model_id, model in data.items():
        if model_id.startswith("_"):
            continue
        names = [p for p in model if not p.startswith("_")]
        components = [built[(model_id, p)] for p in names if "@" not in p]
        variants = {p: built[(model_id, p)] for p in names if "@" in p}
        for path, (src_id, src_path) in BORROWED.get(model_id, {}).items():
            comp = dict(built[(src_id, src_path)])
            comp["path"] = path
            comp["borrowed_from"] = f"{src_id}/{src_path}"
            components.append(comp)
        order = {"dit": 0, "encoder": 1, "vae": 2}
        components.sort(key=lambda c: (order[c["kind"]], c["path"]))
        doc = {
            "format": FORMAT_VERSION,
            "id": model_id,
            "pipeline_class": model["_pipeline"]["pipeline_class"],
            "hf_repo": model["_pipeline"].get("hf_repo", ""),
            "generated_with": data["_meta"]["measured_with"],
            "components": components,
            "variants": variants,
        }
        raw = json.dumps(doc, separators=(",", ":"), sort_keys=False).encode()
        target = out_dir / f"{model_id}.json.gz"
        target.write_bytes(gzip.compress(raw, compresslevel=9, mtime=0))
        print(f"wrote {target} ({target.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
