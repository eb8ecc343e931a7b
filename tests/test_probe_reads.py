"""`torchferry probe PATH`: the drive's read rates, buffered and direct, measured by the file tier's
method with the page cache dropped first, and saved with the device profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torchferry import PlanError
from torchferry.cli import main
from torchferry.runtime import load_profile
from torchferry.runtime._readrate import read_files, sequential_read


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    where = tmp_path / "ckpt"
    (where / "transformer").mkdir(parents=True)
    save_file({"a": torch.arange(3 << 20, dtype=torch.float32)}, str(where / "transformer" / "a.safetensors"))
    save_file({"b": torch.arange(1 << 20, dtype=torch.float32)}, str(where / "b.safetensors"))
    return where


def test_sequential_read_reads_every_byte(folder: Path) -> None:
    """A raw read of a folder's safetensors (largest first), buffered and direct, reads every byte
    (and no more than a limit), after dropping the files from the page cache."""
    files = read_files(folder)
    assert [Path(f).name for f in files] == ["a.safetensors", "b.safetensors"]
    total = sum(Path(f).stat().st_size for f in files)
    for direct in (False, True):
        rate = sequential_read(files, direct=direct)
        assert rate.nbytes == total and rate.seconds > 0 and rate.bytes_per_s > 0
        assert sequential_read(files, direct=direct, limit=5 << 20).nbytes == 5 << 20
    (folder / "empty").mkdir()
    with pytest.raises(PlanError, match=r"holds no \*\.safetensors files"):
        read_files(folder / "empty")


def test_probe_path_saves_read_rates(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`torchferry probe PATH` prints both read rates and saves them in the profile, which loads back
    with them (so `policies.estimate_cost` uses the measured rate)."""
    out = tmp_path / "profile.json"
    assert main(["probe", str(folder), "--device", "cpu", "--output", str(out), "--read-bytes", "8MiB"]) == 0
    text = capsys.readouterr().out
    assert f"read {folder} (page cache dropped first):" in text
    assert "  buffered: " in text and "  direct (O_DIRECT): " in text
    doc = json.loads(out.read_text())
    assert doc["read_bytes_per_s"] > 0 and doc["read_direct_bytes_per_s"] > 0
    profile = load_profile(out)
    assert profile is not None and profile.read_direct_bytes_per_s == doc["read_direct_bytes_per_s"]
    assert profile.file_read_bytes_per_s() == doc["read_direct_bytes_per_s"]
    assert main(["probe", "--device", "cpu", "--no-save"]) == 0
    assert "read " not in capsys.readouterr().out
