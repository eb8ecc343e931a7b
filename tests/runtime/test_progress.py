"""Progress while a session opens: shown on a terminal (tqdm or one stderr line), silent elsewhere."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import torchferry
from torchferry.runtime.store._progress import Progress, wanted
from torchferry.testing import toy


class Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_plain_line_shows_bytes_share_and_time() -> None:
    """Without tqdm the display is one rewritten line, ending with the total and a newline."""
    out = Terminal()
    with Progress("reading weights", stream=out, use_tqdm=False, min_bytes=0) as progress:
        progress(2**30, 2 * 2**30)
        progress(2**30, 2 * 2**30)
    text = out.getvalue()
    assert text.startswith("\rtorchferry: reading weights: 1.0 GiB of 2.0 GiB (50%) in ")
    last = text.rsplit("\r", 1)[1]
    assert last.startswith("torchferry: reading weights: 2.0 GiB of 2.0 GiB (100%) in ")
    assert last.endswith(" GB/s\n")
    assert progress.done == 2 * 2**30


def test_tqdm_bar_when_importable() -> None:
    """With tqdm the display is its bar, in bytes, labelled with what is being done."""
    pytest.importorskip("tqdm")
    out = Terminal()
    with Progress("reading weights", stream=out, use_tqdm=True, min_bytes=0) as progress:
        progress(512 * 2**20, 2**30)
        progress(512 * 2**20, 2**30)
    assert "torchferry: reading weights: 100%" in out.getvalue()
    assert "1.00G/1.00G" in out.getvalue()


def test_silent_off_a_terminal_and_below_the_threshold() -> None:
    """Nothing is written to a stream that is not a terminal, nor for work under min_bytes."""
    plain = io.StringIO()
    with Progress("reading weights", stream=plain, use_tqdm=False, min_bytes=0) as progress:
        progress(10, 10)
    assert plain.getvalue() == ""
    small = Terminal()
    with Progress("reading weights", stream=small, use_tqdm=False, min_bytes=100) as progress:
        progress(10, 10)
    assert small.getvalue() == ""


def test_environment_overrides_the_terminal_check() -> None:
    """TORCHFERRY_PROGRESS=0 silences a terminal and =1 forces progress onto any stream."""
    assert wanted(Terminal(), {}) is True
    assert wanted(Terminal(), {"TORCHFERRY_PROGRESS": "0"}) is False
    assert wanted(io.StringIO(), {"TORCHFERRY_PROGRESS": "1"}) is True
    assert wanted(io.StringIO(), {}) is False


def test_a_broken_stream_turns_the_display_off() -> None:
    """An OSError from the terminal stops the display; the work it reports on goes on."""

    class Broken(Terminal):
        def write(self, text: str) -> int:
            raise OSError("gone")

    progress = Progress("reading weights", stream=Broken(), use_tqdm=False, min_bytes=0)
    progress(1, 2)
    progress(1, 2)
    progress.close()
    assert progress.done == 2


@pytest.mark.parametrize("from_checkpoint", [False, True])
def test_opening_a_session_reports_every_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, from_checkpoint: bool
) -> None:
    """Opening a session (from the module or a checkpoint) reports all host bytes, one call per group."""
    calls: list[tuple[int, int]] = []
    original = Progress.__call__

    def record(self: Progress, nbytes: int, total: int) -> None:
        calls.append((nbytes, total))
        original(self, nbytes, total)

    monkeypatch.setattr(Progress, "__call__", record)
    options: dict[str, object] = {}
    if from_checkpoint:
        path = tmp_path / "toy.safetensors"
        toy.save_checkpoint(toy.build(0), path)
        pipe = toy.build_empty()
        options["checkpoint"] = path
    else:
        pipe = toy.build(0)
    with torchferry.offload(pipe, strategy="layerwise", device="cpu", **options) as session:
        assert sum(n for n, _ in calls) == session.host_bytes
        assert {t for _, t in calls} == {session.host_bytes}
        assert len(calls) == len(session.engine.store.packs)
        assert not any(t.is_meta for t in pipe.parameters())
    assert isinstance(pipe.transformer.blocks[0].q.weight, torch.Tensor)


def test_forcing_progress_shows_it_at_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCHFERRY_PROGRESS=1 shows the display for work below MIN_BYTES too, as the README says."""
    monkeypatch.setenv("TORCHFERRY_PROGRESS", "1")
    out = io.StringIO()
    with Progress("reading weights", stream=out, use_tqdm=False) as progress:
        progress(2**20, 2**20)
    assert out.getvalue().startswith("\rtorchferry: reading weights: 1.0 MiB of 1.0 MiB (100%) in ")
    monkeypatch.setenv("TORCHFERRY_PROGRESS", "")
    quiet = Terminal()
    with Progress("reading weights", stream=quiet, use_tqdm=False) as progress:
        progress(2**20, 2**20)
    assert quiet.getvalue() == ""
