"""The application's arguments: Ray's builder convention (``key=value`` strings from ``serve run``, or a dict from
Python), parsed once into a frozen `AppOptions` and checked, each error naming the key at fault."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from ..errors import CartonError

__all__ = ["AppOptions", "BuildAppError", "parse_app_args"]

_T = TypeVar("_T")


class BuildAppError(CartonError, ValueError):
    """An argument of `carton.ray.build_app` is unknown, missing or has a bad value; `key` names it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"carton.ray.build_app: {key!r}: {message}")
        self.key = key


@dataclass(frozen=True, slots=True, kw_only=True)
class AppOptions:
    """What `build_app` deploys. Every field is a ``build_app`` key of the same name."""

    #: The model repository: a folder every node can read at the same path (``carton serve``'s layout), or the
    #: http(s) URL under which model ``m`` is the packed carton ``<url>/m.carton`` (a string, without a final ``/``).
    repository: Path | str
    #: A fixed number of model replicas; mutually exclusive with ``min_replicas``/``max_replicas``.
    num_replicas: int | None = None
    #: Serve autoscaling between these bounds (either set turns autoscaling on).
    min_replicas: int | None = None
    max_replicas: int | None = None
    #: Replicas of the ingress (each forwards requests to the model replicas; Serve runs a proxy on every node).
    ingress_replicas: int = 1
    #: Autoscaling's target of requests in flight per replica.
    target_ongoing_requests: float = 2.0
    #: Models a replica keeps loaded; a replica loading one more unloads its least recently used model.
    max_models_per_replica: int = 3
    #: CPUs and memory (bytes) each model replica asks Ray for (its runners run inside that reservation).
    num_cpus: float = 1.0
    memory: int | None = None
    #: As ``carton serve``'s flags of the same names, applied by every replica to every model it loads.
    workers: int = 1
    sandbox: str | None = None
    memory_limit: int | None = None
    cpu_limit: float | None = None
    request_timeout: float | None = None
    process_limit: int | None = None
    load_timeout: float = 300.0
    max_body_size: int = 256 * 1024 * 1024
    strict_readiness: bool = False

    def replica_options(self) -> dict[str, Any]:
        """Serve deployment options of the model deployment (replica count or autoscaling, resources)."""
        actor: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.memory is not None:
            actor["memory"] = self.memory
        options: dict[str, Any] = {"ray_actor_options": actor}
        if self.min_replicas is not None or self.max_replicas is not None:
            low = self.min_replicas if self.min_replicas is not None else 1
            high = self.max_replicas if self.max_replicas is not None else max(low, 1)
            options["autoscaling_config"] = {
                "min_replicas": low,
                "max_replicas": high,
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        else:
            options["num_replicas"] = self.num_replicas if self.num_replicas is not None else 1
        return options


def _integer(text: str, *, key: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise BuildAppError(key, f"{text!r} is not a whole number") from None
    if value < minimum:
        raise BuildAppError(key, f"must be at least {minimum}, got {value}")
    return value


def _number(text: str, *, key: str, positive: bool = True) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise BuildAppError(key, f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise BuildAppError(key, f"must be a {'positive' if positive else 'non-negative'} number, got {text!r}")
    return value


def _size(text: str, *, key: str) -> int:
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    stripped = text.strip()
    suffix = stripped[-1:].lower()
    try:
        value = int(stripped[:-1]) * units[suffix] if suffix in units else int(stripped)
    except ValueError:
        raise BuildAppError(key, f"{text!r} is not a size (bytes, or a number with k, m or g)") from None
    if value <= 0:
        raise BuildAppError(key, f"must be a positive size, got {text!r}")
    return value


def _boolean(text: str, *, key: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise BuildAppError(key, f"{text!r} is not true or false")


def _choice(*choices: str) -> Callable[..., str]:
    def parse(text: str, *, key: str) -> str:
        if text not in choices:
            raise BuildAppError(key, f"{text!r} is not one of {', '.join(choices)}")
        return text

    return parse


def _repository(text: str, *, key: str) -> Path | str:
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme in ("http", "https"):
            if not parts.netloc or parts.query or parts.fragment:
                raise BuildAppError(key, f"{text!r} is not a URL of a folder of cartons (http(s)://host/path)")
            return text.rstrip("/")
        if parts.scheme != "file":
            raise BuildAppError(
                key,
                f"{parts.scheme}:// repositories are not supported: give a folder every node can read at the same "
                "path (a shared or mounted file system), a file:// URL of one, or an http(s):// URL of cartons",
            )
        text = unquote(parts.path)
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = path.absolute()
    if not path.is_dir():
        raise BuildAppError(key, f"{text!r} is not a folder on this machine")
    return path


def _with_minimum(parse: Callable[..., _T], **bounds: Any) -> Callable[..., _T]:
    def parse_bounded(text: str, *, key: str) -> _T:
        return parse(text, key=key, **bounds)

    return parse_bounded


_PARSERS: dict[str, Callable[..., Any]] = {
    "repository": _repository,
    "num_replicas": _with_minimum(_integer, minimum=1),
    "min_replicas": _with_minimum(_integer, minimum=0),
    "max_replicas": _with_minimum(_integer, minimum=1),
    "ingress_replicas": _with_minimum(_integer, minimum=1),
    "target_ongoing_requests": _number,
    "max_models_per_replica": _with_minimum(_integer, minimum=1),
    "num_cpus": _with_minimum(_number, positive=False),
    "memory": _size,
    "workers": _with_minimum(_integer, minimum=1),
    "sandbox": _choice("none", "best_effort", "strict"),
    "memory_limit": _size,
    "cpu_limit": _number,
    "request_timeout": _number,
    "process_limit": _with_minimum(_integer, minimum=1),
    "load_timeout": _number,
    "max_body_size": _size,
    "strict_readiness": _boolean,
}
assert set(_PARSERS) == {field.name for field in fields(AppOptions)}


def parse_app_args(args: Mapping[str, object]) -> AppOptions:
    """`AppOptions` from `build_app`'s arguments (strings, or values of the field's type); `BuildAppError` names the
    first unknown key, missing ``repository`` or bad value."""
    if not isinstance(args, Mapping):
        raise BuildAppError("args", f"expected a dict of key=value strings, got {type(args).__name__}")
    values: dict[str, Any] = {}
    for key, raw in args.items():
        parse = _PARSERS.get(str(key))
        if parse is None:
            raise BuildAppError(str(key), f"unknown key (expected one of {', '.join(sorted(_PARSERS))})")
        text = str(raw) if not isinstance(raw, bool) else ("true" if raw else "false")
        if isinstance(raw, Path):
            text = str(raw)
        values[str(key)] = parse(text, key=str(key))
    if "repository" not in values:
        raise BuildAppError("repository", "is required: the model repository folder (repository=PATH)")
    autoscaling = "min_replicas" in values or "max_replicas" in values
    if autoscaling and "num_replicas" in values:
        raise BuildAppError("num_replicas", "give either num_replicas or min_replicas/max_replicas (autoscaling)")
    low, high = values.get("min_replicas"), values.get("max_replicas")
    if low is not None and high is not None and low > high:
        raise BuildAppError("min_replicas", f"{low} is more than max_replicas {high}")
    if "target_ongoing_requests" in values and not autoscaling:
        raise BuildAppError("target_ongoing_requests", "only applies with min_replicas/max_replicas (autoscaling)")
    return AppOptions(**values)
