"""Header templates: the infer fast path for a tensor layout seen before.

A model is called again and again with the same tensor names, dtypes and shapes, so the ``tensors`` part of its
infer headers is the same bytes every time; only the request ``id`` differs. Both ends keep, per connection:

* an **encode cache**, (name, dtype, shape) of each tensor -> the msgpack bytes of the header after the ``id``.
  A header is then ``prefix + packed id + cached tail``: byte for byte what `encode` makes of the same message.
* a **decode cache**, the exact bytes after the ``id`` -> a `Plan` of the tensors those bytes declare. A plan is
  only made from a header the full decoder (`decode_request`/`decode_reply` + `decode_tensors`) has just accepted,
  so every check
  that depends on the header alone (names, datatypes, shape products, sizes, limits, header size) already passed
  for those very bytes. What depends on the data is checked on every call: the number of data frames, each
  frame's byte count and BOOL bytes. A header whose bytes differ in any way (another field, ``drop``, shared
  memory, nested or string tensors) misses and takes the full decoder.

Only the codec (`carton_protocol._codec`) uses these caches: its callers never see which path a message took.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from ._framing import DIRECT_WIRE_TYPES, FIXED_WIRE_TYPES
from ._limits import WireLimits
from ._messages import Infer, InferReply, TensorEntry, encode
from ._runner import Tensor
from .errors import FrameError

__all__ = ["PACK_U32", "REPLY_PREFIX", "REQUEST_PREFIX", "Layout", "LearntRequest", "Plan", "Templates", "pack_id"]

#: ``{"op": "infer", "id": `` as msgpack (a map of 3): the start of every plain infer request.
REQUEST_PREFIX = b"\x83\xa2op\xa5infer\xa2id"
#: ``{"reply": "infer", "id": `` (a map of 3): the start of every plain infer reply.
REPLY_PREFIX = b"\x83\xa5reply\xa5infer\xa2id"
# What follows the id in both: the key of the third and last field.
_MIDDLE = b"\xa7tensors"
# Layouts remembered per cache; a peer cycling through more shapes than this just takes the full path more often.
_MAX_TEMPLATES = 256
# The longest msgpack encoding of an id (0xcf + 8 bytes), so a cached tail stays within max_header_bytes.
_MAX_ID_BYTES = 9

# (name, dtype, shape) of each tensor of a message.
Layout = tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...]
_UNKNOWN: Any = object()
#: `Templates.learnt`: a header's length, its bytes up to and with the id's marker, its bytes after the id, what reads
#: the id (at the offset that follows), and its one tensor's name, dtype, shape and byte size.
LearntRequest = tuple[
    int, bytes, bytes, Callable[[bytes, int], tuple[int]], int, str, np.dtype[Any], tuple[int, ...], int
]

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_PACK_U8 = struct.Struct(">BB")
_PACK_U16 = struct.Struct(">BH")
#: A msgpack uint32: its marker (0xCE) and the value, packed in one call (an id past 65535, `pack_id`'s usual case).
PACK_U32 = struct.Struct(">BI")
_PACK_U64 = struct.Struct(">BQ")
_SMALL_IDS = [bytes([value]) for value in range(128)]
# A wider msgpack uint's marker -> (its width with the marker, what reads the value after the marker).
_ID_READERS = {
    0xCC: (2, _U8.unpack_from),
    0xCD: (3, _U16.unpack_from),
    0xCE: (5, _U32.unpack_from),
    0xCF: (9, _U64.unpack_from),
}


def pack_id(value: int) -> bytes:
    """A non-negative int in msgpack's shortest encoding (as msgspec's encoder writes it)."""
    # The marker and the value in one `pack` (no concatenation after it).
    if value < 128:
        return _SMALL_IDS[value]
    if value < 1 << 8:
        return _PACK_U8.pack(0xCC, value)
    if value < 1 << 16:
        return _PACK_U16.pack(0xCD, value)
    if value < 1 << 32:
        return PACK_U32.pack(0xCE, value)
    return _PACK_U64.pack(0xCF, value)


def _unpack_id(data: bytes, position: int) -> tuple[int, int]:
    """(id, position after it) for a non-negative msgpack int at `position`, or (-1, -1) for anything else."""
    if position >= len(data):
        return -1, -1
    marker = data[position]
    if marker < 0x80:
        return marker, position + 1
    try:
        if marker == 0xCC:
            return _U8.unpack_from(data, position + 1)[0], position + 2
        if marker == 0xCD:
            return _U16.unpack_from(data, position + 1)[0], position + 3
        if marker == 0xCE:
            return _U32.unpack_from(data, position + 1)[0], position + 5
        if marker == 0xCF:
            return _U64.unpack_from(data, position + 1)[0], position + 9
    except struct.error:
        pass
    return -1, -1


class Plan:
    """The tensors a cached header declares, each read from its own data frame."""

    __slots__ = ("items", "single")

    def __init__(self, items: tuple[tuple[str, np.dtype[Any], tuple[int, ...], int, int, bool], ...]) -> None:
        self.items = items  # (name, dtype, shape, size, element count, is BOOL)
        # A plan of one tensor that is neither empty nor BOOL (most models' one input or output): its name, dtype,
        # shape and size, read without the general loop.
        self.single: tuple[str, np.dtype[Any], tuple[int, ...], int] | None = None
        if len(items) == 1 and items[0][4] > 0 and not items[0][5]:
            self.single = items[0][:4]

    def decode(self, frames: Sequence[Any]) -> dict[str, Tensor]:
        """Arrays over the data frames' buffers (`zmq.Frame`s, whose length is their byte count), after the checks
        that depend on the data (frame count, sizes, BOOL)."""
        single = self.single
        if single is not None and len(frames) == 1:
            name, dtype, shape, size = single
            frame = frames[0]
            if len(frame) == size:
                return {name: np.ndarray(shape, dtype, frame)}
        items = self.items
        if len(frames) != len(items):
            raise FrameError(f"message has {len(frames)} data frames, the header accounts for {len(items)}")
        tensors: dict[str, Tensor] = {}
        for (name, dtype, shape, size, count, is_bool), frame in zip(items, frames):  # noqa: B905 - lengths checked
            # The frame itself is the buffer: `frame.buffer` would make a memoryview of it on every call.
            length = len(frame)
            if length != size:
                raise FrameError(f"tensor {name!r}: data frame is {length} bytes, header says {size}")
            if count == 0:
                array = np.empty(shape, dtype)
            else:
                array = np.ndarray(shape, dtype, frame)  # one call: np.frombuffer then reshape costs two
                if is_bool and array.view(np.uint8).max() > 1:
                    raise FrameError(f"tensor {name!r}: BOOL bytes must be 0 or 1")
            tensors[name] = array
        return tensors


class Templates:
    """The encode and decode caches of one connection end (a socket-owning thread; not thread-safe to fill,
    but concurrent readers only ever see complete entries, so sharing one between threads is safe)."""

    __slots__ = ("_decode", "_encode", "_last", "_limits", "_message", "_peer_prefix", "_prefix")

    def __init__(self, *, limits: WireLimits, sends: type[Infer] | type[InferReply]) -> None:
        """`sends` is `Infer` (the host: sends requests, reads replies) or `InferReply` (the runner)."""
        self._message = sends
        self._prefix, self._peer_prefix = (
            (REQUEST_PREFIX, REPLY_PREFIX) if sends is Infer else (REPLY_PREFIX, REQUEST_PREFIX)
        )
        self._limits = limits
        self._encode: dict[Hashable, tuple[bytes, int] | None] = {}
        self._decode: dict[bytes, Plan] = {}
        # The last header matched, as its bytes after the id and their plan: one peer sends one layout again and
        # again, and comparing with the last one costs less than slicing the header and hashing it for the lookup.
        # One tuple, read and replaced whole (the host's calling threads match concurrently).
        # With the length of the prefix and tail together: the id's width is what the header has beyond them.
        self._last: tuple[bytes, Plan, int] | None = None

    # --- sending ---------------------------------------------------------------------------------------------
    def encode(
        self, request_id: int, tensors: Mapping[str, Tensor], threshold: int, layout_key: Hashable | None = None
    ) -> list[Any] | None:
        """The parts of an infer message numbered `request_id` (its header, then the arrays as data frames) when
        `tensors` are plain contiguous arrays all under `threshold` bytes in a layout seen before, else None.

        `layout_key`, when given, stands for `tensors`' layout: the caller vouches that they are plain numpy arrays
        and that the same key always comes with the same names, dtypes and shapes in the same order. The cache is then
        looked up by it, without building and hashing the layout (the host checks inputs by the same layout first)."""
        if layout_key is None:
            entries = []
            for name, value in tensors.items():
                if type(value) is not np.ndarray or not value.flags.c_contiguous:
                    return None
                entries.append((name, value.dtype, value.shape))
            layout_key = layout = tuple(entries)
            cached = self._encode.get(layout, _UNKNOWN)
        else:
            for value in tensors.values():
                if not value.flags.c_contiguous:  # type: ignore[union-attr]  # an ndarray, as the caller vouches
                    return None
            cached = self._encode.get(layout_key, _UNKNOWN)
            if cached is _UNKNOWN:
                layout = tuple((name, value.dtype, value.shape) for name, value in tensors.items())  # type: ignore[union-attr]
        if cached is _UNKNOWN:
            cached = self._learn_encoding(layout_key, layout)
        if cached is None or cached[1] >= threshold:
            return None
        # Past the first 65535 calls ids take four bytes for four billion more: that case of `pack_id` written out.
        packed = PACK_U32.pack(0xCE, request_id) if 1 << 16 <= request_id < 1 << 32 else pack_id(request_id)
        return [self._prefix + packed + cached[0], *tensors.values()]

    def _learn_encoding(self, key: Hashable, layout: Layout) -> tuple[bytes, int] | None:
        entries = []
        largest = 0
        result: tuple[bytes, int] | None = None
        for name, dtype, shape in layout:
            wire = DIRECT_WIRE_TYPES.get(dtype)
            if wire is None or type(name) is not str:
                break
            size = dtype.itemsize
            for dim in shape:
                size *= dim
            largest = max(largest, size)
            entries.append(TensorEntry(name=name, datatype=wire, shape=shape, size=size))
        else:
            # The whole message with id 0 (one byte), minus its prefix and that byte: the rest never depends on it.
            packed = encode(self._message(id=0, tensors=tuple(entries)))
            result = (packed[len(self._prefix) + 1 :], largest)
        if len(self._encode) >= _MAX_TEMPLATES:
            self._encode.clear()
        self._encode[key] = result
        return result

    # --- receiving -------------------------------------------------------------------------------------------
    def match(self, data: bytes) -> tuple[int, Plan] | None:
        """(id, plan) when `data` is a header whose bytes after the id were accepted before, else None."""
        prefix = self._peer_prefix
        if not data.startswith(prefix):
            return None
        last = self._last
        if last is not None and data.endswith(last[0]):
            # The last layout again (one peer sends one layout again and again): what lies between the prefix and
            # its tail must be the id, one msgpack uint of exactly that width. Ids soon pass 127, so the wider
            # encodings are read here too, without `_unpack_id`'s call and its marker tests one by one.
            position = len(prefix)
            width = len(data) - last[2]
            marker = data[position] if width > 0 else 0
            if width == 1:
                if marker < 0x80:
                    return marker, last[1]
            elif width > 1:
                reader = _ID_READERS.get(marker)
                if reader is not None and reader[0] == width:
                    return reader[1](data, position + 1)[0], last[1]
        position = len(prefix)
        if len(data) > position and data[position] < 0x80:  # ids up to 127 are one byte: the common case, inline
            request_id = data[position]
            position += 1
        else:
            request_id, position = _unpack_id(data, position)
            if position < 0:
                return None
        tail = data[position:]
        plan = self._decode.get(tail)
        if plan is None:
            return None
        self._last = (tail, plan, len(prefix) + len(tail))
        return request_id, plan

    def learnt(self, data: bytes) -> LearntRequest | None:
        """What matching headers like `data` takes, when `match` reads `data` in the last layout it matched, that
        layout is one tensor in one data frame (neither empty nor BOOL) and the id is wider than one byte; else None.

        A header of exactly the length, with the head and the tail this gives is that layout with another id of the
        same width, one `match` reads as (``read(header, offset)[0]``, the layout's plan), the plan's tensor being an
        array of that name, dtype and shape over a data frame of exactly that size: what a caller that reads one
        layout again and again (the runner loop) checks itself, without `match`'s call and its general tests."""
        last = self._last
        prefix = self._peer_prefix
        if last is None or last[1].single is None or not data.startswith(prefix) or not data.endswith(last[0]):
            return None
        position = len(prefix)
        width = len(data) - last[2]
        reader = _ID_READERS.get(data[position]) if width > 1 else None
        if reader is None or reader[0] != width:
            return None
        name, dtype, shape, size = last[1].single
        return len(data), data[: position + 1], last[0], reader[1], position + 1, name, dtype, shape, size

    def learn(self, data: bytes, message: Infer | InferReply) -> None:
        """Remember the plan of `data`, a header the full decoder just accepted (with its data frames) as
        `message`."""
        prefix = self._peer_prefix
        if message.drop or not data.startswith(prefix):
            return
        if len(data) + _MAX_ID_BYTES > self._limits.max_header_bytes:
            return
        request_id, position = _unpack_id(data, len(prefix))
        if position < 0 or not data.startswith(_MIDDLE, position) or message.id != request_id:
            return
        items = []
        for entry in message.tensors:
            if entry.shm is not None or entry.nested is not None:
                return  # shared memory or nested: always decoded in full
            dtype = FIXED_WIRE_TYPES.get(entry.datatype or "")
            if dtype is None or entry.name is None or entry.shape is None or entry.size is None:
                return
            shape = entry.shape
            count = 1
            for dim in shape:
                count *= dim
            items.append((entry.name, dtype, shape, entry.size, count, entry.datatype == "BOOL"))
        if len(self._decode) >= _MAX_TEMPLATES:
            self._decode.clear()
        self._decode[data[position:]] = Plan(tuple(items))
