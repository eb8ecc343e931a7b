"""torch.profiler shows torchferry's ops by name (``torchferry::load``...), and only while it records."""

from __future__ import annotations

from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

import torchferry
from torchferry.testing import toy


def test_profiler_trace_names_every_op_of_a_step() -> None:
    """Under torch.profiler every executed op is one ``torchferry::<kind>`` range; outputs are unchanged."""
    p, ref = toy.build(0), toy.build(0)
    expected = ref("a cat", steps=2)
    with torchferry.offload(p, strategy="layerwise", device="cpu") as session:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = p("a cat", steps=2)
        kinds = Counter(op.kind for s in session.schedules.values() for op in s.ops)
    assert torch.equal(out, expected)
    seen = Counter(e.name for e in prof.events() if e.name.startswith("torchferry::"))
    for kind in ("load", "wait", "evict", "stage"):
        assert seen[f"torchferry::{kind}"] >= kinds[kind] > 0, kind
    assert set(seen) <= {f"torchferry::{k}" for k in torchferry.policies.OP_KINDS}
