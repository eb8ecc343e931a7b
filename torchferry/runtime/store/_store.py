"""The host store: every weight the runtime moves lives in one flat byte buffer per pack, and the
store opens on a pipeline in two phases that check, allocate and fill before anything is mutated.

Each pack (`torchferry.runtime.memory._pack`) owns one flat ``uint8`` buffer in page-aligned host memory,
page-locked on CUDA (see `torchferry.runtime.memory._pinning`), and the module's parameters and buffers are
re-pointed (``tensor.data = view``) at views into it. A tensor whose elements are dense in memory
keeps its strides (a transposed weight stays transposed); one with gaps is stored contiguously.

Host buffers are filled once when a session opens (by `torchferry.runtime.store._fill`) and are never
written or freed while it lives: a device copy can always be dropped, and no failure can lose a
weight. `HostStore.close` gives every tensor ordinary storage of its own again.

[Note: filling from a checkpoint]
With a `CheckpointReader` the buffers fill from the safetensors files (one block at a time, straight
from mapped windows of the file into the buffer), never from the module, so the pipeline may be
built with its parameters on the meta device: host memory then peaks near the model's size once.
Opening is two phases: `HostStore.prepare` checks everything (the live tensors against the plan,
the checkpoint against the topology), allocates and pins every buffer and, from a checkpoint, reads
it, without touching the pipeline (a module's own bytes are copied in by commit); only
`Prepared.commit` mutates it (meta tensors become CPU tensors in place, by `torch.utils.swap_tensors`,
so their identity and ties survive, then every tensor is re-pointed). Any failure before commit
leaves the pipeline exactly as it was. Checkpoint bytes are in row-major order; a tensor whose
module stores it with other strides (a transposed weight) is rearranged into those strides.

[Note: inference tensors]
A pipeline built under ``torch.inference_mode()`` (as serving frameworks build them) holds inference
tensors, which keep no version counter and can never again be re-pointed for good outside inference
mode (``t.data = view`` leaves the tensor without one). `Prepared.commit` therefore turns each one it
takes over into an ordinary tensor in place, once its bytes are in the host buffer: the Python
object is kept (identity, class, attributes, so ties and references hold) and only the tensor under
it is swapped, by `torch.utils.swap_tensors`, which checks first that nothing else holds it
(`prepare` refuses one it could not swap, before anything changes). Values are bit-identical; the
one change is that the weights given back at close are ordinary tensors (``is_inference()`` false),
as a ``load_state_dict(..., assign=True)`` of clones outside inference mode would leave them.

Non-persistent buffers (RoPE tables and the like) are not in checkpoints: their bytes come from the
module, which must have computed them on the CPU. Build the pipeline under `meta_parameters()`
(parameters on meta, buffers as the module makes them); a non-persistent buffer left on the meta
device (``with torch.device("meta")`` puts everything there) cannot be recomputed and is rejected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from torchferry._errors import PlanError
from torchferry.policies import rest_unit, unit_packs
from torchferry.runtime.memory import (
    CudaPinner,
    HostMemory,
    HostPinner,
    Layouts,
    Pack,
    Piece,
    Sharding,
    Unit,
    aliased,
    check_wrappers,
    find_wrappers,
    holders,
    on_host,
    page_bytes,
    shard_span,
)
from torchferry.runtime.store._fill import (
    fill_from_module,
    group_specs,
    in_pack_order,
    make_ordinary,
    materialise,
    pack_layout,
    read_loose,
    read_pack,
)
from torchferry.runtime.store._validate import (
    Lookup,
    check_live,
    check_unmanaged,
    refuse_shared,
    refuse_unswappable,
    some,
)
from torchferry.topology import Plan, TensorSpec, find_attr
from torchferry.topology import pack as pack_specs

if TYPE_CHECKING:
    from torchferry.runtime.files import CheckpointReader
    from torchferry.runtime.store._file_tier import FileTier, TierRequest

__all__ = ["HostStore", "Prepared"]


class HostStore:
    """The host buffers of one session, the units that name them, and the live tensors they back."""

    def __init__(self, packs: dict[str, Pack], units: dict[str, Unit], memory: HostMemory) -> None:
        self.packs = packs
        self.units = units
        #: The buffers' memory: it alone pins and frees them.
        self.memory = memory
        # Why: storage layouts (aliases, shared storage, gapped strides) close restores ([Note: as it was]).
        self.layouts = Layouts()
        #: The file tier (packs read from the checkpoint on demand, see `_tiers`), or ``None``.
        self.tier: FileTier | None = None

    @property
    def pinned(self) -> bool:
        """Whether every host buffer is page-locked (the truth: false after a refused pin)."""
        return self.memory.pinned

    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory page-locked for the store now (whole pages of its buffers)."""
        return self.memory.pinned_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the store's packs hold (a sharded pack counts its shard only, a
        file-tier pack nothing: see `host_bytes` for the staging slots)."""
        return sum(g.host.numel() for g in self.packs.values())

    @property
    def tier_bytes(self) -> int:
        """Bytes the file tier holds (staging slots, bounce and scratch buffers, kept buffers)."""
        if (tier := self.tier) is None:
            return 0
        staging = sum(s.buffer.data.numel() for s in tier.staging.values())
        return staging + tier.reader.bounce_bytes + tier.reader.scratch_bytes + tier.kept_bytes

    @property
    def host_bytes(self) -> int:
        """Host memory the store holds now, whole pages: pack buffers, and the file tier's staging
        slots, bounce buffers and kept buffers."""
        tier = 0 if self.tier is None else self.tier.host_bytes
        return sum(page_bytes(g.host.numel()) for g in self.packs.values()) + tier

    @property
    def sharded(self) -> tuple[Pack, ...]:
        """The packs this rank holds only a shard of."""
        return tuple(g for g in self.packs.values() if g.shard is not None)

    @classmethod
    def prepare(
        cls,
        pipeline: Any,
        plan: Plan,
        *,
        pin: bool,
        reader: CheckpointReader | None = None,
        sharding: Sharding | None = None,
        pinner: HostPinner | None = None,
        progress: Callable[[int, int], None] | None = None,
        tier: TierRequest | None = None,
        from_module: frozenset[str] = frozenset(),
    ) -> Prepared:
        """Check everything, allocate (and pin) every buffer and, from a checkpoint, read it, without
        touching the pipeline.

        ``pin`` page-locks the buffers with ``pinner`` (default `CudaPinner`); a refused pin falls
        back to pageable memory with one `OffloadWarning`. Raises `PlanError` for a pipeline or
        checkpoint that cannot serve ``plan`` (every problem at once); see [Note: filling from a
        checkpoint] above and [Note: sharded packs] in `torchferry.runtime.memory._pack`. A `Prepared` that
        is not committed must be `Prepared.discard`-ed. ``progress``, when given, is called once per
        pack as its buffer is filled (here from a checkpoint, else in `Prepared.commit`) with the
        pack's bytes and the bytes of all packs. ``tier`` lays out a file tier: its packs get no
        buffer and are read from ``tier.source`` on demand (see [Note: the file tier] in `_tiers`).
        ``from_module`` names top-level components whose tensors come from the module even with a
        checkpoint (`offload`'s ``checkpoint_components`` leaves them out): only the others are
        validated against and read from ``reader``.
        """
        specs = group_specs(plan)
        filed = frozenset() if tier is None else tier.packs
        owners = {name: top.path for top in plan.components for name in unit_packs(plan, top.path)}
        lookup = Lookup(pipeline)
        resolved = {name: [lookup.tensor(s) for s in pack] for name, pack in specs.items()}
        loose = _loose_specs(plan, specs)
        loose_live = [lookup.tensor(s) for s in loose]
        read = set() if reader is None else {n for n in specs if owners[n] not in from_module}
        loose_read = [reader is not None and _top(plan, s.name) not in from_module for s in loose]
        problems: list[str] = []
        meta: list[str] = []
        unfilled: list[str] = []
        on_meta: list[str] = []
        unmanaged: list[str] = []
        for name, pack in specs.items():
            found: list[str] = []
            check_live(pack, resolved[name], problems, found, on_meta)
            if name in filed:
                continue  # a file-tier pack's meta tensors are filled from its source
            meta.extend(found)
            if name not in read:
                unfilled.extend(found)
        for spec, live, filled in zip(loose, loose_live, loose_read, strict=True):
            found = []
            check_live([spec], [live], problems, found, on_meta, missing_ok=True)
            meta.extend(found)
            if not filled:
                unfilled.extend(found)
        check_unmanaged(pipeline, plan, meta, unmanaged)
        if unfilled:
            why = (
                "no checkpoint was given to fill them; pass checkpoint=<a .safetensors file, a folder of "
                "them or an *.index.json> to torchferry.offload(...)"
                if reader is None
                else "their components are not among the checkpoint's (checkpoint_components); fill them "
                "from the checkpoint"
            )
            raise PlanError(
                f"torchferry.offload cannot take over this pipeline: {len(unfilled)} tensor(s) are on the "
                f"meta device ({some(unfilled)}) and {why}, or load the weights into the pipeline on the "
                "CPU first"
            )
        if on_meta or unmanaged:
            raise PlanError(
                "torchferry.offload cannot fill this pipeline from its checkpoint: "
                + (
                    f"{len(on_meta)} non-persistent buffer(s) are on the meta device ({some(on_meta)}), "
                    "and checkpoints do not hold such buffers nor can torchferry recompute them; build the "
                    "pipeline under torchferry.meta_parameters() (parameters on meta, buffers computed on "
                    "the CPU as the module makes them) instead of torch.device('meta')"
                    if on_meta
                    else f"{len(unmanaged)} tensor(s) on the meta device belong to no component torchferry "
                    f"manages ({some(unmanaged)}), so nothing would fill them; give them real values first"
                )
            )
        if problems:
            raise PlanError(
                "torchferry.offload cannot take over this pipeline:\n  "
                + "\n  ".join(problems[:8])
                + ("\n  ..." if len(problems) > 8 else "")
                + f"\nThe {plan.strategy} plan keeps every weight in host memory and moves it itself: "
                "build or load the pipeline on the CPU (or call pipeline.to('cpu')) before "
                "torchferry.offload(...), and let the session place it on the device."
            )
        refuse_shared(specs, resolved, lookup)
        refuse_unswappable(specs, resolved)
        if reader is not None:
            expected = [
                s for c in plan.topology.components if c.path not in from_module for s in c.all_tensors()
            ]
            reader.validate(expected, skip=tuple(f"{p}." for p in from_module))
        wrappers = {name: find_wrappers(pipeline, pack) for name, pack in specs.items()}
        check_wrappers(wrappers)
        layouts: dict[str, tuple[tuple[Piece, ...], int]] = {}
        for name, pack in specs.items():
            layouts[name] = pack_layout(pack, resolved[name])
        memory = HostMemory((pinner or CudaPinner()) if pin else None)
        buffers: dict[str, torch.Tensor] = {}
        loose_values: list[torch.Tensor | None] = []
        total = sum(_span_bytes(name, layouts[name][1], sharding) for name in specs if name not in filed)
        files: FileTier | None = None
        try:
            memory.probe()
            if tier is not None:
                from torchferry.runtime.store._file_tier import FileTier

                files = FileTier.prepare(
                    tier, specs=specs, layouts=layouts, live=resolved, sharding=sharding, memory=memory
                )
            for name, (_, nbytes) in layouts.items():
                if name in filed:
                    continue
                start, end = shard_span(name, nbytes, sharding) or (0, nbytes)
                # From the module, each pack is pinned in commit once filled (see [Note: exact pinning]).
                buffers[name] = memory.alloc(name, end - start, pin=name in read)
            if reader is not None:
                for name, pack in specs.items():
                    if name in filed or name not in read:
                        continue
                    pieces, nbytes = layouts[name]
                    span = shard_span(name, nbytes, sharding)
                    read_pack(reader, pack, pieces, resolved[name], span, host=buffers[name])
                    if progress is not None:
                        progress(buffers[name].numel(), total)
                for spec, live, filled in zip(loose, loose_live, loose_read, strict=True):
                    loose_values.append(read_loose(reader, spec, live) if filled else None)
        except BaseException:
            if files is not None:
                files.close()
            memory.close()
            raise
        return Prepared(
            pipeline=pipeline, plan=plan, sharding=sharding, specs=specs, live=resolved, layouts=layouts,
            buffers=buffers, filled=frozenset(read - filed), memory=memory, tier=files,
            loose=list(zip(loose_live, loose_values, strict=True)) if reader is not None else [],
            progress=None if len(read) == len(specs) or progress is None else (progress, total),
            wrappers={k: v for k, v in wrappers.items() if v},
        )

    def bind(self) -> None:
        """Dock every pack that can be docked from now on, rather than re-point its tensors (a session
        whose device is the CPU: see [Note: docking] in `torchferry.runtime.memory._pack`)."""
        for pack in self.packs.values():
            pack.bind()

    def reset(self) -> None:
        """Point every tensor back at host memory (error recovery; host bytes are never lost)."""
        for pack in self.packs.values():
            pack.to_host()
            pack.forget_device()

    def close(self, *, broken: bool = False) -> None:
        """Give every tensor ordinary storage of its own again, bit-identical, strides kept.

        Pack by pack, each host buffer dropped as soon as its tensors have their own copies, so closing peaks
        at the host store plus one pack; each buffer is unpinned and unmapped as it goes, so its memory goes
        back to the OS (nothing stays cached). Sharded packs cannot be given back without their peers' shards:
        they keep their placeholders and stay in ``packs`` (host shards are never dropped) until
        `Pack.unshard` gives them their full bytes and `give_back` or `close` runs again (a file-tier one
        needs no peer: `unshard_from_file`). A pack that fails to give its tensors back does not stop the
        others: the first failure is raised once every pack has been tried. ``broken``: see `FileTier.close`.
        """
        failure: Exception | None = None
        for name in list(self.packs):
            pack = self.packs[name]
            try:
                if pack.shard is not None and pack.in_file:
                    self.unshard_from_file(pack)
                if pack.shard is None:
                    self.give_back(pack)
                else:
                    pack.to_host()
                    pack.forget_device()
            except Exception as exc:
                failure = failure or exc
        self.units.clear()
        if self.tier is not None:
            self.tier.close(broken=broken)
        if failure is not None:
            raise failure

    def unshard_from_file(self, pack: Pack) -> None:
        """Point sharded file-tier ``pack`` at views of the whole pack in the file (every rank has it)."""
        assert self.tier is not None and pack.in_file
        pack.to_host()
        pack.forget_device()
        pack.host_views = self.tier.host_views(pack.name, pack.pieces)
        pack.shard = None
        pack.point(pack.host_views)

    def give_back(self, pack: Pack) -> None:
        """Give ``pack``'s tensors storage of their own and drop the pack (it must hold full bytes)."""
        pack.to_host()
        pack.forget_device()
        if pack.in_file:  # its tensors keep pointing at the file's views (see [Note: the file tier])
            pack.host_views = pack.tensors  # no second tensor object on their storage (as below)
            del self.packs[pack.name]
            self.layouts.given_back(pack.name)
            return
        fresh = []
        for piece, view in zip(pack.pieces, pack.host_views, strict=True):
            t = torch.empty_strided(piece.shape, piece.stride, dtype=piece.given or piece.dtype)
            t.copy_(view)
            fresh.append(t)
        bound = pack.bound
        if bound is None:
            pack.point(fresh)
        else:
            # A weight a user gave another tensor its host copy cannot take (another shape, dtype or
            # device: close adopts the rest) keeps it, as in a plain run: its pack docks, so no step
            # re-pointed it (rule 2 of [Note: the session contract]).
            mine = bound._cdata
            given = [t.untyped_storage()._cdata != mine for t in pack.tensors]
            pack.point([t.data if g else f for t, f, g in zip(pack.tensors, fresh, given, strict=True)])
        pack.unbind()
        # Each tensor is its own host view now: no second tensor object is left on its storage (one
        # would read as a view taken elsewhere when a session opens on the pipeline again).
        pack.host_views = pack.tensors
        pack.host = torch.empty(0, dtype=torch.uint8)
        del self.packs[pack.name]
        self.memory.release(pack.name)
        self.layouts.given_back(pack.name)


@attrs.define(eq=False)
class Prepared:
    """A checked (and, from a checkpoint, fully read) host store whose `commit` takes the pipeline over."""

    pipeline: Any
    plan: Plan
    sharding: Sharding | None
    specs: dict[str, list[TensorSpec]]
    live: dict[str, list[torch.Tensor | None]]
    layouts: dict[str, tuple[tuple[Piece, ...], int]]
    #: Every pack's buffer, allocated (and pinned) already; those in ``filled`` read from the checkpoint.
    buffers: dict[str, torch.Tensor]
    filled: frozenset[str]
    memory: HostMemory
    loose: list[tuple[torch.Tensor | None, torch.Tensor | None]]
    #: Told of each group `commit` fills from the module, with the bytes of all groups.
    progress: tuple[Callable[[int, int], None], int] | None = None
    #: Per pack holding inner tensors of wrapper tensors, those wrappers (`find_wrappers`).
    wrappers: dict[str, list[torch.Tensor]] = attrs.field(factory=dict)
    #: The file tier, laid out (reads planned, views made, staging slots allocated), or ``None``.
    tier: FileTier | None = None

    def discard(self) -> None:
        """Give up this store without taking the pipeline over: unpin and free every buffer."""
        self.buffers = {}
        if self.tier is not None:
            self.tier.close()
        self.memory.close()

    def commit(self) -> HostStore:
        """Re-point the pipeline's tensors at the host buffers (copying the module's bytes in if no
        checkpoint was read); the only step that mutates the pipeline, and it cannot fail."""
        packs: dict[str, Pack] = {}
        members = {}
        for name, tensors in self.live.items():
            specs = [spec for spec, _ in pack_specs(self.specs[name])]
            ordered = list(in_pack_order(self.specs[name], tensors))
            members[name] = aliased(self.pipeline, specs, ordered, self.layouts[name][0])
        layouts = Layouts.take({name: tensors for name, (tensors, _) in members.items()})
        # Why: inner tensors of wrapper parameters are plain tensors, yet no forward writes them in place.
        inner = holders([w for group in self.wrappers.values() for w in group])
        for name in self.live:
            nbytes = self.layouts[name][1]
            ordered, pieces = members[name]
            span = shard_span(name, nbytes, self.sharding)
            filed = self.tier is not None and name in self.tier.reads
            host = self.buffers.get(name, _EMPTY)
            if name not in self.filled and not filed:
                fill_from_module(ordered, pieces, nbytes, span, host)
                if self.progress is not None:
                    self.progress[0](host.numel(), self.progress[1])
            for t in ordered:
                if t.is_meta:
                    materialise(t)
                elif t.is_inference():
                    make_ordinary(t)
            if span is None and filed:
                assert self.tier is not None
                views = self.tier.host_views(name, pieces)
            elif span is None:
                views = tuple(p.view(host) for p in pieces)
            else:
                views = tuple(torch.empty(0, dtype=p.dtype) for p in pieces)
            with torch.no_grad():
                for t, v in zip(ordered, views, strict=True):
                    t.data = v
            if name not in self.filled and not filed:
                # The module's own copy of this pack is dropped now: pinning here, not in prepare,
                # keeps the open near the model plus one pack (a refusal falls back, never raises).
                self.memory.pin(name)
            packs[name] = Pack(
                name=name,
                tensors=tuple(ordered),
                pieces=tuple(pieces),
                nbytes=nbytes,
                host=host,
                host_views=views,
                shard=span,
                buffers=tuple(
                    i for i, t in enumerate(ordered) if not isinstance(t, nn.Parameter) and id(t) not in inner
                ),
                wrappers=tuple(on_host(w) for w in self.wrappers.get(name, ())),
                in_file=filed,
            )
        for live, value in self.loose:
            if live is None or value is None:
                continue
            if live.is_meta:
                materialise(live)
            with torch.no_grad():
                live.data = value
        self.buffers = {}
        units = _units(self.plan, packs, self.pipeline)
        store = HostStore(packs, units, self.memory)
        store.layouts = layouts
        store.tier = self.tier
        return store


_EMPTY = torch.empty(0, dtype=torch.uint8)


def _loose_specs(plan: Plan, specs: Mapping[str, Sequence[TensorSpec]]) -> list[TensorSpec]:
    """Tensors of the topology no pack holds (on-demand components'): filled in place from a checkpoint."""
    covered = {s.name for specs_ in specs.values() for s in specs_}
    return [s for c in plan.topology.components for s in c.all_tensors() if s.name not in covered]


def _top(plan: Plan, name: str) -> str:
    """The top-level component of the plan whose tensor ``name`` is (``""`` for a bare model)."""
    best = ""
    for c in plan.components:
        if c.path and (name == c.path or name.startswith(c.path + ".")) and len(c.path) > len(best):
            best = c.path
    return best


def _span_bytes(name: str, nbytes: int, sharding: Sharding | None) -> int:
    span = shard_span(name, nbytes, sharding)
    return nbytes if span is None else span[1] - span[0]


def _units(plan: Plan, packs: dict[str, Pack], pipeline: Any) -> dict[str, Unit]:
    units: dict[str, Unit] = {}
    for top in plan.components:
        for c in top.walk():
            for name in [rest_unit(c.path), *(b.path for b in c.blocks)]:
                units[name] = Unit(name=name, packs=_pick(packs, [name]), component=top.path)
            inner = [rest_unit(d.path) for d in c.walk()] + [b.path for d in c.walk() for b in d.blocks]
            if c is top:
                inner.append(f"{top.path}:extra")
            units[c.path] = Unit(
                name=c.path,
                packs=_pick(packs, inner),
                component=top.path,
                module=find_attr(pipeline, c.path),
            )
    return units


def _pick(packs: dict[str, Pack], names: Iterable[str]) -> tuple[Pack, ...]:
    return tuple(packs[n] for n in names if n in packs)
