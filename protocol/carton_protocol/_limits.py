"""Limits the decoder enforces before it allocates anything a peer asked for."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_LIMITS", "WireLimits"]


@dataclass(frozen=True, slots=True, kw_only=True)
class WireLimits:
    """Upper bounds on what one message may declare. Each is checked against the header before any allocation.

    ``max_bytes_elements`` bounds the number of ``BYTES`` elements in one tensor, so that a body of zero-length
    prefixes (4 bytes each) cannot turn 16 MiB into four million Python strings.
    """

    max_header_bytes: int = 1 << 20
    max_tensors: int = 4096
    max_nested: int = 4096
    max_rank: int = 32
    max_tensor_bytes: int = 1 << 40
    max_message_bytes: int = 1 << 40
    max_bytes_elements: int = 1 << 20
    max_name_length: int = 1024
    max_segments: int = 1024


DEFAULT_LIMITS = WireLimits()
