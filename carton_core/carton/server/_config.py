"""Per-model serving configuration, written as Triton's ``ModelConfig`` in JSON.

It comes from ``REPO/<model>/config.json`` or from the ``config`` parameter of a load request (which then replaces
the file for that load). Only the fields that mean something for a carton are accepted; any other field is refused
by name rather than silently ignored:

- ``name`` (must equal the model's name), ``platform``/``backend`` (``"carton"`` or empty)
- ``max_batch_size``: > 0 makes the first dimension of every input and output the batch dimension
- ``dynamic_batching``: ``max_queue_delay_microseconds``, ``preferred_batch_size``
- ``instance_group``: ``[{"count": N, "kind": "KIND_CPU"}]`` -> N runner processes (`carton.load(workers=N)`)
- ``version_policy``: ``{"latest": {"num_versions": N}}``, ``{"all": {}}`` or ``{"specific": {"versions": [...]}}``
- ``input``/``output``: checked against the carton's declared tensors (names and ``data_type``) after loading
- ``parameters``: ``{"key": {"string_value": "..."}}`` -> runner options
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from carton_protocol import TensorSpec

from ._datatypes import DATATYPE_OF
from .errors import RepositoryError

__all__ = ["DynamicBatching", "ModelConfig", "PolicyKind", "TensorConfig", "VersionPolicy", "parse_config"]

_KNOWN_FIELDS = frozenset(
    {
        "name",
        "platform",
        "backend",
        "max_batch_size",
        "dynamic_batching",
        "instance_group",
        "version_policy",
        "input",
        "output",
        "parameters",
    }
)


class PolicyKind(enum.StrEnum):
    """Triton's ``version_policy`` kinds: the latest N versions, all of them, or specific ones."""

    LATEST = "latest"
    ALL = "all"
    SPECIFIC = "specific"


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionPolicy:
    """Which of a model's versions are served (Triton's default: the latest one)."""

    kind: PolicyKind = PolicyKind.LATEST
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def select(self, available: Sequence[int]) -> list[int]:
        """The versions to serve among `available`, in ascending order."""
        ordered = sorted(available)
        if self.kind is PolicyKind.ALL:
            return ordered
        if self.kind is PolicyKind.SPECIFIC:
            return [version for version in ordered if version in self.versions]
        return ordered[-self.num_versions :]

    def to_json(self) -> dict[str, Any]:
        """The policy as Triton's JSON ``version_policy`` (what the model configuration endpoints return)."""
        if self.kind is PolicyKind.ALL:
            return {"all": {}}
        if self.kind is PolicyKind.SPECIFIC:
            return {"specific": {"versions": list(self.versions)}}
        return {"latest": {"num_versions": self.num_versions}}


@dataclass(frozen=True, slots=True, kw_only=True)
class DynamicBatching:
    """Triton's ``dynamic_batching``: how long a request may wait to be batched, and the batch sizes preferred."""

    max_queue_delay_microseconds: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorConfig:
    """An ``input``/``output`` entry of a config: checked against the carton's declared tensor of that name."""

    name: str
    data_type: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """A model's ``config.json`` (Triton's model configuration, the fields this server implements), checked
    against the carton's declared tensors by `parse_config`."""

    max_batch_size: int = 0
    dynamic_batching: DynamicBatching | None = None
    instance_count: int | None = None
    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    inputs: tuple[TensorConfig, ...] = ()
    outputs: tuple[TensorConfig, ...] = ()
    parameters: Mapping[str, str] = field(default_factory=dict)

    def check_tensors(self, *, model: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> None:
        """Refuse a config whose ``input``/``output`` entries disagree with the carton's declared tensors."""
        for kind, configured, declared in (("input", self.inputs, inputs), ("output", self.outputs, outputs)):
            by_name = {spec.name: spec for spec in declared}
            for tensor in configured:
                spec = by_name.get(tensor.name)
                if spec is None:
                    raise RepositoryError(
                        f"model {model!r}: config {kind} {tensor.name!r} is not an {kind} of the carton "
                        f"(it declares {sorted(by_name)})"
                    )
                expected = "TYPE_" + ("STRING" if DATATYPE_OF[spec.dtype] == "BYTES" else DATATYPE_OF[spec.dtype])
                if tensor.data_type is not None and tensor.data_type != expected:
                    raise RepositoryError(
                        f"model {model!r}: config {kind} {tensor.name!r} has data_type {tensor.data_type} but the "
                        f"carton declares {expected}"
                    )


def _fail(model: str, source: str, message: str) -> RepositoryError:
    return RepositoryError(f"model {model!r}: {source}: {message}")


def _integer(value: object, *, model: str, source: str, where: str, minimum: int = 0) -> int:
    # protobuf's JSON mapping writes 64-bit integers as strings, so both forms are accepted.
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(model, source, f"{where} must be an integer >= {minimum}, got {value!r}")
    return value


def _object(value: object, *, model: str, source: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(model, source, f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _list(value: object, *, model: str, source: str, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(model, source, f"{where} must be a JSON array, got {type(value).__name__}")
    return value


def _version_policy(value: object, *, model: str, source: str) -> VersionPolicy:
    policy = _object(value, model=model, source=source, where="version_policy")
    if len(policy) != 1:
        raise _fail(model, source, "version_policy must have exactly one of 'latest', 'all', 'specific'")
    ((kind, body),) = policy.items()
    body = _object(body, model=model, source=source, where=f"version_policy.{kind}")
    if kind == "all":
        return VersionPolicy(kind=PolicyKind.ALL)
    if kind == "latest":
        count = _integer(
            body.get("num_versions", 1),
            model=model,
            source=source,
            where="version_policy.latest.num_versions",
            minimum=1,
        )
        return VersionPolicy(kind=PolicyKind.LATEST, num_versions=count)
    if kind == "specific":
        raw = _list(body.get("versions", []), model=model, source=source, where="version_policy.specific.versions")
        versions = tuple(
            _integer(v, model=model, source=source, where="version_policy.specific.versions[]", minimum=1) for v in raw
        )
        if not versions:
            raise _fail(model, source, "version_policy.specific.versions must name at least one version")
        return VersionPolicy(kind=PolicyKind.SPECIFIC, versions=versions)
    raise _fail(model, source, f"unknown version_policy {kind!r} (expected 'latest', 'all' or 'specific')")


def _tensors(value: object, *, model: str, source: str, kind: str) -> tuple[TensorConfig, ...]:
    entries = _list(value, model=model, source=source, where=kind)
    tensors = []
    for index, raw in enumerate(entries):
        entry = _object(raw, model=model, source=source, where=f"{kind}[{index}]")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise _fail(model, source, f"{kind}[{index}].name must be a non-empty string")
        data_type = entry.get("data_type")
        if data_type is not None and not isinstance(data_type, str):
            raise _fail(model, source, f"{kind}[{index}].data_type must be a string like 'TYPE_FP32'")
        tensors.append(TensorConfig(name=name, data_type=data_type))
    return tuple(tensors)


def parse_config(document: str | bytes | Mapping[str, Any], *, model: str, source: str) -> ModelConfig:
    """Parse a JSON ``ModelConfig``; `RepositoryError` naming `source` (e.g. ``config.json``) and the field."""
    if isinstance(document, str | bytes):
        try:
            parsed: object = json.loads(document)
        except (ValueError, RecursionError) as exc:
            raise _fail(model, source, f"not valid JSON: {exc}") from exc
    else:
        parsed = dict(document)
    config = _object(parsed, model=model, source=source, where="the config")
    unknown = sorted(set(config) - _KNOWN_FIELDS)
    if unknown:
        raise _fail(model, source, f"unsupported field(s) {unknown}; a carton model accepts {sorted(_KNOWN_FIELDS)}")
    name = config.get("name")
    if name not in (None, "", model):
        raise _fail(model, source, f"name {name!r} does not match the model name")
    for key in ("platform", "backend"):
        value = config.get(key)
        if value not in (None, "", "carton"):
            raise _fail(model, source, f"{key} {value!r} is not available: this server runs cartons ('carton')")
    max_batch_size = _integer(config.get("max_batch_size", 0), model=model, source=source, where="max_batch_size")
    batching = None
    if "dynamic_batching" in config:
        body = _object(config["dynamic_batching"], model=model, source=source, where="dynamic_batching")
        unknown = sorted(set(body) - {"max_queue_delay_microseconds", "preferred_batch_size"})
        if unknown:
            raise _fail(model, source, f"unsupported dynamic_batching field(s) {unknown}")
        if max_batch_size == 0:
            raise _fail(model, source, "dynamic_batching needs max_batch_size > 0")
        preferred = tuple(
            _integer(v, model=model, source=source, where="dynamic_batching.preferred_batch_size[]", minimum=1)
            for v in _list(
                body.get("preferred_batch_size", []),
                model=model,
                source=source,
                where="dynamic_batching.preferred_batch_size",
            )
        )
        if any(size > max_batch_size for size in preferred):
            raise _fail(model, source, f"a preferred_batch_size is larger than max_batch_size {max_batch_size}")
        delay = _integer(
            body.get("max_queue_delay_microseconds", 0),
            model=model,
            source=source,
            where="dynamic_batching.max_queue_delay_microseconds",
        )
        batching = DynamicBatching(max_queue_delay_microseconds=delay, preferred_batch_sizes=preferred)
    instance_count = None
    if "instance_group" in config:
        groups = _list(config["instance_group"], model=model, source=source, where="instance_group")
        instance_count = 0
        for index, raw in enumerate(groups):
            group = _object(raw, model=model, source=source, where=f"instance_group[{index}]")
            kind = group.get("kind", "KIND_CPU")
            if kind not in ("KIND_CPU", "KIND_AUTO"):
                raise _fail(model, source, f"instance_group[{index}].kind {kind!r}: carton runs on CPU (KIND_CPU)")
            instance_count += _integer(
                group.get("count", 1), model=model, source=source, where=f"instance_group[{index}].count", minimum=1
            )
        if instance_count == 0:
            raise _fail(model, source, "instance_group must hold at least one group")
    policy = VersionPolicy()
    if "version_policy" in config:
        policy = _version_policy(config["version_policy"], model=model, source=source)
    parameters: dict[str, str] = {}
    for key, raw in _object(config.get("parameters", {}), model=model, source=source, where="parameters").items():
        value = raw.get("string_value") if isinstance(raw, dict) else None
        if not isinstance(value, str):
            raise _fail(model, source, f'parameters[{key!r}] must be {{"string_value": "..."}}')
        parameters[key] = value
    return ModelConfig(
        max_batch_size=max_batch_size,
        dynamic_batching=batching,
        instance_count=instance_count,
        version_policy=policy,
        inputs=_tensors(config.get("input", []), model=model, source=source, kind="input"),
        outputs=_tensors(config.get("output", []), model=model, source=source, kind="output"),
        parameters=parameters,
    )
