"""The GGUF header reader (`topology.read_gguf`): torch shapes as diffusers loads them, more than four
dimensions, the alignment key, and every damaged file refused with the problem named."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest

from torchferry import PlanError
from torchferry.topology import is_gguf, read_gguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, object]], alignment: int | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch="test")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for name, (data, kind) in tensors.items():
        if kind is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _values(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def test_shapes_offsets_and_types_are_what_the_gguf_package_reads(tmp_path: Path) -> None:
    """Q8_0 and BF16 tensors are uint8 rows of their stored bytes, F16/F32 keep their dtype, a
    5-dimensional tensor keeps its five dimensions, and offsets honour general.alignment=64."""
    path = _write(
        tmp_path / "m.gguf",
        {
            "q": (_values(3, 64), Q.Q8_0),
            "b": (_values(2, 4), Q.BF16),
            "h": (_values(5).astype(np.float16), None),
            "five": (_values(2, 1, 3, 2, 4), None),
        },
        alignment=64,
    )
    entries = {e.name: e for e in read_gguf(path)}
    assert is_gguf(path) and not is_gguf(tmp_path)
    assert (entries["q"].dtype, entries["q"].shape, entries["q"].logical_shape) == ("uint8", (3, 68), (3, 64))
    assert (entries["b"].dtype, entries["b"].shape, entries["b"].quant_type) == ("uint8", (2, 8), "BF16")
    assert (entries["h"].dtype, entries["h"].shape, entries["h"].nbytes) == ("float16", (5,), 10)
    assert entries["five"].shape == (2, 1, 3, 2, 4) and entries["five"].dtype == "float32"
    for tensor in gguf.GGUFReader(str(path)).tensors:
        entry = entries[tensor.name]
        assert (
            entry.shape == tuple(tensor.data.shape) and entry.data_start + entry.begin == tensor.data_offset
        )
        assert (entry.data_start + entry.begin) % 64 == 0


def _good(tmp_path: Path) -> bytes:
    return _write(tmp_path / "good.gguf", {"w": (_values(2, 32), Q.Q8_0)}).read_bytes()


def test_not_gguf_is_refused(tmp_path: Path) -> None:
    """A file without the magic is named as not GGUF."""
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(
        PlanError, match=re.escape(f"{path}: does not begin with the GGUF magic; it is not a GGUF file")
    ):
        read_gguf(path)


def test_a_truncated_header_is_refused(tmp_path: Path) -> None:
    """A header cut short names where it ran out."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(_good(tmp_path)[:30])
    with pytest.raises(
        PlanError, match=r"runs past the end of the 30-byte file; the file is truncated or not GGUF$"
    ):
        read_gguf(path)


def test_truncated_data_is_refused(tmp_path: Path) -> None:
    """A tensor whose bytes run past the end of the file is refused before anything is read."""
    raw = _good(tmp_path)
    path = tmp_path / "short.gguf"
    path.write_bytes(raw[:-40])
    with pytest.raises(
        PlanError,
        match=r"tensor 'w' needs bytes 0-68 of the data region, which holds 56; the file is truncated$",
    ):
        read_gguf(path)


def test_an_unknown_type_and_a_bad_version_are_refused(tmp_path: Path) -> None:
    """A ggml type diffusers cannot load, and a GGUF version other than 2 or 3, are named."""
    raw = bytearray(_good(tmp_path))
    path = tmp_path / "v.gguf"
    path.write_bytes(raw[:4] + struct.pack("<I", 9) + raw[8:])
    with pytest.raises(
        PlanError, match=re.escape(f"{path}: GGUF version 9; torchferry reads versions 2 and 3")
    ):
        read_gguf(path)
    at = raw.index(b"w\x02\x00\x00\x00") + 1 + 4 + 16  # after the name: rank, two dims, then the type
    raw[at : at + 4] = struct.pack("<I", 19)  # IQ1_S
    path.write_bytes(bytes(raw))
    with pytest.raises(
        PlanError, match=r"tensor 'w' has ggml type 19, which diffusers does not load; known types: F32, "
    ):
        read_gguf(path)


def _deep(path: Path, depth: int) -> Path:
    """A GGUF file with no tensors and one metadata array nested ``depth`` deep (12 bytes a level)."""
    key = b"deep"
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    raw += struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 0)
    path.write_bytes(raw)
    return path


def test_metadata_arrays_nested_past_the_bound_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Arrays nested 5,000 deep (a 60 KB header) are a PlanError naming the key and the bound, not a
    RecursionError, and `torchferry plan` says so in one line with status 2; 16 levels still read."""
    from torchferry.cli import main

    assert read_gguf(_deep(tmp_path / "ok.gguf", 16)) == ()
    path = _deep(tmp_path / "deep.gguf", 5000)
    message = f"{path}: metadata 'deep' nests arrays more than 16 deep (at byte 232); GGUF files nest "
    with pytest.raises(PlanError, match=re.escape(message)):
        read_gguf(path)
    (tmp_path / "config.json").write_text('{"_class_name": "WanTransformer3DModel"}')
    assert main(["plan", str(path), "--device-memory", "1GiB"]) == 2
    err = capsys.readouterr().err  # (diffusers may log its own lines while importing)
    said = f"torchferry plan: error: {message}at most 2, so the header is damaged or hostile"
    assert [line for line in err.splitlines() if "torchferry" in line] == [said]
    assert "Traceback" not in err
