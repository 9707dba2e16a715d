"""carton: package ML models as .carton files and run them in isolated runner processes.

    import carton
    with carton.load("model.carton") as model:
        outputs = model.infer({"x": x})
"""

from carton_protocol import DType, RunnerSpec, Runner, TensorSpec

from .errors import (
    ArchiveTooLarge,
    CartonError,
    CartonWarning,
    ConfigError,
    EnvironmentInstallError,
    FormatError,
    InvalidInput,
    InvalidOutput,
    InvalidVersionReq,
    LinkError,
    ManifestError,
    MCFError,
    ModelClosed,
    NoCompatibleRunner,
    PackError,
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
    SandboxError,
    SandboxUnavailable,
    SandboxWarning,
    TensorDataError,
    UnsafeArchive,
)

# Each part of the package adds its public names below, in its own block, and to __all__.
# --- package format (_format) ---
# --- runtime (_runtime) ---
# --- runner environments (_environments) ---
# --- sandbox (_sandbox) ---

__version__ = "0.1.0"

__all__ = [
    "ArchiveTooLarge",
    "CartonError",
    "CartonWarning",
    "ConfigError",
    "DType",
    "EnvironmentInstallError",
    "FormatError",
    "InvalidInput",
    "InvalidOutput",
    "InvalidVersionReq",
    "LinkError",
    "MCFError",
    "ManifestError",
    "ModelClosed",
    "NoCompatibleRunner",
    "PackError",
    "ProtocolMismatch",
    "ResolutionError",
    "Runner",
    "RunnerCPULimit",
    "RunnerCrashed",
    "RunnerError",
    "RunnerFailed",
    "RunnerMemoryLimit",
    "RunnerProtocolError",
    "RunnerSpec",
    "RunnerStartError",
    "RunnerTimeout",
    "RunnerWarning",
    "SafetensorsError",
    "SandboxError",
    "SandboxUnavailable",
    "SandboxWarning",
    "TensorDataError",
    "TensorSpec",
    "UnsafeArchive",
    "__version__",
]
