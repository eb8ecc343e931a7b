"""The only stateful layer: carries out schedules on real modules with streams and collectives.

The public names are what users and the docs reach for: `execute` (one schedule on a live
pipeline), the `Engine` behind it and a session, tracing (`Tracer`, `StepTrace`, `Span`), the
`listing` errors show, `CheckpointReader` and `meta_parameters`. Everything else is internal.
"""

from __future__ import annotations

# Imports written ``name as name`` are for the layers above, which enter only through this file
# (tests/test_layering.py); they are not public and not in ``__all__``.
from torchferry.runtime._checkpoint import CheckpointReader
from torchferry.runtime._claims import CLAIMS as CLAIMS
from torchferry.runtime._claims import Claim as Claim
from torchferry.runtime._claims import Watch as Watch
from torchferry.runtime._claims import refuse_foreign as refuse_foreign
from torchferry.runtime._comm import Comm as Comm
from torchferry.runtime._devices import resolved as resolved
from torchferry.runtime._devices import same_device as same_device
from torchferry.runtime._engine import Engine, execute
from torchferry.runtime._engine import stream_factory as stream_factory
from torchferry.runtime._gguf import GGUFCheckpointReader as GGUFCheckpointReader
from torchferry.runtime._gguf import model_entries as model_entries
from torchferry.runtime._gguf import open_checkpoint as open_checkpoint
from torchferry.runtime._guard import SessionGuard as SessionGuard
from torchferry.runtime._inputs import Inputs as Inputs
from torchferry.runtime._meta import meta_parameters
from torchferry.runtime._pack import PackState as PackState
from torchferry.runtime._preflight import HostPlan as HostPlan
from torchferry.runtime._preflight import host_figures as host_figures
from torchferry.runtime._preflight import host_plan as host_plan
from torchferry.runtime._preflight import open_tier as open_tier
from torchferry.runtime._preflight import strided_names as strided_names
from torchferry.runtime._preflight import widened_names as widened_names
from torchferry.runtime._probe import copy_bytes_per_s as copy_bytes_per_s
from torchferry.runtime._probe import host_name as host_name
from torchferry.runtime._probe import load_profile, probe, profile_path, save_profile
from torchferry.runtime._program import listing
from torchferry.runtime._spill import check_spill as check_spill
from torchferry.runtime._spill_lease import SpillLease as SpillLease
from torchferry.runtime._steps import Steps as Steps
from torchferry.runtime._steps import prove as prove
from torchferry.runtime._streams import DeviceBuffer as DeviceBuffer
from torchferry.runtime._streams import StreamContext as StreamContext
from torchferry.runtime._streams import Timer as Timer
from torchferry.runtime._streams import aligned_empty as aligned_empty
from torchferry.runtime._trace import Span, StepTrace, Tracer
from torchferry.runtime._widen import keep_lists as keep_lists

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
