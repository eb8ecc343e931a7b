"""Hostile cases of the file tier's files and folders: a checkpoint rewritten with its time set back, a
working directory changed under relative paths, a folder made unsearchable, buffers after close,
zero-size tensors; every output compared bit for bit with the plain model."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import torchferry
from torchferry import ExecutionError, policies, topology
from torchferry.runtime.files._checkpoint_reader import CheckpointReader
from torchferry.runtime.memory import Pack, PackState
from torchferry.testing import toy

HIDDEN, BLOCKS = 256, 16  # 45 MiB: a file tier pays beside its 16 MiB of bounce buffers
pytestmark = pytest.mark.filterwarnings("ignore::torchferry.OffloadWarning")


def _budget(pipe: toy.ToyPipeline) -> int:
    """70% of what the layerwise host store would hold: a file tier of several blocks."""
    plan = topology.resolve(topology.discover(pipe), topology.OffloadConfig(strategy="layerwise"))
    return int(policies.tiers(plan).host_bytes * 0.7)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, int]:
    """The toy checkpoint, the plain model's output and a host budget (70% of the store)."""
    ref = toy.build(0, hidden=HIDDEN, blocks=BLOCKS)
    path = tmp_path_factory.mktemp("file_hostile") / "toy.safetensors"
    toy.save_checkpoint(ref, path)
    with torch.no_grad():
        want = ref("a cat", steps=2)
    return path, want, _budget(ref)


def _open(
    path: str | Path, budget: int | None, **options: object
) -> tuple[toy.ToyPipeline, torchferry.Session]:
    pipe = toy.build_empty(hidden=HIDDEN, blocks=BLOCKS)
    session = torchferry.offload(
        pipe, device="cpu", strategy="layerwise", checkpoint=str(path), host_memory=budget, **options
    )
    return pipe, session


def _rewrite_keeping_time(path: Path, other: Path) -> None:
    """Write ``other``'s bytes over ``path`` in place, then set its times back as they were."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.write(other.read_bytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


# ------------------------------------------------------------------ rewritten, time set back (item 1)
def test_a_checkpoint_rewritten_with_its_time_set_back_fails_the_step(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """Another model's bytes written over the checkpoint in place, its size and modification time kept
    (os.utime): the next call is an ExecutionError naming the file and the inode change time."""
    _, want, budget = model
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0, hidden=HIDDEN, blocks=BLOCKS), path)
    other = tmp_path / "other.safetensors"
    toy.save_checkpoint(toy.build(1, hidden=HIDDEN, blocks=BLOCKS), other)
    pipe, s = _open(path, budget)
    try:
        assert torch.equal(pipe("a cat", steps=2), want)
        _rewrite_keeping_time(path, other)
        with pytest.raises(ExecutionError, match=re.escape(str(path))) as caught:
            pipe("a cat", steps=2)
        text = str(caught.value)
        assert (
            "the file was rewritten in place with its modification time set back (its inode change time "
            in text
        )
        assert "differ from what was read" in text and "while its size and modification time did not)" in text
    finally:
        s.close()


def test_the_checkpoint_reader_refuses_a_file_rewritten_in_place(tmp_path: Path) -> None:
    """A CheckpointReader whose file is rewritten in place at the same size after a tensor was read (as
    the host store fills from it, a file tier watching) raises an ExecutionError at the next copy,
    naming the bytes read before that differ, instead of returning the other model's bytes; it still
    reads the file it opened when the name is replaced by another."""
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0), path)
    other = tmp_path / "other.safetensors"
    toy.save_checkpoint(toy.build(1), other)
    with CheckpointReader(path) as reader:
        name = next(iter(reader))
        first = reader.read_tensor(name)
        third = tmp_path / "third.safetensors"
        toy.save_checkpoint(toy.build(2), third)
        os.replace(third, path)
        assert torch.equal(reader.read_tensor(name), first)  # the open file, renamed over: still read
    with CheckpointReader(path) as reader:
        reader.digests.watching = True  # as under a file tier: the reads are digested
        names = list(reader)
        reader.read_tensor(names[0])
        time.sleep(0.05)  # past the file system's timestamp granularity
        with open(path, "r+b") as f:
            f.write(other.read_bytes())
        want = (
            re.escape(f"{path} was rewritten in place (its modification time moved and bytes [")
            + r"\d+, \d+"
            + re.escape(
                "), read before, differ from what was read there then) since it was opened, so bytes ["
            )
            + r"\d+, \d+"
            + re.escape(
                ") cannot be read as its header said; do not rewrite a checkpoint while it is being read, "
                "and open it again"
            )
        )
        with pytest.raises(ExecutionError, match=want):
            reader.read_tensor(names[1])


def test_a_deleted_checkpoint_says_so(model: tuple[Path, torch.Tensor, int], tmp_path: Path) -> None:
    """A checkpoint deleted while a session reads it fails the next call with an ExecutionError that says
    it is no longer at its path and how to go on, not that the drive failed."""
    _, want, budget = model
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0, hidden=HIDDEN, blocks=BLOCKS), path)
    pipe, s = _open(path, budget)
    try:
        assert torch.equal(pipe("a cat", steps=2), want)
        path.unlink()
        with pytest.raises(ExecutionError) as caught:
            pipe("a cat", steps=2)
        text = str(caught.value)
        assert f"of {path} (tensor " in text
        assert (
            "the file is no longer at its path (No such file or directory): it was deleted, or moved with "
            "its folder; nothing was lost: the session's other weights are untouched and it can be closed; "
            "put it back where it was, or close() the session and open a new one from where it is"
        ) in text
        assert "dmesg" not in text
    finally:
        s.close()


def test_permissions_and_links_changed_are_not_a_rewrite(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """The checkpoint made unreadable (chmod 000) and readable again, given another owner and a hard link
    while a session reads it (each moves its inode change time) runs on bit-identical through the file
    opened."""
    _, want, budget = model
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0, hidden=HIDDEN, blocks=BLOCKS), path)
    pipe, s = _open(path, budget)
    with s:
        assert torch.equal(pipe("a cat", steps=2), want)
        before = os.stat(path)
        time.sleep(0.05)  # past the file system's timestamp granularity
        path.chmod(0)
        assert torch.equal(pipe("a cat", steps=2), want)
        time.sleep(0.05)
        path.chmod(before.st_mode & 0o7777)  # back as it was opened: explained by the chmod seen before
        assert torch.equal(pipe("a cat", steps=2), want)
        os.link(path, tmp_path / "backup.safetensors")
        if os.geteuid() == 0:  # only root may give a file away
            os.chown(path, 1234, 1234)
        assert os.stat(path).st_ctime_ns != before.st_ctime_ns
        assert torch.equal(pipe("a cat", steps=2), want)


def _set_xattr(path: Path) -> None:
    """An extended attribute set on ``path``, as a backup tool or an indexer does (skipped where the file
    system refuses them)."""
    try:
        os.setxattr(path, "user.torchferry.test", b"seen")
    except (AttributeError, OSError) as exc:
        pytest.skip(f"no extended attributes here: {exc}")


def _rename_and_link(path: Path) -> None:
    """``path`` moved aside and a symlink put at its old name: the same inode, the same bytes."""
    aside = path.with_name("moved.safetensors")
    os.rename(path, aside)
    path.symlink_to(aside)


def _chmod_and_undo(path: Path) -> None:
    """``path`` made unreadable and readable again before the session looks at it."""
    mode = os.stat(path).st_mode & 0o7777
    path.chmod(0)
    path.chmod(mode)


def _touch(path: Path) -> None:
    """``path``'s times set to now, as ``touch`` (or a cleaner of old files kept off) does."""
    os.utime(path)


@pytest.mark.parametrize(
    "touch", [_set_xattr, _rename_and_link, _chmod_and_undo, _touch], ids=lambda f: f.__name__[1:]
)
def test_a_moved_inode_change_time_alone_is_not_a_rewrite(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path, touch: Callable[[Path], None]
) -> None:
    """An extended attribute set, a rename with a symlink at the old name, a chmod undone, a touch: each
    moves the inode change time (the touch the modification time too) and not a byte, and every later
    call runs on bit-identical (the span digests tell the same bytes), while a rewrite with its time
    set back afterwards is still refused."""
    source, want, budget = model
    path = tmp_path / "toy.safetensors"
    shutil.copyfile(source, path)
    other = tmp_path / "other.safetensors"
    data = bytearray(source.read_bytes())
    data[-5] ^= 1  # one bit of the last tensor's bytes
    other.write_bytes(data)
    pipe, s = _open(path, budget)
    with s:
        assert torch.equal(pipe("a cat", steps=2), want)
        before = os.stat(path).st_ctime_ns
        time.sleep(0.05)  # past the file system's timestamp granularity
        touch(path)
        assert os.stat(path).st_ctime_ns != before
        for _ in range(2):
            assert torch.equal(pipe("a cat", steps=2), want)
        time.sleep(0.05)
        _rewrite_keeping_time(path, other)
        with pytest.raises(ExecutionError, match="the file was rewritten in place") as caught:
            pipe("a cat", steps=2)
        assert "differ from what was read" in str(caught.value)


def test_a_symlink_pointed_elsewhere_fails_the_step(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """A checkpoint opened through a symlink that is then pointed at another model's file fails the next
    call with an ExecutionError saying the file was replaced, never the other model's output."""
    path, want, budget = model
    other = tmp_path / "other.safetensors"
    toy.save_checkpoint(toy.build(1, hidden=HIDDEN, blocks=BLOCKS), other)
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)
    pipe, s = _open(link, budget)
    with s:
        assert torch.equal(pipe("a cat", steps=2), want)
        (tmp_path / "new").symlink_to(other)
        os.replace(tmp_path / "new", link)
        with pytest.raises(ExecutionError, match="the file was replaced on disk"):
            pipe("a cat", steps=2)


# --------------------------------------------------------------- relative paths and chdir (item 2)
@pytest.mark.parametrize("source", ["checkpoint", "spill"])
def test_relative_paths_are_resolved_at_open(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """A session opened with a relative checkpoint= or spill= keeps running bit-identical after the
    working directory changes, and closes with its weights."""
    path, want, budget = model
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.chdir(home)
    if source == "checkpoint":
        os.symlink(path, home / "toy.safetensors")
        pipe, s = _open("toy.safetensors", budget)
    else:
        pipe = toy.build(0, hidden=HIDDEN, blocks=BLOCKS)
        s = torchferry.offload(pipe, device="cpu", strategy="layerwise", spill="spill", host_memory=budget)
    with s:
        assert s.report().file_packs > 0
        assert torch.equal(pipe("a cat", steps=2), want)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        monkeypatch.chdir(elsewhere)
        assert torch.equal(pipe("a cat", steps=2), want)
    assert torch.equal(pipe("a cat", steps=2), want)


# ------------------------------------------------------------------- buffers after close (item 4)
def test_close_frees_the_readers_buffers(
    model: tuple[Path, torch.Tensor, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A closed session still referenced (``with ... as s``) holds no host memory: report() says 0
    bytes, and the reader has dropped its direct-I/O bounce buffers and its scratch."""
    path, want, budget = model
    monkeypatch.setenv("TORCHFERRY_READ", "direct")
    pipe, s = _open(path, budget)
    with s:
        assert torch.equal(pipe("a cat", steps=2), want)
        tier = s.engine.store.tier
        assert tier is not None
        reader = tier.reader
        largest = policies.tiers(s.plan).largest  # the bounce buffers the plan counts
        assert reader.bounce_bytes == policies.read_buffer_bytes(largest) and reader.scratch_bytes > 0
    assert s.report().host_bytes == 0 and s.host_bytes == 0
    assert reader.bounce_bytes == 0 and reader.scratch_bytes == 0
    assert reader._bounces.empty() and reader._scratch.empty()
    assert torch.equal(pipe("a cat", steps=2), want)


def _host_buffers(s: torchferry.Session) -> list[tuple[int, StorageWeakRef]]:
    """Weak references to the storages of every host buffer ``s`` holds: each pack's, each staging
    slot's, each device slot's (host memory on a CPU device); no strong reference kept here."""
    store = s.engine.store
    buffers = [p.host for p in store.packs.values() if p.host.numel()]
    buffers += [buffer.data for _, buffer in s.engine.slots.slots.values()]
    if store.tier is not None:
        buffers += [st.buffer.data for st in store.tier.staging.values()]
    return [(b.untyped_storage().data_ptr(), StorageWeakRef(b.untyped_storage())) for b in buffers]


@pytest.mark.parametrize("tier", ["host", "file"])
def test_close_drops_every_host_buffer(model: tuple[Path, torch.Tensor, int], tier: str) -> None:
    """Once close() returns, with the session object still referenced and nothing collected, every
    host buffer it held (packs, staging and device slots) is freed, save those the weights given back
    live in."""
    path, want, budget = model
    pipe, s = _open(path, budget if tier == "file" else None)
    with s:
        assert torch.equal(pipe("a cat", steps=2), want)
        held = _host_buffers(s)
        assert len(held) >= (9 if tier == "file" else BLOCKS)
    given_back = {t.untyped_storage().data_ptr() for t in pipe.state_dict().values()}
    kept = [at for at, ref in held if not ref.expired() and at not in given_back]
    assert not kept, f"{len(kept)} of {len(held)} host buffers outlive close()"
    assert torch.equal(pipe("a cat", steps=2), want)


# ---------------------------------------------------------------------- zero-size tensors (item 5)
def _with_empty(pipe: toy.ToyPipeline) -> toy.ToyPipeline:
    """``pipe`` with a zero-size parameter in every transformer block."""
    for block in pipe.transformer.blocks:
        empty = torch.empty(0, 4, device=block.q.weight.device)
        block.register_parameter("empty", torch.nn.Parameter(empty, requires_grad=False))
    return pipe


@pytest.mark.parametrize("source", ["checkpoint", "spill"])
def test_a_zero_size_parameter_in_a_file_tier_block(tmp_path: Path, source: str) -> None:
    """Blocks holding a zero-size parameter stream from the file tier (of a checkpoint or a spill)
    bit-identical, and close gives the empty parameter back with its shape."""
    ref = _with_empty(toy.build(0, hidden=HIDDEN, blocks=BLOCKS))
    with torch.no_grad():
        want = ref("a cat", steps=2)
    budget = _budget(ref)
    if source == "checkpoint":
        path = tmp_path / "toy.safetensors"
        toy.save_checkpoint(ref, path)
        pipe = _with_empty(toy.build_empty(hidden=HIDDEN, blocks=BLOCKS))
        s = torchferry.offload(
            pipe, device="cpu", strategy="layerwise", checkpoint=str(path), host_memory=budget
        )
    else:
        pipe = _with_empty(toy.build(0, hidden=HIDDEN, blocks=BLOCKS))
        s = torchferry.offload(
            pipe, device="cpu", strategy="layerwise", spill=str(tmp_path / "spill"), host_memory=budget
        )
    with s:
        assert s.report().file_packs > 0
        assert torch.equal(pipe("a cat", steps=2), want)
    assert all(b.empty.shape == (0, 4) for b in pipe.transformer.blocks)
    assert torch.equal(pipe("a cat", steps=2), want)


# ---------------------------------------------------------------- an unsearchable folder (item 10)
_UNSEARCHABLE = """
import os, sys, torch, torchferry
from torchferry.testing import toy
folder, budget = sys.argv[1], int(sys.argv[2])
path = os.path.join(folder, "toy.safetensors")
try:
    os.stat(folder)
except OSError:
    pass
pipe = toy.build_empty(hidden={hidden}, blocks={blocks})
with torchferry.offload(pipe, device="cpu", strategy="layerwise", checkpoint=path, host_memory=budget) as s:
    first = pipe("a cat", steps=2)
    os.chmod(folder, 0)
    try:
        try:
            os.stat(path)
        except PermissionError:
            print("hidden")
        second = pipe("a cat", steps=2)
    finally:
        os.chmod(folder, 0o755)
torch.save([first, second], os.path.join(folder, "out.pt"))
"""


def _without_dac_override() -> None:
    """In the child before exec: drop the capabilities by which root ignores a folder's permissions."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.skipif(sys.platform != "linux", reason="folder permissions and capabilities as on Linux")
def test_a_folder_made_unsearchable_keeps_reading_through_the_open_file(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """The checkpoint's folder made unsearchable (chmod 000) while a session reads it: the next call
    reads on through the descriptors opened and runs bit-identical (run in a process that cannot
    override folder permissions, as any user but root)."""
    path, want, budget = model
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "toy.safetensors").write_bytes(path.read_bytes())
    code = _UNSEARCHABLE.format(hidden=HIDDEN, blocks=BLOCKS)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    uses_root = os.geteuid() == 0
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(folder), str(budget)],
            capture_output=True, text=True, env=env, timeout=300, check=False, cwd=Path(__file__).parents[2],
            preexec_fn=_without_dac_override if uses_root else None,
        )  # fmt: skip
    except subprocess.SubprocessError:  # no CAP_SETPCAP to drop them with
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here, and root reads any folder")
    finally:
        folder.chmod(0o755)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hidden" in done.stdout  # the name really could not be looked up
    first, second = torch.load(folder / "out.pt")
    assert torch.equal(first, want) and torch.equal(second, want)


# ------------------------------------------------------------------------------- a forked process
_FORKED = """
import faulthandler, os, sys, torch, torchferry
from torchferry.testing import toy
path, budget = sys.argv[1], int(sys.argv[2])
pipe = toy.build_empty(hidden={hidden}, blocks={blocks})
s = torchferry.offload(pipe, device="cpu", strategy="layerwise", checkpoint=path, host_memory=budget)
first = pipe("a cat", steps=2)
child = os.fork()
if child == 0:
    faulthandler.dump_traceback_later(60, exit=True)  # a read that waits for ever fails the test
    try:
        pipe("a cat", steps=2)
        print("child read", flush=True)
    except torchferry.ExecutionError as exc:
        print("child refused:", exc, flush=True)
    s.close()
    os._exit(0)
_, status = os.waitpid(child, 0)
second = pipe("a cat", steps=2)
s.close()
torch.save([first, second, status], sys.argv[3])
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_from_a_session_is_refused_not_hung(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """A process forked while a file-tier session is open and calling the pipeline gets an ExecutionError
    that says why and what to do (the reader threads did not come along, the staging buffers are shared),
    instead of waiting for ever; the parent runs on bit-identical."""
    path, want, budget = model
    out = tmp_path / "out.pt"
    code = _FORKED.format(hidden=HIDDEN, blocks=BLOCKS)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}  # torch's own pool and fork
    done = subprocess.run(
        [sys.executable, "-c", code, str(path), str(budget), str(out)],
        capture_output=True, text=True, env=env, timeout=300, check=False, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(
        r"child refused: read of text_encoder\.blocks\.0: this session was opened in process \d+ and this "
        r"is process \d+, forked from it; a forked process has none of the file tier's reader threads and "
        r"shares its staging buffers with the process that opened it",
        done.stdout,
    ), done.stdout
    first, second, status = torch.load(out)
    assert status == 0 and torch.equal(first, want) and torch.equal(second, want)


class _Alarm(Exception):
    pass


def _raise_alarm(signum: int, frame: object) -> None:
    raise _Alarm


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
# An alarm that lands inside a garbage-collector callback (hypothesis installs one) is swallowed by
# Python itself, not by torchferry, and reported as unraisable: that landing aborts nothing.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_signal_during_reads_loses_nothing(model: tuple[Path, torch.Tensor, int]) -> None:
    """A SIGALRM whose handler raises, landing at spread points of a call while file-tier reads are in
    flight, aborts that call; the next call is bit-identical each time."""
    path, want, budget = model
    pipe, s = _open(path, budget)
    previous = signal.signal(signal.SIGALRM, _raise_alarm)
    try:
        with s:
            start = time.perf_counter()
            assert torch.equal(pipe("a cat", steps=2), want)
            took = time.perf_counter() - start
            landed = 0
            for i in range(8):
                signal.setitimer(signal.ITIMER_REAL, took * (i + 0.5) / 8)
                try:
                    pipe("a cat", steps=2)
                except _Alarm:
                    landed += 1
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                assert torch.equal(pipe("a cat", steps=2), want), i
            assert landed > 0
    finally:
        signal.signal(signal.SIGALRM, previous)


# torch reports the second signal, raised in the component's always-called hook, as a warning.
@pytest.mark.filterwarnings("ignore:module forward hook with:UserWarning")
def test_a_signal_inside_the_recovery_of_a_failed_step_loses_nothing(
    model: tuple[Path, torch.Tensor, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block raises, and while the session drops that step's device copies a second signal lands
    (the abort's first re-point of a unit still on the device raises): the abort was cut short, so
    the next call starts clean instead of finding units where no step left them; every later call is
    bit-identical."""
    path, want, budget = model
    pipe, s = _open(path, budget)
    armed = {"block": False, "abort": False}
    to_host = Pack.to_host

    def cut(pack: Pack) -> None:
        if armed["abort"] and pack.where is PackState.READY:
            armed["abort"] = False
            raise _Alarm
        to_host(pack)

    def failing(module: torch.nn.Module, args: object) -> None:
        if armed["block"]:
            armed["block"], armed["abort"] = False, True
            raise _Alarm

    monkeypatch.setattr(Pack, "to_host", cut)
    with s:
        assert torch.equal(pipe("a cat", steps=2), want)
        pipe.transformer.blocks[12].register_forward_pre_hook(failing)
        armed["block"] = True
        with pytest.raises(_Alarm):
            pipe("a cat", steps=2)
        assert not armed["abort"]
        for _ in range(2):
            assert torch.equal(pipe("a cat", steps=2), want)


def test_sessions_on_one_checkpoint_at_once_are_each_exact(model: tuple[Path, torch.Tensor, int]) -> None:
    """Three pipelines with file tiers on one checkpoint, each opened, called twice and closed on a thread
    of its own at the same time, all give the plain model's output."""
    path, want, budget = model
    results: list[bool] = []
    failures: list[BaseException] = []

    def run() -> None:
        try:
            pipe, s = _open(path, budget)
            with s:
                results.extend(torch.equal(pipe("a cat", steps=2), want) for _ in range(2))
        except BaseException as exc:  # reported on the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and results == [True] * 6
