"""The change check asks whether the bytes changed (docs/host-memory.md, the file tier's change check):
a checkpoint touched in every way that keeps its bytes (a copy renamed over it, a reflink copy, touch,
a hard link, an identical rewrite, chmod, an extended attribute, a rename with a symlink left behind),
before the first streamed read or after it, is read on bit-identical; a rewrite of a byte already read
is refused, with its modification time set back or not, and a second process reading the same file
is unaffected by the first's checks."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import torchferry
from torchferry import ExecutionError, policies, topology
from torchferry.testing import toy

HIDDEN, BLOCKS = 256, 16  # as tests/runtime/test_file_hostile.py: a file tier of several blocks
pytestmark = pytest.mark.filterwarnings("ignore::torchferry.OffloadWarning")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, int]:
    """The toy checkpoint, the plain model's output and a host budget of 70% of the store."""
    ref = toy.build(0, hidden=HIDDEN, blocks=BLOCKS)
    path = tmp_path_factory.mktemp("file_identity") / "toy.safetensors"
    toy.save_checkpoint(ref, path)
    with torch.no_grad():
        want = ref("a cat", steps=2)
    plan = topology.resolve(topology.discover(ref), topology.OffloadConfig(strategy="layerwise"))
    return path, want, int(policies.tiers(plan).host_bytes * 0.7)


def _open(path: Path, budget: int) -> tuple[toy.ToyPipeline, torchferry.Session]:
    pipe = toy.build_empty(hidden=HIDDEN, blocks=BLOCKS)
    session = torchferry.offload(
        pipe, device="cpu", strategy="layerwise", checkpoint=str(path), host_memory=budget
    )
    return pipe, session


def _copy_renamed_over(path: Path) -> None:
    """A copy of ``path`` (times kept, as ``cp --preserve``) renamed over it: another inode, same bytes."""
    shutil.copy2(path, path.with_name("copy.tmp"))
    os.replace(path.with_name("copy.tmp"), path)


def _reflink_renamed_over(path: Path) -> None:
    """A reflink copy of ``path`` renamed over it (skipped where the file system refuses reflinks)."""
    done = subprocess.run(
        ["cp", "--reflink=always", str(path), str(path.with_name("copy.tmp"))],
        capture_output=True,
        check=False,
    )
    if done.returncode:
        pytest.skip(f"no reflink copies here: {done.stderr.decode().strip()}")
    os.replace(path.with_name("copy.tmp"), path)


def _touch(path: Path) -> None:
    os.utime(path)


def _hard_link(path: Path) -> None:
    os.link(path, path.with_name(f"link-{time.monotonic_ns()}.safetensors"))


def _identical_rewrite(path: Path) -> None:
    """Every byte of ``path`` written again in place, unchanged (the modification time moves)."""
    data = path.read_bytes()
    with open(path, "r+b") as f:
        f.write(data)


def _chmod(path: Path) -> None:
    mode = os.stat(path).st_mode & 0o7777
    path.chmod(0)
    path.chmod(mode)


def _xattr(path: Path) -> None:
    try:
        os.setxattr(path, "user.torchferry.seen", str(time.monotonic_ns()).encode())
    except (AttributeError, OSError) as exc:
        pytest.skip(f"no extended attributes here: {exc}")


def _rename_and_symlink(path: Path) -> None:
    aside = path.with_name(f"moved-{time.monotonic_ns()}.safetensors")
    os.rename(path, aside)
    path.symlink_to(aside)


TOUCHES = [
    _copy_renamed_over,
    _reflink_renamed_over,
    _touch,
    _hard_link,
    _identical_rewrite,
    _chmod,
    _xattr,
    _rename_and_symlink,
]


@pytest.mark.parametrize("touch", TOUCHES, ids=lambda f: f.__name__.strip("_"))
def test_a_file_touched_without_changing_a_byte_reads_on(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path, touch: Callable[[Path], None]
) -> None:
    """Touched between the open and the first streamed read, and again after it: every call gives the
    plain model's output, bit for bit."""
    source, want, budget = model
    path = tmp_path / "toy.safetensors"
    shutil.copyfile(source, path)
    pipe, s = _open(path, budget)
    with s:
        time.sleep(0.02)  # past the file system's timestamp granularity
        touch(path)
        assert torch.equal(pipe("a cat", steps=2), want)
        time.sleep(0.02)
        touch(path)
        assert torch.equal(pipe("a cat", steps=2), want)


def _rewrite_one_byte(path: Path, at: int, *, keep_time: bool) -> None:
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))
    if keep_time:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("keep_time", [True, False], ids=["time-set-back", "time-moved"])
@pytest.mark.parametrize("first", [_copy_renamed_over, _touch], ids=["after-copy", "after-touch"])
def test_a_rewrite_of_a_byte_read_is_refused(
    model: tuple[Path, torch.Tensor, int],
    tmp_path: Path,
    keep_time: bool,
    first: Callable[[Path], None],
) -> None:
    """After a copy renamed over the file or a touch (read on), one byte of the last tensor (read by the
    first call) rewritten, its modification time set back or not, fails the next call with an
    ExecutionError saying the bytes read before differ."""
    source, want, budget = model
    path = tmp_path / "toy.safetensors"
    shutil.copyfile(source, path)
    pipe, s = _open(path, budget)
    with s:
        assert torch.equal(pipe("a cat", steps=2), want)
        time.sleep(0.02)
        first(path)
        assert torch.equal(pipe("a cat", steps=2), want)
        time.sleep(0.02)
        _rewrite_one_byte(path, os.path.getsize(path) - 5, keep_time=keep_time)
        with pytest.raises(ExecutionError, match="differ") as caught:
            pipe("a cat", steps=2)
        assert str(path) in str(caught.value)


@pytest.mark.slow  # a second Python process imports torch: about 8 s
def test_two_processes_read_one_checkpoint_touched_between(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """A second process holding its own session over the checkpoint while this one's runs, the file
    touched and linked between their calls: both give the plain model's output."""
    source, want, budget = model
    path = tmp_path / "toy.safetensors"
    shutil.copyfile(source, path)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch, torchferry\n"
            "from torchferry.testing import toy\n"
            f"pipe = toy.build_empty(hidden={HIDDEN}, blocks={BLOCKS})\n"
            "with torchferry.offload(pipe, device='cpu', strategy='layerwise', checkpoint=sys.argv[1],\n"
            "                        host_memory=int(sys.argv[2])):\n"
            "    outs = [pipe('a cat', steps=2) for _ in range(3)]\n"
            "torch.save(outs, sys.argv[3])\n",
            str(path),
            str(budget),
            str(tmp_path / "outs.pt"),
        ],
        cwd=Path(torchferry.__file__).parents[1],
    )
    pipe, s = _open(path, budget)
    with s:
        for touch in (_touch, _hard_link, _chmod):
            touch(path)
            assert torch.equal(pipe("a cat", steps=2), want)
    assert child.wait(timeout=120) == 0
    assert all(torch.equal(out, want) for out in torch.load(tmp_path / "outs.pt"))


def _write(path: Path, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.write(data)


def test_a_touch_while_the_header_is_parsed_is_not_a_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint touched, or linked, right after its header was parsed opens and reads as parsed
    (the header parsed again reads the same); a header rewritten there, the size kept, is refused."""
    from safetensors.torch import save_file

    from torchferry.runtime.files import _checkpoint_reader as module
    from torchferry.topology._safetensors import parse_header

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32)}, str(path))
    parse = parse_header
    change: list[Callable[[], None]] = []

    def parse_then_change(file: str, handle: object) -> object:
        found = parse(file, handle)  # type: ignore[arg-type]
        while change:
            change.pop()()
        return found

    monkeypatch.setattr(module, "parse_header", parse_then_change)
    for touch in (_touch, _hard_link):
        change.append(functools.partial(touch, path))
        with module.CheckpointReader(path) as reader:
            assert torch.equal(reader.read_tensor("a"), torch.arange(6, dtype=torch.float32))
    renamed = bytearray(path.read_bytes())
    renamed[renamed.index(b'"a"') + 1] = ord("b")  # the header names "b": same size, other header
    time.sleep(0.02)  # past the file system's timestamp granularity
    change.append(functools.partial(_write, path, bytes(renamed)))
    with pytest.raises(ExecutionError, match="was rewritten while its header was read"):
        module.CheckpointReader(path)
