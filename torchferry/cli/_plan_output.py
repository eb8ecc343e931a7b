"""`torchferry plan`'s output: a report (`_plan_report`) as readable text or as a stable JSON
document, and the list of known models (``--list``)."""

from __future__ import annotations

import math
from typing import Any

import attrs

from torchferry import policies, topology
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
    elif kind == "folder":
        where = f"safetensors headers of the pipeline folder {where}"
        if report.known_id:
            where += f"\n(its DiT has the shapes of the known model {report.known_id}, whose FLOPs are known)"
    title = f"{report.model}" + (f" ({report.pipeline_class})" if report.pipeline_class else "")
    lines = [title, where, f"total: {_b(report.total_bytes)} ({report.total_bytes} bytes)", ""]
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
    for r in report.rows:
        if r.error is not None:
            table.append([r.strategy, "n/a", "-", "-", "-", r.error])
            continue
        name = r.policy if r.strategy != "auto" else f"auto: {r.policy}"
        table.append(
            [
                name,
                "yes" if r.fits else "no",
                _b(r.peak_device_bytes),
                _seconds(r.step_s),
                f"+{r.overhead * 100:.1f}%",
                "; ".join(r.notes),
            ]
        )
    lines += _table(["strategy", "fits", "peak device", "step", "overhead", "notes"], table, {2, 3, 4})
    lines.append("(fits and peak device count weights only: leave room for activations and the VAE decode)")
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
        lines.append(f"recommended: nothing fits {_b(o.budget_bytes)}")
    lines.extend(f"warning: {w}" for w in report.warnings)
    if show_schedule and report.schedule is not None:
        lines += ["", policies.format_schedule(report.schedule).rstrip("\n")]
    return "\n".join(lines) + "\n"


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
            "fits_counts": "weights only (no activations, no VAE decode)",
        },
        "strategies": [_row_document(r) for r in report.rows],
        "recommended": None if report.recommended is None else _row_document(report.recommended),
        "warnings": list(report.warnings),
    }
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
    lines += _table(
        ["hub id", "id"], [[repo, model] for repo, model in topology.HUB_IDS.items()], set()
    )[1:]
    return "\n".join(lines) + "\n"
