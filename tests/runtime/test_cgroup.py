"""`offload(pipe, checkpoint=..., device="cpu")` with no other argument, in a process held to a cgroup v1
memory limit under half the checkpoint's size: the host planner reads the cgroup's bound, the CPU
device's budget is its share of the same one budget, the file tier's reader fills the device's slots
itself (no staging slot), and the run completes bit-identical, never killed for memory."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torchferry.testing import toy

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("host_child.py")
V1 = Path("/sys/fs/cgroup/memory")
LIMIT = 704 << 20
HIDDEN, BLOCKS = 1024, 39  # about 1.57 GiB of weights in 40 MiB blocks: over twice the limit
PROMPT, STEPS = "a ferry at dawn", 2


def _own_cgroup() -> Path | None:
    """This process's cgroup v1 memory folder, when there is one to nest a test cgroup in."""
    if not V1.is_dir() or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = V1 / path.lstrip("/")
            return folder if folder.is_dir() else None
    return None


@pytest.fixture
def cgroup() -> Iterator[Path]:
    """A memory cgroup nested in this process's own, limited to `LIMIT`; skipped where not allowed."""
    parent = _own_cgroup()
    if parent is None:
        pytest.skip("no cgroup v1 memory hierarchy to nest a test cgroup in (needs root)")
    folder = parent / f"torchferry-test-{os.getpid()}"
    try:
        folder.mkdir()
        (folder / "memory.limit_in_bytes").write_text(str(LIMIT))
    except OSError as exc:
        if folder.is_dir():
            folder.rmdir()
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    swappiness = folder / "memory.swappiness"
    if swappiness.exists():
        with contextlib.suppress(OSError):
            swappiness.write_text("0")  # over the limit is a kill, not a swap
    yield folder
    folder.rmdir()


def test_default_offload_of_a_checkpoint_twice_the_limit_runs_exactly(cgroup: Path, tmp_path: Path) -> None:
    """A 1.57 GiB checkpoint of 40 MiB blocks in a 704 MiB memory cgroup: auto plans one budget of what
    the cgroup leaves (about 200 MiB beside the process and the reserve), the device's least (the CPU's
    memory is host memory) and the host the rest, reads what does not fit from the file straight into
    the device's slots, and the image equals the plain run's. Two 40 MiB staging slots would not fit:
    with them the least is 224.8 MiB, and this was refused; without them it is 144.7 MiB."""
    ref = toy.build(0, hidden=HIDDEN, blocks=BLOCKS)
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(ref, path)
    assert path.stat().st_size >= 2 * LIMIT
    with torch.no_grad():
        want = ref(PROMPT, steps=STEPS)
    del ref
    procs = cgroup / "cgroup.procs"

    def join() -> None:  # in the child, before exec: everything it allocates is charged to the cgroup
        procs.write_text(str(os.getpid()))

    run = subprocess.run(
        [sys.executable, str(CHILD), str(path), str(tmp_path), "--hidden", str(HIDDEN), "--blocks",
         str(BLOCKS), "--auto"],
        preexec_fn=join, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert "cgroup v1 memory" in figures["host_budget_source"]
    assert figures["device_budget_source"].startswith("the least the device's schedules need, ")
    assert figures["file_packs"] > 0
    assert int((cgroup / "memory.max_usage_in_bytes").read_text()) <= LIMIT
    assert torch.equal(torch.load(tmp_path / "out.pt"), want)
