"""The error family every torchferry failure belongs to."""

from __future__ import annotations

__all__ = [
    "ExecutionError",
    "OffloadError",
    "OffloadWarning",
    "PlanError",
    "ScheduleError",
    "TorchferryDeprecationWarning",
]


class OffloadError(Exception):
    """Root of every error torchferry raises on purpose."""


class PlanError(OffloadError, ValueError):
    """A configuration or topology that cannot be served; raised before anything is mutated."""


class ScheduleError(OffloadError):
    """A schedule that breaks an invariant of `policies.check`, or text that does not parse."""


class ExecutionError(OffloadError, RuntimeError):
    """The runtime could not carry out a schedule as written."""


class OffloadWarning(UserWarning):
    """Something was skipped or kept resident because the request could not be served as asked."""


class TorchferryDeprecationWarning(FutureWarning):
    """A legacy way of declaring topology or configuration that still works but will go away."""
