"""The host store: one packed, aligned buffer per block; parameters become strided views into it."""

from __future__ import annotations

import torch

from torchferry import topology
from torchferry.runtime.store._store import HostStore
from torchferry.testing import toy


def _store(p: toy.ToyPipeline, strategy: str = "layerwise") -> tuple[HostStore, topology.Plan]:
    plan = topology.resolve(topology.discover(p), topology.OffloadConfig(strategy=strategy))  # type: ignore[arg-type]
    return HostStore.prepare(p, plan, pin=False).commit(), plan


def test_block_buffers_match_topology_and_are_aligned() -> None:
    """Each block's buffer is exactly Block.nbytes and every tensor starts at a multiple of its itemsize."""
    p = toy.build(0)
    store, plan = _store(p)
    for block in plan.component("transformer").blocks:
        pack = store.packs[block.path]
        assert pack.nbytes == block.nbytes == pack.host.numel()
        base = pack.host.data_ptr()
        for t in pack.tensors:
            assert t.untyped_storage().data_ptr() == base
            assert (t.data_ptr() - base) % t.element_size() == 0


def test_views_keep_strides_ties_and_values() -> None:
    """After the take-over, strides, tied identities and values are those of the original pipeline."""
    p, ref = toy.build(0), toy.build(0)
    store, _ = _store(p)
    block = p.transformer.blocks[2]
    assert block.out.weight.stride() == ref.transformer.blocks[2].out.weight.stride() == (1, 32)
    assert block.norm_k.weight is block.norm_q.weight
    assert all(
        torch.equal(a, b) for a, b in zip(p.state_dict().values(), ref.state_dict().values(), strict=True)
    )
    assert torch.equal(p("a cat"), ref("a cat"))
    assert store.nbytes == topology.discover(ref).nbytes


def test_close_gives_every_tensor_its_own_storage() -> None:
    """Closing the store re-homes each tensor in ordinary storage of its own, bit-identical."""
    p, ref = toy.build(0), toy.build(0)
    store, _ = _store(p)
    store.close()
    w = p.transformer.blocks[1].out.weight
    assert w.untyped_storage().nbytes() == w.numel() * w.element_size()
    assert w.stride() == (1, 32)
    assert all(
        torch.equal(a, b) for a, b in zip(p.state_dict().values(), ref.state_dict().values(), strict=True)
    )


def test_a_pack_in_flight_finds_writes_to_the_tensors_it_watches() -> None:
    """`Pack.carry` watches tensors for in-place writes from now on, keeping the counter it saw first
    for one watched already; `Pack.stale` reports a write to a watched tensor once and forgets the
    watch; `Pack.recopy` marks one tensor written."""
    p = toy.build(0)
    store, _ = _store(p)
    pack = store.packs["transformer.blocks.0"]
    first, second = pack.tensors[0], pack.tensors[1]
    pack.carry([0])
    with torch.no_grad():
        first.mul_(1)
    pack.carry([0, 1])  # tensor 0 keeps the counter from before the write
    assert pack.stale()
    assert not pack.stale() and pack.watched == {}
    pack.carry([0, 1])
    with torch.no_grad():
        pack.tensors[2].mul_(1)  # not watched
    assert not pack.stale()
    pack.carry([1])
    with torch.no_grad():
        second.mul_(1)
    assert pack.stale()
    pack.carry([0])
    pack.recopy(1)
    assert list(pack.watched) == [0, 1] and pack.stale()
