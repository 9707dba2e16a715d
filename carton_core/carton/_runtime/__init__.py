"""Runner resolution (plugins, Cargo version requirements, target triples), runner processes and `Model`.

`carton.load` itself is a workflow above this layer (`carton._workflows`): it reads the carton and picks the
sandbox, then hands a `Model` its `LoadSettings`.
"""

from .._semver import Comparator, VersionReq, framework_version
from ._cgroups import CGROUPS_ENV, CgroupSupport, cgroup_support
from ._hookspecs import hookspec
from ._isolation import RunnerLimits, SandboxPolicy, check_limits, sandbox_policy
from ._model import Model, close_started
from ._pack import PackOutcome, pack_in_runner, serialize_model
from ._platform import target_triple
from ._plugins import Discovery, PluginProblem, discover, discover_runners, plugin_manager, reset_plugins
from ._prestart import prestart
from ._process import RunnerProcess
from ._resolve import RunnerRequest, requirement_source, resolve_runner, select_runner
from ._selftest import SelfTestResult
from ._settings import DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_LOAD_TIMEOUT, LoadSettings
from ._spares import spare_pool

__all__ = [
    "CGROUPS_ENV",
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_LOAD_TIMEOUT",
    "CgroupSupport",
    "Comparator",
    "Discovery",
    "LoadSettings",
    "Model",
    "PackOutcome",
    "PluginProblem",
    "RunnerLimits",
    "RunnerProcess",
    "RunnerRequest",
    "SandboxPolicy",
    "SelfTestResult",
    "VersionReq",
    "cgroup_support",
    "check_limits",
    "close_started",
    "discover",
    "discover_runners",
    "framework_version",
    "hookspec",
    "pack_in_runner",
    "plugin_manager",
    "prestart",
    "requirement_source",
    "reset_plugins",
    "resolve_runner",
    "sandbox_policy",
    "select_runner",
    "serialize_model",
    "spare_pool",
    "target_triple",
]
