"""The machine's host-memory facts, from which the host budget is decided (`policies.machine_budget`):
what the kernel says is left (available memory, every memory cgroup that applies, the locked-memory
limit), each figure with the file it was read from, so a report or an error can say where the budget
came from.

[Note: the host budget]
A process is killed by the kernel's OOM killer when it, or any memory cgroup it belongs to, runs out:
whichever bound is tightest binds. `host_facts` reads every one of them, tightest first, and the host
planner keeps the smallest:

- ``MemAvailable`` of ``/proc/meminfo``: the kernel's estimate of what can be allocated without
  swapping (free memory plus the page cache and slab it can reclaim);
- each memory cgroup of the process and every ancestor up to its hierarchy's mount (a limit set on a
  parent binds its children): cgroup v1 ``memory.limit_in_bytes - (memory.usage_in_bytes -
  total_inactive_file)``, cgroup v2 ``min(memory.max, memory.high) - (memory.current -
  inactive_file)``. Usage includes page cache the kernel can drop first, so the inactive file pages
  are added back (as the kernel's own reclaim and container runtimes count a cgroup's working set).
  The hierarchies are found in ``/proc/self/mountinfo`` (a container's mounts, bind mounts and cgroup
  namespaces included), the process's place in them in ``/proc/self/cgroup``.

From the tightest a reserve is kept back, ``max(RESERVE_FRACTION of it, RESERVE_MIN)``, for what is not
torchferry's (the interpreter, activations computed on the host, the caller's own tensors). Figures
are read once, when a session opens; memory the rest of the process takes later is the reserve's job.
When no figure can be read at all (no ``/proc``, as on macOS, or a sandbox that hides it) there is no
machine limit (``bytes is None``) and one `OffloadWarning` says so; a budget the reserve leaves at 0
is kept as 0, and the session refuses it with a `PlanError` naming its source (`host_plan`).

``RLIMIT_MEMLOCK`` bounds page-locked bytes for ``mlock``-style pinning, unless the process holds
``CAP_IPC_LOCK`` (root usually does). It is read and reported (``locked_bytes``), and it bounds pinned
bytes only where the pinner is subject to it (`HostPinner.memlock`): CUDA's ``cudaHostRegister`` pins
through the NVIDIA kernel module's ``os_lock_user_pages``, which calls ``pin_user_pages`` with
``FOLL_LONGTERM`` and charges nothing to ``RLIMIT_MEMLOCK`` (NVIDIA/open-gpu-kernel-modules,
``kernel-open/nvidia/os-interface.c``), so for the CUDA pinner the limit is reported, not enforced.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import attrs

from torchferry._errors import OffloadWarning
from torchferry.policies import Bound, HostFacts, format_bytes

__all__ = [
    "Bound",
    "host_facts",
    "locked_limit",
    "read_bounds",
]

# cgroup v1 reports "no limit" as its page counter's maximum (9223372036854771712 on x86-64).
_UNLIMITED = 1 << 60
_CAP_IPC_LOCK = 14


def _size(n: int) -> str:
    return format_bytes(n, exact=False)


def read_bounds(proc: str | os.PathLike[str] = "/proc") -> tuple[tuple[Bound, ...], str]:
    """Every bound on host memory read under ``proc``, tightest first (see [Note: the host budget]);
    with none, where they were looked for (and one `OffloadWarning` says so)."""
    root = Path(proc)
    bounds = [_meminfo(root)]
    bounds.extend(_cgroup_bounds(root))
    known = sorted((b for b in bounds if b.available >= 0), key=lambda b: b.available)
    if known:
        return tuple(known), ""
    source = f"no machine limit: no memory figure could be read under {root}"
    _warn_unread(source)
    return (), source


def host_facts(
    *,
    proc: str | os.PathLike[str] = "/proc",
    module_bytes: int = 0,
    pins_locked: bool = False,
    read_mode: str = "auto",
) -> HostFacts:
    """The machine's `HostFacts` now, read once: the bounds, the locked-memory limit, and what the
    caller knows (the pipeline's own CPU bytes, whether its pinner is held to ``RLIMIT_MEMLOCK``)."""
    bounds, unread = read_bounds(proc)
    locked, why = locked_limit(proc)
    return HostFacts(
        bounds=bounds,
        unread=unread,
        locked_bytes=locked,
        locked_source=why,
        pins_locked=pins_locked,
        module_bytes=module_bytes,
        read_mode=read_mode,
    )


_WARNED: set[str] = set()


def _warn_unread(source: str) -> None:
    """The one warning (per place read) that the machine's memory could not be read."""
    if source in _WARNED:
        return
    _WARNED.add(source)
    warnings.warn(
        f"torchferry: {source}, so the host budget has no machine limit; pass host_memory= (bytes or "
        "'32GiB') to bound what torchferry holds in host memory",
        OffloadWarning,
        stacklevel=4,
    )


def locked_limit(proc: str | os.PathLike[str] = "/proc") -> tuple[int | None, str]:
    """``RLIMIT_MEMLOCK`` in bytes when it bounds this process, else ``None``; and where it came from."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None, "no RLIMIT_MEMLOCK on this platform"
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return None, "RLIMIT_MEMLOCK unlimited"
    status = _read(Path(proc) / "self" / "status") or ""
    match = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status, re.MULTILINE)
    if match is not None and int(match.group(1), 16) >> _CAP_IPC_LOCK & 1:
        return None, f"RLIMIT_MEMLOCK {_size(soft)} (ulimit -l), lifted by CAP_IPC_LOCK"
    return soft, f"RLIMIT_MEMLOCK {_size(soft)} (ulimit -l)"


# ------------------------------------------------------------------------------------ reading


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _number(text: str | None) -> int | None:
    if text is None:
        return None
    word = text.strip()
    if word == "max":
        return _UNLIMITED
    try:
        return int(word)
    except ValueError:
        return None


def _stat(folder: Path, key: str) -> int:
    """A counter of the cgroup's ``memory.stat`` (0 when absent)."""
    text = _read(folder / "memory.stat") or ""
    match = re.search(rf"^{key}\s+(\d+)", text, re.MULTILINE)
    return int(match.group(1)) if match is not None else 0


def _meminfo(proc: Path) -> Bound:
    path = proc / "meminfo"
    text = _read(path) or ""
    fields = {m.group(1): int(m.group(2)) * 1024 for m in re.finditer(r"^(\w+):\s+(\d+) kB", text, re.M)}
    if "MemAvailable" in fields:
        return Bound(what="MemAvailable", available=fields["MemAvailable"], source=f"{path} MemAvailable")
    if "MemFree" in fields:  # kernels before 3.14 lack MemAvailable
        free = fields["MemFree"] + fields.get("Cached", 0)
        return Bound(what="MemFree + Cached", available=free, source=f"{path} MemFree + Cached")
    return Bound(what="MemAvailable", available=-1, source=f"{path} could not be read")


def _unescape(field: str) -> str:
    """A mountinfo path field with its octal escapes (``\\040`` for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


@attrs.frozen
class _Mount:
    version: int
    root: str
    point: Path


def _mounts(proc: Path) -> list[_Mount]:
    """The memory cgroup hierarchies mounted in this process's view: v1 ``memory`` and v2."""
    found: list[_Mount] = []
    for line in (_read(proc / "self" / "mountinfo") or "").splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        fstype, options = rest[0], rest[2].split(",")
        if fstype == "cgroup2":
            found.append(_Mount(2, _unescape(fields[3]), Path(_unescape(fields[4]))))
        elif fstype == "cgroup" and "memory" in options:
            found.append(_Mount(1, _unescape(fields[3]), Path(_unescape(fields[4]))))
    return found


def _memberships(proc: Path) -> dict[int, str]:
    """This process's cgroup path in the v1 memory hierarchy (key 1) and the v2 one (key 2)."""
    paths: dict[int, str] = {}
    for line in (_read(proc / "self" / "cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ident, controllers, path = parts
        if ident == "0" and controllers == "":
            paths[2] = path
        elif "memory" in controllers.split(","):
            paths[1] = path
    return paths


def _folders(mount: _Mount, path: str) -> Iterator[Path]:
    """The process's cgroup folder in ``mount`` and each ancestor up to the mount, innermost first."""
    rel = path
    if mount.root not in ("", "/") and (path == mount.root or path.startswith(mount.root.rstrip("/") + "/")):
        rel = path[len(mount.root) :]
    parts = [p for p in rel.split("/") if p and p != ".."]
    folder = mount.point.joinpath(*parts)
    while not folder.is_dir() and parts:  # a path from another namespace: use what this view shows
        parts.pop()
        folder = mount.point.joinpath(*parts)
    while True:
        yield folder
        if folder == mount.point or mount.point not in folder.parents:
            return
        folder = folder.parent


def _cgroup_bounds(proc: Path) -> list[Bound]:
    memberships = _memberships(proc)
    bounds: list[Bound] = []
    seen: set[Path] = set()
    for mount in _mounts(proc):
        path = memberships.get(mount.version)
        if path is None:
            continue
        for folder in _folders(mount, path):
            if folder in seen:
                continue
            seen.add(folder)
            bound = _v1(folder, mount) if mount.version == 1 else _v2(folder, mount)
            if bound is not None:
                bounds.append(bound)
    return bounds


def _name(folder: Path, mount: _Mount) -> str:
    rel = folder.relative_to(mount.point).as_posix()
    return "/" if rel == "." else f"/{rel}"


def _v1(folder: Path, mount: _Mount) -> Bound | None:
    limit = _number(_read(folder / "memory.limit_in_bytes"))
    if limit is None or limit >= _UNLIMITED:
        return None
    usage = _number(_read(folder / "memory.usage_in_bytes")) or 0
    inactive = _stat(folder, "total_inactive_file")
    working = max(usage - inactive, 0)
    return Bound(
        what=f"cgroup v1 memory {_name(folder, mount)}",
        available=max(limit - working, 0),
        source=(
            f"{folder}: memory.limit_in_bytes {_size(limit)} - (memory.usage_in_bytes {_size(usage)} - "
            f"total_inactive_file {_size(inactive)})"
        ),
    )


def _v2(folder: Path, mount: _Mount) -> Bound | None:
    hard = _number(_read(folder / "memory.max"))
    high = _number(_read(folder / "memory.high"))
    named = (("memory.max", hard), ("memory.high", high))
    limits = [(n, v) for n, v in named if v is not None and v < _UNLIMITED]
    if not limits:
        return None
    name, limit = min(limits, key=lambda p: p[1])
    current = _number(_read(folder / "memory.current")) or 0
    inactive = _stat(folder, "inactive_file")
    working = max(current - inactive, 0)
    return Bound(
        what=f"cgroup v2 {_name(folder, mount)}",
        available=max(limit - working, 0),
        source=(
            f"{folder}: {name} {_size(limit)} - (memory.current {_size(current)} - inactive_file "
            f"{_size(inactive)})"
        ),
    )
