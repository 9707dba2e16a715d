"""The typed, frozen view of a carton: `CartonInfo` and its parts.

Tensor data and misc files are not read when the info is built: `TensorRef.load` and `MiscRef.load` (and
`CartonInfo.misc_file`) read them on demand, verifying each file against MANIFEST first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from carton_protocol import OptValue, Tensor, TensorSpec

__all__ = ["CartonInfo", "Example", "MiscRef", "RunnerInfo", "SelfTest", "TensorRef"]

_EMPTY: Mapping[str, str] = MappingProxyType({})


def _missing_misc(path: str) -> bytes:
    raise LookupError(path)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerInfo:
    """carton.toml's ``[runner]`` table."""

    runner_name: str
    required_framework_version: str
    runner_compat_version: int
    opts: Mapping[str, OptValue] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorRef:
    """A tensor in ``tensor_data`` (``@tensor_data/<name>``). ``dtype`` is a `carton.DType` value or ``"nested"``;
    ``shape`` is None for nested tensors. `load` returns a numpy array, or a list of arrays for a nested tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...] | None
    _loader: Callable[[], Tensor] = field(repr=False, compare=False)

    def load(self) -> Tensor:
        return self._loader()


@dataclass(frozen=True, slots=True, kw_only=True)
class MiscRef:
    """A file in ``misc`` (``@misc/<name>``); `load` returns its bytes."""

    name: str
    _loader: Callable[[], bytes] = field(repr=False, compare=False)

    @property
    def path(self) -> str:
        return f"misc/{self.name}"

    def load(self) -> bytes:
        return self._loader()


@dataclass(frozen=True, slots=True, kw_only=True)
class SelfTest:
    """A ``[[self_test]]``: inputs to run and, optionally, the outputs to compare against."""

    name: str | None = None
    description: str | None = None
    inputs: Mapping[str, TensorRef]
    expected_out: Mapping[str, TensorRef] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Example:
    """An ``[[example]]``: inputs and sample outputs, each a tensor or a misc file (an image, a sound...)."""

    name: str | None = None
    description: str | None = None
    inputs: Mapping[str, TensorRef | MiscRef]
    sample_out: Mapping[str, TensorRef | MiscRef]


@dataclass(frozen=True, slots=True, kw_only=True)
class CartonInfo:
    """Everything carton.toml says, the model hash, and lazy access to tensor data and misc files.

    ``manifest`` maps every file of the carton (as MANIFEST lists it) to its sha256; ``misc_files`` lists the
    names under ``misc/``. ``short_description``, ``license``, ``repository`` and ``homepage`` are fields the
    original Carton implementation writes beyond the v1 spec; they are read when present.
    """

    spec_version: int
    model_name: str | None = None
    model_description: str | None = None
    short_description: str | None = None
    license: str | None = None
    repository: str | None = None
    homepage: str | None = None
    required_platforms: tuple[str, ...] = ()
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    self_tests: tuple[SelfTest, ...] = ()
    examples: tuple[Example, ...] = ()
    runner: RunnerInfo
    manifest_sha256: str
    manifest: Mapping[str, str] = field(default_factory=lambda: _EMPTY, repr=False)
    misc_files: tuple[str, ...] = ()
    _misc_loader: Callable[[str], bytes] = field(default=_missing_misc, repr=False, compare=False)

    def misc_file(self, name: str) -> bytes:
        """The bytes of ``misc/<name>``, verified against MANIFEST. Raises `KeyError` for an unknown name."""
        if name not in self.misc_files:
            raise KeyError(f"no misc file {name!r} in this carton (has: {', '.join(self.misc_files) or 'none'})")
        return self._misc_loader(f"misc/{name}")
