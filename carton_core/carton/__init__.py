"""carton: package ML models as .carton files and run them in isolated runner processes.

    import carton
    with carton.load("model.carton") as model:
        outputs = model.infer({"x": x})

The API tour is in README.md; every error derives from `carton.CartonError` (drawn in `carton.errors`).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from carton_protocol import DType, Runner, RunnerSpec, TensorSpec

from ._version import __version__
from .errors import (
    ArchiveTooLarge,
    CartonError,
    CartonWarning,
    ConfigError,
    EnvironmentInstallError,
    FetchError,
    FormatError,
    InvalidInput,
    InvalidOutput,
    InvalidVersion,
    InvalidVersionReq,
    LinkError,
    ManifestError,
    MCFError,
    ModelClosed,
    NoCompatibleRunner,
    PackError,
    PlatformWarning,
    ProtocolMismatch,
    ResolutionError,
    RunnerCPULimit,
    RunnerCrashed,
    RunnerError,
    RunnerFailed,
    RunnerMemoryLimit,
    RunnerProtocolError,
    RunnerStartError,
    RunnerTimeout,
    RunnerWarning,
    SafetensorsError,
    SandboxConfigError,
    SandboxError,
    SandboxUnavailable,
    SandboxWarning,
    TensorDataError,
    UnsafeArchive,
    UnsupportedModel,
)

# The host's modules load on first use (PEP 562): a runner process imports `carton.errors` or `carton.mcf`,
# which runs this file, and must not pay for the host's HTTP, format and process code (docs/performance.md, "MCF
# runner").
_LAZY = {
    "RunnerEnvironment": "._environments",
    "install_runner": "._environments",
    "list_runner_environments": "._environments",
    "remove_runner_environment": "._environments",
    "CartonInfo": "._format",
    "Example": "._format",
    "MiscRef": "._format",
    "ReadLimits": "._format",
    "RunnerInfo": "._format",
    "SelfTest": "._format",
    "TensorRef": "._format",
    "get_model_info": "._format",
    "pack": "._workflows",
    "shrink": "._format",
    "verify": "._format",
    "Model": "._runtime",
    "RunnerLimits": "._runtime",
    "SandboxPolicy": "._runtime",
    "SelfTestResult": "._runtime",
    "VersionReq": "._runtime",
    "discover_runners": "._runtime",
    "load": "._workflows",
    "load_unpacked": "._workflows",
    "prestart": "._runtime",
    "target_triple": "._runtime",
    "BadRequest": ".server.errors",
    "ModelNotFound": ".server.errors",
    "ModelUnavailable": ".server.errors",
    "RepositoryError": ".server.errors",
    "RequestTooLarge": ".server.errors",
    "ServerError": ".server.errors",
    "UploadDisabled": ".server.errors",
}

if TYPE_CHECKING:
    from ._environments import (
        RunnerEnvironment,
        install_runner,
        list_runner_environments,
        remove_runner_environment,
    )
    from ._format import (
        CartonInfo,
        Example,
        MiscRef,
        ReadLimits,
        RunnerInfo,
        SelfTest,
        TensorRef,
        get_model_info,
        shrink,
        verify,
    )
    from ._runtime import (
        Model,
        RunnerLimits,
        SandboxPolicy,
        SelfTestResult,
        VersionReq,
        discover_runners,
        prestart,
        target_triple,
    )
    from ._workflows import load, load_unpacked, pack
    from .server.errors import (
        BadRequest,
        ModelNotFound,
        ModelUnavailable,
        RepositoryError,
        RequestTooLarge,
        ServerError,
        UploadDisabled,
    )


__all__ = [
    "ArchiveTooLarge",
    "BadRequest",
    "CartonError",
    "CartonInfo",
    "CartonWarning",
    "ConfigError",
    "DType",
    "EnvironmentInstallError",
    "Example",
    "FetchError",
    "FormatError",
    "InvalidInput",
    "InvalidOutput",
    "InvalidVersion",
    "InvalidVersionReq",
    "LinkError",
    "MCFError",
    "ManifestError",
    "MiscRef",
    "Model",
    "ModelClosed",
    "ModelNotFound",
    "ModelUnavailable",
    "NoCompatibleRunner",
    "PackError",
    "PlatformWarning",
    "ProtocolMismatch",
    "ReadLimits",
    "RepositoryError",
    "RequestTooLarge",
    "ResolutionError",
    "Runner",
    "RunnerCPULimit",
    "RunnerCrashed",
    "RunnerEnvironment",
    "RunnerError",
    "RunnerFailed",
    "RunnerInfo",
    "RunnerLimits",
    "RunnerMemoryLimit",
    "RunnerProtocolError",
    "RunnerSpec",
    "RunnerStartError",
    "RunnerTimeout",
    "RunnerWarning",
    "SafetensorsError",
    "SandboxConfigError",
    "SandboxError",
    "SandboxPolicy",
    "SandboxUnavailable",
    "SandboxWarning",
    "SelfTest",
    "SelfTestResult",
    "ServerError",
    "TensorDataError",
    "TensorRef",
    "TensorSpec",
    "UnsafeArchive",
    "UnsupportedModel",
    "UploadDisabled",
    "VersionReq",
    "__version__",
    "discover_runners",
    "get_model_info",
    "install_runner",
    "list_runner_environments",
    "load",
    "load_unpacked",
    "pack",
    "prestart",
    "remove_runner_environment",
    "shrink",
    "target_triple",
    "verify",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'carton' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
