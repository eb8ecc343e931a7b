"""The host budget read from the machine: MemAvailable, nested v1 and v2 memory cgroups, the reserve,
the locked-memory limit, each figure with its source (fake /proc and /sys trees under tmp_path)."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
from machine_budgets import given_budget, host_budget

from torchferry import policies
from torchferry.policies import RESERVE_MIN
from torchferry.runtime.machine._host_facts import locked_limit

MiB = 1 << 20
GiB = 1 << 30


def _proc(
    tmp: Path,
    *,
    available: int = 16 * GiB,
    mounts: list[str] = (),  # type: ignore[assignment]
    cgroup: str = "",
    status: str = "CapEff:\t0000000000000000\n",
) -> Path:
    """A fake /proc: meminfo, self/mountinfo, self/cgroup and self/status."""
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       {32 * GiB // 1024} kB\nMemFree:        {GiB // 1024} kB\n"
        f"MemAvailable:   {available // 1024} kB\nCached:         {GiB // 1024} kB\n"
    )
    (proc / "self" / "mountinfo").write_text("".join(f"{m}\n" for m in mounts))
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "status").write_text(status)
    return proc


def _v1_group(folder: Path, *, limit: int, usage: int, inactive: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (folder / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (folder / "memory.stat").write_text(f"cache 0\ninactive_file 1\ntotal_inactive_file {inactive}\n")


def _v2_group(
    folder: Path, *, high: str = "max", hard: str = "max", current: int = 0, inactive: int = 0
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.max").write_text(f"{hard}\n")
    (folder / "memory.high").write_text(f"{high}\n")
    (folder / "memory.current").write_text(f"{current}\n")
    (folder / "memory.stat").write_text(f"anon 5\nactive_file 7\ninactive_file {inactive}\n")


def test_memavailable_less_the_reserve(tmp_path: Path) -> None:
    """Without cgroups the budget is MemAvailable less max(5%, 256 MiB), and says so."""
    budget = host_budget(proc=_proc(tmp_path, available=16 * GiB))
    reserve = int(16 * GiB * 0.05)
    assert budget.bytes == 16 * GiB - reserve
    assert budget.reserve == reserve
    assert budget.source == (
        f"MemAvailable 16.0 GiB ({tmp_path}/proc/meminfo MemAvailable) less a reserve of 819.2 MiB"
    )
    small = host_budget(proc=_proc(tmp_path / "small", available=2 * GiB))
    assert small.bytes == 2 * GiB - RESERVE_MIN  # 5% of 2 GiB is below the 256 MiB floor


def test_v1_nested_parent_binds(tmp_path: Path) -> None:
    """A v1 parent cgroup's limit binds its child; inactive file pages count as available."""
    root = tmp_path / "sys" / "memory"
    _v1_group(root, limit=(1 << 63) - 4096, usage=8 * GiB)  # the root: no limit
    _v1_group(root / "outer", limit=3 * GiB, usage=GiB, inactive=512 * MiB)
    _v1_group(root / "outer" / "inner", limit=6 * GiB, usage=GiB)
    proc = _proc(
        tmp_path,
        mounts=[f"30 25 0:27 / {root} rw,relatime shared:9 - cgroup cgroup rw,memory"],
        cgroup="4:memory:/outer/inner\n3:cpuset:/\n",
    )
    budget = host_budget(proc=proc)
    assert [b.what for b in budget.bounds] == [
        "cgroup v1 memory /outer",
        "cgroup v1 memory /outer/inner",
        "MemAvailable",
    ]
    outer = budget.bounds[0]
    assert outer.available == 3 * GiB - (GiB - 512 * MiB)
    assert outer.source == (
        f"{root}/outer: memory.limit_in_bytes 3.0 GiB - (memory.usage_in_bytes 1.0 GiB - "
        "total_inactive_file 512.0 MiB)"
    )
    assert budget.bytes == outer.available - RESERVE_MIN
    assert budget.source.startswith("cgroup v1 memory /outer 2.5 GiB (")


def test_v2_memory_high_and_max(tmp_path: Path) -> None:
    """v2: the lower of memory.max and memory.high binds; "max" means no limit; ancestors count."""
    root = tmp_path / "sys" / "unified"
    root.mkdir(parents=True)
    _v2_group(root / "user.slice", hard="4294967296", current=GiB, inactive=256 * MiB)
    _v2_group(root / "user.slice" / "app.scope", high=str(2 * GiB), current=GiB // 2)
    proc = _proc(
        tmp_path,
        mounts=[f"31 25 0:28 / {root} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"],
        cgroup="0::/user.slice/app.scope\n",
    )
    budget = host_budget(proc=proc)
    scope, slice_ = budget.bounds[0], budget.bounds[1]
    assert scope.what == "cgroup v2 /user.slice/app.scope"
    assert scope.available == 2 * GiB - GiB // 2
    assert "memory.high 2.0 GiB" in scope.source
    assert slice_.what == "cgroup v2 /user.slice"
    assert slice_.available == 4 * GiB - (GiB - 256 * MiB)
    assert "memory.max 4.0 GiB" in slice_.source


def test_container_view_mount_root(tmp_path: Path) -> None:
    """A container's bind-mounted hierarchy (mount root /docker/abc) maps the process's path to the
    mount point itself; an unlimited v1 group gives no bound."""
    point = tmp_path / "sys" / "memory"
    _v1_group(point, limit=GiB, usage=100 * MiB)
    proc = _proc(
        tmp_path,
        mounts=[
            f"40 30 0:35 /docker/abc {point} ro,nosuid - cgroup cgroup rw,memory",
            "41 30 0:36 /docker/abc /sys/fs/cgroup/cpu ro - cgroup cgroup rw,cpu",
        ],
        cgroup="9:memory:/docker/abc\n",
    )
    budget = host_budget(proc=proc)
    assert budget.bounds[0].what == "cgroup v1 memory /"
    assert budget.bounds[0].available == GiB - 100 * MiB
    _v1_group(point, limit=(1 << 63) - 4096, usage=100 * MiB)
    assert [b.what for b in host_budget(proc=proc).bounds] == ["MemAvailable"]


def test_cgroup_namespace_path_outside_view(tmp_path: Path) -> None:
    """A cgroup path this mount does not show (another namespace's) falls back to the deepest folder
    that exists, and a mount point with an escaped space is decoded."""
    point = tmp_path / "sys fs" / "memory"
    _v1_group(point, limit=2 * GiB, usage=0)
    escaped = str(point).replace(" ", "\\040")
    proc = _proc(
        tmp_path,
        mounts=[f"40 30 0:35 / {escaped} rw - cgroup cgroup rw,memory,hugetlb"],
        cgroup="9:memory:/not/here\n",
    )
    assert host_budget(proc=proc).bounds[0].available == 2 * GiB


def test_locked_limit_and_capability(tmp_path: Path) -> None:
    """RLIMIT_MEMLOCK bounds pinned bytes unless CAP_IPC_LOCK lifts it; both say so."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        pytest.skip("RLIMIT_MEMLOCK is unlimited here")
    plain = _proc(tmp_path / "a", status="CapEff:\t0000000000000000\n")
    locked, why = locked_limit(plain)
    assert locked == soft
    assert why.startswith("RLIMIT_MEMLOCK ") and why.endswith("(ulimit -l)")
    capable = _proc(tmp_path / "b", status="CapEff:\t000001ffffffffff\n")
    assert locked_limit(capable) == (None, why + ", lifted by CAP_IPC_LOCK")
    assert host_budget(proc=plain).locked_bytes == soft


def test_given_budget_and_credit(tmp_path: Path) -> None:
    """A given budget is the caller's word; a read one is credited with the bytes the store takes over
    before the reserve is taken off (the reserve is kept whatever is credited), and says why."""
    assert given_budget(GiB).bytes == GiB
    read = host_budget(proc=_proc(tmp_path, available=4 * GiB))
    facts = policies.HostFacts(bounds=read.bounds)
    more = policies.machine_budget(facts, GiB)
    assert read.bytes is not None and more.bytes == read.bytes + GiB
    assert ", plus 1.0 GiB of the pipeline's own weights the store takes over, less a reserve" in more.source
    assert "MemAvailable: 4.0 GiB" in more.describe()
