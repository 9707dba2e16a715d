"""The sandbox layers, the backends that provide the namespaces, and what this machine supports (probed once)."""

from __future__ import annotations

import enum
import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from . import _landlock, _seccomp
from ._namespaces import namespace_config
from ._paths import import_roots, system_paths

__all__ = ["SHIM", "Backend", "Layer", "LayerStatus", "MachineSupport", "fresh_uid", "machine_support"]

_PROBE_TIMEOUT = 10.0
SHIM = Path(__file__).resolve().with_name("_shim.py")
#: Unprivileged uids handed to runners when the host is root: one fresh uid per runner, so the ``processes``
#: limit (RLIMIT_NPROC counts per uid) is that runner's alone and runners cannot signal each other.
_UID_BASE = 0x10000000
_UID_SPAN = 1 << 24


class Layer(enum.StrEnum):
    """One protection of the sandbox. Warnings and errors name these values."""

    PARENT_DEATH_SIGNAL = "parent_death_signal"
    PID_NAMESPACE = "pid_namespace"
    NETWORK_NAMESPACE = "network_namespace"
    MOUNT_NAMESPACE = "mount_namespace"
    IPC_NAMESPACE = "ipc_namespace"
    FILESYSTEM_VIEW = "filesystem_view"
    RESOURCE_LIMITS = "resource_limits"
    LANDLOCK = "landlock"
    SECCOMP = "seccomp"
    NON_ROOT_UID = "non_root_uid"


class Backend(enum.StrEnum):
    """What creates the namespaces and the filesystem view: bubblewrap, or the shim itself with ``unshare(2)``."""

    BWRAP = "bwrap"
    UNSHARE = "unshare"


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerStatus:
    layer: Layer
    available: bool
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class MachineSupport:
    """What this machine offers: each backend's usability (``None`` = usable, else why not) and the other layers."""

    is_root: bool
    backends: dict[Backend, str | None]
    backend_paths: dict[Backend, str | None]
    landlock_abi: int
    seccomp: str | None
    rlimits: str | None
    pdeathsig: str | None

    def backend(self, forced: Backend | None = None) -> Backend | None:
        """The backend to use: `forced` when usable, else bwrap, else unshare, else None."""
        if forced is not None:
            return forced if self.backends.get(forced) is None else None
        for candidate in (Backend.BWRAP, Backend.UNSHARE):
            if self.backends.get(candidate) is None:
                return candidate
        return None

    def layers(self, backend: Backend | None) -> tuple[LayerStatus, ...]:
        """Layer by layer, what a sandbox built with `backend` gets on this machine."""
        statuses: list[LayerStatus] = []

        def add(layer: Layer, why_not: str | None, detail: str) -> None:
            statuses.append(LayerStatus(layer=layer, available=why_not is None, detail=why_not or detail))

        add(Layer.PARENT_DEATH_SIGNAL, self.pdeathsig, "prctl(PR_SET_PDEATHSIG) in the shim")
        if backend is None:
            reasons = "; ".join(f"{name}: {why}" for name, why in self.backends.items())
            for layer in (Layer.PID_NAMESPACE, Layer.NETWORK_NAMESPACE, Layer.MOUNT_NAMESPACE, Layer.IPC_NAMESPACE):
                add(layer, f"no namespace backend ({reasons})", "")
        else:
            how = "bwrap" if backend is Backend.BWRAP else "unshare(2) in the shim"
            for layer in (Layer.PID_NAMESPACE, Layer.NETWORK_NAMESPACE, Layer.MOUNT_NAMESPACE, Layer.IPC_NAMESPACE):
                add(layer, None, f"via {how} ({self.backend_paths[backend]})")
        if backend is Backend.BWRAP:
            add(Layer.FILESYSTEM_VIEW, None, "bubblewrap binds: system and Python paths and the model read-only, "
                "the runner's scratch folder read-write, nothing else")
        elif backend is Backend.UNSHARE:
            add(Layer.FILESYSTEM_VIEW, None, "the shim's private root (tmpfs + pivot_root): system and Python "
                "paths and the model bound read-only, the runner's scratch folder read-write, fresh /proc, minimal "
                "/dev")
        else:
            add(Layer.FILESYSTEM_VIEW, "no namespace backend to build a private root", "")
        add(Layer.RESOURCE_LIMITS, self.rlimits, "setrlimit AS, CPU, NOFILE, NPROC, FSIZE in the shim")
        add(Layer.LANDLOCK, None if self.landlock_abi else "the kernel has no Landlock (or it is disabled)",
            f"ABI {self.landlock_abi}")
        add(Layer.SECCOMP, self.seccomp, "deny-list BPF filter (see carton._sandbox._seccomp)")
        add(Layer.NON_ROOT_UID, self._uid_problem(backend), self._uid_detail(backend))
        return tuple(statuses)

    def _uid_problem(self, backend: Backend | None) -> str | None:
        if backend is None:
            return "no namespace backend to map or switch the uid"
        return None

    def _uid_detail(self, backend: Backend | None) -> str:
        where = "bwrap's namespaces" if backend is Backend.BWRAP else "the shim's namespaces"
        if self.is_root:
            return f"the shim drops to a fresh unprivileged uid per runner (setresuid) inside {where}"
        return f"uid 65534 (mapped to the caller's uid) in a user namespace created by {where}"


def _run_probe(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=_PROBE_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]} failed to run: {exc}"
    if done.returncode != 0:
        text = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"{Path(argv[0]).name} probe exited with {done.returncode}: {text[-1] if text else 'no output'}"
    return None


def _probe_bwrap(path: str | None, is_root: bool) -> str | None:
    if path is None:
        return "bwrap is not installed (apt-get install bubblewrap)"
    argv = [path, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--die-with-parent", "--ro-bind", "/", "/",
            "--proc", "/proc", "--dev", "/dev"]
    if not is_root:
        argv += ["--unshare-user", "--uid", "65534", "--gid", "65534"]
    return _run_probe([*argv, "--", sys.executable, "-S", "-c", "pass"])


#: Run inside the probe's sandbox: exits non-zero, saying why, unless every property of the view holds.
_UNSHARE_CHECK = (
    "import os, sys\n"
    "problems = [text for text, bad in (\n"
    "    (f'pid {os.getpid()} is not 2 (no PID namespace)', os.getpid() != 2),\n"
    "    ('still uid 0', os.getuid() == 0),\n"
    "    ('/etc/shadow is visible (no private root)', os.path.lexists('/etc/shadow')),\n"
    "    ('/proc is not the namespace\\'s', sorted(p for p in os.listdir('/proc') if p.isdigit()) != ['1', '2']),\n"
    ") if bad]\n"
    "sys.exit('; '.join(problems) if problems else 0)\n"
)


def fresh_uid() -> int:
    """A random unprivileged uid for one runner (the host is root)."""
    return _UID_BASE + secrets.randbelow(_UID_SPAN)


def _probe_unshare(is_root: bool) -> str | None:
    """Build a real sandbox with the shim (namespaces, private root, uid switch) around ``python -c CHECK``."""
    read = [*system_paths(), *import_roots(sys.executable, {}), str(SHIM.parent)]
    config: dict[str, object] = {
        "pdeathsig": True,
        "namespaces": namespace_config(read=read, write=[], cwd="/", user_namespace=not is_root),
        "reaper": True,
        "close_fds": True,
    }
    if is_root:
        uid = fresh_uid()
        config.update(uid=uid, gid=uid)
    shim = [sys.executable, "-E", "-s", "-S", str(SHIM), json.dumps(config, separators=(",", ":")), "--"]
    return _run_probe([*shim, sys.executable, "-E", "-S", "-c", _UNSHARE_CHECK])


def _rlimits_problem() -> str | None:
    try:
        import resource

        resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError) as exc:
        return f"setrlimit is not available: {exc}"
    return None


def _pdeathsig_problem() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"prctl(PR_SET_PDEATHSIG) is Linux-only (this is {sys.platform})"
    return None


@functools.cache
def machine_support() -> MachineSupport:
    """Probe this machine once per process (each backend is tried by really starting a sandboxed ``true``)."""
    is_root = os.geteuid() == 0
    linux = sys.platform.startswith("linux")
    # The unshare backend needs no binary: the shim makes the syscalls (its path is what doctor shows).
    paths = {Backend.BWRAP: shutil.which("bwrap"), Backend.UNSHARE: str(SHIM) if linux else None}
    if linux:
        backends = {
            Backend.BWRAP: _probe_bwrap(paths[Backend.BWRAP], is_root),
            Backend.UNSHARE: _probe_unshare(is_root),
        }
    else:
        backends = {backend: f"namespaces are Linux-only (this is {sys.platform})" for backend in Backend}
    return MachineSupport(
        is_root=is_root,
        backends=backends,
        backend_paths=paths,
        landlock_abi=_landlock.abi_version() if linux else 0,
        seccomp=_seccomp.supported() if linux else f"seccomp is Linux-only (this is {sys.platform})",
        rlimits=_rlimits_problem(),
        pdeathsig=_pdeathsig_problem(),
    )
