"""torchferry as a vLLM-Omni offload backend: ``enable`` opens a session, ``disable`` closes it.

vLLM-Omni builds one offload backend per worker (`get_offload_backend`), enables it on the loaded
pipeline before it compiles the transformers, disables it when enabling failed, and shuts it down
at teardown. `TorchferryBackend` holds that lifecycle; `backend_class` makes it a subclass of
vLLM-Omni's ``OffloadBackend`` (defined when vLLM-Omni is first imported, so torchferry never
imports the engine unless it is asked to serve it).

What ``enable`` serves:

- a native vLLM-Omni pipeline (a plain ``nn.Module`` declaring ``_dit_modules``,
  ``_encoder_modules``, ``_vae_modules`` and maybe ``_offload_plan``): `torchferry.offload` over
  it, whose discovery reads those declarations under the seed's rules;
- a native pipeline that owns its model-level lifecycle (``enable_omni_model_cpu_offload``), under
  model-level offload: delegated to the pipeline, exactly as vLLM-Omni's model-level backend does
  (its non-forward entry points, such as a VAE's ``decode_latent``, cannot be served by hooks);
- the diffusers backend's ``DiffusersAdapterPipeline``: its pipeline was built on the meta device
  from the folder when it loaded (see `torchferry.integrations.vllm_omni._adapter`), and the session
  fills it from the folder's files, so ``host_memory`` and the file tier work.

Under ``distributed_layerwise`` with a shard group of more than one rank the session takes the
engine's own process group (vLLM-Omni's DP group, else its SP group, as its own backend picks) and
never makes one.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import attrs
import torch

from torchferry._errors import ExecutionError, PlanError
from torchferry.integrations.vllm_omni._request import EngineRequest
from torchferry.session import Session, offload
from torchferry.topology import Declaration

__all__ = ["ADAPTER_OPEN", "TorchferryBackend", "backend_class", "declaration_of", "engine_group"]

logger = logging.getLogger("torchferry")

#: The attribute a ``DiffusersAdapterPipeline`` loaded for torchferry carries: the folder, the weight
#: variant and the components built on meta (see ``_adapter.load_weights``).
ADAPTER_OPEN = "_torchferry_open"


def engine_group() -> Any:
    """The process group vLLM-Omni's own distributed backend shards over: DP, else SP."""
    from vllm_omni.diffusion.distributed.parallel_state import (
        get_data_parallel_world_size,
        get_dp_group,
        get_sp_group,
    )

    coordinator = get_dp_group() if get_data_parallel_world_size() > 1 else get_sp_group()
    return coordinator.device_group


#: The fields of vLLM-Omni's ``OffloadPlan`` and torchferry's `Declaration` (the same names, the seed's).
PLAN_FIELDS = tuple(f.name for f in attrs.fields(Declaration))


def declaration_of(pipeline: object) -> Declaration | None:
    """The pipeline's ``_offload_plan`` (or ``get_offload_plan()``) as a `Declaration`: vLLM-Omni's own
    ``OffloadPlan`` dataclass carries the seed's fields under the seed's names, read field by field."""
    found: object = getattr(pipeline, "_offload_plan", None)
    if found is None and callable(getter := getattr(pipeline, "get_offload_plan", None)):
        found = getter()
    if found is None or isinstance(found, Declaration):
        return found
    missing = [name for name in PLAN_FIELDS if not hasattr(found, name)]
    if missing:
        raise PlanError(
            f"{type(pipeline).__name__}'s offload plan ({type(found).__name__}) lacks {', '.join(missing)}, "
            "fields of vLLM-Omni's OffloadPlan torchferry reads; declare it with "
            "vllm_omni.diffusion.offloader.OffloadPlan"
        )
    return Declaration(**{name: getattr(found, name) for name in PLAN_FIELDS})


def _owns_lifecycle(pipeline: object) -> bool:
    return callable(getattr(pipeline, "enable_omni_model_cpu_offload", None)) and callable(
        getattr(pipeline, "disable_omni_model_cpu_offload", None)
    )


class TorchferryBackend:
    """The backend's behaviour; `backend_class` mixes it into vLLM-Omni's ``OffloadBackend``.

    ``config`` is vLLM-Omni's own ``OffloadConfig`` (kept as the base class keeps it), ``request``
    what torchferry was asked (`engine_request`), ``device`` the worker's device.
    """

    def __init__(self, config: Any, device: torch.device | None, *, request: EngineRequest) -> None:
        self.config = config
        self.device = device
        self.enabled = False
        self.request = request
        #: The open session while enabled (None when delegated to the pipeline, or disabled).
        self.session: Session | None = None
        #: A pipeline that owns its model-level lifecycle, while delegated to it.
        self.delegated: Any = None

    def enable(self, pipeline: torch.nn.Module) -> None:
        """Take over ``pipeline``'s weights (see the module docstring for which pipelines and how)."""
        if self.enabled:
            raise ExecutionError(
                "the torchferry offload backend is already enabled; disable() it before enabling it again"
            )
        request = self.request
        if request.config.strategy == "model_level" and _owns_lifecycle(pipeline):
            self._delegate(pipeline)
            return
        kwargs = request.offload_kwargs()
        if self.device is not None:
            kwargs["device"] = self.device
        if request.config.distributed and request.config.dp_size > 1:
            kwargs["process_group"] = engine_group()
        opened = getattr(pipeline, ADAPTER_OPEN, None)
        if opened is not None:
            inner = pipeline._pipeline
            folder, variant, built = opened
            kwargs.update(checkpoint=folder, checkpoint_variant=variant, checkpoint_components=built)
            self.session = offload(inner, **kwargs)
        else:
            target = pipeline._pipeline if _is_adapter(pipeline) else pipeline
            self.session = offload(target, declaration=declaration_of(target), **kwargs)
        self.enabled = True
        logger.info("torchferry serves the pipeline: %s", self.session.running_policy)

    def _delegate(self, pipeline: Any) -> None:
        if self.request.given:
            raise PlanError(
                f"{type(pipeline).__name__} owns its model-level lifecycle (enable_omni_model_cpu_offload), "
                "so under enable_cpu_offload=True vLLM-Omni's rule hands it the offload, and torchferry "
                f'serves none of additional_config["torchferry"] '
                f"({', '.join(map(repr, sorted(self.request.given)))}); drop them, or use "
                "enable_layerwise_offload=True, which torchferry serves"
            )
        components = self.request.config.components
        options: dict[str, Any] = {
            "device": self.device,
            "pin_memory": self.request.config.pin_memory,
            "use_hsdp": self.request.config.parallel.use_hsdp,
        }
        if components is not None:
            options["offload_components"] = components
        try:
            pipeline.enable_omni_model_cpu_offload(**options)
        except BaseException:
            try:
                pipeline.disable_omni_model_cpu_offload()
            except BaseException:  # the enable failure is the one to raise; this one is logged
                logger.exception("model-level cleanup failed after enable_omni_model_cpu_offload failed")
            raise
        self.delegated = pipeline
        self.enabled = True
        logger.info(
            "model-level offload delegated to %s.enable_omni_model_cpu_offload (the pipeline owns its "
            "lifecycle)", type(pipeline).__name__,
        )  # fmt: skip

    def disable(self) -> None:
        """Give the pipeline back: close the session (every weight back where it was) or the delegation."""
        session, delegated = self.session, self.delegated
        self.session = self.delegated = None
        self.enabled = False
        if session is not None and not session.closed:
            session.close()
        if delegated is not None:
            delegated.disable_omni_model_cpu_offload()

    def shutdown(self) -> None:
        """At the worker's teardown: close without gathering shards (no collective at exit)."""
        self.disable()

    def is_enabled(self) -> bool:
        return self.enabled


def _is_adapter(pipeline: object) -> bool:
    inner = getattr(pipeline, "_pipeline", None)
    return type(pipeline).__name__ == "DiffusersAdapterPipeline" and inner is not None


_CLASS: list[type] = []


def backend_class() -> type:
    """``TorchferryOffloadBackend``: `TorchferryBackend` as a subclass of vLLM-Omni's ``OffloadBackend``."""
    if not _CLASS:
        from vllm_omni.diffusion.offloader.base import OffloadBackend

        if not isinstance(OffloadBackend, type):
            raise PlanError(
                "vllm_omni.diffusion.offloader.base.OffloadBackend is not a class in this release"
            )

        def body(namespace: dict[str, Any]) -> None:
            namespace.update(__module__=__name__, __doc__=TorchferryBackend.__doc__)

        made = types.new_class("TorchferryOffloadBackend", (TorchferryBackend, OffloadBackend), {}, body)
        _CLASS.append(made)
    return _CLASS[0]
