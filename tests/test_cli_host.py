"""``torchferry plan --host-memory``: the file tier per component, host bytes, and the step with reads."""

from __future__ import annotations

import json
import re
from typing import Any

import attrs
import pytest
import torch

from torchferry import policies, topology
from torchferry.cli import main
from torchferry.runtime import host_name, profile_path, save_profile

GIB = 1 << 30
WAN = "wan2.2-t2v-a14b"


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(_plan(capsys, *argv, "--format", "json"))
    return doc


def test_wan_on_a_24gib_card_and_a_32gib_host(capsys: pytest.CaptureFixture[str]) -> None:
    """Wan2.2 A14B (64.2 GiB) plans for 24 GiB of device and 32 GiB of host memory: which packs are read
    from the checkpoint per component, host bytes within the budget, and a step that hides its reads."""
    out = _plan(capsys, WAN, "--device-memory", "24GiB", "--host-memory", "32GiB", "--spill").splitlines()
    assert (
        f"host memory 32.0 GiB · file reads 3.5 GB/s (assumed: a PCIe Gen3 NVMe drive; no profile at "
        f"{profile_path()}; pass --read-bandwidth, or time the drive with torchferry probe CHECKPOINT)"
    ) in out
    start = out.index("host tier of layerwise(depth=1) (host memory 32.0 GiB, file reads at 3.5 GB/s):")
    rows = out[start + 2 : start + 9]
    table = [f"{r.split('  ')[0]} | {' '.join(r[len(r.split('  ')[0]) :].split())}" for r in rows]
    assert table == [
        "transformer | 19 of 40 blocks + remainder in file 13.7 GiB 12.9 GiB 12.4 GiB every forward, "
        "496.4 MiB once a session",
        "transformer_2 | 18 of 40 blocks + remainder in file 14.4 GiB 12.3 GiB 11.8 GiB every forward, "
        "496.4 MiB once a session",
        "text_encoder | 24 of 24 blocks in file 2.0 GiB 8.6 GiB 8.6 GiB once a call",
        "vae | file 0 B 242.0 MiB 242.0 MiB once a session",
        "staging slots | 2 x 670.3 MiB 1.3 GiB -",
        "read buffers | direct I/O 16.0 MiB -",
        "total | of a 32.0 GiB budget 31.4 GiB 34.1 GiB",
    ]
    assert out[start + 10] == (
        "in the step: each forward of transformer reads 12.4 GiB from the checkpoint; the step above hides "
        "them, as it would down to 0.568 GB/s (simulated)"
    )
    plain = _json(capsys, WAN, "--device-memory", "24GiB")
    host = _json(capsys, WAN, "--device-memory", "24GiB", "--host-memory", "32GiB", "--spill")
    assert host["recommended"]["step_s"] == pytest.approx(plain["recommended"]["step_s"])


def test_the_json_host_section_adds_up(capsys: pytest.CaptureFixture[str]) -> None:
    """The host section's parts sum to its host bytes, within the budget, as policies.tiers says."""
    doc = _json(capsys, WAN, "--device-memory", "24GiB", "--host-memory", "32GiB", "--spill")
    h = doc["host"]
    pages = sum(policies.page_bytes(n) for n in h["staging_slot_bytes"])
    assert sum(c["host_bytes"] for c in h["components"]) == h["store_bytes"]
    extras = h["kept_bytes"] + h["transient_bytes"]
    assert h["store_bytes"] + pages + h["read_bounce_bytes"] + extras == h["host_bytes"] <= 32 * GIB
    assert doc["recommended"]["host_bytes_per_rank"] == h["host_bytes"]
    plan = topology.resolve(
        topology.known_topology(WAN),
        topology.OffloadConfig(
            strategy="layerwise", components={"dit", "text_encoder"}, host_memory_bytes=32 * GIB
        ),
    )
    tiers = policies.tiers(plan)
    assert (tiers.host_bytes, tiers.store_bytes) == (h["host_bytes"], h["store_bytes"])
    assert doc["assumptions"]["host_memory_bytes"] == 32 * GIB
    assert doc["assumptions"]["read_bytes_per_s"] == policies.DEFAULT_READ_BYTES_PER_S


def test_slow_reads_make_auto_keep_file_blocks_resident(capsys: pytest.CaptureFixture[str]) -> None:
    """At 50 ms a block and 1 GB/s, layerwise waits on reads; auto keeps file-tier blocks resident and
    the report says what the remaining reads add."""
    doc = _json(
        capsys,
        WAN,
        "--device-memory",
        "24GiB",
        "--host-memory",
        "32GiB",
        "--spill",
        "--block-ms",
        "50",
        "--read-bandwidth",
        "1GB/s",
    )
    layer = next(r for r in doc["strategies"] if r["strategy"] == "layerwise")
    auto = doc["recommended"]
    assert "file-first" in " ".join(auto["notes"])
    assert auto["step_s"] < layer["step_s"] / 3
    assert doc["host"]["read_bytes_per_s"] == 1e9
    floor = doc["host"]["reads_hidden_down_to_bytes_per_s"]
    assert floor is not None and floor > 1e9
    out = _plan(
        capsys,
        WAN,
        "--device-memory",
        "24GiB",
        "--host-memory",
        "32GiB",
        "--spill",
        "--block-ms",
        "50",
        "--read-bandwidth",
        "1GB/s",
    )
    assert "to the step above, which would hide them only at" in out


def test_a_host_budget_too_small_for_anything(capsys: pytest.CaptureFixture[str]) -> None:
    """1 GiB of host memory cannot hold even the staging slots: every row says why, nothing is recommended."""
    out = _plan(capsys, WAN, "--device-memory", "24GiB", "--host-memory", "1GiB")
    assert "recommended: nothing fits 24.0 GiB of device memory and 1.0 GiB of host memory" in out
    assert "its host buffers need 3.3 GiB (2 staging slots of 670.3 MiB, the largest pack read;" in out


def test_read_bandwidth_needs_a_host_budget(capsys: pytest.CaptureFixture[str]) -> None:
    """--read-bandwidth alone is a usage error naming the missing option."""
    code = main(["plan", WAN, "--device-memory", "24GiB", "--read-bandwidth", "2GB/s"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (
        "torchferry plan: error: --read-bandwidth is the file tier's read rate, and there is no file tier "
        "without --host-memory; pass --host-memory SIZE too\n"
    )


def test_without_a_host_budget_the_report_is_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    """No --host-memory: no host column, no host tier section, no host keys in the JSON."""
    out = _plan(capsys, WAN, "--device-memory", "24GiB")
    assert "host tier" not in out and "file reads" not in out
    assert "strategy                        fits  peak device      step  overhead  notes" in out
    doc = _json(capsys, WAN, "--device-memory", "24GiB")
    assert "host" not in doc and "host_memory_bytes" not in doc["assumptions"]


def test_plan_takes_the_saved_read_rate_even_from_a_cpu_profile(
    capsys: pytest.CaptureFixture[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`probe PATH` on a CPU saves the drive's rates in a CPU profile: plan drops its device figures
    but reads at its direct rate, and says the rate came from that saved profile (also with
    --device-class); a saved profile without read rates, or of another machine, says so instead."""
    where = tmp_path / "profile.json"
    monkeypatch.setenv("TORCHFERRY_PROFILE", str(where))
    cpu = policies.DeviceProfile(
        name="cpu",
        h2d_bytes_per_s=8e9,
        flops_per_s=2e10,
        collective_bytes_per_s=1e11,
        dtype="float32",
        source="measured on cpu (cpu) by torchferry probe; reads of /ckpt",
        device="cpu",
        host=host_name(),
        read_bytes_per_s=1.5e9,
        read_direct_bytes_per_s=1.0e9,
    )
    save_profile(cpu)
    args = (WAN, "--device-memory", "24GiB", "--host-memory", "32GiB", "--spill")
    for extra in ((), ("--device-class", "h100")):
        doc = _json(capsys, *args, *extra)
        assert doc["assumptions"]["read_bytes_per_s"] == 1.0e9
        assert (
            doc["assumptions"]["h2d_bytes_per_s"] != cpu.h2d_bytes_per_s
        )  # the device figures are not the CPU's
        text = _plan(capsys, *args, *extra)
        assert (
            f"file reads 1 GB/s (from the saved profile {where}: measured on cpu (cpu) by torchferry probe; "
            "reads of /ckpt)"
        ) in text
    save_profile(attrs.evolve(cpu, host="another-machine"))
    text = _plan(capsys, *args)
    assert f"the saved profile {where} was measured on another-machine, another machine with" in text
    save_profile(attrs.evolve(cpu, read_bytes_per_s=None, read_direct_bytes_per_s=None))
    text = _plan(capsys, *args)
    assert f"(assumed: a PCIe Gen3 NVMe drive; the saved profile {where} holds no read rate; " in text
    assert _json(capsys, *args)["assumptions"]["read_bytes_per_s"] == policies.DEFAULT_READ_BYTES_PER_S


def test_host_refusals_speak_flags_and_sit_under_the_table(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    """A host budget too small for a strategy is a numbered note under the table (one per distinct text)
    in the command line's words: --host-memory SIZE and --strategy layerwise, no config field, keyword or
    plan digest, and no claim that a pack held in host memory is the largest pack read."""
    from torchferry.cli._demo_runs import ensure_checkpoint

    path, _ = ensure_checkpoint(tmp_path)
    argv = (str(path), "--device-memory", "20MiB", "--host-memory", "4MiB", "--block-ms", "1")
    argv += ("--components", "dit,text_encoder")
    out = _plan(capsys, *argv)
    lines = out.splitlines()
    table = lines[lines.index(next(x for x in lines if x.startswith("strategy "))) :]
    assert table[1].split()[-3:] == ["see", "note", "1"] and table[2].split()[-3:] == ["see", "note", "1"]
    assert max(len(x) for x in table[:6]) < 120
    notes = [x for x in lines if x.startswith("note ")]
    assert [x.split(":")[0] for x in notes] == ["note 1", "note 2", "note 3"]
    # Kept whole (none, model_level), the least that opens is every pack in host memory (35.3 MiB),
    # less than the file tier's slots as large as the whole transformer would need.
    assert notes[0].startswith(
        "note 1: --host-memory 4.0 MiB is too small for this plan: with every pack in host memory its host "
        "buffers need 35.3 MiB (35.3 MiB of packs in host memory), and the file tier would need more"
    )
    remedy = "; pass --host-memory 35.4MiB or more, or stream the blocks of 'transformer' (--strategy"
    assert remedy in notes[0]
    assert notes[1].startswith("note 2: --host-memory 4.0 MiB is too small for this plan: even with packs")
    assert "(2 staging slots of 2.5 MiB, the largest pack read; " in notes[1]
    for said in (out, json.dumps(_json(capsys, *argv))):
        assert "config.host_memory_bytes" not in said and "host_memory=" not in said
        assert "strategy='" not in said and " for plan " not in said
    # A session's default selection streams the DiT alone: the text encoder, kept whole, is the largest
    # pack, and the remedy names the selection that streams it too.
    default = [x for x in _plan(capsys, *argv[:-2]).splitlines() if x.startswith("note ")]
    assert any(
        "or stream the blocks of 'text_encoder' (--strategy layerwise --components dit,text_encoder)" in x
        for x in default
    ), default
    wan = _plan(capsys, WAN, "--device-memory", "24GiB", "--host-memory", "32GiB", "--spill").splitlines()
    note = next(x for x in wan if x.startswith("note 1: "))
    assert note.endswith(
        "(2 staging slots of 26.7 GiB, the largest pack read; 16.0 MiB of read buffers; 0 B of packs in host "
        "memory; 2.0 MiB of kept, widened and scratch buffers); pass --host-memory 53.4GiB or more, or "
        "stream the blocks of 'transformer' (--strategy "
        "layerwise) so the largest pack read is a block, not transformer:rest (26.7 GiB)"
    )


def test_a_host_budget_too_small_for_everything_prints_the_table_with_notes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 31 item 9: --device-memory 8GiB --host-memory 10MiB exits 0 with the table, each refusal a
    note in the command line's words read from the refusal's fields (the least that opens, as a flag)."""
    out = _plan(capsys, "flux.1-dev", "--device-memory", "8GiB", "--host-memory", "10MiB")
    notes = [x for x in out.splitlines() if x.startswith("note ")]
    assert out.splitlines()[0] and any(x.startswith("strategy ") for x in out.splitlines())
    assert notes and all(": --host-memory 10.0 MiB is too small for this plan: " in x for x in notes)
    assert all(re.search(r"; pass --host-memory [\d.]+[GM]iB or more", x) for x in notes)
    assert "host_memory=" not in out and "config." not in out


def test_refusals_are_worded_from_their_parts_not_reworded(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    """A refusal that names a request field carries it as data (`torchferry._errors.Flag`): the API
    renders the keyword and the plan's digest, the command line its flag and "this plan", from the same
    error, with no rewording of the API's sentence."""
    from torchferry import OffloadError
    from torchferry._errors import HOST_MEMORY, Flag, said, strategy_named
    from torchferry.cli._demo_runs import ensure_checkpoint

    parts = (
        "pass ",
        HOST_MEMORY,
        " or ",
        strategy_named("layerwise"),
        " for ",
        Flag("plan 1a2b3c4d", "this plan"),
    )
    assert said(parts, "api") == "pass host_memory= or strategy='layerwise' for plan 1a2b3c4d"
    assert said(parts, "cli") == "pass --host-memory or --strategy layerwise for this plan"
    error = OffloadError.worded(*parts)
    assert str(error) == error.message("api") == said(parts, "api") and error.message("cli") == said(
        parts, "cli"
    )
    assert OffloadError("plain").message("cli") == "plain"

    path, _ = ensure_checkpoint(tmp_path)
    doc = _json(capsys, str(path), "--device-memory", "1KiB", "--block-ms", "1")
    (auto,) = [r for r in doc["strategies"] if r["strategy"] == "auto"]
    assert auto["error"].endswith("needs 10.2 MiB (10672640) on this plan; raise the budget to at least that")
    from torchferry.cli._plan_input import load_model

    topo, _known = load_model(str(path), None)  # as `torchferry plan` reads it
    plan = topology.resolve(topo, topology.OffloadConfig(strategy="layerwise"))
    with pytest.raises(OffloadError) as caught:
        policies.choose(plan, 1024, policies.DEFAULT_COST)
    assert f"on plan {plan.digest}; raise the budget" in str(caught.value)
    assert caught.value.message("cli") == auto["error"]


def test_the_command_line_says_flags_for_storage_dtype_and_warnings_and_small_buffers(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    """A pack held in --storage-dtype that cannot be in the file tier, and resolve's warnings, are said
    in flags; the JSON's read buffers are those the text shows (as large as the largest pack read)."""
    from torchferry.cli._demo_runs import ensure_checkpoint

    path, _ = ensure_checkpoint(tmp_path)
    argv = (str(path), "--device-memory", "20MiB", "--block-ms", "1", "--components", "dit,text_encoder")
    cast = _plan(capsys, *argv, "--host-memory", "6MiB", "--storage-dtype", "float8_e4m3fn")
    assert "packs held in --storage-dtype float8_e4m3fn would be read back" in cast
    assert "storage_dtype=" not in cast and "or drop --storage-dtype" in cast
    doc = _json(capsys, *argv, "--host-memory", "20MiB", "--strategy", "layerwise")
    host = doc["host"]
    (slot,) = set(host["staging_slot_bytes"])
    assert host["read_bounce_bytes"] == policies.read_buffer_bytes(slot) < policies.READ_BOUNCE_BYTES
    assert host["host_bytes"] == (
        host["store_bytes"] + sum(policies.page_bytes(n) for n in host["staging_slot_bytes"])
        + host["read_bounce_bytes"] + host["kept_bytes"] + host["transient_bytes"]
    )  # fmt: skip
    assert doc["assumptions"]["components"] == ["dit", "text_encoder"]
    dit = tmp_path / "dit.safetensors"  # one DiT, no encoder: model_level warns, in flags
    from safetensors.torch import save_file

    save_file({f"blocks.{i}.weight": torch.zeros(64, 64) for i in range(4)}, str(dit))
    text = _plan(capsys, str(dit), "--device-memory", "1GiB", "--block-ms", "1", "--strategy", "model_level")
    assert "use --strategy layerwise to stream its blocks instead" in text and "strategy='" not in text


def test_a_known_id_needs_spill_for_a_file_tier_as_offload_does(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 39 item 1: a known id is a pipeline built in memory, so a file tier needs a spill folder
    (offload refuses it without spill=): without --spill every row that needs one says so in flags, with
    --spill the same budget plans the file tier."""
    doc = _json(capsys, WAN, "--device-memory", "24GiB", "--host-memory", "32GiB")
    assert doc["recommended"] is None and "host" not in doc
    for row in doc["strategies"]:
        if row["strategy"] in ("none", "model_level"):
            continue  # a component kept whole: too small for 32 GiB, refused before any file tier
        assert "built in memory with no checkpoint; pass --spill (those packs" in row["error"]
        assert re.search(r"or raise --host-memory to [\d.]+ GiB \(\d+\) so every pack stays", row["error"])
        assert "=" not in row["error"]
    spilled = _json(capsys, WAN, "--device-memory", "24GiB", "--host-memory", "32GiB", "--spill")
    assert spilled["recommended"] is not None and spilled["host"]["file_packs"]
    code = main(["plan", WAN, "--device-memory", "24GiB", "--spill"])
    assert code == 2 and "--spill is where the file tier is written" in capsys.readouterr().err
