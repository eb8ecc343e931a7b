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


def _original() -> Callable[..., Any]:
    from vllm_omni.diffusion import offloader

    current = offloader.get_offload_backend
    found: Callable[..., Any] = getattr(current, "__wrapped__", current)
    return found


def get_offload_backend(
    od_config: Any, device: torch.device | None = None, host_weight_plan: Any = None
) -> Any:
    """vLLM-Omni's ``get_offload_backend``, which builds torchferry's backend when the config selects it.

    vLLM-Omni's own checks of its offload options run first (its ``OffloadConfig.from_od_config``, in its
    words), then torchferry's (`engine_request`); a request either refuses is a `PlanError` here, when
    the engine starts, before any weight moves. Any other config goes to the original function.
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

    if offloader.get_offload_backend is not get_offload_backend:
        get_offload_backend.__wrapped__ = offloader.get_offload_backend  # type: ignore[attr-defined]
        offloader.get_offload_backend = get_offload_backend
    patch_adapter()
