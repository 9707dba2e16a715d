"""From a policy and limits to a launch-plan wrapper: which layers apply, and the argv that applies them.

The wrapped argv is ``bwrap <binds> -- python <shim> CONFIG -- <runner argv>`` with bubblewrap, or
``python <shim> CONFIG -- <runner argv>`` with the ``unshare`` backend, where the shim itself creates the namespaces
and the private root (``_namespaces.py``) from the same allow-list as bubblewrap's binds. The runner's
``--host-pid`` watch is dropped inside a PID namespace (the host's pid means nothing there); the parent-death signal
chain and PID 1's death replace it.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from .._runtime._isolation import RunnerLimits, SandboxPolicy
from .._runtime._launch import LaunchPlan, LaunchWrapper
from ..errors import SandboxError, SandboxUnavailable, SandboxWarning
from ._layers import SHIM, Backend, Layer, LayerStatus, MachineSupport, fresh_uid, machine_support
from ._namespaces import namespace_config
from ._paths import import_roots, system_paths

__all__ = ["BACKEND_ENV", "SandboxSetup", "forced_backend", "launch_wrapper", "plan_setup"]


#: Environment variable forcing a backend (``bwrap`` or ``unshare``), for tests and for machines where one misbehaves.
BACKEND_ENV = "CARTON_SANDBOX_BACKEND"
_NOBODY = 65534
_NOFILE_DEFAULT = 4096
_SYSTEM_PATH = ("/usr/local/bin", "/usr/bin", "/bin")


class SandboxSetup:
    """The layers a policy gets on this machine, and how to wrap each runner's launch plan with them."""

    def __init__(self, policy: SandboxPolicy, limits: RunnerLimits | None, backend: Backend | None,
                 layers: tuple[LayerStatus, ...], support: MachineSupport) -> None:
        self.policy = policy
        self.limits = limits
        self.backend = backend
        self.layers = layers
        self.support = support
        self.active = frozenset(status.layer for status in layers if status.available)

    def rlimits(self) -> dict[str, list[int]]:
        limits = self.limits
        values: dict[str, list[int]] = {"CORE": [0, 0]}
        if self.policy is not SandboxPolicy.NONE:
            values["NOFILE"] = [_NOFILE_DEFAULT, _NOFILE_DEFAULT]
        if limits is None:
            return values
        if limits.memory_bytes is not None:
            values["AS"] = [int(limits.memory_bytes)] * 2
        if limits.cpu_seconds is not None:
            soft = max(1, int(-(-limits.cpu_seconds // 1)))
            values["CPU"] = [soft, soft + 1]  # SIGXCPU at the soft limit, SIGKILL a second later if it is caught
        if limits.processes is not None:
            values["NPROC"] = [int(limits.processes)] * 2
        if limits.open_files is not None:
            values["NOFILE"] = [int(limits.open_files)] * 2
        if limits.file_size_bytes is not None:
            values["FSIZE"] = [int(limits.file_size_bytes)] * 2
        return values

    def plan_limits(self) -> dict[str, float]:
        limits = self.limits
        if limits is None:
            return {}
        names = ("memory_bytes", "cpu_seconds", "request_seconds", "processes", "open_files", "file_size_bytes")
        return {name: float(getattr(limits, name)) for name in names if getattr(limits, name) is not None}

    # --- wrapping ------------------------------------------------------------------------------------------------
    def wrap(self, plan: LaunchPlan) -> LaunchPlan:
        if self.backend is None:
            config = {"pdeathsig": Layer.PARENT_DEATH_SIGNAL in self.active, "rlimits": self.rlimits()}
            argv = (*_shim_argv(sys.executable, config), *plan.argv)
            return replace(plan, argv=argv, limits=self.plan_limits())
        runner_argv = _without_host_pid(plan.argv)
        uid = self._uid(plan)
        read, write = self._paths(plan)
        inner: dict[str, object] = {
            "pdeathsig": True,
            # The shim is the namespace's PID 1 under both backends (bwrap with --as-pid-1): it reaps the whole
            # tree, so the CPU time the runner used adds up to the process the host reaps (the CPU-limit verdict).
            "reaper": True,
            "rlimits": self.rlimits(),
            "close_fds": True,
            "keep_fds": list(plan.pass_fds),
            "seccomp": Layer.SECCOMP in self.active,
            "landlock": {"read": read, "write": write} if Layer.LANDLOCK in self.active else None,
        }
        if uid is not None:
            inner.update(uid=uid, gid=uid)
        shim_python = _shim_python(plan)
        if self.backend is Backend.BWRAP:
            argv = (*self._bwrap_argv(plan, read), *_shim_argv(shim_python, inner), *runner_argv)
        else:
            inner["namespaces"] = namespace_config(
                read=[path for path in read if path not in ("/proc", "/dev")], write=[str(plan.scratch_dir)],
                cwd=str(plan.cwd), user_namespace=not self.support.is_root)
            argv = (*_shim_argv(shim_python, inner), *runner_argv)
        # The host's PATH names its own folders; the runner gets its interpreter's and the system's.
        env = {**plan.env, "PATH": os.pathsep.join([str(Path(plan.argv[0]).parent), *_SYSTEM_PATH])}
        return replace(plan, argv=argv, env=env, limits=self.plan_limits(), exit_signal_base=128)

    def _uid(self, plan: LaunchPlan) -> int | None:
        if not self.support.is_root:
            return None  # unprivileged: bwrap or the shim maps the caller to uid 65534 in a user namespace
        uid = fresh_uid()
        try:
            # Only scratch: the runtime directory around it (the runner's socket and log) stays the host's.
            os.chown(plan.scratch_dir, uid, uid)
        except OSError as exc:
            raise SandboxError(f"cannot hand scratch directory {plan.scratch_dir} to sandbox uid {uid}: {exc}") from exc
        return uid

    def _paths(self, plan: LaunchPlan) -> tuple[list[str], list[str]]:
        read = [*system_paths(), *import_roots(plan.argv[0], plan.env), str(SHIM.parent), "/proc", "/dev"]
        if plan.model_dir is not None:
            read.append(str(plan.model_dir))
        write = [str(plan.scratch_dir), "/dev/null"]
        return read, write

    def _bwrap_argv(self, plan: LaunchPlan, read: list[str]) -> list[str]:
        bwrap = self.support.backend_paths[Backend.BWRAP]
        assert bwrap is not None
        argv = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--as-pid-1", "--unshare-net",
                "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "carton-sandbox"]
        if not self.support.is_root:
            argv += ["--unshare-user", "--uid", str(_NOBODY), "--gid", str(_NOBODY), "--disable-userns"]
        binds = [path for path in read if path not in ("/proc", "/dev")]
        if plan.model_dir is not None:
            binds.append(str(plan.model_dir))
        # bubblewrap would create missing parents 0700 (root-owned), which the runner's uid could not traverse.
        argv += _parent_dirs([*binds, str(plan.scratch_dir)])
        for path in binds:
            if Path(path).is_symlink() and str(Path(path).parent) == "/":
                argv += ["--symlink", str(Path(path).readlink()), path]
            else:
                argv += ["--ro-bind", path, path]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        argv += _parent_dirs([str(plan.scratch_dir)], under_dev=True)
        # Of the runtime directory only scratch: its socket and log the runner reaches through inherited descriptors.
        argv += ["--bind", str(plan.scratch_dir), str(plan.scratch_dir)]
        argv += ["--remount-ro", "/", "--chdir", str(plan.cwd), "--"]
        return argv


def _parent_dirs(paths: list[str], *, under_dev: bool = False) -> list[str]:
    """``--perms 0755 --dir`` for every ancestor of `paths` (those under /dev only after ``--dev``)."""
    ancestors: set[str] = set()
    for path in paths:
        parent = Path(path).parent
        while str(parent) != "/":
            ancestors.add(str(parent))
            parent = parent.parent
    argv: list[str] = []
    for ancestor in sorted(ancestors):
        if (ancestor == "/dev" or ancestor.startswith("/dev/")) != under_dev or ancestor == "/dev":
            continue
        if Path(ancestor).is_symlink():
            continue
        argv += ["--perms", "0755", "--dir", ancestor]
    return argv


def _shim_python(plan: LaunchPlan) -> str:
    # The runner's own interpreter is visible in every view; the host's may not be (an isolated environment).
    return plan.argv[0]


def _shim_argv(python: str, config: Mapping[str, object]) -> tuple[str, ...]:
    return (python, "-E", "-s", "-S", str(SHIM), json.dumps(config, separators=(",", ":")), "--")


def _without_host_pid(argv: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
        elif item == "--host-pid":
            skip = True
        else:
            out.append(item)
    return tuple(out)


def forced_backend() -> Backend | None:
    """The backend named by `BACKEND_ENV`, if any."""
    value = os.environ.get(BACKEND_ENV, "").strip()
    if not value:
        return None
    try:
        return Backend(value)
    except ValueError:
        choices = ", ".join(backend.value for backend in Backend)
        raise SandboxError(f"{BACKEND_ENV}={value!r} is not a sandbox backend (choose one of {choices})") from None


def plan_setup(policy: SandboxPolicy, limits: RunnerLimits | None) -> SandboxSetup:
    """Decide the layers for `policy` on this machine: `strict` raises `SandboxUnavailable` naming every missing
    layer, `best_effort` warns (`SandboxWarning`) once per missing layer."""
    support = machine_support()
    if policy is SandboxPolicy.NONE:
        return SandboxSetup(policy, limits, None, (), support)
    forced = forced_backend()
    backend = support.backend(forced)
    layers = list(support.layers(backend))
    if forced is not None and backend is None:
        layers = [LayerStatus(layer=status.layer, available=False,
                              detail=f"{BACKEND_ENV}={forced.value}: {support.backends[forced]}")
                  if status.layer.endswith("namespace") else status for status in layers]
    if limits is not None and limits.processes is not None and not _has(layers, Layer.NON_ROOT_UID):
        layers = [LayerStatus(layer=Layer.RESOURCE_LIMITS, available=False,
                              detail="the processes limit (RLIMIT_NPROC) is not enforced for uid 0")
                  if status.layer is Layer.RESOURCE_LIMITS else status for status in layers]
    missing = [status for status in layers if not status.available]
    if missing and policy is SandboxPolicy.STRICT:
        text = "; ".join(f"{status.layer.value}: {status.detail}" for status in missing)
        raise SandboxUnavailable(f"sandbox policy 'strict' cannot start the runner, missing layers: {text}")
    for status in missing:
        warnings.warn(f"sandbox layer {status.layer.value} is unavailable: {status.detail}", SandboxWarning,
                      stacklevel=4)
    return SandboxSetup(policy, limits, backend, tuple(layers), support)


def _has(layers: list[LayerStatus], layer: Layer) -> bool:
    return any(status.layer is layer and status.available for status in layers)


def launch_wrapper(policy: SandboxPolicy, limits: RunnerLimits | None, *, model_dir: Path) -> LaunchWrapper | None:
    """The ``wrap=`` for every runner process of a model (``None``: run unwrapped, the `none` policy without limits).

    Called by `carton.load` (``carton._workflows``); `model_dir` is bound read-only into the view.
    """
    del model_dir  # each launch plan carries it
    if policy is SandboxPolicy.NONE and (limits is None or not _needs_shim(limits)):
        return None
    return plan_setup(policy, limits).wrap


def _needs_shim(limits: RunnerLimits) -> bool:
    return any(getattr(limits, name) is not None
               for name in ("memory_bytes", "cpu_seconds", "processes", "open_files", "file_size_bytes"))
