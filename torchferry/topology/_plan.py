"""The resolved plan: a topology filtered and annotated by one offload request."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Iterable
from functools import lru_cache

import attrs

from torchferry.topology._config import OffloadConfig
from torchferry.topology._fields import WHEN_SET, Strategy
from torchferry.topology._frozen import FrozenMap
from torchferry.topology._model import Component, ComponentKind, TensorSpec, Topology, find_component

__all__ = ["Plan", "StoreFacts", "canonical", "interned"]


@attrs.frozen(kw_only=True)
class StoreFacts:
    """What the host planner (`policies.host_plan`, `policies.tiers`) must know of a plan's weights
    beyond their shapes: facts read once at open, from the live module and the checkpoint's headers
    (or, by `torchferry plan`, from the folder's pipeline built on the meta device). Not part of
    `Plan.digest`: they change what host memory holds, not what the plan is.

    - ``widened``: tensor names a file-tier pack keeps in host memory, widened to float32 (the
      model keeps them in float32, the checkpoint stores them in 16 bits).
    - ``strided``: tensor names stored with other strides than row-major (a transposed weight): a
      file-tier read goes through the reader's scratch for them.
    - ``own``: top-level components that keep their own weights (given by keyword, or left out of
      ``checkpoint_components=``): the checkpoint does not hold their bytes, so none of their packs
      can be in the file tier.
    - ``copied``: the store copies the pipeline's own weights in, one pack at a time, so the open
      holds one more pack for a moment (counted against a machine budget).
    - ``locked_bytes``: ``RLIMIT_MEMLOCK`` where it bounds the bytes this session pins (``None``: it
      does not, or nothing is pinned).
    - ``host_device``: the session's device is the CPU, so its slots are host memory the file tier's
      reader can fill itself: no staging slot sits between the checkpoint and the device
      (`policies.reads_direct`).
    """

    widened: frozenset[str] = frozenset()
    strided: frozenset[str] = frozenset()
    own: frozenset[str] = frozenset()
    copied: bool = False
    locked_bytes: int | None = None
    host_device: bool = False


def _components(value: Iterable[Component]) -> tuple[Component, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True, cache_hash=True)
class Plan:
    """What `resolve` decided for one topology under one config.

    ``components`` mirror the topology's, with ``selected``, ``on_demand``, resident heads and
    children set by the rules; a component the request does not stream has no stacks here.
    ``skip_reason`` is set when a legacy request turned into a complete no-op.
    """

    topology: Topology
    config: OffloadConfig
    components: tuple[Component, ...] = attrs.field(converter=_components)
    skip_reason: str | None = None
    #: Facts of the weights the host planner counts (`StoreFacts`); not part of the digest.
    facts: StoreFacts = attrs.field(default=StoreFacts(), metadata=WHEN_SET)

    @property
    def strategy(self) -> Strategy:
        return self.config.strategy

    def component(self, path: str) -> Component:
        """The resolved component at ``path`` (children included)."""
        return find_component(self.components, path, "plan")

    def block_owner(self, block: str) -> tuple[Component, Component] | None:
        """The top-level component and the (sub)component whose block list holds block path
        ``block``, or ``None`` when no component of the plan lists it."""
        for top in self.components:
            for c in top.walk():
                if any(b.path == block for b in c.blocks):
                    return top, c
        return None

    def of_kind(self, kind: ComponentKind) -> tuple[Component, ...]:
        return tuple(c for c in self.components if c.kind == kind)

    def owners(self) -> FrozenMap[str, str]:
        """Alias name -> owning tensor name: which tensor owns each tied or aliased weight."""
        return self.topology.owners()

    @property
    def digest(self) -> str:
        """A short stable fingerprint of what `resolve` decided: equal on every rank and in every
        process for equal plans. The config's runtime options (`RUNTIME_OPTIONS`: prefetch depth,
        chunk size, budget, pinning, checkpoint path) take no part, so plans that differ only there
        (two hosts with the checkpoint in different places, say) have one digest."""
        return _digest(self)


def _unset_late_field(field: attrs.Attribute[object], value: object) -> bool:
    """Whether ``field`` is marked `WHEN_SET` and ``value`` leaves it at its default."""
    return field.metadata.get("digest") == WHEN_SET["digest"] and getattr(value, field.name) == field.default


def canonical(value: object) -> object:
    """A process-independent, ordered rendering of frozen data (sets sorted) for hashing."""
    if isinstance(value, TensorSpec):  # the bulk of any plan: a flat tuple is enough and fast
        flat = (value.name, value.shape, value.dtype, value.buffer, value.persistent, value.aliases)
        return flat if value.compute_dtype is None else (*flat, value.compute_dtype)
    cls = type(value)
    if attrs.has(cls):
        # A field marked `WHEN_SET` takes part only when set, so older digests stay as they were.
        fields = [f for f in attrs.fields(cls) if f.eq and not _unset_late_field(f, value)]
        return (cls.__name__, tuple((f.name, canonical(getattr(value, f.name))) for f in fields))
    if isinstance(value, (frozenset, set)):
        return ("set", tuple(sorted(repr(canonical(v)) for v in value)))
    if isinstance(value, FrozenMap):
        return ("map", tuple((k, canonical(v)) for k, v in value.items()))
    if isinstance(value, tuple):
        return tuple(canonical(v) for v in value)
    return value


_NO_FACTS = StoreFacts()


@lru_cache(maxsize=256)
def _digest(plan: Plan) -> str:
    request = plan.config.request  # runtime options are not part of what a plan is
    unset = request is plan.config and plan.facts == _NO_FACTS
    identity = plan if unset else attrs.evolve(plan, config=request, facts=_NO_FACTS)
    return hashlib.sha256(repr(canonical(identity)).encode()).hexdigest()[:8]


#: Every plan a session runs, by value: one instance of each, while anything holds it.
_INTERNED: weakref.WeakValueDictionary[Plan, Plan] = weakref.WeakValueDictionary()


def interned(plan: Plan) -> Plan:
    """The one live instance equal to ``plan`` (``plan`` itself when none is): sessions of one request
    on one machine then share one plan and its topology, so the caches keyed by plans hold one copy
    however often a pipeline is opened and closed."""
    found = _INTERNED.get(plan)
    if found is None:
        _INTERNED[plan] = found = plan
    return found
