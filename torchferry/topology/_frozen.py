"""A hashable, immutable mapping for frozen topology data."""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from types import MappingProxyType
from typing import Generic, TypeVar, overload

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")

__all__ = ["WHEN_SET", "FrozenMap"]

#: Field metadata for a field added after plan digests were published: `canonical` renders it only
#: when it differs from its default, so every plan that leaves it alone keeps the digest it had
#: (and every golden schedule its ``# plan:`` line).
WHEN_SET: Mapping[str, str] = MappingProxyType({"digest": "when set"})


class FrozenMap(Mapping[K, V], Generic[K, V]):
    """An immutable mapping that hashes and compares by its items, kept in insertion order."""

    __slots__ = ("_hash", "_map")

    def __init__(self, items: Mapping[K, V] | tuple[tuple[K, V], ...] = ()) -> None:
        self._map: dict[K, V] = dict(items)
        self._hash: int | None = None

    def __getitem__(self, key: K) -> V:
        return self._map[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    # Membership and lookups go straight to the dict: `Mapping`'s defaults raise and catch a
    # `KeyError` on every miss, and cost models and declarations are probed mostly for misses.
    def __contains__(self, key: object) -> bool:
        return key in self._map

    # The views are the dict's own, so ``dict(m.items())`` copies in C (a step's follow-ups are
    # copied at every step start: `policies.next_step`).
    def keys(self) -> KeysView[K]:
        return self._map.keys()

    def items(self) -> ItemsView[K, V]:
        return self._map.items()

    def values(self) -> ValuesView[V]:
        return self._map.values()

    @overload
    def get(self, key: K, /) -> V | None: ...
    @overload
    def get(self, key: K, /, default: V | T) -> V | T: ...
    def get(self, key: K, /, default: object = None) -> object:
        return self._map.get(key, default)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._map.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenMap):
            return self._map == other._map
        if isinstance(other, Mapping):
            return self._map == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._map!r})"
