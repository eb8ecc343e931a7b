"""`run_ranks`: run a function in N local CPU processes joined by one gloo process group.

For tests, benchmarks and the CLI demo of the distributed strategy on one machine without GPUs:

    results = run_ranks(work, 2, "a cat")      # work(rank, world, "a cat") on ranks 0 and 1

Each rank is a new process, in the parent's environment as it is at the call (plus ``env``). On Linux
it is forked, by default, from a ``forkserver`` that imported torch and torchferry once, so a rank
starts in milliseconds, not the seconds an import of torch takes. Forked ranks share that server's
interpreter: its string-hash seed (every rank iterates a set of strings in one order, where
``torchrun``'s ranks each draw their own), and what it had at its start (the first call's rlimits,
umask and standard output, and torch's import-time environment variables). ``start_method="spawn"``,
the default elsewhere (fork is unsafe under macOS's frameworks), starts each rank as a fresh
interpreter instead: a test of ranks agreeing asks for it. Each rank runs torch on ``threads``
threads and ``torch.distributed`` initialised (gloo, the given ``group_timeout``) from a
TCP store that the parent hosts on a port the OS picks, so there is no port to collide on. ``fn``
and its arguments must be picklable (a module-level function), as must its result. Results come
back in rank order. A rank that raises, exits or outlives ``timeout`` makes `run_ranks` raise
`RankError` naming the rank, with the child's traceback; what the other ranks returned is kept on
the error. With ``TORCHFERRY_STREAM_SANITIZER=1`` in the environment each rank runs ``fn`` under the
stream sanitizer (`sanitize`). Every child is reaped before `run_ranks` returns or raises. As with
``spawn`` and ``forkserver``, a script calling it needs the ``if __name__ == "__main__":`` guard
(children re-import the main module).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar, cast

import attrs

from torchferry._errors import ExecutionError

__all__ = ["RankError", "RankFailure", "run_ranks"]

T = TypeVar("T")

_HOST = "127.0.0.1"

#: Set to ``1`` in the parent's environment, every rank runs ``fn`` under `sanitize` (the runtime tests do);
#: to ``re-point``, under ``sanitize(docks=False)``.
SANITIZE_ENV = "TORCHFERRY_STREAM_SANITIZER"


@attrs.frozen(kw_only=True)
class RankFailure:
    """How one rank failed: the exception's type name and message (or how it exited), and its traceback.

    ``traceback`` is empty when the rank ended without raising (it exited early or timed out).
    """

    rank: int
    kind: str
    message: str
    traceback: str = ""


class RankError(ExecutionError, Generic[T]):
    """One or more ranks of `run_ranks` failed; ``failures`` says how, ``results`` has the rest.

    ``results[r]`` is rank ``r``'s return value, or ``None`` if it failed.
    """

    def __init__(self, world: int, failures: list[RankFailure], results: list[T | None]) -> None:
        self.world = world
        self.failures = failures
        self.results = results
        first = failures[0]
        others = [f.rank for f in failures[1:]]
        also = f" (rank(s) {', '.join(map(str, others))} failed too)" if others else ""
        text = f"rank {first.rank} of {world} {first.kind}: {first.message}{also}"
        if first.traceback:
            text += f"\n--- traceback of rank {first.rank} ---\n{first.traceback.rstrip()}"
        super().__init__(text)

    @property
    def rank(self) -> int:
        """The lowest failing rank."""
        return self.failures[0].rank


@attrs.frozen(kw_only=True)
class _Job:
    """What every child needs to join the group and run (pickled to each rank's process)."""

    fn: Callable[..., Any]
    world: int
    port: int
    group_timeout: float
    threads: int
    env: dict[str, str]
    args: tuple[Any, ...]


#: What a forked rank finds imported (the server imports them once; a module that fails is skipped).
_PRELOAD = ["torch", "torch.distributed", "torchferry"]

START_METHODS = ("forkserver", "spawn")


def _context(start_method: str | None) -> Any:
    """``forkserver`` with torch and torchferry preloaded (Linux's default), or ``spawn``."""
    if start_method is None:
        start_method = "forkserver" if sys.platform == "linux" else "spawn"
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # (read when the server starts: the first call's)
    return ctx


def _child(job: _Job, rank: int, out: Any) -> None:
    # Why: a forked rank has the environment the server started with, not the parent's at this call.
    os.environ.clear()
    os.environ.update(job.env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(job.threads)
    try:
        timeout = datetime.timedelta(seconds=job.group_timeout)
        store = dist.TCPStore(_HOST, job.port, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=rank, world_size=job.world, timeout=timeout)
        try:
            if os.environ.get(SANITIZE_ENV) in ("1", "re-point"):
                from torchferry.testing._sanitizer import sanitize

                with sanitize(docks=os.environ[SANITIZE_ENV] == "1"):
                    result = job.fn(rank, job.world, *job.args)
            else:
                result = job.fn(rank, job.world, *job.args)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        out.put((rank, False, (f"raised {type(exc).__name__}", str(exc), traceback.format_exc())))
        return
    out.put((rank, True, result))


def run_ranks(
    fn: Callable[..., T],
    world: int,
    *args: Any,
    timeout: float = 120.0,
    group_timeout: float = 30.0,
    threads: int = 1,
    env: Mapping[str, str] | None = None,
    start_method: str | None = None,
) -> list[T]:
    """``fn(rank, world, *args)`` on ``world`` processes with a gloo group; results by rank.

    ``timeout`` bounds the whole run (children still running then are killed); ``group_timeout``
    is the process group's timeout, after which a collective that a peer never joins fails;
    ``env`` is added to each child's environment; ``start_method`` is ``"forkserver"`` (Linux's
    default) or ``"spawn"`` (elsewhere), see the module's text. Raises `RankError` when any rank fails.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    import torch.distributed as dist

    ctx = _context(start_method)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        _HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=group_timeout)
    )
    job = _Job(
        fn=fn,
        world=world,
        port=store.port,
        group_timeout=group_timeout,
        threads=threads,
        env={**os.environ, **(env or {})},
        args=args,
    )
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(job, r, out), name=f"torchferry-rank-{r}") for r in range(world)
    ]
    results: list[T | None] = [None] * world
    failures: dict[int, RankFailure] = {}
    done: set[int] = set()
    deadline = time.monotonic() + timeout

    def record(rank: int, ok: bool, payload: Any) -> None:
        """Rank ``rank`` reported: its result, or how it failed."""
        done.add(rank)
        if ok:
            results[rank] = payload
        else:
            kind, message, trace = payload
            failures[rank] = RankFailure(rank=rank, kind=kind, message=message, traceback=trace)

    try:
        for p in procs:  # (inside: a rank that failed to start has the ones before it killed)
            p.start()
        while len(done) < world:
            try:
                rank, ok, payload = out.get(timeout=0.1)
            except queue.Empty:
                rank = -1
            if rank >= 0:
                record(rank, ok, payload)
                continue
            for r, p in enumerate(procs):
                if r not in done and p.exitcode is not None:
                    # Its result may still be in the pipe: give the queue one more look first.
                    p.join()
                    try:
                        rank, ok, payload = out.get(timeout=0.5)
                    except queue.Empty:
                        done.add(r)
                        failures[r] = RankFailure(
                            rank=r, kind="exited", message=f"exit code {p.exitcode}, without a result"
                        )
                        break
                    record(rank, ok, payload)
                    break
            if time.monotonic() > deadline:
                for r in range(world):
                    if r not in done:
                        failures[r] = RankFailure(
                            rank=r, kind="timed out", message=f"still running after {timeout:g} s; killed"
                        )
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            if p.pid is not None:  # (started)
                p.join()
        out.close()
        del store
    if failures:
        raise RankError(world, sorted(failures.values(), key=lambda f: f.rank), results)
    return cast("list[T]", results)
