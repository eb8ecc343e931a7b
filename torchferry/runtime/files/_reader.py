"""The file tier's reader: a small pool of threads that read packs from the checkpoint into staging
buffers, and the read-only views of the checkpoint its tensors point at between uses.

[Note: how a pack is read]
A pack's tensors sit in its flat buffer on 256-byte boundaries (`topology.pack`) and in a safetensors
file back to back, so a run of tensors contiguous in the file is read with one ``os.preadv`` whose
buffers are the tensors' places in the staging buffer: the kernel scatters the file's bytes straight
where they belong, and the gaps between places are never written. `FileReader.plan` turns a pack (or
this rank's shard of it) into such runs once, when the session opens, cut into chunks of at most
``FileReader.chunk_bytes`` (direct I/O: its bounce buffer less an aligned block at each end) or
`BUFFERED_CHUNK_BYTES` (buffered) so that the pool's `READ_THREADS`
threads read one pack together; each chunk is one system call unless the kernel returns less.

Files the page cache cannot keep (larger than what the host leaves it) are read with ``O_DIRECT``:
the device copies into an aligned bounce buffer (one per thread, as large as the plan's largest pack
read needs and at most `BOUNCE_BYTES`: `policies.bounce_bytes`, counted in the host budget) and the
chunk's tensors are copied out of it, so reading a checkpoint larger than memory neither evicts the
rest of the page cache nor, in a memory cgroup, makes the kernel reclaim it on every read. Files
read buffered go through the page cache (a second pass over a file that fits is a memcpy). A file
system that refuses ``O_DIRECT`` (tmpfs) is read buffered.

A tensor the module stores with other strides than the file's row-major order (a transposed weight)
is copied from the file's mapping into its strides; a non-persistent buffer (absent from
checkpoints) from the module's own bytes, kept for it at open. Both run in the reader thread that
finishes a pack's last chunk, so nothing of a read runs on the compute thread.

Every read goes through the descriptors the checkpoint opened (its file names made absolute then,
so a later ``os.chdir`` changes nothing). Before each chunk the file is checked against what it was
when opened: its name must still name the same inode (not replaced, deleted or moved), and the open
file must keep its size (`changed`: not truncated or rewritten in place), and once more after the
chunk is read; a moved identity (a rewrite, even with its time set back, or only ``touch``, an
extended attribute, a rename, a chmod, a copy renamed over the name) is settled by comparing the
header and every span read so far with their digests (see [Note: the file's identity and the span
digests] in `torchferry.runtime.files._identity`). A folder on the way made unsearchable hides the
name, not the file: the read goes on through the descriptor. A failed system call, a short read or
a changed file is an `ExecutionError` naming the file, the byte range, the tensors and what to do;
nothing of the host store is written by a read, so no weight is lost and the session stays
closeable. A process forked from the one that opened the reader may not read (`submit`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from torchferry import policies
from torchferry._errors import ExecutionError, PlanError
from torchferry.runtime.files._checkpoint_reader import CheckpointReader
from torchferry.runtime.files._chunks import Chunk, Fixup, PackRead, chunked
from torchferry.runtime.files._identity import changed, crc32
from torchferry.runtime.files._spans import FileSpan
from torchferry.runtime.memory import PAGE, Piece, page_bytes
from torchferry.topology import TensorSpec

__all__ = [
    "BOUNCE_BYTES",
    "BUFFERED_CHUNK_BYTES",
    "CHUNK_BYTES",
    "DIRECT_ALIGN",
    "READ_THREADS",
    "Chunk",
    "FileReader",
    "FileViews",
    "Fixup",
    "PackRead",
    "Ticket",
    "thread_setup",
]

#: Reader threads (`policies.READ_THREADS`): enough to keep a drive's queue busy while chunks are
#: copied out of their bounce buffers (measured: 2 threads reached 79-80% of a raw direct read of the
#: same file, 4 threads 86-95%).
READ_THREADS = policies.READ_THREADS
#: The alignment ``O_DIRECT`` needs of offsets, lengths and buffers (the largest logical block size).
DIRECT_ALIGN = policies.DIRECT_ALIGN
#: The largest aligned bounce buffer a reader thread holds for direct I/O (`policies.BOUNCE_MAX`); a
#: file tier of smaller packs gets smaller ones (`policies.bounce_bytes`), the figure the tiers count.
BOUNCE_BYTES = policies.BOUNCE_MAX
#: The most bytes of a pack one direct chunk reads through the largest bounce buffer.
CHUNK_BYTES = BOUNCE_BYTES - 2 * DIRECT_ALIGN
#: The most bytes one buffered chunk reads (large: one ``preadv`` each, but a big pack still splits
#: across the threads).
BUFFERED_CHUNK_BYTES = 64 << 20


def error_reason(exc: BaseException) -> str:
    """The operating system's words for why ``exc`` happened, else its text."""
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _buffer(t: torch.Tensor, start: int, length: int) -> Any:
    """A writable buffer over bytes ``[start, start + length)`` of contiguous CPU tensor ``t``."""
    return (ctypes.c_char * length).from_address(t.data_ptr() + start)


class FileViews:
    """Read-only views of checkpoint files, for file-tier tensors between their uses.

    One private mapping (``ACCESS_COPY``) per file, made at the first view: its pages are the page
    cache's file-backed pages, not anonymous memory, so they count in the resident set only while
    touched and the kernel may drop them at any time. A view keeps its mapping alive; nothing is
    unmapped while a tensor points into it (after ``close()`` too).
    """

    def __init__(self, checkpoint: CheckpointReader) -> None:
        self.checkpoint = checkpoint
        self._maps: dict[str, mmap.mmap] = {}

    def view(self, file: str, offset: int, piece: Piece, name: str) -> torch.Tensor:
        """The row-major tensor of ``piece``'s shape and dtype at file offset ``offset`` of ``file``."""
        if piece.nbytes == 0:
            return torch.empty(piece.shape, dtype=piece.dtype)
        size = piece.dtype.itemsize
        if offset % size:
            raise PlanError(
                f"{file}: tensor {name!r} starts at byte {offset}, not a multiple of its {size}-byte "
                f"{str(piece.dtype).removeprefix('torch.')} elements, so it cannot be viewed in place for "
                "the file tier; re-save the checkpoint with safetensors' own writer (it aligns every "
                "tensor), or raise host_memory= so its block stays in host memory"
            )
        mapped = self._maps.get(file)
        if mapped is None:
            fd = self.checkpoint.descriptor(file)
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                mapped.madvise(mmap.MADV_RANDOM)  # a view is read where touched, not ahead
            self._maps[file] = mapped
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=piece.nbytes, offset=offset)
        return flat.view(piece.dtype).view(piece.shape)


@attrs.frozen
class _Opened:
    """A file's descriptors, and what it was when its checkpoint opened it (``stat``: to find it
    replaced, truncated or rewritten)."""

    fd: int
    direct: int | None
    stat: os.stat_result


class Ticket:
    """One pack read in flight: `wait` returns once every chunk and fixup is done, or raises the
    `ExecutionError` of the first that failed."""

    def __init__(self, read: PackRead, into: torch.Tensor) -> None:
        self.read = read
        self.into = into  # held: the threads write it until the ticket is done
        self.futures: list[concurrent.futures.Future[None]] = []
        self.errors: list[BaseException] = []
        self._left = len(read.chunks)
        self._lock = threading.Lock()
        self.started = time.perf_counter()
        self.finished: float | None = None

    @property
    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        concurrent.futures.wait(self.futures)
        for f in self.futures:
            exc = f.exception()
            if exc is not None:
                raise exc
        if self.errors:
            raise self.errors[0]

    def chunk_done(self) -> bool:
        """A chunk finished: whether it was the last (its thread then runs the fixups)."""
        with self._lock:
            self._left -= 1
            return self._left == 0


def thread_setup(device: torch.device | None) -> dict[str, Any]:
    """The reader pool's thread initializer for ``device``: ``torch.cuda.set_device`` on CUDA (nothing
    elsewhere), as keyword arguments of ``ThreadPoolExecutor``."""
    if device is None or device.type != "cuda":
        return {}
    return {"initializer": torch.cuda.set_device, "initargs": (device,)}


class FileReader:
    """Reads packs of a checkpoint into staging buffers on a pool of `READ_THREADS` threads.

    ``direct`` names the files to read with ``O_DIRECT`` (see [Note: how a pack is read]); ``modes``
    says how each file is read in the end. The reader holds the checkpoint's descriptors (and its
    own direct ones) until `close`.
    """

    def __init__(
        self,
        checkpoint: CheckpointReader,
        *,
        direct: Sequence[str] = (),
        threads: int = READ_THREADS,
        device: torch.device | None = None,
        bounce_bytes: int = BOUNCE_BYTES,
        bounces: int | None = None,
    ) -> None:
        if (
            bounce_bytes % DIRECT_ALIGN
            or bounce_bytes <= 2 * DIRECT_ALIGN
            or (bounces is not None and bounces < 1)
        ):
            raise ValueError(
                f"bounce_bytes={bounce_bytes}, bounces={bounces}: a multiple of {DIRECT_ALIGN} over two of "
                "them, and at least one"
            )
        self.checkpoint = checkpoint
        self.views = FileViews(checkpoint)
        self.threads = threads
        self._opened: dict[str, _Opened] = {}
        #: How each file is read: ``"direct"`` or ``"buffered"`` (and why, when direct was refused).
        self.modes: dict[str, str] = {}
        for file in dict.fromkeys(e.file for e in checkpoint.entries.values()):
            fd = checkpoint.descriptor(file)
            info = checkpoint.stats[file]
            raw = self._open_direct(file, info) if file in direct else None
            self.modes.setdefault(file, "buffered")
            self._opened[file] = _Opened(fd, raw, info)
            if raw is None and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        #: The CRC-32 of each span read (the checkpoint's: its header and the host store's reads too),
        #: for a file whose identity moves (see `SpanDigests`).
        self.digests = checkpoint.digests
        self.digests.watching = True
        self._bounces: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self.bounce_bytes = 0
        if any(o.direct is not None for o in self._opened.values()):
            for _ in range(threads if bounces is None else bounces):
                region = mmap.mmap(-1, bounce_bytes)  # page-aligned, so DIRECT_ALIGN-aligned
                self._bounces.put(torch.frombuffer(region, dtype=torch.uint8))
                self.bounce_bytes += bounce_bytes
        #: The most bytes of a pack one direct chunk reads (its aligned span fits one bounce buffer).
        self.chunk_bytes = bounce_bytes - 2 * DIRECT_ALIGN
        # Why: scratch for rearranging tensors stored with other strides, one per thread, sized once
        # (`reserve`) so a read allocates nothing.
        self._scratch: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self.scratch_bytes = 0
        # Why: on CUDA each reader thread makes the session's device current, so the drain waits it
        # runs bind no other device's context.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="torchferry-read", **thread_setup(device)
        )
        self._closed = False
        # Why: a process forked from this one has none of the pool's threads (a read would wait for
        # them for ever) and shares the staging and bounce buffers with it, so it may not read.
        self._pid = os.getpid()
        #: Bytes read from files and ``preadv`` calls made, for reports and benchmarks.
        self.bytes_read = 0
        self.syscalls = 0
        self._stats = threading.Lock()

    def _open_direct(self, file: str, info: os.stat_result) -> int | None:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag or PAGE % DIRECT_ALIGN:
            self.modes[file] = "buffered (no O_DIRECT on this platform)"
            return None
        try:
            raw = os.open(file, os.O_RDONLY | flag)
        except OSError as exc:
            self.modes[file] = f"buffered (O_DIRECT refused: {error_reason(exc)})"
            return None
        now = os.fstat(raw)
        if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            os.close(raw)
            raise ExecutionError(f"{file} was replaced on disk while the session opened it; open it again")
        self.modes[file] = "direct"
        return raw

    # ------------------------------------------------------------------------------- planning
    def plan(
        self,
        name: str,
        *,
        layout: Sequence[tuple[TensorSpec, int]],
        pieces: Sequence[Piece],
        span: tuple[int, int] | None,
        module_bytes: Mapping[str, torch.Tensor],
        prefix_map: Mapping[str, str] | None = None,
    ) -> PackRead:
        """How to read pack ``name`` (``layout``, its ``pieces``), or bytes ``span`` of it, from the
        checkpoint; ``module_bytes`` holds the non-persistent buffers' bytes in their pieces' strides."""
        nbytes = max((off + s.nbytes for s, off in layout), default=0)
        start, end = span if span is not None else (0, nbytes)
        whole = {s.name: s for s in self.checkpoint.spans(layout, 0, nbytes, prefix_map)}
        direct = {f for f, o in self._opened.items() if o.direct is not None}
        runs: list[FileSpan] = []
        fixups: list[Fixup] = []
        by_name = {spec.name: (spec, off, piece) for (spec, off), piece in zip(layout, pieces, strict=True)}
        for part in self.checkpoint.spans(layout, start, end, prefix_map):
            _, off, piece = by_name[part.name]
            lo, hi = part.dst + start - off, part.dst + start - off + part.length
            if part.file is None and part.name not in module_bytes:
                raise PlanError(
                    f"{part.name} is held as {str(piece.dtype).removeprefix('torch.')} but stored in the "
                    "checkpoint in another dtype (storage_dtype=), and the file tier reads bytes as they "
                    f"are stored; keep {name} in host memory (a larger host_memory=) or drop storage_dtype="
                )
            if part.file is None:
                fixups.append(Fixup(part.dst - lo, lo, hi, piece, part.name, source=module_bytes[part.name]))
            elif piece.row_major:
                runs.append(part)
            elif (lo, hi) == (0, piece.nbytes):  # read in place with its run, then rearranged there
                runs.append(part)
                fixups.append(Fixup(part.dst, lo, hi, piece, part.name, in_place=True))
            else:  # a shard's part of it: the whole tensor is read aside, arranged, and the part taken
                full = whole[part.name]
                fixups.append(Fixup(part.dst - lo, lo, hi, piece, part.name, file=full.file, src=full.src))
        chunks: list[Chunk] = []
        for file in dict.fromkeys(r.file for r in runs if r.file is not None):
            limit = self.chunk_bytes if file in direct else BUFFERED_CHUNK_BYTES
            mine = sorted((r for r in runs if r.file == file), key=lambda r: r.src)
            chunks.extend(chunked(file, mine, limit))
        return PackRead(name=name, nbytes=end - start, chunks=tuple(chunks), fixups=tuple(fixups))

    def reserve(self, reads: Sequence[PackRead]) -> None:
        """Allocate the rearranging scratch ``reads`` need: per thread, twice their largest tensor
        stored with other strides (none when every tensor is row-major)."""
        need = 2 * max((f.piece.nbytes for r in reads for f in r.fixups if f.source is None), default=0)
        if need == 0:
            return
        for _ in range(self.threads):
            self._scratch.put(torch.frombuffer(mmap.mmap(-1, need), dtype=torch.uint8))
            self.scratch_bytes += page_bytes(need)

    # -------------------------------------------------------------------------------- reading
    def submit(self, read: PackRead, into: torch.Tensor, before: Callable[[], None] | None = None) -> Ticket:
        """Start reading ``read`` into the first bytes of ``into`` (a contiguous CPU ``uint8`` tensor);
        each thread first calls ``before`` (the wait for the buffer's last reader to finish)."""
        if self._closed:
            raise ExecutionError(f"the file tier's reader of {self.checkpoint.path} is closed")
        if os.getpid() != self._pid:
            raise ExecutionError(
                f"read of {read.name}: this session was opened in process {self._pid} and this is process "
                f"{os.getpid()}, forked from it; a forked process has none of the file tier's reader threads "
                "and shares its staging buffers with the process that opened it, so it cannot read from the "
                "checkpoint; open a session of its own in this process (torchferry.offload after the fork), "
                "or start it with the 'spawn' method of multiprocessing"
            )
        if into.numel() < read.nbytes:
            raise ExecutionError(
                f"read of {read.name}: the staging buffer holds {into.numel()} bytes, the read {read.nbytes}"
            )
        ticket = Ticket(read, into)
        if not read.chunks:
            ticket.futures.append(self._pool.submit(self._finish, ticket, before))
            return ticket
        for chunk in read.chunks:
            ticket.futures.append(self._pool.submit(self._run, ticket, chunk, before))
        return ticket

    def _run(self, ticket: Ticket, chunk: Chunk, before: Callable[[], None] | None) -> None:
        try:
            if before is not None:
                before()
            self._check_file(chunk.file)
            opened = self._opened[chunk.file]
            if opened.direct is not None:
                self._direct(opened.direct, chunk, ticket.into)
            else:
                self._buffered(opened.fd, chunk, ticket.into)
                into = ticket.into
                self._confirm(chunk, lambda: crc32(_buffer(into, d, n) for d, n in chunk.parts))
        except BaseException as exc:
            ticket.errors.append(self._failure(ticket.read, chunk, exc))
        if ticket.chunk_done():
            self._finish(ticket, None)

    def _finish(self, ticket: Ticket, before: Callable[[], None] | None) -> None:
        """The last chunk is in: apply the fixups (unless a chunk failed)."""
        try:
            if before is not None:
                before()
            if not ticket.errors:
                for fixup in ticket.read.fixups:
                    self._fix(fixup, ticket.into)
        except BaseException as exc:
            if not isinstance(exc, ExecutionError):
                exc = ExecutionError(f"read of {ticket.read.name}: {type(exc).__name__}: {exc}")
            ticket.errors.append(exc)
        ticket.finished = time.perf_counter()

    def _fix(self, fixup: Fixup, into: torch.Tensor) -> None:
        piece = fixup.piece
        if fixup.source is not None:
            into[fixup.dst + fixup.lo : fixup.dst + fixup.hi].copy_(fixup.source[fixup.lo : fixup.hi])
            return
        n = piece.nbytes
        try:
            scratch = self._scratch.get_nowait()
        except queue.Empty:  # a read planned without `reserve` (tests): scratch of its own
            scratch = torch.empty(2 * n, dtype=torch.uint8)
        if scratch.numel() < 2 * n:
            scratch = torch.empty(2 * n, dtype=torch.uint8)
        try:
            rows = scratch[:n]
            if fixup.in_place:
                rows.copy_(into[fixup.dst : fixup.dst + n])
                piece.view(into, fixup.dst).copy_(rows.view(piece.dtype).view(piece.shape))
                return
            assert fixup.file is not None
            self._check_file(fixup.file)
            chunk = Chunk(file=fixup.file, offset=fixup.src, parts=((0, n),), names=(fixup.name,))
            self._buffered(self._opened[fixup.file].fd, chunk, rows)
            self._confirm(chunk, lambda: crc32([_buffer(rows, 0, n)]))
            arranged = scratch[n : 2 * n]
            piece.view(arranged, 0).copy_(rows.view(piece.dtype).view(piece.shape))
            into[fixup.dst + fixup.lo : fixup.dst + fixup.hi].copy_(arranged[fixup.lo : fixup.hi])
        finally:
            self._scratch.put(scratch)

    def _check_file(self, file: str) -> None:
        """`_Changed` unless ``file``'s name still names the file opened, of the same size and
        modification time (see the Note); a folder made unsearchable hides the name, not the file,
        which is read on through its descriptor."""
        opened = self._opened[file]
        try:
            now: os.stat_result | None = os.stat(file)
        except PermissionError:
            now = None
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise _Changed(
                f"is no longer at its path ({error_reason(exc)}): it was deleted, or moved with its folder",
                fix="put it back where it was, or close() the session and open a new one from where it is",
            ) from None
        except OSError as exc:
            raise OSError(exc.errno, f"looking the file up failed ({error_reason(exc)})") from None
        # a copy renamed over it reads on through the descriptor opened; another file is refused
        if (
            now is not None
            and (now.st_dev, now.st_ino) != (opened.stat.st_dev, opened.stat.st_ino)
            and (change := self.digests.renamed_over(file, file, now)) is not None
        ):
            raise _Changed(change)
        if (change := changed(opened.stat, os.fstat(opened.fd), mtime=False)) is not None:
            raise _Changed(change)

    def _confirm(self, chunk: Chunk, digest: Callable[[], int]) -> None:
        """`_Changed` unless the bytes of ``chunk`` just read may be used: the file is looked at again
        after the read (a rewrite during it), and a moved inode change time is settled by the span's
        digest (see [Note: the file's identity and the span digests])."""
        fd = self._opened[chunk.file].fd
        held = os.fstat(fd)
        if (change := changed(self._opened[chunk.file].stat, held, mtime=False)) is not None:
            raise _Changed(change)
        if change := self.digests.confirm(
            chunk.file, fd, chunk.offset, chunk.length, now=held, digest=digest
        ):
            raise _Changed(change)

    def _buffered(self, fd: int, chunk: Chunk, into: torch.Tensor) -> None:
        parts = list(chunk.parts)
        done, total, calls = 0, chunk.length, 0
        while done < total:
            got = os.preadv(fd, [_buffer(into, d, n) for d, n in parts], chunk.offset + done)
            calls += 1
            if got <= 0:
                raise _Short(chunk.offset + done)
            done += got
            while parts and got >= parts[0][1]:
                got -= parts.pop(0)[1]
            if got:
                d, n = parts[0]
                parts[0] = (d + got, n - got)
        self._count(total, calls)

    def _direct(self, fd: int, chunk: Chunk, into: torch.Tensor) -> None:
        bounce = self._bounces.get()
        try:
            first = chunk.offset - chunk.offset % DIRECT_ALIGN
            need = chunk.offset + chunk.length - first
            length = -(-need // DIRECT_ALIGN) * DIRECT_ALIGN
            got = calls = 0
            while got < need:
                n = os.preadv(fd, [_buffer(bounce, got, length - got)], first + got)
                calls += 1
                if n <= 0 or (n % DIRECT_ALIGN and got + n < need):
                    raise _Short(first + got + max(n, 0))
                got += n
            cursor = chunk.offset - first
            self._confirm(chunk, lambda: crc32([_buffer(bounce, cursor, chunk.length)]))
            for dst, n in chunk.parts:
                into[dst : dst + n].copy_(bounce[cursor : cursor + n])
                cursor += n
        finally:
            self._bounces.put(bounce)
        self._count(chunk.length, calls)

    def _count(self, nbytes: int, calls: int) -> None:
        with self._stats:
            self.bytes_read += nbytes
            self.syscalls += calls

    def _failure(self, read: PackRead, chunk: Chunk, exc: BaseException) -> ExecutionError:
        """The error a failed chunk raises at its load: the file, the bytes, the tensors, what to do."""
        names = ", ".join(chunk.names[:3]) + (", ..." if len(chunk.names) > 3 else "")
        where = f"bytes [{chunk.offset}, {chunk.offset + chunk.length}) of {chunk.file} (tensor {names})"
        keep = "nothing was lost: the session's other weights are untouched and it can be closed; "
        if isinstance(exc, _Short):
            what = f"the file ended at byte {exc.at}: it was truncated while the session reads it"
            fix = "restore the file (re-save or re-download it) and open a new session"
        elif isinstance(exc, _Changed):
            what = f"the file {exc}"
            fix = exc.fix
        elif isinstance(exc, OSError):
            what = f"the read failed: {error_reason(exc)} (errno {exc.errno})"
            fix = "check the drive (dmesg), then run the step again or close() the session"
        else:
            what = f"{type(exc).__name__}: {exc}"
            fix = "close() the session"
        head = f"reading {read.name} from its checkpoint failed at {where}: {what}; "
        return ExecutionError(head + keep + fix)

    # ------------------------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Wait for reads in flight, stop the threads, close the direct descriptors and drop the bounce
        and scratch buffers (their memory goes back to the system); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        for opened in self._opened.values():
            if opened.direct is not None:
                os.close(opened.direct)
        for buffers in (self._bounces, self._scratch):
            with contextlib.suppress(queue.Empty):
                while True:
                    buffers.get_nowait()  # the last reference: its mapping is unmapped
        self.bounce_bytes = self.scratch_bytes = 0


_REOPEN = "do not rewrite a checkpoint while a session reads it; close() and open a new session"


class _Short(Exception):
    def __init__(self, at: int) -> None:
        super().__init__(at)
        self.at = at


class _Changed(Exception):
    def __init__(self, what: str, fix: str = _REOPEN) -> None:
        super().__init__(what)
        self.fix = fix
