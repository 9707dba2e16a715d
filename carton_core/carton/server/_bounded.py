"""Caches of what clients repeat (request targets, header blocks, checked request and response layouts), bounded by
emptying them when full: a client that repeats itself refills its entry at once, one that never does cannot grow
them."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["remember"]

_K = TypeVar("_K")
_V = TypeVar("_V")


def remember(cache: dict[_K, _V], key: _K, value: _V, limit: int) -> _V:
    """Store `value` under `key` in `cache`, emptying `cache` first when it holds `limit` entries; returns `value`."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value
