"""`resolve`: the pure function from a topology and a config to a plan, or a `PlanError`."""

from __future__ import annotations

from torchferry.topology._config import OffloadConfig
from torchferry.topology._model import Topology
from torchferry.topology._plan import Plan

__all__ = ["resolve"]


def resolve(topology: Topology, config: OffloadConfig) -> Plan:
    """Resolve and validate ``topology`` under ``config``."""
    raise NotImplementedError
