"""Whether a file open for reading is still what it was when opened: the one comparison the
checkpoint reader and the file tier's reader make before they read (see [Note: how a pack is read]
in `torchferry.runtime.files._reader`)."""

from __future__ import annotations

import os

__all__ = ["changed"]


def changed(opened: os.stat_result, now: os.stat_result, *, inode_time: bool = True) -> str | None:
    """How an open file whose ``os.fstat`` was ``opened`` differs in ``now`` (``None``: not at all).

    A rewrite in place moves the size or the modification time, unless the writer sets the time back
    (``os.utime``, ``touch -r``, ``rsync -t``); the inode change time (``inode_time``) finds that one,
    since nothing but the kernel sets it. It also moves when the file is renamed or its permissions,
    owner or link count change (a name replaced by another file drops its link): a visible change of
    mode, owner or links explains it, and only a caller that found the file still under its name
    passes ``inode_time``, so a rename is not taken for a rewrite.
    """
    if now.st_size < opened.st_size:
        return f"was truncated from {opened.st_size} to {now.st_size} bytes"
    if now.st_size != opened.st_size or now.st_mtime_ns != opened.st_mtime_ns:
        return "was rewritten in place"
    same = all(getattr(now, k) == getattr(opened, k) for k in ("st_mode", "st_uid", "st_gid", "st_nlink"))
    if inode_time and same and now.st_ctime_ns != opened.st_ctime_ns:
        return (
            "was rewritten in place with its modification time set back (its inode change time moved, "
            "while its size, modification time, permissions, owner and links did not)"
        )
    return None
