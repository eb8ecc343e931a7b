"""The host budget's edges: unreadable machine figures, a budget the reserve leaves at 0, tensors the
file tier keeps widened to float32, the locked-memory limit of a pinner subject to it, and spill
folders (tmpfs refused, complete identical files kept)."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from machine_budgets import given_budget, host_budget
from safetensors.torch import save_file

import torchferry
from torchferry import OffloadWarning, PlanError, policies
from torchferry.runtime.files import _spill
from torchferry.runtime.machine import _facts, _host_facts
from torchferry.runtime.machine._host_facts import locked_limit
from torchferry.runtime.memory._pinning import BookPinner, CudaPinner, HostPinner
from torchferry.testing import toy

HIDDEN = 512
MiB = 1 << 20


def _fake_proc(root: Path, meminfo: str | None = None, status: str | None = None) -> Path:
    (root / "self").mkdir(parents=True, exist_ok=True)
    if meminfo is not None:
        (root / "meminfo").write_text(meminfo)
    if status is not None:
        (root / "self" / "status").write_text(status)
    return root


def _use_proc(monkeypatch: pytest.MonkeyPatch, proc: Path) -> None:
    real = _host_facts.host_facts
    monkeypatch.setattr(_facts, "host_facts", lambda **known: real(proc=proc, **known))
    monkeypatch.setattr(_host_facts, "_WARNED", set())


def test_unreadable_machine_figures_mean_no_limit_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing readable under /proc the budget is unlimited (bytes None, not given), warned about
    once, and a plain session opens and runs bit-identical instead of failing on a budget of 0."""
    proc = _fake_proc(tmp_path / "proc")
    _use_proc(monkeypatch, proc)
    with pytest.warns(OffloadWarning, match="no machine limit") as caught:
        budget = host_budget(proc=proc)
    assert len(caught) == 1
    assert budget.bytes is None and not budget.given and budget.bounds == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadWarning)
        again = host_budget(proc=proc)  # the same place read again: no second warning
    assert again.bytes is None
    ref = toy.build(0)
    with torch.no_grad():
        want = ref("a cat", steps=2)
    pipe = toy.build(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadWarning)
        session = torchferry.offload(pipe, strategy="layerwise", device="cpu")
    with session, torch.no_grad():
        assert torch.equal(pipe("a cat", steps=2), want)
        assert session.plan.config.host_memory_bytes is None
        assert session.host is not None and session.host.budget.bytes is None


def test_given_is_an_explicit_field() -> None:
    """A budget named by the caller says so; one read from the machine does not, bounds or none."""
    assert given_budget(1 << 30).given
    assert not host_budget().given


def test_a_budget_the_reserve_leaves_at_zero_names_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MemAvailable under the reserve: a PlanError naming the budget's source and the remedies, not the
    config validator's complaint about a host_memory= the caller never passed."""
    proc = _fake_proc(tmp_path / "proc", meminfo="MemTotal: 1048576 kB\nMemAvailable: 102400 kB\n")
    _use_proc(monkeypatch, proc)
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0), path)
    with pytest.raises(PlanError) as info:
        torchferry.offload(toy.build_empty(), strategy="layerwise", device="cpu", checkpoint=str(path))
    text = str(info.value)
    assert text.startswith("the host budget is 0 B") or text.startswith("the host budget is 0")
    assert "MemAvailable 100.0 MiB" in text and "less a reserve of 256.0 MiB" in text
    assert "pass host_memory=" in text and "free host memory" in text
    assert "must be a positive number" not in text


def _widened_checkpoint(path: Path) -> torchferry.testing.toy.ToyPipeline:
    """A toy whose transformer keeps ``fc1`` in float32, saved with those tensors in bfloat16; returns
    the reference model (its fc1 rounded to bfloat16, so widening is exact)."""
    ref = toy.build(0, hidden=HIDDEN)
    ref.transformer._keep_in_fp32_modules = ["fc1"]
    with torch.no_grad():
        for name, t in ref.named_parameters():
            if name.startswith("transformer.") and ".fc1." in name:
                t.copy_(t.to(torch.bfloat16).float())
    tensors = {n: t.detach().contiguous() for n, t in ref.state_dict(keep_vars=True).items()}
    seen: dict[int, str] = {}
    for name, p in ref.named_parameters(remove_duplicate=False):
        if seen.setdefault(id(p), name) != name:
            del tensors[name]
    narrow = {n for n in tensors if n.startswith("transformer.") and ".fc1." in n}
    tensors = {n: (t.to(torch.bfloat16) if n in narrow else t) for n, t in tensors.items()}
    save_file(tensors, str(path))
    return ref


def test_the_host_figure_counts_tensors_the_file_tier_keeps_widened(tmp_path: Path) -> None:
    """fc1 kept in float32 but stored in bfloat16: the file tier keeps float32 copies of its file-tier
    tensors in host memory, the open plan's tiers count them, and the whole footprint stays within the
    budget."""
    path = tmp_path / "toy.safetensors"
    ref = _widened_checkpoint(path)
    with torch.no_grad():
        want = ref("a cat", steps=2)
    pipe = toy.build_empty(hidden=HIDDEN)
    pipe.transformer._keep_in_fp32_modules = ["fc1"]
    whole = policies.tiers(torchferry.topology.resolve(
        torchferry.topology.discover(pipe), torchferry.topology.OffloadConfig(strategy="layerwise")
    )).host_bytes  # fmt: skip
    budget = int(whole * 0.8)
    session = torchferry.offload(
        pipe, strategy="layerwise", device="cpu", checkpoint=str(path), host_memory=budget
    )
    with session, torch.no_grad():
        assert torch.equal(pipe("a cat", steps=2), want)
        tier = session.engine.store.tier
        assert tier is not None and tier.kept_bytes > 0  # float32 copies really are kept
        assert session.host is not None
        assert "transformer.blocks.0.fc1.weight" in session.plan.facts.widened
        chosen = policies.tiers(session.plan)
        assert chosen.kept_bytes >= tier.kept_bytes
        assert session.host_bytes <= budget


def test_locked_limit_refuses_pins_of_a_pinner_subject_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finite RLIMIT_MEMLOCK (no CAP_IPC_LOCK) under the pinned bytes, read from this process: the open
    plan refuses a store pinning with a pinner charged to it with a PlanError naming the remedy, and
    lets the CUDA pinner through."""
    proc = _fake_proc(tmp_path / "proc", status="Name:\tpython\nCapEff:\t0000000000000000\n")
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lowered = 4 * MiB if hard == resource.RLIM_INFINITY else min(4 * MiB, hard)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (lowered, hard))
    try:
        locked, why = locked_limit(proc)
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
    assert locked == lowered and "ulimit -l" in why
    assert BookPinner.memlock and not CudaPinner.memlock
    pipe = toy.build(0, hidden=HIDDEN)
    plan = torchferry.topology.resolve(
        torchferry.topology.discover(pipe), torchferry.topology.OffloadConfig(strategy="layerwise")
    )
    cuda = policies.DeviceFacts(type="cuda", free_bytes=1 << 40)

    def facts(pinner: type[HostPinner]) -> policies.Facts:
        host = policies.HostFacts(locked_bytes=locked, locked_source=why, pins_locked=pinner.memlock)
        return policies.Facts(host=host, device=cuda)

    with pytest.raises(PlanError, match=r"over the locked-memory limit of 4\.0 MiB.*pin_memory=False"):
        policies.open_plan(plan, facts(BookPinner))
    assert policies.open_plan(plan, facts(CudaPinner)).pin


def test_spill_into_tmpfs_is_refused(tmp_path: Path) -> None:
    """spill= on a tmpfs (/dev/shm) would keep the file tier in memory: a PlanError naming a folder on
    a disk, raised before anything is written, and the folders the refused open made are gone again."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or _spill.MEMORY_FILESYSTEMS.get(_spill.statfs_type(shm) or 0) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    top = shm / f"torchferry-test-{os.getpid()}"
    folder = top / "nested" / "spill"
    pipe = toy.build(0, hidden=HIDDEN)
    try:
        with pytest.raises(PlanError, match=r"is on a tmpfs.*name a folder on a disk"):
            torchferry.offload(
                pipe, strategy="layerwise", device="cpu", host_memory=60 * MiB, spill=str(folder)
            )
        assert not top.exists()
    finally:
        if top.exists():
            shutil.rmtree(top)
    if _spill.statfs_type(tmp_path) not in _spill.MEMORY_FILESYSTEMS:
        assert _spill.spill_folder(tmp_path / "ok") == tmp_path / "ok"


def test_spill_keeps_a_complete_identical_file_and_rewrites_others(tmp_path: Path) -> None:
    """Spilling the same weights again keeps each file (same inode, no temporary left); a changed
    weight or a truncated file is rewritten with the new bytes."""
    pipe = toy.build(0, hidden=HIDDEN)
    plan = torchferry.topology.resolve(
        torchferry.topology.discover(pipe), torchferry.topology.OffloadConfig(strategy="layerwise")
    )
    packs = ["transformer.blocks.6", "transformer.blocks.7"]
    index = _spill.spill(pipe, plan, packs, tmp_path)
    files = sorted(tmp_path.glob("spill-*.safetensors"))
    assert len(files) == 2
    first = {f.name: f.stat().st_ino for f in files}
    index_ino = Path(index).stat().st_ino
    _spill.spill(pipe, plan, packs, tmp_path)
    assert {f.name: f.stat().st_ino for f in files} == first
    assert Path(index).stat().st_ino == index_ino
    assert not list(tmp_path.glob("*.tmp"))
    with torch.no_grad():
        pipe.transformer.blocks[7].fc1.weight.add_(1.0)
    files[0].write_bytes(files[0].read_bytes()[:-16])  # blocks.6, cut short
    _spill.spill(pipe, plan, packs, tmp_path)
    after = {f.name: f.stat().st_ino for f in files}
    assert all(after[n] != first[n] for n in first)
    from torchferry.runtime.files._checkpoint_reader import CheckpointReader

    with CheckpointReader(index) as reader:
        got = reader.read_tensor("transformer.blocks.7.fc1.weight")
    assert torch.equal(got, pipe.transformer.blocks[7].fc1.weight)


def test_reader_threads_take_the_session_device() -> None:
    """On CUDA the reader pool's threads start with torch.cuda.set_device of the session's device (so
    their drain waits bind no other GPU's context); elsewhere they are plain threads."""
    from torchferry.runtime.files._reader import thread_setup

    setup = thread_setup(torch.device("cuda", 3))
    assert setup == {"initializer": torch.cuda.set_device, "initargs": (torch.device("cuda", 3),)}
    assert thread_setup(torch.device("cpu")) == {} and thread_setup(None) == {}
