"""A hashable, immutable mapping for frozen topology data."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

__all__ = ["FrozenMap"]


class FrozenMap(Mapping[K, V], Generic[K, V]):
    """An immutable mapping that hashes and compares by its items, kept in insertion order."""

    __slots__ = ("_hash", "_items", "_map")

    def __init__(self, items: Mapping[K, V] | tuple[tuple[K, V], ...] = ()) -> None:
        pairs = tuple(items.items()) if isinstance(items, Mapping) else tuple(items)
        self._map: dict[K, V] = dict(pairs)
        self._items = tuple(self._map.items())
        self._hash: int | None = None

    def __getitem__(self, key: K) -> V:
        return self._map[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._items))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._map) == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._map!r})"
