"""Spilling: the file-tier packs of a pipeline built in memory, written once as safetensors into a
folder the caller names (``spill=``), so the file tier can read them back like a checkpoint.

Each pack is one file (``spill-<pack>.safetensors``), its tensors in the file back to back, widest
dtype first (so every tensor starts at a multiple of its element size and can be viewed in place),
and ``spill.safetensors.index.json`` maps every tensor to its file. A pack is then one run of the
file: one ``preadv`` reads it. Tensors are written one at a time straight from their memory (a
non-contiguous one through a contiguous copy of itself), so spilling holds no second copy of the
model; each file is written under a temporary name of its own (process id and a random token) and
renamed into place once complete, and a complete file that already holds exactly these bytes is kept
as it is (no second write, no new inode under a reader). The files stay after the session closes:
the pipeline's file-tier tensors then view them (delete the folder once the pipeline is gone).

Every refusal comes before the first byte is written: a tensor safetensors cannot hold, a folder
that cannot be written, a disk without room for the files or files over the process's size limit,
something other than a file where a file goes, and a folder another open session uses with other
bytes (see [Note: spill ownership] in `torchferry.runtime.files._spill_lease`). A write that fails anyway
(the disk filled meanwhile, an interrupt) takes out what this open wrote and is a `PlanError` naming
the folder. Only regular files are opened: a FIFO or a device where a file goes is replaced, never
read. Temporary files a killed writer left are removed by the next open that holds the folder alone.

The folder must be on a disk: a tmpfs (``/dev/shm``, often ``/tmp``) keeps its files in memory that
counts against the process's memory cgroup and cannot be reclaimed, which would defeat the host
budget, so it is a `PlanError` (and the folders the refused open made are removed). Several ranks of
a process group spilling into one folder (their weights are the same: the distributed strategy needs
it) do not race: rank 0 writes while the others wait, then each other rank finds the files complete
and identical and keeps them (on a folder local to another node, it writes its own), and no rank
reads before every rank is done (`agreed`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import json
import os
import re
import resource
import secrets
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import torch

from torchferry._errors import ExecutionError, PlanError
from torchferry.policies import format_bytes, group_specs
from torchferry.runtime.files._spill_lease import (
    LOCK_NAME,
    Access,
    SpillLease,
    current,
    made_folders,
    open_regular,
    remove_made,
)
from torchferry.topology import SAFETENSORS_DTYPES, Plan, find_attr

if TYPE_CHECKING:
    from torchferry.runtime.device import Comm

__all__ = [
    "INDEX_NAME",
    "LOCK_NAME",
    "SpillLease",
    "agreed",
    "check_spill",
    "spill",
    "spill_folder",
    "statfs_type",
]

_T = TypeVar("_T")
#: ``statfs`` magic numbers of file systems held in memory: tmpfs and ramfs.
MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
#: Bytes compared at a time when checking whether a file already holds a pack.
_COMPARE_BYTES = 8 << 20

#: The index file of a spill folder (what the file tier opens).
INDEX_NAME = "spill.safetensors.index.json"
_CODES = {name: code for code, name in SAFETENSORS_DTYPES.items()}
#: The temporary names `_temporary` gives (a killed writer's are removed by the next writer alone).
_TEMPORARY = re.compile(r"^\.spill[^/]*\.\d+\.[0-9a-f]{12}\.tmp$")
#: The longest pack part of a file name kept as it is (file names end at 255 bytes).
_NAME_BYTES = 160


def _file_names(packs: Collection[str]) -> dict[str, str]:
    """Each pack's file name: ``spill-<pack>.safetensors``, characters other than letters, digits and
    ``._-`` written as ``-``; a name that is long, or that two packs would share (also on a file system
    that ignores case), ends with a digest of the pack's own name instead."""

    def plain(pack: str) -> str:
        return "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in pack)

    stems = {pack: plain(pack) for pack in packs}
    seen: dict[str, int] = {}
    for stem in stems.values():
        seen[stem.lower()] = seen.get(stem.lower(), 0) + 1
    for pack, stem in stems.items():
        if len(stem.encode()) > _NAME_BYTES or seen[stem.lower()] > 1:
            short = stem.encode()[:_NAME_BYTES].decode("utf-8", "ignore")
            stems[pack] = f"{short}-{hashlib.sha256(pack.encode()).hexdigest()[:12]}"
    return {pack: f"spill-{stem}.safetensors" for pack, stem in stems.items()}


def agreed(comm: Comm | None, what: str, run: Callable[[], _T]) -> _T:
    """``run()``, and with ``comm`` an agreement with an ok flag after it: every rank learns whether
    every rank could ``what`` before any goes on; a rank whose ``run`` failed raises its own error,
    the others an `ExecutionError` naming it."""
    if comm is None:
        return run()
    failure: Exception | None = None
    done: list[_T] = []
    try:
        done.append(run())
    except Exception as exc:
        failure = exc
    try:
        comm.agree(what, what, ok=failure is None)
    except ExecutionError:
        if failure is not None:
            raise failure from None
        raise
    if failure is not None:  # pragma: no cover - the agreement raised on every rank already
        raise failure
    return done[0]


def statfs_type(path: str | os.PathLike[str]) -> int | None:
    """The ``statfs`` file-system magic of ``path`` (``None`` where it cannot be asked)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        statfs = libc.statfs
    except (OSError, AttributeError, TypeError):
        return None
    buffer = ctypes.create_string_buffer(512)  # struct statfs, f_type first (a C long)
    if statfs(os.fsencode(os.fspath(path)), buffer) != 0:
        return None
    return int(ctypes.c_long.from_buffer(buffer).value) & 0xFFFFFFFF


def check_spill(folder: object) -> None:
    """Refuse a ``spill=`` that names no folder before anything else looks at it: another type than a
    path (``TypeError``), or an empty name (`PlanError`: it would be the working directory)."""
    if folder is None:
        return
    text = os.fspath(folder) if isinstance(folder, os.PathLike) else folder
    if not isinstance(text, str):
        raise TypeError(
            f"offload(spill=...) must be a folder path (str or os.PathLike), got {type(folder).__name__} "
            f"{folder!r}"
        )
    if not text.strip():
        raise PlanError(
            f"spill={text!r}: an empty name is no folder (the packs would go into the working "
            "directory); name the folder to write them in, such as spill='/var/tmp/torchferry'"
        )


def spill_folder(folder: str | os.PathLike[str]) -> Path:
    """The spill folder, created if missing; an empty name, one that cannot be created, or one on a
    file system held in memory (tmpfs, ramfs), is a `PlanError` naming the remedy, and the folders a
    refused call made are removed (inside a session's open, they are removed if the open fails)."""
    check_spill(folder)
    shown = os.fspath(folder)
    try:
        where = Path(folder).expanduser()
        made = made_folders(where)
        where.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise PlanError(f"spill={shown!r}: cannot create the folder ({why}); name a writable one") from None
    kind = MEMORY_FILESYSTEMS.get(statfs_type(where) or 0)
    if kind is not None:
        remove_made(made)
        raise PlanError(
            f"spill={shown!r} is on a {kind}, which holds its files in memory (counted against "
            "the process's memory limit and never reclaimed), so spilling there would take the host memory "
            "the host budget keeps free; name a folder on a disk (spill='/var/tmp/torchferry' or a local "
            "SSD), open the pipeline from its checkpoint (checkpoint=), or pass a larger host_memory="
        )
    lease = current()
    if lease is not None:
        lease.made(made)
    return where


def spill(
    pipeline: Any,
    plan: Plan,
    packs: Collection[str],
    folder: str | os.PathLike[str],
    *,
    comm: Comm | None = None,
) -> str:
    """Write the tensors of ``packs`` (file-tier pack names of ``plan``) from ``pipeline`` into
    ``folder``; returns the index path to read them from. Non-persistent buffers are not written (the
    file tier keeps the module's own bytes for them). With ``comm`` (a collective) rank 0 writes
    first and the others after it, keeping the files it wrote (see the module's docstring).

    Inside a session's open (`SpillLease.opening`) this checks what it can, prepares the files and
    returns; the open's lease writes them (`SpillLease.write`) once the open's other checks passed,
    and holds the folder until the session closes. Outside one, the folder is held while writing."""
    files = _prepare(pipeline, plan, packs)
    where = spill_folder(folder)
    shown = os.fspath(folder)
    opening = current()
    if opening is not None:
        opening.defer(lambda: _spill_ranks(files, where, shown, opening, comm))
        return str(where / INDEX_NAME)
    lease = SpillLease()
    try:
        index = _spill_ranks(files, where, shown, lease, comm)
    except BaseException:
        lease.abandon()
        raise
    lease.release()
    return index


def _spill_ranks(files: list[_File], where: Path, shown: str, lease: SpillLease, comm: Comm | None) -> str:
    if comm is None:
        return _spill(files, where, shown, lease)
    rank = comm.rank
    first = agreed(
        comm, "spill the file tier's packs", lambda: _spill(files, where, shown, lease) if rank == 0 else ""
    )
    return agreed(
        comm,
        "find the spilled packs complete",
        lambda: _spill(files, where, shown, lease) if rank != 0 else first,
    )


@attrs.frozen(kw_only=True, eq=False)
class _File:
    """One spill file to be: its name, header, tensors in file order and size."""

    name: str
    head: bytes
    tensors: tuple[tuple[str, torch.Tensor], ...]
    size: int

    @property
    def data_bytes(self) -> int:
        return self.size - len(self.head)


def _prepare(pipeline: Any, plan: Plan, packs: Collection[str]) -> list[_File]:
    """Every file of the spill, refusing (`PlanError`) before any is written what cannot be spilled:
    a tensor on the meta device, or of a dtype safetensors cannot hold."""
    specs = group_specs(plan)
    names = _file_names(packs)
    files: list[_File] = []
    for name in sorted(packs):
        tensors: list[tuple[str, torch.Tensor]] = []
        for spec in specs[name]:
            if spec.buffer and not spec.persistent:
                continue
            t = find_attr(pipeline, spec.name)
            assert isinstance(t, torch.Tensor)
            if t.is_meta:
                raise PlanError(
                    f"spill: {spec.name} is on the meta device, so there is nothing to write; fill the "
                    "pipeline first, or open it from its checkpoint (checkpoint=) instead of spilling"
                )
            tensors.append((spec.name, t))
        files.append(_layout(names[name], tensors))
    return files


def _spill(files: list[_File], where: Path, shown: str, lease: SpillLease) -> str:
    """Write ``files`` and the index into ``where`` under ``lease`` (see [Note: spill ownership])."""
    weight_map = {n: f.name for f in files for n, _ in f.tensors}
    total = sum(f.data_bytes for f in files)
    text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode()
    index = where / INDEX_NAME
    with lease.gate(where) as access:
        if access == "alone":
            _clear_temporaries(where)
        _refuse_folders(where, shown, [f.name for f in files] + [INDEX_NAME])
        todo = [f for f in files if not _holds(where / f.name, f)]
        index_todo = _read_regular(index) != text
        changed = [f.name for f in todo] + ([INDEX_NAME] if index_todo else [])
        if changed:
            _refuse_change(where, shown, lease, access, changed)
            _refuse_room(where, shown, todo, len(text))
            if access == "alone":
                lease.claim()
        try:
            for f in todo:
                _write(where / f.name, f, lease)
            if index_todo:
                _write_bytes(index, text, lease)
        except OSError as exc:
            raise PlanError(_failed(shown, exc, sum(f.size for f in todo) + len(text))) from None
    return str(index)


def _refuse_folders(where: Path, shown: str, names: list[str]) -> None:
    """A folder where a spill file goes cannot be replaced by a file: a `PlanError` before writing."""
    for name in names:
        path = where / name
        if path.is_dir() and not path.is_symlink():
            raise PlanError(
                f"spill={shown!r}: {name} in the folder is a folder, where the spill writes a file; "
                "remove it, or name another folder"
            )


def _refuse_change(where: Path, shown: str, lease: SpillLease, access: Access, changed: list[str]) -> None:
    """Files that must be written into a folder this open may not change as needed: a `PlanError`."""
    if access == "read-only":
        raise PlanError(
            f"spill={shown!r}: cannot write into the folder ({lease.read_only}), and its files do not hold "
            f"this pipeline's packs ({_some(changed)}); nothing was left in it; name a folder this process "
            "can write (spill='/var/tmp/torchferry'), or open the pipeline from its checkpoint (checkpoint=)"
        )
    if access == "shared":
        clash = [name for name in changed if os.path.lexists(where / name)]
        if clash:
            raise PlanError(
                f"spill={shown!r} is in use by another open session (its files were written by "
                f"{lease.owner()}), and its files hold other bytes than this pipeline's ({_some(clash)}); "
                "rewriting them would break that session, so nothing was written; close that session "
                "first, or name another folder (each model spilled at once needs its own)"
            )


def _refuse_room(where: Path, shown: str, todo: list[_File], index_bytes: int) -> None:
    """Files the disk has no room for, or over the process's file-size limit: a `PlanError` before the
    first byte (a file being replaced frees its room once the new one is in place)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    largest = max([index_bytes, *(f.size for f in todo)])
    if soft != resource.RLIM_INFINITY and largest > soft:
        raise PlanError(
            f"spill={shown!r}: a spill file of {format_bytes(largest, exact=False)} is over this "
            f"process's file-size limit of {format_bytes(soft, exact=False)} (ulimit -f), so nothing was "
            "written; raise the limit, or open the pipeline from its checkpoint (checkpoint=)"
        )
    try:
        fs = os.statvfs(where)
    except OSError:
        return
    block = max(fs.f_frsize, 1)
    need = sum(-(-f.size // block) * block for f in todo) + index_bytes
    freed = 0
    for f in todo:
        with contextlib.suppress(OSError):
            freed += (where / f.name).lstat().st_size
    room = fs.f_bavail * block
    if need > room + freed:
        raise PlanError(
            f"spill={shown!r}: the disk has {format_bytes(room, exact=False)} free and the spill needs "
            f"{format_bytes(need, exact=False)} there, so nothing was written; free space, name a folder "
            "on a larger disk, or pass a larger host_memory= so fewer packs are spilled"
        )


def _failed(shown: str, exc: OSError, need: int) -> str:
    """Why a write into the spill folder failed, and what to do."""
    what = f"{exc.strerror or exc}" + (f": {Path(exc.filename).name}" if exc.filename else "")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = (
            f"the disk filled up ({what}); the spill needs {format_bytes(need, exact=False)} there; free "
            "space, or name a folder on a larger disk"
        )
    elif exc.errno == errno.EFBIG:
        fix = f"a file grew past a size limit ({what}); raise the limit (ulimit -f), or name another folder"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"the folder cannot be written ({what}); name a folder this process can write"
    else:
        fix = f"writing failed ({what}); check the folder and the drive (dmesg)"
    return (
        f"spill={shown!r}: {fix}, or open the pipeline from its checkpoint (checkpoint=); nothing this "
        "open wrote was left behind"
    )


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _clear_temporaries(where: Path) -> None:
    """Remove the temporary files of writers that died (the folder's gate and lock are held alone, so
    no other writer has one open)."""
    try:
        names = os.listdir(where)
    except OSError:
        return
    for name in names:
        if _TEMPORARY.match(name):
            with contextlib.suppress(OSError):
                (where / name).unlink()


def _temporary(path: Path) -> Path:
    """A temporary name beside ``path`` that no other process or thread picks."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


def _read_regular(path: Path) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (never blocking on a FIFO or a device), else None."""
    fd = open_regular(path)
    if fd is None:
        return None
    try:
        with open(fd, "rb") as f:
            return f.read()
    except OSError:
        return None


def _holds(path: Path, file: _File) -> bool:
    """Whether ``path`` is a complete regular file of exactly ``file``'s header and tensor bytes."""
    fd = open_regular(path)
    if fd is None:
        return False
    try:
        with open(fd, "rb") as f:
            if os.fstat(f.fileno()).st_size != file.size or f.read(len(file.head)) != file.head:
                return False
            chunk = bytearray(_COMPARE_BYTES)
            for _, t in file.tensors:
                flat = _contiguous(t).reshape(-1).view(torch.uint8)
                at = 0
                while at < flat.numel():
                    n = min(_COMPARE_BYTES, flat.numel() - at)
                    if f.readinto(memoryview(chunk)[:n]) != n:
                        return False
                    seen = torch.frombuffer(chunk, dtype=torch.uint8, count=n)
                    if not torch.equal(seen, flat[at : at + n]):
                        return False
                    at += n
    except OSError:
        return False
    return True


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    data = t.detach()
    return data if data.is_contiguous() else data.contiguous()


#: Spilled tensors start on this many bytes where their sizes allow (CPU kernels may round operands
#: at other addresses differently, and file-tier tensors are views of these files after close).
SPILL_ALIGN = 64


def _layout(name: str, tensors: list[tuple[str, torch.Tensor]]) -> _File:
    """One safetensors file of ``tensors``. safetensors allows no gaps, so the header is padded to
    start the data on `SPILL_ALIGN` bytes, the tensors whose size is a multiple of `SPILL_ALIGN` go
    first (each then starts aligned), and the others after them, widest element first (each still on
    a multiple of its element size). A dtype safetensors cannot hold is a `PlanError`."""
    ordered = sorted(
        tensors,
        key=lambda nt: (nt[1].numel() * nt[1].element_size() % SPILL_ALIGN != 0, -nt[1].element_size()),
    )
    header: dict[str, Any] = {}
    offset = 0
    for tensor_name, t in ordered:
        code = _CODES.get(str(t.dtype).removeprefix("torch."))
        if code is None:
            raise PlanError(
                f"spill: {tensor_name} is {t.dtype}, which safetensors cannot hold; keep it in host memory"
            )
        nbytes = t.numel() * t.element_size()
        span = [offset, offset + nbytes]
        header[tensor_name] = {"dtype": code, "shape": list(t.shape), "data_offsets": span}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % SPILL_ALIGN)  # the data starts on a SPILL_ALIGN boundary
    head = len(raw).to_bytes(8, "little") + raw
    return _File(name=name, head=head, tensors=tuple(ordered), size=len(head) + offset)


def _write(path: Path, file: _File, lease: SpillLease) -> None:
    """``file`` written to ``path`` under a temporary name, then renamed into place."""
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(file.head)
            for _, t in file.tensors:
                data = _contiguous(t)
                n = data.numel() * data.element_size()
                if n:
                    f.write((ctypes.c_char * n).from_address(data.data_ptr()))
        os.replace(tmp, path)
        lease.wrote(path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_bytes(path: Path, data: bytes, lease: SpillLease) -> None:
    tmp = _temporary(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
        lease.wrote(path)
    finally:
        tmp.unlink(missing_ok=True)
