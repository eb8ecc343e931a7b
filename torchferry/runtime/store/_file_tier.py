"""The file tier of one session: packs with no host buffer, read on demand from the checkpoint into
staging slots, and pointing at read-only views of the checkpoint between their uses.

[Note: the file tier]
`policies.tiers` names the units whose packs stay in the checkpoint (`Schedule.file`); the host store
gives them no buffer. Between uses their tensors point at views of the checkpoint's files
(`FileViews`: a private mapping, file-backed pages, so reading the weights between calls is right
and costs no anonymous memory); a non-persistent buffer, which no checkpoint holds, keeps a small
copy of the module's bytes instead. A ``read`` op submits the pack to the `FileReader` into a
staging slot (a pinned host buffer allocated once, `Slot(kind="staging")`); the ``load`` or
``stage`` ``from`` that slot waits for the read on the host (the reader threads stand in for the
schedule's ``io`` stream), copies the slot to the device on the copy stream and records the slot's
drain (``free``), which the next read into the slot waits for before it writes a byte. A unit of
several packs (a whole component staged) is read and staged one pack at a time through its slot.
On a CPU device (`policies.reads_direct`) the device's slots are host memory and there is no staging
slot: a ``load`` or ``stage`` ``from file`` has the reader fill the device slot itself (`read_into`,
through `StreamContext.fill`) and returns; the block's ``wait`` waits for the read, so the reads of
the blocks ahead run while the blocks before compute, as reads into staging slots do. A slot is
filled again only once its last read is in (the evict of a unit never waited for waits for it).

Nothing a read does touches the host store or the files, so a failed read loses no weight: its
`ExecutionError` reaches the step, which aborts as any failed step does, and the session closes.
The in-place edits a host copy would take cannot be kept here (the next read brings the file's
bytes back): an edit of a file-tier tensor is refused at the next step start by the session guard,
and ``close()`` leaves the tensors pointing at the file views, bit-identical, row-major.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from torchferry import policies
from torchferry._errors import ExecutionError, PlanError
from torchferry.policies import Schedule, Tiers, unit_packs
from torchferry.runtime.device import DeviceBuffer
from torchferry.runtime.files import CheckpointReader, FileReader, PackRead, Ticket
from torchferry.runtime.machine import READ_MODE_ENV
from torchferry.runtime.memory import (
    HostMemory,
    Pack,
    Piece,
    Sharding,
    contiguous_strides,
    page_bytes,
    shard_span,
)
from torchferry.topology import Plan, TensorSpec
from torchferry.topology import pack as pack_specs

__all__ = [
    "FileTier",
    "TierLayout",
    "TierRequest",
    "read_direct",
    "tier_request",
]

#: Reads straight into device memory kept in `FileTier.direct` before the finished ones are dropped.
_DIRECT_KEPT = 16

#: A failure `check` makes unreachable ([9]: file-tier reads and staging slots) is not the caller's.
_MISSED = "a torchferry bug, or a custom policy that check missed ([9])"


def read_direct(file_bytes: int, cache_bytes: int | None, mode: str | None = None) -> bool:
    """Whether the file tier reads with ``O_DIRECT`` (`policies.read_direct`, the decision), in the
    read mode the session's facts hold (``None``, an engine opened without them: `READ_MODE_ENV`)."""
    if mode is None:
        mode = os.environ.get(READ_MODE_ENV, "auto").strip().lower()
    return policies.read_direct(file_bytes, cache_bytes, mode)


@attrs.frozen(kw_only=True)
class TierLayout:
    """The file tier a session lays out, as decided before it opened (`TierLayout.of` the open
    plan's tiers, or `from_schedule` for one schedule run alone): the packs in it and the staging
    slots (name, bytes), where it is read from (``None``: the plan's checkpoint; else a spill folder
    written for it), what the page cache can keep (``None``: unknown) and the read mode the facts
    hold (``None``: read `READ_MODE_ENV` at open). The default is no file tier."""

    packs: frozenset[str] = frozenset()
    staging: tuple[tuple[str, int], ...] = ()
    cache_bytes: int | None = None
    source: str | None = None
    read_mode: str | None = None

    @classmethod
    def of(cls, chosen: Tiers, **options: Any) -> TierLayout:
        """The layout of the tiers the open planner chose (`policies.Tiers`)."""
        return cls(packs=chosen.file, staging=tuple((s.name, s.nbytes) for s in chosen.staging), **options)

    @classmethod
    def from_schedule(cls, schedule: Schedule) -> TierLayout:
        """The file tier ``schedule`` names (`Schedule.file`, its staging slots): what an engine built for
        that schedule alone lays out (`execute`)."""
        staging = tuple((s.name, s.nbytes) for s in schedule.slots if s.kind == "staging")
        return cls(packs=frozenset(schedule.file), staging=staging)


@attrs.frozen(kw_only=True)
class TierRequest:
    """What the host store needs to lay out a file tier: the pack names in it, the staging slots
    (name, bytes), the checkpoint its bytes are read from (kept open for the session), and what the
    page cache can keep (``None``: unknown) for choosing direct I/O."""

    packs: frozenset[str]
    staging: tuple[tuple[str, int], ...]
    source: CheckpointReader
    cache_bytes: int | None = None
    prefix_map: Mapping[str, str] | None = None
    #: The session's device: reader threads make it current before waiting on its events.
    device: torch.device | None = None
    #: The read mode (`TierLayout.read_mode`).
    read_mode: str | None = None
    #: The largest pack the tier reads (`policies.Tiers.largest`): sizes the reader's bounce buffers
    #: when there is no staging slot to size them by (the reader fills device slots itself).
    largest: int = 0


def tier_request(
    plan: Plan,
    layout: TierLayout | None,
    checkpoint: CheckpointReader | None,
    opened: list[CheckpointReader],
    prefix_map: Mapping[str, str] | None,
    *,
    from_module: frozenset[str] = frozenset(),
    device: torch.device | None = None,
) -> TierRequest | None:
    """The host store's file tier for ``plan`` as ``layout`` names it (``None``, or no packs: no file
    tier): read from ``layout.source`` when it names a spill (a reader opened for it is appended to
    ``opened``), else from ``checkpoint``. A layout the open planner could not have made (file-tier
    packs with nothing to read them from, or of a component that keeps its own weights,
    ``from_module``: `policies.needs_source` and `policies.unfiled` keep both out) is an
    `ExecutionError` saying so, raised before anything is read."""
    layout = layout or TierLayout()
    packs = layout.packs
    if not packs:
        return None
    # The read buffers are sized by the staging slots, or with none (the reader fills device slots
    # itself) by the largest file-tier pack, as `policies.tiers` counts them.
    largest = policies.read_size(plan, packs, (n for _, n in layout.staging))
    source = checkpoint
    if layout.source is not None:
        source = CheckpointReader(layout.source)
        opened.append(source)
        prefix_map = None
    kept = () if layout.source is not None else from_module  # a spill holds their bytes too
    own = [n for top in plan.components if top.path in kept for n in unit_packs(plan, top.path) if n in packs]
    if source is None or own:
        shown = sorted(own or packs, key=_natural)
        listed = ", ".join(shown[:3]) + (", ..." if len(shown) > 3 else "")
        what = (
            "nothing to read them from (no checkpoint nor spill)"
            if source is None
            else "their components keep their own weights, which are not the checkpoint's"
        )
        raise ExecutionError(
            f"the file tier names {len(shown)} pack(s) ({listed}) and {what}: a torchferry bug, or a "
            "TierLayout that policies.open_plan did not decide (it refuses both: needs_source, unfiled); "
            "lay the file tier out from the open plan's tiers"
        )
    return TierRequest(
        packs=frozenset(packs),
        staging=layout.staging,
        source=source,
        cache_bytes=layout.cache_bytes,
        prefix_map=prefix_map,
        device=device,
        read_mode=layout.read_mode,
        largest=largest,
    )


def _natural(name: str) -> list[object]:
    """Sort key: numbers in names compare as numbers (``blocks.2`` before ``blocks.10``)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


@attrs.define(eq=False)
class _Staging:
    """One staging slot: its pinned buffer (with the events of its last drain), and the read in it."""

    buffer: DeviceBuffer
    pack: Pack | None = None
    ticket: Ticket | None = None


class FileTier:
    """The file-tier packs' reads and views, the staging slots and the reader (see [Note: the file tier])."""

    def __init__(
        self,
        *,
        source: CheckpointReader,
        reader: FileReader,
        reads: dict[str, PackRead],
        views: dict[str, dict[int, torch.Tensor]],
        memory: HostMemory,
        staging: dict[str, _Staging],
        kept: int,
    ) -> None:
        self.source = source
        self.reader = reader
        self.reads = reads
        #: Pack name -> piece offset -> the tensor its pieces point at between uses.
        self.views = views
        self.memory = memory
        self.staging = staging
        #: Bytes of the module's non-persistent buffers kept for file-tier packs.
        self.kept_bytes = kept
        #: Reads given up while the weight-shard group was broken (`settle` with ``wait=False``).
        self.abandoned: list[Ticket] = []
        #: Reads straight into device memory (`read_into`) not yet seen finished: an abort or a close
        #: waits for them (`settle`) before the slots they write are used again or freed.
        self.direct: list[Ticket] = []

    @property
    def packs(self) -> frozenset[str]:
        return frozenset(self.reads)

    @property
    def host_bytes(self) -> int:
        """Host memory the tier holds: staging slots, bounce and scratch buffers (whole pages), kept
        buffers."""
        staging = sum(page_bytes(s.buffer.data.numel()) for s in self.staging.values())
        return staging + self.reader.bounce_bytes + self.reader.scratch_bytes + self.kept_bytes

    @classmethod
    def prepare(
        cls,
        request: TierRequest,
        *,
        specs: Mapping[str, Sequence[TensorSpec]],
        layouts: Mapping[str, tuple[tuple[Piece, ...], int]],
        live: Mapping[str, Sequence[torch.Tensor | None]],
        sharding: Sharding | None,
        memory: HostMemory,
    ) -> FileTier:
        """Plan every file-tier pack's read, make its views and allocate the staging slots; nothing of
        the pipeline is touched. A tensor that cannot be viewed in place is a `PlanError`."""
        source = request.source
        names = [n for n in specs if n in request.packs]
        files = {
            e.file
            for n in names
            for s in specs[n]
            if (e := source.entries.get(source.key(s.name, request.prefix_map))) is not None
        }
        file_bytes = sum(os.path.getsize(f) for f in files)
        direct = source.files if read_direct(file_bytes, request.cache_bytes, request.read_mode) else ()
        largest = max((n for _, n in request.staging), default=0) or request.largest
        reader = FileReader(
            source, direct=[f for f in direct if f in files], device=request.device,
            bounce_bytes=policies.bounce_bytes(largest), bounces=policies.bounce_count(largest),
        )  # fmt: skip
        try:
            reads: dict[str, PackRead] = {}
            views: dict[str, dict[int, torch.Tensor]] = {}
            kept = 0
            for name in names:
                pieces, nbytes = layouts[name]
                layout = pack_specs(specs[name])
                tensors = {s.name: t for s, t in zip(specs[name], live[name], strict=True)}
                module: dict[str, torch.Tensor] = {}
                widened = {
                    w.name: w.source
                    for w in source.spans(layout, 0, nbytes, request.prefix_map)
                    if w.source is not None
                }
                for (spec, _), piece in zip(layout, pieces, strict=True):
                    if spec.buffer and not spec.persistent:
                        t = tensors[spec.name]
                        assert t is not None
                        module[spec.name] = piece.arranged(t.detach())
                        kept += page_bytes(piece.nbytes)
                    elif spec.name in widened:  # a 16-bit float the module keeps in float32: kept widened
                        rows = widened[spec.name].view(piece.dtype).view(piece.shape)
                        module[spec.name] = piece.arranged(rows)
                        kept += page_bytes(piece.nbytes)
                span = shard_span(name, nbytes, sharding)
                reads[name] = reader.plan(
                    name,
                    layout=layout,
                    pieces=pieces,
                    span=span,
                    module_bytes=module,
                    prefix_map=request.prefix_map,
                )
                views[name] = _views(reader, layout, pieces, module, request.prefix_map)
            reader.reserve(list(reads.values()))
            staging: dict[str, _Staging] = {}
            need = max((r.nbytes for r in reads.values()), default=0)
            for slot, nbytes in request.staging:
                if nbytes < need:
                    raise PlanError(
                        f"staging slot {slot} holds {nbytes} bytes but the largest file-tier read is {need}; "
                        "the schedule's staging slots must fit every file-tier pack"
                    )
                data = memory.alloc(f"staging {slot}", nbytes)
                staging[slot] = _Staging(DeviceBuffer(data=data))
        except BaseException:
            reader.close()
            raise
        return cls(
            source=source, reader=reader, reads=reads, views=views, memory=memory, staging=staging, kept=kept
        )

    def host_views(self, name: str, pieces: Sequence[Piece]) -> tuple[torch.Tensor, ...]:
        """Pack ``name``'s tensors between uses, one per piece (aliases share their owner's)."""
        views = self.views[name]
        return tuple(views[p.offset] if p.nbytes else _empty(p) for p in pieces)

    # -------------------------------------------------------------------------------- reading
    def slot(self, name: str) -> _Staging:
        staging = self.staging.get(name)
        if staging is None:
            raise ExecutionError(
                f"staging slot {name} is not one of this session's ({', '.join(self.staging) or 'none'}); "
                f"every schedule of a session must use the staging slots its plan's tiers name: {_MISSED}"
            )
        return staging

    def issue(self, pack: Pack, slot: str, before: Any) -> None:
        """Start reading ``pack`` into staging slot ``slot``; the reader threads first call ``before``."""
        read = self.reads.get(pack.name)
        if read is None:
            raise ExecutionError(
                f"read of {pack.name}: it is not in this session's file tier (its bytes are in host "
                f"memory): {_MISSED}"
            )
        staging = self.slot(slot)
        if staging.ticket is not None and staging.pack is not pack:
            raise ExecutionError(
                f"read of {pack.name} into staging slot {slot}, which still holds the read of "
                f"{staging.pack.name if staging.pack is not None else 'another pack'} that no load took: "
                f"{_MISSED}"
            )
        if staging.ticket is not None:
            # The same pack read again before a load took the first read: that read finishes (or
            # raises its error here) before the second one writes the slot.
            ticket, staging.ticket, staging.pack = staging.ticket, None, None
            ticket.wait()
        staging.pack, staging.ticket = pack, self.reader.submit(read, staging.buffer.data, before)

    def read_into(self, pack: Pack, into: torch.Tensor) -> Ticket:
        """Start reading ``pack`` straight into ``into`` (its place in a device slot whose memory is
        host memory: no staging slot between); its ticket, which the block's wait waits for (and
        `settle`, when the step is abandoned first)."""
        read = self.reads.get(pack.name)
        if read is None:
            raise ExecutionError(
                f"read of {pack.name}: it is not in this session's file tier (its bytes are in host memory)"
            )
        if len(self.direct) >= _DIRECT_KEPT:  # now and then, not per read: the hot path of a step
            self.direct = [t for t in self.direct if not t.done]
        ticket = self.reader.submit(read, into)
        self.direct.append(ticket)
        return ticket

    def take(self, pack: Pack, slot: str) -> tuple[DeviceBuffer, torch.Tensor]:
        """Wait for ``pack``'s read into ``slot``; its buffer and the bytes read (raises the read's error)."""
        staging = self.slot(slot)
        ticket = staging.ticket
        if ticket is None or staging.pack is not pack:
            held = "nothing" if staging.pack is None else f"the read of {staging.pack.name}"
            raise ExecutionError(
                f"load of {pack.name} from staging slot {slot}, which holds {held}; read it first: {_MISSED}"
            )
        staging.pack = staging.ticket = None
        ticket.wait()
        return staging.buffer, staging.buffer.data.narrow(0, 0, ticket.read.nbytes)

    def settle(self, *, wait: bool = True) -> None:
        """Wait for every read in flight, into a staging slot or straight into device memory, and
        forget it (a step aborted: the slots are free again).

        ``wait=False`` (the weight-shard group is broken): a read may be blocked for good on the drain
        of a copy queued behind a collective that never completes, so nothing is waited for; reads
        not yet started are cancelled, and those running are left to `abandoned`.
        """
        tickets = [staging.ticket for staging in self.staging.values()] + self.direct
        for staging in self.staging.values():
            staging.ticket = staging.pack = None
        self.direct = []
        for ticket in tickets:
            if ticket is None:
                continue
            if not wait:
                for future in ticket.futures:
                    future.cancel()
                self.abandoned.append(ticket)
                continue
            # The step that issued it failed or was dropped: nothing reads these bytes.
            with contextlib.suppress(ExecutionError):
                ticket.wait()

    def close(self, *, broken: bool = False) -> None:
        """Wait for reads in flight, stop the reader, free the staging slots and close the source;
        the views stay (their mappings hold the files).

        ``broken`` (a collective of the weight-shard group failed): a copy from a staging slot may
        still be queued on the device, behind the collective, so the slots stay mapped and pinned
        for the life of the process (`_KEPT`), as the engine keeps its device slots then; nothing is
        waited for, and while an abandoned read still runs the reader and the source stay open too.
        """
        self.settle(wait=not broken)
        if broken:
            _KEPT.extend(self.staging.values())
            if not all(t.done for t in self.abandoned):
                return
        self.reader.close()
        if not broken:
            for slot in self.staging:
                self.memory.release(f"staging {slot}")
            self.staging.clear()
        self.kept_bytes = 0  # the kept buffers are the given-back tensors' own memory now
        # The tensors given back keep their views; no other tensor object may stay on those storages
        # (one would read as a view taken elsewhere when a session opens on the pipeline again).
        self.views.clear()
        self.reads = {n: attrs.evolve(r, fixups=()) for n, r in self.reads.items()}  # kept buffers' bytes
        self.source.close()


#: Staging slots of file tiers closed while their weight-shard group was broken: they stay mapped and
#: registered (a copy queued on the device may still read them), so nothing here is ever dropped.
_KEPT: list[_Staging] = []


def _empty(piece: Piece) -> torch.Tensor:
    """A tensor of no elements in ``piece``'s shape, dtype and strides (a file holds no bytes of it)."""
    return torch.empty_strided(piece.shape, piece.stride, dtype=piece.dtype)


def _views(
    reader: FileReader,
    layout: Sequence[tuple[TensorSpec, int]],
    pieces: Sequence[Piece],
    module: Mapping[str, torch.Tensor],
    prefix_map: Mapping[str, str] | None,
) -> dict[int, torch.Tensor]:
    """Each piece's tensor between uses: a row-major view of the file, or the kept module bytes."""
    nbytes = max((off + s.nbytes for s, off in layout), default=0)
    where = {s.name: s for s in reader.checkpoint.spans(layout, 0, nbytes, prefix_map)}
    out: dict[int, torch.Tensor] = {}
    for (spec, _), piece in zip(layout, pieces, strict=True):
        if piece.nbytes == 0:  # no bytes in any file, and its offset may be the next tensor's
            continue
        if spec.name in module:
            out[piece.offset] = piece.view(module[spec.name], 0)
            continue
        span = where[spec.name]
        assert span.file is not None
        rows = attrs.evolve(piece, stride=contiguous_strides(piece.shape))
        out[piece.offset] = reader.views.view(span.file, span.src, rows, spec.name)
    return out
