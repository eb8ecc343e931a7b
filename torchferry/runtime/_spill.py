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

The folder must be on a disk: a tmpfs (``/dev/shm``, often ``/tmp``) keeps its files in memory that
counts against the process's memory cgroup and cannot be reclaimed, which would defeat the host
budget, so it is a `PlanError`. Several ranks of a process group spilling into one folder (their
weights are the same: the distributed strategy needs it) do not race: rank 0 writes while the others
wait, then each other rank finds the files complete and identical and keeps them (on a folder local
to another node, it writes its own), and no rank reads before every rank is done (`agreed`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import secrets
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from torchferry._errors import ExecutionError, PlanError
from torchferry.policies import group_specs
from torchferry.topology import SAFETENSORS_DTYPES, Plan, find_attr

if TYPE_CHECKING:
    from torchferry.runtime._comm import Comm

__all__ = ["INDEX_NAME", "agreed", "spill", "spill_folder", "statfs_type"]

_T = TypeVar("_T")
#: ``statfs`` magic numbers of file systems held in memory: tmpfs and ramfs.
MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
#: Bytes compared at a time when checking whether a file already holds a pack.
_COMPARE_BYTES = 8 << 20

#: The index file of a spill folder (what the file tier opens).
INDEX_NAME = "spill.safetensors.index.json"
_CODES = {name: code for code, name in SAFETENSORS_DTYPES.items()}


def _file_name(pack: str) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in pack)
    return f"spill-{safe}.safetensors"


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


def spill_folder(folder: str | os.PathLike[str]) -> Path:
    """The spill folder, created if missing; one that cannot be created, or on a file system held in
    memory (tmpfs, ramfs), is a `PlanError` naming the remedy."""
    where = Path(folder).expanduser()
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlanError(
            f"spill={os.fspath(folder)!r}: cannot create the folder ({exc}); name a writable one"
        ) from None
    kind = MEMORY_FILESYSTEMS.get(statfs_type(where) or 0)
    if kind is not None:
        raise PlanError(
            f"spill={os.fspath(folder)!r} is on a {kind}, which holds its files in memory (counted against "
            "the process's memory limit and never reclaimed), so spilling there would take the host memory "
            "the host budget keeps free; name a folder on a disk (spill='/var/tmp/torchferry' or a local "
            "SSD), open the pipeline from its checkpoint (checkpoint=), or pass a larger host_memory="
        )
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
    first and the others after it, keeping the files it wrote (see the module's docstring)."""
    where = spill_folder(folder)
    if comm is None:
        return _spill(pipeline, plan, packs, where)
    rank = comm.rank
    first = agreed(
        comm, "spill the file tier's packs", lambda: _spill(pipeline, plan, packs, where) if rank == 0 else ""
    )
    later = agreed(
        comm,
        "find the spilled packs complete",
        lambda: _spill(pipeline, plan, packs, where) if rank != 0 else first,
    )
    return later


def _spill(pipeline: Any, plan: Plan, packs: Collection[str], where: Path) -> str:
    specs = group_specs(plan)
    weight_map: dict[str, str] = {}
    total = 0
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
        file = _file_name(name)
        total += _write(where / file, tensors)
        weight_map.update(dict.fromkeys((n for n, _ in tensors), file))
    index = where / INDEX_NAME
    text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode()
    try:
        same = index.read_bytes() == text
    except OSError:
        same = False
    if not same:
        tmp = _temporary(index)
        try:
            tmp.write_bytes(text)
            os.replace(tmp, index)
        finally:
            tmp.unlink(missing_ok=True)
    return str(index)


def _temporary(path: Path) -> Path:
    """A temporary name beside ``path`` that no other process or thread picks."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


def _holds(path: Path, head: bytes, ordered: list[tuple[str, torch.Tensor]], size: int) -> bool:
    """Whether ``path`` is a complete file of exactly ``head`` followed by the bytes of ``ordered``."""
    try:
        if path.stat().st_size != size:
            return False
        with open(path, "rb") as f:
            if f.read(len(head)) != head:
                return False
            chunk = bytearray(_COMPARE_BYTES)
            for _, t in ordered:
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


def _write(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> int:
    """One safetensors file of ``tensors``; returns its data bytes. safetensors allows no gaps, so the
    header is padded to start the data on `SPILL_ALIGN` bytes, the tensors whose size is a multiple of
    `SPILL_ALIGN` go first (each then starts aligned), and the others after them, widest element first
    (each still on a multiple of its element size)."""
    ordered = sorted(
        tensors,
        key=lambda nt: (nt[1].numel() * nt[1].element_size() % SPILL_ALIGN != 0, -nt[1].element_size()),
    )
    header: dict[str, Any] = {}
    offset = 0
    for name, t in ordered:
        code = _CODES.get(str(t.dtype).removeprefix("torch."))
        if code is None:
            raise PlanError(
                f"spill: {name} is {t.dtype}, which safetensors cannot hold; keep it in host memory"
            )
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % SPILL_ALIGN)  # the data starts on a SPILL_ALIGN boundary
    head = len(raw).to_bytes(8, "little") + raw
    if _holds(path, head, ordered, len(head) + offset):
        return offset  # already complete and identical: a reader that opened it keeps its file
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for _, t in ordered:
                data = _contiguous(t)
                n = data.numel() * data.element_size()
                if n:
                    f.write((ctypes.c_char * n).from_address(data.data_ptr()))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return offset
