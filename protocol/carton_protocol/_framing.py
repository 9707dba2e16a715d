"""Tensors on the wire, Triton-style: one header entry per tensor, then its raw little-endian C-order bytes.

Header entry of a tensor (a `TensorEntry`, a msgpack map in the header's ``tensors`` list)::

    {"name": "x", "datatype": "FP32", "shape": [1, 2], "size": 8}                 bytes in the next frame
    {"name": "x", "datatype": "FP32", "shape": [4096, 4096], "size": 67108864,
     "shm": ["h0", 0]}                                                             bytes in shared memory
    {"name": "x", "nested": [<entry without name>, ...]}                           a list of arrays

``size`` is the byte count. ``BYTES`` elements are a 4-byte little-endian length then the bytes (utf-8 text for
carton strings). The decoder checks every declared size against the limits and against the bytes that arrived
before it allocates anything.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._dtypes import WIRE_TYPES, WireType, from_numpy, to_numpy
from ._limits import WireLimits
from ._messages import TensorEntry
from ._runner import Tensor
from ._shm import PeerSegments, Segment, SegmentPool, align
from .errors import FrameError, LimitExceeded

__all__ = ["DIRECT_WIRE_TYPES", "FIXED_WIRE_TYPES", "Encoded", "decode_tensors", "encode_tensors", "shared_segments"]

_PREFIX = struct.Struct("<I")
# Largest dimension accepted: numpy's own limit is below 2**63, and no real tensor comes near this.
_MAX_DIM = 1 << 62
_EMPTY = b""


class Encoded:
    """An encoded set of tensors: header entries, data frames, and the shared-memory segment holding the rest."""

    __slots__ = ("entries", "frames", "segment")

    def __init__(self, entries: tuple[TensorEntry, ...], frames: list[Any], segment: Segment | None) -> None:
        self.entries = entries
        self.frames = frames
        self.segment = segment


def _bytes_payload(array: np.ndarray, name: str) -> bytes:
    parts: list[bytes] = []
    append = parts.append
    pack = _PREFIX.pack
    for element in array.reshape(-1).tolist():
        if type(element) is str:
            data = element.encode("utf-8")
        elif type(element) is bytes:
            raise FrameError(f"tensor {name!r}: string tensors must hold str, not bytes (decode them first)")
        else:
            raise FrameError(f"tensor {name!r}: string tensor holds a {type(element).__name__}, expected str")
        append(pack(len(data)))
        append(data)
    return _EMPTY.join(parts)


def _prepare(value: object, name: str) -> tuple[str, tuple[int, ...], Any, int]:
    """Wire type, shape, payload buffer and byte size of one array."""
    if not isinstance(value, np.ndarray):
        raise FrameError(f"tensor {name!r}: expected a numpy array, got {type(value).__name__}")
    wire = from_numpy(value.dtype, tensor=name)
    if wire is WireType.BYTES:
        payload: Any = _bytes_payload(value, name)
        size = len(payload)
    else:
        array = value
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        payload = array.reshape(-1).view(np.uint8)
        size = payload.nbytes
    return wire.value, value.shape, payload, size


# Fixed-size dtypes whose arrays, when C-contiguous, go out as they are (the common case, kept short).
DIRECT_WIRE_TYPES: dict[np.dtype[Any], str] = {
    np.dtype(code): wire.value
    for code, wire in (
        ("?", WireType.BOOL), ("<u1", WireType.UINT8), ("<u2", WireType.UINT16), ("<u4", WireType.UINT32),
        ("<u8", WireType.UINT64), ("<i1", WireType.INT8), ("<i2", WireType.INT16), ("<i4", WireType.INT32),
        ("<i8", WireType.INT64), ("<f2", WireType.FP16), ("<f4", WireType.FP32), ("<f8", WireType.FP64),
    )
}  # fmt: skip


def encode_tensors(tensors: Mapping[str, Tensor], *, pool: SegmentPool | None, threshold: int) -> Encoded:
    """Encode `tensors`; payloads of at least `threshold` bytes go to one segment from `pool` when there is one."""
    entries: list[TensorEntry | None] = []
    frames: list[Any] = []
    # Payloads bound for shared memory: (index in entries, name, datatype, shape, payload, size).
    big: list[tuple[int, str, str, tuple[int, ...], Any, int]] = []
    for name, value in tensors.items():
        if type(value) is np.ndarray:
            wire = DIRECT_WIRE_TYPES.get(value.dtype)
            if wire is not None and value.flags.c_contiguous and type(name) is str:
                size = value.nbytes
                if pool is not None and size >= threshold:
                    big.append((len(entries), name, wire, value.shape, value.reshape(-1).view(np.uint8), size))
                    entries.append(None)
                else:
                    entries.append(TensorEntry(name=name, datatype=wire, shape=value.shape, size=size))
                    frames.append(value)
                continue
        if type(name) is not str:
            raise FrameError(f"tensor names must be str, got {type(name).__name__} {name!r}")
        if isinstance(value, list | tuple):
            nested: list[TensorEntry] = []
            for index, item in enumerate(value):
                datatype, shape, payload, size = _prepare(item, f"{name}[{index}]")
                nested.append(TensorEntry(datatype=datatype, shape=shape, size=size))
                frames.append(payload)
            entries.append(TensorEntry(name=name, nested=tuple(nested)))
            continue
        datatype, shape, payload, size = _prepare(value, name)
        if pool is not None and size >= threshold:
            big.append((len(entries), name, datatype, shape, payload, size))
            entries.append(None)
        else:
            entries.append(TensorEntry(name=name, datatype=datatype, shape=shape, size=size))
            frames.append(payload)
    segment = None
    if big:
        assert pool is not None
        total = 0
        for *_, size in big:
            total = align(total) + size
        segment = pool.acquire(total)
        offset = 0
        for index, name, datatype, shape, payload, size in big:
            offset = align(offset)
            target = np.frombuffer(segment.mapping, np.uint8, count=size, offset=offset)
            if isinstance(payload, bytes):
                target[:] = np.frombuffer(payload, np.uint8)
            else:
                np.copyto(target, payload)
            entries[index] = TensorEntry(name=name, datatype=datatype, shape=shape, size=size, shm=(segment.id, offset))
            offset += size
    return Encoded(tuple(entries), frames, segment)  # type: ignore[arg-type]  # every None was replaced


def decode_tensors(
    entries: tuple[TensorEntry, ...],
    frames: Sequence[memoryview],
    *,
    limits: WireLimits,
    peer: PeerSegments | None,
    copy_shared: bool,
) -> tuple[dict[str, Tensor], list[str]]:
    """Tensors from header entries and data frames, and the ids of the peer segments that held any of them.

    Arrays decoded from frames are views over the frame buffers. Arrays in shared memory are views over the
    mapping, or copies when `copy_shared` (the host copies, so the runner may reuse its segment at once).
    """
    if len(entries) > limits.max_tensors:
        raise LimitExceeded(f"message declares {len(entries)} tensors, over the limit of {limits.max_tensors}")
    decoder = _Decoder(frames, limits, peer, copy_shared)
    tensors: dict[str, Tensor] = {}
    for index, entry in enumerate(entries):
        name = entry.name
        if name is None or not 0 < len(name) <= limits.max_name_length:
            raise FrameError(
                f"tensors[{index}]: 'name' must be a non-empty string of at most {limits.max_name_length} characters"
            )
        if name in tensors:
            raise FrameError(f"tensor {name!r} appears twice")
        nested = entry.nested
        if nested is None:
            tensors[name] = decoder.array(entry, name)
            continue
        if len(nested) > limits.max_nested:
            raise LimitExceeded(f"tensor {name!r}: {len(nested)} nested arrays, over the limit of {limits.max_nested}")
        items: list[np.ndarray] = []
        for position, item in enumerate(nested):
            where = f"{name}[{position}]"
            if item.nested is not None:
                raise FrameError(f"tensor {where!r}: nested entries must not be nested themselves")
            items.append(decoder.array(item, where))
        tensors[name] = items
    if decoder.next_frame != len(frames):
        raise FrameError(f"message has {len(frames)} data frames, the header accounts for {decoder.next_frame}")
    return tensors, decoder.segments


def shared_segments(entries: tuple[TensorEntry, ...]) -> list[str]:
    """The segment ids the entries' bytes lie in (what the reader must release once it has read them)."""
    used: list[str] = []
    for entry in entries:
        for item in (entry, *(entry.nested or ())):
            if item.shm is not None and item.shm[0] not in used:
                used.append(item.shm[0])
    return used


# Fixed-size wire types by name (BF16 included when ml_dtypes is installed).
FIXED_WIRE_TYPES: dict[str, np.dtype[Any]] = {}
for _wire in WireType:
    if _wire is not WireType.BYTES:
        with contextlib.suppress(FrameError):  # BF16 without ml_dtypes
            FIXED_WIRE_TYPES[_wire.value] = to_numpy(_wire, tensor="")


class _Decoder:
    __slots__ = ("copy_shared", "frames", "limits", "next_frame", "peer", "segments", "total")

    def __init__(
        self, frames: Sequence[memoryview], limits: WireLimits, peer: PeerSegments | None, copy_shared: bool
    ) -> None:
        self.frames = frames
        self.limits = limits
        self.peer = peer
        self.copy_shared = copy_shared
        self.next_frame = 0
        self.total = 0
        self.segments: list[str] = []

    def array(self, entry: TensorEntry, name: str) -> np.ndarray:
        limits = self.limits
        datatype = entry.datatype
        shape = entry.shape
        size = entry.size
        if shape is None:
            raise FrameError(f"tensor {name!r}: 'shape' must be a list of dimensions")
        if len(shape) > limits.max_rank:
            raise LimitExceeded(f"tensor {name!r}: rank {len(shape)} is over the limit of {limits.max_rank}")
        count = 1
        for dim in shape:
            if not 0 <= dim <= _MAX_DIM:
                raise FrameError(f"tensor {name!r}: shape {list(shape)!r} must hold ints from 0 to 2**62")
            count *= dim  # Python ints do not overflow; the product is checked against the size below
        if size is None or size < 0:
            raise FrameError(f"tensor {name!r}: 'size' must be a non-negative int")
        if size > limits.max_tensor_bytes:
            raise LimitExceeded(f"tensor {name!r}: {size} bytes, over the limit of {limits.max_tensor_bytes}")
        self.total += size
        if self.total > limits.max_message_bytes:
            raise LimitExceeded(f"message tensors total over {limits.max_message_bytes} bytes")
        if datatype is None:
            raise FrameError(f"tensor {name!r}: 'datatype' is missing")
        dtype = FIXED_WIRE_TYPES.get(datatype)
        if dtype is None:
            wire = WIRE_TYPES.get(datatype)
            if wire is None:
                raise FrameError(f"tensor {name!r}: unknown datatype {datatype!r}")
            if wire is WireType.BYTES:
                if count > limits.max_bytes_elements:
                    raise LimitExceeded(
                        f"tensor {name!r}: {count} BYTES elements, over the limit of {limits.max_bytes_elements}"
                    )
                if size < 4 * count:
                    raise FrameError(f"tensor {name!r}: {size} bytes cannot hold {count} length-prefixed elements")
                buffer, offset = self._locate(entry, name, size)
                return _decode_strings(buffer, offset, size, count, shape, name)
            dtype = to_numpy(wire, tensor=name)
        if count * dtype.itemsize != size:
            raise FrameError(
                f"tensor {name!r}: shape {list(shape)} of {datatype} needs {count * dtype.itemsize} bytes, "
                f"size says {size}"
            )
        buffer, offset = self._locate(entry, name, size)
        if count == 0:
            return _empty(shape, dtype, name)
        array = np.frombuffer(buffer, dtype, count, offset).reshape(shape)
        if datatype == "BOOL" and array.view(np.uint8).max() > 1:
            raise FrameError(f"tensor {name!r}: BOOL bytes must be 0 or 1")
        if self.copy_shared and entry.shm is not None:
            array = array.copy()
        return array

    def _locate(self, entry: TensorEntry, name: str, size: int) -> tuple[Any, int]:
        placement = entry.shm
        if placement is None:
            index = self.next_frame
            if index >= len(self.frames):
                raise FrameError(f"tensor {name!r}: its data frame is missing ({len(self.frames)} frames arrived)")
            self.next_frame = index + 1
            frame = self.frames[index]
            if len(frame) != size:
                raise FrameError(f"tensor {name!r}: data frame is {len(frame)} bytes, header says {size}")
            return frame, 0
        if self.peer is None:
            raise FrameError(f"tensor {name!r}: placed in shared memory, which this connection does not use")
        segment_id, offset = placement
        if offset < 0:
            raise FrameError(f"tensor {name!r}: 'shm' offset must be non-negative, got {offset}")
        segment = self.peer.get(segment_id)
        if offset + size > segment.size:
            raise FrameError(
                f"tensor {name!r}: bytes {offset}..{offset + size} lie outside segment {segment_id!r} "
                f"({segment.size} bytes)"
            )
        if segment_id not in self.segments:
            self.segments.append(segment_id)
        return segment.mapping, offset


def _empty(shape: tuple[int, ...], dtype: np.dtype[Any], name: str) -> np.ndarray:
    """A zero-element array; numpy refuses some shapes (``[0, 2**62, 2**62]``) even though they hold nothing."""
    try:
        return np.empty(shape, dtype)
    except ValueError as exc:
        raise FrameError(f"tensor {name!r}: shape {list(shape)} is too large for a numpy array") from exc


def _decode_strings(buffer: Any, offset: int, size: int, count: int, shape: tuple[int, ...], name: str) -> np.ndarray:
    data = memoryview(buffer)[offset : offset + size]
    values: list[str] = []
    position = 0
    unpack = _PREFIX.unpack_from
    try:
        for _ in range(count):
            if position + 4 > size:
                raise FrameError(f"tensor {name!r}: BYTES element {len(values)} has no length prefix")
            (length,) = unpack(data, position)
            position += 4
            if length > size - position:
                raise FrameError(
                    f"tensor {name!r}: BYTES element {len(values)} declares {length} bytes, {size - position} remain"
                )
            values.append(str(data[position : position + length], "utf-8"))
            position += length
    except UnicodeDecodeError as exc:
        raise FrameError(f"tensor {name!r}: BYTES element {len(values)} is not valid utf-8") from exc
    if position != size:
        raise FrameError(f"tensor {name!r}: {size - position} bytes left over after {count} BYTES elements")
    if not values:
        return _empty(shape, np.dtype("<U1"), name)
    return np.array(values, dtype=str).reshape(shape)
