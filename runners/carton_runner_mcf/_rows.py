"""Rows of a quantized payload: where each row's bytes live, and how to cut a range of rows into a smaller payload.

Every region of a q* / k* payload (scales, sub-scales, codes) is stored row-major, so rows ``a..b`` of a region are
one contiguous run; int* payloads add regions holding one value for the whole tensor. A process of a split model
reads only its rows this way (`_loader`), and an embedding lookup decodes only the rows it needs (`_weights`).
"""

from __future__ import annotations

from carton.mcf import PayloadLayout, Region, payload_layout

__all__ = ["row_copies", "row_regions"]


def row_regions(layout: PayloadLayout) -> list[tuple[Region, int | None]] | None:
    """The payload's regions in order, each with its bytes per row, or None for a region that holds one value for the
    whole tensor (the int* scale and zero point). Every per-block region is stored row-major, so rows ``a..b`` of a
    region are one contiguous run. None when rows do not start on a byte (int4 with an odd number of columns)."""
    if layout.method.family == "int":
        if layout.cols * layout.bits % 8:
            return None
        shared: list[tuple[Region, int | None]] = [(layout.scales, None)]
        if layout.zero is not None:
            shared.append((layout.zero, None))
        return [*shared, (layout.data, layout.cols * layout.bits // 8)]
    regions = [layout.scales, *([layout.sub_scales] if layout.sub_scales is not None else []), layout.data]
    return [(region, region.size // layout.rows) for region in regions]


def row_copies(layout: PayloadLayout, start: int, stop: int) -> tuple[PayloadLayout, list[tuple[int, int, int]]] | None:
    """How to cut rows ``start..stop`` out of a payload: the part's layout and ``(source offset, size, destination
    offset)`` byte copies that fill it (the gaps between regions stay as the caller made them). None when rows do
    not start on a byte (`row_regions`)."""
    if not 0 <= start < stop <= layout.rows:
        raise ValueError(f"rows ({start}, {stop}) are not a non-empty range within 0..{layout.rows}")
    whole = row_regions(layout)
    if whole is None:
        return None
    part = payload_layout(layout.method, stop - start, layout.cols, domain=layout.domain)
    cut = row_regions(part)
    assert cut is not None  # same columns, so the same byte alignment
    copies = [
        (region.offset, region.size, into.offset)
        if per_row is None
        else (region.offset + start * per_row, (stop - start) * per_row, into.offset)
        for (region, per_row), (into, _) in zip(whole, cut, strict=True)
    ]
    return part, copies
