"""What every part of discovery shares: dotted paths, words for messages, warnings once per class.

Discovery reads a module tree in three places (`_discover` for the components, `_blocks` for their
rings, `_owners` for their tensors); they name classes, look up dotted attributes, describe what
they found and issue each deprecation warning once per class through this module.
"""

from __future__ import annotations

import warnings

from torch import nn

from torchferry._errors import TorchferryDeprecationWarning
from torchferry.topology._model import find_attr

__all__ = ["Missing", "describe", "get_path", "qualname", "reset_warning_caches", "warn_once"]

# Deprecation warnings are issued once per topic and class (fully qualified name) per process.
_warned: set[tuple[str, str]] = set()


def reset_warning_caches() -> None:
    """Forget which classes were already warned about, so the next discovery warns again."""
    _warned.clear()


def qualname(cls: type) -> str:
    """The fully qualified name of ``cls`` (``module.Qualname``), as warnings and messages name it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def warn_once(topic: str, key: str, message: str) -> None:
    """A deprecation warning about ``key`` (a class name) on ``topic``, the first time only."""
    if (topic, key) not in _warned:
        _warned.add((topic, key))
        warnings.warn(message, TorchferryDeprecationWarning, stacklevel=4)


class Missing(Exception):
    """A dotted attribute path that does not exist."""


def get_path(root: object, dotted: str) -> object:
    """The attribute at the ``dotted`` path below ``root``, else `Missing`."""
    try:
        return find_attr(root, dotted)
    except AttributeError:
        raise Missing(dotted) from None


def describe(value: object) -> str:
    """What ``value`` is, for a message: "a ModuleList of 3", "a Linear", "None"."""
    if isinstance(value, nn.ModuleList):
        return f"a ModuleList of {len(value)}"
    return "None" if value is None else f"a {type(value).__name__}"
