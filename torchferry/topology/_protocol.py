"""The protocol a pipeline satisfies when it declares its own components."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol, runtime_checkable

__all__ = ["SupportsComponentDiscovery"]


@runtime_checkable
class SupportsComponentDiscovery(Protocol):
    """A pipeline that names its components instead of leaving `discover` to guess.

    Each list holds dotted attribute paths from the pipeline object (``"transformer"``,
    ``"transformer.language_model"``). ``_dit_modules`` are streamed block by block,
    ``_encoder_modules`` run before the DiTs, ``_vae_modules`` after them. A pipeline may also set
    ``_resident_modules`` (modules that always stay where they are); it is optional and defaults to
    none. An ``isinstance`` check looks for the three required lists only.
    """

    _dit_modules: ClassVar[Sequence[str]]
    _encoder_modules: ClassVar[Sequence[str]]
    _vae_modules: ClassVar[Sequence[str]]
