"""Autocast's cast cache, kept off while a step runs, so it never holds a copy of a streamed weight.

[Note: autocast]
Under ``torch.autocast`` a float32 weight that requires grad (every ``nn.Parameter`` unless frozen)
is cast to the lower precision at its first use, and the cast copy is cached until the outermost
autocast region exits, keyed on the tensor object. Re-pointing keeps the object (see [Note: why
tensors are re-pointed] in `_pack`), so each streamed block's cast copy would stay in device memory
for the whole region: the cache would end up holding the model at half its size, unseen by the
ledger and by every budget. So while a step runs the session turns the cache off (where autocast
had it on) and turns it back on when the step ends or is abandoned: each use of a weight casts it
again, to the same values, so outputs equal the plain autocast run's bit for bit; what it costs
is a cast per use instead of one per region (an elementwise pass over the weight, small beside
moving it). An autocast region entered inside the forward inherits the setting, unless it passes
``cache_enabled=True`` itself.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["CastCache"]


class CastCache:
    """Turns autocast's cast cache off for the step that runs now and back on after it."""

    def __init__(self) -> None:
        # Why: the thread whose cache was turned off (autocast state is per thread), or ``None``.
        self._off: int | None = None

    def step_begins(self) -> None:
        """A step starts on this thread: turn the cache off if autocast has it on."""
        if torch.is_autocast_cache_enabled():
            torch.set_autocast_cache_enabled(False)
            self._off = threading.get_ident()

    def step_ends(self) -> None:
        """The step finished or was abandoned: turn the cache back on if this turned it off."""
        off, self._off = self._off, None
        if off is not None and off == threading.get_ident():
            torch.set_autocast_cache_enabled(True)
