"""Policies, layer detection, the seccomp program's bytes, Landlock and the shim, exit classification."""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import carton
import numpy as np
import pytest
from carton._runtime._exits import describe_exit, exit_signal, memory_failure
from carton._sandbox import Backend, Layer, SandboxPolicy, _seccomp, _wrap, launch_wrapper, machine_support, plan_setup
from carton._sandbox._layers import SHIM
from carton._sandbox._paths import system_paths
from carton._sandbox._shim import SETUP_FAILED
from carton.errors import (
    RunnerMemoryLimit,
    RunnerStartError,
    SandboxConfigError,
    SandboxError,
    SandboxUnavailable,
    SandboxWarning,
)

# --- policies --------------------------------------------------------------------------------------------------


def _crippled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this machine has no namespace backend, no Landlock and no seccomp."""
    real = machine_support()
    fake = dataclasses.replace(
        real,
        backends={backend: f"{backend.value} missing (test)" for backend in Backend},
        landlock_abi=0,
        seccomp="no seccomp (test)",
    )
    monkeypatch.setattr(_wrap, "machine_support", lambda: fake)


def test_strict_names_every_missing_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    _crippled(monkeypatch)
    with pytest.raises(SandboxUnavailable) as caught:
        plan_setup(SandboxPolicy.STRICT, None)
    text = str(caught.value)
    for layer in (
        "pid_namespace",
        "network_namespace",
        "mount_namespace",
        "ipc_namespace",
        "filesystem_view",
        "landlock",
        "seccomp",
        "non_root_uid",
    ):
        assert layer in text
    assert "bwrap missing (test)" in text


def test_best_effort_warns_once_per_missing_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    _crippled(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        setup = plan_setup(SandboxPolicy.BEST_EFFORT, None)
    messages = [str(w.message) for w in caught if issubclass(w.category, SandboxWarning)]
    assert len(messages) == 8
    assert any("seccomp" in message for message in messages)
    assert Layer.RESOURCE_LIMITS in setup.active and Layer.PARENT_DEATH_SIGNAL in setup.active


def test_unknown_backend_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARTON_SANDBOX_BACKEND", "docker")
    with pytest.raises(SandboxError, match="CARTON_SANDBOX_BACKEND='docker'"):
        plan_setup(SandboxPolicy.STRICT, None)


@pytest.mark.usefixtures("adversarial_plugin")
def test_unknown_policy_is_refused(tmp_path: Path) -> None:
    allowed = r"\(choose one of 'none', 'best_effort', 'strict'\)"
    with pytest.raises(SandboxConfigError, match=f"unknown sandbox policy 'paranoid' {allowed}") as caught:
        carton.load_unpacked(tmp_path, runner_name="adversary", required_framework_version="1", sandbox="paranoid")
    assert isinstance(caught.value, ValueError) and not isinstance(caught.value, SandboxUnavailable)


def test_none_without_limits_is_unwrapped(tmp_path: Path) -> None:
    assert launch_wrapper(SandboxPolicy.NONE, None, model_dir=tmp_path) is None
    assert launch_wrapper(SandboxPolicy.NONE, carton.RunnerLimits(request_seconds=1), model_dir=tmp_path) is None
    assert launch_wrapper(SandboxPolicy.NONE, carton.RunnerLimits(open_files=64), model_dir=tmp_path) is not None


@pytest.mark.parametrize("field", ["memory_bytes", "cpu_seconds", "processes", "open_files", "file_size_bytes"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), True, "1"])
def test_limits_are_validated(field: str, value: object) -> None:
    with pytest.raises(SandboxConfigError, match=rf"RunnerLimits\.{field} must be a positive number") as caught:
        carton.RunnerLimits(**{field: value})  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, carton.CartonError)


@pytest.mark.usefixtures("adversarial_plugin")
def test_memory_limit_applies_without_a_sandbox(tmp_path: Path) -> None:
    (tmp_path / "note.txt").write_text("n:")
    limits = carton.RunnerLimits(memory_bytes=3 << 30)
    with (
        carton.load_unpacked(
            tmp_path, runner_name="adversary", required_framework_version="1", sandbox="none", limits=limits
        ) as model,
        pytest.raises(RunnerMemoryLimit, match=r"memory_bytes=3221225472"),
    ):
        model.infer({"action": np.array(["alloc"]), "arg": np.array([str(50 << 30)])})


@pytest.mark.usefixtures("adversarial_plugin")
@pytest.mark.parametrize("policy", ["none", "strict"])
def test_a_memory_limit_too_low_to_start_names_the_limit(tmp_path: Path, policy: str) -> None:
    support = machine_support()
    if policy == "strict" and not all(status.available for status in support.layers(support.backend(None))):
        pytest.skip("strict is refused on this machine (a layer is missing)")
    (tmp_path / "note.txt").write_text("n:")
    limits = carton.RunnerLimits(memory_bytes=50 << 20)  # numpy's libraries cannot even be mapped
    with pytest.raises(
        RunnerMemoryLimit,
        match=r"before completing the handshake: it ran out of memory under its "
        r"memory limit \(memory_bytes=52428800\): ",
    ) as caught:
        carton.load_unpacked(
            tmp_path, runner_name="adversary", required_framework_version="1", sandbox=policy, limits=limits
        )
    message = str(caught.value)
    assert caught.value.limit_bytes == 50 << 20
    # The one line that says what failed, not the log's tail (numpy's import error is a page of advice).
    assert "failed to map segment" in message or "MemoryError" in message
    assert len(message.splitlines()) == 1
    assert "IMPORTANT" not in message and "Traceback" not in message and "numpy.org" not in message


NUMPY_IMPORT_FAILURE = """Traceback (most recent call last):
  File "numpy/_core/__init__.py", line 24, in <module>
    from . import multiarray
ImportError: libscipy_openblas64_.so: failed to map segment from shared object

The above exception was the direct cause of the following exception:

ImportError:

IMPORTANT: PLEASE READ THIS FOR ADVICE ON HOW TO SOLVE THIS ISSUE!

Importing the numpy C-extensions failed. This error can happen for
many reasons, often due to issues with your setup or how NumPy was
installed.

Original error was: libscipy_openblas64_.so: failed to map segment from shared object
"""


@pytest.mark.parametrize(
    ("text", "limits", "expected"),
    [
        (
            "ImportError: libstdc++.so.6: failed to map segment from shared object",
            {"memory_bytes": 5e7},
            "ImportError: libstdc++.so.6: failed to map segment from shared object",
        ),
        ("MemoryError", {"memory_bytes": 1024.0}, "MemoryError"),
        (
            "OSError: [Errno 12] Cannot allocate memory",
            {"memory_bytes": 1024.0},
            "OSError: [Errno 12] Cannot allocate memory",
        ),
        ("mmap failed: ENOMEM", {"memory_bytes": 1024.0}, "mmap failed: ENOMEM"),
        (
            "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc\n",
            {"memory_bytes": 1024.0},
            "what():  std::bad_alloc",
        ),
        (
            NUMPY_IMPORT_FAILURE,
            {"memory_bytes": 1024.0},
            "Original error was: libscipy_openblas64_.so: failed to map segment from shared object",
        ),
        ("ImportError: libstdc++.so.6: failed to map segment from shared object", {}, None),  # no limit: not it
        ("ModuleNotFoundError: No module named 'x'", {"memory_bytes": 1024.0}, None),
        ("ENOMEMORIES are not errors", {"memory_bytes": 1024.0}, None),
    ],
)
def test_memory_failures_are_recognised_only_under_a_memory_limit(
    text: str, limits: dict[str, float], expected: str | None
) -> None:
    """What a memory-limit error quotes: the last line that shows an allocation failure, nothing else."""
    assert memory_failure(limits, "runner x exited with status 1", text) == expected


@pytest.mark.usefixtures("adversarial_plugin")
def test_an_unrelated_start_failure_under_a_memory_limit_stays_a_start_error(tmp_path: Path) -> None:
    with pytest.raises(RunnerStartError, match=r"failed to load .*FileNotFoundError.*note\.txt"):  # no note.txt
        carton.load_unpacked(
            tmp_path,
            runner_name="adversary",
            required_framework_version="1",
            sandbox="none",
            limits=carton.RunnerLimits(memory_bytes=3 << 30),
        )


def test_machine_support_reports_every_layer() -> None:
    support = machine_support()
    for backend in (None, *Backend):
        assert [status.layer for status in support.layers(backend)] == list(Layer)


# --- exit classification ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("returncode", "base", "signum", "text"),
    [
        (-11, None, 11, "was killed by SIGSEGV"),
        (139, 128, 11, "was killed by SIGSEGV"),
        (152, 128, 24, "was killed by SIGXCPU"),
        (139, None, None, "exited with status 139"),
        (1, 128, None, "exited with status 1"),
        (128, 128, None, "exited with status 128"),
        (None, 128, None, "is still running"),
    ],
)
def test_exit_classification(returncode: int | None, base: int | None, signum: int | None, text: str) -> None:
    assert exit_signal(returncode, base) == signum
    assert describe_exit(returncode, base) == text


# --- seccomp: exact bytes and behaviour ---------------------------------------------------------------------------


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def test_seccomp_program_bytes_x86_64() -> None:
    program = _seccomp.build_filter("x86_64")
    assert len(program) % 8 == 0
    assert program[:40] == b"".join(
        [
            _insn(0x20, 0, 0, 4),  # ld arch
            _insn(0x15, 1, 0, 0xC000003E),  # jeq AUDIT_ARCH_X86_64
            _insn(0x06, 0, 0, 0x80000000),  # ret KILL_PROCESS
            _insn(0x20, 0, 0, 0),  # ld nr
            _insn(0x35, len(program) // 8 - 6, 0, 0x40000000),  # x32 syscalls -> the final KILL_PROCESS
        ]
    )
    assert program[-40:] == b"".join(
        [
            _insn(0x06, 0, 0, 0x7FFF0000),  # allow
            _insn(0x06, 0, 0, 0x00050001),  # errno EPERM
            _insn(0x06, 0, 0, 0x00050026),  # errno ENOSYS
            _insn(0x06, 0, 0, 0x00050061),  # errno EAFNOSUPPORT
            _insn(0x06, 0, 0, 0x80000000),  # kill
        ]
    )


def test_seccomp_program_bytes_aarch64() -> None:
    program = _seccomp.build_filter("aarch64")
    assert program[:32] == b"".join(
        [
            _insn(0x20, 0, 0, 4),
            _insn(0x15, 1, 0, 0xC00000B7),
            _insn(0x06, 0, 0, 0x80000000),
            _insn(0x20, 0, 0, 0),
        ]
    )
    assert _insn(0x15, 0, 0, 117)[:2] in program  # ptrace is in the deny list (jump offsets vary)


def test_seccomp_unknown_architecture() -> None:
    with pytest.raises(_seccomp.FilterUnavailable, match="riscv64"):
        _seccomp.build_filter("riscv64")


def _run_shim(config: dict[str, object], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-E", "-s", "-S", str(SHIM), json.dumps(config), "--", sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(_seccomp.supported() is not None, reason=f"seccomp unavailable: {_seccomp.supported()}")
def test_seccomp_filter_denies_escape_syscalls() -> None:
    code = textwrap.dedent(
        """
        import ctypes, errno, socket
        libc = ctypes.CDLL(None, use_errno=True)
        def err(result):
            return errno.errorcode.get(ctypes.get_errno()) if result != 0 else "ok"
        print("unshare", err(libc.unshare(0x10000000)))
        print("ptrace", err(libc.ptrace(0, 0, None, None)))
        print("mount", err(libc.mount(b"none", b"/nonexistent-carton-test", b"tmpfs", 0, None)))  # ENOENT if unfiltered
        for family in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK):
            try:
                socket.socket(family, socket.SOCK_DGRAM).close()
                print("socket", family, "ok")
            except OSError as exc:
                print("socket", int(family), errno.errorcode[exc.errno])
        socket.socketpair(socket.AF_UNIX).__len__()
        print("unix ok")
        """
    )
    done = _run_shim({"seccomp": True}, code)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == ["unshare EPERM", "ptrace EPERM", "mount EPERM"]
    assert lines[3:6] == ["socket 2 EAFNOSUPPORT", "socket 10 EAFNOSUPPORT", "socket 16 EAFNOSUPPORT"]
    assert lines[6] == "unix ok"


@pytest.mark.skipif(machine_support().landlock_abi == 0, reason="the kernel has no Landlock")
def test_landlock_rules(tmp_path: Path) -> None:
    readable, writable, hidden = tmp_path / "ro", tmp_path / "rw", tmp_path / "hidden"
    for folder in (readable, writable, hidden):
        folder.mkdir()
        (folder / "file").write_text(folder.name)
    read = [*system_paths(), sys.base_prefix, sys.prefix, str(readable), "/proc", "/dev"]
    code = textwrap.dedent(
        f"""
        def attempt(what, action):
            try:
                action()
                print(what, "ok")
            except OSError as exc:
                print(what, type(exc).__name__)
        attempt("read ro", lambda: open({str(readable / "file")!r}).read())
        attempt("write ro", lambda: open({str(readable / "new")!r}, "w"))
        attempt("write rw", lambda: open({str(writable / "new")!r}, "w").write("x"))
        attempt("read hidden", lambda: open({str(hidden / "file")!r}).read())
        attempt("read shadow", lambda: open("/etc/shadow").read())
        """
    )
    done = _run_shim({"landlock": {"read": read, "write": [str(writable)]}}, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "read ro ok",
        "write ro PermissionError",
        "write rw ok",
        "read hidden PermissionError",
        "read shadow PermissionError",
    ]


def test_shim_reports_a_failing_layer_by_name() -> None:
    done = _run_shim({"rlimits": {"NOFILE": [10, 5]}}, "pass")
    assert done.returncode == SETUP_FAILED
    assert done.stderr.startswith("carton sandbox: resource_limits: setrlimit(NOFILE, 10, 5)")
    done = _run_shim({}, "pass")
    assert done.returncode == 0
    bad = subprocess.run(
        [sys.executable, "-S", str(SHIM), "{not json", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == SETUP_FAILED and "carton sandbox: shim: bad configuration" in bad.stderr


def test_shim_reaper_reports_signals_like_bubblewrap() -> None:
    done = _run_shim({"reaper": True}, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert done.returncode == 128 + 11


@pytest.mark.parametrize(
    ("where", "given", "expected"),
    [
        ("https://example.invalid/m.carton", None, SandboxPolicy.BEST_EFFORT),
        ("http://127.0.0.1:9/m.carton", None, SandboxPolicy.BEST_EFFORT),
        ("https://example.invalid/m.carton", "none", "none"),
        ("/models/m.carton", None, None),
    ],
)
def test_url_loads_default_to_best_effort(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str, given: str | None, expected: object
) -> None:
    from carton._workflows import _load

    info = carton.CartonInfo(
        spec_version=1,
        model_name=None,
        required_platforms=(),
        inputs=(),
        outputs=(),
        runner=carton.RunnerInfo(
            runner_name="adversary", required_framework_version="1", runner_compat_version=1, opts={}
        ),
        manifest_sha256="",
    )

    class Opened:
        def __init__(self) -> None:
            self.info = info
            self.model_dir = tmp_path
            self.verification = None

    def open_carton(path_or_url: object, **options: Any) -> Opened:
        options["on_info"](info)
        return Opened()

    class Chosen(Exception):
        pass

    seen: list[object] = []

    def wrapper(sandbox: object, limits: object, model_dir: object) -> None:
        seen.append(sandbox)
        raise Chosen

    monkeypatch.setattr(_load, "open_carton", open_carton)
    spec = carton.RunnerSpec(runner_name="adversary", framework_version="1.0.0", runner_compat_version=1, entry="x:Y")
    monkeypatch.setattr(_load, "resolve_runner", lambda request, where: spec)
    monkeypatch.setattr(_load, "_start_in_background", lambda runner, handshake_timeout: None)
    monkeypatch.setattr(_load, "_launch_wrapper", wrapper)
    with pytest.raises(Chosen):
        _load.load(where, sandbox=given)
    assert seen == [expected]
