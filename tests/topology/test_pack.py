"""The flat-buffer layout: every tensor of every known model's buffers starts on a 256-byte boundary."""

from __future__ import annotations

import pytest

from torchferry import topology
from torchferry.runtime.store._fill import group_specs
from torchferry.topology import KNOWN_MODELS, PACK_ALIGN, TensorSpec, known_topology, pack, packed_nbytes


def test_pack_aligns_every_offset_and_counts_the_padding() -> None:
    """Odd-sized tensors are padded up to the next 256-byte boundary; the length ends at the last tensor."""
    specs = [
        TensorSpec(name="w", shape=(3, 5), dtype="float32"),  # 60 bytes
        TensorSpec(name="b", shape=(7,), dtype="bfloat16"),  # 14 bytes
        TensorSpec(name="m", shape=(3,), dtype="int8"),  # 3 bytes
    ]
    layout = pack(specs)
    assert [(s.name, off) for s, off in layout] == [("w", 0), ("b", 256), ("m", 512)]
    assert packed_nbytes(layout) == 515
    assert topology.Block(path="x", tensors=specs).nbytes == 515


@pytest.mark.parametrize("model_id", KNOWN_MODELS)
def test_every_known_model_buffer_is_256_byte_aligned(model_id: str) -> None:
    """Every tensor of every host buffer (and so device slot) a layerwise plan of a known model builds
    starts at a multiple of 256 bytes, and each buffer is exactly its unit's byte count."""
    plan = topology.resolve(known_topology(model_id), topology.OffloadConfig(strategy="layerwise"))
    groups = group_specs(plan)
    offsets = [off for specs in groups.values() for _, off in pack(specs)]
    assert len(offsets) == sum(1 for c in plan.components for _ in c.all_tensors())
    assert [off for off in offsets if off % PACK_ALIGN] == []
    blocks = {b.path: b.nbytes for c in plan.components for sub in c.walk() for b in sub.blocks}
    for name, specs in groups.items():
        if name in blocks:
            assert packed_nbytes(pack(specs)) == blocks[name], name
