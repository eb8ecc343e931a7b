"""The only stateful layer: carries out schedules on real modules with streams and collectives.

The public names are what users and the docs reach for: `execute` (one schedule on a live
pipeline), the `Engine` behind it and a session, tracing (`Tracer`, `StepTrace`, `Span`), the
`listing` errors show, `CheckpointReader` and `meta_parameters`. Everything else is internal.
"""

from __future__ import annotations

from torchferry.runtime.device import Comm as Comm
from torchferry.runtime.device import DeviceBuffer as DeviceBuffer
from torchferry.runtime.device import Reading as Reading
from torchferry.runtime.device import StreamContext as StreamContext
from torchferry.runtime.device import Timer as Timer
from torchferry.runtime.device import aligned_empty as aligned_empty
from torchferry.runtime.device import resolved as resolved
from torchferry.runtime.device import same_device as same_device
from torchferry.runtime.executor import Engine, Span, StepTrace, Tracer, execute, listing
from torchferry.runtime.executor import Steps as Steps
from torchferry.runtime.executor import prove as prove
from torchferry.runtime.executor import stream_factory as stream_factory

# Imports written ``name as name`` are for the layers above, which enter only through this file
# (tests/test_layering.py); they are not public and not in ``__all__``.
from torchferry.runtime.files import CheckpointReader
from torchferry.runtime.files import GGUFCheckpointReader as GGUFCheckpointReader
from torchferry.runtime.files import SpillLease as SpillLease
from torchferry.runtime.files import agreed as agreed
from torchferry.runtime.files import check_spill as check_spill
from torchferry.runtime.files import model_entries as model_entries
from torchferry.runtime.files import open_checkpoint as open_checkpoint
from torchferry.runtime.guard import CLAIMS as CLAIMS
from torchferry.runtime.guard import Claim as Claim
from torchferry.runtime.guard import SessionGuard as SessionGuard
from torchferry.runtime.guard import Watch as Watch
from torchferry.runtime.guard import refuse_foreign as refuse_foreign
from torchferry.runtime.interop import Inputs as Inputs
from torchferry.runtime.interop import meta_parameters
from torchferry.runtime.machine import copy_bytes_per_s as copy_bytes_per_s
from torchferry.runtime.machine import host_name as host_name
from torchferry.runtime.machine import load_profile, probe, profile_path, save_profile
from torchferry.runtime.machine import read_facts as read_facts
from torchferry.runtime.machine import strided_names as strided_names
from torchferry.runtime.machine import widened_names as widened_names
from torchferry.runtime.memory import PackState as PackState
from torchferry.runtime.store import HostPlan as HostPlan
from torchferry.runtime.store import exchange_budgets as exchange_budgets
from torchferry.runtime.store import host_figures as host_figures
from torchferry.runtime.store import host_side as host_side
from torchferry.runtime.store import open_tier as open_tier

__all__ = [
    "CheckpointReader",
    "Engine",
    "Span",
    "StepTrace",
    "Tracer",
    "execute",
    "listing",
    "load_profile",
    "meta_parameters",
    "probe",
    "profile_path",
    "save_profile",
]
