"""The block hook's read of `torch.compiler.is_compiling` (`compile_state`): torch's flag where the
function is that flag behind its TorchScript check, the function itself otherwise."""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchferry.runtime.executor._compile import COMPILE, compile_state


def _both() -> tuple[bool, bool]:
    read: bool = COMPILE._is_compiling_flag
    return read, torch.compiler.is_compiling()


def test_this_torch_reads_the_flag_and_it_follows_a_compile_session_and_an_export() -> None:
    state: object = COMPILE
    assert state is torch.compiler  # no call per block on this torch
    assert _both() == (False, False)
    with torch.compiler._compile_session_context():  # what Dynamo holds while it compiles
        assert _both() == (True, True)
    from torch._export.utils import _compiling_state_context

    with _compiling_state_context():  # what a non-strict export holds while it traces
        assert _both() == (True, True)
    assert _both() == (False, False)


def test_a_function_of_another_shape_is_asked_each_time() -> None:
    answers = [False]

    def is_compiling() -> bool:  # another torch's: a context variable, say
        return answers[0]

    state = compile_state(is_compiling)
    assert state is not torch.compiler
    assert state._is_compiling_flag is False
    answers[0] = True
    assert state._is_compiling_flag is True


def test_a_function_reading_the_flag_and_more_is_asked_too() -> None:
    is_compiling: Callable[[], bool] = lambda: torch.compiler._is_compiling_flag or torch.is_grad_enabled()  # noqa: E731
    assert compile_state(is_compiling) is not torch.compiler
