"""Host memory: exact pinning (pinned bytes ~ store bytes), unpinned at close, a refused pin falls back
before anything is mutated, and every managed tensor starts on a 256-byte boundary."""

from __future__ import annotations

import os
import re

import pytest
import torch

import torchferry
from torchferry import OffloadWarning, policies, topology
from torchferry.runtime.memory._pinning import PAGE, BookPinner, HostPinner, page_bytes
from torchferry.runtime.store._store import HostStore
from torchferry.testing import toy
from torchferry.topology import KNOWN_MODELS, PACK_ALIGN, known_topology


class _Refusing(HostPinner):
    """Pins the first ``allow`` buffers (keeping books like `BookPinner`), then refuses like a full ulimit."""

    def __init__(self, allow: int) -> None:
        self.books = BookPinner()
        self.allow = allow
        self.calls = 0

    def register(self, ptr: int, nbytes: int) -> None:
        self.calls += 1
        if self.calls > self.allow:
            raise RuntimeError("cudaHostRegister of 4096 bytes returned cudaErrorMemoryAllocation")
        self.books.register(ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        self.books.unregister(ptr)


def _plan(p: toy.ToyPipeline) -> topology.Plan:
    return topology.resolve(topology.discover(p), topology.OffloadConfig(strategy="layerwise"))


def _snapshot(p: torch.nn.Module) -> list[tuple[str, int, torch.Tensor]]:
    return [(n, t.data_ptr(), t.detach().clone()) for n, t in p.state_dict(keep_vars=True).items()]


@pytest.mark.parametrize("model_id", KNOWN_MODELS)
def test_pinned_bytes_of_every_known_model_are_within_one_percent(model_id: str) -> None:
    """A layerwise store of each shipped topology pins at most 1% more than it holds (whole pages)."""
    plan = topology.resolve(known_topology(model_id), topology.OffloadConfig(strategy="layerwise"))
    held = sum(_sizes(plan))
    assert held == sum(c.nbytes for c in plan.components if not c.on_demand)
    pinned = policies.tiers(plan).store_bytes
    assert pinned == sum(page_bytes(n) for n in _sizes(plan) if n)
    assert 1.0 <= pinned / held <= 1.01


def _sizes(plan: topology.Plan) -> list[int]:
    from torchferry.runtime.store._fill import group_specs

    return [topology.packed_nbytes(topology.pack(g)) for g in group_specs(plan).values()]


def test_store_pins_exactly_its_pages_and_close_unpins_them() -> None:
    """Every buffer is page-aligned and registered once (the store bytes the tiers count, whole pages);
    close unregisters each."""
    p = toy.build(0)
    plan = _plan(p)
    pinner = BookPinner()
    store = HostStore.prepare(p, plan, pin=True, pinner=pinner).commit()
    assert store.pinned
    assert store.pinned_bytes == policies.tiers(plan).store_bytes == sum(pinner.ranges.values())
    assert store.nbytes == sum(_sizes(plan))
    assert sorted(pinner.ranges) == sorted(g.host.data_ptr() for g in store.packs.values() if g.nbytes)
    for group in store.packs.values():
        assert group.host.data_ptr() % PAGE == 0
        for t in group.tensors:
            assert t.data_ptr() % PACK_ALIGN == 0, group.name
    store.close()
    assert pinner.ranges == {}
    assert store.pinned_bytes == 0


WARNING = (
    "torchferry: could not pin a host buffer of {n} bytes (RuntimeError: cudaHostRegister of 4096 bytes "
    "returned cudaErrorMemoryAllocation); the session keeps its weights in pageable host memory "
    "instead, where every host-to-device copy is synchronous (no overlap with compute). Raise the "
    "locked-memory limit (ulimit -l, or the container's memlock limit) or free host memory, or pass "
    "pin_memory=False to choose pageable memory"
)


def test_a_pinner_that_refuses_outright_is_found_in_prepare_before_anything_changes() -> None:
    """The probe page's pin fails in prepare: one warning, nothing pinned, the pipeline as it was; commit
    then serves the pipeline from pageable memory with unchanged outputs."""
    p, ref = toy.build(0), toy.build(0)
    before = _snapshot(p)
    pinner = _Refusing(allow=0)
    with pytest.warns(OffloadWarning) as caught:
        prepared = HostStore.prepare(p, _plan(p), pin=True, pinner=pinner)
    assert [str(w.message) for w in caught] == [WARNING.format(n=PAGE)]
    assert pinner.calls == 1
    after = _snapshot(p)
    assert [(n, ptr) for n, ptr, _ in after] == [(n, ptr) for n, ptr, _ in before]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(after, before, strict=True))
    store = prepared.commit()
    assert pinner.calls == 1
    assert not store.pinned
    assert store.pinned_bytes == 0
    assert torch.equal(p("a cat"), ref("a cat"))
    store.close()


def test_a_pin_refused_part_way_through_commit_falls_back_to_pageable_memory() -> None:
    """The second pack's pin fails in commit (a locked-memory limit reached part-way): commit does not
    raise, unpins the first pack, warns once, and serves unchanged outputs from pageable memory."""
    p, ref = toy.build(0), toy.build(0)
    pinner = _Refusing(allow=2)  # the probe page, then the first pack
    prepared = HostStore.prepare(p, _plan(p), pin=True, pinner=pinner)
    assert pinner.books.ranges == {}  # from the module, packs are pinned only once filled, in commit
    second = [b for b in prepared.buffers.values() if b.numel()][1].numel()
    with pytest.warns(OffloadWarning) as caught:
        store = prepared.commit()
    assert [str(w.message) for w in caught] == [WARNING.format(n=second)]
    assert pinner.calls == 3
    assert pinner.books.ranges == {}
    assert not store.pinned
    assert store.pinned_bytes == 0
    assert torch.equal(p("a cat"), ref("a cat"))
    store.close()


def test_packs_from_the_module_are_pinned_one_by_one_as_commit_fills_them() -> None:
    """From the module, prepare pins nothing (the model is never held twice); each pack is registered
    right after its tensors are re-pointed at it, and a discarded prepare leaves nothing pinned."""
    p = toy.build(0)
    pinner = BookPinner()
    prepared = HostStore.prepare(p, _plan(p), pin=True, pinner=pinner)
    assert pinner.ranges == {}
    prepared.discard()
    assert pinner.ranges == {}
    order: list[int] = []

    class _Watching(HostPinner):
        def register(self, ptr: int, nbytes: int) -> None:
            pinner.register(ptr, nbytes)
            # Each pack pinned so far already backs its tensors (re-pointed before its pin).
            tensors = [*p.parameters(), *p.buffers()]
            order.append(sum(1 for t in tensors if ptr <= t.data_ptr() < ptr + nbytes))

        def unregister(self, ptr: int) -> None:
            pinner.unregister(ptr)

    store = HostStore.prepare(p, _plan(p), pin=True, pinner=_Watching()).commit()
    assert store.pinned
    assert len(order) == 1 + sum(1 for g in store.packs.values() if g.nbytes)  # the probe page, each pack
    assert order[0] == 0 and all(n >= 1 for n in order[1:])
    store.close()
    assert pinner.ranges == {}


def test_book_pinner_refuses_what_the_driver_refuses() -> None:
    """Overlapping registrations and unregistering an unknown address raise, as cudaHostRegister does."""
    books = BookPinner()
    books.register(4096, 8192)
    overlap = "host range at 0x2000 overlaps one registered at 0x1000"
    with pytest.raises(RuntimeError, match=re.escape(overlap)):
        books.register(8192, 4096)
    with pytest.raises(RuntimeError, match=re.escape("host range at 0x3000 is not registered")):
        books.unregister(12288)
    books.unregister(4096)
    assert books.ranges == {}


def test_every_managed_tensor_is_aligned_in_host_memory_and_in_slots_during_a_forward() -> None:
    """Inside each block's forward its weights sit at 256-byte aligned addresses in their slot (whose base
    is aligned on every device), and every managed tensor's host view is 256-byte aligned (buffers start
    on a page)."""
    p, ref = toy.build(0), toy.build(0)
    seen: list[tuple[str, int]] = []

    def check(module: torch.nn.Module, args: object) -> None:
        for name, t in module.named_parameters():
            seen.append((name, t.data_ptr() % PACK_ALIGN))

    handles = [b.register_forward_pre_hook(check) for b in p.transformer.blocks]
    with torchferry.offload(p, strategy="layerwise", prefetch_depth=2, device="cpu") as session:
        out = p("a cat")
        store = session.engine.store
        for group in store.packs.values():
            for t in group.host_views:
                assert t.data_ptr() % PACK_ALIGN == 0, group.name
    for h in handles:
        h.remove()
    assert torch.equal(out, ref("a cat"))
    assert seen
    assert {r for _, r in seen} == {0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_views_are_256_byte_aligned_and_host_memory_is_registered() -> None:
    """On CUDA every weight a block runs with is a 256-byte aligned device pointer; the store is pinned."""
    p, ref = toy.build(0), toy.build(0)
    ptrs: list[int] = []

    def check(module: torch.nn.Module, args: object) -> None:
        ptrs.extend(t.data_ptr() for t in module.parameters())

    handles = [b.register_forward_pre_hook(check) for b in p.transformer.blocks]
    with torchferry.offload(p, strategy="layerwise", device="cuda") as session:
        out = p("a cat").cpu()
        assert session.engine.store.pinned
        assert all(g.host.is_pinned() for g in session.engine.store.packs.values() if g.nbytes)
    for h in handles:
        h.remove()
    assert ptrs
    assert all(ptr % PACK_ALIGN == 0 for ptr in ptrs)
    assert torch.allclose(out, ref("a cat"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pageable_memory_on_cuda_warns_once() -> None:
    """pin_memory=False on CUDA says once that copies become synchronous."""
    p = toy.build(0)
    with pytest.warns(OffloadWarning, match="pin_memory=False on cuda") as caught:
        session = torchferry.offload(p, strategy="layerwise", device="cuda", pin_memory=False)
    assert sum(issubclass(w.category, OffloadWarning) for w in caught) == 1
    session.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_released_buffers_give_their_memory_back_to_the_os() -> None:
    """A filled 64 MiB buffer raises RSS by its size, and releasing it (as close does) takes it back."""
    from torchferry.runtime.memory._pinning import HostMemory

    memory = HostMemory(BookPinner())
    size = 64 << 20
    base = _rss()
    buffer = memory.alloc("block", size)
    buffer.fill_(1)
    grown = _rss() - base
    del buffer
    memory.release("block")
    assert grown > size * 0.9
    assert _rss() - base < size * 0.1
    assert memory.pinned_bytes == 0
