"""`torchferry plan`'s output: a report (`_plan_report`) as readable text or as a stable JSON
document, and the list of known models (``--list``)."""

from __future__ import annotations

import math
from typing import Any

import attrs

from torchferry import policies, topology
from torchferry.cli._plan_host import HostTier
from torchferry.cli._plan_report import ComponentRow, PlanReport, StrategyRow
from torchferry.cli._tables import table as _table

__all__ = ["JSON_VERSION", "format_list", "format_report", "list_document", "report_document"]

#: Version of the JSON documents `torchferry plan --format json` prints.
JSON_VERSION = 1


def _b(nbytes: int) -> str:
    return policies.format_bytes(nbytes, exact=False)


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def _blocks(c: ComponentRow) -> str:
    if not c.blocks:
        return "-"
    if c.block_min_bytes == c.block_max_bytes:
        return f"{c.blocks} x {_b(c.block_max_bytes)}"
    return f"{c.blocks} x {_b(c.block_min_bytes)}-{_b(c.block_max_bytes)}"


def format_report(report: PlanReport, *, show_schedule: bool = False) -> str:
    """The readable report `torchferry plan` prints."""
    o = report.options
    kind, _, where = report.source.partition(":")
    if kind == "known":
        where = f"known model; tensor shapes from the published config of {report.hf_repo}"
    elif kind == "checkpoint":
        where = f"safetensors headers of {where}"
    elif kind == "gguf-inferred":
        where = (
            f"{where}, with no config.json beside it: its class and configuration inferred from its tensor "
            "names and shapes"
        )
    elif kind in ("folder", "pipeline"):
        if kind == "pipeline":
            where = f"the pipeline folder {where}, built on meta as from_pretrained builds it (no data read)"
        else:
            where = (
                f"safetensors headers of the pipeline folder {where} (its pipeline could not be built "
                "here, so buffers the model computes, such as RoPE tables, are not counted)"
            )
        if report.known_id:
            where += f"\n(its DiT has the shapes of the known model {report.known_id}, whose FLOPs are known)"
    title = f"{report.model}" + (f" ({report.pipeline_class})" if report.pipeline_class else "")
    lines = [title, where, f"total: {_b(report.total_bytes)} ({report.total_bytes} bytes)", ""]
    if o.storage_dtype is not None:
        lines[-1:-1] = [f"DiT Linear/Conv/Embedding weights stored as {o.storage_dtype} (--storage-dtype)"]
    lines += _table(
        ["component", "kind", "class", "bytes", "blocks", "remainder"],
        [
            [c.path or "(root)", c.kind, c.class_name or "-", _b(c.nbytes), _blocks(c), _b(c.rest_bytes)]
            for c in report.components
        ],
        {3, 5},
    )
    forwards = (
        f", {report.forwards_per_step} DiT forwards per denoising step (guidance)"
        if report.forwards_per_step > 1
        else ""
    )
    ranks = (
        f"{report.world_size} ranks (given; auto considers them)"
        if o.world_size
        else f"{report.world_size} ranks (assumed; pass --world-size to set it and let auto use them)"
    )
    lines += [
        "",
        f"device memory {_b(o.budget_bytes)} · host-to-device {o.h2d / 1e9:.3g} GB/s · "
        f"all-gather {o.allgather / 1e9:.3g} GB/s · ring depth {o.depth}",
        *(
            [f"host memory {_b(o.host_bytes)} · file reads {_rate(o.read)} ({o.read_source})"]
            if o.host_bytes is not None
            else []
        ),
        f"device: {o.device.name} ({o.device.source})",
        f"distributed rows: {ranks}",
        f"compute: {report.compute}",
    ]
    if o.block_ms is None and report.hf_repo:  # derived from FLOPs: say what it comes to
        lines.append(f"         = {_seconds(report.block_s)} per block{forwards}")
    elif forwards:
        lines.append(f"         {forwards.lstrip(', ')}")
    lines.append("")
    table: list[list[str]] = []
    host = o.host_bytes is not None
    notes: list[str] = []  # errors too long for a cell, numbered under the table (one per distinct text)
    for r in report.rows:
        if r.error is not None:
            cell = r.error
            if len(cell) > NOTE_CELL_CHARS:
                if cell not in notes:
                    notes.append(cell)
                cell = f"see note {notes.index(cell) + 1}"
            table.append([r.strategy, "n/a", "-", *(["-"] if host else []), "-", "-", cell])
            continue
        name = r.policy if r.strategy != "auto" else f"auto: {r.policy}"
        table.append(
            [
                name,
                "yes" if r.fits else "no",
                _b(r.peak_device_bytes),
                *([_b(r.host_bytes_per_rank)] if host else []),
                _seconds(r.step_s),
                f"+{r.overhead * 100:.1f}%",
                "; ".join(r.notes),
            ]
        )
    heads = ["strategy", "fits", "peak device", *(["host"] if host else []), "step", "overhead", "notes"]
    lines += _table(heads, table, {2, 3, 4, 5} if host else {2, 3, 4})
    if report.dequantize_bytes:
        lines.append(
            f"(fits and peak device count the weights and the largest dequantized GGUF weight, "
            f"{_b(report.dequantize_bytes)}: leave room for activations and the VAE decode)"
        )
    else:
        lines.append(
            "(fits and peak device count weights only: leave room for activations and the VAE decode)"
        )
    lines.extend(f"note {i}: {text}" for i, text in enumerate(notes, 1))
    lines.append("")
    rec = report.recommended
    if rec is not None:
        lines.append(
            f"recommended: {rec.policy} — peak {_b(rec.peak_device_bytes)} of {_b(o.budget_bytes)}, "
            f"step {_seconds(rec.step_s)} (+{rec.overhead * 100:.1f}% over all-resident "
            f"{_seconds(rec.resident_step_s)})"
        )
        if rec.reason:
            lines.append(f"why: {rec.reason}")
    elif any(r.strategy == "auto" for r in report.rows):
        both = f" of device memory and {_b(o.host_bytes)} of host memory" if o.host_bytes is not None else ""
        lines.append(f"recommended: nothing fits {_b(o.budget_bytes)}{both}")
    if report.host is not None:
        lines += ["", *_host_lines(report.host, rec, report.forwards_per_step)]
    lines.extend(f"warning: {w}" for w in report.warnings)
    if show_schedule and report.schedule is not None:
        lines += ["", policies.format_schedule(report.schedule).rstrip("\n")]
    return "\n".join(lines) + "\n"


#: The longest reason a strategy does not apply that the table shows in its cell; a longer one is a
#: numbered note under the table, so the table stays readable at any terminal width.
NOTE_CELL_CHARS = 60


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3g} GB/s"


_HOW = {"forward": "every forward", "call": "once a call", "session": "once a session"}


def _host_lines(h: HostTier, rec: StrategyRow | None, forwards: int) -> list[str]:
    """Where the recommended plan's packs live, what they take of the host, and what reading costs."""
    which = f"{rec.policy}" if rec is not None else "the plan shown"
    lines = [f"host tier of {which} (host memory {_b(h.budget)}, file reads at {_rate(h.read_bytes_per_s)}):"]
    rows = []
    for r in h.rows:
        how = ", ".join(f"{_b(n)} {_HOW[heat]}" for heat, n in r.reads if n)
        in_file = _b(r.file_bytes) if r.file_bytes else "-"
        rows.append([r.path or "(root)", r.tier, _b(r.host_bytes), in_file, how])
    if h.staging:
        staging = sum(policies.page_bytes(n) for n in h.staging)
        rows.append(["staging slots", f"{len(h.staging)} x {_b(h.staging[0])}", _b(staging), "-", ""])
        rows.append(["read buffers", "direct I/O", _b(h.read_buffer_bytes), "-", ""])
    total_file = _b(sum(r.file_bytes for r in h.rows))
    rows.append(["total", f"of a {_b(h.budget)} budget", _b(h.host_bytes), total_file, ""])
    lines += _table(["component", "tier", "host", "in file", "read from the file"], rows, {2, 3})
    reads = {heat: sum(dict(r.reads).get(heat, 0) for r in h.rows) for heat in _HOW}
    if not any(reads.values()):
        lines.append("everything fits host memory: nothing is read from the checkpoint after opening")
        return lines
    spoken = []
    for heat in ("call", "session"):
        if reads.get(heat):
            spoken.append(f"{_b(reads[heat])} {_HOW[heat]} ({_seconds(reads[heat] / h.read_bytes_per_s)})")
    if spoken:
        lines.append(f"outside the step: reads of {', '.join(spoken)} at {_rate(h.read_bytes_per_s)}")
    if h.hidden_down_to is None:
        lines.append("in the step: the DiT reads nothing from the checkpoint; its time holds at any rate")
        return lines
    added = max(h.forward_s - h.forward_free_reads_s, 0.0) * forwards
    pace = (
        f"the step above hides them, as it would down to {_rate(h.hidden_down_to)} (simulated)"
        if added <= h.forward_free_reads_s * forwards * 0.01
        else f"they add {_seconds(added)} to the step above, which would hide them only at "
        f"{_rate(h.hidden_down_to)} or more (simulated)"
    )
    who = h.forward_component or "the DiT"
    read = _b(h.forward_read_bytes)
    lines.append(f"in the step: each forward of {who} reads {read} from the checkpoint; {pace}")
    return lines


def _host_document(h: HostTier) -> dict[str, Any]:
    return {
        "host_memory_bytes": h.budget,
        "read_bytes_per_s": h.read_bytes_per_s,
        "read_source": h.read_source,
        "host_bytes": h.host_bytes,
        "store_bytes": h.store_bytes,
        "staging_slot_bytes": list(h.staging),
        "read_bounce_bytes": h.read_buffer_bytes,
        "kept_bytes": h.kept_bytes,
        "transient_bytes": h.transient_bytes,
        "plan_digest": h.digest,
        "file_packs": list(h.file_packs),
        "file_read_bytes": dict(h.read_bytes),
        "components": [
            {
                "path": r.path,
                "tier": r.tier,
                "host_bytes": r.host_bytes,
                "file_bytes": r.file_bytes,
                "blocks": r.blocks,
                "file_blocks": r.file_blocks,
                "remainder_in_file": r.rest_in_file,
                "file_read_bytes": dict(r.reads),
            }
            for r in h.rows
        ],
        "reads_hidden_down_to_bytes_per_s": h.hidden_down_to,
        "forward_s": h.forward_s,
        "forward_free_reads_s": h.forward_free_reads_s,
    }


def _row_document(r: StrategyRow) -> dict[str, Any]:
    if r.error is not None:
        return {"strategy": r.strategy, "applicable": False, "error": r.error}
    return {
        "strategy": r.strategy,
        "applicable": True,
        "policy": r.policy,
        "fits": r.fits,
        "peak_device_bytes": r.peak_device_bytes,
        "host_bytes_per_rank": r.host_bytes_per_rank,
        "step_s": r.step_s,
        "resident_step_s": r.resident_step_s,
        "overhead": r.overhead if math.isfinite(r.overhead) else None,
        "notes": list(r.notes),
        **({"reason": r.reason} if r.reason else {}),
    }


def report_document(report: PlanReport, *, show_schedule: bool = False) -> dict[str, Any]:
    """The stable JSON document of a report (``"torchferry_plan": 1``)."""
    o = report.options
    res = o.resolution
    doc: dict[str, Any] = {
        "torchferry_plan": JSON_VERSION,
        "model": report.model,
        "source": report.source,
        "hf_repo": report.hf_repo or None,
        "pipeline_class": report.pipeline_class,
        "total_bytes": report.total_bytes,
        "components": [attrs.asdict(c) for c in report.components],
        "assumptions": {
            "device_memory_bytes": o.budget_bytes,
            "h2d_bytes_per_s": o.h2d,
            "collective_bytes_per_s": o.allgather,
            "device": attrs.asdict(o.device),
            "host_op_s": o.host_op_s,
            "text_tokens": o.text_tokens,
            "world_size": report.world_size,
            "world_size_given": o.world_size is not None,
            "depth": o.depth,
            "resolution": None if res is None else attrs.asdict(res),
            "tflops": o.tflops,
            "block_ms": o.block_ms,
            "compute": report.compute,
            "block_s": report.block_s,
            "forwards_per_step": report.forwards_per_step,
            "storage_dtype": o.storage_dtype,
            "components": sorted(o.components) if o.components else None,
            "fits_counts": "weights only (no activations, no VAE decode)"
            if not report.dequantize_bytes
            else "weights and the largest dequantized weight (no activations, no VAE decode)",
            "dequantize_bytes": report.dequantize_bytes,
        },
        "strategies": [_row_document(r) for r in report.rows],
        "recommended": None if report.recommended is None else _row_document(report.recommended),
        "warnings": list(report.warnings),
    }
    if report.host is not None:
        doc["assumptions"]["host_memory_bytes"] = o.host_bytes
        doc["assumptions"]["read_bytes_per_s"] = o.read
        doc["host"] = _host_document(report.host)
    if show_schedule:
        doc["schedule"] = None if report.schedule is None else policies.format_schedule(report.schedule)
    return doc


def list_document() -> list[dict[str, Any]]:
    """Every known model id with its pipeline class and sizes."""
    names: list[tuple[str, dict[str, Any]]] = [(model_id, {}) for model_id in topology.KNOWN_MODELS]
    names += [(alias, {"alias_of": base}) for alias, base in topology.KNOWN_ALIASES.items()]
    out = []
    for name, extra in names:
        topo = topology.known_topology(name)
        out.append(
            {
                "id": name,
                **extra,
                "pipeline_class": topo.pipeline_class,
                "hf_repo": topology.known_model(name).hf_repo,
                "hub_ids": [repo for repo, m in topology.HUB_IDS.items() if m == name],
                "total_bytes": topo.nbytes,
                "components": {c.path: c.nbytes for c in topo.components},
            }
        )
    return out


def format_list() -> str:
    """The table `torchferry plan --list` prints."""
    rows = []
    for entry in list_document():
        comps = entry["components"]
        dits = sum(n for p, n in comps.items() if p.startswith("transformer"))
        name = entry["id"] + (f" (= {entry['alias_of']}, other VAE)" if "alias_of" in entry else "")
        rows.append([name, entry["pipeline_class"], _b(entry["total_bytes"]), _b(dits), str(len(comps))])
    lines = _table(["id", "pipeline", "total", "DiT(s)", "components"], rows, {2, 3, 4})
    lines += ["", "hub ids (a snapshot in the local Hugging Face cache is planned from its files):"]
    lines += _table(["hub id", "id"], [[repo, model] for repo, model in topology.HUB_IDS.items()], set())[1:]
    return "\n".join(lines) + "\n"
