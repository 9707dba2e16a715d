"""Every exception `carton` raises derives from `CartonError`. Each message names the file, field or tensor at fault,
and the facts a program needs are attributes, set by keyword-only arguments (``RunnerTimeout.limit_seconds``,
``RunnerCrashed.signal``, ``RunnerFailed.remote_kind``, ``InvalidInput.tensor``, ...): never parse a message.

    CartonError
    ├── FormatError                 a .carton package (file, directory or URL) is not valid Carton v1
    │   ├── UnsafeArchive           zip structure refused: bad entry names, symlinks, duplicates, overlaps, lying sizes
    │   │   └── ArchiveTooLarge     decompression would pass the configured size or ratio cap (zip bomb)
    │   ├── ManifestError           MANIFEST missing or malformed, a hash wrong or missing, an unlisted file
    │   ├── ConfigError             carton.toml missing, malformed (line and column), or a field of the wrong type
    │   ├── TensorDataError         tensor_data/index.toml or a tensor file is inconsistent
    │   ├── LinkError               a LINKS URL failed (status, timeout) or served bytes with the wrong sha256
    │   └── FetchError              a carton URL could not be read (status, timeout, broken range responses)
    ├── PackError                   packing or shrinking a carton failed
    ├── SafetensorsError            a safetensors file breaks a rule of the format
    │   └── SafetensorsOSError      the file cannot be opened or written; also an OSError, as the reference raises
    │       ├── SafetensorsFileNotFound      ... and a FileNotFoundError (no such file, or a missing folder)
    │       ├── SafetensorsIsADirectory      ... and an IsADirectoryError
    │       ├── SafetensorsNotADirectory     ... and a NotADirectoryError (a component of the path is a file)
    │       └── SafetensorsPermissionError   ... and a PermissionError
    ├── MCFError                    an MCF file breaks a rule of the container layout or quantization spec
    │   └── UnsupportedModel        the mcf runner does not implement the model's architecture or a config key
    │                               (also a carton_protocol.UnsupportedModel: it reaches the host with its code)
    ├── ResolutionError             finding a runner for a model failed
    │   ├── InvalidVersionReq       a framework version requirement does not parse
    │   ├── InvalidVersion          a framework version is neither SemVer nor PEP 440 (or has an epoch)
    │   ├── NoCompatibleRunner      no installed runner matches; lists every candidate and why (.rejected)
    │   └── EnvironmentInstallError building an isolated runner environment failed
    ├── RunnerError                 a runner process failed (.remote_kind, .remote_message: what the runner reported)
    │   ├── RunnerStartError        the process could not start, load the model, or complete the handshake
    │   ├── ProtocolMismatch        host and runner speak different protocol versions (.host_version, .runner_version)
    │   ├── RunnerProtocolError     the runner sent a malformed message, or refused ours
    │   ├── RunnerCrashed           the process died with requests in flight (.returncode, .signal)
    │   ├── RunnerTimeout           a load, handshake or request went over its limit (.limit_seconds, .limit_name)
    │   ├── RunnerMemoryLimit       the process went over its memory limit (.limit_bytes)
    │   ├── RunnerCPULimit          the process went over its CPU-time limit (.limit_seconds)
    │   ├── RunnerFailed            the runner's own code raised while handling a request (carries its message)
    │   └── ModelClosed             the model was closed before or during the call
    ├── InvalidInput                inputs are wrong, whichever process found it (.tensor when one is at fault)
    ├── InvalidOutput               the runner returned outputs that do not match the declared outputs (.tensor)
    ├── SandboxError                the sandbox could not be set up
    │   ├── SandboxConfigError      a sandbox policy or RunnerLimits value is invalid (also a ValueError)
    │   └── SandboxUnavailable      the strict policy needs a layer this machine does not have (names it)
    ├── ServerError                 the model server refused a request; defined in carton.server.errors with the
    │   │                           table of the HTTP status and gRPC code each is answered with
    │   ├── BadRequest              a request is malformed: body, header, tensor data, names (400)
    │   │   └── RequestTooLarge     a request body is over the server's size limit (413)
    │   ├── ModelNotFound           no such model, or no ready version of it (404)
    │   ├── ModelUnavailable        the model timed out or went away under a request; retrying may work (503)
    │   └── RepositoryError         a repository load or unload failed: config, files, carton, timeout (400)
    │       └── UploadDisabled      a load sent `file:` payloads to a server started with uploads off (403)
    └── BuildAppError               `carton.ray.build_app` got an unknown key, no repository, or a bad value (.key;
                                    also a ValueError); defined in carton.ray, which needs the `ray` extra

Warnings: `CartonWarning` (root), `RunnerWarning` (a runner's warning, e.g. unknown options), `SandboxWarning`,
`PlatformWarning` (a carton packed for platforms of which this machine is none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from carton_protocol import UnsupportedModel as _RunnerUnsupportedModel

if TYPE_CHECKING:
    from carton_protocol import RunnerSpec

__all__ = [
    "ArchiveTooLarge",
    "CartonError",
    "CartonWarning",
    "ConfigError",
    "EnvironmentInstallError",
    "FetchError",
    "FormatError",
    "InvalidInput",
    "InvalidOutput",
    "InvalidVersion",
    "InvalidVersionReq",
    "LinkError",
    "MCFError",
    "ManifestError",
    "ModelClosed",
    "NoCompatibleRunner",
    "PackError",
    "PlatformWarning",
    "ProtocolMismatch",
    "Rejection",
    "ResolutionError",
    "RunnerCPULimit",
    "RunnerCrashed",
    "RunnerError",
    "RunnerFailed",
    "RunnerMemoryLimit",
    "RunnerProtocolError",
    "RunnerStartError",
    "RunnerTimeout",
    "RunnerWarning",
    "SafetensorsError",
    "SafetensorsFileNotFound",
    "SafetensorsIsADirectory",
    "SafetensorsNotADirectory",
    "SafetensorsOSError",
    "SafetensorsPermissionError",
    "SandboxConfigError",
    "SandboxError",
    "SandboxUnavailable",
    "SandboxWarning",
    "TensorDataError",
    "UnsafeArchive",
    "UnsupportedModel",
]


class CartonError(Exception):
    """Root of every error raised by carton."""


# --- package format -------------------------------------------------------------------------------------------
class FormatError(CartonError):
    """A carton package is not valid Carton v1."""


class UnsafeArchive(FormatError):
    """The zip structure was refused before anything was extracted."""


class ArchiveTooLarge(UnsafeArchive):
    """Decompressing would exceed the configured total-size or ratio cap."""


class ManifestError(FormatError):
    """MANIFEST is missing or malformed, or a file's sha256 is wrong, missing, or the file is unlisted."""


class ConfigError(FormatError):
    """carton.toml is missing, malformed or has a field of the wrong type."""


class TensorDataError(FormatError):
    """tensor_data/index.toml or one of its tensor files is inconsistent."""


class LinkError(FormatError):
    """A file listed in LINKS could not be fetched, or its bytes do not match its sha256."""


class FetchError(FormatError):
    """A carton given by URL could not be read: HTTP status, timeout, or a malformed range response."""


class PackError(CartonError):
    """Packing or shrinking a carton failed."""


# --- tensor files ---------------------------------------------------------------------------------------------
class SafetensorsError(CartonError):
    """A safetensors file or buffer breaks a rule of the format."""


class SafetensorsOSError(SafetensorsError, OSError):
    """A safetensors file could not be opened, read or written. Also an `OSError` (the reference package raises
    plain OSErrors there), with the underlying ``errno``, ``strerror`` and ``filename``; ``str()`` is carton's
    message, which starts with the file name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SafetensorsFileNotFound(SafetensorsOSError, FileNotFoundError):
    """The file, or the folder it is to be written in, does not exist."""


class SafetensorsIsADirectory(SafetensorsOSError, IsADirectoryError):
    """The path names a directory, not a file."""


class SafetensorsNotADirectory(SafetensorsOSError, NotADirectoryError):
    """A component of the path that should be a folder is a file."""


class SafetensorsPermissionError(SafetensorsOSError, PermissionError):
    """The file or its folder may not be read or written by this process."""


class MCFError(CartonError):
    """An MCF file breaks a rule of the container layout or of the quantization spec."""


class UnsupportedModel(MCFError, _RunnerUnsupportedModel):
    """The mcf runner does not implement the model's architecture or one of its config keys; names them.

    Also a `carton_protocol.UnsupportedModel`, so that raised in a runner it reaches the host as that kind."""


# --- runner resolution ----------------------------------------------------------------------------------------
class ResolutionError(CartonError):
    """Finding a runner for a model failed."""


class InvalidVersionReq(ResolutionError):
    """A framework version requirement is not a valid Cargo-style requirement."""


class InvalidVersion(ResolutionError):
    """A framework version is neither SemVer nor PEP 440, or uses a PEP 440 epoch SemVer cannot express."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejection:
    """A discovered runner that cannot run the model, with every reason."""

    spec: RunnerSpec
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        spec = self.spec
        described = f"{spec.runner_name} {spec.framework_version} (compat {spec.runner_compat_version}, {spec.source})"
        return f"{described}: {'; '.join(self.reasons)}"


class NoCompatibleRunner(ResolutionError):
    """No installed runner satisfies the model; the message lists each candidate and why it was rejected, and
    ``rejected`` holds them (`Rejection`: the runner's spec and the reasons)."""

    def __init__(self, message: str, *, rejected: tuple[Rejection, ...] = ()) -> None:
        super().__init__(message)
        self.rejected = rejected


class EnvironmentInstallError(ResolutionError):
    """Building an isolated runner environment failed; nothing was registered."""


# --- runner processes -----------------------------------------------------------------------------------------
class RunnerError(CartonError):
    """A runner process failed.

    When the runner itself reported the failure, ``remote_kind`` is the code it sent (a `carton_protocol.ErrorCode`
    value, such as ``"internal"`` or ``"unsupported_model"``) and ``remote_message`` its own message; both are
    ``None`` when the host found the failure (a crash, a timeout)."""

    def __init__(self, message: str, *, remote_kind: str | None = None, remote_message: str | None = None) -> None:
        super().__init__(message)
        self.remote_kind = remote_kind
        self.remote_message = remote_message


class RunnerStartError(RunnerError):
    """The runner process could not start, load its model, or complete the handshake."""


class ProtocolMismatch(RunnerError):
    """The host and the runner speak different protocol versions (``host_version``, ``runner_version``; the latter
    ``None`` when the runner sent none)."""

    def __init__(self, message: str, *, host_version: int | None = None, runner_version: int | None = None) -> None:
        super().__init__(message)
        self.host_version = host_version
        self.runner_version = runner_version


class RunnerProtocolError(RunnerError):
    """The runner sent a message the host could not decode, or refused the host's (``remote_kind`` is then
    ``"protocol"``)."""


class RunnerCrashed(RunnerError):
    """The runner process died: ``signal`` is the signal number that killed it, else ``returncode`` its exit
    status (either may be ``None`` when unknown)."""

    def __init__(self, message: str, *, returncode: int | None = None, signal: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.signal = signal


class RunnerTimeout(RunnerError):
    """A load, handshake or request exceeded its time limit: ``limit_seconds``, named ``limit_name`` (such as
    ``"infer timeout"`` or ``"handshake_timeout"``). The runner was killed."""

    def __init__(self, message: str, *, limit_seconds: float | None = None, limit_name: str | None = None) -> None:
        super().__init__(message)
        self.limit_seconds = limit_seconds
        self.limit_name = limit_name


class RunnerMemoryLimit(RunnerError):
    """The runner process exceeded its memory limit (``limit_bytes``; ``None`` when it ran out of memory without
    one)."""

    def __init__(
        self,
        message: str,
        *,
        limit_bytes: float | None = None,
        remote_kind: str | None = None,
        remote_message: str | None = None,
    ) -> None:
        super().__init__(message, remote_kind=remote_kind, remote_message=remote_message)
        self.limit_bytes = limit_bytes


class RunnerCPULimit(RunnerError):
    """The runner process exceeded its CPU-time limit (``limit_seconds``)."""

    def __init__(self, message: str, *, limit_seconds: float | None = None) -> None:
        super().__init__(message)
        self.limit_seconds = limit_seconds


class RunnerFailed(RunnerError):
    """The runner's own code raised while handling a request; the message is the runner's (``remote_message``,
    with ``remote_kind`` its code)."""


class ModelClosed(RunnerError):
    """The model was closed before or while the call ran."""


# --- tensors --------------------------------------------------------------------------------------------------
class InvalidInput(CartonError):
    """Inputs are wrong: they do not match the model's declared inputs (found by the host), or the runner refused
    them (a `carton_protocol.InvalidInput`). ``tensor`` names the tensor at fault, when one is."""

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class InvalidOutput(CartonError):
    """A runner's outputs do not match the model's declared outputs, or cannot travel; ``tensor`` names the tensor
    at fault, when one is."""

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


# --- sandbox --------------------------------------------------------------------------------------------------
class SandboxError(CartonError):
    """The sandbox for a runner could not be set up."""


class SandboxConfigError(SandboxError, ValueError):
    """A usage error: an unknown sandbox policy, or a `RunnerLimits` value that is not a positive number.

    Also a `ValueError`, since that is what it is; names the field or the allowed values."""


class SandboxUnavailable(SandboxError):
    """The strict policy needs a sandbox layer this machine does not provide; names the layer."""


# --- warnings -------------------------------------------------------------------------------------------------
class CartonWarning(UserWarning):
    """Root of carton's warnings."""


class RunnerWarning(CartonWarning):
    """A warning raised by a runner (for example, options it does not understand)."""


class SandboxWarning(CartonWarning):
    """A sandbox layer is missing under the best_effort policy."""


class PlatformWarning(CartonWarning):
    """A carton is packed with ``required_platforms`` that leave out this machine: it will not load here."""
