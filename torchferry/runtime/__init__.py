"""The only stateful layer: carries out schedules on real modules with streams and collectives."""

from __future__ import annotations

from torchferry.runtime._checkpoint import CheckpointReader
from torchferry.runtime._comm import Comm
from torchferry.runtime._device import Ledger, SlotPool
from torchferry.runtime._engine import Engine, Program, execute, listing, schedule_text
from torchferry.runtime._host import Group, HostStore, Prepared, Sharding, Unit
from torchferry.runtime._meta import meta_parameters
from torchferry.runtime._probe import load_profile, probe, profile_path, save_profile
from torchferry.runtime._streams import CudaStreams, StreamContext, Transfer, stream_context
from torchferry.runtime._trace import Span, StepTrace, Tracer

__all__ = [
    "CheckpointReader",
    "Comm",
    "CudaStreams",
    "Engine",
    "Group",
    "HostStore",
    "Ledger",
    "Prepared",
    "Program",
    "Sharding",
    "SlotPool",
    "Span",
    "StepTrace",
    "StreamContext",
    "Tracer",
    "Transfer",
    "Unit",
    "execute",
    "listing",
    "load_profile",
    "meta_parameters",
    "probe",
    "profile_path",
    "save_profile",
    "schedule_text",
    "stream_context",
]
