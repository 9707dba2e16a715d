"""Writing cartons, deterministically and atomically: `write_carton` (what `carton.pack` ends with, in
`carton._workflows`) and `carton.shrink`.

Entry order: the content files (``model/``, ``misc/``, tensor files) sorted by path, then the small metadata
(``carton.toml``, ``tensor_data/index.toml``, ``MANIFEST``, ``LINKS``) last, next to the central directory, so that
`get_model_info` on a URL gets everything it needs from one range request of the file's tail. Every entry has the
same timestamp and mode, so the same inputs give byte-identical files. The output is written to a temporary file
in the destination directory and renamed into place; on any failure nothing is left behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from carton_protocol import TensorSpec

from .. import _paths
from .._progress import Progress
from ..errors import ConfigError, PackError, UnsafeArchive
from ._config import RawExample, RawSelfTest, serialize_carton_toml
from ._config import _tensor_spec as tensor_spec_from_table
from ._info import MiscRef, RunnerInfo, SelfTest, TensorRef
from ._limits import DEFAULT_LIMITS
from ._links import serialize_links
from ._manifest import serialize_manifest
from ._reader import ZipStore, open_reader
from ._tensor_data import INDEX_PATH, TensorWriter
from ._zipread import METHOD_STORED, normalize_name
from ._zipwrite import COMPRESSION_METHODS, ZipWriter

__all__ = [
    "CartonContents",
    "check_links",
    "check_specs",
    "compression_method",
    "default_output",
    "shrink",
    "write_carton",
]

_METADATA_LAST = ("carton.toml", INDEX_PATH)
_CHUNK = 4 << 20


def _hash_file(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def _model_files(model_dir: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for directory, _dirs, names in os.walk(model_dir, followlinks=True):
        for name in names:
            source = Path(directory) / name
            relative = f"model/{source.relative_to(model_dir).as_posix()}"
            try:
                normalize_name(relative.encode("utf-8"), 0x800, str(model_dir))
            except UnsafeArchive as exc:
                raise PackError(f"{source}: this file name cannot be stored in a carton ({exc})") from exc
            if not source.is_file():
                raise PackError(f"{source}: not a regular file (broken symlink or special file)")
            files[relative] = source
    return files


def check_specs(name: str, specs: Sequence[TensorSpec] | None) -> tuple[TensorSpec, ...]:
    """The specs as carton.toml will hold them, checked by the same rules the reader applies (dtype, shape, name)."""
    if specs is None:
        return ()
    out = []
    for i, spec in enumerate(specs):
        where = f"{name}[{i}]"
        if not isinstance(spec, TensorSpec):
            raise PackError(f"{where} must be a carton.TensorSpec, got {type(spec).__name__}")
        if not isinstance(spec.name, str) or not spec.name:
            raise PackError(f"{where}.name must be a non-empty string, not {spec.name!r}")
        shape = spec.shape if isinstance(spec.shape, str) else list(spec.shape) if isinstance(
            spec.shape, tuple | list) else spec.shape  # fmt: skip
        table = {"name": spec.name, "dtype": spec.dtype, "shape": shape, "description": spec.description,
                 "internal_name": spec.internal_name}  # fmt: skip
        try:
            out.append(tensor_spec_from_table({k: v for k, v in table.items() if v is not None}, where))
        except ConfigError as exc:
            raise PackError(str(exc).removeprefix("carton.toml: ")) from exc
    names = [s.name for s in out]
    for spec_name in names:
        if names.count(spec_name) > 1:
            raise PackError(f"{name}: tensor name {spec_name!r} is declared more than once")
    return tuple(out)


def _check_urls(digest: str, targets: object, where: str) -> None:
    """LINKS may only hold http(s) URLs (the reader refuses anything else), and at least one per file."""
    if isinstance(targets, str) or not isinstance(targets, Sequence) or not targets:
        raise PackError(f"{where}: sha256 {digest} needs a non-empty list of URLs, not {targets!r}")
    for url in targets:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) <= len("https://"):
            raise PackError(f"{where}: sha256 {digest}: {url!r} is not an http(s) URL")


def _tensor_value(value: object) -> object:
    return value.load() if isinstance(value, TensorRef) else value


class _Contents:
    """Files of the carton being built, other than model/: ``{path: bytes}``."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.tensors = TensorWriter()
        self._misc_count = 0

    def add_misc(self, name: str, value: object, where: str) -> str:
        if isinstance(value, MiscRef):
            value = value.load()
        if isinstance(value, os.PathLike):
            source = Path(value)
            try:
                value = source.read_bytes()
            except OSError as exc:
                raise PackError(f"{where}: cannot read {source}: {exc.strerror}") from exc
        if not isinstance(value, bytes | bytearray | memoryview):
            raise PackError(f"{where}: a misc file must be bytes or a path, not {type(value).__name__}")
        path = f"misc/{name}"
        try:
            normalize_name(path.encode("utf-8"), 0x800, where)
        except UnsafeArchive as exc:
            raise PackError(f"{where}: {name!r} is not a valid misc file name") from exc
        if path in self.files:
            raise PackError(f"{where}: misc file {name!r} is given twice")
        self.files[path] = bytes(value)
        return f"@misc/{name}"

    def example_value(self, value: object, where: str) -> str:
        if isinstance(value, str) and value.startswith("@misc/"):
            if f"misc/{value[len('@misc/') :]}" not in self.files:
                raise PackError(f"{where}: {value} names a misc file that misc_files does not provide")
            return value
        if isinstance(value, bytes | bytearray | memoryview | os.PathLike | MiscRef):
            name = f"_example_misc_file_{self._misc_count}"
            self._misc_count += 1
            return self.add_misc(name, value, where)
        return self.tensors.add(_tensor_value(value), where)


def _field(item: object, key: str, where: str, *, required: bool = False) -> Any:
    value = item.get(key) if isinstance(item, Mapping) else getattr(item, key, None)
    if required and value is None:
        raise PackError(f"{where}.{key} is required")
    return value


def _build_tests(
    contents: _Contents,
    self_tests: Sequence[SelfTest | Mapping[str, Any]],
    examples: Sequence[Any],
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
) -> tuple[list[RawSelfTest], list[RawExample]]:
    if (self_tests or examples) and not (inputs or outputs):
        raise PackError("self_tests and examples need the model's inputs and outputs to be declared")
    input_names, output_names = {s.name for s in inputs}, {s.name for s in outputs}

    def tensors(values: Mapping[str, Any] | None, allowed: set[str], where: str) -> dict[str, str]:
        out = {}
        for key, value in (values or {}).items():
            if key not in allowed:
                raise PackError(f"{where}.{key}: no such tensor is declared (declared: {', '.join(sorted(allowed))})")
            out[key] = contents.tensors.add(_tensor_value(value), f"{where}.{key}")
        return out

    raw_tests = []
    for i, test in enumerate(self_tests):
        where = f"self_tests[{i}]"
        expected = _field(test, "expected_out", where)
        raw_tests.append(
            RawSelfTest(
                name=_field(test, "name", where),
                description=_field(test, "description", where),
                inputs=tensors(_field(test, "inputs", where, required=True), input_names, f"{where}.inputs"),
                expected_out=None if expected is None else tensors(expected, output_names, f"{where}.expected_out"),
            )
        )
    raw_examples = []
    for i, example in enumerate(examples):
        where = f"examples[{i}]"
        values: dict[str, dict[str, str]] = {}
        for key, allowed in (("inputs", input_names), ("sample_out", output_names)):
            given = _field(example, key, where, required=key == "inputs") or {}
            for name in given:
                if name not in allowed:
                    raise PackError(f"{where}.{key}.{name}: no such tensor is declared")
            values[key] = {k: contents.example_value(v, f"{where}.{key}.{k}") for k, v in given.items()}
        raw_examples.append(
            RawExample(
                name=_field(example, "name", where),
                description=_field(example, "description", where),
                inputs=values["inputs"],
                sample_out=values["sample_out"],
            )
        )
    return raw_tests, raw_examples


@contextlib.contextmanager
def _atomic_output(output: Path) -> Iterator[BinaryIO]:
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".partial")
    temp = Path(temp_name)
    try:
        with os.fdopen(fd, "w+b") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        temp.chmod(0o644)
        temp.replace(output)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def default_output(model_dir: Path) -> Path:
    """``<model_dir>.carton`` beside the folder, as `carton pack` does without ``-o``."""
    folder = model_dir.resolve()
    return folder.with_name(f"{folder.name}.carton")


def compression_method(name: str) -> int:
    """The zip method of a ``compression`` name; `PackError` listing the names otherwise."""
    method = COMPRESSION_METHODS.get(name)
    if method is None:
        raise PackError(f"compression {name!r} is not one of {', '.join(COMPRESSION_METHODS)}")
    return method


def check_links(linked_files: Mapping[str, Sequence[str]] | None) -> None:
    """LINKS may only hold http(s) URLs, at least one per file; `PackError` naming the hash otherwise."""
    for digest, targets in (linked_files or {}).items():
        _check_urls(digest, targets, "linked_files")


@dataclass(frozen=True, slots=True, kw_only=True)
class CartonContents:
    """What a carton holds besides its model folder: carton.toml's fields and the files they reference.

    ``metadata`` holds carton.toml's descriptive fields (``model_name``, ``short_description``,
    ``model_description``, ``license``, ``repository``, ``homepage``); the rest are as `carton.pack` takes them.
    """

    runner: RunnerInfo
    metadata: Mapping[str, str | None] = field(default_factory=dict)
    required_platforms: tuple[str, ...] = ()
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    self_tests: Sequence[SelfTest | Mapping[str, Any]] = ()
    examples: Sequence[Any] = ()
    misc_files: Mapping[str, bytes | os.PathLike[str]] = field(default_factory=dict)
    linked_files: Mapping[str, Sequence[str]] = field(default_factory=dict)


def write_carton(destination: Path, model_dir: Path, contents: CartonContents, *, method: int) -> None:
    """Write `model_dir` and `contents` to the .carton file `destination`, atomically; `PackError` on failure."""
    files = _Contents()
    for name, value in sorted(contents.misc_files.items()):
        files.add_misc(name, value, f"misc_files[{name!r}]")
    raw_tests, raw_examples = _build_tests(
        files, contents.self_tests, contents.examples, contents.inputs, contents.outputs
    )
    files.files.update(files.tensors.files())
    try:
        files.files["carton.toml"] = serialize_carton_toml(
            metadata=dict(contents.metadata),
            required_platforms=list(contents.required_platforms),
            inputs=contents.inputs,
            outputs=contents.outputs,
            self_tests=raw_tests,
            examples=raw_examples,
            runner=contents.runner,
        )
    except (TypeError, ValueError) as exc:
        raise PackError(f"carton.toml cannot hold these values: {exc}") from exc
    _write(destination, _model_files(model_dir), files.files, dict(contents.linked_files), method)


def _write(
    destination: Path, model_files: dict[str, Path], files: dict[str, bytes], links: dict[str, Sequence[str]],
    method: int,
) -> None:  # fmt: skip
    manifest = {path: hashlib.sha256(data).hexdigest() for path, data in files.items()}
    if links:
        manifest.update({path: _hash_file(source) for path, source in model_files.items()})
        unused = sorted(set(links) - set(manifest.values()))
        if unused:
            raise PackError(f"linked_files names sha256 {unused[0]}, which no file of the carton has")
        if manifest["carton.toml"] in links:
            raise PackError("carton.toml cannot be a linked file")
    content = sorted((p for p in (*model_files, *files) if p not in _METADATA_LAST), key=lambda p: p.encode())
    total = sum(source.stat().st_size for source in model_files.values())
    with _atomic_output(destination) as handle, Progress(f"packing {destination.name}", total=total) as bar:
        writer = ZipWriter(handle)
        for path in [*content, *(p for p in _METADATA_LAST if p in files)]:
            if path in manifest and manifest[path] in links:
                continue
            if path in files:
                writer.add_bytes(path, files[path], method)
                continue
            hasher = hashlib.sha256()

            def on_chunk(chunk: bytes, hasher: Any = hasher) -> None:
                hasher.update(chunk)
                bar.advance(len(chunk))

            writer.add_file(path, model_files[path], method, on_chunk=on_chunk)
            digest = hasher.hexdigest()
            if manifest.setdefault(path, digest) != digest:
                raise PackError(f"{model_files[path]} changed while the carton was being written")
        writer.add_bytes("MANIFEST", serialize_manifest(manifest), METHOD_STORED)
        if links:
            used = {d: links[d] for d in sorted(set(manifest.values()) & set(links))}
            writer.add_bytes("LINKS", serialize_links(used), METHOD_STORED)
        writer.close()


def shrink(path: str | os.PathLike[str], urls: Mapping[str, Sequence[str]], output: str | os.PathLike[str]) -> Path:
    """Write a copy of the carton at ``path`` to ``output`` with the files whose sha256 is in ``urls`` moved out of
    the zip and into LINKS. MANIFEST is copied unchanged, so the model hash stays the same. Each copied entry is
    verified against MANIFEST on the way; compressed bytes are copied as they are."""
    destination = Path(output)
    with open_reader(path, DEFAULT_LIMITS, _paths.cache_dir()) as reader:
        store = reader.store
        if not isinstance(store, ZipStore):
            raise PackError(f"{path}: shrink takes a .carton file, not a directory")
        hashes = set(reader.manifest.values())
        unknown = sorted(set(urls) - hashes)
        if unknown:
            raise PackError(f"{path}: sha256 {unknown[0]} given to shrink is not the hash of any file in the carton")
        if reader.manifest.get("carton.toml") in urls:
            raise PackError(f"{path}: carton.toml cannot be moved to LINKS")
        for digest, targets in urls.items():
            _check_urls(digest, targets, f"{path}: shrink")
        links: dict[str, list[str]] = {d: list(u) for d, u in reader.links.items()}
        for digest, targets in urls.items():
            known = links.setdefault(digest, [])
            known.extend(t for t in targets if t not in known)
        entries = sorted(store.zip.entries.values(), key=lambda e: e.header_offset)
        with _atomic_output(destination) as handle:
            writer = ZipWriter(handle)
            for entry in entries:
                if entry.name in ("MANIFEST", "LINKS") or reader.manifest[entry.name] in urls:
                    continue
                writer.add_raw(entry.name, entry.method, crc32=entry.crc32,
                               uncompressed_size=entry.uncompressed_size,
                               raw_chunks=_verified_raw(reader, entry.name))  # fmt: skip
            writer.add_bytes("MANIFEST", reader.manifest_bytes, METHOD_STORED)
            writer.add_bytes("LINKS", serialize_links(links), METHOD_STORED)
            writer.close()
    return destination


def _verified_raw(reader: Any, name: str) -> Iterator[bytes]:
    """The compressed bytes of an entry, checked (decompressed and hashed) as they stream through."""
    store: ZipStore = reader.store
    pending: list[bytes] = []
    hasher = hashlib.sha256()
    for plain in store.zip.iter_entry(store.entry(name), raw_sink=pending.append):
        hasher.update(plain)
        yield from pending
        pending.clear()
    yield from pending
    if hasher.hexdigest() != reader.manifest[name]:
        raise PackError(f"{reader.location}: {name} does not match its MANIFEST sha256; not shrinking a bad carton")
