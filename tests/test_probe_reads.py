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
from torchferry.runtime.machine._readrate import read_files, sequential_read


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
    sizes = ["--read-bytes", "8MiB", "--min-bytes", "8MiB"]
    assert main(["probe", str(folder), "--device", "cpu", "--output", str(out), *sizes]) == 0
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


def test_probe_path_refuses_what_is_not_a_safetensors_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A PATH that is not a *.safetensors file (model_index.json) is refused, rc 2, saving nothing."""
    index = tmp_path / "model_index.json"
    index.write_text("{}")
    out = tmp_path / "profile.json"
    assert main(["probe", str(index), "--device", "cpu", "--output", str(out)]) == 2
    assert "not a *.safetensors file, so not what the file tier reads" in capsys.readouterr().err
    assert not out.exists()


def test_probe_path_refuses_too_few_bytes_to_time(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """16 MiB of safetensors is under the 64 MiB floor: rc 2, the message says so, and no profile is saved;
    --min-bytes lowers the floor, and --read-bytes under it is refused too."""
    out = tmp_path / "profile.json"
    assert main(["probe", str(folder), "--device", "cpu", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "16.0 MiB of *.safetensors to read, too few to time a read rate over (at least 64.0 MiB)" in err
    assert "nothing was measured or saved" in err and "--min-bytes" in err
    assert not out.exists()
    sizes = ["--min-bytes", "8MiB", "--read-bytes", "4MiB"]
    assert main(["probe", str(folder), "--device", "cpu", "--output", str(out), *sizes]) == 2
    asked = capsys.readouterr().err
    assert "a read of 4.0 MiB (--read-bytes, read_bytes=) is too few" in asked and not out.exists()
    assert main(["probe", "--device", "cpu", "--min-bytes", "8MiB", "--no-save"]) == 2
    assert "name PATH" in capsys.readouterr().err
