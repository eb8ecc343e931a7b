"""Measure what this machine's device can do, and keep it where ``torchferry plan`` (and, later, the
session) finds it: the pinned host-to-device bandwidth and the matrix-multiply rate, and, given a
checkpoint, the drive's read rates (buffered and direct, page cache dropped first: `_readrate`).

A profile is a `policies.DeviceProfile` saved as JSON at `profile_path()`:
``$TORCHFERRY_PROFILE`` if set, else ``$TORCHFERRY_CACHE/profile.json``, else
``$XDG_CACHE_HOME/torchferry/profile.json``, else ``~/.cache/torchferry/profile.json``.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from pathlib import Path

import torch

from torchferry._errors import PlanError
from torchferry.policies import DeviceProfile, format_bytes, match_device_class
from torchferry.topology import load_json

__all__ = [
    "READ_PROBE_BYTES",
    "READ_PROBE_MIN_BYTES",
    "host_name",
    "load_profile",
    "probe",
    "profile_path",
    "read_rates",
    "save_profile",
]


def profile_path() -> Path:
    """Where profiles are saved and looked for (see the module notes for the order)."""
    explicit = os.environ.get("TORCHFERRY_PROFILE")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("TORCHFERRY_CACHE")
    if cache:
        return Path(cache).expanduser() / "profile.json"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "torchferry" / "profile.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(device: torch.device, run: object, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``run`` after one warm-up (host clock, synchronised)."""
    assert callable(run)
    run()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def copy_bytes_per_s(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes per second of one host-to-device copy of ``nbytes`` from pinned memory (a host memcpy
    on the CPU): the fastest of ``repeats`` timed copies after one warm-up."""
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds = _best_seconds(device, functools.partial(dest.copy_, host, non_blocking=cuda), repeats)
    del host, dest
    release = getattr(torch._C, "_host_emptyCache", None)
    if cuda and release is not None:
        release()  # else torch's caching host allocator keeps the pinned buffer for the process's life
    return nbytes / seconds


#: The most bytes of a checkpoint a probe reads per measurement (the largest files first).
READ_PROBE_BYTES = 1 << 30

#: The fewest bytes a read rate is timed over: a read of less takes too little time, and too much of
#: it is opening files and starting threads, for its rate to be the drive's.
READ_PROBE_MIN_BYTES = 64 << 20


def _files_to_time(path: str | os.PathLike[str], nbytes: int, min_bytes: int) -> list[str]:
    """The ``*.safetensors`` files under ``path`` a read-rate measurement reads, refused (`PlanError`)
    when they hold fewer than ``min_bytes`` to read (within ``nbytes``), before anything is timed."""
    from torchferry.runtime.machine._readrate import read_files

    files = read_files(path)
    on_disk = sum(os.path.getsize(f) for f in files)
    available = min(nbytes, on_disk)
    if available < min_bytes:
        have, floor = format_bytes(available, exact=False), format_bytes(min_bytes, exact=False)
        if nbytes < on_disk:  # the checkpoint holds enough: the asked read size is what is short
            raise PlanError(
                f"probe: a read of {have} (--read-bytes, read_bytes=) is too few to time a read rate over "
                f"(at least {floor}); nothing was measured or saved. Ask for at least {floor}, or lower the "
                "floor too (--min-bytes SIZE, probe(read_min_bytes=...))"
            )
        raise PlanError(
            f"{os.fspath(path)}: {have} of *.safetensors to read, too few to time a read rate over (at "
            f"least {floor}); nothing was measured or saved. Name a larger checkpoint file or folder on "
            "the same drive, or lower the floor (torchferry probe --min-bytes SIZE, "
            "probe(read_min_bytes=...))"
        )
    return files


def read_rates(
    path: str | os.PathLike[str],
    *,
    nbytes: int = READ_PROBE_BYTES,
    repeats: int = 2,
    min_bytes: int = READ_PROBE_MIN_BYTES,
) -> tuple[float, float]:
    """The drive's read rates under ``path`` (a checkpoint file or folder), buffered and direct, by the
    file tier's own method with the page cache dropped first: the fastest of ``repeats`` each. Fewer
    than ``min_bytes`` to read is a `PlanError` (`READ_PROBE_MIN_BYTES`: too few to time)."""
    from torchferry.runtime.machine._readrate import sequential_read

    files = _files_to_time(path, nbytes, min_bytes)
    buffered = max(sequential_read(files, direct=False, limit=nbytes).bytes_per_s for _ in range(repeats))
    direct = max(sequential_read(files, direct=True, limit=nbytes).bytes_per_s for _ in range(repeats))
    return buffered, direct


def probe(
    device: torch.device | str | None = None,
    *,
    copy_bytes: int | None = None,
    matmul_size: int | None = None,
    read_path: str | os.PathLike[str] | None = None,
    read_bytes: int = READ_PROBE_BYTES,
    read_min_bytes: int = READ_PROBE_MIN_BYTES,
) -> DeviceProfile:
    """Measure ``device`` (default: CUDA when present, else the CPU): pinned host-to-device copies of
    ``copy_bytes`` (default 256 MiB on CUDA, 64 MiB on the CPU, where the "copy" is a host memcpy)
    and square matrix products of ``matmul_size`` (default 4096 in bf16 on CUDA, 512 in fp32 on the
    CPU); the fastest of a few runs each. Takes about a second. With ``read_path`` (a checkpoint
    file or folder on the drive the file tier will read), also the drive's buffered and direct read
    rates over up to ``read_bytes`` of it (`read_rates`); a path with no ``*.safetensors`` file, or
    with fewer than ``read_min_bytes`` of them, is refused before anything is measured."""
    target = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    if target.type not in ("cpu", "cuda"):
        raise PlanError(f"probe(device={str(target)!r}): torchferry measures cpu or cuda devices only")
    if target.type == "cuda" and not torch.cuda.is_available():
        raise PlanError(
            f"probe(device={str(target)!r}): no CUDA device is available here; probe where the GPU is, "
            "or pass --device cpu to measure this machine's CPU"
        )
    if read_path is not None:
        _files_to_time(read_path, read_bytes, read_min_bytes)  # refused before the device is timed
    cuda = target.type == "cuda"
    nbytes = copy_bytes if copy_bytes is not None else (256 << 20 if cuda else 64 << 20)
    h2d = copy_bytes_per_s(target, nbytes, 5)
    n = matmul_size if matmul_size is not None else (4096 if cuda else 512)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=target, dtype=dtype)
    b = torch.randn(n, n, device=target, dtype=dtype)
    matmul_s = _best_seconds(target, lambda: torch.mm(a, b), 5)
    name = torch.cuda.get_device_name(target) if cuda else "cpu"
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    known = match_device_class(name)
    collective = known.collective_bytes_per_s if known is not None else 100e9
    buffered = direct = None
    where = ""
    if read_path is not None:
        buffered, direct = read_rates(read_path, nbytes=read_bytes, min_bytes=read_min_bytes)
        where = f"; reads of {os.fspath(read_path)}"
    return DeviceProfile(
        name=name,
        h2d_bytes_per_s=h2d,
        flops_per_s=2 * n**3 / matmul_s,
        collective_bytes_per_s=collective,
        dtype=str(dtype).removeprefix("torch."),
        source=f"measured on {name} ({target}) by torchferry probe, {when} UTC{where}",
        device=target.type,
        host=host_name(),
        read_bytes_per_s=buffered,
        read_direct_bytes_per_s=direct,
    )


def host_name() -> str:
    """This machine's name, as a profile records where it was measured."""
    return platform.node() or "unknown host"


def save_profile(profile: DeviceProfile, path: str | os.PathLike[str] | None = None) -> Path:
    """Write ``profile`` as JSON to ``path`` (default `profile_path()`); returns where it went."""
    where = Path(path) if path is not None else profile_path()
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = where.with_name(where.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    tmp.replace(where)
    return where


def load_profile(path: str | os.PathLike[str] | None = None) -> DeviceProfile | None:
    """The profile at ``path`` (default `profile_path()`), or ``None`` when there is none there; a file
    that is not a profile is a `PlanError` saying to probe again."""
    where = Path(path) if path is not None else profile_path()
    if not where.exists():
        return None
    try:
        doc = load_json(where.read_bytes())
    except (OSError, ValueError) as exc:
        raise PlanError(
            f"profile {where} cannot be read ({exc}); write a new one with `torchferry probe`"
        ) from None
    return DeviceProfile.from_json(doc, where=f"profile {where}")
