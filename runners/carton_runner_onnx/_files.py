"""Finding the ``.onnx`` file in the model folder and keeping every file it reads inside that folder.

ONNX models may keep tensors in "external data" files named by a relative ``location``. A hostile model could name
``../../etc/shadow``, an absolute path, or a symlink leading out of the folder; all three are refused here, before
onnxruntime sees the model (recent onnxruntime versions check too, older ones do not).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ._errors import OnnxRunnerError, UnsafeModelPath

__all__ = ["check_external_data", "find_model_file"]

# Every external data reference carries an entry whose key is exactly these bytes; a file without them has none.
_LOCATION_KEY = b"location"

# Protobuf field numbers on the path to initializer bytes:
# ModelProto.graph, GraphProto.initializer, TensorProto.raw_data.
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9
# raw_data fields shorter than this are scanned like everything else (skipping them would not save anything).
_MIN_SKIP = 4096
# Reading the structure is given up (the whole file is scanned) past this many fields: a graph of millions of tiny
# fields is scanned faster than it is walked in Python.
_MAX_FIELDS = 200_000


def find_model_file(model_dir: Path, model_file: str | None) -> Path:
    """Return the model to load: ``model_file`` (relative to the folder) or the folder's only ``*.onnx`` file."""
    root = model_dir.resolve()
    if model_file is not None:
        _check_relative(model_file, what=f"runner opt model_file={model_file!r}")
        candidate = model_dir / model_file
    else:
        found = sorted(path for path in model_dir.glob("*.onnx"))
        if not found:
            listing = ", ".join(sorted(path.name for path in model_dir.iterdir())) or "nothing"
            raise OnnxRunnerError(
                f"no .onnx file in the model folder (it holds: {listing}); set runner opt 'model_file'"
            )
        if len(found) > 1:
            names = ", ".join(path.name for path in found)
            raise OnnxRunnerError(f"several .onnx files in the model folder ({names}); set runner opt 'model_file'")
        candidate = found[0]
    _check_inside(candidate, root, what=f"model file {_display(candidate, model_dir)!r}")
    if not candidate.is_file():
        raise OnnxRunnerError(f"model file {_display(candidate, model_dir)!r} does not exist in the model folder")
    return candidate


def check_external_data(model_path: Path, model_dir: Path) -> None:
    """Refuse external data locations that are absolute, contain ``..``, lead out through a symlink, or are missing."""
    if not _mentions_location(model_path):
        return
    import onnx  # only for models that reference external data: importing it costs ~0.1 s

    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others for a corrupt protobuf
        raise OnnxRunnerError(f"{model_path.name} is not a valid ONNX model: {exc}") from exc
    root = model_dir.resolve()
    for tensor in _all_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entries = {entry.key: entry.value for entry in tensor.external_data}
        location = entries.get("location", "")
        what = f"external data of tensor {tensor.name!r} (location {location!r})"
        if not location:
            raise UnsafeModelPath(f"tensor {tensor.name!r} is marked as external data but has no location")
        _check_relative(location, what=what)
        target = model_path.parent / location
        _check_inside(target, root, what=what)
        if not target.is_file():
            raise UnsafeModelPath(f"{what}: the file does not exist in the model folder")


def _mentions_location(model_path: Path) -> bool:
    """Whether the bytes ``location`` occur anywhere outside the initializers' raw tensor bytes.

    An external data entry (``TensorProto.external_data``) is a field of its own, never inside another tensor's
    ``raw_data``, so those bytes (nearly all of a large model) are skipped rather than searched: the protobuf
    structure above them is read with the wire-format rules every protobuf parser applies. A file whose structure
    cannot be read that way (not a protobuf, groups, too many fields) is searched whole.
    """
    with model_path.open("rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            raise OnnxRunnerError(f"model file {model_path.name!r} is empty")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
            position = 0
            for start, end in _raw_data_ranges(view) or ():
                if view.find(_LOCATION_KEY, position, start) != -1:
                    return True
                position = end
            return view.find(_LOCATION_KEY, position) != -1


class _Unreadable(Exception):
    """The bytes do not follow the protobuf wire format the way the walk expects."""


def _raw_data_ranges(view: mmap.mmap) -> list[tuple[int, int]] | None:
    """Sorted ``(start, end)`` byte ranges of large ``raw_data`` fields of ``graph.initializer`` tensors, or ``None``
    when the file cannot be walked (then it is searched whole)."""
    ranges: list[tuple[int, int]] = []
    budget = [_MAX_FIELDS]
    try:
        for number, start, end in _fields(view, 0, len(view), budget):
            if number != _MODEL_GRAPH:
                continue
            for graph_number, tensor_start, tensor_end in _fields(view, start, end, budget):
                if graph_number != _GRAPH_INITIALIZER:
                    continue
                for tensor_number, data_start, data_end in _fields(view, tensor_start, tensor_end, budget):
                    if tensor_number == _TENSOR_RAW_DATA and data_end - data_start >= _MIN_SKIP:
                        ranges.append((data_start, data_end))
    except _Unreadable:
        return None
    return ranges


def _fields(view: mmap.mmap, position: int, end: int, budget: list[int]) -> Iterator[tuple[int, int, int]]:
    """``(field number, start, end)`` of each length-delimited field of the message in ``view[position:end]``;
    other wire types are stepped over. Raises `_Unreadable` for anything a protobuf parser would reject or that
    this walk does not follow (groups)."""
    while position < end:
        budget[0] -= 1
        if budget[0] < 0:
            raise _Unreadable
        tag, position = _varint(view, position, end)
        wire_type, number = tag & 7, tag >> 3
        if number == 0:
            raise _Unreadable
        if wire_type == 0:
            _, position = _varint(view, position, end)
        elif wire_type == 1:
            position += 8
        elif wire_type == 5:
            position += 4
        elif wire_type == 2:
            length, position = _varint(view, position, end)
            if position + length > end:
                raise _Unreadable
            yield number, position, position + length
            position += length
        else:  # 3 and 4 (groups) and the invalid 6 and 7
            raise _Unreadable
        if position > end:
            raise _Unreadable


def _varint(view: mmap.mmap, position: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= end or shift > 63:
            raise _Unreadable
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _check_relative(location: str, *, what: str) -> None:
    posix = PurePosixPath(location.replace("\\", "/"))
    if posix.is_absolute() or PureWindowsPath(location).is_absolute() or PureWindowsPath(location).drive:
        raise UnsafeModelPath(f"{what}: absolute paths are not allowed; use a path inside the model folder")
    if ".." in posix.parts:
        raise UnsafeModelPath(f"{what}: '..' is not allowed; use a path inside the model folder")


def _check_inside(path: Path, root: Path, *, what: str) -> None:
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        raise UnsafeModelPath(f"{what} resolves to {str(resolved)!r}, outside the model folder (through a symlink)")


def _display(path: Path, model_dir: Path) -> str:
    try:
        return str(path.relative_to(model_dir))
    except ValueError:
        return str(path)


def _all_tensors(model: Any) -> Iterator[Any]:
    """Every TensorProto of a ModelProto: initializers, Constant-like attributes, subgraphs, functions."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _graph_tensors(graph: Any) -> Iterator[Any]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: Any) -> Iterator[Any]:
    for attribute in node.attribute:
        if attribute.HasField("t"):
            yield attribute.t
        yield from attribute.tensors
        if attribute.HasField("sparse_tensor"):
            yield attribute.sparse_tensor.values
            yield attribute.sparse_tensor.indices
        for sparse in attribute.sparse_tensors:
            yield sparse.values
            yield sparse.indices
        if attribute.HasField("g"):
            yield from _graph_tensors(attribute.g)
        for subgraph in attribute.graphs:
            yield from _graph_tensors(subgraph)
