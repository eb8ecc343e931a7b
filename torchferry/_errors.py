"""The error family every torchferry failure belongs to, and the words its messages name requests in.

A message that names a request field is data, not text: its parts are strings and `Flag`s, each
`Flag` naming the field as the Python API does (``host_memory=``) and as ``torchferry plan`` does
(``--host-memory``). `OffloadError.worded` builds such an error; `OffloadError.message` renders it
in either words, so the command line shows every refusal in its own flags without rewording text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeAlias

from typing_extensions import Self

__all__ = [
    "CHECKPOINT",
    "DEVICE_BUDGET",
    "HOST_BUDGET",
    "HOST_MEMORY",
    "SPILL",
    "STORAGE_DTYPE",
    "ExecutionError",
    "Flag",
    "OffloadError",
    "OffloadWarning",
    "PlanError",
    "ScheduleError",
    "TorchferryDeprecationWarning",
    "Words",
    "plan_named",
    "said",
    "strategy_named",
]

#: Whose words a message is in: the Python API's or the command line's.
Words: TypeAlias = Literal["api", "cli"]


class Flag:
    """A request field as the Python API names it (``api``) and as the command line does (``cli``)."""

    __slots__ = ("api", "cli")

    def __init__(self, api: str, cli: str) -> None:
        self.api = api
        self.cli = cli

    def __repr__(self) -> str:
        return f"Flag({self.api!r}, {self.cli!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Flag) and (self.api, self.cli) == (other.api, other.cli)

    def __hash__(self) -> int:
        return hash((self.api, self.cli))


#: One part of a message: plain words, or a field named in each caller's words.
Part: TypeAlias = "str | Flag"

#: The storage dtype, as a keyword and as a flag.
STORAGE_DTYPE = Flag("storage_dtype=", "--storage-dtype")
#: The host budget, as a keyword and as a flag.
HOST_MEMORY = Flag("host_memory=", "--host-memory")
#: The host budget as the config field a plan holds.
HOST_BUDGET = Flag("config.host_memory_bytes", "--host-memory")
#: The device budget as the config field a plan holds.
DEVICE_BUDGET = Flag("config.device_memory_bytes", "--device-memory")
#: A folder the file tier of a pipeline built in memory is written to once (``--spill`` plans as if given).
SPILL = Flag("spill=<a folder>", "--spill")
#: Opening the model from its checkpoint instead of building it in memory.
CHECKPOINT = Flag(
    "open it from its checkpoint (checkpoint=, or from_pretrained)",
    "plan its checkpoint (a pipeline folder or file as MODEL)",
)


def strategy_named(name: str) -> Flag:
    """The request for strategy ``name``: ``strategy='layerwise'`` / ``--strategy layerwise``."""
    return Flag(f"strategy={name!r}", f"--strategy {name}")


def plan_named(digest: str) -> Flag:
    """A plan by its digest for the API (``plan 4b81edf0``); the command line plans one at a time."""
    return Flag(f"plan {digest}", "this plan")


def said(parts: Sequence[Part], words: Words = "api") -> str:
    """``parts`` as one message in ``words``."""
    return "".join(p if isinstance(p, str) else getattr(p, words) for p in parts)


class _Worded(Exception):
    """An exception or warning whose message may name request fields, in either words."""

    #: The message's parts when it names request fields (`worded`), else ``None``.
    parts: tuple[Part, ...] | None = None

    @classmethod
    def worded(cls, *parts: Part) -> Self:
        """One whose message names request fields (`Flag`), renderable in either words."""
        error = cls(said(parts, "api"))
        error.parts = parts
        return error

    def message(self, words: Words = "api") -> str:
        """The message in the API's words or the command line's."""
        return str(self) if self.parts is None else said(self.parts, words)


class OffloadError(_Worded):
    """Root of every error torchferry raises on purpose."""


class PlanError(OffloadError, ValueError):
    """A configuration or topology that cannot be served; raised before anything is mutated."""


class ScheduleError(OffloadError):
    """A schedule that breaks an invariant of `policies.check`, or text that does not parse."""


class ExecutionError(OffloadError, RuntimeError):
    """The runtime could not carry out a schedule as written."""


class OffloadWarning(UserWarning, _Worded):
    """Something was skipped or kept resident because the request could not be served as asked."""


class TorchferryDeprecationWarning(FutureWarning):
    """A legacy way of declaring topology or configuration that still works but will go away."""
