"""What moves where, when: pure functions from a plan and a step to a checked transfer schedule."""

from __future__ import annotations

# Imports written ``name as name`` are for the layers above, which enter only through this file
# (tests/test_layering.py); they are not public and not in ``__all__``.
from torchferry.policies._auto import Choice, auto, choose, swap_per_forward_s
from torchferry.policies._auto import least_device_bytes as least_device_bytes
from torchferry.policies._auto import whole_device_bytes as whole_device_bytes
from torchferry.policies._builtin import (
    BUILTINS,
    STRATEGIES,
    builtin,
    cached,
    distributed_layerwise,
    layerwise,
    model_level,
    none,
)
from torchferry.policies._calibrate import MAX_TRACES as MAX_TRACES
from torchferry.policies._calibrate import REMEASURE_MARGIN as REMEASURE_MARGIN
from torchferry.policies._calibrate import TRACE_EVERY as TRACE_EVERY
from torchferry.policies._calibrate import Calibration as Calibration
from torchferry.policies._calibrate import ChooserState as ChooserState
from torchferry.policies._calibrate import Measured as Measured
from torchferry.policies._calibrate import calibrate as calibrate
from torchferry.policies._calibrate import fit as fit
from torchferry.policies._calibrate import init_chooser as init_chooser
from torchferry.policies._calibrate import measure as measure
from torchferry.policies._calibrate import observe as observe
from torchferry.policies._calibrate import predicted_step_s as predicted_step_s
from torchferry.policies._calibrate import should_trace as should_trace
from torchferry.policies._calibrate import switch_policy as switch_policy
from torchferry.policies._calibrate import unmoved as unmoved
from torchferry.policies._check import INVARIANTS, check
from torchferry.policies._cost import (
    DEFAULT_DEVICE,
    DEFAULT_READ_BYTES_PER_S,
    DEVICE_CLASSES,
    PROFILE_VERSION,
    DeviceProfile,
    estimate_cost,
    match_device_class,
)
from torchferry.policies._dequantize import DEQUANTIZE_PEAK_BYTES as DEQUANTIZE_PEAK_BYTES
from torchferry.policies._dequantize import (
    DEQUANTIZE_VALUES_PER_S,
    dequantize_bytes,
    dequantize_reserve,
    dequantize_seconds,
    weight_budget,
)
from torchferry.policies._dequantize import DEQUANTIZED_DTYPE as DEQUANTIZED_DTYPE
from torchferry.policies._dequantize import dequantize_paths as dequantize_paths
from torchferry.policies._dequantize import dequantized_tensors as dequantized_tensors
from torchferry.policies._dequantize import with_dequantize as with_dequantize
from torchferry.policies._device import DeviceFacts as DeviceFacts
from torchferry.policies._device import auto_setup as auto_setup
from torchferry.policies._device import device_profile as device_profile
from torchferry.policies._host import NO_LIMIT as NO_LIMIT
from torchferry.policies._host import RESERVE_FRACTION as RESERVE_FRACTION
from torchferry.policies._host import RESERVE_MIN as RESERVE_MIN
from torchferry.policies._host import SHARED_DEVICES as SHARED_DEVICES
from torchferry.policies._host import Bound as Bound
from torchferry.policies._host import HostBudget as HostBudget
from torchferry.policies._host import HostFacts as HostFacts
from torchferry.policies._host import HostFigure as HostFigure
from torchferry.policies._host import file_reads as file_reads
from torchferry.policies._host import given_budget as given_budget
from torchferry.policies._host import group_least as group_least
from torchferry.policies._host import host_plan as host_plan
from torchferry.policies._host import machine_budget as machine_budget
from torchferry.policies._host import needs_source as needs_source
from torchferry.policies._host import offered_budget as offered_budget
from torchferry.policies._host import policy_reads as policy_reads
from torchferry.policies._host import read_direct as read_direct
from torchferry.policies._host import settled as settled
from torchferry.policies._host import share_budget as share_budget
from torchferry.policies._ir import (
    DEVICE,
    OP_KINDS,
    OP_STREAM,
    Declared,
    Op,
    OpKind,
    Placement,
    Policy,
    Schedule,
    Slot,
    SlotKind,
    Step,
    StreamName,
    When,
    declare,
    index_free,
    is_index_free,
    rest_unit,
)
from torchferry.policies._ir import FILE as FILE
from torchferry.policies._ir import gather_nbytes as gather_nbytes
from torchferry.policies._layout import group_specs as group_specs
from torchferry.policies._layout import layout as layout
from torchferry.policies._layout import pack_bytes as pack_bytes
from torchferry.policies._layout import shard_nbytes
from torchferry.policies._layout import unit_packs as unit_packs
from torchferry.policies._listing import format_schedule
from torchferry.policies._open import ACTIVATION_MARGIN as ACTIVATION_MARGIN
from torchferry.policies._open import ACTIVATION_MARGIN_MIN as ACTIVATION_MARGIN_MIN
from torchferry.policies._open import CPU_BUDGET as CPU_BUDGET
from torchferry.policies._open import Facts as Facts
from torchferry.policies._open import OpenPlan as OpenPlan
from torchferry.policies._open import auto_candidates as auto_candidates
from torchferry.policies._open import default_device_budget as default_device_budget
from torchferry.policies._open import open_plan as open_plan
from torchferry.policies._open import store_pins as store_pins
from torchferry.policies._refusal import HostBudgetTooSmall as HostBudgetTooSmall
from torchferry.policies._refusal import size_at_least as size_at_least
from torchferry.policies._sim import DEFAULT_COST, CostModel, SimReport, Span, simulate, steady_schedule
from torchferry.policies._staging import file_read_bytes as file_read_bytes
from torchferry.policies._steps import StepState as StepState
from torchferry.policies._steps import init_steps as init_steps
from torchferry.policies._steps import next_step as next_step
from torchferry.policies._steps import step_failed as step_failed
from torchferry.policies._steps import step_fields as step_fields
from torchferry.policies._steps import step_name as step_name
from torchferry.policies._text import Mark, format_marked, parse_schedule
from torchferry.policies._tiers import BOUNCE_MAX as BOUNCE_MAX
from torchferry.policies._tiers import DIRECT_ALIGN as DIRECT_ALIGN
from torchferry.policies._tiers import DIRECT_DEVICES as DIRECT_DEVICES
from torchferry.policies._tiers import HEATS as HEATS
from torchferry.policies._tiers import READ_BOUNCE_BYTES, STAGING_SLOTS, Tiers, read_buffer_bytes, tiers
from torchferry.policies._tiers import READ_THREADS as READ_THREADS
from torchferry.policies._tiers import bounce_bytes as bounce_bytes
from torchferry.policies._tiers import bounce_count as bounce_count
from torchferry.policies._tiers import file_packs as file_packs
from torchferry.policies._tiers import host_bytes as host_bytes
from torchferry.policies._tiers import pack_heats as pack_heats
from torchferry.policies._tiers import page_bytes as page_bytes
from torchferry.policies._tiers import read_nbytes as read_nbytes
from torchferry.policies._tiers import read_size as read_size
from torchferry.policies._tiers import reads_direct as reads_direct
from torchferry.policies._tiers import staging_count as staging_count
from torchferry.policies._tokens import format_bytes

__all__ = [
    "BUILTINS",
    "DEFAULT_COST",
    "DEFAULT_DEVICE",
    "DEFAULT_READ_BYTES_PER_S",
    "DEQUANTIZE_VALUES_PER_S",
    "DEVICE",
    "DEVICE_CLASSES",
    "INVARIANTS",
    "OP_KINDS",
    "OP_STREAM",
    "PROFILE_VERSION",
    "READ_BOUNCE_BYTES",
    "STAGING_SLOTS",
    "STRATEGIES",
    "Choice",
    "CostModel",
    "Declared",
    "DeviceProfile",
    "Mark",
    "Op",
    "OpKind",
    "Placement",
    "Policy",
    "Schedule",
    "SimReport",
    "Slot",
    "SlotKind",
    "Span",
    "Step",
    "StreamName",
    "Tiers",
    "When",
    "auto",
    "builtin",
    "cached",
    "check",
    "choose",
    "declare",
    "dequantize_bytes",
    "dequantize_reserve",
    "dequantize_seconds",
    "distributed_layerwise",
    "estimate_cost",
    "format_bytes",
    "format_marked",
    "format_schedule",
    "index_free",
    "is_index_free",
    "layerwise",
    "match_device_class",
    "model_level",
    "none",
    "parse_schedule",
    "read_buffer_bytes",
    "rest_unit",
    "shard_nbytes",
    "simulate",
    "steady_schedule",
    "swap_per_forward_s",
    "tiers",
    "weight_budget",
]
