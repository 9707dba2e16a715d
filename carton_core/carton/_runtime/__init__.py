"""Runner resolution (plugins, Cargo version requirements, target triples), runner processes and `Model`."""

from ._hookspecs import hookspec
from ._isolation import RunnerLimits, SandboxPolicy
from ._model import Model, load, load_unpacked
from ._pack import PackOutcome, pack_in_runner, serialize_model
from ._platform import target_triple
from ._plugins import Discovery, PluginProblem, discover, discover_runners, plugin_manager, reset_plugins
from ._prestart import prestart
from ._process import RunnerProcess
from ._resolve import Rejection, RunnerRequest, resolve_runner, select_runner
from ._selftest import SelfTestResult
from ._semver import Comparator, VersionReq, framework_version

__all__ = [
    "Comparator",
    "Discovery",
    "Model",
    "PackOutcome",
    "PluginProblem",
    "Rejection",
    "RunnerLimits",
    "RunnerProcess",
    "RunnerRequest",
    "SandboxPolicy",
    "SelfTestResult",
    "VersionReq",
    "discover",
    "discover_runners",
    "framework_version",
    "hookspec",
    "load",
    "load_unpacked",
    "pack_in_runner",
    "plugin_manager",
    "prestart",
    "reset_plugins",
    "resolve_runner",
    "select_runner",
    "serialize_model",
    "target_triple",
]
