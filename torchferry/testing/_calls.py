"""Counting torchferry's own work in a forward: a figure that is the same on every machine.

Timings of the per-block hot path change with the machine and its load (the same commit measures
33 us one day and 60 us the next on a shared 2-core box), so they cannot guard it in a test. What
torchferry's code *does* per block can: `count_calls` runs a callable under `sys.setprofile` and
counts the Python functions of the package that run and those of other code that the package's
call directly (``calls``: `threading.current_thread`, the methods attrs generates, a wrapped block's
own forward; what they call in turn is theirs), the functions implemented in C
they call (``c_calls``: ``copy_``, ``data_ptr``, a dict's ``get``), the bytecode instructions
they execute (``instructions``: an attribute store such as ``tensor.data = view`` calls nothing a
profiler sees, but it is an instruction) and the tensor operations they issue (``tensor_ops``: every
call torch offers to a ``TorchFunctionMode``, such as ``tensor.data = view``, ``data_ptr()``,
``_version`` or ``copy_``, whose caller is the package's, those a C ``map`` runs over a pack's
tensors included, which the profiler sees as one C call). The counts are deterministic for a given
model, schedule, Python and torch, so a test can assert a budget per streamed block and fail when a change
puts work back on the hot path (tests/test_hot_path.py); benchmarks/overhead.py and paths.py print the same
counts beside their timings. A resumed generator counts as a call, as the profiler reports it.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import attrs
from torch.overrides import TorchFunctionMode

import torchferry

__all__ = ["CallCount", "count_calls"]

#: The package's own source folder: a frame whose code lives under it is torchferry's, except
#: `torchferry.testing`'s (the toy models whose forwards the counts are taken around).
PACKAGE = str(Path(torchferry.__file__).resolve().parent)
#: This file: the counter's own frames (its tensor-operation mode) are never counted.
_HERE = __file__


@attrs.frozen(kw_only=True)
class CallCount:
    """What torchferry's code ran during one call: its Python functions, the C functions they called
    and the instructions they executed.

    ``by_function`` counts the calls of each Python function (``module:line(name)``), each C
    function (``C name``) and each tensor operation (``T name``), ``instructions_by_function`` the
    instructions each Python function executed, for a reader hunting what grew.
    """

    calls: int
    c_calls: int
    instructions: int
    tensor_ops: int
    by_function: dict[str, int] = attrs.field(eq=False, repr=False)
    instructions_by_function: dict[str, int] = attrs.field(eq=False, repr=False)

    def top(self, n: int = 15, *, instructions: bool = False) -> list[tuple[str, int]]:
        """The ``n`` functions called most often (or that executed the most instructions)."""
        table = self.instructions_by_function if instructions else self.by_function
        return Counter(table).most_common(n)


def _ours(filename: str, package: str) -> bool:
    return filename.startswith(package) and not filename.startswith(os.path.join(package, "testing", ""))


class _TensorOps(TorchFunctionMode):
    """Counts the tensor operations whose Python caller is the package's (see `count_calls`)."""

    def __init__(self, package: str, seen: Counter[str]) -> None:
        super().__init__()
        self.package, self.seen, self.count = package, seen, 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if _ours(sys._getframe(1).f_code.co_filename, self.package):
            self.count += 1
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            self.seen[f"T {name}"] += 1
        return func(*args, **(kwargs or {}))


def count_calls(fn: Callable[[], Any], *, package: str = PACKAGE) -> CallCount:
    """Run ``fn`` once and count the calls torchferry's code (files under ``package``) made in it.

    A Python function counts when its own code is under ``package`` and outside its ``testing``
    folder (the engine's hooks count, though torch calls them); a C function counts when the frame
    calling it does. Only this thread is watched.
    """
    seen: Counter[str] = Counter()
    executed: Counter[str] = Counter()
    calls = c_calls = instructions = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls, c_calls
        if event == "call":
            code = frame.f_code
            if _ours(code.co_filename, package):
                calls += 1
                where = code.co_filename[len(package) + 1 :]
                seen[f"{where}:{code.co_firstlineno}({code.co_name})"] += 1
            elif (
                (caller := frame.f_back) is not None
                and code.co_filename != _HERE
                and _ours(caller.f_code.co_filename, package)
            ):
                # Another package's Python function called by ours (`torch.compiler.is_compiling`,
                # `threading.current_thread`, a wrapped block's own forward): a call ours pays for.
                calls += 1
                name = code.co_filename.rsplit(os.sep, 1)[-1]
                seen[f"py {name}:{code.co_firstlineno}({code.co_name})"] += 1
        elif event == "c_call" and _ours(frame.f_code.co_filename, package):
            c_calls += 1
            seen[f"C {getattr(arg, '__qualname__', None) or getattr(arg, '__name__', repr(arg))}"] += 1

    def step(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal instructions
        if event == "opcode":
            instructions += 1
            code = frame.f_code
            executed[f"{code.co_filename[len(package) + 1 :]}:{code.co_firstlineno}({code.co_name})"] += 1
        return step

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call" or not _ours(frame.f_code.co_filename, package):
            return None
        frame.f_trace_lines = False
        frame.f_trace_opcodes = True
        return step

    ops = _TensorOps(package, seen)
    profiler, tracer = sys.getprofile(), sys.gettrace()
    sys.setprofile(profile)
    sys.settrace(trace)
    try:
        with ops:
            fn()
    finally:
        sys.settrace(tracer)
        sys.setprofile(profiler)
    return CallCount(
        calls=calls,
        c_calls=c_calls,
        instructions=instructions,
        tensor_ops=ops.count,
        by_function=dict(seen),
        instructions_by_function=dict(executed),
    )
