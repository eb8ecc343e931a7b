"""What a checkpoint path names: `locate` finds the shard files of a file, a folder or an index.

An index's shards must be named inside the index's folder (no absolute paths, no ``..``); a shard
that is a symlink to elsewhere (the Hugging Face cache's ``snapshots/<rev>/x -> ../../blobs/<hash>``)
is fine, since the name is what is checked, not where the link points. The index itself is read as
strictly as a header (`strict_json`) and held to the same size cap.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePath

import attrs

from torchferry._errors import PlanError
from torchferry.topology._frozen import FrozenMap
from torchferry.topology._safetensors import (
    MAX_HEADER_BYTES,
    HeaderEntry,
    check_text,
    error_reason,
    file_kind,
    open_regular,
    parse_header,
    show,
    strict_json,
)

__all__ = ["Sources", "locate", "shard_header"]

# A shard name in an index is a file name beside the index; this bounds the paths messages quote.
_MAX_SHARD_NAME = 512
_HOW = "point checkpoint at a .safetensors file, a folder of them, or a *.index.json"


@attrs.frozen(kw_only=True)
class Sources:
    """What a checkpoint path names: the shard files to read and, for an index, its weight map.

    ``files`` are path strings in the order they are read (sorted); ``weight_map`` maps each tensor
    the index lists to one of them (``None`` for a file or a folder). Files are not opened here.
    """

    path: str
    files: tuple[str, ...]
    weight_map: FrozenMap[str, str] | None = None


def _shard_name(index: str, tensor: str, name: object) -> str:
    """The weight map's shard ``name`` if it names a file inside the index's folder, else `PlanError`."""
    if not isinstance(name, str):
        raise PlanError(
            f"{index}: the index maps tensor {show(tensor)} to {show(name)}; shard names are strings"
        )
    check_text(index, "shard name", name)
    parts = PurePath(name).parts
    escapes = PurePath(name).is_absolute() or PurePath(name).drive or ".." in parts or "\0" in name
    if len(name) > _MAX_SHARD_NAME or any(len(part) > 255 for part in parts):
        raise PlanError(
            f"{index}: the index names shard {show(name)} for tensor {show(tensor)}, longer than a file "
            f"name can be (at most {_MAX_SHARD_NAME} characters, 255 per folder or file name)"
        )
    if escapes or not parts or os.path.isabs(name):
        raise PlanError(
            f"{index}: the index names shard {show(name)} for tensor {show(tensor)}, which is not a file "
            "name inside the index's folder; shards must sit beside the index (no absolute paths, no '..')"
        )
    return name


def locate(path: str | os.PathLike[str]) -> Sources:
    """The shard files a checkpoint path names: a ``.safetensors`` file, a folder, or an index.

    A folder's shards are its ``*.safetensors`` entries, sorted. An ``*.json`` file is an index whose
    ``weight_map`` maps tensor names to shard names inside the index's folder. Raises `PlanError`
    for a missing path, a folder without shards, a path that is not a regular file or folder, and
    any malformed index; shards are not opened (nor checked for existence) here.
    """
    source = os.fspath(path)
    try:
        mode = os.stat(source).st_mode
    except FileNotFoundError:
        raise PlanError(f"{source}: no such checkpoint file or folder") from None
    except (OSError, ValueError) as exc:
        raise PlanError(f"{source}: cannot be read ({error_reason(exc)}); {_HOW}") from None
    if stat.S_ISDIR(mode):
        files = sorted(str(p) for p in Path(source).glob("*.safetensors"))
        if not files:
            raise PlanError(f"{source}: the folder holds no *.safetensors file; {_HOW}")
        return Sources(path=source, files=tuple(files))
    if not stat.S_ISREG(mode):
        raise PlanError(f"{source}: is {file_kind(mode)}, not a regular file; {_HOW}")
    if not source.endswith(".json"):
        return Sources(path=source, files=(source,))
    with open_regular(source) as handle:
        raw = handle.read(MAX_HEADER_BYTES + 1)
    if len(raw) > MAX_HEADER_BYTES:
        raise PlanError(f"{source}: the index is larger than {MAX_HEADER_BYTES} bytes; it is not an index")
    index = strict_json(source, raw, "the index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise PlanError(f"{source}: an index needs a 'weight_map' object of tensor name -> shard file")
    if not weight_map:
        raise PlanError(f"{source}: the index's 'weight_map' is empty; an index names every tensor's shard")
    folder = Path(source).parent
    resolved: dict[str, str] = {}
    for tensor, shard in weight_map.items():
        check_text(source, "tensor name", tensor)
        resolved[tensor] = str(folder / _shard_name(source, tensor, shard))
    return Sources(path=source, files=tuple(sorted(set(resolved.values()))), weight_map=FrozenMap(resolved))


def shard_header(index: str, file: str) -> tuple[HeaderEntry, ...]:
    """The checked entries of the shard ``file`` the index ``index`` names (a missing one: `PlanError`)."""
    try:
        handle = open_regular(file)
    except FileNotFoundError:
        raise PlanError(
            f"{index}: the index names shard {show(os.path.basename(file))}, which does not exist"
        ) from None
    with handle:
        return parse_header(file, handle)
