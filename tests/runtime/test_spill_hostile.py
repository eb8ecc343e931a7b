"""Spill under attack: a second model into an open session's folder, folders that cannot be written
or have no room, refusals after the open began, empty names, FIFOs where files go, forks, killed
writers, many sessions at once and odd names; every output compared bit for bit with the plain model
and every folder checked for what was left in it."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import torchferry
from torchferry import PlanError, policies, topology
from torchferry.runtime import SpillLease
from torchferry.runtime.files import _spill
from torchferry.testing import run_ranks, toy

HIDDEN, BLOCKS = 256, 16  # 43 MiB; 70% of it leaves 18 packs to spill
MiB = 1 << 20
pytestmark = pytest.mark.filterwarnings("ignore::torchferry.OffloadWarning")


def _budget(pipe: toy.ToyPipeline) -> int:
    plan = topology.resolve(topology.discover(pipe), topology.OffloadConfig(strategy="layerwise"))
    return int(policies.tiers(plan).host_bytes * 0.7)


def _open(pipe: toy.ToyPipeline, folder: object, **options: Any) -> torchferry.Session:
    options.setdefault("host_memory", _budget(pipe))
    return torchferry.offload(pipe, device="cpu", strategy="layerwise", spill=folder, **options)


def _want(seed: int) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = toy.build(seed, hidden=HIDDEN, blocks=BLOCKS)("a cat", steps=2)
    return out


def _build(seed: int) -> toy.ToyPipeline:
    return toy.build(seed, hidden=HIDDEN, blocks=BLOCKS)


def _files(folder: Path) -> dict[str, int]:
    """Every entry of ``folder`` with its inode."""
    return {p.name: p.lstat().st_ino for p in folder.iterdir()}


def _untouched(pipe: toy.ToyPipeline, seed: int) -> bool:
    ref = toy.build(seed, hidden=HIDDEN, blocks=BLOCKS)
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in pipe.modules())
    same = all(
        torch.equal(a, b) for a, b in zip(pipe.state_dict().values(), ref.state_dict().values(), strict=True)
    )
    return hooks == 0 and same


def _in_use(folder: Path, pid: int) -> str:
    return (
        f"spill={str(folder)!r} is in use by another open session (its files were written by process "
        f"{pid} on {socket.gethostname()}), and its files hold other bytes than this pipeline's "
        "(spill-text_encoder.blocks.0.safetensors, spill-text_encoder.blocks.1.safetensors, "
        "spill-text_encoder-rest.safetensors, ...); rewriting them would break that session, so nothing "
        "was written; close that session first, or name another folder (each model spilled at once "
        "needs its own)"
    )


# ---------------------------------------------------------------------------------- ownership
def test_a_second_model_is_refused_an_open_sessions_spill_folder(tmp_path: Path) -> None:
    """A second model spilling into the folder of an open session is a PlanError naming the folder and
    its owner: the session's files keep their inodes and it stays exact, the second pipeline is
    untouched, and once the session closes the folder is the second model's."""
    pipe, other = _build(0), _build(1)
    with _open(pipe, tmp_path):
        before = _files(tmp_path)
        with pytest.raises(PlanError, match=re.escape(_in_use(tmp_path, os.getpid()))):
            _open(other, tmp_path)
        assert _files(tmp_path) == before
        assert _untouched(other, 1)
        assert torch.equal(pipe("a cat", steps=2), _want(0))
    with _open(other, tmp_path):
        assert torch.equal(other("a cat", steps=2), _want(1))


def test_the_same_weights_share_an_open_sessions_folder(tmp_path: Path) -> None:
    """A second pipeline of the same weights opened into the folder of an open session keeps its files
    (same inodes) and both run exact."""
    one, two = _build(0), _build(0)
    with _open(one, tmp_path), _open(two, tmp_path):
        files = _files(tmp_path)
        assert torch.equal(one("a cat", steps=2), _want(0))
        assert torch.equal(two("a cat", steps=2), _want(0))
        assert _files(tmp_path) == files


def test_a_process_forked_while_a_session_is_open_does_not_keep_its_folder(tmp_path: Path) -> None:
    """A child forked while a session is open does not hold the folder's lock: once the parent closes,
    another model may spill there while the child still lives."""
    pipe, other = _build(0), _build(1)
    session = _open(pipe, tmp_path)
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (the child runs no Python)
        child = os.fork()
    if child == 0:  # pragma: no cover - the child waits for the parent and leaves
        os.close(write)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        session.close()
        with _open(other, tmp_path):
            assert torch.equal(other("a cat", steps=2), _want(1))
    finally:
        os.close(write)
        os.waitpid(child, 0)


_HOLDER = """
import sys, torch, torchferry
from torchferry.testing import toy
pipe = toy.build(0, hidden={hidden}, blocks={blocks})
session = torchferry.offload(pipe, device="cpu", strategy="layerwise", host_memory={budget}, spill={folder!r})
print("open", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_a_session_in_another_process_owns_the_folder_until_it_dies(tmp_path: Path) -> None:
    """A session open in another process refuses a second model its folder, naming that process; once
    the process is killed (no close ran) the kernel drops its lock and the folder is free."""
    pipe = _build(1)
    script = _HOLDER.format(hidden=HIDDEN, blocks=BLOCKS, budget=_budget(pipe), folder=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "open\n"
            with pytest.raises(PlanError, match=re.escape(_in_use(tmp_path, holder.pid))):
                _open(pipe, tmp_path)
        finally:
            holder.kill()
            holder.wait(timeout=60)
    with _open(pipe, tmp_path):
        assert torch.equal(pipe("a cat", steps=2), _want(1))


def test_sessions_opened_at_once_never_share_a_folder_with_other_bytes(tmp_path: Path) -> None:
    """Three sessions opened at once into one folder by three threads, two of one model and one of
    another: the sessions that open are all of one model and exact, the others are refused."""
    seeds = [0, 1, 0]
    pipes = [_build(seed) for seed in seeds]
    opened: dict[int, torchferry.Session] = {}
    refused: dict[int, str] = {}

    def open_one(i: int) -> None:
        try:
            opened[i] = _open(pipes[i], tmp_path)
        except PlanError as exc:
            refused[i] = str(exc)

    threads = [threading.Thread(target=open_one, args=(i,)) for i in range(len(pipes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert opened and len(opened) + len(refused) == len(pipes)
        (winner,) = {seeds[i] for i in opened}
        assert all(seeds[i] != winner for i in refused)
        assert all("is in use by another open session" in message for message in refused.values())
        for i in opened:
            assert torch.equal(pipes[i]("a cat", steps=2), _want(winner))
    finally:
        for session in opened.values():
            session.close()


def test_what_an_open_wrote_is_taken_out_when_it_fails_later(tmp_path: Path) -> None:
    """An open whose spill was written and that then fails takes out the files, the lock file and the
    folders it made; files it found complete and kept stay (another pipeline may view them)."""
    pipe = _build(0)
    plan = topology.resolve(topology.discover(pipe), topology.OffloadConfig(strategy="layerwise"))
    packs = ["transformer.blocks.6", "transformer.blocks.7"]
    folder = tmp_path / "made" / "spill"
    lease = SpillLease()
    with pytest.raises(RuntimeError, match="a later check failed"), lease.opening():
        _spill.spill(pipe, plan, packs, folder)
        lease.write()
        assert sorted(_files(folder)) == [
            "spill-transformer.blocks.6.safetensors",
            "spill-transformer.blocks.7.safetensors",
            "spill.lock",
            "spill.safetensors.index.json",
        ]
        raise RuntimeError("a later check failed")
    assert not (tmp_path / "made").exists()
    _spill.spill(pipe, plan, packs[:1], tmp_path)
    kept = _files(tmp_path)
    lease = SpillLease()
    with pytest.raises(RuntimeError, match="a later check failed"), lease.opening():
        _spill.spill(pipe, plan, packs, tmp_path)
        lease.write()
        raise RuntimeError("a later check failed")
    after = _files(tmp_path)
    assert after["spill-transformer.blocks.6.safetensors"] == kept["spill-transformer.blocks.6.safetensors"]
    assert "spill-transformer.blocks.7.safetensors" not in after


# -------------------------------------------------------------------- refusals before any byte
def test_a_device_budget_refusal_writes_no_spill(tmp_path: Path) -> None:
    """A device budget the schedules break is refused before the spill is written: the folder the open
    would have made is not there, and an existing one stays empty."""
    pipe = _build(0)
    folder = tmp_path / "spill"
    for where in (folder, tmp_path):
        breaks = r"^step transformer#0: the schedule layerwise\(depth=1\) made breaks the plan"
        with pytest.raises(PlanError, match=breaks):
            _open(pipe, where, device_memory="1MiB")
    assert not folder.exists() and not any(tmp_path.iterdir())
    assert _untouched(pipe, 0)


def test_a_tensor_safetensors_cannot_hold_is_refused_before_any_file(tmp_path: Path) -> None:
    """A complex128 buffer in a file-tier block is refused before the first file is written."""
    pipe = _build(0)
    for block in pipe.transformer.blocks:
        block.register_buffer("phase", torch.zeros(4, dtype=torch.complex128))
    message = (
        "spill: transformer.blocks.10.phase is torch.complex128, which safetensors cannot hold; keep it "
        "in host memory"
    )
    with pytest.raises(PlanError, match=re.escape(message)):
        _open(pipe, tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["", "   "])
def test_an_empty_spill_name_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """spill='' (or blanks) is refused like checkpoint='' and writes nothing into the working directory."""
    monkeypatch.chdir(tmp_path)
    message = (
        f"spill={name!r}: an empty name is no folder (the packs would go into the working directory); "
        "name the folder to write them in, such as spill='/var/tmp/torchferry'"
    )
    with pytest.raises(PlanError, match=re.escape(message)):
        _open(_build(0), name)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("value", [123, b"/var/tmp/spill"])
def test_a_spill_that_is_no_path_is_a_type_error(value: object) -> None:
    """spill= of another type than a path (an int, bytes) is a TypeError naming spill=."""
    message = (
        f"offload(spill=...) must be a folder path (str or os.PathLike), got {type(value).__name__} {value!r}"
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        _open(_build(0), value)


def _as_nobody(run: Any) -> tuple[str, str]:
    """``run()``'s error (type name, message) as a user without root's powers over files: in a forked
    child that drops to ``nobody`` when this is root, else here."""
    if os.geteuid() != 0:
        try:
            run()
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return "", ""
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.close(read)
        result = ("", "")
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            run()
        except BaseException as exc:
            result = (type(exc).__name__, str(exc))
        os.write(write, "\0".join(result).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read().decode()
    os.waitpid(child, 0)
    kind, message = data.split("\0", 1)
    return kind, message


@contextlib.contextmanager
def _shared_folder() -> Iterator[Path]:
    """A folder every user can reach (a test's tmp_path is root's alone), removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="torchferry-", dir="/var/tmp"))
    try:
        base.chmod(0o755)
        yield base
    finally:
        for p in base.rglob("*"):
            if p.is_dir():
                p.chmod(0o755)
        shutil.rmtree(base)


def test_spill_into_a_folder_that_cannot_be_written_is_refused() -> None:
    """An existing folder this process cannot write is a PlanError naming it, with nothing left in it."""
    pipe = _build(0)
    budget = _budget(pipe)
    with _shared_folder() as base:
        folder = base / "read-only"
        folder.mkdir(mode=0o555)
        folder.chmod(0o555)
        kind, message = _as_nobody(
            lambda: torchferry.offload(
                pipe, device="cpu", strategy="layerwise", host_memory=budget, spill=folder
            )
        )
        assert kind == "PlanError", message
        assert message == (
            f"spill={str(folder)!r}: cannot write into the folder (Permission denied), and its files do not "
            "hold this pipeline's packs (spill-text_encoder.blocks.0.safetensors, "
            "spill-text_encoder.blocks.1.safetensors, spill-text_encoder-rest.safetensors, ...); nothing was "
            "left in it; name a folder this process can write (spill='/var/tmp/torchferry'), or open the "
            "pipeline from its checkpoint (checkpoint=)"
        )
        assert not any(folder.iterdir())


def test_spill_over_the_file_size_limit_is_refused_before_writing(tmp_path: Path) -> None:
    """Spill files over RLIMIT_FSIZE (which would fail with EFBIG mid-write) are a PlanError before the
    first byte, and the folders the open made are gone."""
    pipe = _build(0)
    folder = tmp_path / "spill"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (MiB, hard))
    try:
        with pytest.raises(PlanError) as caught:
            _open(pipe, folder)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert re.fullmatch(
        rf"spill={re.escape(repr(str(folder)))}: a spill file of [0-9.]+ MiB is over this process's "
        r"file-size limit of 1\.0 MiB \(ulimit -f\), so nothing was written; raise the limit, or open the "
        r"pipeline from its checkpoint \(checkpoint=\)",
        str(caught.value),
    )
    assert not folder.exists()


@contextlib.contextmanager
def _mounted(tmp_path: Path, *how: str) -> Iterator[Path]:
    """A mount at a fresh folder (``mount *how``); skipped where this process cannot mount."""
    target = tmp_path / "mnt"
    target.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    done = subprocess.run(["mount", *how, str(target)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)


def test_spill_onto_a_full_disk_is_refused_before_writing(tmp_path: Path) -> None:
    """A disk without room for the spill (an 8 MiB ext4) is a PlanError naming the folder, the room and
    the need, before the first byte: nothing is left on the disk."""
    image = tmp_path / "disk.img"
    with open(image, "wb") as f:
        f.truncate(8 * MiB)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, check=False)
    if made.returncode != 0:
        pytest.skip("no mkfs.ext4 here")
    with _mounted(tmp_path, "-o", "loop", str(image)) as disk:
        before = _files(disk)
        folder = disk / "spill"
        with pytest.raises(PlanError) as caught:
            _open(_build(0), folder)
        assert re.fullmatch(
            rf"spill={re.escape(repr(str(folder)))}: the disk has [0-9.]+ MiB free and the spill needs "
            r"[0-9.]+ MiB there, so nothing was written; free space, name a folder on a larger disk, or "
            r"pass a larger host_memory= so fewer packs are spilled",
            str(caught.value),
        )
        assert _files(disk) == before


def test_a_read_only_mount_of_a_complete_spill_is_read_and_a_change_is_refused(tmp_path: Path) -> None:
    """A read-only bind mount of a folder that holds the pipeline's spill already serves it exact (no
    write needed, no lock file made); another model there is a PlanError naming the read-only folder."""
    source = tmp_path / "spill"
    pipe = _build(0)
    with _open(pipe, source):
        pass
    with _mounted(tmp_path, "--bind", "-o", "ro", str(source)) as mounted:
        again = _build(0)
        with _open(again, mounted):
            assert torch.equal(again("a cat", steps=2), _want(0))
        message = f"spill={str(mounted)!r}: cannot write into the folder (Read-only file system), and its"
        with pytest.raises(PlanError, match=re.escape(message)):
            _open(_build(1), mounted)


# ------------------------------------------------------------------- what is found in the folder
class _Blocked(Exception):
    """A call blocked past the watchdog (not an OSError, which the code under test may catch)."""


def _watchdog(seconds: int) -> Any:
    """A SIGALRM that fails the test instead of letting a blocked open hang it."""

    def fail(signum: int, frame: object) -> None:
        raise _Blocked(f"blocked for {seconds} s")

    return signal.signal(signal.SIGALRM, fail)


@pytest.mark.parametrize("where", ["spill.safetensors.index.json", "spill-transformer.blocks.9.safetensors"])
def test_a_fifo_where_a_spill_file_goes_is_replaced_without_blocking(tmp_path: Path, where: str) -> None:
    """A FIFO at the index's or a pack's path is never opened for reading (which would block forever):
    it is replaced by the file, and the session runs exact."""
    os.mkfifo(tmp_path / where)
    before = _watchdog(60)
    signal.alarm(60)
    try:
        pipe = _build(0)
        with _open(pipe, tmp_path):
            assert stat.S_ISREG((tmp_path / where).lstat().st_mode)
            assert torch.equal(pipe("a cat", steps=2), _want(0))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("fifo", "not a regular file"),
        ("folder", "Is a directory"),
        ("symlink", "Too many levels of symbolic links"),
    ],
)
def test_a_lock_file_that_is_not_a_file_is_refused(tmp_path: Path, kind: str, why: str) -> None:
    """Something other than a regular file at the lock file's path is a PlanError naming it, before any
    pack is written, and without blocking."""
    lock = tmp_path / _spill.LOCK_NAME
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "folder":
        lock.mkdir()
    else:
        lock.symlink_to(tmp_path / "elsewhere")
    message = (
        f"spill={str(tmp_path)!r}: the folder's lock file spill.lock cannot be used ({why}); it is how "
        "sessions sharing the folder keep out of each other's way; remove "
        f"{str(lock)!r} if no session uses the folder, or name another folder"
    )
    before = _watchdog(60)
    signal.alarm(60)
    try:
        with pytest.raises(PlanError, match=re.escape(message)):
            _open(_build(0), tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert not list(tmp_path.glob("spill-*")) and not (tmp_path / _spill.INDEX_NAME).exists()


def test_a_folder_where_a_spill_file_goes_is_refused_before_writing(tmp_path: Path) -> None:
    """A folder at a pack file's path (which no rename can replace) is a PlanError naming it, before
    any file is written."""
    (tmp_path / "spill-transformer.blocks.9.safetensors").mkdir()
    with pytest.raises(PlanError, match=re.escape(
        f"spill={str(tmp_path)!r}: spill-transformer.blocks.9.safetensors in the folder is a folder, where "
        "the spill writes a file; remove it, or name another folder"
    )):
        _open(_build(0), tmp_path)
    assert sorted(_files(tmp_path)) == ["spill-transformer.blocks.9.safetensors"]


def test_temporaries_of_a_killed_writer_are_removed(tmp_path: Path) -> None:
    """The temporary files a writer killed mid-spill left are removed by the next open that holds the
    folder alone; other files are left as they are."""
    stale = tmp_path / ".spill-transformer.blocks.9.safetensors.4242.0123456789ab.tmp"
    stale.write_bytes(b"half a pack")
    mine = tmp_path / "notes.tmp"
    mine.write_text("the user's")
    pipe = _build(0)
    with _open(pipe, tmp_path):
        assert not stale.exists() and mine.exists()
        assert torch.equal(pipe("a cat", steps=2), _want(0))


def test_odd_folder_names_spill_exact(tmp_path: Path) -> None:
    """A spill folder whose name holds spaces, a newline, quotes and non-ASCII letters works exact."""
    folder = tmp_path / "sp ill\n'\"☃ é"
    pipe = _build(0)
    with _open(pipe, folder):
        assert torch.equal(pipe("a cat", steps=2), _want(0))


def test_pack_names_that_would_share_a_file_name_get_their_own() -> None:
    """Pack names that sanitise to one file name (also ignoring case) or are too long for one get
    distinct names of at most 255 bytes, the same on every call."""
    packs = ["a:b", "a-b", "A-B", "x" * 300, "blocks.0"]
    names = _spill._file_names(packs)
    assert len(set(names.values())) == len(packs)
    assert len({n.lower() for n in names.values()}) == len(packs)
    assert all(len(n.encode()) <= 255 for n in names.values())
    assert names["blocks.0"] == "spill-blocks.0.safetensors"
    assert names == _spill._file_names(list(reversed(packs)))


# --------------------------------------------------------------------------------- sizes, ranks
def _open_huge(rank: int, world: int) -> dict[str, str]:
    """Open the toy under the distributed strategy with a host budget of 2**63 bytes."""
    pipe = toy.build(0, hidden=32)
    try:
        torchferry.offload(pipe, strategy="distributed_layerwise", device="cpu", host_memory=2**63)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": ""}  # pragma: no cover - refused


@pytest.mark.dist
def test_a_host_budget_past_2_63_bytes_under_a_group_is_a_plan_error() -> None:
    """host_memory=2**63 under a process group is a PlanError on every rank where it is read, not a
    ValueError from exchanging it as a signed 64-bit integer."""
    results = run_ranks(_open_huge, 2, timeout=150, group_timeout=120)
    for seen in results:
        assert seen["error"] == "PlanError", seen
        assert seen["message"].startswith("host_memory: 9223372036854775808 is more than 8 EiB")
