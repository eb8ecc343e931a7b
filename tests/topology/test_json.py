"""Every user JSON file torchferry reads (a pipeline's model_index.json, a device profile, a GGUF
config.json: tests/integration/test_gguf_lies.py) goes through one reader that refuses nesting deeper
than 64 levels in words, never a RecursionError (`topology/_json.py`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import torchferry
from torchferry import runtime, topology

DEEP = "[" * 100_000 + "]" * 100_000


def test_load_json_bounds_the_nesting() -> None:
    """64 levels parse; 65 levels, and 100,000 (past Python's own parser), are a ValueError saying so."""
    assert topology.load_json("[" * 64 + "]" * 64) is not None
    for text in ("[" * 65 + "]" * 65, DEEP, '{"a": ' * 65 + "1" + "}" * 65):
        with pytest.raises(ValueError, match="it nests arrays and objects deeper than 64 levels"):
            topology.load_json(text)


def test_a_deep_model_index_is_a_plan_error(tmp_path: Path) -> None:
    """A pipeline folder whose model_index.json nests 100,000 deep is a PlanError naming the file."""
    (tmp_path / "model_index.json").write_text(DEEP)
    with pytest.raises(
        torchferry.PlanError,
        match=re.escape(f"{tmp_path / 'model_index.json'}: cannot read the ")
        + ".*"
        + re.escape("(it nests arrays and objects deeper than 64 levels)"),
    ):
        topology.read_pipeline_folder(tmp_path)


def test_a_deep_profile_is_a_plan_error(tmp_path: Path) -> None:
    """A device profile nested 100,000 deep is a PlanError saying to probe again."""
    where = tmp_path / "profile.json"
    where.write_text(DEEP)
    with pytest.raises(torchferry.PlanError, match=re.escape(f"profile {where} cannot be read (it nests")):
        runtime.load_profile(where)


def test_deep_torchao_metadata_is_not_torchaos() -> None:
    """A safetensors header whose torchao ``tensor_names`` (or one tensor's description) nests 100,000
    deep is read as metadata that is not torchao's (no renames), never a RecursionError."""
    assert topology.flattened_names({"tensor_names": DEEP}) == {}
    described = {"tensor_names": '["blocks.0.weight"]', "blocks.0.weight": DEEP}
    assert topology.flattened_names(described) == {}
