"""`MCFWriter` and `write_mcf`: stream tensors into an MCF file, then write the index sections and the directory.

File layout we write: the 40-byte header, the TensorData section (every tensor on a 64-byte boundary of the file,
zero padding between), then the HF resource sections, ModelInfo, QuantInfo and TensorIndex (each 8-aligned), then the
section directory sorted by type. The file is written under a temporary name and renamed into place only when complete,
so a failed write never leaves a truncated MCF behind or clobbers an existing file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol, runtime_checkable

import ml_dtypes
import numpy as np

from ..errors import MCFError
from ..safetensors._files import create_temp_beside, describe_os_error, output_problem
from ._container import (
    FLAG_TENSOR_DATA_ALIGNED64,
    HEADER_SIZE,
    MAJOR_VERSION,
    MINOR_VERSION,
    RESOURCE_FILES,
    MCFHeader,
    QuantRecord,
    SectionEntry,
    TensorEntry,
    align,
    encode_directory,
    encode_header,
    encode_quant_info,
    encode_tensor_index,
)
from ._layout import payload_size
from ._modelinfo import ModelInfo
from ._types import MCFDType, QuantDomain, QuantMethod, SectionType

__all__ = ["MCFWriter", "QuantizedPayload", "write_mcf"]

_TENSOR_ALIGN = 64

_DTYPES_BY_NUMPY: dict[np.dtype[Any], MCFDType] = {
    np.dtype("float32"): MCFDType.F32,
    np.dtype("float16"): MCFDType.F16,
    np.dtype(ml_dtypes.bfloat16): MCFDType.BF16,
    np.dtype("float64"): MCFDType.F64,
    np.dtype("int8"): MCFDType.I8,
    np.dtype("uint8"): MCFDType.U8,
    np.dtype("int16"): MCFDType.I16,
    np.dtype("uint16"): MCFDType.U16,
    np.dtype("int32"): MCFDType.I32,
    np.dtype("uint32"): MCFDType.U32,
    np.dtype("int64"): MCFDType.I64,
    np.dtype("uint64"): MCFDType.U64,
}


@runtime_checkable
class QuantizedPayload(Protocol):
    """What the writer needs from a quantized tensor (``carton.mcf.quantize`` returns such an object)."""

    @property
    def method(self) -> QuantMethod | str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def payload(self) -> Any: ...
    @property
    def min_clip(self) -> float: ...
    @property
    def max_clip(self) -> float: ...


@dataclass(frozen=True, slots=True)
class _Pending:
    name: str
    dtype: MCFDType
    shape: tuple[int, ...]
    data_offset: int
    data_size: int
    method: QuantMethod | None
    domain: QuantDomain
    min_clip: float
    max_clip: float


class MCFWriter:
    """Build an MCF file tensor by tensor::

        with MCFWriter("model.mcf", model_info=ModelInfo(arch=Architecture.LLAMA)) as w:
            w.add_tensor("model.norm.weight", norm)
            w.add_quantized("model.layers.0.mlp.up_proj.weight", carton.mcf.quantize(up, "k4"))
            w.add_resource(SectionType.HF_CONFIG, config_bytes)

    Leaving the block normally finalizes the file (`close()`); an exception discards it (`abort()`). With
    ``dedup=True`` a tensor whose bytes equal an earlier tensor's shares that tensor's data range.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, model_info: ModelInfo | None = None, dedup: bool = True
    ) -> None:
        self.path = Path(path)
        self.model_info = model_info if model_info is not None else ModelInfo()
        self.dedup = dedup
        self._resources: dict[int, bytes] = {}
        self._pending: dict[str, _Pending] = {}
        self._by_digest: dict[tuple[int, bytes], int] = {}
        self._data_start: int | None = None
        self._done = False
        problem = output_problem(self.path)
        if problem is not None:
            raise MCFError(f"{self.path}: cannot write the MCF file: {problem[1]}")
        try:
            fd, self._tmp_path = create_temp_beside(self.path)
        except OSError as exc:
            raise MCFError(f"{self.path}: cannot write the MCF file: {describe_os_error(exc)}") from exc
        self._file: IO[bytes] = os.fdopen(fd, "w+b")
        with self._writing():
            self._file.write(bytes(HEADER_SIZE))

    # --- adding content -------------------------------------------------------------------------------------
    def set_model_info(self, model_info: ModelInfo) -> None:
        """Replace the ModelInfo section written at `close` (the constructor's ``model_info=`` does the same)."""
        self._check_open()
        self.model_info = model_info

    def add_resource(self, section: SectionType | int | str, data: bytes | bytearray | memoryview) -> None:
        """Carry a raw Hugging Face file: ``SectionType.HF_CONFIG`` or its file name ``"config.json"``."""
        self._check_open()
        if isinstance(section, str):
            by_name = {filename: stype for stype, filename in RESOURCE_FILES.items()}
            if section not in by_name:
                raise MCFError(f"{section!r} is not an MCF resource file (one of {sorted(by_name)})")
            section = by_name[section]
        if section not in RESOURCE_FILES:
            raise MCFError(f"section type 0x{int(section):04x} is not a raw resource section (0x0100..0x0105)")
        if section in self._resources:
            raise MCFError(f"resource {RESOURCE_FILES[SectionType(section)]} was already added")
        self._resources[int(section)] = bytes(data)

    def add_tensor(self, name: str, array: np.ndarray[Any, Any]) -> None:
        """Store a float or integer array as is (little-endian, C order)."""
        self._check_name(name)
        if not isinstance(array, np.ndarray):
            raise MCFError(f"tensor {name!r}: expected a numpy array, got {type(array).__name__}")
        dtype = _DTYPES_BY_NUMPY.get(array.dtype.newbyteorder("=")) if array.dtype.byteorder in "<>" else None
        dtype = dtype or _DTYPES_BY_NUMPY.get(array.dtype)
        if dtype is None:
            raise MCFError(
                f"tensor {name!r}: numpy dtype {array.dtype} has no MCF equivalent "
                "(float32/16/64, bfloat16, int8..64, uint8..64)"
            )
        little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        raw = little.reshape(-1).view(np.uint8).data
        offset, size = self._write_data(raw)
        self._pending[name] = _Pending(
            name, dtype, tuple(int(d) for d in array.shape), offset, size, None, QuantDomain.WEIGHTS, 0.0, 0.0
        )

    def add_quantized(
        self,
        name: str,
        quantized: QuantizedPayload | None = None,
        *,
        method: QuantMethod | str | None = None,
        payload: bytes | bytearray | memoryview | np.ndarray[Any, Any] | None = None,
        shape: tuple[int, ...] | None = None,
        min_clip: float = 0.0,
        max_clip: float = 0.0,
        domain: QuantDomain | int = QuantDomain.WEIGHTS,
    ) -> None:
        """Store a quantized tensor: either an object from ``carton.mcf.quantize`` or ``method``, ``payload``,
        ``shape`` (rows, cols) and the clip bounds. The payload size must match the method and shape exactly."""
        self._check_name(name)
        if quantized is not None:
            method, payload, shape = quantized.method, quantized.payload, tuple(quantized.shape)
            min_clip, max_clip = quantized.min_clip, quantized.max_clip
            domain = getattr(quantized, "domain", QuantDomain.WEIGHTS)
        if method is None or payload is None or shape is None:
            raise MCFError(f"tensor {name!r}: give a quantized tensor, or method, payload and shape")
        try:
            qmethod = QuantMethod(method)
            qdomain = QuantDomain(domain)
        except ValueError as exc:
            raise MCFError(f"tensor {name!r}: {exc}") from exc
        if len(shape) != 2:
            raise MCFError(f"tensor {name!r}: quantized tensors must have rank 2, shape is {tuple(shape)}")
        rows, cols = (int(d) for d in shape)
        if qmethod.family != "int" and qdomain != QuantDomain.WEIGHTS:
            raise MCFError(f"tensor {name!r}: {qmethod.value} allows only the weights domain")
        try:
            raw = (
                np.ascontiguousarray(payload).reshape(-1).view(np.uint8).data
                if isinstance(payload, np.ndarray)
                else memoryview(payload).cast("B")
            )
        except (TypeError, ValueError) as exc:
            raise MCFError(f"tensor {name!r}: payload is not a contiguous byte buffer: {exc}") from exc
        want = payload_size(qmethod, rows, cols, domain=qdomain)
        if len(raw) != want:
            raise MCFError(
                f"tensor {name!r}: {qmethod.value} payload for shape ({rows}, {cols}) must be {want} bytes, "
                f"got {len(raw)}"
            )
        offset, size = self._write_data(raw)
        self._pending[name] = _Pending(
            name, qmethod.dtype, (rows, cols), offset, size, qmethod, qdomain, float(min_clip), float(max_clip)
        )

    # --- finishing ------------------------------------------------------------------------------------------
    def close(self) -> Path:
        """Write the index sections, the directory and the header, then move the file into place."""
        if self._done:
            return self.path
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Discard everything written so far."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError):  # closing flushes; a full disk must not keep the file from going
            self._file.close()
        with contextlib.suppress(OSError):
            self._tmp_path.unlink(missing_ok=True)

    def __enter__(self) -> MCFWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # --- internals ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._done:
            raise MCFError(f"{self.path}: writer is already closed")

    def _check_name(self, name: str) -> None:
        self._check_open()
        if not isinstance(name, str) or not name:
            raise MCFError(f"tensor name must be a non-empty string, got {name!r}")
        if "\x00" in name:
            raise MCFError(f"tensor name {name!r} contains a NUL character")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise MCFError(f"tensor name {name!r} cannot be encoded as UTF-8") from exc
        if name in self._pending:
            raise MCFError(f"tensor {name!r} was already added")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Around writes to the temporary file: an OSError (disk full, the target turned into a folder, ...) discards
        the temporary file and becomes an `MCFError` naming the target."""
        try:
            yield
        except OSError as exc:
            self.abort()
            problem = output_problem(self.path)
            reason = problem[1] if problem is not None else describe_os_error(exc)
            raise MCFError(f"{self.path}: cannot write the MCF file: {reason}") from exc

    def _write_data(self, raw: memoryview) -> tuple[int, int]:
        with self._writing():
            return self._append(raw)

    def _append(self, raw: memoryview) -> tuple[int, int]:
        f = self._file
        position = f.tell()
        offset = align(position, _TENSOR_ALIGN)
        if self._data_start is None:
            self._data_start = offset
        size = len(raw)
        if size and self.dedup:
            key = (size, hashlib.sha256(raw).digest())
            earlier = self._by_digest.get(key)
            if earlier is not None:
                f.flush()
            if earlier is not None and os.pread(f.fileno(), size, earlier) == raw:
                return earlier, size
            self._by_digest[key] = offset
        f.write(bytes(offset - position))
        f.write(raw)
        return offset, size

    def _finish(self) -> None:
        self._check_open()
        with self._writing():
            self._write_index_and_rename()
        self._done = True

    def _write_index_and_rename(self) -> None:
        f = self._file
        sections: list[SectionEntry] = []
        ordered = sorted(self._pending.values(), key=lambda p: p.name.encode("utf-8"))
        if ordered:
            start = self._data_start if self._data_start is not None else align(f.tell(), _TENSOR_ALIGN)
            f.seek(0, os.SEEK_END)
            end = max([start] + [p.data_offset + p.data_size for p in ordered])
            sections.append(SectionEntry(type=SectionType.TENSOR_DATA, version=1, offset=start, size=end - start))
        payloads: list[tuple[int, bytes]] = sorted(self._resources.items())
        payloads.append((SectionType.MODEL_INFO, self.model_info.encode()))
        records = [
            QuantRecord.for_method(p.method, tensor_index=i, domain=p.domain, min_clip=p.min_clip, max_clip=p.max_clip)
            for i, p in enumerate(ordered)
            if p.method is not None
        ]
        if records:
            payloads.append((SectionType.QUANT_INFO, encode_quant_info(records)))
        if ordered:
            entries = [
                TensorEntry(
                    name=p.name,
                    index=i,
                    dtype=p.dtype,
                    shape=p.shape,
                    data_offset=p.data_offset,
                    data_size=p.data_size,
                )
                for i, p in enumerate(ordered)
            ]
            payloads.append((SectionType.TENSOR_INDEX, encode_tensor_index(entries)))
        for stype, payload in payloads:
            offset = self._pad_to(8)
            f.write(payload)
            sections.append(SectionEntry(type=stype, version=1, offset=offset, size=len(payload)))
        sections.sort(key=lambda s: s.type)
        dir_offset = self._pad_to(8)
        f.write(encode_directory(sections))
        file_size = f.tell()
        flags = FLAG_TENSOR_DATA_ALIGNED64
        header = MCFHeader(
            major=MAJOR_VERSION,
            minor=MINOR_VERSION,
            header_size=HEADER_SIZE,
            section_count=len(sections),
            section_dir_offset=dir_offset,
            file_size=file_size,
            flags=flags,
        )
        f.seek(0)
        f.write(encode_header(header))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._tmp_path.replace(self.path)

    def _pad_to(self, alignment: int) -> int:
        position = self._file.tell()
        target = align(position, alignment)
        self._file.write(bytes(target - position))
        return target


def write_mcf(
    path: str | os.PathLike[str],
    *,
    tensors: Mapping[str, np.ndarray[Any, Any] | QuantizedPayload | tuple[Any, ...]],
    model_info: ModelInfo | None = None,
    resources: Mapping[SectionType | int | str, bytes] | None = None,
    dedup: bool = True,
) -> Path:
    """Write a whole MCF file at once. A tensor is a numpy array, a quantized tensor from ``carton.mcf.quantize``, or
    a tuple ``(method, payload, shape, min_clip, max_clip)``."""
    with MCFWriter(path, model_info=model_info, dedup=dedup) as writer:
        for name, tensor in tensors.items():
            if isinstance(tensor, np.ndarray):
                writer.add_tensor(name, tensor)
            elif isinstance(tensor, tuple):
                if len(tensor) != 5:
                    raise MCFError(
                        f"tensor {name!r}: a quantized tuple is (method, payload, shape, min_clip, max_clip), "
                        f"got {len(tensor)} items"
                    )
                method, payload, shape, min_clip, max_clip = tensor
                writer.add_quantized(
                    name, method=method, payload=payload, shape=tuple(shape), min_clip=min_clip, max_clip=max_clip
                )
            elif isinstance(tensor, QuantizedPayload):
                writer.add_quantized(name, tensor)
            else:
                raise MCFError(f"tensor {name!r}: unsupported value of type {type(tensor).__name__}")
        for section, data in (resources or {}).items():
            writer.add_resource(section, data)
    return Path(path)
