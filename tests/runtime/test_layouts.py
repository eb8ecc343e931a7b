"""`Layouts`: which storages close rebuilds, and that it waits for every pack holding one of them."""

from __future__ import annotations

import torch

from torchferry.runtime.memory._layouts import Layouts


def test_plain_tensors_record_nothing() -> None:
    """Tensors that are their whole storage, dense at offset 0 (transposed ones too), cost nothing."""
    layouts = Layouts.take({"a": [torch.randn(4, 4), torch.randn(4, 4).t()], "b": [torch.randn(3)]})
    assert layouts.pending == 0


def test_shared_storage_waits_for_every_pack_then_is_rebuilt() -> None:
    """Two views of one storage in two packs share one fresh storage only once both packs gave back."""
    base = torch.arange(20, dtype=torch.float32)
    first, second = base[:8].view(2, 4), base[10:18].view(2, 4)
    layouts = Layouts.take({"a": [first], "b": [second]})
    assert layouts.pending == 1
    first.data, second.data = first.data.clone(), second.data.clone()  # what give_back leaves
    layouts.given_back("a")
    assert layouts.pending == 1
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    layouts.given_back("b")
    assert layouts.pending == 0
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert first.untyped_storage().nbytes() == 80
    assert (first.storage_offset(), second.storage_offset()) == (0, 10)
    assert torch.equal(first, torch.arange(8.0).view(2, 4))
    assert torch.equal(second, torch.arange(10.0, 18.0).view(2, 4))


def test_gapped_strides_come_back() -> None:
    """A tensor with gaps between its elements gets its strides and offset back on a storage of its size."""
    wide = torch.arange(32, dtype=torch.float32).view(4, 8)
    gapped = wide[:, 1::2]
    layouts = Layouts.take({"a": [gapped]})
    gapped.data = gapped.data.contiguous()
    layouts.given_back("a")
    assert (gapped.stride(), gapped.storage_offset(), gapped.untyped_storage().nbytes()) == ((8, 2), 1, 128)
    assert torch.equal(gapped, torch.arange(32.0).view(4, 8)[:, 1::2])


def test_an_expanded_buffer_comes_back_expanded_after_a_session() -> None:
    """A buffer made with ``.expand`` (stride 0) runs exactly, and close() gives it back with stride 0 on
    its one-row storage, every block given back (no raw error part-way)."""
    import torchferry

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
            self.register_buffer("table", torch.arange(16.0).expand(4, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x) + self.table[1]
            return x

    model = Model()
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = model(x)
    session = torchferry.offload(model, strategy="layerwise", device="cpu")
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    session.close()
    assert session.closed
    assert model.table.stride() == (0, 1)
    assert model.table.untyped_storage().nbytes() == 64
    assert torch.equal(model.table, torch.arange(16.0).expand(4, 16))
    assert all(b.weight.untyped_storage().nbytes() == 16 * 16 * 4 for b in model.blocks)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_overlapping_views_on_one_storage_are_rebuilt() -> None:
    """Strides whose elements share memory (an expand, a sliding window) are rebuilt location by location."""
    from torchferry.runtime.memory._layouts import _overlapping

    window = torch.arange(10, dtype=torch.float32).as_strided((4, 4), (2, 1))
    layouts = Layouts.take({"a": [window]})
    window.data = window.data.clone()
    layouts.given_back("a")
    assert (window.stride(), window.untyped_storage().nbytes()) == ((2, 1), 40)
    assert torch.equal(window, torch.arange(10.0).as_strided((4, 4), (2, 1)))
    assert _overlapping((4, 16), (0, 1)) and _overlapping((4, 4), (2, 1))
    assert not _overlapping((4, 4), (1, 4)) and not _overlapping((4, 1, 4), (4, 99, 1))
