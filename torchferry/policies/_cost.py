"""What a device can do, and the cost model a plan is chosen under: device classes, profiles, estimates.

A `DeviceProfile` holds the figures the cost model needs from a device: pinned host-to-device
bandwidth, achieved matrix-multiply FLOP/s in the weights' dtype, and the bandwidth one rank
receives in an all-gather. `DEVICE_CLASSES` holds assumed figures per device class (sourced below);
``torchferry probe`` measures this machine's and saves them as a profile (`runtime.probe`), which
replaces the assumption. `estimate_cost` turns a profile and a model's facts (FLOPs per block at a
resolution, text tokens, forwards per denoising step) into the `CostModel` that `choose` and
``torchferry plan`` use.

Sources of the assumed figures (every one is a published measurement or datasheet figure, not ours):
pinned PCIe Gen5 x16 copy-engine H2D about 55 GB/s (NVIDIA nvbandwidth, issue #24), Gen4 x16
about 25 GB/s (nvbandwidth #42 on A100-SXM: 25.1 GB/s); achieved bf16 DiT throughput about 60% of
the dense datasheet peak (H100/H200 989 TFLOP/s -> 600; A100 312 -> 200; RTX 4090 165 -> 150, the
figure ``torchferry plan`` always assumed; L40S 362 -> 220); NVLink4 all-gather about 350 GB/s
(nccl #1264), NVLink3 about 200 GB/s; cards without NVLink all-gather over PCIe (about 20 GB/s).
The CPU class is a placeholder for a small host (``torchferry probe`` measured 4.2 GB/s and 0.27
TFLOP/s fp32 on a 2-core cloud VM): measure yours.

The file tier's read rate, when nothing measured it, is `DEFAULT_READ_BYTES_PER_S`: 3.5 GB/s, the
sequential read of a PCIe Gen3 x4 NVMe drive (Samsung 970 EVO Plus datasheet: up to 3,500 MB/s), a
common consumer drive; Gen4 drives read about twice as fast, SATA SSDs about 0.55 GB/s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs

from torchferry._errors import PlanError
from torchferry.policies._dequantize import with_dequantize
from torchferry.policies._sim import CostModel
from torchferry.topology import KnownModel, Resolution, Topology

__all__ = [
    "DEFAULT_DEVICE",
    "DEFAULT_READ_BYTES_PER_S",
    "DEVICE_CLASSES",
    "PROFILE_VERSION",
    "DeviceProfile",
    "estimate_cost",
    "match_device_class",
]

#: Version of the JSON document a profile is saved as (``"torchferry_profile": 1``).
PROFILE_VERSION = 1


def _rate(name: str, value: object) -> None:
    if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        raise PlanError(f"DeviceProfile.{name} must be a positive finite number, got {value!r}")


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    _rate(attribute.name, value)


def _positive_or_none(_: object, attribute: attrs.Attribute[float | None], value: float | None) -> None:
    if value is not None:
        _rate(attribute.name, value)


#: The file tier's read rate assumed when no profile measured one (see the module notes).
DEFAULT_READ_BYTES_PER_S = 3.5e9


@attrs.frozen(kw_only=True)
class DeviceProfile:
    """What one device can do: the figures a cost model needs from it.

    ``name`` is the device class (``h100``) or the device's own name when measured (``NVIDIA H100
    80GB HBM3``); ``flops_per_s`` is the achieved matrix-multiply rate in ``dtype`` (bf16 on GPUs;
    fp32 on a CPU, which has no fast bf16); ``source`` says where the figures come from.
    ``read_bytes_per_s`` and ``read_direct_bytes_per_s`` are a drive's sequential read rates,
    buffered and with direct I/O (``torchferry probe PATH`` measures them; ``None``: not measured),
    the rates of the file tier (`policies.tiers`). A measured profile also records which device it
    was measured on: ``device`` its type (``"cuda"`` or ``"cpu"``) and ``host`` the machine's name,
    so it is never applied to another device (`measured_on`); both are empty for assumed figures
    and for profiles saved before they were recorded.
    """

    name: str
    h2d_bytes_per_s: float = attrs.field(validator=_positive)
    flops_per_s: float = attrs.field(validator=_positive)
    collective_bytes_per_s: float = attrs.field(default=100e9, validator=_positive)
    dtype: str = "bfloat16"
    source: str = ""
    read_bytes_per_s: float | None = attrs.field(default=None, validator=_positive_or_none)
    read_direct_bytes_per_s: float | None = attrs.field(default=None, validator=_positive_or_none)
    device: str = ""
    host: str = ""

    @property
    def measured(self) -> bool:
        """Whether the profile records the device it was measured on (`torchferry probe` writes it)."""
        return bool(self.device)

    def measured_on(self, device_type: str, name: str, host: str) -> bool:
        """Whether these figures were measured on a device of type ``device_type`` (``"cuda"``,
        ``"cpu"``) named ``name`` on machine ``host``: the only device they may be applied to."""
        return self.measured and (self.device, self.name, self.host) == (device_type, name, host)

    def file_read_bytes_per_s(self, *, direct: bool = True) -> float | None:
        """The file tier's read rate measured on this machine: direct I/O's when ``direct`` and
        measured (the runtime reads directly when the checkpoint is larger than the page cache
        keeps, which is when a file tier exists), else the buffered one; ``None`` when neither was."""
        if direct and self.read_direct_bytes_per_s is not None:
            return self.read_direct_bytes_per_s
        return self.read_bytes_per_s

    def to_json(self) -> dict[str, Any]:
        """The profile as the JSON document ``torchferry probe`` saves."""
        return {"torchferry_profile": PROFILE_VERSION, **attrs.asdict(self)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], where: str = "profile") -> DeviceProfile:
        """A profile from its JSON document; a document of another version or shape is a `PlanError`."""
        if not isinstance(doc, Mapping) or doc.get("torchferry_profile") != PROFILE_VERSION:
            raise PlanError(
                f"{where} is not a torchferry profile of version {PROFILE_VERSION}; "
                "write a new one with `torchferry probe`"
            )
        fields = {f.name for f in attrs.fields(cls)}
        try:
            return cls(**{k: v for k, v in doc.items() if k in fields})
        except TypeError as exc:
            raise PlanError(f"{where}: {exc}; write a new one with `torchferry probe`") from None


def _class(name: str, h2d: float, tflops: float, allgather: float, what: str) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        h2d_bytes_per_s=h2d,
        flops_per_s=tflops * 1e12,
        collective_bytes_per_s=allgather,
        dtype="float32" if name == "cpu" else "bfloat16",
        source=f"assumed: {what}",
    )


#: Assumed figures per device class (see the module notes for their sources).
DEVICE_CLASSES: Mapping[str, DeviceProfile] = MappingProxyType(
    {
        "h200": _class("h200", 55e9, 600, 350e9, "H200-class, PCIe Gen5 pinned, bf16 achieved"),
        "h100": _class("h100", 55e9, 600, 350e9, "H100-class, PCIe Gen5 pinned, bf16 achieved"),
        "a100": _class("a100", 25e9, 200, 200e9, "A100-class, PCIe Gen4 pinned, bf16 achieved"),
        "l40s": _class("l40s", 25e9, 220, 20e9, "L40S-class, PCIe Gen4 pinned, bf16 achieved"),
        "rtx4090": _class("rtx4090", 25e9, 150, 20e9, "RTX 4090-class, PCIe Gen4 pinned, bf16 achieved"),
        "cpu": _class("cpu", 5e9, 0.2, 5e9, "a small CPU host, memcpy and fp32 matmul; run torchferry probe"),
    }
)
#: What is assumed when nothing names the device: torchferry's long-standing figures (an RTX
#: 4090-class GPU's PCIe Gen4 and bf16 rate, with the 100 GB/s all-gather of `DEFAULT_COST`).
DEFAULT_DEVICE = attrs.evolve(
    DEVICE_CLASSES["rtx4090"],
    name="default",
    collective_bytes_per_s=100e9,
    source="assumed: RTX 4090-class bf16 over PCIe Gen4; name a device class or run torchferry probe",
)

_NAMES: tuple[tuple[str, str], ...] = (
    ("h200", "h200"),
    ("h100", "h100"),
    ("h800", "h100"),
    ("gh200", "h200"),
    ("a100", "a100"),
    ("a800", "a100"),
    ("l40s", "l40s"),
    ("4090", "rtx4090"),
)


def match_device_class(device_name: str) -> DeviceProfile | None:
    """The class of a device by its name (``torch.cuda.get_device_name()``, or ``cpu``); ``None``
    when no class matches (then measure it, or name a class)."""
    low = device_name.lower()
    if low == "cpu":
        return DEVICE_CLASSES["cpu"]
    for needle, key in _NAMES:
        if needle in low:
            return DEVICE_CLASSES[key]
    return None


def estimate_cost(
    topo: Topology,
    known: KnownModel | None = None,
    *,
    device: DeviceProfile = DEFAULT_DEVICE,
    resolution: Resolution | None = None,
    text_tokens: int | None = None,
    forwards_per_step: int | None = None,
    steps: int = 50,
    block_s: float | None = None,
    rest_s: float = 0.0,
    host_op_s: float = 0.0,
    host_block_s: float = 0.0,
    read_bytes_per_s: float | None = None,
) -> CostModel:
    """The cost model of ``topo`` on ``device``: its link bandwidths, and compute per block.

    Compute comes from ``block_s`` when given (seconds per block, say measured); else, for a known
    model, from its FLOPs per block at ``resolution`` with ``text_tokens`` (defaults: the
    pipeline's) over ``device.flops_per_s``; else it is `CostModel`'s default block time.
    ``rest_s`` is the compute of a component's non-block remainder (embedders, final projection):
    its FLOPs do not follow from its bytes (a time embedder runs on one token, a patch embedder on
    all), so it is an input, 0 unless measured. ``forwards_per_step`` (default: the pipeline's
    guidance, else 1) and ``steps`` set the forwards of a step and of a call; ``host_op_s`` and
    ``host_block_s`` are the runtime's host cost (see `CostModel`). The file tier's reads go at
    ``read_bytes_per_s`` when given, else at the device's measured rate
    (`DeviceProfile.file_read_bytes_per_s`), else at `DEFAULT_READ_BYTES_PER_S`; a schedule without
    reads takes no time from it.

    On a CPU device (``device.name`` or ``device.device`` is ``"cpu"``) each block and component
    whose layers dequantize their weights at every call (`TensorSpec.dequantized`, GGUF) computes
    for `dequantize_seconds` more, at the CPU rates measured (`DEQUANTIZE_VALUES_PER_S`); ``source``
    then says how much. No GPU rate was measured, so on a GPU nothing is added; nor to a given
    ``block_s``, which is the whole block's time.
    """
    cost = _compute_cost(
        topo, known, device=device, resolution=resolution, text_tokens=text_tokens,
        forwards_per_step=forwards_per_step, steps=steps, block_s=block_s, rest_s=rest_s,
        host_op_s=host_op_s, host_block_s=host_block_s, read_bytes_per_s=read_bytes_per_s,
    )  # fmt: skip
    if block_s is not None or "cpu" not in (device.name, device.device):
        return cost  # a given block time is the whole block's; no GPU rate was measured
    return with_dequantize(cost, topo)


def _compute_cost(
    topo: Topology,
    known: KnownModel | None,
    *,
    device: DeviceProfile,
    resolution: Resolution | None,
    text_tokens: int | None,
    forwards_per_step: int | None,
    steps: int,
    block_s: float | None,
    rest_s: float,
    host_op_s: float,
    host_block_s: float,
    read_bytes_per_s: float | None,
) -> CostModel:
    forwards = forwards_per_step or (known.forwards_per_step if known is not None else 1)
    read = read_bytes_per_s or device.file_read_bytes_per_s() or DEFAULT_READ_BYTES_PER_S
    base = CostModel(
        h2d_bytes_per_s=device.h2d_bytes_per_s,
        collective_bytes_per_s=device.collective_bytes_per_s,
        read_bytes_per_s=read,
        component_s=rest_s,
        host_op_s=host_op_s,
        host_block_s=host_block_s,
        forwards_per_step=forwards,
        forwards_per_call=max(1, steps * forwards),
        source=device.source,
    )
    if block_s is not None:
        return attrs.evolve(
            base, block_s=block_s, source=f"{device.source}; {block_s * 1e3:g} ms per block given"
        )
    if known is None:
        return base
    per_block = known.block_flops(resolution, text_tokens=text_tokens)
    batch = known.batch_per_forward
    flops: dict[str, float] = {}
    for path in known.dit_paths:
        for block, f in zip(topo.component(path).blocks, per_block, strict=False):
            flops[block.path] = float(f * batch)
    mean = sum(per_block) / len(per_block) * batch
    return attrs.evolve(
        base, block_s=mean / device.flops_per_s, flops=flops, device_flops_per_s=device.flops_per_s
    )
