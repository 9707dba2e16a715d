"""Weight payloads on 2 MiB pages: anonymous memory, aligned to 2 MiB and advised as huge (``MADV_HUGEPAGE``).

A matrix-vector product reads its whole payload once, mostly from memory. On 4 KiB pages a payload of several MiB
spans thousands of pages, more than the TLB holds: after the payload has left the caches every page costs a page
walk whose own table entries have left them too, and the hardware prefetcher stops at every page boundary. On
2 MiB pages the same payload is a handful of TLB entries. The kernel gives huge pages to anonymous memory only
where asked (transparent huge pages in ``madvise`` mode, the usual default) and to a mapped file only when its
page cache happens to hold 2 MiB folios, so the payloads are copied into memory of our own (`HugePageArena`).

Where the system gives no huge pages (``never`` mode, no memory to assemble them, another OS), the arena is still
ordinary memory and everything works, on small pages.
"""

from __future__ import annotations

import contextlib
import mmap
import threading

import numpy as np
import numpy.typing as npt

__all__ = ["HUGE_PAGE", "HugePageArena", "in_arena"]

#: Bytes of a transparent huge page (x86-64, and arm64 with 4 KiB base pages).
HUGE_PAGE = 2 << 20
#: Payloads start on a cache line within an arena.
_ALIGN = 64
#: Arena chunks are at least this large, so that small payloads share their huge pages.
_CHUNK = 16 << 20

_lock = threading.Lock()
#: (start, end) addresses of every arena chunk handed out, for `in_arena` (chunks are never unmapped while an array
#: over them lives, and a chunk's range is dropped with its arena).
_ranges: dict[int, int] = {}


def _address(array: npt.NDArray[np.uint8]) -> int:
    return int(array.__array_interface__["data"][0])


def in_arena(array: npt.NDArray[np.uint8]) -> bool:
    """Whether ``array`` lies inside a chunk of a live `HugePageArena`."""
    start = _address(array)
    end = start + array.nbytes
    with _lock:
        return any(lo <= start and end <= hi for lo, hi in _ranges.items())


class HugePageArena:
    """Memory for read-only payloads, carved from 2 MiB-aligned anonymous chunks advised as huge pages.

    ``take(nbytes)`` returns a writable uint8 array of ``nbytes`` starting on a cache line; fill it, then only read
    it. The chunks stay mapped while any array taken from them lives (each array keeps its chunk referenced), and
    are shared copy-on-write with processes forked afterwards.
    """

    def __init__(self, chunk_bytes: int = _CHUNK) -> None:
        self._chunk_bytes = chunk_bytes
        self._free: npt.NDArray[np.uint8] | None = None

    def take(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A fresh region of ``nbytes`` (its contents are zero until written)."""
        need = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        if self._free is None or self._free.nbytes < need:
            self._free = _chunk(max(need, self._chunk_bytes))
        region, self._free = self._free[:nbytes], self._free[need:]
        return region


def _forget(start: int) -> None:
    with _lock:
        _ranges.pop(start, None)


class _Chunk(mmap.mmap):
    """An anonymous mapping that drops its range from `in_arena`'s registry when it is freed."""

    start = 0

    def __del__(self) -> None:
        _forget(self.start)


def _chunk(nbytes: int) -> npt.NDArray[np.uint8]:
    """A 2 MiB-aligned, huge-page-advised uint8 array of at least ``nbytes`` (rounded up to 2 MiB)."""
    size = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    # One huge page more than needed, so that an aligned start exists inside the mapping; the slack is never
    # touched, so it costs address space only.
    private = getattr(mmap, "MAP_PRIVATE", None)  # absent on Windows, whose anonymous mappings are private anyway
    if private is None:
        mapping = _Chunk(-1, size + HUGE_PAGE)
    else:
        mapping = _Chunk(-1, size + HUGE_PAGE, flags=private | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mapping, dtype=np.uint8)
    skip = -_address(whole) % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and hasattr(mapping, "madvise"):
        with contextlib.suppress(OSError):  # no transparent huge pages in this kernel: small pages, still correct
            mapping.madvise(advice, skip, size)
    region = whole[skip : skip + size]
    mapping.start = _address(region)
    with _lock:
        _ranges[mapping.start] = mapping.start + size
    return region
