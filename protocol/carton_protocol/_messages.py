"""Control messages: the msgpack header every message starts with, and the typed readers that check its fields.

A message is a ZeroMQ multipart message: frame 0 is a msgpack map (the header), frames 1.. carry tensor bytes in
the order the header lists them (see `carton_protocol._framing`). Every request has ``op`` and ``id``; every reply
has ``id`` (the request's) and ``ok``. The full list of fields is in ``docs/protocol.md``.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from typing import Any

import msgpack

from ._limits import WireLimits
from ._runner import OptValue
from ._spec import DType, Shape, TensorSpec
from .errors import FrameError, LimitExceeded

__all__ = [
    "PROTOCOL_VERSION",
    "Op",
    "decode_opts",
    "decode_specs",
    "encode_specs",
    "field_bool",
    "field_int",
    "field_list",
    "field_map",
    "field_str",
    "hello_request",
    "infer_request",
    "pack_header",
    "unpack_header",
]

#: The wire protocol version both sides send in ``hello``. Fields only ever get added; anything that would break an
#: older peer bumps this number, and a peer that sees a different number refuses to talk (`VersionMismatch`).
PROTOCOL_VERSION = 1

_MAX_OPT_DEPTH = 32


class Op(enum.StrEnum):
    """Request operations, host to runner."""

    HELLO = "hello"
    LOAD = "load"
    PACK = "pack"
    INFER = "infer"
    RELEASE = "release"
    CLOSE = "close"


_local = threading.local()


def pack_header(header: Mapping[str, Any]) -> bytes:
    """Encode a header; keys keep their insertion order, so the bytes are deterministic (docs show them)."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        # One Packer per thread: reusing it costs half of what msgpack.packb does (Packers are not thread-safe).
        packer = _local.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    try:
        data: bytes = packer.pack(header)
    except (TypeError, ValueError, OverflowError) as exc:
        _local.packer = None  # a failed pack may leave bytes behind in the packer's buffer
        raise FrameError(f"header cannot be encoded: {exc}") from exc
    return data


def unpack_header(data: bytes | memoryview, limits: WireLimits) -> dict[str, Any]:
    """Decode frame 0. Sizes inside msgpack are bounded by the frame, and the frame by ``max_header_bytes``."""
    size = len(data)
    if size > limits.max_header_bytes:
        raise LimitExceeded(f"header frame is {size} bytes, over the {limits.max_header_bytes}-byte limit")
    try:
        header = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size,
            max_ext_len=0,
        )
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException) as exc:
        raise FrameError(f"header frame is not valid msgpack: {exc}") from exc
    if not isinstance(header, dict):
        raise FrameError(f"header frame is a msgpack {type(header).__name__}, expected a map")
    return header


def hello_request(*, host_pid: int, shm_threshold: int | None) -> dict[str, Any]:
    """The host's first message. ``shm_threshold`` absent means: no shared memory on this connection."""
    header: dict[str, Any] = {"op": Op.HELLO.value, "id": 0, "protocol": PROTOCOL_VERSION, "host_pid": host_pid}
    if shm_threshold is not None:
        header["shm_threshold"] = shm_threshold
    return header


def infer_request(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """An infer request header; the connection sets ``id`` when it sends it."""
    return {"op": Op.INFER.value, "id": 0, "tensors": entries}


def _missing(header: Mapping[str, Any], key: str, what: str) -> FrameError:
    return FrameError(f"{what}: field {key!r} is {'missing' if key not in header else 'of the wrong type'}")


def field_int(header: Mapping[str, Any], key: str, what: str, *, minimum: int = 0) -> int:
    value = header.get(key)
    if type(value) is not int:
        raise _missing(header, key, what)
    if value < minimum:
        raise FrameError(f"{what}: field {key!r} is {value}, below {minimum}")
    return value


def field_str(header: Mapping[str, Any], key: str, what: str) -> str:
    value = header.get(key)
    if type(value) is not str:
        raise _missing(header, key, what)
    return value


def field_bool(header: Mapping[str, Any], key: str, what: str) -> bool:
    value = header.get(key)
    if type(value) is not bool:
        raise _missing(header, key, what)
    return value


def field_list(header: Mapping[str, Any], key: str, what: str) -> list[Any]:
    value = header.get(key)
    if type(value) is not list:
        raise _missing(header, key, what)
    return value


def field_map(header: Mapping[str, Any], key: str, what: str) -> dict[str, Any]:
    value = header.get(key)
    if type(value) is not dict:
        raise _missing(header, key, what)
    return value


def encode_specs(specs: tuple[TensorSpec, ...]) -> list[dict[str, Any]]:
    encoded: list[dict[str, Any]] = []
    for spec in specs:
        entry: dict[str, Any] = {
            "name": spec.name,
            "dtype": DType(spec.dtype).value,
            "shape": spec.shape if isinstance(spec.shape, str) else list(spec.shape),
        }
        if spec.description is not None:
            entry["description"] = spec.description
        if spec.internal_name is not None:
            entry["internal_name"] = spec.internal_name
        encoded.append(entry)
    return encoded


def decode_specs(raw: object, what: str, limits: WireLimits) -> tuple[TensorSpec, ...]:
    if type(raw) is not list:
        raise FrameError(f"{what}: expected a list of tensor specs")
    if len(raw) > limits.max_tensors:
        raise LimitExceeded(f"{what}: {len(raw)} tensor specs, over the limit of {limits.max_tensors}")
    specs: list[TensorSpec] = []
    for index, entry in enumerate(raw):
        where = f"{what}[{index}]"
        if type(entry) is not dict:
            raise FrameError(f"{where}: expected a map")
        name = field_str(entry, "name", where)
        try:
            dtype = DType(field_str(entry, "dtype", where))
        except ValueError as exc:
            raise FrameError(f"{where} ({name!r}): unknown dtype {entry['dtype']!r}") from exc
        shape_raw = entry.get("shape")
        shape: Shape
        if type(shape_raw) is str:
            shape = shape_raw
        elif type(shape_raw) is list and len(shape_raw) <= limits.max_rank:
            if not all(type(dim) in (int, str) for dim in shape_raw):
                raise FrameError(f"{where} ({name!r}): shape entries must be ints or symbol names")
            shape = tuple(shape_raw)
        else:
            raise FrameError(f"{where} ({name!r}): shape must be a string or a list of at most {limits.max_rank}")
        description = entry.get("description")
        internal_name = entry.get("internal_name")
        if description is not None and type(description) is not str:
            raise FrameError(f"{where} ({name!r}): description must be a string")
        if internal_name is not None and type(internal_name) is not str:
            raise FrameError(f"{where} ({name!r}): internal_name must be a string")
        specs.append(
            TensorSpec(name=name, dtype=dtype, shape=shape, description=description, internal_name=internal_name)
        )
    return tuple(specs)


def decode_opts(raw: object, what: str) -> dict[str, OptValue]:
    """Runner options: maps with string keys, lists, str, int, float, bool (no nil, no binary)."""
    if type(raw) is not dict:
        raise FrameError(f"{what}: expected a map")
    _check_opt(raw, what, 0)
    return raw


def _check_opt(value: object, where: str, depth: int) -> None:
    if depth > _MAX_OPT_DEPTH:
        raise LimitExceeded(f"{where}: nested deeper than {_MAX_OPT_DEPTH}")
    kind = type(value)
    if kind in (str, int, float, bool):
        return
    if isinstance(value, list) and kind is list:
        for index, item in enumerate(value):
            _check_opt(item, f"{where}[{index}]", depth + 1)
        return
    if isinstance(value, dict) and kind is dict:
        for key, item in value.items():
            _check_opt(item, f"{where}.{key}", depth + 1)
        return
    raise FrameError(f"{where}: a runner option cannot be a {kind.__name__}")
