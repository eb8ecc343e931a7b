"""FrozenMap: an immutable mapping that compares and hashes by its items."""

from __future__ import annotations

import pytest

from torchferry.topology import FrozenMap


def test_equal_by_items_in_any_order() -> None:
    """Maps with the same items are equal and hash alike, whatever their order; a dict compares equal too."""
    a = FrozenMap({"x": 1, "y": 2})
    b = FrozenMap((("y", 2), ("x", 1)))
    assert a == b
    assert hash(a) == hash(b)
    assert a == {"x": 1, "y": 2}
    assert a != FrozenMap({"x": 1})
    assert a != [("x", 1), ("y", 2)]


def test_lookups() -> None:
    """Membership, get with and without a default, indexing and iteration read the items in order."""
    m = FrozenMap({"b": 1, "a": 2})
    assert "a" in m
    assert "c" not in m
    assert m.get("a") == 2
    assert m.get("c") is None
    assert m.get("c", 7) == 7
    assert m["b"] == 1
    assert list(m) == ["b", "a"]
    assert list(m.items()) == [("b", 1), ("a", 2)]
    with pytest.raises(KeyError):
        m["c"]


def test_immutable() -> None:
    """A FrozenMap has no item assignment and no attribute dict to mutate."""
    m = FrozenMap({"a": 1})
    with pytest.raises(TypeError):
        m["a"] = 2  # type: ignore[index]
    with pytest.raises(AttributeError):
        m.extra = 1  # type: ignore[attr-defined]
    assert repr(m) == "FrozenMap({'a': 1})"
