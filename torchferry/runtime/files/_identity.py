"""Whether a file open for reading is still what it was when opened: the comparisons the checkpoint
reader and the file tier's reader make around each read (see [Note: how a pack is read] in
`torchferry.runtime.files._reader`).

[Note: the inode change time and the span digests]
A rewrite in place moves the size or the modification time, unless the writer sets the time back
(``os.utime``, ``touch -r``, ``rsync -t``); the inode change time finds that one, since only the
kernel sets it. But the kernel also moves it when nothing about the bytes changed: an extended
attribute set (backup tools, indexers, an SELinux relabel), a rename (the file moved and a symlink
put at its old name), a permission, owner or link change, even one undone before anyone looks; and
``touch`` (a cleaner of old files kept off) moves the modification time alone. So a moved time is a
question, not an answer: `SpanDigests` keeps a CRC-32 of each span's bytes from its first read (taken
while the file's times were still those of the open), and a read made after either time moved is
compared with it once; the same bytes are read on and the new times adopted for that span, other
bytes are a rewrite. A change of size is a rewrite, asked nothing. The steady read pays one
``fstat`` and a dictionary look-up; a span's first read, and its first read after each move, pay a
CRC-32 of its bytes (zlib's, several GiB/s, the GIL released). A span first read after a time moved
has nothing to be compared with, and is refused as a rewrite could be.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Iterable

__all__ = ["SpanDigests", "changed", "crc32"]


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


class SpanDigests:
    """The CRC-32 of each span of a set of files from its first read, and the file times it was last
    found equal at (see [Note: the inode change time and the span digests]); thread-safe."""

    def __init__(self, opened: dict[str, os.stat_result]) -> None:
        #: Each file's (modification, inode change) times when it was opened.
        self.opened = {f: (st.st_mtime_ns, st.st_ctime_ns) for f, st in opened.items()}
        # Why: (file, offset, length) -> (the times the span's bytes were last confirmed at, their
        # CRC-32); read by every reader thread, so behind a lock.
        self._known: dict[tuple[str, int, int], tuple[tuple[int, int], int]] = {}
        self._lock = threading.Lock()
        #: CRC-32s computed (first reads and comparisons), for tests and reports.
        self.computed = 0

    def confirm(
        self, file: str, offset: int, length: int, now: os.stat_result, digest: Callable[[], int]
    ) -> str | None:
        """Whether bytes ``[offset, offset + length)`` of ``file``, just read, may be used when the
        file's ``os.fstat`` after the read is ``now``; ``digest`` computes their CRC-32. ``None``:
        yes; else how the file changed."""
        key = (file, offset, length)
        stamp = (now.st_mtime_ns, now.st_ctime_ns)
        with self._lock:
            known = self._known.get(key)
        if known is not None and known[0] == stamp:
            return None  # the steady read: nothing moved since these bytes were last confirmed
        value = digest()
        moved = stamp[0] != self.opened[file][0]  # the modification time too, not only the change time
        with self._lock:
            self.computed += 1
            if known is None:
                if stamp == self.opened[file]:
                    self._known[key] = (stamp, value)
                    return None
                if moved:
                    return (
                        "was rewritten in place (its modification time moved before these bytes were first "
                        "read, so they cannot be compared with what was opened)"
                    )
                return (
                    "changed its inode change time before these bytes were first read, while its size "
                    "and modification time stayed, so they cannot be told from a rewrite with its "
                    "modification time set back"
                )
            if known[1] != value:
                if moved:
                    return (
                        "was rewritten in place (its modification time moved and these bytes differ from "
                        "what was read here before)"
                    )
                return (
                    "was rewritten in place with its modification time set back (its inode change time "
                    "moved and these bytes differ from what was read here before, while its size and "
                    "modification time did not)"
                )
            self._known[key] = (stamp, value)
        return None
