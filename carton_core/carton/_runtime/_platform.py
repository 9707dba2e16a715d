"""The host's target triple, spelled as Rust spells it (carton.toml's ``required_platforms`` holds these)."""

from __future__ import annotations

import functools
import platform
import sys

__all__ = ["target_triple"]

# platform.machine() spellings -> Rust's architecture names.
_ARCH = {
    "x86_64": "x86_64",
    "amd64": "x86_64",
    "i386": "i686",
    "i486": "i686",
    "i586": "i686",
    "i686": "i686",
    "x86": "i686",
    "aarch64": "aarch64",
    "arm64": "aarch64",
    "armv7l": "armv7",
    "armv7": "armv7",
    "armv6l": "arm",
    "ppc64le": "powerpc64le",
    "ppc64": "powerpc64",
    "s390x": "s390x",
    "riscv64": "riscv64gc",
    "loongarch64": "loongarch64",
}

# Architectures a 32-bit interpreter on a 64-bit kernel really runs as.
_ARCH_32 = {"x86_64": "i686", "aarch64": "armv7"}


def _arch(machine: str, pointer_bits: int) -> str:
    arch = _ARCH.get(machine.lower(), machine.lower())
    if pointer_bits == 32:
        arch = _ARCH_32.get(arch, arch)
    return arch


def _linux_abi(arch: str, libc: str) -> str:
    env = "musl" if libc == "musl" else "gnu"
    if arch in ("armv7", "arm"):
        return f"unknown-linux-{env}eabihf"
    return f"unknown-linux-{env}"


def _triple(machine: str, system: str, pointer_bits: int, libc: str) -> str:
    arch = _arch(machine, pointer_bits)
    if system.startswith("linux"):
        return f"{arch}-{_linux_abi(arch, libc)}"
    if system == "darwin":
        return f"{arch}-apple-darwin"
    if system in ("win32", "cygwin"):
        return f"{arch}-pc-windows-msvc"
    if system.startswith("freebsd"):
        return f"{arch}-unknown-freebsd"
    return f"{arch}-unknown-{system}"


def _libc() -> str:
    name, _version = platform.libc_ver()
    if name == "glibc":
        return "glibc"
    # libc_ver() knows only glibc (and older libc names); a musl interpreter names its loader in sysconfig.
    import sysconfig

    soabi = sysconfig.get_config_var("SOABI") or ""
    host = sysconfig.get_config_var("HOST_GNU_TYPE") or ""
    return "musl" if "musl" in soabi or "musl" in host else "glibc"


@functools.cache
def target_triple() -> str:
    """The Rust target triple of the running interpreter, e.g. ``x86_64-unknown-linux-gnu`` or
    ``aarch64-apple-darwin`` (a 32-bit interpreter on a 64-bit kernel reports its 32-bit triple)."""
    bits = 64 if sys.maxsize > 2**32 else 32
    libc = _libc() if sys.platform.startswith("linux") else ""
    return _triple(platform.machine(), sys.platform, bits, libc)
