"""Diffusers pipeline folders: ``model_index.json`` and one subfolder per component, as a checkpoint.

``DiffusionPipeline.save_pretrained`` writes, and the Hugging Face cache holds, a folder whose
``model_index.json`` names every component (``"transformer": ["diffusers",
"WanTransformer3DModel"]``), each in its own subfolder with a ``config.json`` and its weights as
one safetensors file, numbered shards, or shards with an ``*.safetensors.index.json``. Tensor names
inside a subfolder lack the component's attribute path (``blocks.0.attn1.to_q.weight``); the
pipeline's own names have it (``transformer.blocks.0.attn1.to_q.weight``), so every subfolder's
names are read under ``<component>.``: no prefix map to write.

`read_pipeline_folder` finds the components and their weight sources; `from_pipeline_folder` builds
the topology from their headers alone (the class names from each ``config.json``, kinds and block
attributes from the registry of known classes, else guessed from the tensor names), and
`known_match` says which known model the folder holds, when its tensors have that model's names and
shapes. The runtime's `CheckpointReader` opens the same sources through `pipeline_sources`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from torchferry._errors import PlanError
from torchferry.topology._grouping import by_kind, component_from_entries
from torchferry.topology._json import load_json
from torchferry.topology._locate import locate
from torchferry.topology._model import ComponentKind, Declaration, Topology
from torchferry.topology._registry import (
    DIT_BLOCK_ATTRS,
    ENCODER_BLOCK_LAYOUTS,
    PIPELINES,
    declaration_for_pipeline,
)
from torchferry.topology._safetensors import HeaderEntry, read_header

__all__ = [
    "FolderComponent",
    "PipelineFolder",
    "from_pipeline_folder",
    "guess_block_attrs",
    "hub_cache_dir",
    "hub_snapshot",
    "is_hub_id",
    "is_pipeline_folder",
    "known_match",
    "library_module",
    "pipeline_sources",
    "read_pipeline_folder",
]

MODEL_INDEX = "model_index.json"
_NUMBERED = re.compile(r"^(.+?)\.(\d+)\.")
# The weight file names diffusers and transformers write, without a variant (``.fp16``) infix.
_WEIGHT_NAMES = ("diffusion_pytorch_model", "model")
#: How the classes of components that hold no weights end (schedulers, tokenizers, processors): a
#: stray ``*.safetensors`` in their subfolder is not a model of the pipeline, as diffusers, which
#: loads them with their own ``from_pretrained``, never reads it either.
_NO_WEIGHTS = ("Scheduler", "Tokenizer", "TokenizerFast", "Processor", "FeatureExtractor")


#: The libraries diffusers imports a component's class from by name (its ``LOADABLE_CLASSES``).
LOADABLE_LIBRARIES = ("diffusers", "transformers", "onnxruntime.training")


def library_module(library: str, *, pipeline_local: bool, imported: bool) -> str | None:
    """The module a ``model_index.json`` library name means, read as diffusers reads it, or None.

    A library diffusers loads from (`LOADABLE_LIBRARIES`) is itself; a name that is a module of
    ``diffusers.pipelines`` (``pipeline_local``: LTX-2 records ``["ltx2", "LTX2Vocoder"]``) is that
    module; any other name is the module only when the process has ``imported`` it already: like
    diffusers, torchferry never imports a module because a downloaded file names it.
    """
    if library in LOADABLE_LIBRARIES:
        return library
    if pipeline_local:
        return f"diffusers.pipelines.{library}"
    return library if imported else None


@attrs.frozen(kw_only=True)
class FolderComponent:
    """One component of a pipeline folder: its attribute name, library, class and weight source.

    ``source`` is what `from_checkpoint` and `CheckpointReader` take (a file, a folder of shards or
    an ``*.index.json``), or ``None`` for a component without safetensors weights (a scheduler, a
    tokenizer). ``class_name`` comes from the subfolder's ``config.json`` (diffusers'
    ``_class_name``, transformers' ``architectures[0]``), else from ``model_index.json``.
    """

    name: str
    library: str
    class_name: str
    #: The class ``model_index.json`` lists (the one diffusers instantiates).
    index_class: str
    folder: Path
    source: Path | None


@attrs.frozen(kw_only=True)
class PipelineFolder:
    """A pipeline folder: its pipeline class, its components, and the other values of its index."""

    path: Path
    pipeline_class: str
    components: tuple[FolderComponent, ...]
    #: ``model_index.json`` values that are not components (``boundary_ratio``, ``expand_timesteps``).
    init_values: tuple[tuple[str, object], ...] = ()
    #: Components listed as ``[null, null]`` (absent in this folder).
    absent: tuple[str, ...] = ()

    @property
    def weighted(self) -> tuple[FolderComponent, ...]:
        """The components with safetensors weights, in index order."""
        return tuple(c for c in self.components if c.source is not None)


def is_pipeline_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder with a ``model_index.json``."""
    return (Path(path) / MODEL_INDEX).is_file()


def _read_json(file: Path, what: str) -> dict[str, object]:
    try:
        doc = load_json(file.read_bytes())
    except (OSError, ValueError) as exc:
        raise PlanError(
            f"{file}: cannot read the {what} ({exc}); re-save or re-download the pipeline"
        ) from None
    if not isinstance(doc, dict):
        raise PlanError(f"{file}: the {what} is a {type(doc).__name__}, not a JSON object")
    return doc


def _variant_source(folder: Path, variant: str) -> Path | None:
    """The index or single file of weight variant ``variant`` in one component subfolder, if any.

    The names are the ones ``save_pretrained(variant=...)`` writes: ``<stem>.<variant>.safetensors``,
    shards with ``<stem>.safetensors.index.<variant>.json`` (or the older ``.<variant>.index.json``).
    """
    for stem in _WEIGHT_NAMES:
        for index in (f"{stem}.safetensors.index.{variant}.json", f"{stem}.safetensors.{variant}.index.json"):
            if (folder / index).is_file():
                return folder / index
        single = folder / f"{stem}.{variant}.safetensors"
        if single.is_file():
            return single
    return None


def _weight_source(folder: Path) -> Path | None:
    """The safetensors source of one component subfolder: its index, its single file, or the folder.

    A folder may hold variants too (``diffusion_pytorch_model.fp16.safetensors``); the plain names
    win, and a folder of variants only is read as a whole when it holds one variant.
    """
    for stem in _WEIGHT_NAMES:
        index = folder / f"{stem}.safetensors.index.json"
        if index.is_file():
            return index
        single = folder / f"{stem}.safetensors"
        if single.is_file():
            return single
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) == 1:
        return indexes[0]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    if len(indexes) > 1 or (len(files) > 1 and not all(re.search(r"-\d+-of-\d+\.", f.name) for f in files)):
        shown = ", ".join(f.name for f in (indexes or files)[:4])
        raise PlanError(
            f"{folder}: holds several safetensors weight sets ({shown}) and none has a plain name "
            f"({_WEIGHT_NAMES[0]}.safetensors or model.safetensors); keep one set, or point the checkpoint "
            "at the file or index to use"
        )
    return folder if len(files) > 1 else files[0]


def _class_name(folder: Path, listed: str) -> str:
    config = folder / "config.json"
    if not config.is_file():
        return listed
    doc = _read_json(config, "component config")
    name = doc.get("_class_name")
    if isinstance(name, str) and name:
        return name
    archs = doc.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return listed


def read_pipeline_folder(path: str | os.PathLike[str], variant: str | None = None) -> PipelineFolder:
    """The pipeline class and components of the folder ``path`` from its ``model_index.json``.

    ``variant`` (``"fp16"``) reads each component's files of that weight variant, as diffusers'
    ``from_pretrained(variant=...)`` does: a component without them reads its plain files, and a
    folder where no component has them is a `PlanError`.
    """
    root = Path(path)
    index_file = root / MODEL_INDEX
    if not index_file.is_file():
        raise PlanError(
            f"{root}: no {MODEL_INDEX}; a diffusers pipeline folder (as save_pretrained writes it) has one"
        )
    index = _read_json(index_file, "pipeline index")
    pipeline_class = index.get("_class_name")
    if not isinstance(pipeline_class, str):
        raise PlanError(f"{index_file}: needs '_class_name', the pipeline class, got {pipeline_class!r}")
    components: list[FolderComponent] = []
    values: list[tuple[str, object]] = []
    absent: list[str] = []
    found_variant = False
    for name, entry in index.items():
        if name.startswith("_"):
            continue
        if not (isinstance(entry, list) and len(entry) == 2):
            values.append((name, entry))
            continue
        if not name.isidentifier():
            raise PlanError(
                f"{index_file}: component {name!r} is not an attribute name, and a component's subfolder "
                "is named after it, inside the pipeline folder (a name with '..' or a path separator "
                "would be read from elsewhere, as an index shard named so is refused); fix model_index.json"
            )
        library, listed = entry
        if library is None or listed is None:
            absent.append(name)
            continue
        if not (isinstance(library, str) and isinstance(listed, str)):
            raise PlanError(f"{index_file}: component {name!r} is {entry!r}; expected [library, class name]")
        folder = root / name
        source = None
        weighs = folder.is_dir() and not listed.endswith(_NO_WEIGHTS)
        if weighs and variant is not None:
            source = _variant_source(folder, variant)
            found_variant = found_variant or source is not None
        if weighs and source is None:
            source = _weight_source(folder)
        components.append(
            FolderComponent(
                name=name,
                library=library,
                class_name=_class_name(folder, listed) if folder.is_dir() else listed,
                index_class=listed,
                folder=folder,
                source=source,
            )
        )
    found = PipelineFolder(
        path=root,
        pipeline_class=pipeline_class,
        components=tuple(components),
        init_values=tuple(values),
        absent=tuple(absent),
    )
    if not found.weighted:
        raise PlanError(
            f"{root}: {MODEL_INDEX} lists {len(components)} component(s) but no subfolder holds "
            "*.safetensors weights; torchferry reads safetensors only (re-save with save_pretrained, "
            "whose default is safetensors)"
        )
    if variant is not None and not found_variant:
        raise PlanError(
            f"{root}: no component holds weights of variant {variant!r} (files such as "
            f"{_WEIGHT_NAMES[0]}.{variant}.safetensors or model.{variant}.safetensors); drop variant= to "
            "read the plain files, or fetch that variant"
        )
    return found


def pipeline_sources(
    path: str | os.PathLike[str], variant: str | None = None
) -> tuple[list[str], dict[str, str] | None, dict[str, str]] | None:
    """For the runtime's reader: ``(shard files, weight map or None, name prefix per file)``.

    ``None`` when ``path`` is not a pipeline folder. Tensor ``k`` of a file of the component
    ``transformer`` is the pipeline's ``transformer.k``: the prefix per file says so, and the weight
    map (present when any component has an index) maps prefixed names to absolute file paths.
    """
    if not is_pipeline_folder(path):
        return None
    files: list[str] = []
    prefixes: dict[str, str] = {}
    index: dict[str, str] = {}
    indexed = False
    for comp in read_pipeline_folder(path, variant).weighted:
        assert comp.source is not None
        sources = locate(comp.source)
        for shard in sources.files:
            files.append(shard)
            prefixes[shard] = comp.name + "."
        if sources.weight_map is not None:
            indexed = True
            index.update({f"{comp.name}.{k}": v for k, v in sources.weight_map.items()})
    return files, index if indexed else None, prefixes


def _entries(comp: FolderComponent) -> list[HeaderEntry]:
    """The component's checked header entries, named from the pipeline root."""
    assert comp.source is not None
    sources = locate(comp.source)
    entries: list[HeaderEntry] = []
    owner: dict[str, str] = {}
    for file in sources.files:
        for entry in read_header(file):
            if entry.name in owner:
                raise PlanError(
                    f"tensor {entry.name!r} is stored twice, in {owner[entry.name]} and {entry.file}"
                )
            owner[entry.name] = entry.file
            entries.append(attrs.evolve(entry, name=f"{comp.name}.{entry.name}"))
    for name, shard in (sources.weight_map or {}).items():
        if owner.get(name) != shard:
            raise PlanError(
                f"{comp.source}: the index maps tensor {name!r} to {shard!r}, but that shard's header has "
                "no such tensor"
            )
    return entries


def guess_block_attrs(names: Sequence[str]) -> tuple[str, ...]:
    """Block attributes guessed from tensor names: prefixes followed by at least two distinct indices.

    ``blocks.0.attn.q.weight`` and ``blocks.1.…`` make ``blocks`` one; the shortest numbered prefix
    of a name wins (so ``blocks.3.ffn.net.0`` counts for ``blocks`` only). Shorter attributes come
    first (``transformer_blocks`` before ``single_transformer_blocks``).
    """
    indices: dict[str, set[int]] = {}
    for name in names:
        match = _NUMBERED.match(name)
        if match:
            indices.setdefault(match.group(1), set()).add(int(match.group(2)))
    found = [attr for attr, seen in indices.items() if len(seen) >= 2]
    return tuple(sorted(found, key=lambda a: (len(a), a)))


def _kind(pipeline_class: str, comp: FolderComponent) -> ComponentKind:
    entry = PIPELINES.get(pipeline_class)
    if entry is not None:
        for group, kind in ((entry.dits, "dit"), (entry.encoders, "encoder"), (entry.vaes, "vae")):
            if any(p == comp.name for p, _ in group):
                return kind  # type: ignore[return-value]
    if comp.class_name in DIT_BLOCK_ATTRS:
        return "dit"
    if comp.class_name in ENCODER_BLOCK_LAYOUTS or "encoder" in comp.name:
        return "encoder"
    if "vae" in comp.name or comp.class_name.startswith("Autoencoder"):
        return "vae"
    return "dit"


def _block_attrs(kind: ComponentKind, comp: FolderComponent, names: Sequence[str]) -> tuple[str, ...]:
    """The component's block attributes: the registry's for its class, else guessed from its names."""
    if kind == "vae":
        return ()
    if kind == "dit" and comp.class_name in DIT_BLOCK_ATTRS:
        return DIT_BLOCK_ATTRS[comp.class_name]
    if kind == "encoder":
        for layout in ENCODER_BLOCK_LAYOUTS.get(comp.class_name, ()):
            # The files hold the layout of the transformers release that saved them.
            if all(any(n.startswith(a + ".") for n in names) for a in layout):
                return layout
    return guess_block_attrs(names)


def from_pipeline_folder(
    path: str | os.PathLike[str],
    block_attrs: Mapping[str, Sequence[str]] | None = None,
    *,
    declaration: Declaration | None = None,
    variant: str | None = None,
) -> Topology:
    """Describe the diffusers pipeline folder ``path`` from its headers alone (no tensor data read).

    Each component with safetensors weights becomes a component at its attribute path, its tensors
    named from the pipeline root, its class from its ``config.json``. Kinds come from the pipeline
    class's registry entry, else from the component's class and name; block attributes from
    ``block_attrs[name]`` when given, else the registry of known classes, else guessed from the
    tensor names. The declaration is ``declaration``, else the known pipeline class's. ``variant``
    describes the files of that weight variant (see `read_pipeline_folder`).
    """
    folder = read_pipeline_folder(path, variant)
    overrides = dict(block_attrs or {})
    unknown = sorted(set(overrides) - {c.name for c in folder.weighted})
    if unknown:
        raise PlanError(
            f"{folder.path}: block_attrs names {', '.join(map(repr, unknown))}, which the folder has no "
            f"weights for; its components are {', '.join(c.name for c in folder.weighted)}"
        )
    found = []
    for comp in folder.weighted:
        entries = _entries(comp)
        kind = _kind(folder.pipeline_class, comp)
        names = [e.name[len(comp.name) + 1 :] for e in entries]
        given = overrides.get(comp.name)
        attrs_ = tuple(given) if given is not None else _block_attrs(kind, comp, names)
        component = component_from_entries(comp.name, kind, attrs_, entries)
        found.append(attrs.evolve(component, class_name=comp.class_name))
    built = by_kind(found)
    if declaration is None:
        declaration = declaration_for_pipeline(folder.pipeline_class, {c.path: c.class_name for c in built})
    return Topology(
        pipeline_class=folder.pipeline_class,
        components=built,
        declaration=declaration,
        declares_components=True,
        source=f"folder:{folder.path}",
    )


def _shapes(topo: Topology, path: str) -> frozenset[tuple[str, tuple[int, ...]]]:
    comp = next((c for c in topo.components if c.path == path), None)
    if comp is None:
        return frozenset()
    out: set[tuple[str, tuple[int, ...]]] = set()
    for spec in comp.all_tensors():
        if spec.buffer and not spec.persistent:
            continue
        out.add((spec.name, spec.shape))
    return frozenset(out)


def known_match(topo: Topology, candidates: Mapping[str, Topology]) -> str | None:
    """The id among ``candidates`` whose DiTs have exactly ``topo``'s DiT tensor names and shapes.

    A checkpoint stores each tied tensor once and no non-persistent buffer, so only persistent
    owner names are compared (a known spec's aliases count as its owner); the first match wins.
    """
    dits = [c.path for c in topo.components if c.kind == "dit"]
    if not dits:
        return None
    for model_id, known in candidates.items():
        if known.pipeline_class != topo.pipeline_class:
            continue
        if sorted(c.path for c in known.components if c.kind == "dit") != sorted(dits):
            continue
        ok = True
        for path in dits:
            mine = _shapes(topo, path)
            theirs = _shapes(known, path)
            aliases = {
                (a, s.shape)
                for c in known.components
                if c.path == path
                for s in c.all_tensors()
                for a in s.aliases
            }
            if not (mine <= theirs | aliases and len(mine) == len(theirs)):
                ok = False
                break
        if ok:
            return model_id
    return None


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_hub_id(text: str) -> bool:
    """Whether ``text`` has the form of a hub repository id (``org/name``)."""
    return _HUB_ID.match(text) is not None


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str, environ: Mapping[str, str] | None = None) -> Path | None:
    """The local snapshot folder of the hub repository ``repo_id`` (``org/name``), or ``None``.

    Reads the cache layout huggingface_hub writes (``models--org--name/snapshots/<revision>``): the
    revision ``refs/main`` names, else the only snapshot, else the newest. Nothing is downloaded.
    """
    if not is_hub_id(repo_id):
        return None
    cache = hub_cache_dir(environ)
    name = "models--" + repo_id.replace("/", "--")
    repo = cache / name
    if not repo.is_dir() and cache.is_dir():  # ids are case-insensitive on the hub, not on disk
        repo = next((p for p in cache.iterdir() if p.name.lower() == name.lower()), repo)
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    main = repo / "refs" / "main"
    if main.is_file():
        chosen = snapshots / main.read_text("utf-8").strip()
        if chosen.is_dir():
            return chosen
    found = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None
