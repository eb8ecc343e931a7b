"""Hostile cases of the host budget and the file tier: odd budgets, checkpoints changed under a
session, edits, interrupts, threads, spills, re-opening after close; every output compared bit for
bit with the plain model."""

from __future__ import annotations

import gc
import json
import os
import random
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import torchferry
from torchferry import ExecutionError, PlanError, policies, topology
from torchferry.testing import toy

HIDDEN, BLOCKS = 256, 16  # 45 MiB: a file tier pays beside its 16 MiB of bounce buffers
pytestmark = pytest.mark.filterwarnings("ignore::torchferry.OffloadWarning")


def _whole(pipe: toy.ToyPipeline) -> int:
    plan = topology.resolve(topology.discover(pipe), topology.OffloadConfig(strategy="layerwise"))
    return policies.tiers(plan).host_bytes


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, int]:
    """The toy checkpoint, the plain model's output and a host budget (70% of the store)."""
    ref = toy.build(0, hidden=HIDDEN, blocks=BLOCKS)
    path = tmp_path_factory.mktemp("hostile") / "toy.safetensors"
    toy.save_checkpoint(ref, path)
    with torch.no_grad():
        want = ref("a cat", steps=3)
    return path, want, int(_whole(ref) * 0.7)


def _open(path: Path, budget: object, **options: object) -> tuple[toy.ToyPipeline, torchferry.Session]:
    pipe = toy.build_empty(hidden=HIDDEN, blocks=BLOCKS)
    options.setdefault("strategy", "layerwise")
    session = torchferry.offload(pipe, device="cpu", checkpoint=str(path), host_memory=budget, **options)
    return pipe, session


def _filed_block(session: torchferry.Session) -> str:
    return next(n for n in sorted(policies.tiers(session.plan).file) if n.startswith("transformer.blocks."))


# ------------------------------------------------------------------------------------ budgets
@pytest.mark.parametrize("text", ["30MiB", "30 MiB", "30mib", "31457280"])
def test_host_memory_as_text_is_bytes(model: tuple[Path, torch.Tensor, int], text: str) -> None:
    """host_memory= as text with a unit, any case or spacing, or as digits, is that many bytes, and the
    file tier it forces runs bit-identical."""
    path, want, _ = model
    if text.isdigit():
        text_or_int: object = int(text)
    else:
        text_or_int = text
    pipe, s = _open(path, text_or_int)
    with s:
        assert torch.equal(pipe("a cat", steps=3), want)
        assert s.report().host_budget == 30 << 20 and s.report().file_packs > 0


@pytest.mark.parametrize("value", [0, -5, "0", "0MiB", "-5", "abc", "1e9"])
def test_host_memory_not_positive_or_unreadable_is_a_plan_error(
    model: tuple[Path, torch.Tensor, int], value: object
) -> None:
    """A host budget of 0, negative, or text that is no size is a PlanError naming host_memory, and the
    pipeline stays on the meta device with no hook."""
    path, _, _ = model
    pipe = toy.build_empty(hidden=HIDDEN, blocks=BLOCKS)
    with pytest.raises(PlanError, match="host_memory"):
        torchferry.offload(pipe, device="cpu", strategy="layerwise", checkpoint=str(path), host_memory=value)
    assert pipe.transformer.blocks[0].q.weight.is_meta
    assert sum(len(m._forward_pre_hooks) for m in pipe.modules()) == 0


@pytest.mark.parametrize("value", [True, 1.5e8, 31457280.0])
def test_host_memory_of_another_type_is_a_type_error(
    model: tuple[Path, torch.Tensor, int], value: object
) -> None:
    """A bool or a float host budget is a TypeError naming host_memory (as device_memory= does)."""
    path, _, _ = model
    with pytest.raises(TypeError, match="host_memory must be a number of bytes"):
        _open(path, value)


def test_a_huge_host_budget_keeps_everything_in_host_memory(model: tuple[Path, torch.Tensor, int]) -> None:
    """A given budget far beyond any machine (2**62 bytes) is taken as given: no file tier, exact."""
    path, want, _ = model
    pipe, s = _open(path, 2**62)
    with s:
        assert torch.equal(pipe("a cat", steps=3), want)
        assert s.report().file_packs == 0


# ------------------------------------------------------------------------ the checkpoint changed
@pytest.mark.parametrize("change", ["truncate", "delete", "replace_same", "replace_other", "overwrite_other"])
def test_a_checkpoint_changed_between_steps_fails_the_step(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path, change: str
) -> None:
    """A checkpoint truncated, deleted, replaced by another model's file or overwritten in place between
    calls: the next call is an ExecutionError naming the file, never another model's output; replaced by
    a file of identical bytes, it reads on, bit-exact (the change check compares the bytes read)."""
    _, want, budget = model
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0, hidden=HIDDEN, blocks=BLOCKS), path)
    pipe, s = _open(path, budget)
    try:
        assert torch.equal(pipe("a cat", steps=3), want)
        other = tmp_path / "other.safetensors"
        toy.save_checkpoint(
            toy.build(0 if change == "replace_same" else 1, hidden=HIDDEN, blocks=BLOCKS), other
        )
        if change == "truncate":
            os.truncate(path, os.path.getsize(path) // 2)
        elif change == "delete":
            path.unlink()
        elif change == "overwrite_other":
            with open(path, "r+b") as f:
                f.write(other.read_bytes())
        else:
            os.replace(other, path)
        if change == "replace_same":
            assert torch.equal(pipe("a cat", steps=3), want)
            return
        with pytest.raises(ExecutionError, match=re.escape(str(path))):
            pipe("a cat", steps=3)
    finally:
        s.close()  # touches no view (those of a truncated file may not be read: see below)


_TRUNCATED = """
import os, sys, torch, torchferry
from torchferry.testing import toy
path, budget = sys.argv[1], int(sys.argv[2])
pipe = toy.build_empty(hidden={hidden}, blocks={blocks})
s = torchferry.offload(pipe, device="cpu", strategy="layerwise", checkpoint=path, host_memory=budget)
pipe("a cat", steps=1)
os.truncate(path, os.path.getsize(path) // 2)
try:
    pipe("a cat", steps=1)
except torchferry.ExecutionError:
    pass
try:
    pipe.state_dict()
except torchferry.ExecutionError:
    pass
print("survived")
"""


@pytest.mark.xfail(
    strict=True,
    reason="file-tier tensors point at a private mapping of the checkpoint between uses; once the file is "
    "truncated, touching them (state_dict(), reading a weight, after close() too) is SIGBUS: the process "
    "dies with every weight, where docs/host-memory.md promises an ExecutionError and nothing lost",
)
def test_a_truncated_checkpoint_does_not_kill_the_process(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """After a truncation of the checkpoint fails a step, state_dict() of the pipeline raises a torchferry
    error or returns; it does not kill the process."""
    _, _, budget = model
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0, hidden=HIDDEN, blocks=BLOCKS), path)
    code = _TRUNCATED.format(hidden=HIDDEN, blocks=BLOCKS)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(path), str(budget)],
        capture_output=True, text=True, env=env, timeout=120, check=False, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode, done.stderr[-2000:])


@pytest.mark.xfail(
    strict=True,
    reason="close() leaves file-tier tensors as views of the checkpoint's pages: rewriting the checkpoint "
    "afterwards in place (open(path, 'wb'), as torch.save and shutil.copyfile do) silently changes the "
    "closed pipeline's weights to the new file's",
)
def test_rewriting_the_checkpoint_after_close_changes_no_weight(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """A pipeline closed after a file-tier session keeps its weights when another model's bytes are written
    over its checkpoint in place (safetensors' own save_file makes a new file, which is safe)."""
    _, _, budget = model
    path = tmp_path / "toy.safetensors"
    toy.save_checkpoint(toy.build(0, hidden=HIDDEN, blocks=BLOCKS), path)
    pipe, s = _open(path, budget)
    pipe("a cat", steps=1)
    s.close()
    other = tmp_path / "other.safetensors"
    toy.save_checkpoint(toy.build(1, hidden=HIDDEN, blocks=BLOCKS), other)
    path.write_bytes(other.read_bytes())  # open(path, "wb"): the same inode, truncated and rewritten
    assert _same_weights(pipe, toy.build(0, hidden=HIDDEN, blocks=BLOCKS))


# ------------------------------------------------------------------------------ closing, reopening
@pytest.mark.parametrize("source", ["checkpoint", "spill"])
def test_a_closed_file_tier_session_still_held_lets_the_pipeline_open_again(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path, source: str
) -> None:
    """Closing a file-tier session that is still referenced (the ``with ... as s`` name) leaves no second
    tensor object on the weights' views, so the pipeline opens again (plainly and with a file tier) and
    runs bit-identical."""
    path, want, budget = model
    if source == "checkpoint":
        pipe, s = _open(path, budget)
    else:
        pipe = toy.build(0, hidden=HIDDEN, blocks=BLOCKS)
        s = torchferry.offload(pipe, device="cpu", strategy="layerwise", host_memory=budget, spill=tmp_path)
    with s:
        pipe("a cat", steps=1)
    assert s.closed
    with torchferry.offload(pipe, device="cpu", strategy="layerwise") as again:
        assert torch.equal(pipe("a cat", steps=3), want)
    with torchferry.offload(
        pipe, device="cpu", strategy="layerwise", host_memory=budget, spill=tmp_path / "second"
    ) as again:
        assert again.report().file_packs > 0
        assert torch.equal(pipe("a cat", steps=3), want)
    assert s.report().file_packs > 0  # the closed session's report still counts its file tier


def test_close_twice_and_outputs_after_close_are_exact(model: tuple[Path, torch.Tensor, int]) -> None:
    """close() twice is harmless; after it the pipeline's weights and outputs equal the plain model's."""
    path, want, budget = model
    pipe, s = _open(path, budget)
    pipe("a cat", steps=1)
    s.close()
    s.close()
    assert _same_weights(pipe, toy.build(0, hidden=HIDDEN, blocks=BLOCKS))
    assert torch.equal(pipe("a cat", steps=3), want)


def test_a_session_dropped_without_close_keeps_serving(model: tuple[Path, torch.Tensor, int]) -> None:
    """A file-tier session whose last reference is dropped and collected goes on serving its pipeline
    (session_of finds it) bit-identical."""
    path, want, budget = model
    pipe, s = _open(path, budget)
    pipe("a cat", steps=1)
    del s
    gc.collect()
    assert torch.equal(pipe("a cat", steps=3), want)
    found = torchferry.session_of(pipe)
    assert found is not None
    found.close()


# ------------------------------------------------------------------------------------------ edits
def test_an_edit_of_a_file_tier_weight_is_refused_until_close(model: tuple[Path, torch.Tensor, int]) -> None:
    """An in-place edit of a file-tier weight is refused at every later step, even once undone, and the
    pipeline after close() holds the edit, as the plain model would."""
    path, _, budget = model
    pipe, s = _open(path, budget)
    pipe("a cat", steps=1)
    block = _filed_block(s)
    weight = topology.find_attr(pipe, f"{block}.fc1.weight")
    plain = topology.find_attr(toy.build(0, hidden=HIDDEN, blocks=BLOCKS), f"{block}.fc1.weight")
    with torch.no_grad():
        weight.mul_(2)
    for _ in range(2):
        with pytest.raises(ExecutionError, match=re.escape(f"{block}.fc1.weight is in the file tier")):
            pipe("a cat", steps=1)
    s.close()
    assert torch.equal(weight, plain * 2)


@pytest.mark.parametrize("how", ["data", "load_state_dict"])
def test_replacing_file_tier_weights_is_refused(model: tuple[Path, torch.Tensor, int], how: str) -> None:
    """``.data =`` on a file-tier weight, or load_state_dict of the pipeline's own values, is refused at
    the next step with an ExecutionError naming the file tier."""
    path, _, budget = model
    pipe, s = _open(path, budget)
    with s:
        pipe("a cat", steps=1)
        if how == "data":
            weight = topology.find_attr(pipe, f"{_filed_block(s)}.fc1.weight")
            weight.data = weight.data.clone()
        else:
            pipe.load_state_dict(pipe.state_dict())
        with pytest.raises(ExecutionError, match="is in the file tier"):
            pipe("a cat", steps=1)


def test_a_hook_editing_a_later_file_tier_block_is_refused(model: tuple[Path, torch.Tensor, int]) -> None:
    """A hook of the first block that edits the last (file-tier) block during a step gets an
    ExecutionError, never an output made without its edit."""
    path, _, budget = model
    pipe, s = _open(path, budget)
    with s:
        last = pipe.transformer.blocks[BLOCKS - 1]
        assert f"transformer.blocks.{BLOCKS - 1}" in policies.tiers(s.plan).file

        def edit(module: torch.nn.Module, args: object) -> None:
            with torch.no_grad():
                last.fc1.weight.mul_(2)

        pipe.transformer.blocks[0].register_forward_pre_hook(edit)
        with pytest.raises(ExecutionError, match=f"transformer.blocks.{BLOCKS - 1}"):
            pipe("a cat", steps=1)


def test_a_keyboard_interrupt_from_a_hook_mid_reads_loses_nothing(
    model: tuple[Path, torch.Tensor, int],
) -> None:
    """A KeyboardInterrupt raised from a block's hook while file-tier reads are in flight propagates; the
    next calls and the weights after close() are the plain model's, bit for bit."""
    path, want, budget = model
    pipe, s = _open(path, budget)
    calls = [0]

    def interrupt(module: torch.nn.Module, args: object) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt

    handle = pipe.transformer.blocks[5].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        pipe("a cat", steps=3)
    handle.remove()
    assert torch.equal(pipe("a cat", steps=3), want)
    s.close()
    assert _same_weights(pipe, toy.build(0, hidden=HIDDEN, blocks=BLOCKS))


def test_threads_calling_a_file_tier_pipeline_get_one_answer_and_refusals(
    model: tuple[Path, torch.Tensor, int],
) -> None:
    """Three threads calling one file-tier pipeline at once: each call either returns the plain output
    or is refused with an ExecutionError (one step at a time); none returns a wrong output."""
    path, want, budget = model
    pipe, s = _open(path, budget)
    results: list[object] = []

    def run() -> None:
        try:
            results.append(torch.equal(pipe("a cat", steps=3), want))
        except ExecutionError as exc:
            results.append(str(exc))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.close()
    assert True in results and False not in results
    assert all(r is True or "one step at a time" in str(r) for r in results)
    assert torch.equal(pipe("a cat", steps=3), want)


# ------------------------------------------------------------------------------------- checkpoints
def test_a_checkpoint_in_shuffled_file_order_is_exact(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """A checkpoint whose tensors lie in a random order (no pack contiguous in the file) reads back
    bit-identical through the file tier."""
    path, want, budget = model
    tensors = load_file(str(path))
    names = list(tensors)
    random.Random(0).shuffle(names)
    shuffled = tmp_path / "shuffled.safetensors"
    save_file({n: tensors[n] for n in names}, str(shuffled))
    pipe, s = _open(shuffled, budget)
    with s:
        assert s.report().file_packs > 0
        assert torch.equal(pipe("a cat", steps=3), want)


def test_an_index_naming_a_missing_shard_is_refused_before_anything(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """Shards whose index names a file that is gone: a PlanError at open, the pipeline untouched."""
    path, _, budget = model
    tensors = load_file(str(path))
    first = {n: t for n, t in tensors.items() if n.startswith("transformer.blocks.1")}
    rest = {n: t for n, t in tensors.items() if n not in first}
    save_file(rest, str(tmp_path / "m-2.safetensors"))
    weight_map = dict.fromkeys(first, "m-1.safetensors") | dict.fromkeys(rest, "m-2.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    pipe = toy.build_empty(hidden=HIDDEN, blocks=BLOCKS)
    with pytest.raises(PlanError, match="nothing was read or changed"):
        torchferry.offload(
            pipe, device="cpu", strategy="layerwise", checkpoint=str(index), host_memory=budget
        )
    assert pipe.transformer.blocks[0].q.weight.is_meta and torchferry.session_of(pipe) is None


def test_a_checkpoint_of_another_dtype_is_refused(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """A bfloat16 checkpoint for a float32 model with a host budget: a PlanError naming the dtypes."""
    path, _, budget = model
    low = {
        n: t.to(torch.bfloat16) if t.dtype == torch.float32 else t for n, t in load_file(str(path)).items()
    }
    other = tmp_path / "bf16.safetensors"
    save_file(low, str(other))
    with pytest.raises(PlanError, match="dtype bfloat16 but the model expects float32"):
        _open(other, budget)


@pytest.mark.parametrize("strategy", ["layerwise", "auto"])
def test_two_expert_dits_with_a_file_tier_are_exact(tmp_path: Path, strategy: str) -> None:
    """transformer and transformer_2 with a file tier, layerwise and auto (which re-chooses once
    calibrated): every call and the weights after close() equal the plain model's."""
    ref = toy.build(0, hidden=HIDDEN, blocks=BLOCKS, two_experts=True)
    path = tmp_path / "moe.safetensors"
    toy.save_checkpoint(ref, path)
    with torch.no_grad():
        want = ref("a cat", steps=4)
    budget = int(_whole(ref) * 0.6)
    pipe = toy.build_empty(hidden=HIDDEN, blocks=BLOCKS, two_experts=True)
    options = {} if strategy == "auto" else {"strategy": strategy}
    with torchferry.offload(pipe, device="cpu", checkpoint=str(path), host_memory=budget, **options) as s:
        for _ in range(4):
            assert torch.equal(pipe("a cat", steps=4), want)
        report = s.report()
        assert report.file_packs > 0 and report.peak_host_bytes <= budget
        assert any(n.startswith("transformer_2.") for n in policies.tiers(s.plan).file)
    assert _same_weights(pipe, ref)


# ------------------------------------------------------------------------------------------ spill
def test_spill_to_a_file_is_a_plan_error(model: tuple[Path, torch.Tensor, int], tmp_path: Path) -> None:
    """spill= naming a file, not a folder, is a PlanError before anything is written or moved."""
    _, _, budget = model
    target = tmp_path / "a-file"
    target.write_text("x")
    pipe = toy.build(0, hidden=HIDDEN, blocks=BLOCKS)
    with pytest.raises(PlanError, match="cannot create the folder"):
        torchferry.offload(pipe, device="cpu", strategy="layerwise", host_memory=budget, spill=target)
    assert target.read_text() == "x" and torchferry.session_of(pipe) is None


def test_spill_over_another_models_files_is_exact(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """A spill folder holding another model's packs under the same names: they are rewritten, the
    pipeline runs bit-identical, and the other (closed) model keeps its own weights."""
    _, want, budget = model
    other = toy.build(1, hidden=HIDDEN, blocks=BLOCKS)
    with torchferry.offload(other, device="cpu", strategy="layerwise", host_memory=budget, spill=tmp_path):
        other("a cat", steps=1)
    pipe = toy.build(0, hidden=HIDDEN, blocks=BLOCKS)
    with torchferry.offload(
        pipe, device="cpu", strategy="layerwise", host_memory=budget, spill=tmp_path
    ) as s:
        assert s.report().file_packs > 0
        assert torch.equal(pipe("a cat", steps=3), want)
    assert _same_weights(other, toy.build(1, hidden=HIDDEN, blocks=BLOCKS))


def test_spill_with_storage_dtype_is_refused_before_writing(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """spill= with storage_dtype= whose budget leaves cast packs in the file tier is a PlanError before a
    single file is written; the pipeline is untouched and runs as before."""
    _, want, _ = model
    pipe = toy.build(0, hidden=HIDDEN, blocks=BLOCKS)
    budget = int(_whole(pipe) * 0.47)
    folder = tmp_path / "spill"
    refusal = (
        r"host budget [\d.]+ MiB \(given as host_memory=\) is too small for plan [0-9a-f]{8}: .*"
        r"\d+ pack\(s\) cannot be in the file tier, so they stay in host memory \(packs held in "
        r"storage_dtype='bfloat16' "
        r"would be read back in the model's own dtypes\); raise host_memory= to [\d.]+ MiB, or drop "
        r"storage_dtype="
    )
    with pytest.raises(PlanError, match=refusal):
        torchferry.offload(
            pipe,
            device="cpu",
            strategy="layerwise",
            host_memory=budget,
            storage_dtype="bfloat16",
            spill=folder,
        )
    assert not folder.exists() or not any(folder.iterdir())
    assert torchferry.session_of(pipe) is None
    assert torch.equal(pipe("a cat", steps=3), want)


def test_outputs_after_close_of_a_spill_session_are_exact(
    model: tuple[Path, torch.Tensor, int], tmp_path: Path
) -> None:
    """After a spill session closes, the pipeline's output equals the plain model's bit for bit: the
    spill files start every tensor on 64 bytes, so the views close leaves compute as aligned copies."""
    _, want, budget = model
    pipe = toy.build(0, hidden=HIDDEN, blocks=BLOCKS)
    with torchferry.offload(pipe, device="cpu", strategy="layerwise", host_memory=budget, spill=tmp_path):
        pipe("a cat", steps=1)
    assert _same_weights(pipe, toy.build(0, hidden=HIDDEN, blocks=BLOCKS))
    assert all(t.data_ptr() % 64 == 0 for t in pipe.state_dict().values())
    assert torch.equal(pipe("a cat", steps=3), want)
