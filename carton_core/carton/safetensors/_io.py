"""Reading and writing safetensors with numpy: the reference package's numpy API, lazy and zero-copy.

A file is memory-mapped copy-on-write: tensors are numpy arrays over the mapped pages (writable, but writes stay
private to the process and never reach the file). Sub-byte dtypes (F4, F6) are packed in the file and unpacked on read,
so they are the one case that copies.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from ..errors import (
    SafetensorsError,
    SafetensorsFileNotFound,
    SafetensorsIsADirectory,
    SafetensorsNotADirectory,
    SafetensorsOSError,
    SafetensorsPermissionError,
)
from ._files import create_temp_beside, describe_os_error, output_problem
from ._header import DTypeInfo, Header, TensorInfo, build_header, dtype_for_array, parse_header

__all__ = ["Array", "SafeOpen", "TensorSlice", "load", "load_file", "safe_open", "save", "save_file"]

Array = np.ndarray[Any, Any]


# --- writing --------------------------------------------------------------------------------------------------
def _prepare(tensors: Mapping[str, Array]) -> tuple[list[tuple[str, DTypeInfo, tuple[int, ...]]], dict[str, Array]]:
    if not isinstance(tensors, Mapping):
        raise SafetensorsError(f"tensors must be a dict of str to numpy arrays, got {type(tensors).__name__}")
    specs = []
    arrays = {}
    for name, array in tensors.items():
        if not isinstance(name, str):
            raise SafetensorsError(f"tensor names must be str, got {name!r}")
        if name == "__metadata__":
            raise SafetensorsError("'__metadata__' is reserved and cannot name a tensor")
        if "\x00" in name:
            raise SafetensorsError(f"tensor name {name!r} contains a NUL character")
        if not isinstance(array, np.ndarray):
            raise SafetensorsError(f"tensor {name!r}: expected a numpy array, got {type(array).__name__}")
        info = dtype_for_array(array, name)
        specs.append((name, info, tuple(int(d) for d in array.shape)))
        arrays[name] = array
    return specs, arrays


def _raw_bytes(array: Array, info: DTypeInfo) -> memoryview:
    flat = np.ascontiguousarray(array, dtype=info.numpy).reshape(-1)
    if info.bits >= 8:
        return flat.view(np.uint8).data
    return _pack_subbyte(flat.view(np.uint8), info.bits).data


def save(tensors: Mapping[str, Array], metadata: Mapping[str, str] | None = None) -> bytes:
    """The safetensors bytes for ``tensors``; byte-identical to the reference's ``safetensors.numpy.save``."""
    specs, arrays = _prepare(tensors)
    header, order = build_header(specs, metadata)
    infos = {name: info for name, info, _ in specs}
    return header + b"".join(_raw_bytes(arrays[name], infos[name]) for name, _ in order)


def save_file(
    tensors: Mapping[str, Array], filename: str | os.PathLike[str], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` to ``filename`` (atomically: a temporary file renamed into place when complete)."""
    specs, arrays = _prepare(tensors)
    header, order = build_header(specs, metadata)
    infos = {name: info for name, info, _ in specs}
    path = Path(filename)
    problem = output_problem(path)
    if problem is not None:
        raise _os_error(f"{path}: cannot write: {problem[1]}", path, problem[0])
    try:
        fd, tmp = create_temp_beside(path)
    except OSError as exc:
        raise _os_error(f"{path}: cannot write: {describe_os_error(exc)}", path, exc.errno, exc.strerror) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            for name, _ in order:
                f.write(_raw_bytes(arrays[name], infos[name]))
        tmp.replace(path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if not isinstance(exc, OSError):
            raise
        # Name the target, not the temporary file; the state of the path explains most failures (e.g. the target
        # became a directory, or the folder vanished, while writing).
        code, reason = output_problem(path) or (exc.errno, describe_os_error(exc))
        raise _os_error(f"{path}: cannot write: {reason}", path, code, exc.strerror) from exc


_OS_ERRORS: dict[int, type[SafetensorsOSError]] = {
    errno.ENOENT: SafetensorsFileNotFound,
    errno.EISDIR: SafetensorsIsADirectory,
    errno.ENOTDIR: SafetensorsNotADirectory,
    errno.EACCES: SafetensorsPermissionError,
    errno.EPERM: SafetensorsPermissionError,
}


def _os_error(message: str, path: Path, code: int | None, strerror: str | None = None) -> SafetensorsOSError:
    """A `SafetensorsOSError` of the subclass matching ``code`` (so it is also a FileNotFoundError, ...), carrying
    ``errno``, ``strerror`` and ``filename`` like the OSError the reference package would raise."""
    exc = _OS_ERRORS.get(code, SafetensorsOSError)(message) if code is not None else SafetensorsOSError(message)
    exc.errno = code
    exc.strerror = strerror if strerror is not None else (os.strerror(code) if code is not None else None)
    exc.filename = str(path)
    return exc


# --- reading --------------------------------------------------------------------------------------------------
class SafeOpen:
    """An opened safetensors file (see `safe_open`). Parsing and validation happen on open; tensors are read on
    demand as arrays over the mapping."""

    def __init__(self, buffer: Any, *, name: str, mapping: mmap.mmap | None = None) -> None:
        self.name = name
        self._mapping = mapping
        self._buffer: memoryview | None = memoryview(buffer).cast("B")
        self._header: Header = parse_header(self._buffer, name)

    def __enter__(self) -> SafeOpen:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Drop this handle's reference to the mapping; arrays already returned keep it alive."""
        self._buffer = None
        self._mapping = None

    def keys(self) -> list[str]:
        """Tensor names, sorted (as the reference returns them)."""
        return sorted(self._header.tensors)

    def offset_keys(self) -> list[str]:
        """Tensor names in the order of their data in the file."""
        return [t.name for t in sorted(self._header.tensors.values(), key=lambda t: (t.begin, t.end))]

    def metadata(self) -> dict[str, str] | None:
        """The ``__metadata__`` map, or None when the header has none."""
        return None if self._header.metadata is None else dict(self._header.metadata)

    def get_tensor(self, name: str) -> Array:
        """The tensor as a numpy array over the file's bytes."""
        return _array(self._data(), self._info(name), self._header.data_start)

    def get_tensors(self) -> dict[str, Array]:
        return {name: self.get_tensor(name) for name in self.offset_keys()}

    def get_slice(self, name: str) -> TensorSlice:
        """A lazy handle: ``get_shape()``, ``get_dtype()`` and numpy basic indexing (``[0, 1:3, ...]``)."""
        info = self._info(name)
        return TensorSlice(info, lambda: _array(self._data(), info, self._header.data_start))

    def _info(self, name: str) -> TensorInfo:
        try:
            return self._header.tensors[name]
        except (KeyError, TypeError):
            raise SafetensorsError(f"{self.name}: file does not contain tensor {name!r}") from None

    def _data(self) -> memoryview:
        if self._buffer is None:
            raise SafetensorsError(f"{self.name}: file is closed")
        return self._buffer


class TensorSlice:
    """A tensor not yet read; indexing returns a numpy view of just the selected part (zero-copy)."""

    def __init__(self, info: TensorInfo, materialize: Any) -> None:
        self._info = info
        self._materialize = materialize

    def get_shape(self) -> list[int]:
        return list(self._info.shape)

    def get_dtype(self) -> str:
        return self._info.dtype.code

    @property
    def shape(self) -> tuple[int, ...]:
        return self._info.shape

    @property
    def ndim(self) -> int:
        return len(self._info.shape)

    def __len__(self) -> int:
        if not self._info.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._info.shape[0]

    def __getitem__(self, index: Any) -> Array:
        items = index if isinstance(index, tuple) else (index,)
        label = f"tensor {self._info.name!r} with shape {list(self._info.shape)}"
        for position, item in enumerate(items):
            if item is Ellipsis or isinstance(item, slice):
                continue
            if isinstance(item, int | np.integer) and not isinstance(item, bool):
                continue
            raise SafetensorsError(
                f"{label}: unsupported index {item!r} at position {position} (use ints, slices or ...)"
            )
        if sum(item is Ellipsis for item in items) > 1:
            raise SafetensorsError(f"{label}: an index can only have a single ellipsis")
        if len(items) - (Ellipsis in items) > len(self._info.shape):
            raise SafetensorsError(f"{label}: {len(items)} indices for {len(self._info.shape)} dimensions")
        try:
            return self._materialize()[index]  # type: ignore[no-any-return]
        except IndexError as exc:
            raise SafetensorsError(f"{label}: {exc}") from exc


def safe_open(filename: str | os.PathLike[str], framework: str = "numpy", device: str = "cpu") -> SafeOpen:
    """Open a safetensors file lazily (memory-mapped). Only numpy arrays on the CPU are produced here."""
    if framework not in ("numpy", "np"):
        raise SafetensorsError(f"framework {framework!r} is not supported: carton.safetensors produces numpy arrays")
    if device != "cpu":
        raise SafetensorsError(f"device {device!r} is not supported: carton.safetensors reads to the CPU")
    path = Path(filename)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise SafetensorsError(f"{path}: file is {size} bytes, too small for the 8-byte header length")
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as exc:
        raise _os_error(f"{path}: cannot open: {describe_os_error(exc)}", path, exc.errno, exc.strerror) from exc
    return SafeOpen(mapping, name=str(path), mapping=mapping)


def load_file(filename: str | os.PathLike[str]) -> dict[str, Array]:
    """All tensors of a file, as arrays over one copy-on-write mapping of it."""
    with safe_open(filename) as f:
        return f.get_tensors()


def load(data: bytes | bytearray | memoryview) -> dict[str, Array]:
    """All tensors of an in-memory safetensors image, as arrays over ``data`` (read-only if ``data`` is bytes)."""
    with SafeOpen(data, name="<bytes>") as f:
        return f.get_tensors()


# --- element access -------------------------------------------------------------------------------------------
def _array(buffer: memoryview, info: TensorInfo, data_start: int) -> Array:
    start = data_start + info.begin
    if info.dtype.bits >= 8:
        count = info.nbytes // info.dtype.numpy.itemsize
        return np.frombuffer(buffer, dtype=info.dtype.numpy, count=count, offset=start).reshape(info.shape)
    packed = np.frombuffer(buffer, dtype=np.uint8, count=info.nbytes, offset=start)
    count = 1
    for d in info.shape:
        count *= d
    codes = _unpack_subbyte(packed, info.dtype.bits, count)
    return codes.view(info.dtype.numpy).reshape(info.shape)


def _pack_subbyte(codes: Array, bits: int) -> Array:
    """Pack ``bits``-wide codes (one per uint8) into an LSB-first bit stream: element i at bits [i*bits, (i+1)*bits)."""
    mask = (1 << bits) - 1
    values = codes.astype(np.uint8) & mask
    if bits == 4:
        return np.ascontiguousarray(values[0::2] | (values[1::2] << 4))
    # 6-bit: four codes fill three bytes.
    quads = values.reshape(-1, 4).astype(np.uint32)
    word = quads[:, 0] | (quads[:, 1] << 6) | (quads[:, 2] << 12) | (quads[:, 3] << 18)
    out = np.empty((len(word), 3), dtype=np.uint8)
    out[:, 0] = word & 0xFF
    out[:, 1] = (word >> 8) & 0xFF
    out[:, 2] = (word >> 16) & 0xFF
    return out.reshape(-1)


def _unpack_subbyte(packed: Array, bits: int, count: int) -> Array:
    if bits == 4:
        out = np.empty(count, dtype=np.uint8)
        out[0::2] = packed & 0x0F
        out[1::2] = packed >> 4
        return out
    triples = packed.reshape(-1, 3).astype(np.uint32)
    word = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
    quads = np.stack([(word >> shift) & 0x3F for shift in (0, 6, 12, 18)], axis=1).astype(np.uint8)
    return quads.reshape(-1)[:count]
