"""Who owns a spill folder: the lock a session holds on the folder it spilled into, and what an open
that fails takes back out of it.

[Note: spill ownership]
A session reads its spilled packs for as long as it is open, and it checks that each file is still the
one it opened, so a second model written into the same folder would break it. A folder in use is
therefore owned: every session that spills into it holds a shared `flock` on its lock file
(`LOCK_NAME`) from its open until `close` (or its process's death, which the kernel releases). Writing
needs the folder alone: an open that finds no other holder takes the lock exclusively and may
replace any file; one that finds other holders may only keep files that already hold exactly its
bytes, and add files that are missing, and a file that would have to change is a `PlanError` naming
the folder and the process that wrote its files, before a byte is written. Checking and writing
happen under a second lock, on the folder itself (the *gate*), so no two opens check or write a
folder at once and an exclusive writer's step down to shared cannot be overtaken; an open arriving
while another writes waits for it (ranks of a process group spilling into one folder do, rank 0
first). A process forked while a session is open drops its copy of the lock (the session is its
parent's), so the lock lives exactly as long as the session that took it.

An open that fails after its spill began (another check, another rank, an interrupt) removes the
files it wrote, the lock file it made and the folders it made, unless another session took the files
up meanwhile. Files the open found complete and kept are never removed: they may be another
pipeline's views (the files stay after a session closes, see `torchferry.runtime.files._spill`).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fcntl
import os
import socket
import stat
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from torchferry._errors import PlanError

__all__ = ["LOCK_NAME", "Access", "SpillLease", "current", "made_folders", "open_regular", "remove_made"]

#: How an open may change a spill folder: ``alone`` (no other session uses it: any file may be
#: replaced), ``shared`` (others do: files may only be added), ``read-only`` (nothing may be written).
Access = Literal["alone", "shared", "read-only"]

#: The lock file of a spill folder: sessions using the folder hold a shared ``flock`` on it; it
#: names the process that last wrote the folder's files.
LOCK_NAME = "spill.lock"

_OPENING: contextvars.ContextVar[SpillLease | None] = contextvars.ContextVar("torchferry_spill", default=None)
_LEASES: weakref.WeakSet[SpillLease] = weakref.WeakSet()
#: Folder descriptors whose gate is held now (a forked child closes its copies, see `_forget_in_child`).
_GATES: set[int] = set()


def current() -> SpillLease | None:
    """The lease of the session being opened in this context (``None``: none is)."""
    return _OPENING.get()


def open_regular(path: Path, flags: int = os.O_RDONLY) -> int | None:
    """A descriptor of ``path`` if it is a regular file (following links), else ``None``: a FIFO, a
    device or a folder is never opened in a way that blocks (``O_NONBLOCK``), and is closed again."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return fd


def made_folders(where: Path) -> list[Path]:
    """The folders ``where.mkdir(parents=True)`` would make, outermost first."""
    missing: list[Path] = []
    at = where
    while not at.exists() and not at.is_symlink() and at != at.parent:
        missing.append(at)
        at = at.parent
    return missing[::-1]


def remove_made(folders: list[Path]) -> None:
    """Remove ``folders`` (outermost first, as `made_folders` lists them) where they are empty."""
    for folder in reversed(folders):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _shown(where: Path) -> str:
    return repr(os.fspath(where))


class SpillLease:
    """One session's hold on its spill folder (see [Note: spill ownership]).

    ``opening()`` brackets the session's open: a `spill` inside it only prepares (checks what it can
    and names the files) and `write` writes it, once every other check of the open has passed; if the
    open fails, `abandon` takes out what it wrote. `release` (at ``close``) lets the folder go.
    """

    def __init__(self) -> None:
        #: The folder whose lock this lease holds (``None``: none yet).
        self.folder: Path | None = None
        self._lock: int | None = None  # Why: the lock file's descriptor, flocked while the session is open.
        self._wrote: list[Path] = []  # Why: files this open wrote, taken out again if the open fails.
        self._made: list[Path] = []  # Why: folders this open made, likewise.
        self._made_lock: Path | None = None  # Why: the lock file, when this open made it.
        self._pending: list[Callable[[], object]] = []  # Why: the spill `opening` prepared, for `write`.
        #: Why the folder cannot be written (its lock file could not be made), or ``None``.
        self.read_only: str | None = None
        _LEASES.add(self)

    # ------------------------------------------------------------------------------ the open
    @contextlib.contextmanager
    def opening(self) -> Iterator[SpillLease]:
        """The session's open: a spill inside is prepared, not written (`write`), and if the block
        raises, what this open wrote is taken out again (`abandon`) before the error goes on."""
        token = _OPENING.set(self)
        try:
            yield self
        except BaseException:
            self.abandon()
            raise
        finally:
            _OPENING.reset(token)

    def defer(self, run: Callable[[], object]) -> None:
        """Keep the spill ``run`` until `write` (called by `spill` inside `opening`)."""
        self._pending.append(run)

    def write(self) -> None:
        """Write the spill prepared in `opening`, now that the open's every other check passed."""
        pending, self._pending = self._pending, []
        for run in pending:
            run()

    def made(self, folders: list[Path]) -> None:
        """Note folders this open made, to be removed if the open fails."""
        self._made.extend(folders)

    def wrote(self, path: Path) -> None:
        """Note a file this open wrote, to be removed if the open fails."""
        self._wrote.append(path)

    # ------------------------------------------------------------------------------- the lock
    @contextlib.contextmanager
    def gate(self, where: Path) -> Iterator[Access]:
        """Hold ``where``'s gate and its lock for checking and writing: yields how this open may
        change the folder (`Access`). Afterwards the lock stays held, shared, until `release`."""
        gate = _take_gate(where)
        assert gate is not None
        try:
            if self.folder is None:
                self.folder = where
                self._lock, made, self.read_only = _open_lock(where)
                if made:
                    self._made_lock = where / LOCK_NAME
            if self.read_only is not None:  # nothing is written: sharing the lock keeps writers out
                if self._lock is not None and not _flock(self._lock, fcntl.LOCK_SH, where):
                    raise PlanError(  # pragma: no cover - only a writer holds it alone, under the gate
                        f"spill={_shown(where)}: another session holds the folder's lock while writing it"
                    )
                yield "read-only"
                return
            assert self._lock is not None
            alone = _flock(self._lock, fcntl.LOCK_EX, where)
            if not alone and not _flock(self._lock, fcntl.LOCK_SH, where):
                raise PlanError(  # pragma: no cover - only a writer holds it alone, and only under the gate
                    f"spill={_shown(where)}: another session holds the folder's lock ({LOCK_NAME}) while "
                    "writing it; wait for it to open, or name another folder"
                )
            yield "alone" if alone else "shared"
            if alone:
                _flock(self._lock, fcntl.LOCK_SH, where)  # under the gate: no other open sees the change
        finally:
            _close_gate(gate)

    def owner(self) -> str:
        """Who wrote the folder's files, as its lock file says (``"another process"`` if it does not)."""
        if self._lock is None:
            return "another process"
        try:
            text = os.pread(self._lock, 256, 0).decode("utf-8", "replace").strip()
        except OSError:
            text = ""
        return text or "another process"

    def claim(self) -> None:
        """Write this process into the lock file (it holds the lock alone and is writing the files)."""
        if self._lock is None:
            return
        text = f"process {os.getpid()} on {socket.gethostname()}".encode()
        with contextlib.suppress(OSError):  # a lock opened read-only cannot say who holds it
            os.ftruncate(self._lock, 0)
            os.pwrite(self._lock, text, 0)

    # --------------------------------------------------------------------------- the ending
    def abandon(self) -> None:
        """The open failed: remove the files it wrote and the lock file and folders it made (unless
        another session took the folder up meanwhile), then let the folder go."""
        try:
            folder = self.folder
            if folder is not None and self._lock is not None and (self._wrote or self._made_lock):
                gate = _take_gate(folder, missing_ok=True)
                try:
                    if gate is not None and _flock(self._lock, fcntl.LOCK_EX, folder):
                        for path in [*self._wrote, *([self._made_lock] if self._made_lock else [])]:
                            with contextlib.suppress(OSError):
                                path.unlink()
                finally:
                    if gate is not None:
                        _close_gate(gate)
            self.release()
            remove_made(self._made)
        finally:
            self._wrote, self._made, self._made_lock, self._pending = [], [], None, []
            self.release()

    def release(self) -> None:
        """Let the folder go (the session closed): other sessions may write it again."""
        lock, self._lock = self._lock, None
        if lock is not None:
            os.close(lock)

    def _forget(self) -> None:
        """In a forked child: drop this process's copy of the lock without unlocking it (the parent's
        session holds it) and forget what the parent's open wrote."""
        lock, self._lock = self._lock, None
        if lock is not None:
            with contextlib.suppress(OSError):
                os.close(lock)
        self._wrote, self._made, self._made_lock, self._pending = [], [], None, []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()


def _forget_in_child() -> None:
    """A forked child lets go of its copies of every lock and gate this process held (they are the
    parent's: the child's copy would keep the folder locked after the parent's session closed)."""
    for lease in list(_LEASES):
        lease._forget()
    for fd in list(_GATES):
        _GATES.discard(fd)
        with contextlib.suppress(OSError):
            os.close(fd)


def _close_gate(fd: int) -> None:
    _GATES.discard(fd)
    os.close(fd)


os.register_at_fork(after_in_child=_forget_in_child)


def _take_gate(where: Path, *, missing_ok: bool = False) -> int | None:
    """The folder's descriptor, flocked exclusively (waiting while another open checks or writes it);
    ``None`` when ``missing_ok`` and the folder is gone."""
    while True:
        try:
            fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise PlanError(f"spill={_shown(where)}: the folder was removed while opening") from None
        except OSError as exc:
            raise PlanError(f"spill={_shown(where)}: cannot open the folder ({exc.strerror})") from None
        _GATES.add(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            _close_gate(fd)
            raise PlanError(_no_locks(where, exc)) from None
        try:
            same = os.stat(where).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        _close_gate(fd)  # removed (a failed open took out the folder it made) while this one waited
        if missing_ok:
            return None
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PlanError(f"spill={_shown(where)}: cannot create the folder ({exc.strerror})") from None


def _open_lock(where: Path) -> tuple[int | None, bool, str | None]:
    """The lock file's descriptor (made when missing; ``None`` when there is none and none can be
    made), whether this made it, and why the folder cannot be written (``None``: it can). A lock file
    that cannot be written is opened read-only (a folder another user shares, or a read-only mount);
    one that is not a regular file is a `PlanError`."""
    path = where / LOCK_NAME
    flags = os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
    made = False
    why: str | None = None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o644)
        made = True
    except FileExistsError:
        try:
            fd = os.open(path, os.O_RDWR | flags)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise PlanError(_bad_lock(where, exc)) from None
            try:
                fd = os.open(path, os.O_RDONLY | flags)
            except OSError as again:
                raise PlanError(_bad_lock(where, again)) from None
            if exc.errno == errno.EROFS or not os.access(where, os.W_OK):
                why = exc.strerror or str(exc)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return None, False, exc.strerror or str(exc)
        raise PlanError(_bad_lock(where, exc)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PlanError(_bad_lock(where, OSError(errno.EINVAL, "not a regular file")))
    os.set_blocking(fd, True)
    return fd, made, why


def _flock(fd: int, how: int, where: Path) -> bool:
    """``flock(fd, how)`` without waiting: whether it was taken."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        raise PlanError(_no_locks(where, exc)) from None
    return True


def _bad_lock(where: Path, exc: OSError) -> str:
    return (
        f"spill={_shown(where)}: the folder's lock file {LOCK_NAME} cannot be used ({exc.strerror}); it "
        "is how sessions sharing the folder keep out of each other's way; remove "
        f"{os.fspath(where / LOCK_NAME)!r} if no session uses the folder, or name another folder"
    )


def _no_locks(where: Path, exc: OSError) -> str:
    return (
        f"spill={_shown(where)}: the folder's file system takes no locks ({exc.strerror}), and a spill "
        "folder is locked by the session using it, so another session cannot rewrite its files; name a "
        "folder on a local disk"
    )
