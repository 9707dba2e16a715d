"""Limits applied while reading untrusted packages. Every size the archive declares is checked against these
before any work is done, and every byte actually produced is counted against them again."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_LIMITS", "ReadLimits"]

_MiB = 1 << 20
_GiB = 1 << 30


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadLimits:
    """Caps for reading one carton.

    ``max_total_size``: uncompressed bytes all entries may add up to (declared and produced).
    ``max_ratio``: uncompressed/compressed ratio an entry may have once it is larger than ``ratio_floor`` bytes;
    small entries (a zero-filled 1 MiB tensor compresses 10000:1) are exempt so that legitimate cartons load.
    ``max_metadata_size``: carton.toml, MANIFEST, LINKS, index.toml and string tensor files are read into memory
    and may not be larger than this.
    ``max_entries``: zip entries. ``max_toml_depth``: nesting of arrays and tables in any TOML file (tomllib
    recurses, so a deeply nested document would otherwise exhaust the interpreter's stack).
    ``http_timeout``: seconds for connecting and for each read when a carton or a LINKS file comes from a URL.
    """

    max_total_size: int = 256 * _GiB
    max_ratio: float = 1000.0
    ratio_floor: int = 16 * _MiB
    max_metadata_size: int = 64 * _MiB
    max_entries: int = 100_000
    max_toml_depth: int = 32
    http_timeout: float = 30.0


DEFAULT_LIMITS = ReadLimits()
