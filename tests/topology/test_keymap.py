"""`topology.KeyMap`: the checkpoint key of each model tensor, from prefixes, renames and conversions."""

from __future__ import annotations

from torchferry.topology import Conversion, FrozenMap, KeyMap


def test_a_rename_wins_over_the_prefixes_and_other_names_keep_them() -> None:
    """An exact rename names its tensor's key; every other name goes through the longest prefix."""
    keys = KeyMap({"text_encoder.": "te.", "text_encoder.model.": "te.m."}).with_library(
        {"text_encoder.model.language_model.layers.0.w": "text_encoder.model.layers.0.w"}, ()
    )
    assert keys.key("text_encoder.model.language_model.layers.0.w") == "text_encoder.model.layers.0.w"
    assert keys.key("text_encoder.model.language_model.layers.0.w2") == "te.m.language_model.layers.0.w2"
    assert keys.key("text_encoder.lm_head.weight") == "te.lm_head.weight"
    assert keys.key("vae.conv.weight") == "vae.conv.weight"


def test_a_key_map_is_a_prefix_map_that_compares_by_all_it_holds() -> None:
    """Without renames or conversions a KeyMap equals its prefix map; with them it does not, and
    equal maps hash alike."""
    plain = KeyMap({"transformer.": ""})
    assert plain == FrozenMap({"transformer.": ""}) and dict(plain) == {"transformer.": ""}
    assert KeyMap.of(plain) is plain and KeyMap.of(None) == KeyMap()
    made = Conversion(
        library="transformers",
        component="",
        model_class="MixtralModel",
        operation="MergeModulelist(dim=0)",
        sources=("layers.0.experts.0.w2.weight", "layers.0.experts.1.w2.weight"),
        targets=("layers.0.mlp.experts.down_proj",),
    )
    richer = plain.with_library({"a": "b"}, (made,))
    assert richer != plain and richer != FrozenMap({"transformer.": ""})
    assert richer == plain.with_library({"a": "b"}, (made,))
    assert hash(richer) == hash(plain.with_library({"a": "b"}, (made,)))
    assert richer.converted("layers.0.mlp.experts.down_proj") is made
    assert richer.converted("layers.0.mlp.experts.gate_up_proj") is None
