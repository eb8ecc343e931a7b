"""vLLM-Omni's diffusers backend, loaded for torchferry: the pipeline built on meta, filled from its folder.

vLLM-Omni serves any diffusers pipeline through ``DiffusersAdapterPipeline`` (``diffusion_load_format=
"diffusers"``), whose ``load_weights`` runs diffusers' ``from_pretrained``, moves the pipeline to its
load device and then calls diffusers' own ``enable_sequential_cpu_offload()`` or
``enable_model_cpu_offload()`` for vLLM-Omni's offload flags (both need an accelerator). When
torchferry is selected, `load_weights` below replaces that method: it builds the pipeline with every
model parameter on the meta device (as `torchferry.from_pretrained` does), runs the adapter's own
post-load steps (its per-model utilities, call signature, VAE slicing and tiling, attention backend),
and leaves the filling to the backend's ``enable``, which opens the session with
``checkpoint=<the folder>``: weights are read once from the files into torchferry's host store, and
a host budget keeps the rest in the files (the file tier). Without the selection the adapter's own
method runs, untouched.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from torchferry._errors import PlanError
from torchferry.integrations.vllm_omni._backend import ADAPTER_OPEN
from torchferry.integrations.vllm_omni._request import engine_request, read_settings, selects_torchferry
from torchferry.load import build_on_meta, resolve_folder

__all__ = ["load_weights", "patch_adapter"]

logger = logging.getLogger("torchferry")

#: ``diffusers_load_kwargs`` keys torchferry honours when it loads the folder.
LOAD_KWARGS = ("variant",)


def _load_kwargs(adapter: Any) -> tuple[str | None, dict[str, Any]]:
    """The weight variant and the other keywords of the adapter's load (its ``diffusers_load_kwargs``
    and what its per-model utilities add, such as Wan's ``boundary_ratio``): components and pipeline
    values go to `build_on_meta`, which returns what names neither, refused by `load_weights`."""
    od_config = adapter.od_config
    if getattr(od_config, "quantization_config", None) is not None:
        raise PlanError(
            "quantization_config with the diffusers backend and torchferry: vLLM-Omni would quantize "
            "the pipeline as diffusers loads it, and torchferry fills it from the folder's files; save "
            "the pipeline quantized (torchao or optimum-quanto, which torchferry streams as their "
            "bytes) and drop quantization_config"
        )
    if "torch_dtype" in od_config.diffusers_load_kwargs:
        raise PlanError(
            "diffusers_load_kwargs['torch_dtype'] with torchferry: the dtype is vLLM-Omni's dtype= "
            "(torchferry reads the folder in it); drop it and set dtype="
        )
    load_kwargs: dict[str, Any] = {"torch_dtype": od_config.dtype, **od_config.diffusers_load_kwargs}
    adapter._pipeline_utils.update_load_kwargs(od_config, load_kwargs)
    load_kwargs.pop("torch_dtype")
    return load_kwargs.pop("variant", None), load_kwargs


def load_weights(adapter: Any) -> None:
    """``DiffusersAdapterPipeline.load_weights`` for torchferry (see the module docstring)."""
    from vllm_omni.diffusion.models.diffusers_adapter.pipeline_utils import (
        get_pipeline_utils_for_config,
        resolve_diffusers_pipeline_class,
    )

    od_config = adapter.od_config
    engine_request(read_settings(od_config))  # refuse a misconfiguration before anything is built
    adapter._pipeline_utils = get_pipeline_utils_for_config(od_config)
    variant, components = _load_kwargs(adapter)
    folder = resolve_folder(od_config.model)
    resolved = resolve_diffusers_pipeline_class(od_config)
    if resolved is None or resolved is od_config.diffusers_pipeline_cls:
        from diffusers import DiffusionPipeline  # as the adapter: diffusers' own class lookup

        resolved = DiffusionPipeline
    pipeline, options, built = build_on_meta(resolved, folder, od_config.dtype, components, variant)
    if options:
        raise PlanError(
            f"diffusers_load_kwargs names {', '.join(map(repr, sorted(options)))}, which are neither "
            f"components nor values of {type(pipeline).__name__} (torchferry honours "
            f"{', '.join(map(repr, LOAD_KWARGS))} besides those); drop them, or drop "
            'additional_config["offload_backend"] to load with diffusers'
        )
    adapter._pipeline = pipeline
    setattr(adapter, ADAPTER_OPEN, (str(folder), variant, built))
    adapter._pipeline_utils.apply_post_load_updates(pipeline, od_config)
    adapter._accept_call_kwargs = set(inspect.signature(pipeline.__call__).parameters)
    for flag, method in (("vae_use_slicing", "enable_vae_slicing"), ("vae_use_tiling", "enable_vae_tiling")):
        if getattr(od_config, flag, False):
            try:  # as the adapter: not every pipeline has a VAE that slices or tiles
                getattr(pipeline, method)()
            except Exception as exc:
                logger.warning("%s() failed for %s: %s", method, type(pipeline).__name__, exc)
    adapter._set_attention_backend()


def patch_adapter() -> None:
    """Route ``DiffusersAdapterPipeline.load_weights`` to `load_weights` when torchferry is selected.

    Idempotent: the original method is kept once and called whenever torchferry is not selected.
    """
    from vllm_omni.diffusion.models.diffusers_adapter.pipeline_diffusers_adapter import (
        DiffusersAdapterPipeline,
    )

    current = DiffusersAdapterPipeline.load_weights
    if getattr(current, "__torchferry__", False):
        return
    original: Callable[[Any], None] = current

    def patched(self: Any) -> None:
        if selects_torchferry(getattr(self.od_config, "additional_config", None)):
            load_weights(self)
        else:
            original(self)

    patched.__torchferry__ = True  # type: ignore[attr-defined]  # marks the patch, for idempotence
    patched.__wrapped__ = original  # type: ignore[attr-defined]  # the adapter's own method
    patched.__doc__ = original.__doc__
    DiffusersAdapterPipeline.load_weights = patched
