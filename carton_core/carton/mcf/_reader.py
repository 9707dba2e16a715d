"""`MCFFile`: a validated, lazily read view of an MCF file (memory-mapped, or over bytes already in memory).

Opening checks the whole structure (header, directory, ModelInfo, QuantInfo, TensorIndex and every tensor's data
range and size) so that later accessors cannot fail on a malformed file; tensor bytes are never copied.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any

import numpy as np

from ..errors import MCFError
from ..safetensors._files import describe_os_error
from ..safetensors._header import fits_numpy
from ._container import (
    NUMPY_DTYPES,
    RESOURCE_FILES,
    MCFHeader,
    QuantRecord,
    SectionEntry,
    TensorEntry,
    decode_directory,
    decode_header,
    decode_quant_info,
    decode_tensor_index,
    plain_data_size,
    quant_method_of,
)
from ._decode import dequantize as _dequantize
from ._layout import payload_size
from ._modelinfo import ModelInfo
from ._types import MCFDType, QuantDomain, SectionType

__all__ = ["MCFFile", "open_mcf"]

_PARSED_SECTIONS = (SectionType.MODEL_INFO, SectionType.QUANT_INFO, SectionType.TENSOR_INDEX, SectionType.TENSOR_DATA)


class MCFFile:
    """A validated MCF file. Use `MCFFile.open(path)` (memory-mapped) or `MCFFile.from_bytes(data)`; close it, or use
    it as a context manager. Arrays and memoryviews it hands out stay valid after `close()` (they keep the mapping
    alive until they are released)."""

    header: MCFHeader
    sections: tuple[SectionEntry, ...]
    model_info: ModelInfo | None
    quant_info: Mapping[int, QuantRecord]
    tensors: Mapping[str, TensorEntry]

    def __init__(self, buffer: Any, *, name: str = "<bytes>", _mapping: mmap.mmap | None = None) -> None:
        self.name = name
        self._mapping = _mapping
        self._view: memoryview | None = memoryview(buffer).cast("B")
        try:
            self._parse(self._view)
        except BaseException:
            self.close()
            raise

    # --- construction ---------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> MCFFile:
        """Memory-map and validate ``path``. Raises `MCFError` naming the path for a malformed file (and the field
        at fault) and for a file that cannot be read (missing, a directory, no permission; the OSError is chained)."""
        path = Path(path)
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise MCFError(f"{path}: file is empty")
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise MCFError(f"{path}: cannot open: {describe_os_error(exc)}") from exc
        return cls(mapping, name=str(path), _mapping=mapping)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, name: str = "<bytes>") -> MCFFile:
        """Validate an MCF image already in memory; tensors are views over ``data``."""
        return cls(data, name=name)

    def close(self) -> None:
        """Release the mapping. Arrays handed out earlier keep their pages alive until they are dropped."""
        view, self._view = self._view, None
        if view is not None:
            # numpy arrays over the view may still hold it; they keep the bytes alive
            with contextlib.suppress(BufferError):
                view.release()
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            # an array may still export the mapping; it is unmapped when the last one is collected
            with contextlib.suppress(BufferError):
                mapping.close()

    def __enter__(self) -> MCFFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<MCFFile {self.name!r} tensors={len(self.tensors)}>"

    # --- accessors ------------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True after `close` (or leaving the ``with`` block); arrays handed out before stay valid."""
        return self._view is None

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def section(self, section_type: SectionType | int) -> SectionEntry | None:
        """The first directory entry of ``section_type``, or None."""
        for entry in self.sections:
            if entry.type == section_type:
                return entry
        return None

    def section_bytes(self, section_type: SectionType | int) -> memoryview | None:
        """A zero-copy view of the first section of ``section_type``, or None when the file has none."""
        entry = self.section(section_type)
        if entry is None:
            return None
        return self._data()[entry.offset : entry.offset + entry.size]

    def resource(self, section_type: SectionType | int | str) -> bytes | None:
        """The raw bytes of a Hugging Face file section (``SectionType.HF_CONFIG`` or ``"config.json"``), or None."""
        if isinstance(section_type, str):
            by_name = {filename: stype for stype, filename in RESOURCE_FILES.items()}
            if section_type not in by_name:
                raise MCFError(f"{self.name}: {section_type!r} is not an MCF resource (one of {sorted(by_name)})")
            section_type = by_name[section_type]
        view = self.section_bytes(section_type)
        return None if view is None else bytes(view)

    def tensor(self, name: str) -> TensorEntry:
        """The index entry of tensor ``name`` (dtype, shape, method, data range); `MCFError` naming it when the
        file has no such tensor (``f.tensors[name]`` raises a plain `KeyError` instead)."""
        try:
            return self.tensors[name]
        except KeyError:
            raise MCFError(f"{self.name}: no tensor named {name!r}") from None

    def tensor_bytes(self, name: str) -> memoryview:
        """The tensor's payload bytes, zero-copy over the file (read-only)."""
        entry = self.tensor(name)
        return self._data()[entry.data_offset : entry.data_offset + entry.data_size]

    def array(self, name: str) -> np.ndarray[Any, np.dtype[Any]]:
        """A read-only numpy array over the file's bytes for a float or integer tensor (BF16 via ml_dtypes)."""
        entry = self.tensor(name)
        dtype = NUMPY_DTYPES.get(entry.dtype)
        if dtype is None:
            raise MCFError(
                f"{self.name}: tensor {name!r} has dtype {entry.dtype.name}, which is not a plain array type; "
                "read its payload with tensor_bytes() (quantized tensors: carton.mcf.dequantize)"
            )
        count = entry.data_size // dtype.itemsize
        # An empty tensor's offset is not checked against the file; it has nothing to read there.
        offset = entry.data_offset if count else 0
        flat = np.frombuffer(self._data(), dtype=dtype, count=count, offset=offset)
        return flat.reshape(entry.shape)

    def dequantize(self, name: str) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The tensor as float32: decoded for quantized tensors, converted for plain ones (both copy)."""
        entry = self.tensor(name)
        if entry.method is None:
            return np.asarray(self.array(name), dtype=np.float32)
        rows, cols = entry.shape
        return _dequantize(self.tensor_bytes(name), entry.method, (rows, cols), domain=entry.domain)

    def _data(self) -> memoryview:
        if self._view is None:
            raise MCFError(f"{self.name}: file is closed")
        return self._view

    # --- validation -----------------------------------------------------------------------------------------
    def _parse(self, data: memoryview) -> None:
        where = self.name
        self.header = decode_header(data, len(data), where)
        self.sections = decode_directory(data, self.header, where)
        first: dict[int, SectionEntry] = {}
        for section in self.sections:
            first.setdefault(section.type, section)
        for stype in _PARSED_SECTIONS:
            found = first.get(stype)
            if found is not None and found.version != 1:
                raise MCFError(f"{where}: {stype.name} section has unsupported version {found.version}")

        def payload(stype: SectionType) -> memoryview | None:
            found = first.get(stype)
            return None if found is None else data[found.offset : found.offset + found.size]

        info = payload(SectionType.MODEL_INFO)
        self.model_info = None if info is None else ModelInfo.decode(info, where)
        index = payload(SectionType.TENSOR_INDEX)
        raw_entries = [] if index is None else decode_tensor_index(index, where)
        quant = payload(SectionType.QUANT_INFO)
        records: dict[int, QuantRecord] = {}
        for i, record in enumerate([] if quant is None else decode_quant_info(quant, where)):
            if record.tensor_index >= len(raw_entries):
                raise MCFError(
                    f"{where}: QuantInfo record {i} refers to tensor {record.tensor_index}, but the TensorIndex "
                    f"has {len(raw_entries)} tensors"
                )
            if record.tensor_index in records:
                raise MCFError(f"{where}: QuantInfo has two records for tensor {record.tensor_index}")
            target = raw_entries[record.tensor_index]
            if quant_method_of(target.dtype) != record.method:
                raise MCFError(
                    f"{where}: QuantInfo record {i} says {record.method.value} but tensor {target.name!r} has dtype "
                    f"{target.dtype.name}"
                )
            records[record.tensor_index] = record
        self.quant_info = MappingProxyType(records)
        data_section = first.get(SectionType.TENSOR_DATA)
        tensors: dict[str, TensorEntry] = {}
        for i, raw in enumerate(raw_entries):
            entry = TensorEntry(
                name=raw.name,
                index=i,
                dtype=raw.dtype,
                shape=raw.shape,
                data_offset=raw.data_offset,
                data_size=raw.data_size,
                quant=records.get(i),
            )
            self._check_tensor(entry, data_section)
            tensors[raw.name] = entry
        self.tensors = MappingProxyType(tensors)

    def _check_tensor(self, entry: TensorEntry, data_section: SectionEntry | None) -> None:
        label = f"{self.name}: tensor {entry.name!r}"
        start, size = entry.data_offset, entry.data_size
        method = quant_method_of(entry.dtype)
        if method is not None:
            if len(entry.shape) != 2:
                raise MCFError(f"{label}: {method.value}-quantized tensors must have rank 2, shape is {entry.shape}")
            rows, cols = entry.shape
            if rows == 0 or cols == 0:
                raise MCFError(f"{label}: {method.value}-quantized tensor has an empty shape {entry.shape}")
            want = payload_size(method, rows, cols, domain=entry.domain)
            if size != want:
                raise MCFError(
                    f"{label}: data size {size} does not match the {want}-byte {method.value} payload for shape "
                    f"{entry.shape}" + (" (activations domain)" if entry.domain == QuantDomain.ACTIVATIONS else "")
                )
            if start % 64:
                raise MCFError(f"{label}: quantized data offset {start} is not a multiple of 64")
            if method.family != "int" and not self.header.tensor_data_aligned64:
                raise MCFError(
                    f"{label}: the file holds {method.value} tensors but does not set FlagTensorDataAligned64"
                )
        elif entry.dtype != MCFDType.UNKNOWN:
            if not fits_numpy(entry.shape, NUMPY_DTYPES[entry.dtype].itemsize):
                raise MCFError(f"{label}: shape {entry.shape} is too large for a numpy array")
            want = plain_data_size(entry.dtype, entry.shape)
            if size != want:
                raise MCFError(
                    f"{label}: data size {size} does not match {want} bytes for {entry.dtype.name} shape {entry.shape}"
                )
        if size == 0:
            return
        if self.header.tensor_data_aligned64 and start % 64:
            raise MCFError(f"{label}: data offset {start} is not 64-byte aligned though FlagTensorDataAligned64 is set")
        if data_section is None:
            raise MCFError(f"{label}: has {size} bytes of data but the file has no TensorData section")
        section_end = data_section.offset + data_section.size
        if start < data_section.offset or start + size > section_end:
            raise MCFError(
                f"{label}: data range [{start}, {start + size}) lies outside the TensorData section "
                f"[{data_section.offset}, {section_end})"
            )


def open_mcf(path: str | os.PathLike[str]) -> MCFFile:
    """Same as `MCFFile.open`."""
    return MCFFile.open(path)
