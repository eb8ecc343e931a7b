"""The only stateful layer: carries out schedules on real modules with streams and collectives."""

from __future__ import annotations

__all__: list[str] = []
