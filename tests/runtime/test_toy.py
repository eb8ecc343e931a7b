"""The toy pipeline that ships with torchferry: deterministic, declared, and awkward where it should be."""

from __future__ import annotations

from pathlib import Path

import torch

from torchferry import topology
from torchferry.testing import toy


def test_weights_are_a_function_of_the_seed() -> None:
    """Two builds with one seed agree bit for bit; another seed differs."""
    a, b, c = toy.build(0), toy.build(0), toy.build(1)
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert not torch.equal(a.transformer.blocks[0].q.weight, c.transformer.blocks[0].q.weight)
    assert torch.equal(a("a cat"), b("a cat"))


def test_awkward_tensors_are_there() -> None:
    """Blocks hold a tied pair, a transposed weight and a float16 tensor; the encoder ties a weight."""
    p = toy.build(0)
    block = p.transformer.blocks[0]
    assert block.norm_k.weight is block.norm_q.weight
    assert not block.out.weight.is_contiguous()
    assert block.gate.dtype == torch.float16
    assert p.text_encoder.out_proj.weight is p.text_encoder.in_proj.weight


def test_declared_topology() -> None:
    """Discovery finds the declared components and block lists of both pipeline variants."""
    topo = topology.discover(toy.build(0, two_experts=True))
    assert [c.path for c in topo.components] == ["transformer", "transformer_2", "text_encoder", "vae"]
    assert len(topo.component("transformer_2").blocks) == 8
    assert len(topo.component("text_encoder").blocks) == 2


def test_two_experts_hand_over_mid_way() -> None:
    """The two-expert pipeline runs ``transformer`` then ``transformer_2``, switching at the boundary."""
    p = toy.build(0, two_experts=True)
    seen: list[str] = []
    p.transformer.register_forward_pre_hook(lambda m, a: seen.append("transformer"))
    p.transformer_2.register_forward_pre_hook(lambda m, a: seen.append("transformer_2"))
    p("a cat", steps=4)
    assert seen == ["transformer", "transformer", "transformer_2", "transformer_2"]


def test_skipping_a_block_changes_the_output() -> None:
    """A skip mapping really skips blocks on the named step."""
    p = toy.build(0)
    assert not torch.equal(p("a cat", steps=2), p("a cat", steps=2, skip={1: {3}}))


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    """A saved checkpoint loads into a differently seeded toy and reproduces outputs, strides and ties."""
    path = tmp_path / "toy.safetensors"
    a = toy.build(0)
    toy.save_checkpoint(a, path)
    b = toy.load_checkpoint(toy.build(5), path)
    assert torch.equal(a("a cat"), b("a cat"))  # type: ignore[operator]
    assert b.transformer.blocks[0].out.weight.stride() == (1, 32)  # type: ignore[union-attr,index]
