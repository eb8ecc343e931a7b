"""The block hook's read of `torch.compiler.is_compiling` (`compile_state`): torch's flag where the
function is that flag behind its TorchScript check, the function itself otherwise."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import pytest
import torch

import torchferry
from torchferry.runtime.executor._compile import COMPILE, compile_state
from torchferry.testing import toy


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


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 16, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 8, 32, generator=g)


def test_a_wrapper_copying_the_functions_name_is_asked() -> None:
    flag = [True]

    @functools.wraps(torch.compiler.is_compiling)
    def is_compiling() -> bool:  # a library's replacement: its own flag, torch's name and module
        return flag[0]

    state = compile_state(is_compiling)
    assert state is not torch.compiler
    assert state._is_compiling_flag is True


@pytest.mark.parametrize("held", ["compile session", "export"])
@torch.no_grad()
def test_an_eager_forward_while_the_process_compiles_runs_each_hook_once(held: str) -> None:
    """The compile flag is the process's: set while another thread compiles, or under a non-strict
    export. A forward that really runs then takes the hooks' compiled-caller path, and the block's
    hook, asked there to run eagerly, runs its body (it recursed, asking again, before)."""
    from torch._export.utils import _compiling_state_context

    p, ref = toy.build(0), toy.build(0)
    args = _inputs()
    expected = ref.transformer(*args)
    context = (
        torch.compiler._compile_session_context if held == "compile session" else _compiling_state_context
    )
    with torchferry.offload(p.transformer, strategy="layerwise", device="cpu"):
        assert torch.equal(p.transformer(*args), expected)
        with context():
            for _ in range(2):
                assert torch.equal(p.transformer(*args), expected)
        assert torch.equal(p.transformer(*args), expected)


@torch.no_grad()
def test_a_forward_on_one_thread_while_another_holds_the_compile_flag_is_exact() -> None:
    p, ref = toy.build(0), toy.build(0)
    args = _inputs()
    expected = ref.transformer(*args)
    holding, done = threading.Event(), threading.Event()

    def compiler() -> None:  # stands for a thread inside torch.compile's compile session
        with torch.compiler._compile_session_context():
            holding.set()
            done.wait(60)

    thread = threading.Thread(target=compiler)
    thread.start()
    try:
        assert holding.wait(60)
        with torchferry.offload(p.transformer, strategy="layerwise", device="cpu"):
            outputs = [p.transformer(*args) for _ in range(3)]
    finally:
        done.set()
        thread.join()
    assert all(torch.equal(out, expected) for out in outputs)
