"""A pack: the tensors that move together, each one's place in their flat buffer, and where they point now.

A *pack* is the set of tensors that always move together: one block, one component's non-block
remainder, or what is left of a component that the plan does not split. Its flat ``uint8`` buffer is
laid out by `topology.pack` (every tensor on a 256-byte boundary; the buffer is exactly the
topology's byte count; each tensor's place is a `Piece`), and its tensors are re-pointed
(``tensor.data = view``) between views into that buffer and into device slots. Re-pointing keeps each
tensor object, so tied weights (one object under several names) stay tied. A `Unit` is what a
schedule names: a block, ``<component>:rest`` or a whole component, with its packs.

[Note: why tensors are re-pointed]
A block reaches its slot once per step, so how its modules are made to read the slot is the hot
path: each tensor is re-pointed (``tensor.data = view``) at the wait and back at the evict, 2 x 27
assignments per step for a block of a Wan transformer, about 0.13 us each in a tight loop and 0.3 us
in a live forward (`Pack.point` maps the setter over the tensors in C: no Python loop step per
tensor). Swapping each module's ``_parameters``/``_buffers`` dict for a cached one holding
parameters over slot views ("binding", 16 dict assignments each way) was built and measured: it cut
torchferry's own code per block from 43 to 20 us on benchmarks/overhead.py, and was taken out again,
because it gives every weight a second identity during a step. A reference taken during a forward
(a hook or a module keeping ``self.weight``) then pointed into a slot: it read another block's
bytes after the evict, and crashed the process once the slot was freed; a tensor a forward assigns
(``self.count = self.count + 1``) or registers landed in the cached dict and was lost; table edits
between steps (``bias = None``, ``register_parameter``, ``functional_call``) were ignored; a
weight's own attributes and ``requires_grad_`` changes were not seen, and a backward inside a no-grad
forward gave its gradient to the stand-in. Each can be checked for, at about the cost binding saved.
tests/runtime/test_weights_hostile.py keeps those cases, all exact with re-pointing. Binding each
block to its ring slot once for the session (a fixed ring puts block i in slot i mod R), so a load
is only the copy and an evict nothing, fails the same cases and one more: between steps a weight
must read its own values (the contract's rule 2 adopts edits made then), and R slots cannot hold
them. Where host and slot memory are one kind of device (a CPU session), a pack is *docked*
instead (see [Note: docking]); on CUDA a CPU tensor cannot read device memory, so each tensor is
re-pointed as above. The tensors
move at the wait, not at the load: until compute is ordered after the copy they read the host copy,
so nothing that reads them then (a hook, a tied weight, the caller between steps) races the copy
stream on a GPU; an in-place write to them meanwhile is caught at the wait, which copies again
(`Pack.carry`: a pack's buffers from its load on, all its tensors from its load on once the engine
bumped their versions, which hides a write from the session guard, and all of them once a step ends
with it in flight; `Pack.recopy`: a write the guard finds at the step's end). An all-gathered
block in flight points at its empty placeholders: a write then raises at the wait.

[Note: docking]
On a CPU session every tensor of a pack views one storage, the host buffer's own (``bound``), and
moving the pack is one call instead of one per tensor: at the wait the data pointer of ``bound`` is
exchanged with that of a storage over the pack's bytes in its slot (``torch.UntypedStorage.
_swap_data_ptr_``, about 0.1-0.25 us; `arrive`), and at the evict exchanged back (`to_host`): on
benchmarks/overhead.py the two moves of a Wan block cost 4-6 us against 34-48 us re-pointed. Each
tensor keeps its object, storage, offset and strides; only the memory under the storage changes, so
a view of a weight anyone took (a hook's, autograd's) follows it too, and no weight gets a second
identity (what took binding out, above). A pack that is not docked points at its host memory, so a
read of an evicted block's weights (a hook of another block, the caller between steps) sees its true
values, as re-pointing gives. The host copy itself (``host``, ``host_views``: what loads copy from
and edits are written back to) is a second storage over the same memory that never moves;
``rest_views`` are the tensors' own views of ``bound``, which `point` takes them back to after a
copy re-pointed them. A staged copy docks too (`dock`), so no op of a step ever re-points a tensor
of a pack that docks (what lets the session guard leave their pointers alone at step starts: rule 2
of [Note: the session contract]). The storage over the slot holds no memory of its own
(`_storage_at`): while the pack is docked it holds the host memory, whose owner it is then, and the
engine never frees a slot a unit occupies; a slot whose memory moved (freed and grown again) is
found at the next load, by the count of its regrowths (`DeviceBuffer.grown`). A pack dropped while
docked (a step interrupted, then its session and pipeline dropped without close()) undocks as it
goes, so a weight kept elsewhere holds the host memory, never a freed slot. Docking leaves the
pack's ``moves`` alone (the tensors point where they did: the session guard reads no pointer of a
pack that docks). The three moves of a pack that docks are functions of the pack and one argument
(`load_docked`, `land`, `lift`); at their core each is one C call on memory (a copy from ``source``,
``bound``'s bytes, into the slot; an exchange, `SWAP`, of ``bound`` with the slot's storage), so a
steady step can be replayed as a list of those calls (`Replay` in `torchferry.runtime.executor`).
The record of where a pack is (``where``, ``docked``, ``arriving``) may lag its memory (a replayed
step writes it only where it hands over; CPython handles a signal as a C call returns, between an
exchange and its record), so what must be right whatever happened, undocking at `to_host` (every
recovery goes through it) and as a dropped pack goes, reads it from memory: ``bound`` away from the
host memory is docked at whichever of its storages holds that memory (`_holder`). File-tier and
sharded packs, and every pack of a CUDA session, are not bound.

[Note: sharded packs]
Under the distributed strategy each rank keeps only its shard of an all-gathered block: bytes
``[rank * shard, (rank + 1) * shard)`` of the block's packed buffer, zero-padded past the block's end
(``shard = policies.shard_nbytes(block, world)``); from a checkpoint only those bytes are read.
Outside a step the tensors of a sharded pack are placeholders of shape ``(0,)`` (this rank has no
full copy to point them at): running a block that is not resident is an `ExecutionError`, and
reading its weights directly shows empty tensors. They point into a device slot while the block is
resident, and the session's ``close(gather=True)`` re-assembles full host copies (a collective).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from torchferry.policies import shard_nbytes
from torchferry.runtime.device import DeviceBuffer
from torchferry.runtime.memory._layouts import dense
from torchferry.runtime.memory._wrappers import Wrapper

__all__ = [
    "Pack",
    "PackState",
    "Piece",
    "Sharding",
    "Unit",
    "contiguous_strides",
    "dense_strides",
    "shard_span",
    "views_into",
]


#: What a load leaves for its wait: the views the tensors take (re-pointing), or the storage over the
#: slot's bytes that their storage exchanges memory with (docking, see [Note: docking]).
Arriving = tuple[torch.Tensor, ...] | torch.UntypedStorage


class PackState(enum.Enum):
    """Where a pack's bytes are: host memory only, also a device copy still in flight, or a ready
    device copy. Its tensors point at the device copy only when it is ready (see `Pack.point`)."""

    #: At its host buffer (between steps, and after an evict or unstage).
    HOST = "in host memory"
    #: A load or gather has issued the device copy but no wait has ordered compute after it yet: the
    #: tensors still point at the host buffer (a read of them on any stream does not race the copy).
    IN_FLIGHT = "still in flight (loaded but never waited for)"
    #: At device bytes compute may read (waited for, or staged).
    READY = "ready"


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides: list[int] = []
    expected = 1
    for size in reversed(shape):
        strides.insert(0, expected)
        expected *= size
    return tuple(strides)


def dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides if its elements fill a gap-free range of memory, else contiguous strides."""
    if t.is_contiguous() or not dense(t):
        return contiguous_strides(t.shape)
    return tuple(t.stride())


@attrs.define(slots=True, frozen=True)
class Piece:
    """Where one tensor sits in its group's flat buffer; ``given`` is the dtype close gives it back in
    when it is stored in another (a ``storage_dtype`` request), else ``None``."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    given: torch.dtype | None = None

    def view(self, flat: torch.Tensor, at: int | None = None) -> torch.Tensor:
        """This tensor's view into ``flat`` (a ``uint8`` buffer laid out like its pack), or at ``at``."""
        offset = self.offset if at is None else at
        return flat.narrow(0, offset, self.nbytes).view(self.dtype).as_strided(self.shape, self.stride)

    @property
    def row_major(self) -> bool:
        """Whether the bytes are in the row-major order checkpoints store."""
        return self.stride == contiguous_strides(self.shape)

    def arranged(self, source: torch.Tensor) -> torch.Tensor:
        """``source``'s values as this piece stores them: ``nbytes`` bytes in the piece's strides."""
        flat = torch.empty(self.nbytes, dtype=torch.uint8)
        self.view(flat, 0).copy_(source)
        return flat


def views_into(pieces: Sequence[Piece], flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each piece's view into ``flat`` (`Piece.view` of each), made with one ``as_strided`` per piece
    over one typed view of ``flat`` per dtype: a staged component's views are made at every stage."""
    typed: dict[torch.dtype, tuple[torch.Tensor, int, Any]] = {}
    for dtype in {p.dtype for p in pieces}:
        size = dtype.itemsize
        whole = flat.narrow(0, 0, flat.shape[0] - flat.shape[0] % size).view(dtype)
        typed[dtype] = (whole, size, whole.storage_offset())
    # A piece off its dtype's alignment (never in a packed layout: 256-byte places) takes the general way.
    return tuple(
        [
            p.view(flat) if p.offset % size else whole.as_strided(p.shape, p.stride, base + p.offset // size)
            for p in pieces
            for whole, size, base in (typed[p.dtype],)
        ]
    )


@attrs.frozen(kw_only=True)
class Sharding:
    """This rank's part of the weight-shard group: it keeps 1/``world`` of every group in ``names``."""

    rank: int
    world: int
    names: frozenset[str]


def shard_span(name: str, nbytes: int, sharding: Sharding | None) -> tuple[int, int] | None:
    """The byte range of pack ``name`` this rank keeps, or ``None`` when it keeps all of it."""
    if sharding is None or name not in sharding.names:
        return None
    shard = shard_nbytes(nbytes, sharding.world)
    return sharding.rank * shard, (sharding.rank + 1) * shard


@attrs.define(slots=True, eq=False, kw_only=True)
class Pack:
    """Tensors that move together, their host buffer, and where they point now.

    ``where`` is a `PackState`; ``device_views`` caches, per slot name, the byte range
    and tensor views into the slot's buffer last used, so a repeated load into a slot builds nothing;
    ``arriving`` holds the views a load or gather issued, which the tensors take at the wait.
    ``shard`` is the byte range ``[start, end)`` of the pack this rank holds when it holds
    only a shard (then ``host`` is those bytes and ``host_views`` are placeholders); else ``None``.
    ``moves`` changes whenever the pack's tensors are re-pointed (docking leaves it: the tensors
    keep their storage), and ``bumps`` counts version bumps the engine made
    (see `GradGuard`), so the session guard refreshes what it remembers of a pack only when they
    change: a block docked and undocked within a step costs it nothing.
    """

    # The fields read of every pack at a step's start and end come first, so they share the object's
    # first cache lines (`Replay.ready` and the session guard read them after a forward left them cold).
    where: PackState = PackState.HOST
    # Why: while docked, the slot's storage exchanged with ``bound`` (it holds the host memory now).
    docked: torch.UntypedStorage | None = None
    arriving: Arriving | None = None
    # Why: the engine bumped the pack's version counters since its last load (`keep_written`, the grad
    # guard), so the session guard re-reads them at the step's end and cannot tell an in-place edit
    # made after the next load from its own bump: that load watches every tensor (see `carry`).
    rewatch: bool = False
    #: The storage every tensor of the pack views when it is docked, not re-pointed ([Note: docking]).
    bound: torch.UntypedStorage | None = None
    #: While the pack's copy is in flight, the tensors watched for in-place writes (its buffers from
    #: the load on, all of them from the load on after `rewatch` and once a step ends): index ->
    #: version counter when the watch began, -1 for one known written (see `carry`, `recopy`).
    watched: dict[int, int] = attrs.field(factory=dict)
    #: ``bound``'s bytes as one tensor, wherever it is docked (a replayed load copies from it).
    source: torch.Tensor | None = None
    moves: int = 0
    bumps: int = 0
    name: str
    tensors: tuple[torch.Tensor, ...]
    pieces: tuple[Piece, ...]
    nbytes: int
    host: torch.Tensor
    host_views: tuple[torch.Tensor, ...]
    device_views: dict[str, tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]] = attrs.field(
        factory=dict
    )
    shard: tuple[int, int] | None = None
    #: The indices of the pack's buffers (not parameters): a forward may write them in place.
    buffers: tuple[int, ...] = ()
    # Why: the buffers' version counters when the pack reached the device (see `arrived`, `keep_written`).
    _arrival: tuple[int, ...] = ()
    # Why: per shard slot name, (the slot's buffer, this rank's shard bytes of it).
    shard_views: dict[str, tuple[torch.Tensor, torch.Tensor]] = attrs.field(factory=dict)
    #: The wrapper tensors whose inner tensors are among ``tensors``, inner ones first: each takes the
    #: device its inner tensors are pointed at (see [Note: wrapper tensors] in `_wrappers`).
    wrappers: tuple[Wrapper, ...] = ()
    #: The pack is in the file tier: no host buffer (``host`` is empty), ``host_views`` are views of
    #: the checkpoint, and its bytes reach the device through a staging slot (see `_tiers`).
    in_file: bool = False
    #: The views of ``bound`` the tensors take at host memory (``host_views`` when not bound).
    rest_views: tuple[torch.Tensor, ...] = ()
    # Why: per slot name, (the slot's buffer, its ``grown`` count, the pack's bytes of it, a storage
    # over them) (see `dock_at`).
    docks: dict[str, tuple[torch.Tensor, int, torch.Tensor, torch.UntypedStorage]] = attrs.field(factory=dict)

    @property
    def held_bytes(self) -> int:
        """Bytes of the pack this rank moves: its shard when it holds one, else all of it."""
        return self.nbytes if self.shard is None else self.shard[1] - self.shard[0]

    def shard_bytes(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        """The first bytes of ``flat`` (shard slot ``key``'s buffer) that hold this rank's shard of
        the pack, cached per slot while ``flat`` stays."""
        cached = self.shard_views.get(key)
        if cached is None or cached[0] is not flat:
            cached = (flat, flat.narrow(0, 0, self.held_bytes))
            self.shard_views[key] = cached
        return cached[1]

    def views(self, key: str, flat: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The group's bytes of ``flat`` and its tensors' views, cached per ``key`` while ``flat`` stays."""
        cached = self.device_views.get(key)
        if cached is not None and cached[0] is flat:
            return cached[1], cached[2]
        dst = flat.narrow(0, 0, self.nbytes)
        views = views_into(self.pieces, flat)
        self.device_views[key] = (flat, dst, views)
        return dst, views

    def bind(self) -> None:
        """Dock this pack from now on instead of re-pointing its tensors ([Note: docking]): its host
        copy becomes a storage of its own over the same memory, and its tensors keep the buffer's.
        A pack whose tensors do not all view its host buffer, whole, is left as it is."""
        host = self.host
        storage = host.untyped_storage()
        if (
            _SWAP is None
            or _FOREIGN is None
            or self.in_file
            or self.shard is not None
            or self.bound is not None
            or not self.tensors
            or host.device.type != "cpu"
            or host.storage_offset() != 0
            or storage.nbytes() != self.nbytes
            or any(t.untyped_storage()._cdata != storage._cdata for t in self.tensors)
        ):
            return
        alias = _storage_at(storage.data_ptr(), host.device, self.nbytes)
        copy = torch.empty(0, dtype=torch.uint8).set_(alias, 0, (self.nbytes,), (1,))
        self.rest_views = self.host_views
        self.source = host
        self.host = copy
        self.host_views = views_into(self.pieces, copy)
        self.bound = storage

    def dock_at(self, key: str, slot: DeviceBuffer) -> tuple[torch.Tensor, torch.UntypedStorage]:
        """The pack's bytes of slot ``key`` (its buffer ``slot``), and the storage over them that
        `arrive` docks, cached per slot while the slot's memory stays where it is (a slot freed and
        grown again may start elsewhere: its ``grown`` count is compared at every load)."""
        flat = slot.data
        cached = self.docks.get(key)
        if cached is None or cached[0] is not flat or cached[1] != slot.grown:
            at = flat.data_ptr()
            view = flat.narrow(0, 0, self.nbytes)
            cached = (flat, slot.grown, view, _storage_at(at, flat.device, self.nbytes))
            self.docks[key] = cached
        return cached[2], cached[3]

    def arrive(self) -> None:
        """The copy issued into a slot is waited for: the tensors take it (``arriving``)."""
        arriving = self.arriving
        if arriving is None:
            return
        self.arriving = None
        if isinstance(arriving, tuple):
            self.point(arriving)
            return
        if self.docked is not None:  # docked already: ``docked`` owns the host memory until undocked
            self._undock()
        _SWAP(self.bound, arriving)  # the tensors see the slot, ``arriving`` the host memory
        self.docked = arriving

    def dock(self, flat: torch.Tensor) -> None:
        """Dock the pack at ``flat``, a copy of its bytes on the device (a staged one), as `arrive`
        docks it at a slot: its tensors see ``flat``'s memory, not one re-pointed at a time."""
        if self.docked is not None:
            self._undock()
        self.arriving = _storage_at(flat.data_ptr(), flat.device, self.nbytes)
        self.arrive()

    def __del__(self) -> None:
        # A pack dropped while docked (a step interrupted, then its session and pipeline dropped
        # without close()) gives its storage the host memory back: a weight kept elsewhere then
        # owns memory that lives, not the slot's, which goes with the session. Where it is docked is
        # read from memory: a replayed step leaves the record behind, a signal may cut one short.
        with contextlib.suppress(Exception):
            holder = self._holder()
            if holder is not None:
                lift(self, holder)

    def _holder(self) -> torch.UntypedStorage | None:
        """The storage holding this pack's host memory while ``bound`` is docked elsewhere, found by
        address among those it docks at (``None`` when ``bound`` is at its host memory)."""
        bound = self.bound
        if bound is None or bound.data_ptr() == (at := self.host.data_ptr()):
            return None
        for storage in (self.docked, self.arriving, *(cached[3] for cached in self.docks.values())):
            if isinstance(storage, torch.UntypedStorage) and storage.data_ptr() == at:
                return storage
        return None

    def _undock(self) -> None:
        docked = self.docked
        assert docked is not None
        lift(self, docked)

    def point(self, views: Sequence[torch.Tensor]) -> None:
        """Re-point every tensor of the pack at ``views`` (all on one device, so it is checked once), and
        give its wrapper tensors that device."""
        if self.docked is not None:
            self._undock()
        tensors = self.tensors
        if len(views) != len(tensors):
            raise ValueError(f"pack {self.name}: {len(views)} views for {len(tensors)} tensors")
        self.moves += 1
        if not tensors or tensors[0].is_meta is views[0].is_meta:
            _consume(map(_SET_DATA, tensors, views))  # ``t.data = v`` for each, in C
        else:
            for t, v in zip(tensors, views):  # noqa: B905
                _swap_in(t, v)
            self.bumps += 1  # swapping tensors swaps their version counters too
        wrappers = self.wrappers
        if wrappers:
            device = views[0].device
            for w in wrappers:
                if w.device != device:
                    w.follow(device)

    def to_host(self) -> None:
        """Point the pack back at its host buffer (nothing is copied: host bytes are the truth); a
        pack whose copy is still in flight points there already."""
        where = self.where
        # From memory, whatever the record says (it may lag a signal); a pack that never docks has none.
        holder = None if self.bound is None else self._holder()
        if holder is not None:
            lift(self, holder)
        elif where is PackState.READY and self.bound is None:  # the wait took `arriving` and the watch
            self.point(self.rest_views or self.host_views)
        if where is PackState.IN_FLIGHT:
            self.arriving = None
            self.watched.clear()
        self.docked = None
        self.where = PackState.HOST

    def carry(self, indices: Iterable[int]) -> None:
        """The pack's copy is in flight: watch tensors ``indices`` from now on, so its wait finds an
        in-place write made to their host bytes meanwhile (`stale`). Tensors already watched keep the
        counter seen first."""
        watched, tensors = self.watched, self.tensors
        if not watched:  # the usual case (a load's first watch): in C
            indices = tuple(indices)
            watched.update(zip(indices, map(_VERSION, map(tensors.__getitem__, indices)), strict=True))
            return
        if -1 in watched.values():
            return  # its wait copies it again whatever is written (`recopy`)
        for i in indices:
            if i not in watched:
                watched[i] = tensors[i]._version

    def recopy(self, index: int) -> None:
        """The pack's copy is in flight and tensor ``index`` was written in place since some time in
        the step that issued it (its host bytes hold the write; the copy may not): make its wait copy
        the pack again (`stale`)."""
        self.watched[index] = -1  # no version counter reads -1

    def stale(self) -> bool:
        """Whether a watched tensor was written in place since `carry` (the copy holds old bytes);
        the watch ends."""
        watched = self.watched
        written = list(map(_VERSION, map(self.tensors.__getitem__, watched))) != list(watched.values())
        watched.clear()
        return written

    def arrived(self) -> None:
        """The pack's tensors point at a device copy now: remember its buffers' version counters."""
        self._arrival = tuple(map(_VERSION, map(self.tensors.__getitem__, self.buffers)))

    def keep_written(self) -> None:
        """Before the pack leaves the device: copy into the host buffer each buffer a forward wrote in
        place meanwhile (a running statistic, a counter), as the plain run keeps it. A pack this rank
        holds only a shard of has no host copy of the whole buffer to take it."""
        if self.shard is not None or self.in_file:
            return  # a file-tier pack's write cannot be kept: the session guard refuses it
        if tuple(map(_VERSION, map(self.tensors.__getitem__, self.buffers))) == self._arrival:
            return  # nothing written (the usual case), found in C
        for i, then in zip(self.buffers, self._arrival, strict=True):
            t = self.tensors[i]
            if t._version != then:
                with torch.no_grad():
                    self.host_views[i].copy_(t.detach())
                self.bumps += 1
                self.rewatch = True

    def forget_device(self) -> None:
        """Drop every cached view of device memory (the slots may be freed). The storages a pack
        docks at stay until `unbind`: a replay built over them may run again, and where a pack is
        docked is found among them (`_holder`); each is checked against its slot at every use."""
        self.device_views.clear()
        self.shard_views.clear()

    def unbind(self) -> None:
        """Stop docking (the pack is given back): drop the storages it holds."""
        self.bound = self.source = None
        self.rest_views = ()
        self.docks.clear()

    def unshard(self, full: torch.Tensor) -> None:
        """Adopt ``full`` (the whole pack, at least ``nbytes`` bytes) as the host buffer."""
        self.host = full
        self.host_views = tuple(p.view(full) for p in self.pieces)
        self.shard = None
        self.point(self.host_views)
        self.where = PackState.HOST


#: Exchange two storages' memory (and its owner): every tensor viewing either sees the other's bytes.
#: ``None`` in a torch without it (or without storages over foreign memory): packs are re-pointed then.
_SWAP: Any = vars(torch._C.StorageBase).get("_swap_data_ptr_")
SWAP = _SWAP
_FOREIGN: Any = getattr(torch._C, "_construct_storage_from_data_pointer", None)
#: ``tensor.data = view`` as a function (the setter of ``Tensor.data``), mapped over a pack's tensors
#: and run to the end by `_consume` (an empty deque's ``extend``): no Python loop per tensor.
_SET_DATA: Any = vars(torch._C.TensorBase)["data"].__set__
_VERSION = operator.attrgetter("_version")
_consume = collections.deque[Any](maxlen=0).extend


def load_docked(pack: Pack, at: tuple[torch.Tensor, torch.UntypedStorage]) -> None:
    """Copy ``pack``'s host bytes into ``at``'s bytes of a slot (a copy that completes as it is
    issued) and leave the storage over them for the wait to dock (`land`): a load of a pack that
    docks, less the checks and tables a replayed step has settled already."""
    at[0].copy_(pack.host)
    pack.arriving = at[1]
    pack.where = PackState.IN_FLIGHT


def land(pack: Pack, arriving: torch.UntypedStorage) -> None:
    """The wait of a pack that docks: `Pack.arrive` at ``arriving`` (a storage over its bytes in a
    slot), and the pack is ready. A signal handled as the exchange returns leaves the record behind
    it: `Pack.to_host` reads where the pack is from memory."""
    _SWAP(pack.bound, arriving)
    pack.docked = arriving
    pack.arriving = None
    pack.where = PackState.READY


def lift(pack: Pack, docked: torch.UntypedStorage) -> None:
    """Undock ``pack`` from ``docked`` (what `land` exchanged): its tensors see the host memory again."""
    _SWAP(pack.bound, docked)
    pack.docked = None
    pack.where = PackState.HOST


def _storage_at(ptr: int, device: torch.device, nbytes: int) -> torch.UntypedStorage:
    """A storage over ``nbytes`` at address ``ptr`` that owns nothing (the memory is another's)."""
    storage: torch.UntypedStorage = _FOREIGN(ptr, device, nbytes)
    return storage


def _swap_in(t: torch.Tensor, v: torch.Tensor) -> None:
    """Re-point ``t`` at ``v`` across the meta device (a session device for tests only).

    ``t.data = v`` cannot cross between CPU and meta tensors; swapping in a fresh alias of ``v`` (of
    ``t``'s own class) keeps the tensor object, as the plain path does.
    """
    alias = v.view_as(v)
    if isinstance(t, torch.nn.Parameter):
        alias = torch.nn.Parameter(alias, requires_grad=t.requires_grad)
    torch.utils.swap_tensors(t, alias)  # type: ignore[no-untyped-call]


@attrs.define(slots=True, eq=False)
class Unit:
    """A schedule's unit: a block, ``<component>:rest`` or a whole component, and its packs."""

    name: str
    packs: tuple[Pack, ...]
    component: str
    module: Any = None

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.packs)
