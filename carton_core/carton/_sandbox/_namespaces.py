"""The ``unshare`` backend: namespaces and a private filesystem view built by the shim itself (ctypes syscalls).

Standard library only: the shim imports this module as a top-level module (its folder is ``sys.path[0]``); the host
imports it as ``carton._sandbox._namespaces`` for `namespace_config` alone.

`enter` runs in the shim process the host started (P). P calls ``unshare(2)`` for new mount, PID, network, IPC and
UTS namespaces (and, when the host is not root, a user namespace mapping the caller's uid and gid to 65534; as root
no user namespace is needed and the shim later switches to a fresh unprivileged host uid with ``setresuid``), forks
the namespace's PID 1 (G) and waits for it, exiting with its status. In G `enter` builds the view and returns:

1. every mount made private, so nothing propagates back to the host;
2. a tmpfs mounted over ``/tmp`` becomes the new root. Each allowed path is bind-mounted into it from a descriptor
   opened beforehand (so sources under ``/tmp`` stay reachable): deep folders such as
   ``/root/.pyenv/versions/3.11.7`` land on 0755 directories created on the tmpfs, so the host's 0700 parents are
   never traversed by the runner. Read-only binds get ``ro,nosuid,nodev`` recursively (``mount_setattr``, or a
   remount per mount before Linux 5.12), writable ones ``nosuid,nodev``; top-level symlinks (``/lib -> usr/lib``)
   stay symlinks;
3. a fresh ``/proc`` for the new PID namespace and a minimal ``/dev`` (a small tmpfs with null, zero, full, random,
   urandom and tty bound from the host, the fd/stdin/stdout/stderr links and ``shm/``);
4. the tmpfs root and ``/dev`` made read-only, ``pivot_root`` into the new root, the old root detached, the
   hostname set, and the working directory entered;
5. PID 1 made non-dumpable and, in a user namespace, stripped of its capabilities.

Paths inside the new root are created without following any symlink out of it (the shim may be root here).
"""
# os, not pathlib: importing pathlib costs ~10 ms (urllib.parse, ipaddress) on every sandboxed runner start.
# ruff: noqa: PTH102, PTH103, PTH114, PTH115, PTH120, PTH211

from __future__ import annotations

import ctypes
import errno
import os
import platform
import select
import signal
import stat
from collections.abc import Iterable, Mapping

TYPE_CHECKING = False  # typing is not imported at run time (start-up cost, as pathlib)
if TYPE_CHECKING:
    from typing import Any, NoReturn

__all__ = ["DEVICES", "HOSTNAME", "NEW_ROOT", "SANDBOX_ID", "NamespaceError", "enter", "namespace_config"]

#: uid and gid of the runner inside a user namespace (the host is not root): "nobody", mapped to the caller.
SANDBOX_ID = 65534
HOSTNAME = "carton-sandbox"
#: Where the new root's tmpfs is mounted before ``pivot_root`` (only in the private mount namespace).
NEW_ROOT = "/tmp"  # noqa: S108 - a mount point in a private namespace, never a file
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_SETUP_FAILED = 121

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000

_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_NOATIME = 1024
_MS_NODIRATIME = 2048
_MS_BIND = 4096
_MS_REC = 16384
_MS_UNBINDABLE = 1 << 17
_MS_PRIVATE = 1 << 18
_MS_RELATIME = 1 << 21
_MS_STRICTATIME = 1 << 24
_MNT_DETACH = 2
_ST_RELATIME = 4096  # statvfs f_flag; the other kept bits have the same values as the MS_ ones
_AT_FDCWD = -100
_AT_RECURSIVE = 0x8000
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41}
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_CAPABILITY_VERSION_3 = 0x20080522

_READ_ONLY = _MS_RDONLY | _MS_NOSUID | _MS_NODEV  # MOUNT_ATTR_RDONLY/NOSUID/NODEV have the same values
_WRITABLE = _MS_NOSUID | _MS_NODEV


class NamespaceError(Exception):
    """A step failed; `layer` names the sandbox layer it belongs to (the shim reports it)."""

    def __init__(self, layer: str, message: str) -> None:
        super().__init__(message)
        self.layer = layer


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def namespace_config(*, read: Iterable[str], write: Iterable[str], cwd: str, user_namespace: bool,
                     legacy_remount: bool = False) -> dict[str, Any]:
    """The ``namespaces`` section of the shim's configuration (built by the host).

    `read` paths are bound read-only (missing ones skipped), `write` paths read-write (they must exist), `cwd` is
    entered last. `user_namespace` (an unprivileged host) maps the caller to `SANDBOX_ID`. `legacy_remount` skips
    ``mount_setattr`` (tests exercise the pre-5.12 path with it).
    """
    config: dict[str, Any] = {"read": sorted(set(read)), "write": sorted(set(write)), "cwd": cwd,
                              "user": [SANDBOX_ID, SANDBOX_ID] if user_namespace else None, "hostname": HOSTNAME}
    if legacy_remount:
        config["legacy_remount"] = True
    return config


class _Syscalls:
    def __init__(self, legacy_remount: bool) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        libc.unshare.argtypes = [ctypes.c_int]
        libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        libc.syscall.restype = ctypes.c_long
        self.libc = libc
        self.mount_setattr = not legacy_remount

    @staticmethod
    def _error(layer: str, what: str) -> NamespaceError:
        code = ctypes.get_errno()
        return NamespaceError(layer, f"{what}: {errno.errorcode.get(code, code)} ({os.strerror(code)})")

    def unshare(self, flags: int) -> None:
        if self.libc.unshare(flags) != 0:
            raise self._error("namespaces", f"unshare({_flag_names(flags)})")

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        encode = os.fsencode
        if self.libc.mount(encode(source) if source else None, encode(target), encode(fstype) if fstype else None,
                           flags, encode(data) if data else None) != 0:
            raise self._error("filesystem_view", f"mount {source or '-'} on {target} (flags {flags:#x})")

    def set_flags(self, target: str, flags: int, *, recursive: bool) -> None:
        """Add `flags` (read-only, nosuid, nodev) to the mount at `target` and, if `recursive`, every mount below."""
        if self.mount_setattr:
            attr = _MountAttr(flags, 0, 0, 0)
            result = self.libc.syscall(ctypes.c_long(_SYS_MOUNT_SETATTR), ctypes.c_int(_AT_FDCWD),
                                       ctypes.c_char_p(os.fsencode(target)),
                                       ctypes.c_uint(_AT_RECURSIVE if recursive else 0), ctypes.byref(attr),
                                       ctypes.c_size_t(ctypes.sizeof(attr)))
            if result == 0:
                return
            if ctypes.get_errno() != errno.ENOSYS:
                raise self._error("filesystem_view", f"mount_setattr({target}, {flags:#x})")
            self.mount_setattr = False  # Linux before 5.12
        for point in [target, *(_mounts_below(target) if recursive else ())]:
            # A remount must repeat the flags it keeps: inside a user namespace the host's are locked.
            self.mount(None, point, None, _MS_BIND | _MS_REMOUNT | _kept_flags(point) | flags)

    def pivot_root_here(self) -> None:
        number = _SYS_PIVOT_ROOT.get(platform.machine().lower())
        if number is None:
            raise NamespaceError("filesystem_view", f"pivot_root: unknown architecture {platform.machine()}")
        if self.libc.syscall(ctypes.c_long(number), ctypes.c_char_p(b"."), ctypes.c_char_p(b".")) != 0:
            raise self._error("filesystem_view", "pivot_root")
        if self.libc.umount2(b".", _MNT_DETACH) != 0:
            raise self._error("filesystem_view", "detaching the old root")

    def sethostname(self, name: str) -> None:
        raw = name.encode()
        if self.libc.sethostname(raw, len(raw)) != 0:
            raise self._error("namespaces", f"sethostname({name})")

    def harden_init(self, *, drop_capabilities: bool) -> None:
        """PID 1 needs no privilege once the view is built: make it non-dumpable (the runner, perhaps the same uid,
        cannot ptrace it or open its /proc entries) and, in a user namespace, drop every capability (as root it
        keeps them: the runner's setresuid happens after the fork)."""
        if self.libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise self._error("namespaces", "prctl(PR_SET_DUMPABLE, 0)")
        if drop_capabilities:
            header = _CapHeader(_CAPABILITY_VERSION_3, 0)
            data = (_CapData * 2)()
            if self.libc.capset(ctypes.byref(header), data) != 0:
                raise self._error("non_root_uid", "capset (dropping PID 1's capabilities)")

    def parent_death_signal(self) -> None:
        if self.libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise self._error("parent_death_signal", "prctl(PR_SET_PDEATHSIG)")


def _flag_names(flags: int) -> str:
    names = {_CLONE_NEWUSER: "NEWUSER", _CLONE_NEWNS: "NEWNS", _CLONE_NEWPID: "NEWPID", _CLONE_NEWNET: "NEWNET",
             _CLONE_NEWIPC: "NEWIPC", _CLONE_NEWUTS: "NEWUTS"}
    return "|".join(f"CLONE_{name}" for bit, name in names.items() if flags & bit)


def _kept_flags(point: str) -> int:
    flags = os.statvfs(point).f_flag
    kept = flags & (_MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME)
    if flags & _ST_RELATIME:
        kept |= _MS_RELATIME
    elif not flags & _MS_NOATIME:
        kept |= _MS_STRICTATIME
    return kept


def _unescape(field: str) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes are written as 3-digit octal escapes."""
    out, index = [], 0
    while index < len(field):
        if field[index] == "\\" and field[index + 1 : index + 4].isdigit():
            out.append(chr(int(field[index + 1 : index + 4], 8)))
            index += 4
        else:
            out.append(field[index])
            index += 1
    return "".join(out)


def _mounts_below(target: str) -> list[str]:
    prefix = target.rstrip("/") + "/"
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as handle:
        points = [_unescape(line.split(" ")[4]) for line in handle]
    return [point for point in points if point.startswith(prefix)]


# --- P: unshare, map ids, fork PID 1, wait -----------------------------------------------------------------------


def enter(config: Mapping[str, Any]) -> None:
    """Create the namespaces; returns only in their PID 1, inside the new root (P exits with PID 1's status)."""
    calls = _Syscalls(bool(config.get("legacy_remount")))
    user = config.get("user")
    flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
    if user:
        flags |= _CLONE_NEWUSER
    outer_uid, outer_gid = os.getuid(), os.getgid()
    calls.unshare(flags)
    if user:
        _map_ids(int(user[0]), int(user[1]), outer_uid, outer_gid)
        calls.parent_death_signal()  # a credential change may clear it; re-arm (the parent is still the host)
    alive_read, alive_write = os.pipe()
    child = os.fork()
    if child:
        os.close(alive_read)
        _wait_for_init(child, alive_write)
    os.close(alive_write)
    try:
        calls.parent_death_signal()
        # P holds the pipe's write end until it dies: end-of-file now means it died before the signal was armed.
        if select.select([alive_read], [], [], 0)[0]:
            raise NamespaceError("parent_death_signal", "the shim exited before the signal was armed")
    finally:
        os.close(alive_read)
    _build_root(calls, config)
    calls.harden_init(drop_capabilities=bool(user))


def _map_ids(inner_uid: int, inner_gid: int, outer_uid: int, outer_gid: int) -> None:
    try:
        try:
            with open("/proc/self/setgroups", "w") as handle:
                handle.write("deny")  # required before an unprivileged gid_map
        except FileNotFoundError:
            pass  # Linux before 3.19
        with open("/proc/self/uid_map", "w") as handle:
            handle.write(f"{inner_uid} {outer_uid} 1\n")
        with open("/proc/self/gid_map", "w") as handle:
            handle.write(f"{inner_gid} {outer_gid} 1\n")
    except OSError as exc:
        raise NamespaceError("non_root_uid", f"cannot map uid {outer_uid} to {inner_uid}: {exc.strerror}") from exc


def _wait_for_init(child: int, keep: int) -> NoReturn:
    """P: forward termination signals to PID 1, exit with its status (death by signal N as 128+N)."""
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 20)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda num, _frame: os.kill(child, num))
    while True:
        try:
            _, status = os.waitpid(child, 0)
        except ChildProcessError:
            os._exit(_SETUP_FAILED)
        except InterruptedError:
            continue
        if os.WIFSIGNALED(status):
            os._exit(128 + os.WTERMSIG(status))
        if os.WIFEXITED(status):
            os._exit(os.WEXITSTATUS(status))


# --- G: the private root -------------------------------------------------------------------------------------


def _inside(root: str, path: str, depth: int = 0) -> str:
    """Where `path` (as the runner will see it) lives under `root` now, following only symlinks inside `root`."""
    parts = [part for part in path.split("/") if part and part != "."]
    current = ""
    for index, part in enumerate(parts):
        candidate = f"{current}/{part}"
        if os.path.islink(root + candidate):
            if depth > 16:
                raise NamespaceError("filesystem_view", f"too many symbolic links under {path}")
            target = os.readlink(root + candidate)
            base = target if target.startswith("/") else f"{current or ''}/{target}"
            rest = "/".join(parts[index + 1 :])
            return _inside(root, os.path.normpath(f"{base}/{rest}" if rest else base), depth + 1)
        current = candidate
    return root + current if current else root


def _mount_point(root: str, path: str, *, is_dir: bool) -> str:
    where = _inside(root, path)
    if os.path.lexists(where):
        return where
    os.makedirs(os.path.dirname(where), mode=0o755, exist_ok=True)
    if is_dir:
        os.mkdir(where, 0o755)
    else:
        os.close(os.open(where, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
    return where


def _open_sources(paths: Iterable[str], *, required: bool) -> dict[str, int]:
    opened: dict[str, int] = {}
    for path in paths:
        try:
            opened[path] = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            if required:
                raise NamespaceError("filesystem_view", f"{path} does not exist") from None
        except OSError as exc:
            raise NamespaceError("filesystem_view", f"cannot open {path}: {exc.strerror}") from exc
    return opened


def _covered(path: str, bound: Iterable[str]) -> bool:
    return any(path == done or path.startswith(done.rstrip("/") + "/") for done in bound)


def _build_root(calls: _Syscalls, config: Mapping[str, Any]) -> None:
    read = [str(path) for path in config.get("read", ())]
    write = [str(path) for path in config.get("write", ())]
    os.umask(0o022)
    calls.mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    # Top-level symlinks (merged /usr) are recreated; everything else is bound from descriptors opened before the
    # tmpfs hides /tmp.
    links = {path: os.readlink(path) for path in read if os.path.dirname(path) == "/" and os.path.islink(path)}
    sources = _open_sources([path for path in read if path not in links], required=False)
    sources.update(_open_sources(write, required=True))
    devices = _open_sources([f"/dev/{name}" for name in DEVICES], required=False)
    try:
        root = NEW_ROOT
        calls.mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
        # Unbindable: a recursive bind of an allowed folder that holds NEW_ROOT (e.g. /tmp itself) must not copy
        # the view under construction into itself.
        calls.mount(None, root, None, _MS_UNBINDABLE)
        for path, target in links.items():
            os.symlink(target, root + path)
        proc = _mount_point(root, "/proc", is_dir=True)
        calls.mount("proc", proc, "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        dev = _make_dev(calls, root, devices)
        bound: list[str] = []
        for path in sorted(sources, key=lambda item: (item.count("/"), item)):
            writable = path in write
            if not writable and _covered(path, bound):
                continue  # already visible, read-only, through a bound parent
            is_dir = stat.S_ISDIR(os.fstat(sources[path]).st_mode)
            target = _mount_point(root, path, is_dir=is_dir)
            calls.mount(f"/proc/self/fd/{sources[path]}", target, None, _MS_BIND | _MS_REC)
            calls.set_flags(target, _WRITABLE if writable else _READ_ONLY, recursive=True)
            bound.append(path)
        calls.set_flags(dev, _READ_ONLY, recursive=False)
        calls.set_flags(root, _READ_ONLY, recursive=False)
        os.chdir(root)
        calls.pivot_root_here()
        os.chdir("/")
    except OSError as exc:
        raise NamespaceError("filesystem_view", f"{exc.strerror}: {exc.filename}") from exc
    finally:
        for fd in (*sources.values(), *devices.values()):
            os.close(fd)
    calls.sethostname(str(config.get("hostname") or HOSTNAME))
    cwd = str(config.get("cwd") or "/")
    try:
        os.chdir(cwd)
    except OSError as exc:
        raise NamespaceError("filesystem_view", f"cannot enter {cwd}: {exc.strerror}") from exc


def _make_dev(calls: _Syscalls, root: str, devices: Mapping[str, int]) -> str:
    dev = _mount_point(root, "/dev", is_dir=True)
    calls.mount("tmpfs", dev, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "mode=0755,size=64k")
    for path, fd in devices.items():
        node = _mount_point(root, path, is_dir=False)
        calls.mount(f"/proc/self/fd/{fd}", node, None, _MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm", 0o755)
    return dev
