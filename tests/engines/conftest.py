"""Fixtures for the tests that drive vLLM-Omni's own code (run by tools/vllm_omni_env.sh, not by CI)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import folders


@pytest.fixture(scope="session")
def wan22(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Wan 2.2 pipeline folder (two experts), float32."""
    return folders.wan22_folder(tmp_path_factory.mktemp("wan22"))


@pytest.fixture(scope="session")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny FLUX.1 pipeline folder, float32."""
    return folders.flux_folder(tmp_path_factory.mktemp("flux"))


@pytest.fixture(scope="session", autouse=True)
def plugins() -> Any:
    """vLLM-Omni's plugin loader, run once as every diffusion worker runs it."""
    from vllm_omni.plugins import load_omni_general_plugins

    load_omni_general_plugins()


@pytest.fixture(autouse=True)
def attention_backend() -> Iterator[None]:
    """diffusers' process-wide attention backend, put back after each test.

    vLLM-Omni's diffusers adapter calls ``transformer.set_attention_backend(...)``, which also sets
    diffusers' active backend for the whole process (``_AttentionBackendRegistry``): on the CPU it
    picks native flash attention, which refuses an attention mask, so every later model with one
    (HunyuanVideo, LTX-Video, Qwen-Image) failed in the diffusers tests run after these.
    """
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(active)
