"""Reading a carton: a zip file, an unpacked directory or a URL, through one verified view.

`CartonReader` checks the carton's file list against MANIFEST (no unlisted file, every listed file present or in
LINKS) and hands out a file's bytes only after checking them against their sha256. `build_info` turns carton.toml
and tensor_data/index.toml into a `CartonInfo` whose tensors and misc files load lazily (each load reopens the
carton and checks that its model hash has not changed).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

from carton_protocol import Tensor

from .. import _paths
from ..errors import ConfigError, FormatError, ManifestError, TensorDataError, UnsafeArchive
from ._config import MISC_PREFIX, TENSOR_PREFIX, parse_carton_toml
from ._info import CartonInfo, Example, MiscRef, SelfTest, TensorRef
from ._limits import DEFAULT_LIMITS, ReadLimits
from ._links import fetch_blob, parse_links
from ._manifest import UNLISTED, manifest_hash, parse_manifest, serialize_manifest
from ._source import Source, open_source
from ._tensor_data import INDEX_PATH, IndexEntry, load_tensor, parse_index
from ._zipread import ZipEntry, ZipReader

__all__ = ["CartonReader", "DirStore", "Store", "ZipStore", "build_info", "get_model_info", "located", "open_reader"]

_CHUNK = 4 << 20


class Store(Protocol):
    """The files physically present in a carton (a zip or a directory)."""

    @property
    def name(self) -> str: ...
    def present(self) -> frozenset[str]: ...
    def read(self, path: str, max_size: int) -> bytes: ...
    def iter_file(self, path: str, piece_size: int | None = None) -> Iterator[bytes]:
        """The file's bytes in pieces of at most ``piece_size`` (``None``: the store's own default)."""
        ...

    def size(self, path: str) -> int: ...
    def close(self) -> None: ...


class ZipStore:
    def __init__(self, source: Source, limits: ReadLimits) -> None:
        self.source = source
        self.zip = ZipReader(source, limits)

    @property
    def name(self) -> str:
        return self.source.name

    def present(self) -> frozenset[str]:
        return frozenset(self.zip.entries)

    def entry(self, path: str) -> ZipEntry:
        return self.zip.entries[path]

    def read(self, path: str, max_size: int) -> bytes:
        # CRC-32 is checked only where no sha256 covers the bytes: MANIFEST and LINKS.
        return self.zip.read(self.zip.entries[path], max_size=max_size, check_crc=path in UNLISTED)

    def iter_file(self, path: str, piece_size: int | None = None) -> Iterator[bytes]:
        return self.zip.iter_entry(self.zip.entries[path], piece_size=piece_size)

    def size(self, path: str) -> int:
        return self.zip.entries[path].uncompressed_size

    def close(self) -> None:
        self.source.close()


class DirStore:
    """An unpacked carton: a directory holding carton.toml, model/ and so on.

    ``root`` is resolved (absolute, symlinks followed) so that the folder means the same thing to a runner process
    started in another working directory. Symlinks inside the folder are followed only when they lead to a regular
    file or directory inside it; anything else (a link out of the folder, a device, a FIFO, a directory loop) is
    refused with `UnsafeArchive` before any file is read.
    """

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._present: frozenset[str] | None = None

    @property
    def name(self) -> str:
        return str(self.root)

    def _inside(self, path: Path) -> Path:
        target = path.resolve()
        if target != self.root and not target.is_relative_to(self.root):
            raise UnsafeArchive(f"{path}: symlink leads out of the carton folder {self.root} (to {target})")
        return target

    def present(self) -> frozenset[str]:
        if self._present is None:
            found = set()
            visited: set[Path] = set()
            for directory, dirs, files in os.walk(self.root, followlinks=True):
                here = self._inside(Path(directory))
                if here in visited:
                    raise UnsafeArchive(f"{directory}: directory symlink loop in the carton folder")
                visited.add(here)
                base = Path(directory).relative_to(self.root)
                for name in dirs:
                    self._inside(Path(directory) / name)
                for file in files:
                    path = Path(directory) / file
                    target = self._inside(path)
                    try:
                        mode = target.stat().st_mode
                    except OSError as exc:
                        raise UnsafeArchive(f"{path}: cannot stat ({exc.strerror}; a broken symlink?)") from exc
                    if not stat.S_ISREG(mode):
                        raise UnsafeArchive(f"{path}: not a regular file (a FIFO, socket or device)")
                    found.add((base / file).as_posix())
            self._present = frozenset(found)
        return self._present

    def read(self, path: str, max_size: int) -> bytes:
        size = self.size(path)
        if size > max_size:
            raise FormatError(f"{self.root / path}: {size} bytes is over the limit of {max_size} for this file")
        return (self.root / path).read_bytes()

    def iter_file(self, path: str, piece_size: int | None = None) -> Iterator[bytes]:
        with (self.root / path).open("rb") as handle:
            while chunk := handle.read(piece_size or _CHUNK):
                yield chunk

    def size(self, path: str) -> int:
        return (self.root / path).stat().st_size

    def close(self) -> None:
        return None


@contextlib.contextmanager
def located(location: str) -> Iterator[None]:
    """Prefix a `TensorDataError` raised inside (which names the file in tensor_data/) with the carton's path."""
    try:
        yield
    except TensorDataError as exc:
        if str(exc).startswith(f"{location}: "):
            raise
        raise TensorDataError(f"{location}: {exc}") from exc


def _hash_chunks(chunks: Iterator[bytes]) -> str:
    hasher = hashlib.sha256()
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.hexdigest()


class CartonReader:
    """A carton whose file list has been checked against MANIFEST; `read` hands out verified bytes."""

    def __init__(
        self, store: Store, location: str, limits: ReadLimits, cache_dir: Path, *, reopen: str | None = None
    ) -> None:
        self.store = store
        self.location = location
        #: What lazy loads reopen: the resolved path (or the URL), independent of the working directory.
        self.reopen = reopen or location
        self.limits = limits
        self.cache_dir = cache_dir
        present = store.present()
        if "MANIFEST" in present:
            self.manifest_bytes = store.read("MANIFEST", limits.max_metadata_size)
        elif isinstance(store, DirStore):
            # An unpacked directory without a MANIFEST (for example a model folder being prepared): compute one.
            listing = {p: _hash_chunks(store.iter_file(p)) for p in sorted(present - UNLISTED)}
            self.manifest_bytes = serialize_manifest(listing)
        else:
            raise ManifestError(f"{location}: MANIFEST is missing")
        self.manifest = parse_manifest(self.manifest_bytes, location)
        self.model_hash = manifest_hash(self.manifest_bytes)
        self.links: dict[str, tuple[str, ...]] = {}
        if "LINKS" in present:
            self.links = parse_links(store.read("LINKS", limits.max_metadata_size), location, limits.max_toml_depth)
        unlisted = sorted(present - UNLISTED - self.manifest.keys())
        if unlisted:
            raise ManifestError(f"{location}: {unlisted[0]} is in the carton but not listed in MANIFEST")
        for path in sorted(self.manifest.keys() - present):
            if self.manifest[path] not in self.links:
                raise ManifestError(f"{location}: {path} is listed in MANIFEST but is in neither the carton nor LINKS")
        self.present = present

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> CartonReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def expect(self, path: str) -> str:
        digest = self.manifest.get(path)
        if digest is None:
            raise ManifestError(f"{self.location}: {path} is not listed in MANIFEST")
        return digest

    def linked_blob(self, path: str) -> Path:
        """The cached, verified file for a path LINKS provides (downloading it if needed)."""
        digest = self.expect(path)
        return fetch_blob(digest, self.links.get(digest, ()), self.cache_dir, self.limits, label=path)

    def read(self, path: str, max_size: int | None = None) -> bytes:
        """The bytes of ``path``, checked against MANIFEST."""
        limit = self.limits.max_metadata_size if max_size is None else max_size
        digest = self.expect(path)
        if path in self.present:
            data = self.store.read(path, limit)
        else:
            blob = self.linked_blob(path)
            if blob.stat().st_size > limit:
                raise FormatError(f"{self.location}: {path} is over the {limit}-byte limit for this file")
            data = blob.read_bytes()
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise ManifestError(f"{self.location}: {path} has sha256 {actual} but MANIFEST says {digest}")
        return data

    def verify_file(self, path: str) -> None:
        """Stream ``path`` (any size) and check it against MANIFEST."""
        digest = self.expect(path)
        chunks = self.store.iter_file(path) if path in self.present else iter([self.linked_blob(path).read_bytes()])
        actual = _hash_chunks(chunks)
        if actual != digest:
            raise ManifestError(f"{self.location}: {path} has sha256 {actual} but MANIFEST says {digest}")


def open_reader(location: str | os.PathLike[str], limits: ReadLimits, cache_dir: Path) -> CartonReader:
    """A reader for a .carton file, an unpacked directory or an http(s) URL."""
    text = os.fspath(location)
    if not text.startswith(("http://", "https://")):
        # Local paths are resolved once here: the runner process, lazy loads and the cache all see the same
        # absolute folder whatever the working directory is later. Error messages keep the caller's spelling.
        local = Path(text)
        if local.is_dir():
            return CartonReader(DirStore(local), text, limits, cache_dir, reopen=str(local.resolve()))
        if not local.exists():
            raise FormatError(f"{text}: no such file or directory")
        source = open_source(local.resolve(), limits, cache_dir / "downloads")
    else:
        source = open_source(text, limits, cache_dir / "downloads")
    try:
        return CartonReader(ZipStore(source, limits), text, limits, cache_dir, reopen=source.name)
    except BaseException:
        source.close()
        raise


class _LazyFiles:
    """Reopens the carton to read a file on demand, so a `CartonInfo` holds no open file or connection."""

    def __init__(self, location: str, model_hash: str, limits: ReadLimits, cache_dir: Path) -> None:
        self._location = location
        self._model_hash = model_hash
        self._limits = limits
        self._cache_dir = cache_dir

    def read(self, path: str) -> bytes:
        with open_reader(self._location, self._limits, self._cache_dir) as reader:
            if reader.model_hash != self._model_hash:
                raise ManifestError(f"{self._location}: the carton changed since its info was read")
            return reader.read(path, self._limits.max_total_size)


def build_info(reader: CartonReader, read: Callable[[str], bytes] | None = None) -> CartonInfo:
    """The `CartonInfo` of a carton. ``read`` (default: reopen the carton on demand) serves lazy loads."""
    if "carton.toml" not in reader.manifest:
        raise ConfigError(f"{reader.location}: carton.toml is missing")
    limits = reader.limits
    try:
        config = parse_carton_toml(reader.read("carton.toml"), limits.max_toml_depth)
    except ConfigError as exc:
        raise ConfigError(f"{reader.location}: {exc}") from exc
    index: dict[str, IndexEntry] = {}
    if INDEX_PATH in reader.manifest:
        with located(reader.location):
            index = parse_index(reader.read(INDEX_PATH), limits.max_toml_depth)
        for entry in index.values():
            if entry.file is not None and f"tensor_data/{entry.file}" not in reader.manifest:
                raise TensorDataError(f"{reader.location}: {INDEX_PATH}: tensor {entry.name!r} names missing "
                                      f"file tensor_data/{entry.file}")  # fmt: skip
    reader_fn = read or _LazyFiles(reader.reopen, reader.model_hash, limits, reader.cache_dir).read
    tensors: dict[str, TensorRef] = {}

    def tensor(ref: str, where: str) -> TensorRef:
        name = ref[len(TENSOR_PREFIX) :]
        if name not in index:
            raise TensorDataError(f"{reader.location}: carton.toml: {where} references {ref}, which "
                                  f"{INDEX_PATH} does not list")  # fmt: skip
        if name not in tensors:
            entry = index[name]

            def load(name: str = name) -> Tensor:
                with located(reader.location):
                    return load_tensor(index, name, reader_fn, limits.max_toml_depth)

            tensors[name] = TensorRef(name=name, dtype=entry.dtype, shape=entry.shape, _loader=load)
        return tensors[name]

    def misc(ref: str, where: str) -> MiscRef:
        name = ref[len(MISC_PREFIX) :]
        if f"misc/{name}" not in reader.manifest:
            raise ConfigError(f"{reader.location}: carton.toml: {where} references {ref}, which the carton lacks")
        return MiscRef(name=name, _loader=lambda: reader_fn(f"misc/{name}"))

    def resolve(ref: str, where: str) -> TensorRef | MiscRef:
        return misc(ref, where) if ref.startswith(MISC_PREFIX) else tensor(ref, where)

    self_tests = tuple(
        SelfTest(
            name=t.name,
            description=t.description,
            inputs=MappingProxyType({k: tensor(v, f"self_test[{i}].inputs.{k}") for k, v in t.inputs.items()}),
            expected_out=None if t.expected_out is None else MappingProxyType(
                {k: tensor(v, f"self_test[{i}].expected_out.{k}") for k, v in t.expected_out.items()}
            ),
        )
        for i, t in enumerate(config.self_tests)
    )  # fmt: skip
    examples = tuple(
        Example(
            name=e.name,
            description=e.description,
            inputs=MappingProxyType({k: resolve(v, f"example[{i}].inputs.{k}") for k, v in e.inputs.items()}),
            sample_out=MappingProxyType(
                {k: resolve(v, f"example[{i}].sample_out.{k}") for k, v in e.sample_out.items()}
            ),
        )
        for i, e in enumerate(config.examples)
    )
    return CartonInfo(
        spec_version=config.spec_version,
        model_name=config.model_name,
        model_description=config.model_description,
        short_description=config.short_description,
        license=config.license,
        repository=config.repository,
        homepage=config.homepage,
        required_platforms=config.required_platforms,
        inputs=config.inputs,
        outputs=config.outputs,
        self_tests=self_tests,
        examples=examples,
        runner=config.runner,
        manifest_sha256=reader.model_hash,
        manifest=MappingProxyType(dict(reader.manifest)),
        misc_files=tuple(sorted(p[len("misc/") :] for p in reader.manifest if p.startswith("misc/"))),
        _misc_loader=reader_fn,
    )


def get_model_info(path_or_url: str | os.PathLike[str], *, limits: ReadLimits | None = None) -> CartonInfo:
    """Read a carton's metadata (.carton file, unpacked directory or http(s) URL) without reading model bytes.

    Reads the zip's central directory, MANIFEST, carton.toml and tensor_data/index.toml, each checked against
    MANIFEST; tensor data and misc files load lazily through the returned `CartonInfo`.
    """
    limits = limits or DEFAULT_LIMITS
    with open_reader(path_or_url, limits, _paths.cache_dir()) as reader:
        return build_info(reader)

