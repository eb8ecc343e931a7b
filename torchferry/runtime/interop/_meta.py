"""`meta_parameters`: build a pipeline whose parameters take no memory, to fill from a checkpoint."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["meta_parameters"]

#: Why: one patch at a time; re-entrant, so a meta_parameters() block may nest in one thread.
_LOCK = threading.RLock()


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built in this block get their parameters on the meta device; buffers stay real.

    Use it to build a pipeline that ``torchferry.offload(..., checkpoint=...)`` fills straight from
    safetensors files: parameters cost no memory until the host store reads them (strides are kept,
    so a transposed weight stays transposed), while buffers, including non-persistent ones such as
    RoPE tables that no checkpoint holds, are computed on the CPU as the module makes them.
    (``with torch.device("meta")`` would put those buffers on meta too, where nothing can recompute
    them.) Each parameter is created where its module creates it and moved to meta as it is
    registered; ``torch.empty`` storage is never touched, so it costs no resident memory. The
    context patches ``nn.Module.register_parameter`` for its duration (one block at a time per
    process).
    """
    with _LOCK:  # the method is read under the lock: read before it, another thread's patch leaks
        original = nn.Module.register_parameter

        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            original(module, name, param)
            if param is not None and not param.is_meta:
                moved: Any = param.to("meta")
                module._parameters[name] = type(param)(moved, requires_grad=param.requires_grad)

        nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            nn.Module.register_parameter = original  # type: ignore[method-assign]
