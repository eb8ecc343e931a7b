"""`offload`: the session users open; it turns every component forward into one executed schedule.

The session reads top to bottom: discover the pipeline, resolve the request into a plan, pick the
policy, then let the engine take the weights over. From then on each forward of a top-level
component is one *step*: the session names it (``Step(component, index, entry, next)``), asks the
policy for its schedule (once per distinct step: policies are pure, so schedules are cached) and
the engine carries it out while the component runs. The pipeline is called exactly as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection, Iterator, Mapping
from types import TracebackType
from typing import Any

import attrs
import torch

from torchferry import policies, runtime, topology
from torchferry._errors import ExecutionError, PlanError
from torchferry.policies import Placement, Policy, Schedule, Step
from torchferry.runtime import (
    CLAIMS,
    Claim,
    Comm,
    Engine,
    Inputs,
    SessionGuard,
    Steps,
    Tracer,
    Watch,
    prove,
    refuse_foreign,
)
from torchferry.session import _served
from torchferry.session._chooser import Chooser, SessionReport, named_report
from torchferry.session._options import (
    budget_options,
    check_pipeline,
    check_variant,
    is_auto,
    offload_config,
    positional,
    target_device,
)
from torchferry.topology import Declaration, OffloadConfig, Plan

__all__ = ["Session", "SessionReport", "default_policy", "offload", "session_of"]

LOG = logging.getLogger("torchferry")


def default_policy(config: OffloadConfig) -> Policy:
    """The built-in policy of ``config.strategy``, its knobs from the config (`policies.builtin`)."""
    return policies.builtin(config.strategy, depth=config.prefetch_depth, chunk_bytes=config.chunk_bytes)


#: The request's knobs that configure a built-in policy, with their defaults.
_POLICY_KNOBS = {
    f.name: f.default for f in attrs.fields(OffloadConfig) if f.name in ("prefetch_depth", "chunk_bytes")
}


def _policy_knobs(request: OffloadConfig) -> list[str]:
    """The policy knobs ``request`` sets away from their defaults (they configure a built-in policy)."""
    return [f"{k}={getattr(request, k)}" for k, dflt in _POLICY_KNOBS.items() if getattr(request, k) != dflt]


def _shard_group(request: OffloadConfig, process_group: Any) -> Any:
    """The weight-shard group the request needs (``None``: none).

    Only the distributed strategy with an all-gather transfer uses a group: the one passed, else the
    default group (with rank-local transfers a group passed is not used). `topology.resolve` sizes
    the request to it (``world=``): a parallel layout left at one rank takes the group's size, one
    that names another is refused.
    """
    gathers = "allgather" in (request.dit_transfer, request.encoder_transfer)
    if not request.distributed and process_group is not None:
        raise PlanError(
            f"offload(process_group=...) is only used by strategy='distributed_layerwise', and this request "
            f"is strategy={request.strategy!r}; drop process_group or change the strategy"
        )
    if not request.distributed or not gathers:
        return None  # rank-local transfers issue no collective: a group given is not needed
    import torch.distributed as dist

    group = process_group
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise PlanError(
                "strategy='distributed_layerwise' with 'allgather' transfers shards weights across the "
                "ranks of a process group, and torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) on every rank first (or pass "
                "process_group=...), or use dit_transfer='rank-local' and encoder_transfer='rank-local'"
            )
        group = dist.group.WORLD
    return group


def offload(
    pipeline: Any,
    config: OffloadConfig | str | None = None,
    *,
    strategy: str | None = None,
    device: torch.device | str | None = None,
    declaration: Declaration | None = None,
    policy: Policy | None = None,
    process_group: Any = None,
    checkpoint_prefix_map: Mapping[str, str] | None = None,
    spill: str | os.PathLike[str] | None = None,
    checkpoint_variant: str | None = None,
    gather_on_close: bool = False,
    checkpoint_components: Collection[str] | None = None,
    **config_options: Any,
) -> Session:
    """Take over ``pipeline``'s weights and stream them to ``device`` on the policy's schedule.

    ``strategy`` defaults to ``"auto"``: the session picks strategy, depth and resident blocks that
    fit the budget (``device_memory=``, else the device's free memory at open less a margin for
    activations), measures this machine and re-chooses once calibrated (see `torchferry.session._chooser`,
    `Session.report`). A ``config``, a ``policy`` or a ring knob (``prefetch_depth=``) names the
    policy instead. ``config`` (or ``strategy`` and any `OffloadConfig` field as a keyword) says what
    to offload (a strategy name in its place is the strategy: ``offload(pipe, "layerwise")``);
    ``policy`` replaces the strategy's built-in policy (its knobs then go to its factory: passing
    ``prefetch_depth`` or ``chunk_bytes`` with it is a `PlanError`); ``device`` defaults to CUDA when
    present. ``device_memory=`` is the device budget, in bytes or as ``"24GiB"``/``"80GB"``;
    ``host_memory=`` the host budget alike (`OffloadConfig.host_memory_bytes`: what does not fit
    stays in the checkpoint, read on demand; see `policies.tiers`).
    Everything that can be rejected is rejected (`PlanError`) before the pipeline is touched. Use the
    returned `Session` as a context manager, or call its ``close()``.

    - ``checkpoint=`` (a config field): fill the host buffers from a safetensors file, shard folder or
      ``*.index.json`` instead of the module, one block at a time; the pipeline may then be built
      under `torchferry.meta_parameters()`. The checkpoint is validated against the pipeline first
      (missing, extra, mis-shaped or mis-typed tensors, damaged files). ``checkpoint_prefix_map``
      maps the pipeline's tensor-name prefixes to the checkpoint's (``{"transformer.": ""}``);
      ``checkpoint_variant`` (``"fp16"``) reads a pipeline folder's files of that weight variant.
      ``checkpoint_components`` names the top-level components it fills (default: all); the others
      keep their own weights (`from_pretrained` passes those it built).
    - ``host_memory=``: the host budget (default: the machine's); what does not fit is read from the
      checkpoint on demand, or from ``spill=<a folder>`` written once (docs/host-memory.md).
    - ``strategy="distributed_layerwise"``: with an ``allgather`` transfer, every rank of
      ``process_group`` (default: the default group; never a new one) keeps 1/N of each streamed
      block and the ranks all-gather it; every rank must call `offload` alike (a collective). The
      parallel layout defaults to the group's size. ``gather_on_close=True`` makes leaving a ``with``
      block call ``close(gather=True)`` (a collective: every rank must leave it alike), so the
      pipeline comes back with full weights; when the block raises, it closes without gathering
      (a failed rank may never join), and ``close(gather=True)`` still works afterwards.
    """
    config, strategy = positional(config, strategy)
    check_pipeline(pipeline)
    target = target_device(device)
    if _served.serving(pipeline) is not None:
        raise ExecutionError(
            "this pipeline is already served by an open torchferry session; close() it before opening "
            "another (torchferry.session_of(pipe).close() when you no longer hold the session)"
        )
    config_options = budget_options(config_options)
    auto = is_auto(config, strategy, policy, config_options)
    request = offload_config(config, "layerwise" if auto else strategy, config_options)
    if policy is not None and _policy_knobs(request):
        raise PlanError(
            f"offload(policy=...) with {' and '.join(_policy_knobs(request))}: those knobs configure the "
            "strategy's built-in policy, which policy= replaces; pass them to the policy's factory "
            "(policies.layerwise(depth=2)) and drop them here"
        )
    group = _shard_group(request, process_group)
    check_variant(checkpoint_variant, request.checkpoint)
    runtime.check_spill(spill)
    if gather_on_close and not request.distributed:
        raise PlanError(
            f"offload(gather_on_close=True) re-assembles the weight shards of strategy="
            f"'distributed_layerwise', and this request is strategy={request.strategy!r}, which keeps "
            "whole weights: close() gives them back as they were; drop gather_on_close"
        )
    topo = topology.discover(pipeline, declaration)
    topology.check_stranded(pipeline, topo, target)
    refuse_foreign(pipeline, topo)
    CLAIMS.check(pipeline, topo)
    world = None if group is None else torch.distributed.get_world_size(group)
    plan = topology.resolve(topo, request, world=world, checkpoint_components=checkpoint_components)
    if request.checkpoint is not None:  # the names its library saved the files under (topology.KeyMap)
        paths = [c.path for c in topo.components]
        checkpoint_prefix_map = topology.checkpoint_key_map(
            pipeline, paths, request.checkpoint, checkpoint_variant, checkpoint_prefix_map
        )
    facts = runtime.read_facts(
        pipeline, plan, device=target, prefix_map=checkpoint_prefix_map, variant=checkpoint_variant,
        own=topology.own_weights(plan, checkpoint_components), measure=auto,
    )  # fmt: skip
    offered = policies.offered_budget(plan, facts.host)  # under a group, the ranks plan on the least
    least = None if group is None else runtime.exchange_budgets(offered, group, target, plan)

    def decide() -> policies.OpenPlan:
        return policies.open_plan(plan, facts, auto=auto, spill=spill is not None, least=least)

    # Under a group a refusal made on one rank alone (its own facts: a read mode, a locked-memory
    # limit) is agreed on, so no peer is left waiting in the next collective.
    opened = (
        decide() if group is None else runtime.agreed(runtime.Comm(group, target), "plan the session", decide)
    )
    host = runtime.host_side(opened, spill)
    source = opened.device_source
    plan = topology.interned(opened.plan)  # one request on one machine: one plan object however often opened
    chooser = None
    if opened.setup is not None:  # auto: what it starts from, decided by open_plan from the facts
        chooser = Chooser(attrs.evolve(opened.setup, plan=plan), target, source, facts.device.h2d_source)
    chosen = (
        policy if policy is not None else chooser.policy if chooser is not None else default_policy(request)
    )
    comm = None
    if group is not None and plan.config.dp_size > 1:
        from torchferry.runtime import Comm

        comm = Comm(group, target)
    session = Session(
        pipeline, plan, chosen, device=target, comm=comm, prefix_map=checkpoint_prefix_map, chooser=chooser,
        variant=checkpoint_variant, host=host, checkpoint_components=checkpoint_components,
    )  # fmt: skip
    session.gather_on_close = gather_on_close
    session.budget_source = source
    return session


def session_of(pipeline: Any) -> Session | None:
    """The open session serving ``pipeline`` (what was passed to `offload`) or one of its top-level
    components (``pipe.transformer``), else ``None``.

    Every session should be closed by its ``close()`` (or a ``with`` block); this finds one again
    when its value was lost (a notebook cell run twice), so a new `offload` can follow::

        if (old := torchferry.session_of(pipe)) is not None:
            old.close()
    """
    found = _served.find(pipeline)
    return found if isinstance(found, Session) else None


class Session:
    """One pipeline served by one plan and policy until `close`; also a context manager.

    ``schedules`` holds every schedule the session has run, by step. Device and host byte counts,
    the peak and the hooks installed are exposed for inspection and tests.
    """

    def __init__(
        self,
        pipeline: Any,
        plan: Plan,
        policy: Policy,
        *,
        device: torch.device,
        comm: Comm | None = None,
        prefix_map: Mapping[str, str] | None = None,
        chooser: Chooser | None = None,
        host: runtime.HostPlan,
        variant: str | None = None,
        checkpoint_components: Collection[str] | None = None,
    ) -> None:
        # Host memory was proved by the open plan; each top-level component's first schedule is proved
        # here, and only then is a spill written: every refusal comes before its first byte.
        self.host = host  # Why: what the open plan decided of host memory (tiers, budget, pinning; `report`).
        self.pipeline = pipeline
        self.plan = plan
        self.policy = policy
        self.device = device
        # Why: the spill folder this session holds until close; a failed open takes out what it wrote.
        self._spill = runtime.SpillLease()
        with self._spill.opening():
            # Why: with a group, every rank learns whether every rank could (a failed one fails them all).
            tier = runtime.open_tier(pipeline, plan, host, comm=comm)
            for top in plan.components:
                prove(policy(plan, Step(component=top.path)), plan)
            self._spill.write()
            self.engine = Engine(
                pipeline,
                plan,
                device=device,
                pin_memory=host.pin,
                comm=comm,
                prefix_map=prefix_map,
                driver=self,
                tier=tier,
                variant=variant,
                checkpoint_components=checkpoint_components,
            )
        self._steps = Steps(plan, policy, index_free=policies.is_index_free(policy))
        self.schedules: dict[Step, Schedule] = self._steps.schedules
        # Why: the most device bytes each step held while it ran, to compare with `policies.simulate`.
        self.step_peaks: dict[Step, int] = self._steps.peaks
        self._step: Step | None = None
        self._closed = False
        # Why: auto's choice, measurements and re-choices (``None``: the caller named the policy).
        self._chooser = chooser
        # Why: the chooser's tracer of the running step, handed to it when the step finishes.
        self._measuring: Tracer | None = None
        # Why: a step's end that did not run to its end (see `leave`).
        self._ending = False
        # Why: the most host bytes the store held, for `report` (the store is filled once, at open).
        self._peak_host = 0
        inputs: Inputs | None = None
        try:
            self.engine.anchor(self._anchors())
            self._guard = SessionGuard(pipeline, plan, self.engine)
            # Why: a pipeline call's inputs go to the session device, where its weights run (defect 1).
            inputs = Inputs(pipeline, [c.path for c in plan.components], device)
            # Why: tensors added to a component after opening (a LoRA adapter) are checked at each step.
            self._watch = Watch(pipeline, plan.topology, device)
        except BaseException:
            if inputs is not None:
                inputs.remove()
            self.engine.close()
            self._spill.abandon()
            raise
        self._inputs = inputs
        #: Whether leaving a ``with`` block gathers full weights back (see `offload`'s gather_on_close).
        self.gather_on_close = False
        #: Where the device budget came from, as a named policy's report says it.
        self.budget_source = "given"
        _served.register(pipeline, self)
        # Why: the tensors this session serves, refused to a second session until close.
        self._claimed: Claim | None = CLAIMS.claim(pipeline, plan.topology)
        self._peak_host = self.host_bytes
        if chooser is not None:
            self._log()  # what auto chose at open, before measuring anything

    def _anchors(self) -> list[str]:
        paths: list[str] = []
        for top in self.plan.components:
            for c in top.walk():
                paths.append(c.path)
                paths.extend(b.path for b in c.blocks)
        return paths

    # --------------------------------------------------------------------------- engine driver
    def enter(self, component: str) -> None:
        """A top-level component's forward begins: start its step's schedule."""
        self._watch.check(component)
        engine = self.engine
        self._guard.entering(component)  # another thread's step runs: refused
        if engine.running or self._ending:
            # A step that never finished (a KeyboardInterrupt skips forward hooks), or whose end was
            # cut short by a signal: start clean.
            self._guard.restart()
            self._ending = False
        self._guard.adopt()  # weight edits since the last step reach the host copy, or are refused
        chooser = self._chooser
        if chooser is not None:
            switch = chooser.pending()
            if switch is not None:
                # Between steps only: drop what the old schedule left, the new one stages what it needs.
                self._guard.restart()
                self._steps.use(switch, index_free=policies.is_index_free(switch))
                self.policy = switch
                self._log()  # the re-chosen schedule runs from this step
        step = self._steps.next(component, engine.residency)
        if chooser is not None:
            tracer = chooser.tracer(component, self._steps.index)
            if tracer is not None and not engine.traced:
                engine.arm(tracer)
                self._measuring = tracer
        engine.begin(self._steps.schedule(step))
        self._step = step

    def leave(self, component: str, failing: bool) -> None:
        """A top-level component's forward ended: check its step, or recover if it raised."""
        if not self._guard.owns():
            return  # this thread's step was refused at its start; another thread's step runs on
        measuring, self._measuring = self._measuring, None
        # Why: a signal may land anywhere in here (the step's end, its recovery, the guard's record):
        # until all of it ran, the next step starts clean, as after a step that never finished.
        self._ending = True
        ended = False
        try:
            self._guard.drain()  # a step that failed or ended early still owes the other ranks its gathers
            if failing:
                self._guard.keep_device_writes()  # what the failed step wrote in place is kept
                self.engine.abort()
                self._steps.interrupted()
                ended = True
                return
            self.engine.finish()
            if self._step is not None:
                self._steps.finished(self._step, self.engine.ledger.step_peak)
            ended = True
        finally:
            self._guard.left()
            self._ending = not ended
        chooser = self._chooser
        if measuring is not None and measuring.done and chooser is not None:
            rechosen = chooser.traced(measuring.result)
            if rechosen and not chooser.switching:
                self._log()  # a re-choice that kept the schedule; a switch is logged when it takes effect

    def _log(self) -> None:
        if LOG.isEnabledFor(logging.INFO):
            LOG.info("%s", self.report().summary())

    @contextlib.contextmanager
    def trace(self, component: str, *, skip: int = 0) -> Iterator[Tracer]:
        """Measure one step of ``component`` run inside the block: when each op and block ran, and where.

        The first ``skip`` steps of ``component`` that start in the block run untraced (the first
        step of a pipeline call starts from another component's residency; later ones are steady);
        the next one is traced. After it, ``tracer.result`` is a `StepTrace`: every copy (copy
        stream), collective (comm stream), block forward and stall (compute stream) as a `Span` in
        seconds from the step's start, timed with CUDA events on CUDA (one synchronize when the step
        ends) and with the host clock on the CPU (see `Tracer`). Steps that are not traced cost nothing
        extra, and tracing changes no output::

            with session.trace("transformer", skip=1) as tracer:
                pipe(prompt, steps=2)
            print(tracer.result.busy_s("copy"), tracer.result.wall_s)
        """
        tops = [c.path for c in self.plan.components]
        if component not in tops:
            raise PlanError(
                f"session.trace({component!r}): not a top-level component of this plan; trace one of "
                f"{', '.join(map(repr, tops))}"
            )
        if skip < 0:
            raise PlanError(f"session.trace(skip={skip}): skip counts steps, so it must be 0 or more")
        if self.engine.traced:
            raise ExecutionError("session.trace(): a trace is already running on this session; end it first")
        tracer = Tracer(self.device, component, skip=skip)
        self.engine.arm(tracer)
        try:
            yield tracer
        finally:
            self.engine.disarm(tracer)

    @contextlib.contextmanager
    def running(self, component: str) -> Iterator[None]:
        """Treat the body as a forward of ``component`` (for calls such as ``vae.decode()``).

        The component's step runs around the body exactly as around its forward: its ``before`` ops
        first, its ``after`` ops and the end-of-step checks after, or recovery if the body raises.
        """
        if self._closed:
            raise ExecutionError(f"session.running({component!r}): this session is closed; open a new one")
        tops = [c.path for c in self.plan.components]
        if component not in tops:
            raise PlanError(
                f"session.running({component!r}): not a top-level component of this plan; run one of "
                f"{', '.join(map(repr, tops))}"
            )
        with self.engine.forward(component):
            yield

    # ------------------------------------------------------------------------------- figures
    def report(self) -> SessionReport:
        """What this session measured, chose, predicted and measured again, and why.

        Under ``strategy="auto"``: the budget and where it came from, the bandwidth measured, the
        chooser's `policies.Choice`, the calibrated cost model, each streaming component's predicted
        and measured steady step, the one check of a prediction against a step it was not fitted to,
        and every switch of schedule. Otherwise the policy the caller named. Both say what the
        session holds in device and host memory, now and at peak; ``print(session.report())`` shows
        it as aligned lines, ``report.summary()`` in one.
        """
        self._peak_host = max(self._peak_host, self.host_bytes)
        memory: dict[str, Any] = {
            "device": str(self.device),
            "device_bytes": self.device_bytes,
            "peak_device_bytes": self.peak_device_bytes,
            "host_bytes": self.host_bytes,
            "peak_host_bytes": self._peak_host,
            "host_budget": self.plan.config.host_memory_bytes,
            **runtime.host_figures(self.engine.store, self.host),
            **self._planned_reads(),
        }
        if self._chooser is not None:
            return attrs.evolve(self._chooser.report(), **memory)
        return named_report(self.running_policy, self.plan, source=self.budget_source, **memory)

    def _planned_reads(self) -> dict[str, Any]:
        """The plan's digest, file-tier packs and planned reads by how often, as `torchferry plan` says."""
        chosen = self.host.tiers
        reads = policies.policy_reads(self.policy, self.plan, chosen)
        return {
            "plan_digest": self.plan.digest,
            "file_pack_names": tuple(sorted(chosen.file)),
            "planned_read_bytes": {h: sum(r[h] for r in reads.values()) for h in policies.HEATS},
        }

    @property
    def device_bytes(self) -> int:
        """Device bytes the runtime holds now (slots, staged units, acquired components)."""
        return self.engine.ledger.held

    @property
    def peak_device_bytes(self) -> int:
        return self.engine.ledger.peak

    @property
    def host_bytes(self) -> int:
        """Bytes of the host buffers behind every managed weight, and the file tier's staging and reader's."""
        return self.engine.store.nbytes + self.engine.store.tier_bytes

    @property
    def hook_count(self) -> int:
        return self.engine.hook_count + self._inputs.count

    @property
    def residency(self) -> tuple[Placement, ...]:
        """What the last step left on the device."""
        return self.engine.residency

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def running_policy(self) -> str:
        """What runs the steps now: the policy's name, ``auto: `` before it when auto chose it (and
        re-chose: a switch waiting for the next step shows once that step has begun)."""
        name = str(getattr(self.policy, "name", getattr(self.policy, "__name__", "custom policy")))
        return f"auto: {name}" if self._chooser is not None else name

    def served_modules(self) -> list[Any]:
        """The top-level component modules this session serves (see `torchferry.session_of`)."""
        return [topology.find_attr(self.pipeline, c.path) for c in self.plan.components]

    # ------------------------------------------------------------------------------ lifecycle
    def close(self, *, gather: bool = False) -> None:
        """Give the pipeline back as it was: weights on the host, bit-identical, no hooks left.

        Needs no collective. Under the distributed strategy each rank holds only its shard of every
        all-gathered block, so a plain ``close()`` leaves those blocks' tensors empty (shape ``(0,)``)
        and warns (`OffloadWarning`), except blocks in the file tier, which come back as views of the
        checkpoint every rank reads; host shards are never dropped. ``close(gather=True)``, called on
        every rank of the process group (a collective), re-assembles full weights first; it also
        works after a plain ``close()``.
        """
        if self._closed:
            if gather:
                self.engine.gather_host()
            return
        self._closed = True
        try:
            try:
                self._guard.close()  # edits made since the last step reach the weights given back
            finally:
                self._inputs.remove()
                self.engine.close(gather=gather)
        finally:
            _served.unregister(self.pipeline, self)
            CLAIMS.release(self._claimed)
            self._claimed = None
            self._watch.clear()
            self._spill.release()

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        if value is None:
            self.close(gather=self.gather_on_close)
            return
        try:
            self.close()
        except Exception as exc:
            # The body's own exception is the one to see (a device that failed mid-step fails close
            # too, after close has given every weight back): close's is noted on it, not raised.
            note = getattr(value, "add_note", None)
            if note is not None:
                note(f"torchferry: closing the session afterwards raised too: {type(exc).__name__}: {exc}")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<torchferry.Session {state} {self.running_policy} on {self.device}: plan {self.plan.digest}, "
            f"{len(self.schedules)} schedules, {self.device_bytes} device bytes>"
        )
