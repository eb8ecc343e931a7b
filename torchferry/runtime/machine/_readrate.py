"""How fast this machine's drive reads a checkpoint, by the file tier's own method: `sequential_read`
reads files start to end with `READ_THREADS` threads, buffered or with ``O_DIRECT`` through aligned
bounce buffers, in the chunks the file tier uses, after dropping the files from the page cache
(``posix_fadvise(POSIX_FADV_DONTNEED)``), so what is measured is the drive, not memory.

``torchferry probe PATH`` saves both rates with the device profile (``read_bytes_per_s``,
``read_direct_bytes_per_s``), where `policies.estimate_cost` finds them; benchmarks/host_tier.py
compares the file tier's throughput with this raw read of the same files in the same run.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from torchferry._errors import PlanError
from torchferry.runtime.files import BOUNCE_BYTES, BUFFERED_CHUNK_BYTES, DIRECT_ALIGN, READ_THREADS

__all__ = ["ReadRate", "drop_cache", "read_files", "sequential_read"]


@attrs.frozen(kw_only=True)
class ReadRate:
    """One timed read: ``nbytes`` read in ``seconds``, ``direct`` or buffered, from ``files``."""

    nbytes: int
    seconds: float
    direct: bool
    files: tuple[str, ...]

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else float("inf")


def read_files(path: str | os.PathLike[str]) -> list[str]:
    """The files a read of ``path`` measures: the file itself when it is a ``*.safetensors`` file, or a
    folder's ``*.safetensors`` files (recursively, so a diffusers pipeline folder counts), largest
    first; anything else is no checkpoint the file tier would read, so a `PlanError`."""
    where = Path(path).expanduser()
    if where.is_file():
        if where.suffix != ".safetensors":
            raise PlanError(
                f"{where}: not a *.safetensors file, so not what the file tier reads; name a checkpoint "
                "file or folder"
            )
        return [str(where)]
    if where.is_dir():
        found = [p for p in where.rglob("*.safetensors") if p.is_file()]
        if found:
            return [str(p) for p in sorted(found, key=lambda p: -p.stat().st_size)]
        raise PlanError(f"{where}: holds no *.safetensors files to read; name a checkpoint file or folder")
    raise PlanError(f"{where}: no such file or folder")


def drop_cache(files: Iterable[str]) -> None:
    """Ask the kernel to drop ``files``' clean pages from the page cache (a hint it honours for pages
    nobody maps), so the next read comes from the drive."""
    if not hasattr(os, "posix_fadvise"):
        return
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            if hasattr(os, "fdatasync"):
                os.fdatasync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(
    files: Sequence[str],
    *,
    direct: bool,
    limit: int | None = None,
    threads: int = READ_THREADS,
    drop: bool = True,
) -> ReadRate:
    """Read ``files`` start to end (at most ``limit`` bytes in all) as the file tier does: chunks of
    `BUFFERED_CHUNK_BYTES` (buffered) or one bounce buffer's worth (``O_DIRECT``) spread over
    ``threads`` threads; the page cache dropped for them first unless ``drop`` is false."""
    if drop:
        drop_cache(files)
    jobs: list[tuple[str, int, int]] = []
    left = limit
    step = BOUNCE_BYTES if direct else BUFFERED_CHUNK_BYTES
    for file in files:
        size = os.path.getsize(file)
        if left is not None:
            size = min(size, left)
            left -= size
        jobs.extend((file, at, min(step, size - at)) for at in range(0, size, step))
        if left == 0:
            break
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fds = {file: os.open(file, flags) for file in dict.fromkeys(f for f, _, _ in jobs)}
    buffers = [mmap.mmap(-1, step) for _ in range(threads)]
    for buffer in buffers:  # touched before the clock starts, as the file tier's staging slots are
        buffer.write(bytes(step))
    free = list(range(threads))
    try:

        def run(job: tuple[str, int, int]) -> int:
            file, at, n = job
            slot = free.pop()
            try:
                length = -(-n // DIRECT_ALIGN) * DIRECT_ALIGN if direct else n
                view = (ctypes.c_char * length).from_buffer(buffers[slot])
                got = 0
                while got < n:
                    r = os.preadv(fds[file], [memoryview(view)[got:length]], at + got)
                    if r <= 0:
                        break
                    got += r
                return min(got, n)
            finally:
                free.append(slot)

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(run, jobs))
        seconds = time.perf_counter() - start
    finally:
        for fd in fds.values():
            os.close(fd)
    return ReadRate(nbytes=total, seconds=seconds, direct=direct, files=tuple(fds))
