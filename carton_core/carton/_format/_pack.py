"""`carton.pack` and `carton.shrink`: writing cartons, deterministically and atomically.

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
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from carton_protocol import OptValue, TensorSpec

from .. import _paths
from .._progress import Progress
from .._warnings import warn_user
from ..errors import ConfigError, PackError, PlatformWarning, UnsafeArchive
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

__all__ = ["pack", "shrink"]

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


def _check_specs(name: str, specs: Sequence[TensorSpec] | None) -> tuple[TensorSpec, ...]:
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


def _default_output(model_dir: Path) -> Path:
    """``<model_dir>.carton`` beside the folder, as `carton pack` does without ``-o``."""
    folder = model_dir.resolve()
    return folder.with_name(f"{folder.name}.carton")


def pack(
    model_dir_or_object: str | os.PathLike[str] | object,
    output: str | os.PathLike[str] | None = None,
    *,
    runner_name: str,
    required_framework_version: str,
    runner_compat_version: int | None = None,
    model_name: str | None = None,
    model_description: str | None = None,
    short_description: str | None = None,
    license: str | None = None,
    repository: str | None = None,
    homepage: str | None = None,
    required_platforms: Sequence[str] = (),
    inputs: Sequence[TensorSpec] | None = None,
    outputs: Sequence[TensorSpec] | None = None,
    self_tests: Sequence[SelfTest | Mapping[str, Any]] = (),
    examples: Sequence[Any] = (),
    misc_files: Mapping[str, bytes | os.PathLike[str]] | None = None,
    linked_files: Mapping[str, Sequence[str]] | None = None,
    runner_opts: Mapping[str, OptValue] | None = None,
    compression: str = "zstd",
    validate: bool = True,
) -> Path:
    """Pack a model folder (or an in-memory model object) into a .carton file and return its path.

    ``validate=True`` runs the runner's own packing step in a runner process (it checks the folder, may fill in
    ``inputs``/``outputs`` and options, and supplies ``runner_compat_version``); with ``validate=False`` nothing
    runs and ``runner_compat_version`` must be given. Self tests are ``{"name", "description", "inputs",
    "expected_out"}`` mappings, examples ``{"name", "description", "inputs", "sample_out"}``; tensors are numpy
    arrays, strings, (nested) lists, or lists of arrays for nested tensors; example values may also be misc files
    (bytes or a path). ``linked_files`` maps sha256 to URLs: files with those hashes are left out of the zip and
    listed in LINKS. ``output=None`` writes ``<model_dir>.carton`` beside a model folder (a model object needs an
    explicit ``output``). Raises `carton.PackError`.
    """
    method = COMPRESSION_METHODS.get(compression)
    if method is None:
        raise PackError(f"compression {compression!r} is not one of {', '.join(COMPRESSION_METHODS)}")
    _warn_if_foreign(required_platforms)
    inputs_t, outputs_t = _check_specs("inputs", inputs), _check_specs("outputs", outputs)
    is_folder = isinstance(model_dir_or_object, str | os.PathLike)
    if output is None and not is_folder:
        raise PackError("pack(model_object): output= is required (there is no model folder to write beside)")
    for digest, targets in (linked_files or {}).items():
        _check_urls(digest, targets, "linked_files")
    destination = Path(output) if output is not None else _default_output(Path(model_dir_or_object))  # type: ignore[arg-type]
    opts: dict[str, OptValue] = dict(runner_opts or {})
    with tempfile.TemporaryDirectory(prefix="carton-pack-") as staging_name:
        staging = Path(staging_name) / "model"
        if is_folder:
            model_dir = Path(model_dir_or_object)  # type: ignore[arg-type]
            if not model_dir.is_dir():
                raise PackError(f"{model_dir}: not a directory (pack takes a model folder or a model object)")
        else:
            from .._runtime import serialize_model

            staging.mkdir()
            recorded = serialize_model(model_dir_or_object, runner_name=runner_name, model_dir=staging)
            opts = {**dict(recorded or {}), **opts}
            model_dir = staging
        if validate:
            from .._runtime import pack_in_runner

            if model_dir != staging:
                # The runner's pack step may rewrite files: give it a copy, never the caller's folder.
                shutil.copytree(model_dir, staging, symlinks=False)
                model_dir = staging
            try:
                packed = pack_in_runner(
                    runner_name=runner_name,
                    required_framework_version=required_framework_version,
                    model_dir=model_dir,
                    opts=opts,
                    inputs=inputs_t,
                    outputs=outputs_t,
                )
            except PackError as exc:
                # The runner saw our private copy; name the caller's folder (or object) instead.
                shown = str(Path(model_dir_or_object)) if is_folder else "the serialized model object"  # type: ignore[arg-type]
                message = str(exc).replace(str(staging.resolve()), shown).replace(str(staging), shown)
                raise PackError(message) from exc
            inputs_t = inputs_t or tuple(packed.result.inputs)
            outputs_t = outputs_t or tuple(packed.result.outputs)
            opts = dict(packed.result.opts)
            if runner_compat_version is None:
                runner_compat_version = packed.runner.runner_compat_version
        if runner_compat_version is None:
            raise PackError("runner_compat_version is required when validate=False (no runner is asked for it)")
        if isinstance(runner_compat_version, bool) or not isinstance(runner_compat_version, int):
            raise PackError(f"runner_compat_version must be an int, not {type(runner_compat_version).__name__}")
        contents = _Contents()
        for name, value in sorted((misc_files or {}).items()):
            contents.add_misc(name, value, f"misc_files[{name!r}]")
        raw_tests, raw_examples = _build_tests(contents, self_tests, examples, inputs_t, outputs_t)
        contents.files.update(contents.tensors.files())
        try:
            contents.files["carton.toml"] = serialize_carton_toml(
                metadata={"model_name": model_name, "short_description": short_description,
                          "model_description": model_description, "license": license, "repository": repository,
                          "homepage": homepage},
                required_platforms=list(required_platforms),
                inputs=inputs_t,
                outputs=outputs_t,
                self_tests=raw_tests,
                examples=raw_examples,
                runner=RunnerInfo(runner_name=runner_name, required_framework_version=required_framework_version,
                                  runner_compat_version=runner_compat_version, opts=opts),
            )  # fmt: skip
        except (TypeError, ValueError) as exc:
            raise PackError(f"carton.toml cannot hold these values: {exc}") from exc
        _write(destination, _model_files(model_dir), contents.files, dict(linked_files or {}), method)
    return destination


def _warn_if_foreign(required_platforms: Sequence[str]) -> None:
    """Packing for other machines is legitimate, but a carton this machine cannot load is worth saying at once."""
    if not required_platforms:
        return
    from .._runtime import target_triple

    host = target_triple()
    if host not in required_platforms:
        warn_user(
            f"required_platforms allows only {', '.join(required_platforms)} and this machine is {host}: the carton "
            f"will not load here (add {host} to required_platforms to load it on this machine too)",
            PlatformWarning,
        )


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
