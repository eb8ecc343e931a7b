"""The engine's hooks under `torch.compile`: opaque to Dynamo, at no cost to an eager call.

Dynamo traces none of the engine's code: each hook carries Dynamo's ``_torchdynamo_disable`` mark (a
compiled caller graph-breaks around the call rather than inlining it) and its code runs with the
frame strategy "skip, and skip everything it calls" (`skip_in_dynamo`). A compiled block stays one
graph, the hooks run eagerly around it, and nothing recompiles per block. An eager call pays one
read of `torch.compiler.is_compiling` (the block hook reads its flag with no call: `compile_state`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["COMPILE", "Hook", "compile_state", "compiled_call", "marked", "opaque"]

Hook = Callable[..., None]
_compiling = torch.compiler.is_compiling
#: The code objects of the hook functions (shared by every closure made from one ``def``).
_HOOK_CODES: set[Any] = set()
_SKIPPED: set[Any] = set()


class _Asking:
    """``is_compiling`` behind the attribute the block hook reads (see `compile_state`)."""

    def __init__(self, is_compiling: Callable[[], bool]) -> None:
        self._ask = is_compiling

    @property
    def _is_compiling_flag(self) -> bool:
        return self._ask()


def compile_state(is_compiling: Callable[[], bool] = _compiling) -> Any:
    """What the block hook reads ``_is_compiling_flag`` of, for `torch.compiler.is_compiling`.

    Where ``is_compiling`` is torch's flag behind its TorchScript check (torch 2.4 on, this torch
    included: ``False`` when scripting, else the flag a compile session or an export sets), that is
    `torch.compiler` itself, read with no call: two Python frames less per block, on memory the
    block's compute left cold. Any other form of it is called through the attribute (`_Asking`).
    """
    module = sys.modules.get(getattr(is_compiling, "__module__", ""))
    code = getattr(is_compiling, "__code__", None)
    if (
        code is not None
        and module is not None
        and getattr(is_compiling, "__globals__", None) is vars(module)  # (not a wrapper copying its name)
        and isinstance(getattr(module, "_is_compiling_flag", None), bool)
        and "_is_compiling_flag" in code.co_names
        and set(code.co_names) <= {"torch", "jit", "is_scripting", "_is_compiling_flag"}
    ):
        return module
    return _Asking(is_compiling)


#: Read by the block hook: ``COMPILE._is_compiling_flag`` is `torch.compiler.is_compiling()`.
COMPILE = compile_state()


def opaque(body: Hook) -> Hook:
    """``body`` as a hook Dynamo does not trace, at no cost to an eager call.

    The hook carries Dynamo's ``_torchdynamo_disable`` mark, so a compiled caller does not inline it
    (it graph-breaks around the call), and its code runs with Dynamo's frame strategy "skip, and skip
    everything it calls" (`skip_in_dynamo`), so nothing of the engine is compiled either. Both are
    read by Dynamo alone: an eager call pays one flag read. Dynamo is never imported for this: when
    it is not loaded yet at anchor time, the first compiled call finds `torch.compiler.is_compiling`
    true, runs ``body`` through a disabled wrapper and sets the strategy then.
    """
    lazy: list[Hook] = []

    def eager(*args: Any) -> None:
        skip_in_dynamo()
        body(*args)

    def hook(*args: Any) -> None:
        if COMPILE._is_compiling_flag:
            if not lazy:
                lazy.append(torch.compiler.disable(eager, recursive=True))  # type: ignore[no-untyped-call]
            lazy[0](*args)
            return
        body(*args)

    return marked(hook)


def marked(hook: Hook) -> Hook:
    """``hook`` with Dynamo's ``_torchdynamo_disable`` mark and its code skipped (see `opaque`)."""
    hook._torchdynamo_disable = True  # type: ignore[attr-defined]
    _HOOK_CODES.add(hook.__code__)
    skip_in_dynamo()
    return hook


def compiled_call(hook: Hook, *args: Any) -> None:
    """Run ``hook`` from a compiled caller, as `opaque`'s hook does, for a hook that reads the compile
    flag itself (the block hook: one Python frame less per block). The hook is called with
    ``eager=True`` and must then run its body without reading the flag again: the flag is the
    process's, so it is set while the hook really runs when another thread compiles, or under a
    non-strict export, and asking again would recurse."""
    disabled = getattr(hook, "_torchferry_disabled", None)
    if disabled is None:

        def eager(*inner: Any) -> None:
            skip_in_dynamo()
            hook(*inner, eager=True)

        disabled = torch.compiler.disable(eager, recursive=True)  # type: ignore[no-untyped-call]
        hook._torchferry_disabled = disabled  # type: ignore[attr-defined]
    disabled(*args)


def skip_in_dynamo() -> None:
    """Give every hook's code Dynamo's strategy "skip this frame and every frame it calls", if loaded."""
    if "torch._dynamo" not in sys.modules or _HOOK_CODES <= _SKIPPED:
        return
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy
        from torch._dynamo import eval_frame
    except ImportError:  # another torch: the lazy path above still keeps the engine out of graphs
        return
    set_code_exec_strategy = getattr(eval_frame, "set_code_exec_strategy", None)
    if set_code_exec_strategy is None:
        return
    for code in _HOOK_CODES - _SKIPPED:
        set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
        _SKIPPED.add(code)
