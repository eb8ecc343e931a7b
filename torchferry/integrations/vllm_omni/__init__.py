"""torchferry inside vLLM-Omni, selected by one entry of the engine's configuration.

Installed with torchferry, the entry point ``torchferry`` of the group ``vllm_omni.general_plugins``
names `register`, which vLLM-Omni runs once in every process before its diffusion worker is built.
`register` changes nothing a stock configuration sees: it wraps vLLM-Omni's
``get_offload_backend`` (the function its ``enable_offload_backend`` looks up when the model runner
enables offloading) and its diffusers adapter's ``load_weights``, and both wrappers hand over to the
originals unless ``additional_config={"offload_backend": "torchferry"}``. With that entry, and one of
vLLM-Omni's offload options (``enable_layerwise_offload=True``, ``enable_cpu_offload=True``,
``enable_distributed_layerwise_offload=True`` or ``diffusion_offload_config``, so the engine loads the
weights on the CPU), vLLM-Omni's own functions return and enable a torchferry backend; its options
go in ``additional_config["torchferry"]``. docs/engines.md has the setup, the mapping and what is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchferry._errors import PlanError
from torchferry.integrations.vllm_omni._backend import TorchferryBackend, backend_class
from torchferry.integrations.vllm_omni._request import (
    BACKEND_KEY,
    BACKEND_NAME,
    OPTIONS_KEY,
    EngineRequest,
    EngineSettings,
    engine_request,
    read_settings,
    selects_torchferry,
)

__all__ = [
    "BACKEND_KEY",
    "BACKEND_NAME",
    "OPTIONS_KEY",
    "EngineRequest",
    "EngineSettings",
    "TorchferryBackend",
    "backend_class",
    "engine_request",
    "get_offload_backend",
    "read_settings",
    "register",
    "selects_torchferry",
]


#: vLLM-Omni's own ``get_offload_backend``, kept by the first `register` (another plugin may wrap ours later).
_STOCK: list[Callable[..., Any]] = []


def _original() -> Callable[..., Any]:
    if _STOCK:
        return _STOCK[0]
    from vllm_omni.diffusion import offloader

    stock: Callable[..., Any] = offloader.get_offload_backend  # not registered: it is still vLLM-Omni's
    return stock


def _installed(function: object) -> bool:
    """Whether ``function`` is torchferry's wrapper or wraps it (``__wrapped__``, as functools.wraps sets)."""
    seen: set[int] = set()
    while function is not None and id(function) not in seen:
        if getattr(function, "__torchferry__", False):
            return True
        seen.add(id(function))
        function = getattr(function, "__wrapped__", None)
    return False


def get_offload_backend(
    od_config: Any, device: torch.device | None = None, host_weight_plan: Any = None
) -> Any:
    """vLLM-Omni's ``get_offload_backend``, which builds torchferry's backend when the config selects it.

    vLLM-Omni's own checks of its offload options run first (its ``OffloadConfig.from_od_config``: its
    own ``ValueError`` or ``TypeError``, in its words), then torchferry's (`engine_request`: a
    `PlanError` in the engine's words), when the engine starts. Any other config goes to vLLM-Omni's
    own function.
    """
    if not selects_torchferry(getattr(od_config, "additional_config", None)):
        return _original()(od_config, device=device, host_weight_plan=host_weight_plan)
    from vllm_omni.diffusion.offloader.base import OffloadConfig

    engine_config = OffloadConfig.from_od_config(od_config)
    if host_weight_plan is not None:
        raise PlanError(
            "vLLM-Omni's loader skipped the DiT's weights for its own host-weight plan, which torchferry "
            "does not bind; set host_weight_runtime_mode='disabled' so the loader loads them, or drop "
            f'additional_config["{BACKEND_KEY}"]'
        )
    request = engine_request(read_settings(od_config))
    backend: Any = backend_class()(engine_config, device, request=request)
    return backend


def register() -> None:
    """The plugin's entry point: install the two wrappers (idempotent; vLLM-Omni may call it again)."""
    from vllm_omni.diffusion import offloader

    from torchferry.integrations.vllm_omni._adapter import patch_adapter

    current = offloader.get_offload_backend
    if not _installed(current):
        if not _STOCK:
            _STOCK.append(current)
        get_offload_backend.__wrapped__ = _STOCK[0]  # type: ignore[attr-defined]  # functools' convention
        offloader.get_offload_backend = get_offload_backend
    patch_adapter()


get_offload_backend.__torchferry__ = True  # type: ignore[attr-defined]  # marks the wrapper (`_installed`)
