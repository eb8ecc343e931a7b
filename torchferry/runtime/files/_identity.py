"""Whether a file open for reading still holds the bytes the session read from it and planned from:
the comparisons the checkpoint reader and the file tier's reader make around each read (see [Note:
how a pack is read] in `torchferry.runtime.files._reader`).

[Note: the file's identity and the span digests]
A rewrite in place moves the size or the modification time, unless the writer sets the time back
(``os.utime``, ``touch -r``, ``rsync -t``); the inode change time finds that one, since only the
kernel sets it. But the kernel also moves it when nothing about the bytes changed: an extended
attribute set (backup tools, indexers, an SELinux relabel), a rename (the file moved and a symlink
put at its old name), a permission, owner or link change, even one undone before anyone looks; and
``touch`` (a cleaner of old files kept off) moves the modification time alone; a copy of the file
renamed over it (``cp --preserve`` and ``os.replace``, a reflink copy, a re-download of the same
file) puts another inode at its name with the same bytes. So a moved identity (inode, size,
modification or inode change time) is a question, not an answer, and what is asked is whether the
bytes the session depends on changed: the file's header (the plan was made from it) and every span
read so far (the file tier's packs read since the open and, when there is a file tier, the host
store's tensors read at open: without one nothing is read later, so nothing can mix old and new).
`SpanDigests` keeps a CRC-32 of each, taken at its first read while the identity was the one
confirmed last. When the identity moves, every recorded span is read again and compared once
(`SpanDigests.settle`): all equal, the new identity is adopted and reading goes on; one differs, the
file was rewritten, and the read is refused, naming the bytes. A change of size is a rewrite, asked
nothing.

A span first read after the identity moved and never read before is read as the file holds it
then, once the header and every recorded span were found unchanged: what the session serves is then
the file as it is now, as a session opened after the change would read it. A rewrite that changes
only bytes the session had never read (and not its header) is therefore not refused, and needs no
refusal: nothing the session holds came from the old bytes. A name replaced by a copy is compared the
same way, through the new file, and the session reads on through the descriptor it opened, whose
bytes are the ones it planned from.

The steady read pays one ``fstat`` and a dictionary look-up; a span's first read pays a CRC-32 of its
bytes (zlib's, about 3.4 GB/s on one core, the GIL released); a moved identity pays one re-read and
CRC-32 of every byte read so far, once.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Iterable

__all__ = ["SpanDigests", "changed", "crc32", "crc32_at"]

#: The bytes one re-read of a recorded span reads per system call.
_REREAD_BYTES = 16 << 20
#: How many times a moved identity is settled before the file is taken to be changing under the read.
_SETTLE_TRIES = 3

Stamp = tuple[int, int, int, int, int]


def _stamp(st: os.stat_result) -> Stamp:
    """What identifies a file's bytes without reading them: device, inode, size, the two times."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def changed(opened: os.stat_result, now: os.stat_result, *, mtime: bool = True) -> str | None:
    """How an open file whose ``os.fstat`` was ``opened`` visibly differs in ``now``: its size, or its
    modification time unless ``mtime`` is false (``None``: neither; a reader that keeps
    `SpanDigests` asks them about the times)."""
    if now.st_size < opened.st_size:
        return f"was truncated from {opened.st_size} to {now.st_size} bytes"
    if now.st_size != opened.st_size or (mtime and now.st_mtime_ns != opened.st_mtime_ns):
        return "was rewritten in place"
    return None


def crc32(parts: Iterable[memoryview]) -> int:
    """The CRC-32 of ``parts`` read one after another."""
    value = 0
    for part in parts:
        value = zlib.crc32(part, value)
    return value


def crc32_at(fd: int, offset: int, length: int) -> int | None:
    """The CRC-32 of bytes ``[offset, offset + length)`` of the open file ``fd`` (``None``: the file
    ends before them)."""
    value, done = 0, 0
    while done < length:
        got = os.pread(fd, min(_REREAD_BYTES, length - done), offset + done)
        if not got:
            return None
        value = zlib.crc32(got, value)
        done += len(got)
    return value


def _span(offset: int, length: int, header: bool) -> str:
    where = f"bytes [{offset}, {offset + length})"
    return where + (" (its header, which the plan was made from)" if header else "")


class SpanDigests:
    """The CRC-32 of the header and of each span read of a set of files, and the identity (`_stamp`)
    each file's were last confirmed at (see [Note: the file's identity and the span digests]);
    thread-safe."""

    def __init__(self, opened: dict[str, os.stat_result]) -> None:
        # Why: each file's identity when its recorded spans were last confirmed; moved by `settle`.
        self._stamp = {f: _stamp(st) for f, st in opened.items()}
        # Why: each file's identity at its name when last looked at (a copy renamed over it, once
        # compared, is not compared again).
        self._named = dict(self._stamp)
        # Why: (offset, length) -> CRC-32 of each span read, per file; the header's first.
        self._spans: dict[str, dict[tuple[int, int], int]] = {f: {} for f in opened}
        self._headers: dict[str, tuple[int, int]] = {}
        # Why: settling re-reads every span; one thread settles a file while the others wait.
        self._lock = threading.RLock()
        #: Whether a file tier reads these files after the open (a `FileReader` sets it): only then are
        #: the host store's reads digested too (without later reads nothing could mix old and new).
        self.watching = False
        #: CRC-32s of first reads, for tests and reports.
        self.computed = 0
        #: Moved identities settled (each one re-read of every recorded span), for tests and reports.
        self.settled = 0

    def header(self, file: str, fd: int, length: int, same: Callable[[], bool]) -> str | None:
        """Record the CRC-32 of the first ``length`` bytes of ``file`` (its header, just parsed through
        ``fd``); ``same`` parses it again and says whether it reads as it did. ``None``, or how the
        file changed while it was opened."""
        for _ in range(_SETTLE_TRIES):
            before = _stamp(os.fstat(fd))
            value = crc32_at(fd, 0, length)
            if value is None or before[2] != self._stamp[file][2]:
                return "changed its size while its header was read"
            if before != self._stamp[file] and not same():
                return "was rewritten while its header was read (it no longer reads as it did)"
            if _stamp(os.fstat(fd)) != before:
                continue  # moved again while it was compared: once more
            with self._lock:
                # Why: only the identity moved since the parse (a touch, a rename over it, a link),
                # and the header reads as parsed: these bytes and this identity are the ones planned.
                self._stamp[file] = self._named[file] = before
                self._spans[file][(0, length)] = value
                self._headers[file] = (0, length)
            return None
        return "kept changing while its header was read"

    def confirm(
        self, file: str, fd: int, offset: int, length: int, *, now: os.stat_result, digest: Callable[[], int]
    ) -> str | None:
        """Whether bytes ``[offset, offset + length)`` of ``file``, just read through ``fd``, may be used
        when ``os.fstat(fd)`` after the read is ``now``; ``digest`` computes the CRC-32 of the bytes
        read. ``None``: yes; else how the file changed."""
        key = (offset, length)
        stamp = _stamp(now)
        with self._lock:
            steady = stamp == self._stamp[file]
            known = self._spans[file].get(key)
        if steady and known is not None:
            return None  # the steady read: nothing moved since these bytes were confirmed
        value = digest()
        with self._lock:
            if steady and stamp == self._stamp[file]:
                self.computed += 1
                self._spans[file].setdefault(key, value)
                return None
            known = self._spans[file].get(key)
            if known is not None and known != value:
                return self._rewritten(file, stamp, None)
            if (problem := self.settle(file, fd, now)) is not None:
                return problem
            if known is None:
                # read before or after the change: the bytes held must be the file's bytes now
                if crc32_at(fd, offset, length) != value:
                    return f"was rewritten while {_span(offset, length, False)} were being read"
                self.computed += 1
                self._spans[file][key] = value
        return None

    def settle(self, file: str, fd: int, now: os.stat_result) -> str | None:
        """Compare every recorded span of ``file`` with its bytes through ``fd`` (whose ``os.fstat`` was
        ``now``) and, all equal, adopt its identity; ``None``, or how the file changed."""
        with self._lock:
            for _ in range(_SETTLE_TRIES):
                stamp = _stamp(now)
                if stamp == self._stamp[file]:
                    return None
                if stamp[2] != self._stamp[file][2]:
                    return changed_size(self._stamp[file][2], stamp[2])
                for key, value in self._spans[file].items():
                    if crc32_at(fd, *key) != value:
                        return self._rewritten(file, stamp, key)
                after = os.fstat(fd)
                if _stamp(after) == stamp:
                    self.settled += 1
                    self._stamp[file] = stamp
                    return None
                now = after
        return "kept changing while the bytes read from it were compared with it (it is being rewritten)"

    def renamed_over(self, file: str, path: str, named: os.stat_result) -> str | None:
        """Whether the file now at ``path`` (whose ``os.stat`` is ``named``; another inode than the one
        ``file`` opened) holds every recorded span of ``file``: ``None`` (a copy: the session reads on
        through its own descriptor), else what differs."""
        stamp = _stamp(named)
        with self._lock:
            if stamp == self._named[file]:
                return None
            if stamp[2] != self._stamp[file][2]:
                return "was replaced on disk (another file of another size now has its name)"
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                why = exc.strerror or type(exc).__name__
                return f"was replaced on disk (another file now has its name, and it cannot be read: {why})"
            try:
                for _ in range(_SETTLE_TRIES):
                    stamp = _stamp(os.fstat(fd))
                    for key, value in self._spans[file].items():
                        if crc32_at(fd, *key) != value:
                            where = _span(*key, header=key == self._headers.get(file))
                            return f"was replaced on disk (another file has its name, and its {where} differ)"
                    if _stamp(os.fstat(fd)) == stamp:
                        break
                else:
                    return "was replaced on disk (another file now has its name, and it is being written)"
            finally:
                os.close(fd)
            self.settled += 1
            self._named[file] = stamp
        return None

    def _rewritten(self, file: str, stamp: Stamp, key: tuple[int, int] | None) -> str:
        """How ``file`` changed when the recorded span ``key`` (``None``: the bytes being read) differs."""
        moved = stamp[3] != self._stamp[file][3]  # the modification time too, not only the change time
        if key is not None:
            where = _span(*key, header=key == self._headers.get(file))
            if moved:
                return (
                    f"was rewritten in place (its modification time moved and {where}, read before, differ "
                    "from what was read there then)"
                )
            return (
                f"was rewritten in place with its modification time set back (its inode change time moved "
                f"and {where}, read before, differ from what was read there then, while its size and "
                "modification time did not)"
            )
        if moved:
            return (
                "was rewritten in place (its modification time moved and these bytes differ from what "
                "was read here before)"
            )
        return (
            "was rewritten in place with its modification time set back (its inode change time moved and "
            "these bytes differ from what was read here before, while its size and modification time did "
            "not)"
        )


def changed_size(before: int, now: int) -> str:
    """How a file of ``before`` bytes that now has ``now`` changed."""
    if now < before:
        return f"was truncated from {before} to {now} bytes"
    return "was rewritten in place"
