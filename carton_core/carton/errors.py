"""Every exception `carton` raises derives from `CartonError`. Each message names the file, field or tensor at fault.

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
    ├── ResolutionError             finding a runner for a model failed
    │   ├── InvalidVersionReq       a framework version requirement does not parse
    │   ├── InvalidVersion          a framework version is neither SemVer nor PEP 440 (or has an epoch)
    │   ├── NoCompatibleRunner      no installed runner matches; lists every candidate and why it was rejected
    │   └── EnvironmentInstallError building an isolated runner environment failed
    ├── RunnerError                 a runner process failed
    │   ├── RunnerStartError        the process could not start, load the model, or complete the handshake
    │   ├── ProtocolMismatch        host and runner speak different protocol versions
    │   ├── RunnerProtocolError     the runner sent a malformed message
    │   ├── RunnerCrashed           the process died (exit code or signal) with requests in flight
    │   ├── RunnerTimeout           a load, handshake or request took longer than its limit
    │   ├── RunnerMemoryLimit       the process went over its memory limit
    │   ├── RunnerCPULimit          the process went over its CPU-time limit
    │   ├── RunnerFailed            the runner's own code raised while handling a request (carries its message)
    │   └── ModelClosed             the model was closed before or during the call
    ├── InvalidInput                inputs do not match the model's declared inputs (names the tensor)
    ├── InvalidOutput               the runner returned outputs that do not match the declared outputs
    ├── SandboxError                the sandbox could not be set up
    │   ├── SandboxConfigError      a sandbox policy or RunnerLimits value is invalid (also a ValueError)
    │   └── SandboxUnavailable      the strict policy needs a layer this machine does not have (names it)
    └── ServerError                 the model server refused a request (carries its HTTP status)
        ├── BadRequest              a request is malformed: body, header, tensor data, names (400)
        │   └── RequestTooLarge     a request body is over the server's size limit (413)
        ├── ModelNotFound           no such model, or no ready version of it (404)
        ├── ModelUnavailable        the model timed out or went away under a request; retrying may work (503)
        └── RepositoryError         a repository load or unload failed: config, files, carton, timeout (400)
            └── UploadDisabled      a load sent `file:` payloads to a server started with uploads off (403)

Warnings: `CartonWarning` (root), `RunnerWarning` (a runner's warning, e.g. unknown options), `SandboxWarning`,
`PlatformWarning` (a carton packed for platforms of which this machine is none).
"""

from __future__ import annotations

__all__ = [
    "ArchiveTooLarge",
    "BadRequest",
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
    "ModelNotFound",
    "ModelUnavailable",
    "NoCompatibleRunner",
    "PackError",
    "PlatformWarning",
    "ProtocolMismatch",
    "RepositoryError",
    "RequestTooLarge",
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
    "ServerError",
    "TensorDataError",
    "UnsafeArchive",
    "UnsupportedModel",
    "UploadDisabled",
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


class UnsupportedModel(MCFError):
    """The mcf runner does not implement the model's architecture or one of its config keys; names them."""


# --- runner resolution ----------------------------------------------------------------------------------------
class ResolutionError(CartonError):
    """Finding a runner for a model failed."""


class InvalidVersionReq(ResolutionError):
    """A framework version requirement is not a valid Cargo-style requirement."""


class InvalidVersion(ResolutionError):
    """A framework version is neither SemVer nor PEP 440, or uses a PEP 440 epoch SemVer cannot express."""


class NoCompatibleRunner(ResolutionError):
    """No installed runner satisfies the model; the message lists each candidate and why it was rejected."""


class EnvironmentInstallError(ResolutionError):
    """Building an isolated runner environment failed; nothing was registered."""


# --- runner processes -----------------------------------------------------------------------------------------
class RunnerError(CartonError):
    """A runner process failed."""


class RunnerStartError(RunnerError):
    """The runner process could not start, load its model, or complete the handshake."""


class ProtocolMismatch(RunnerError):
    """The host and the runner speak different protocol versions."""


class RunnerProtocolError(RunnerError):
    """The runner sent a message the host could not decode."""


class RunnerCrashed(RunnerError):
    """The runner process died (names the exit code or signal)."""


class RunnerTimeout(RunnerError):
    """A load, handshake or request exceeded its time limit (names the limit)."""


class RunnerMemoryLimit(RunnerError):
    """The runner process exceeded its memory limit."""


class RunnerCPULimit(RunnerError):
    """The runner process exceeded its CPU-time limit."""


class RunnerFailed(RunnerError):
    """The runner's own code raised while handling a request; the message is the runner's."""


class ModelClosed(RunnerError):
    """The model was closed before or while the call ran."""


# --- tensors --------------------------------------------------------------------------------------------------
class InvalidInput(CartonError):
    """Inputs do not match the model's declared inputs; names the tensor at fault."""


class InvalidOutput(CartonError):
    """A runner's outputs do not match the model's declared outputs; names the tensor at fault."""


# --- sandbox --------------------------------------------------------------------------------------------------
class SandboxError(CartonError):
    """The sandbox for a runner could not be set up."""


class SandboxConfigError(SandboxError, ValueError):
    """A usage error: an unknown sandbox policy, or a `RunnerLimits` value that is not a positive number.

    Also a `ValueError`, since that is what it is; names the field or the allowed values."""


class SandboxUnavailable(SandboxError):
    """The strict policy needs a sandbox layer this machine does not provide; names the layer."""


# --- model server ---------------------------------------------------------------------------------------------
class ServerError(CartonError):
    """The model server refused a request; `http_status` is the HTTP status it is answered with."""

    http_status: int = 500


class BadRequest(ServerError):
    """A request is malformed (body, header, tensor data, model name); names the field or tensor at fault."""

    http_status = 400


class RequestTooLarge(BadRequest):
    """A request body is larger than the server's configured limit."""

    http_status = 413


class ModelNotFound(ServerError):
    """The model does not exist, or has no ready version (not loaded, loading, or being unloaded)."""

    http_status = 404


class ModelUnavailable(ServerError):
    """The model could not answer this request in time, or went away under it; retrying may succeed.

    Answered like Triton's ``UNAVAILABLE`` errors (its request timeouts among them): HTTP 503, gRPC UNAVAILABLE.
    """

    http_status = 503


class RepositoryError(ServerError):
    """A repository load or unload failed: bad config, bad `file:` payload, invalid carton, or a load timeout."""

    http_status = 400


class UploadDisabled(RepositoryError):
    """A load sent `file:` payloads to a server started with model upload disabled."""

    http_status = 403


# --- warnings -------------------------------------------------------------------------------------------------
class CartonWarning(UserWarning):
    """Root of carton's warnings."""


class RunnerWarning(CartonWarning):
    """A warning raised by a runner (for example, options it does not understand)."""


class SandboxWarning(CartonWarning):
    """A sandbox layer is missing under the best_effort policy."""


class PlatformWarning(CartonWarning):
    """A carton is packed with ``required_platforms`` that leave out this machine: it will not load here."""
