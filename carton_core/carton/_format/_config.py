"""carton.toml and the other TOML files of a carton: guarded parsing, typed field checks, serialization.

`parse_toml` refuses documents nested deeper than a limit before handing them to `tomllib` (which recurses once
per level of arrays and inline tables) and translates `TOMLDecodeError` into an error naming the file, line and
column. `parse_carton_toml` checks every field's type and names the field at fault (``input[1].dtype``). Unknown
tables and fields are ignored, as the spec requires.
"""

from __future__ import annotations

import datetime
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import tomli_w
from carton_protocol import DType, OptValue, Shape, TensorSpec

from ..errors import ConfigError, FormatError
from ._info import RunnerInfo

__all__ = [
    "MISC_PREFIX",
    "TENSOR_PREFIX",
    "ParsedConfig",
    "RawExample",
    "RawSelfTest",
    "check_nesting",
    "parse_carton_toml",
    "parse_toml",
    "serialize_carton_toml",
]

_E = TypeVar("_E", bound=FormatError)

#: A target triple: arch-vendor-os[-env] (two to four dash-separated parts of lowercase letters, digits, _ and .).
_TRIPLE = re.compile(r"[a-z0-9_.]+(-[a-z0-9_.]+){1,3}")
TENSOR_PREFIX = "@tensor_data/"
MISC_PREFIX = "@misc/"


def check_nesting(text: str, limit: int) -> int:
    """The deepest nesting of arrays and inline tables in a TOML document (strings and comments skipped).

    Returns as soon as ``limit`` is exceeded; an unterminated string ends the scan (tomllib reports it).
    """
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif c in "\"'":
            quote = c * 3 if text.startswith(c * 3, i) else c
            j = i + len(quote)
            while True:
                k = text.find(quote, j)
                if k < 0:
                    return deepest
                if c == '"':
                    backslashes = 0
                    while text[k - 1 - backslashes] == "\\" and k - 1 - backslashes >= j:
                        backslashes += 1
                    if backslashes % 2:
                        j = k + 1
                        continue
                break
            i = k + len(quote)
            continue
        elif c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif c in "]}":
            depth = max(depth - 1, 0)
        i += 1
    return deepest


def parse_toml(data: bytes, where: str, error: type[_E], max_depth: int) -> dict[str, Any]:
    """Parse a TOML file; ``where`` names it in errors, which are raised as ``error``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not valid UTF-8 (byte {exc.start})") from exc
    if check_nesting(text, max_depth) > max_depth:
        raise error(f"{where}: arrays and tables are nested more than {max_depth} levels deep")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{where}: invalid TOML: {exc}") from exc
    except RecursionError as exc:  # pragma: no cover - check_nesting stops these first
        raise error(f"{where}: nested too deeply to parse") from exc


# --- typed field access ---------------------------------------------------------------------------------------
def _type_name(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)  # fmt: skip


def _opt_str(table: Mapping[str, Any], key: str, where: str) -> str | None:
    value = table.get(key)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"carton.toml: {_field(where, key)} must be a string, not {_type_name(value)}")
    return value


def _field(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _require_str(table: Mapping[str, Any], key: str, where: str) -> str:
    value = table.get(key)
    if value is None:
        raise ConfigError(f"carton.toml: {_field(where, key)} is required")
    if not isinstance(value, str):
        raise ConfigError(f"carton.toml: {_field(where, key)} must be a string, not {_type_name(value)}")
    return value


def _tables(doc: Mapping[str, Any], key: str) -> list[tuple[str, dict[str, Any]]]:
    value = doc.get(key, [])
    if not isinstance(value, list):
        raise ConfigError(f"carton.toml: {key} must be an array of tables ([[{key}]]), not {_type_name(value)}")
    out = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise ConfigError(f"carton.toml: {key}[{index}] must be a table, not {_type_name(item)}")
        out.append((f"{key}[{index}]", item))
    return out


def _shape(value: object, where: str) -> Shape:
    if isinstance(value, str):
        if not value:
            raise ConfigError(f"carton.toml: {where}.shape must not be an empty string")
        return value
    if isinstance(value, list):
        dims: list[int | str] = []
        for i, dim in enumerate(value):
            if isinstance(dim, bool) or not isinstance(dim, int | str):
                raise ConfigError(
                    f"carton.toml: {where}.shape[{i}] must be a non-negative integer or a symbol, "
                    f"not {_type_name(dim)}"
                )
            if isinstance(dim, int) and dim < 0:
                raise ConfigError(f"carton.toml: {where}.shape[{i}] is negative ({dim})")
            if isinstance(dim, str) and not dim:
                raise ConfigError(f"carton.toml: {where}.shape[{i}] must not be an empty string")
            dims.append(dim)
        return tuple(dims)
    raise ConfigError(f"carton.toml: {where}.shape must be a string or an array, not {_type_name(value)}")


def _tensor_spec(table: Mapping[str, Any], where: str) -> TensorSpec:
    name = _require_str(table, "name", where)
    dtype = _require_str(table, "dtype", where)
    try:
        parsed = DType(dtype)
    except ValueError:
        valid = ", ".join(d.value for d in DType)
        raise ConfigError(f"carton.toml: {where}.dtype {dtype!r} is not a carton dtype ({valid})") from None
    if "shape" not in table:
        raise ConfigError(f"carton.toml: {where}.shape is required")
    return TensorSpec(
        name=name,
        dtype=parsed,
        shape=_shape(table["shape"], where),
        description=_opt_str(table, "description", where),
        internal_name=_opt_str(table, "internal_name", where),
    )


def _opt_value(value: object, where: str) -> OptValue:
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [_opt_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _opt_value(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, datetime.date | datetime.time):
        raise ConfigError(f"carton.toml: {where} is a date/time, which runner options cannot hold")
    raise ConfigError(f"carton.toml: {where} has an unsupported type {_type_name(value)}")  # pragma: no cover


def _refs(table: Mapping[str, Any], key: str, where: str, *, allow_misc: bool, required: bool) -> dict[str, str]:
    value = table.get(key)
    if value is None:
        if required:
            raise ConfigError(f"carton.toml: {where}.{key} is required")
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"carton.toml: {where}.{key} must be a table, not {_type_name(value)}")
    out: dict[str, str] = {}
    for name, ref in value.items():
        prefixes = (TENSOR_PREFIX, MISC_PREFIX) if allow_misc else (TENSOR_PREFIX,)
        if not isinstance(ref, str) or not ref.startswith(prefixes) or ref in prefixes:
            wanted = " or ".join(f"'{p}...'" for p in prefixes)
            raise ConfigError(f"carton.toml: {where}.{key}.{name} must be a reference {wanted}, not {ref!r}")
        out[name] = ref
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RawSelfTest:
    name: str | None
    description: str | None
    inputs: dict[str, str]
    expected_out: dict[str, str] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class RawExample:
    name: str | None
    description: str | None
    inputs: dict[str, str]
    sample_out: dict[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedConfig:
    """carton.toml with every field checked; self tests and examples still hold ``@tensor_data/`` references."""

    spec_version: int
    model_name: str | None
    model_description: str | None
    short_description: str | None
    license: str | None
    repository: str | None
    homepage: str | None
    required_platforms: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    self_tests: tuple[RawSelfTest, ...]
    examples: tuple[RawExample, ...]
    runner: RunnerInfo


def parse_carton_toml(data: bytes, max_depth: int) -> ParsedConfig:
    doc = parse_toml(data, "carton.toml", ConfigError, max_depth)
    version = doc.get("spec_version")
    if version is None:
        raise ConfigError("carton.toml: spec_version is required")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ConfigError(f"carton.toml: spec_version must be an integer, not {_type_name(version)}")
    if version != 1:
        raise ConfigError(f"carton.toml: spec_version {version} is not supported (this reader knows version 1)")
    platforms = doc.get("required_platforms", [])
    if not isinstance(platforms, list):
        raise ConfigError(f"carton.toml: required_platforms must be an array, not {_type_name(platforms)}")
    for i, triple in enumerate(platforms):
        if not isinstance(triple, str) or not _TRIPLE.fullmatch(triple):
            raise ConfigError(f"carton.toml: required_platforms[{i}] {triple!r} is not a target triple")
    inputs = tuple(_tensor_spec(t, where) for where, t in _tables(doc, "input"))
    outputs = tuple(_tensor_spec(t, where) for where, t in _tables(doc, "output"))
    for kind, specs in (("input", inputs), ("output", outputs)):
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"carton.toml: {kind} name {duplicates[0]!r} is declared more than once")
    self_tests = tuple(
        RawSelfTest(
            name=_opt_str(t, "name", where),
            description=_opt_str(t, "description", where),
            inputs=_refs(t, "inputs", where, allow_misc=False, required=True),
            expected_out=_refs(t, "expected_out", where, allow_misc=False, required=False) or None,
        )
        for where, t in _tables(doc, "self_test")
    )
    examples = tuple(
        RawExample(
            name=_opt_str(t, "name", where),
            description=_opt_str(t, "description", where),
            inputs=_refs(t, "inputs", where, allow_misc=True, required=True),
            sample_out=_refs(t, "sample_out", where, allow_misc=True, required=False),
        )
        for where, t in _tables(doc, "example")
    )
    return ParsedConfig(
        spec_version=version,
        model_name=_opt_str(doc, "model_name", ""),
        model_description=_opt_str(doc, "model_description", ""),
        short_description=_opt_str(doc, "short_description", ""),
        license=_opt_str(doc, "license", ""),
        repository=_opt_str(doc, "repository", ""),
        homepage=_opt_str(doc, "homepage", ""),
        required_platforms=tuple(platforms),
        inputs=inputs,
        outputs=outputs,
        self_tests=self_tests,
        examples=examples,
        runner=_runner(doc),
    )


def _runner(doc: Mapping[str, Any]) -> RunnerInfo:
    runner = doc.get("runner")
    if runner is None:
        raise ConfigError("carton.toml: the [runner] table is required")
    if not isinstance(runner, dict):
        raise ConfigError(f"carton.toml: runner must be a table, not {_type_name(runner)}")
    compat = runner.get("runner_compat_version")
    if compat is None:
        raise ConfigError("carton.toml: runner.runner_compat_version is required")
    if isinstance(compat, bool) or not isinstance(compat, int) or compat < 0:
        raise ConfigError(f"carton.toml: runner.runner_compat_version must be a non-negative integer, not {compat!r}")
    opts = runner.get("opts", {})
    if not isinstance(opts, dict):
        raise ConfigError(f"carton.toml: runner.opts must be a table, not {_type_name(opts)}")
    return RunnerInfo(
        runner_name=_require_str(runner, "runner_name", "runner"),
        required_framework_version=_require_str(runner, "required_framework_version", "runner"),
        runner_compat_version=compat,
        opts=MappingProxyType({k: _opt_value(v, f"runner.opts.{k}") for k, v in opts.items()}),
    )


# --- writing --------------------------------------------------------------------------------------------------
def _spec_table(spec: TensorSpec) -> dict[str, Any]:
    table: dict[str, Any] = {"name": spec.name, "dtype": DType(spec.dtype).value}
    table["shape"] = spec.shape if isinstance(spec.shape, str) else list(spec.shape)
    if spec.description is not None:
        table["description"] = spec.description
    if spec.internal_name is not None:
        table["internal_name"] = spec.internal_name
    return table


def _plain(value: OptValue) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def serialize_carton_toml(
    *,
    metadata: Mapping[str, str | None],
    required_platforms: Sequence[str],
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    self_tests: Sequence[RawSelfTest],
    examples: Sequence[RawExample],
    runner: RunnerInfo,
) -> bytes:
    """carton.toml bytes, fields in the spec's order so that the same inputs give the same bytes."""
    doc: dict[str, Any] = {"spec_version": 1}
    doc.update({k: v for k, v in metadata.items() if v is not None})
    doc["required_platforms"] = list(required_platforms)
    if inputs:
        doc["input"] = [_spec_table(s) for s in inputs]
    if outputs:
        doc["output"] = [_spec_table(s) for s in outputs]
    if self_tests:
        doc["self_test"] = [
            {k: v for k, v in (("name", t.name), ("description", t.description), ("inputs", t.inputs),
                               ("expected_out", t.expected_out)) if v is not None}
            for t in self_tests
        ]  # fmt: skip
    if examples:
        doc["example"] = [
            {k: v for k, v in (("name", e.name), ("description", e.description), ("inputs", e.inputs),
                               ("sample_out", e.sample_out)) if v is not None}
            for e in examples
        ]  # fmt: skip
    runner_table: dict[str, Any] = {
        "runner_name": runner.runner_name,
        "required_framework_version": runner.required_framework_version,
        "runner_compat_version": runner.runner_compat_version,
    }
    if runner.opts:
        runner_table["opts"] = {k: _plain(v) for k, v in sorted(runner.opts.items())}
    doc["runner"] = runner_table
    return tomli_w.dumps(doc, multiline_strings=True).encode("utf-8")
