"""The seccomp filter every sandboxed runner gets: a small classic-BPF program assembled here, no libseccomp.

Standard library only: the shim imports this module as a top-level module before it execs the runner.

The filter is a deny-list (an allow-list would break whichever framework calls a syscall we did not foresee):
  - a foreign architecture (or, on x86_64, the x32 ABI) kills the process: syscall numbers would mean other things;
  - kernel-attack surface and escape tools fail with EPERM: ptrace, mount and the new mount API, pivot_root,
    chroot, unshare/setns, kernel modules, kexec, bpf, perf_event_open, keyrings, userfaultfd, io_uring,
    process_vm_readv/writev, open_by_handle_at, swap, reboot, clock setting, syslog, kcmp;
  - ``clone`` with a namespace flag fails with EPERM, ``clone3`` with ENOSYS (its flags live in memory the filter
    cannot read; libc then falls back to ``clone``);
  - ``socket``/``socketpair`` of any family but AF_UNIX fail with EAFNOSUPPORT (the transport is a Unix socket).
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

__all__ = ["ARCHES", "FilterUnavailable", "build_filter", "install_filter", "supported"]

# struct sock_filter { u16 code; u8 jt; u8 jf; u32 k; }
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K

_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000

_OFF_NR = 0
_OFF_ARCH = 4
_OFF_ARG0_LOW = 16  # args[0], low 32 bits on a little-endian machine

_AF_UNIX = 1
_CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_X32_SYSCALL_BIT = 0x40000000

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2

# Denied with EPERM. Numbers from the kernel's syscall tables (arch/x86/entry/syscalls/syscall_64.tbl and
# include/uapi/asm-generic/unistd.h for aarch64).
_DENIED: dict[str, dict[str, int]] = {
    "x86_64": {
        "ptrace": 101, "syslog": 103, "vhangup": 153, "pivot_root": 155, "adjtimex": 159,
        "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167,
        "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173,
        "init_module": 175, "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212, "clock_settime": 227,
        "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272,
        "perf_event_open": 298, "fanotify_init": 300, "name_to_handle_at": 303, "open_by_handle_at": 304,
        "clock_adjtime": 305, "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
        "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
        "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    },
    "aarch64": {
        "lookup_dcookie": 18, "umount2": 39, "mount": 40, "pivot_root": 41, "chroot": 51, "vhangup": 58,
        "quotactl": 60, "acct": 89, "unshare": 97, "kexec_load": 104, "init_module": 105,
        "delete_module": 106, "clock_settime": 112, "syslog": 116, "ptrace": 117, "reboot": 142,
        "sethostname": 161, "setdomainname": 162, "settimeofday": 170, "adjtimex": 171, "add_key": 217,
        "request_key": 218, "keyctl": 219, "swapon": 224, "swapoff": 225, "perf_event_open": 241,
        "fanotify_init": 262, "name_to_handle_at": 264, "open_by_handle_at": 265, "clock_adjtime": 266,
        "setns": 268, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "finit_module": 273,
        "bpf": 280, "userfaultfd": 282, "kexec_file_load": 294, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    },
}
# (AUDIT_ARCH_*, socket, socketpair, clone, clone3)
_ARCH_INFO: dict[str, tuple[int, int, int, int, int]] = {
    "x86_64": (0xC000003E, 41, 53, 56, 435),
    "aarch64": (0xC00000B7, 198, 199, 220, 435),
}
ARCHES = tuple(_ARCH_INFO)


class FilterUnavailable(Exception):
    """This machine cannot take the filter (unknown architecture, no seccomp)."""


def _machine() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def supported() -> str | None:
    """Why the filter cannot be installed here, or None when it can."""
    machine = _machine()
    if machine not in _ARCH_INFO:
        return f"no syscall table for architecture {machine!r} (have {', '.join(ARCHES)})"
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            if not any(line.startswith("Seccomp:") for line in status):
                return "the kernel was built without seccomp (no Seccomp: line in /proc/self/status)"
    except OSError as exc:
        return f"cannot read /proc/self/status: {exc}"
    return None


class _Assembler:
    """Instructions with symbolic jump targets, resolved to BPF's forward-only 8-bit offsets."""

    def __init__(self) -> None:
        self.code: list[tuple[int, object, object, int]] = []
        self.labels: dict[str, int] = {}

    def load(self, offset: int) -> None:
        self.code.append((_LD_W_ABS, 0, 0, offset))

    def jump(self, op: int, k: int, true: str | int, false: str | int) -> None:
        self.code.append((op, true, false, k))

    def ret(self, value: int) -> None:
        self.code.append((_RET_K, 0, 0, value))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        out = bytearray()
        for index, (op, true, false, k) in enumerate(self.code):
            offsets = []
            for target in (true, false):
                if isinstance(target, str):
                    delta = self.labels[target] - index - 1
                else:
                    assert isinstance(target, int)
                    delta = target
                if not 0 <= delta <= 255:
                    raise ValueError(f"BPF jump from {index} to {target!r} out of range")
                offsets.append(delta)
            out += struct.pack("<HBBI", op, offsets[0], offsets[1], k)
        return bytes(out)


def build_filter(machine: str | None = None) -> bytes:
    """The filter program for `machine` (default: this one) as raw ``struct sock_filter`` bytes."""
    machine = machine or _machine()
    if machine not in _ARCH_INFO:
        raise FilterUnavailable(f"no syscall table for architecture {machine!r}")
    audit_arch, nr_socket, nr_socketpair, nr_clone, nr_clone3 = _ARCH_INFO[machine]
    asm = _Assembler()
    asm.load(_OFF_ARCH)
    asm.jump(_JEQ_K, audit_arch, 1, 0)
    asm.ret(_RET_KILL_PROCESS)
    asm.load(_OFF_NR)
    if machine == "x86_64":
        asm.jump(_JGE_K, _X32_SYSCALL_BIT, "kill", 0)
    for number in sorted(_DENIED[machine].values()):
        asm.jump(_JEQ_K, number, "eperm", 0)
    asm.jump(_JEQ_K, nr_clone3, "enosys", 0)
    asm.jump(_JEQ_K, nr_socket, "family", 0)
    asm.jump(_JEQ_K, nr_socketpair, "family", 0)
    asm.jump(_JEQ_K, nr_clone, "clone", "allow")
    asm.label("family")
    asm.load(_OFF_ARG0_LOW)
    asm.jump(_JEQ_K, _AF_UNIX, "allow", "eafnosupport")
    asm.label("clone")
    asm.load(_OFF_ARG0_LOW)
    asm.jump(_JSET_K, _CLONE_NAMESPACES, "eperm", "allow")
    asm.label("allow")
    asm.ret(_RET_ALLOW)
    asm.label("eperm")
    asm.ret(_RET_ERRNO | errno.EPERM)
    asm.label("enosys")
    asm.ret(_RET_ERRNO | errno.ENOSYS)
    asm.label("eafnosupport")
    asm.ret(_RET_ERRNO | errno.EAFNOSUPPORT)
    asm.label("kill")
    asm.ret(_RET_KILL_PROCESS)
    return asm.assemble()


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_filter(program: bytes) -> None:
    """Set no_new_privs and install `program` on the calling thread (before exec, so on the whole runner)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_NO_NEW_PRIVS): {errno.errorcode.get(ctypes.get_errno())}")
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_SECCOMP): {errno.errorcode.get(code, code)}")
