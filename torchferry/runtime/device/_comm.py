"""`Comm`: the weight-shard process group, as the runtime uses it.

Every collective the runtime issues goes through here: the agreement exchanges before anything
could hang (`Comm.agree`), the all-gather of a block's shards into its device slot
(`Comm.all_gather`), and the re-assembly of full host weights when a session gives them back
(`Comm.gather_host`). A failed collective (a peer died, stalled past the group's timeout, or issued a
different collective) becomes an `ExecutionError` that says so; host weights are never touched.

[Note: chunked gathers keep the block's byte order]
A full slot holds the ranks' shards back to back: rank ``r``'s shard at ``[r * S, (r + 1) * S)``,
which is exactly the block's packed bytes followed by zero padding. A gather in ``k`` chunks moves
piece ``j`` (bytes ``[j * c, min((j + 1) * c, S))``, ``c = ceil(S / k)``) of every rank's shard at
once. NCCL needs one contiguous output, so a chunk is gathered into the schedule's ``gather`` slot
of ``world * c`` bytes (a slot like any other: `policies.check` and `simulate` count it, the engine
allocates it once) and copied into the ``world`` places with one strided copy on the same stream;
every backend gathers this way, so what runs on gloo is what runs on NCCL. Only the gathers a failed
step still owes (`drain`) land on gloo as ``world`` views of the slot, one at each rank's offset.

[Note: ranks out of step]
gloo aborts the process (SIGABRT, "Received data size doesn't match expected size") when ranks post
collectives of different sizes, and NCCL hangs; both happen when ranks fall out of step. Two rules
keep every rank's collectives paired, so that falling out of step is an `ExecutionError`:
1. Every step that issues collectives starts with an agreement on its schedule (`agree`: one
   fixed-size all-gather of a digest), every time it runs, not only the first: a rank that runs
   more steps, or another component, meets its peers in an agreement, and a different schedule is
   a disagreement on every rank.
2. A rank whose step fails after the agreement (its own exception, an interrupt, a forward that
   ends early) still issues the step's remaining all-gathers before it aborts (`drain`, called by
   the session), with its own shards, so its peers finish the step with the right weights and
   every rank's next collective is again an agreement. Only a failed collective (a peer died or
   timed out) owes nothing: then the peers time out too.
Steps agree once each (one 33-byte all-gather and, on NCCL, one host round trip per step).

[Note: agreeing on the request]
A session's first collective is `Comm.agree_request`, before anything is read, pinned or changed:
one fixed-size all-gather of a digest of what the rank asked for (the offload options, less the
host budget, which ranks may differ on) and of its host budget (the plan uses the least). A rank
that asks for something else (another prefetch depth) fails every rank alike, naming each rank's
request. A rank that asked for no weight-sharded session (``strategy="layerwise"``,
``dit_transfer="rank-local"``) never joins, and one killed before it opens never will: gloo then
times out or loses the connection on the ranks that did, and each says which ranks never joined.
To name what each asked for, every rank leaves its request in the default group's store before the
all-gather (a key per rank and session); the store only serves the messages.

[Note: failures]
On gloo every collective is a host call: a peer that died, stalled past the group's timeout or
issued another collective makes it raise, and `Comm` turns that into `ExecutionError` on every
surviving rank. NCCL collectives are asynchronous: an all-gather on the comm stream returns at once
and never raises for a dead peer; NCCL's watchdog ends the process after the group's timeout (by
default; ``TORCH_NCCL_ASYNC_ERROR_HANDLING``). So the agreements (on the plan, on opening, on each
schedule) use the group's CPU backend when it has one (``init_process_group("cpu:gloo,cuda:nccl")``):
a rank that fails to open, disagrees or died before an agreement then fails every rank with
`ExecutionError` instead of leaving them in NCCL. After any failed collective the group is
``broken``: the engine then never synchronizes the device (a gather that never completes would
block it forever) and keeps its device slots allocated (such a gather may still write them).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchferry._errors import ExecutionError, OffloadError

__all__ = ["Comm"]

_DIGEST = 32


#: The one-output all-gather: ``all_gather_single`` since torch 2.13, which deprecates (with a
#: FutureWarning) the ``all_gather_into_tensor`` that earlier releases offer.
_GATHER_SINGLE: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    _GATHER_SINGLE(out, inp, group=group)


def cpu_backend(backend: str) -> bool:
    """Whether a group's backend string (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``) serves CPU tensors."""
    for part in backend.split(","):
        device, _, name = part.rpartition(":")
        if name == "gloo" and device in ("", "cpu"):
            return True
    return False


def _timeout(group: Any, device: torch.device) -> str:
    """`` (the group's timeout is N s)`` when the group says, else nothing (only for messages)."""
    try:
        timeout = group._get_backend(device).options._timeout
    except Exception:  # a private API, and the group may be broken already
        return ""
    if isinstance(timeout, datetime.timedelta):
        return f" (the group's timeout is {timeout.total_seconds():g} s)"
    return ""


#: The options every request summary names; the others only where the ranks differ on them.
_NAMED = ("strategy", "dit_transfer", "encoder_transfer")
#: Sessions opened per group in this process, so a rank's n-th request meets its peers' n-th.
_OPENED: dict[str, int] = {}


def _store() -> Any:
    """The default group's key-value store (``None`` where there is none): the ranks' requests are
    left there for the messages of a failed agreement, never for the agreement itself."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a private API: without it the messages say less
        return None


def _request_key(group: Any) -> Callable[[int], str]:
    """The store key of rank ``r``'s request for this process's next session on ``group``."""
    try:
        members = "-".join(map(str, dist.get_process_group_ranks(group)))
    except Exception:
        members = "world"
    seq = _OPENED.get(members, 0)
    _OPENED[members] = seq + 1
    return lambda r: f"torchferry/request/{members}/{seq}/{r}"


def _asked(store: Any, key: Callable[[int], str], world: int) -> dict[int, str]:
    """The requests the ranks left in ``store``, by rank (those that left one)."""
    found: dict[int, str] = {}
    if store is None:
        return found
    for r in range(world):
        with contextlib.suppress(Exception):
            if store.check([key(r)]):
                found[r] = bytes(store.get(key(r))).decode()
    return found


def _fields(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def _differing(asked: dict[int, str]) -> frozenset[str]:
    """The options whose values differ between the requests ``asked``."""
    found = [_fields(t) for t in asked.values()]
    names = {k for f in found for k in f}
    return frozenset(k for k in names if len({f.get(k) for f in found}) > 1)


def _summary(text: str, differing: frozenset[str] = frozenset()) -> str:
    """A request as keywords: its strategy and transfers, and the options in ``differing``."""
    fields = _fields(text)
    names = [k for k in _NAMED if k in fields] + sorted(k for k in differing - set(_NAMED) if k in fields)
    return ", ".join(f"{k}={fields[k]}" for k in names) or "(unknown: it left no request)"


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class Comm:
    """One process group used for weight shards: its rank, size and backend, and its collectives.

    ``device`` is where collective buffers live: the CPU for gloo, the session's device otherwise.
    """

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.world: int = dist.get_world_size(group)
        self.backend: str = str(dist.get_backend(group))
        self.device = torch.device("cpu") if self.backend == "gloo" else device
        # Why: agreements go through the group's CPU backend when it has one ("cpu:gloo,cuda:nccl"), so a
        # dead or disagreeing peer raises there instead of hanging in NCCL (see [Note: failures]).
        self.agree_device = torch.device("cpu") if cpu_backend(self.backend) else self.device
        #: Whether a collective on this group has failed: the group is unusable, and a collective that
        #: never completes may still be queued on the device (the engine then never waits for the device).
        self.broken = False
        # Why: (slot, shard bytes, piece) -> per-chunk output views, so steady steps build nothing; the
        # slot tensor is kept in the entry, so a recycled id never returns another slot's views.
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, list[list[torch.Tensor]]]] = {}

    @property
    def staged(self) -> bool:
        """Whether a chunked gather needs a contiguous output to land in (every backend but gloo)."""
        return self.backend != "gloo"

    def _run(self, what: str, fn: Callable[..., object], *args: Any) -> None:
        try:
            fn(*args, group=self.group)
        except OffloadError:
            raise
        except Exception as exc:
            self.broken = True
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ExecutionError(
                f"{what} failed on rank {self.rank} of {self.world} ({self.backend}): "
                f"{type(exc).__name__}: {first}; a peer rank died, stalled past the process group's "
                f"timeout{_timeout(self.group, self.device)}, or issued a different collective. Host "
                "weights are intact and this step was aborted; the process group is likely unusable now, so "
                "close() the session (that needs no collective) and restart the ranks"
            ) from exc

    # ------------------------------------------------------------------------------ agreement
    def agree_request(self, request: dict[str, str], budget: int) -> list[int]:
        """The first collective of a session (see [Note: agreeing on the request]): every rank's host
        ``budget``, in rank order, once every rank is found to ask for the same ``request`` (option
        name to its ``repr``). Raises `ExecutionError` naming the ranks that asked for something else,
        never joined or vanished, and what each asked for where known; nothing is changed here."""
        text = "\n".join(f"{k}={v}" for k, v in sorted(request.items()))
        key = _request_key(self.group)
        store = _store()
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(key(self.rank), text)  # for the peers' messages, should this agreement fail
        row = [*hashlib.sha256(text.encode()).digest(), *int(budget).to_bytes(8, "little", signed=True)]
        mine = torch.tensor(row, dtype=torch.uint8, device=self.agree_device)
        out = torch.empty(self.world * len(row), dtype=torch.uint8, device=self.agree_device)
        try:
            _all_gather_single(out, mine, self.group)
        except Exception as exc:
            self.broken = True
            raise self._lost(exc, _asked(store, key, self.world), text) from exc
        rows = out.cpu().view(self.world, len(row))
        digests = [bytes(rows[r, :_DIGEST].tolist()) for r in range(self.world)]
        if len(set(digests)) > 1:
            asked = _asked(store, key, self.world)
            groups: dict[bytes, list[int]] = {}
            for r, d in enumerate(digests):
                groups.setdefault(d, []).append(r)
            differing = _differing(asked)
            listed = "; ".join(
                f"{_ranks(rs)} asked for {_summary(asked.get(rs[0], ''), differing)}"
                for rs in groups.values()
            )
            raise ExecutionError(
                f"the ranks of the {self.world}-rank weight-shard group disagree on what they ask for: "
                f"{listed}; this is rank {self.rank}, and nothing was changed on it. Every rank must open "
                "torchferry.offload(...) on the same pipeline with the same options, so that all issue the "
                "same collectives"
            )
        return [
            int.from_bytes(bytes(rows[r, _DIGEST:].tolist()), "little", signed=True)
            for r in range(self.world)
        ]

    def _lost(self, exc: Exception, asked: dict[int, str], text: str) -> ExecutionError:
        """The error of a request agreement whose all-gather failed: which ranks never joined, which
        joined and vanished (and what they asked for)."""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        absent = [r for r in range(self.world) if r != self.rank and r not in asked]
        vanished = [r for r in asked if r != self.rank]
        parts = [f"rank {r} asked for {_summary(asked[r])} and then vanished" for r in vanished]
        if absent:
            parts.insert(
                0,
                f"{_ranks(absent)} never joined: no weight-sharded session was opened there (another "
                "strategy=, dit_transfer='rank-local', no offload call at all), or the rank died or stalled "
                "before it",
            )
        if not parts:
            parts.append("a peer rank died or stalled")
        return ExecutionError(
            f"the ranks of the {self.world}-rank weight-shard group could not agree on the plan: "
            f"{'; '.join(parts)} ({self.backend}: {first}{_timeout(self.group, self.device)}); this is rank "
            f"{self.rank}, which asked for {_summary(text)}, and nothing was changed on it. Open the same "
            "torchferry.offload(...) on every rank of the group, and restart the ranks (the process group "
            "is likely unusable now)"
        )

    def agree(self, what: str, text: str, *, ok: bool = True) -> list[tuple[str, bool]]:
        """All-gather a digest of ``text`` and an ok flag from every rank; returns them in rank order.

        Raises `ExecutionError` on every rank alike when the digests differ (a rank would otherwise
        issue different collectives and hang its peers) or when a rank reports it is not ok.
        """
        digest = hashlib.sha256(text.encode()).digest()
        mine = torch.tensor([*digest, int(ok)], dtype=torch.uint8, device=self.agree_device)
        out = torch.empty(self.world * (_DIGEST + 1), dtype=torch.uint8, device=self.agree_device)
        self._run(f"the check that every rank agrees on {what}", _all_gather_single, out, mine)
        rows = out.cpu().view(self.world, _DIGEST + 1)
        seen = [
            (bytes(rows[r, :_DIGEST].tolist()).hex()[:12], bool(rows[r, _DIGEST])) for r in range(self.world)
        ]
        failed = [r for r, (_, good) in enumerate(seen) if not good]
        if failed:
            raise ExecutionError(
                f"rank(s) {', '.join(map(str, failed))} of the {self.world}-rank weight-shard group could "
                f"not {what} (see the error on those ranks); nothing was changed on rank {self.rank}"
            )
        digests = [d for d, _ in seen]
        if len(set(digests)) > 1:
            groups: dict[str, list[int]] = {}
            for r, d in enumerate(digests):
                groups.setdefault(d, []).append(r)
            listed = "; ".join(
                f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {d}" for d, rs in groups.items()
            )
            raise ExecutionError(
                f"the ranks of the {self.world}-rank weight-shard group disagree on {what} (this is rank "
                f"{self.rank}; digests {listed}); every rank must open torchferry.offload(...) on the same "
                "pipeline with the same config and policy, and run the same components in the same order, "
                "so that all issue the same collectives"
            )
        return seen

    def drain(self, owed: list[tuple[str, torch.Tensor, int]]) -> None:
        """Issue all-gathers a failed step still owes its peers: ``(what, this rank's shard, chunks)``.

        The results are dropped; see [Note: ranks out of step]. Nothing is issued after a failed
        collective.
        """
        for what, shard, chunks in owed:
            if self.broken:  # a failed collective: nothing more is owed to peers
                return
            src = shard.to(self.device)
            size = src.numel()
            out = torch.empty(self.world * size, dtype=torch.uint8, device=self.device)
            staging = None
            if chunks > 1 and self.staged:
                staging = torch.empty(self.world * -(-size // chunks), dtype=torch.uint8, device=self.device)
            self.all_gather(out, src, chunks, what, staging)
        self.forget()  # the views of the dropped outputs would keep them

    # -------------------------------------------------------------------------------- gathers
    def all_gather(
        self,
        slot: torch.Tensor,
        shard: torch.Tensor,
        chunks: int,
        what: str,
        staging: torch.Tensor | None = None,
    ) -> None:
        """Gather every rank's ``shard`` (``S`` bytes) into the first ``world * S`` bytes of ``slot``.

        ``chunks`` pieces, byte order as the Note at the top says. A chunked gather lands each chunk
        of every rank in ``staging`` (``world * ceil(S / chunks)`` bytes, the schedule's gather slot)
        and copies it into place; without one (gloo only) each chunk lands in views of ``slot``.
        """
        size = shard.numel()
        full = slot.narrow(0, 0, self.world * size)
        if chunks <= 1 or size == 0:
            self._run(f"all-gather of {what}", _all_gather_single, full, shard)
            return
        piece = -(-size // chunks)
        count = -(-size // piece)
        if staging is None:
            assert not self.staged, "a chunked gather on this backend needs its gather slot"
            for j, outputs in enumerate(self._chunk_views(slot, size, piece)):
                lo = j * piece
                part = shard.narrow(0, lo, outputs[0].numel())
                self._run(f"all-gather of {what} (chunk {j + 1} of {count})", dist.all_gather, outputs, part)
            return
        grid = full.view(self.world, size)
        for j in range(count):
            lo = j * piece
            n = min(piece, size - lo)
            out = staging.narrow(0, 0, self.world * n)
            self._run(
                f"all-gather of {what} (chunk {j + 1} of {count})",
                _all_gather_single,
                out,
                shard.narrow(0, lo, n),
            )
            grid[:, lo : lo + n].copy_(out.view(self.world, n))

    def forget(self) -> None:
        """Drop the cached views of slots (each holds its slot's memory): after a drain, whose outputs
        are dropped, and when the slots are freed."""
        self._views.clear()

    def _chunk_views(self, slot: torch.Tensor, size: int, piece: int) -> list[list[torch.Tensor]]:
        """Per chunk, the ``world`` views of ``slot`` its pieces land in (cached while ``slot`` lives)."""
        key = (id(slot), size, piece)
        cached = self._views.get(key)
        if cached is not None and cached[0] is slot:
            return cached[1]
        grid = slot.narrow(0, 0, self.world * size).view(self.world, size)
        views = [
            [grid[r, lo : lo + min(piece, size - lo)] for r in range(self.world)]
            for lo in range(0, size, piece)
        ]
        self._views[key] = (slot, views)
        return views

    def gather_host(self, shard: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's host ``shard`` put together: a new CPU tensor of ``world * S`` bytes (collective)."""
        self.agree(f"the re-assembly of {what}", f"re-assembly {what} {shard.numel()}")
        src = shard.to(self.device)
        out = torch.empty(self.world * shard.numel(), dtype=torch.uint8, device=self.device)
        self._run(f"re-assembly of {what}", _all_gather_single, out, src)
        return out.cpu() if out.device.type != "cpu" else out
