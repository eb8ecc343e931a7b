"""`topology.check_gguf_fits`, the one check `from_single_file` and `torchferry plan` refuse a GGUF
file by: every way the file's shapes disagree with the configured model, named at once."""

from __future__ import annotations

import re

import pytest

from torchferry import PlanError
from torchferry.topology import check_gguf_fits

#: A model of two blocks, width 8 (2 heads of 4), feed-forward 16.
MODEL = {
    "embed.weight": (8, 3),
    **{f"blocks.{i}.ff.weight": (16, 8) for i in range(2)},
    **{f"blocks.{i}.attn.weight": (8, 8) for i in range(2)},
}
CONFIG = {"_class_name": "Toy", "num_layers": 2, "num_heads": 2, "head_dim": 4, "ffn_dim": 16, "eps": 1e-6}


def test_a_file_that_fills_the_model_passes() -> None:
    """Equal names and shapes raise nothing."""
    check_gguf_fits("m.gguf", "Toy", dict(MODEL), MODEL, CONFIG)


def test_every_problem_is_named_with_shapes_and_fields() -> None:
    """A feed-forward of other rows names ffn_dim, a width of other size names heads x head_dim, and
    blocks the file has beyond the model's count are one range naming num_layers, all in one error."""
    found = {
        **MODEL,
        "embed.weight": (16, 3),
        "blocks.0.ff.weight": (32, 8),
        **{f"blocks.{i}.{p}.weight": (8, 8) for i in (2, 3) for p in ("ff", "attn")},
    }
    listing = (
        "m.gguf does not fill the Toy its configuration builds (3 problems; nothing was read):\n"
        "  - blocks.2 to blocks.3 (2 blocks) of the file have no place in Toy, which has 2 of blocks (config "
        "field num_layers gives 2; the file has 4)\n"
        "  - tensor 'embed.weight': the file's shape is [16, 3], the configuration's [8, 3] (config field "
        "num_heads x head_dim gives 8; the file has 16)\n"
        "  - tensor 'blocks.0.ff.weight': the file's shape is [32, 8], the configuration's [16, 8] (config "
        "field ffn_dim gives 16; the file has 32)\n"
        "pass config= the configuration the file was made from, or leave config= out to infer it from the "
        "file"
    )
    with pytest.raises(PlanError, match=f"^{re.escape(listing)}$") as caught:
        check_gguf_fits("m.gguf", "Toy", found, MODEL, CONFIG)
    assert caught.value.message("cli").endswith(
        "\nput the config.json of the model the file was made from beside it, or remove it to infer the "
        "configuration from the file"
    )


def test_missing_tensors_and_a_file_of_another_model() -> None:
    """A tensor missing from a block is named alone; a file holding none of the model's tensors is told
    so once; an inferred configuration's refusal says it was inferred and how to give one."""
    found = {n: s for n, s in MODEL.items() if n != "blocks.1.attn.weight"}
    with pytest.raises(
        PlanError, match=re.escape("  - tensor 'blocks.1.attn.weight' of Toy is not in the file\n")
    ):
        check_gguf_fits("m.gguf", "Toy", found, MODEL, CONFIG)
    with pytest.raises(
        PlanError,
        match=re.escape("  - it holds none of the 5 tensors of Toy (the file's are named like 'x.w'"),
    ):
        check_gguf_fits("m.gguf", "Toy", {"x.w": (1,)}, MODEL, CONFIG)
    with pytest.raises(
        PlanError,
        match=re.escape(
            "m.gguf does not fill the Toy configuration inferred from its tensors (Toy (its names))"
        ),
    ):
        check_gguf_fits("m.gguf", "Toy", {"x.w": (1,)}, MODEL, CONFIG, inferred="Toy (its names)")
