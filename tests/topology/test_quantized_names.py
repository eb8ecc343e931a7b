"""torchao's names for a wrapper tensor's parts in a safetensors file read as discovery's names
(`torchferry.topology._quantized`), from the file's metadata alone."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from torchferry import topology

#: What torchao writes for one Int8Tensor weight and one plain bias (abridged to the keys read).
METADATA = {
    "tensor_names": json.dumps(["blocks.0.proj.weight", "blocks.0.proj.bias", "table"]),
    "blocks.0.proj.weight": json.dumps(
        {"_type": "Int8Tensor", "_data": {}, "_tensor_data_names": ["qdata", "scale"]}
    ),
    "blocks.0.proj.bias": json.dumps({"_type": "Tensor"}),
    "table": json.dumps({"_type": "Tensor"}),
}


def test_torchao_metadata_names_each_part_as_discovery_does() -> None:
    """Each part ``<module>._<param>_<attribute>`` of a wrapper the metadata describes maps to
    ``<module>.<param>.<attribute>``; plain tensors and metadata that is not torchao's map nothing."""
    assert topology.flattened_names(METADATA) == {
        "blocks.0.proj._weight_qdata": "blocks.0.proj.weight.qdata",
        "blocks.0.proj._weight_scale": "blocks.0.proj.weight.scale",
    }
    assert topology.flattened_names({"format": "pt"}) == {}
    assert topology.flattened_names({"tensor_names": "not json"}) == {}


def test_a_torchao_file_reads_under_discovery_names(tmp_path: Path) -> None:
    """The checkpoint reader's renaming of a file torchao wrote: entries and the shard index's keys
    take discovery's names (under the component prefix), bytes and offsets unchanged; a file without
    torchao's metadata is left as it is."""
    tensors = {
        "blocks.0.proj._weight_qdata": torch.zeros(4, 4, dtype=torch.int8),
        "blocks.0.proj._weight_scale": torch.ones(4, 1),
        "blocks.0.proj.bias": torch.ones(4),
        "table": torch.ones(2),
    }
    file = str(tmp_path / "model.safetensors")
    save_file(tensors, file, metadata=METADATA)
    plain = str(tmp_path / "plain.safetensors")
    save_file(tensors, plain, metadata={"format": "pt"})
    index = {f"transformer.{k}": file for k in tensors}
    with open(file, "rb") as handle:
        entries = topology.parse_header(file, handle)
        found, renamed = topology.quantized_names(file, handle, entries, index, "transformer.")
    assert sorted(e.name for e in found) == [
        "blocks.0.proj.bias",
        "blocks.0.proj.weight.qdata",
        "blocks.0.proj.weight.scale",
        "table",
    ]
    assert sorted((e.begin, e.end) for e in found) == sorted((e.begin, e.end) for e in entries)
    assert renamed is not None and sorted(renamed) == sorted(f"transformer.{e.name}" for e in found)
    with open(plain, "rb") as handle:
        entries = topology.parse_header(plain, handle)
        assert topology.quantized_names(plain, handle, entries, None) == (entries, None)
