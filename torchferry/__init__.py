"""torchferry: run large diffusion pipelines on small GPUs by streaming weights on a planned schedule."""

from __future__ import annotations

from torchferry import policies, runtime, topology
from torchferry._errors import (
    ExecutionError,
    OffloadError,
    OffloadWarning,
    PlanError,
    ScheduleError,
    TorchferryDeprecationWarning,
)
from torchferry.load import from_pretrained, from_single_file
from torchferry.runtime import meta_parameters
from torchferry.session import Session, SessionReport, offload, session_of

__version__ = "0.1.0"

__all__ = [
    "ExecutionError",
    "OffloadError",
    "OffloadWarning",
    "PlanError",
    "ScheduleError",
    "Session",
    "SessionReport",
    "TorchferryDeprecationWarning",
    "__version__",
    "from_pretrained",
    "from_single_file",
    "meta_parameters",
    "offload",
    "policies",
    "runtime",
    "session_of",
    "topology",
]
