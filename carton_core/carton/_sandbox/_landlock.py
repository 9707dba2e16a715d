"""Landlock filesystem, network and scope rules through raw syscalls (ctypes; no binding exists in the stdlib).

Standard library only: the shim imports this module as a top-level module before it execs the runner.

A ruleset handles every filesystem right the kernel's ABI knows; rules then allow reading (and executing) the paths
the runner needs and writing only its scratch directory (and /dev/null). From ABI 4 TCP bind and connect are handled
with no rule (so denied); from ABI 6 abstract Unix sockets and signals are scoped to the sandbox.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
from collections.abc import Iterable

__all__ = ["LandlockError", "abi_version", "restrict"]

_SYS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446), "arm64": (444, 445, 446)}
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

_EXECUTE = 1 << 0
_WRITE_FILE = 1 << 1
_READ_FILE = 1 << 2
_READ_DIR = 1 << 3
_REMOVE_DIR = 1 << 4
_REMOVE_FILE = 1 << 5
_MAKE_CHAR = 1 << 6
_MAKE_DIR = 1 << 7
_MAKE_REG = 1 << 8
_MAKE_SOCK = 1 << 9
_MAKE_FIFO = 1 << 10
_MAKE_BLOCK = 1 << 11
_MAKE_SYM = 1 << 12
_REFER = 1 << 13  # ABI 2
_TRUNCATE = 1 << 14  # ABI 3
_IOCTL_DEV = 1 << 15  # ABI 5
_NET_BIND_TCP = 1 << 0  # ABI 4
_NET_CONNECT_TCP = 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
_SCOPE_SIGNAL = 1 << 1

_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE | _IOCTL_DEV
_READ_RIGHTS = _EXECUTE | _READ_FILE | _READ_DIR
_PR_SET_NO_NEW_PRIVS = 38


class LandlockError(Exception):
    """A Landlock syscall failed; the message names it and the path."""


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _numbers() -> tuple[int, int, int] | None:
    return _SYS.get(platform.machine().lower())


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
    numbers = _numbers()
    if numbers is None:
        return 0
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(ctypes.c_long(numbers[0]), None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return int(result) if result > 0 else 0


def _handled_fs(abi: int) -> int:
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= _REFER
    if abi >= 3:
        rights |= _TRUNCATE
    if abi >= 5:
        rights |= _IOCTL_DEV
    return rights


def restrict(read: Iterable[str], write: Iterable[str], *, abi: int | None = None) -> int:
    """Allow reading `read`, reading and writing `write`, nothing else; applies to this process and its children.

    Missing paths are skipped. Sets no_new_privs (Landlock requires it). Returns the ABI version used.
    """
    abi = abi_version() if abi is None else abi
    numbers = _numbers()
    if abi < 1 or numbers is None:
        raise LandlockError("Landlock is not available in this kernel")
    create, add_rule, restrict_self = numbers
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    handled = _handled_fs(abi)
    attr = _RulesetAttr(handled, (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0,
                        (_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL) if abi >= 6 else 0)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    ruleset = libc.syscall(ctypes.c_long(create), ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        code = ctypes.get_errno()
        raise LandlockError(f"landlock_create_ruleset failed: {errno.errorcode.get(code, code)}")
    try:
        for paths, rights in ((read, _READ_RIGHTS | (_IOCTL_DEV if abi >= 5 else 0)), (write, handled)):
            for path in paths:
                _add_path(libc, add_rule, int(ruleset), path, rights & handled)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            code = ctypes.get_errno()
            raise LandlockError(f"prctl(PR_SET_NO_NEW_PRIVS) failed: {errno.errorcode.get(code, code)}")
        if libc.syscall(ctypes.c_long(restrict_self), ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            code = ctypes.get_errno()
            raise LandlockError(f"landlock_restrict_self failed: {errno.errorcode.get(code, code)}")
    finally:
        os.close(int(ruleset))
    return abi


def _add_path(libc: ctypes.CDLL, add_rule: int, ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise LandlockError(f"cannot open {path} for a Landlock rule: {exc.strerror}") from exc
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= _FILE_RIGHTS
        rule = _PathBeneath(rights, fd)
        if libc.syscall(ctypes.c_long(add_rule), ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                        ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            code = ctypes.get_errno()
            raise LandlockError(f"landlock_add_rule({path}) failed: {errno.errorcode.get(code, code)}")
    finally:
        os.close(fd)
