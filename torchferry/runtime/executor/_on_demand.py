"""The handlers of an on-demand component's own lifecycle: ``acquire`` calls its ``load_to_device``,
``release`` its ``offload_to_cpu``, with the bytes they hold on the device ledger."""

from __future__ import annotations

import inspect

import torch

from torchferry._errors import ExecutionError
from torchferry.policies import DEVICE, Op
from torchferry.runtime.device import Ledger
from torchferry.runtime.executor._trace import Tracer
from torchferry.runtime.memory import Unit
from torchferry.runtime.store import HostStore
from torchferry.topology import Plan

__all__ = ["OnDemand"]


class OnDemand:
    """The acquire and release handlers of `Mover` (which sets every attribute declared here)."""

    plan: Plan
    device: torch.device
    ledger: Ledger
    store: HostStore
    tracer: Tracer | None
    placed: dict[str, str]
    #: Per acquired component, the bytes it holds on the device.
    acquired: dict[str, int]
    _load_takes_device: dict[str, bool]

    def _acquire(self, unit: Unit, op: Op) -> None:
        module = unit.module
        load = getattr(module, "load_to_device", None)
        if load is None:
            raise ExecutionError(f"acquire {unit.name}: the module defines no load_to_device()")
        takes = self._load_takes_device.get(unit.name)
        if takes is None:
            takes = bool(inspect.signature(load).parameters)
            self._load_takes_device[unit.name] = takes
        tracer = self.tracer
        begin = None if tracer is None else tracer.compute_mark()
        if takes:
            load(self.device)
        else:
            load()
        if tracer is not None:
            tracer.span("compute", begin, tracer.compute_mark())
        nbytes = op.nbytes or self.plan.topology.component(unit.name).nbytes
        self.acquired[unit.name] = nbytes
        self.ledger.add(nbytes)
        self.placed[unit.name] = DEVICE

    def _release(self, unit: Unit, op: Op) -> None:
        self._release_module(unit.name)
        self.placed.pop(unit.name, None)

    def _release_module(self, name: str) -> None:
        nbytes = self.acquired.pop(name, None)
        if nbytes is None:
            return
        self.ledger.sub(nbytes)
        offload = getattr(self.store.units[name].module, "offload_to_cpu", None)
        if offload is None:
            raise ExecutionError(f"release {name}: the module defines no offload_to_cpu()")
        offload()
