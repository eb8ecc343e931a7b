"""The open sessions of this process by pipeline, held weakly, and the look-up behind `session_of`.

A pipeline is served by one session at a time, so `offload` looks the pipeline up here first. The
registry holds neither the pipeline nor its session: a pipeline key is weak, and so is the session
it maps to. While a session is open the pipeline's hooks reach it (hooks -> engine -> session), so
it lives as long as the pipeline or the caller's own reference does; once both are dropped the
pipeline, its session and their host memory are freed together, and `OffloadWarning` says that
a session was collected open. `find` (`torchferry.session_of`) gives back the session serving a
pipeline (or one of its components), so a session whose value was lost (a notebook cell run twice)
can still be closed.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Protocol

from torchferry._errors import OffloadWarning

__all__ = ["Served", "find", "register", "serving", "unregister"]


class Served(Protocol):
    """What the registry needs of a session (`torchferry.Session` meets it)."""

    @property
    def closed(self) -> bool: ...

    @property
    def running_policy(self) -> str: ...

    @property
    def device(self) -> Any: ...

    def served_modules(self) -> list[Any]: ...


#: pipeline -> a weak reference to the session serving it (both weak: see the module notes).
_OPEN: weakref.WeakKeyDictionary[Any, weakref.ref[Served]] = weakref.WeakKeyDictionary()
#: id(session) -> the finalizer that warns if it is collected open; detached by `unregister`.
_WATCHES: dict[int, weakref.finalize[Any, Any]] = {}


def _collected_open(key: int, what: str) -> None:
    _WATCHES.pop(key, None)
    warnings.warn(
        f"torchferry: {what} was garbage-collected without close(); its pipeline went with it. Close "
        "sessions yourself (session.close(), or `with torchferry.offload(pipe) as session:`), and "
        "torchferry.session_of(pipe) finds the session serving a pipeline",
        OffloadWarning,
        stacklevel=1,
    )


def register(pipeline: Any, session: Served) -> None:
    """Record that ``session`` now serves ``pipeline``, and watch for it being collected open."""
    _OPEN[pipeline] = weakref.ref(session)
    running = f"{session.running_policy} on {session.device}"
    what = f"the open session serving a {type(pipeline).__name__} ({running})"
    watch = weakref.finalize(session, _collected_open, id(session), what)
    watch.atexit = False  # sessions still open when the interpreter exits are not reported
    _WATCHES[id(session)] = watch


def unregister(pipeline: Any, session: Served) -> None:
    """``session`` closed: forget it, and stop watching it."""
    ref = _OPEN.get(pipeline)
    if ref is not None and ref() in (session, None):
        del _OPEN[pipeline]
    watch = _WATCHES.pop(id(session), None)
    if watch is not None:
        watch.detach()


def serving(pipeline: Any) -> Served | None:
    """The open session registered for ``pipeline`` itself (not for a component of it), if any."""
    try:
        ref = _OPEN.get(pipeline)
    except TypeError:  # an unhashable or non-weakrefable object cannot be registered
        return None
    session = None if ref is None else ref()
    return session if session is not None and not session.closed else None


def find(pipeline: Any) -> Served | None:
    """The open session serving ``pipeline`` or one of its top-level components, else ``None``."""
    found = serving(pipeline)
    if found is not None:
        return found
    for ref in list(_OPEN.values()):
        session = ref()
        if session is None or session.closed:
            continue
        try:
            modules = session.served_modules()
        except AttributeError:  # a component deleted from its pipeline while served
            continue
        if any(m is pipeline for m in modules):
            return session
    return None
