"""tensor_data: ``index.toml``, numeric ``.bin`` files (little-endian, C order), string tensors in TOML, nested
tensors built from ``inner`` tensors.

Reading accepts the original writers' quirks (``tensor = []``, ``inner = []`` on non-nested tensors). Writing
produces what the original reader requires: ``index.toml`` always present, ``tensor`` always a key, and an
``inner`` array on every entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tomli_w
from carton_protocol import DType, Tensor

from ..errors import PackError, TensorDataError
from ._config import parse_toml
from ._zipread import normalize_name

__all__ = ["INDEX_PATH", "NESTED", "IndexEntry", "TensorWriter", "load_tensor", "parse_index"]

INDEX_PATH = "tensor_data/index.toml"
NESTED = "nested"
_NUMERIC: dict[str, np.dtype[Any]] = {
    d.value: np.dtype(d.value).newbyteorder("<") for d in DType if d is not DType.STRING
}
_FROM_NUMPY = {np.dtype(d.value).str.lstrip("<>|="): d.value for d in DType if d is not DType.STRING}


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexEntry:
    """One ``[[tensor]]`` of index.toml: a numeric or string tensor with its file, or a nested one."""

    name: str
    dtype: str
    shape: tuple[int, ...] | None
    file: str | None
    inner: tuple[str, ...]


def parse_index(data: bytes, max_depth: int) -> dict[str, IndexEntry]:
    """``{name: entry}`` from index.toml bytes, with every reference between entries checked."""
    doc = parse_toml(data, INDEX_PATH, TensorDataError, max_depth)
    tensors = doc.get("tensor", [])
    if not isinstance(tensors, list):
        raise TensorDataError(f"{INDEX_PATH}: tensor must be an array of tables")
    entries: dict[str, IndexEntry] = {}
    for index, table in enumerate(tensors):
        where = f"{INDEX_PATH}: tensor[{index}]"
        if not isinstance(table, dict):
            raise TensorDataError(f"{where} must be a table")
        name, dtype = table.get("name"), table.get("dtype")
        if not isinstance(name, str) or not name:
            raise TensorDataError(f"{where}.name must be a non-empty string")
        where = f"{INDEX_PATH}: tensor {name!r}"
        if name in entries:
            raise TensorDataError(f"{where} is listed twice")
        if dtype != NESTED and dtype not in _NUMERIC and dtype != DType.STRING.value:
            raise TensorDataError(f"{where}: dtype {dtype!r} is not a carton dtype or 'nested'")
        inner = table.get("inner", [])
        if not isinstance(inner, list) or not all(isinstance(i, str) for i in inner):
            raise TensorDataError(f"{where}: inner must be an array of tensor names")
        if dtype == NESTED:
            if not inner:
                raise TensorDataError(f"{where}: a nested tensor needs a non-empty inner array")
            entries[name] = IndexEntry(name=name, dtype=NESTED, shape=None, file=None, inner=tuple(inner))
            continue
        shape, file = table.get("shape"), table.get("file")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise TensorDataError(f"{where}: shape must be an array of integers")
        if any(d < 0 for d in shape):
            raise TensorDataError(f"{where}: shape {shape} has a negative dimension")
        if not isinstance(file, str):
            raise TensorDataError(f"{where}: file must be a string")
        try:
            normalize_name(file.encode("utf-8"), 0x800, where)
        except Exception as exc:
            raise TensorDataError(f"{where}: file {file!r} is not a relative path inside tensor_data") from exc
        entries[name] = IndexEntry(name=name, dtype=dtype, shape=tuple(shape), file=file, inner=())
    for entry in entries.values():
        for inner_name in entry.inner:
            target = entries.get(inner_name)
            if target is None:
                raise TensorDataError(f"{INDEX_PATH}: nested tensor {entry.name!r} names unknown {inner_name!r}")
            if target.dtype == NESTED:
                raise TensorDataError(f"{INDEX_PATH}: nested tensor {entry.name!r} contains nested {inner_name!r}")
    return entries


def load_tensor(
    entries: Mapping[str, IndexEntry], name: str, read: Callable[[str], bytes], max_depth: int
) -> Tensor:
    """Load tensor ``name``; ``read(path)`` returns a verified file of the carton."""
    entry = entries[name]
    if entry.dtype == NESTED:
        loaded = [load_tensor(entries, inner, read, max_depth) for inner in entry.inner]
        return [t for t in loaded if isinstance(t, np.ndarray)]
    assert entry.file is not None and entry.shape is not None
    path = f"tensor_data/{entry.file}"
    data = read(path)
    count = math.prod(entry.shape)
    if entry.dtype == DType.STRING.value:
        doc = parse_toml(data, path, TensorDataError, max_depth)
        strings = doc.get("data")
        if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
            raise TensorDataError(f"{path}: data must be an array of strings (tensor {name!r})")
        if len(strings) != count:
            raise TensorDataError(
                f"{path}: tensor {name!r} has {len(strings)} strings but shape {list(entry.shape)} needs {count}"
            )
        return np.array(strings, dtype=np.str_).reshape(entry.shape)
    dtype = _NUMERIC[entry.dtype]
    if len(data) != count * dtype.itemsize:
        raise TensorDataError(
            f"{path}: tensor {name!r} is {len(data)} bytes but {entry.dtype} shape {list(entry.shape)} needs "
            f"{count * dtype.itemsize}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(entry.shape).astype(dtype.newbyteorder("="), copy=True)


def _as_tensor(value: object, where: str) -> Tensor:
    """A numpy array, a string array, or a list of arrays (nested) from what a caller passed to `carton.pack`."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, list) and value and all(isinstance(v, np.ndarray) for v in value):
        return list(value)
    if isinstance(value, str):
        return np.array(value, dtype=np.str_)
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:
        kind = type(value).__name__
        raise PackError(f"{where}: cannot make a tensor of this {kind} (ragged or mixed): {exc}") from exc
    if array.dtype == object:
        raise PackError(f"{where}: cannot make a tensor of a ragged or mixed-type list")
    return array


class TensorWriter:
    """Collects tensors for a new carton and produces ``tensor_data`` files (names follow the original writer)."""

    def __init__(self) -> None:
        self._files: dict[str, bytes] = {}
        self._index: list[dict[str, Any]] = []
        self._count = 0
        self._file_count = 0

    def add(self, value: object, where: str) -> str:
        """Store a tensor; returns its ``@tensor_data/...`` reference."""
        tensor = _as_tensor(value, where)
        name = f"_tensor_{self._count}"
        self._count += 1
        if isinstance(tensor, list):
            inner = []
            for i, item in enumerate(tensor):
                inner_name = f"_carton_nested_inner_{name}_{i}"
                self._add_plain(inner_name, item, f"{where}[{i}]")
                inner.append(inner_name)
            self._index.append({"name": name, "dtype": NESTED, "inner": inner})
        else:
            self._add_plain(name, tensor, where)
        return f"@tensor_data/{name}"

    def _add_plain(self, name: str, array: np.ndarray, where: str) -> None:
        file_index = self._file_count
        self._file_count += 1
        shape = [int(d) for d in array.shape]
        if array.dtype.kind == "U":
            file = f"tensor_{file_index}.toml"
            strings = [str(s) for s in np.ascontiguousarray(array).reshape(-1)]
            self._files[file] = tomli_w.dumps({"data": strings}).encode("utf-8")
            dtype = DType.STRING.value
        else:
            dtype_name = _FROM_NUMPY.get(array.dtype.str.lstrip("<>|="))
            if dtype_name is None:
                valid = ", ".join(d.value for d in DType)
                raise PackError(f"{where}: numpy dtype {array.dtype} has no carton dtype ({valid})")
            file = f"tensor_{file_index}.bin"
            self._files[file] = np.ascontiguousarray(array, dtype=_NUMERIC[dtype_name]).tobytes()
            dtype = dtype_name
        self._index.append({"name": name, "dtype": dtype, "shape": shape, "file": file, "inner": []})

    def files(self) -> dict[str, bytes]:
        """``{path: bytes}`` for the carton: every tensor file and ``tensor_data/index.toml`` (always written,
        since the original reader requires it)."""
        out = {f"tensor_data/{name}": data for name, data in self._files.items()}
        out[INDEX_PATH] = tomli_w.dumps({"tensor": self._index}).encode("utf-8")
        return out
