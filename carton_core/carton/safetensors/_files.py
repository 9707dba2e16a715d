"""File-system plumbing shared by the safetensors and MCF readers and writers: why a path cannot be read or written,
in words, and the temporary file an atomic write goes through.

Both writers write ``.<name>.<random>.tmp`` beside the target and rename it into place when complete. The temporary
file is created with mode ``0o666`` minus the umask, as ``open(target, "wb")`` (and the reference safetensors
package) would create the target: ``mkstemp``'s 0600 would survive the rename and lock out every other uid, such as
a sandboxed runner reading the model.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

__all__ = ["create_temp_beside", "describe_os_error", "output_problem"]

_PHRASES = {
    errno.ENOENT: "no such file",
    errno.EISDIR: "it is a directory",
    errno.ENOTDIR: "a component of the path is not a folder",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOSPC: "no space left on the device",
}

_TEMP_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def describe_os_error(exc: OSError) -> str:
    """A short lowercase reason for ``exc`` ("no such file", "it is a directory", or the OS's own words)."""
    phrase = _PHRASES.get(exc.errno) if exc.errno is not None else None
    if phrase is not None:
        return phrase
    text = exc.strerror or str(exc) or type(exc).__name__
    return text[:1].lower() + text[1:]


def output_problem(target: Path) -> tuple[int, str] | None:
    """``(errno, reason)`` when ``target`` cannot be written as a file because of what is on disk (it is a directory,
    its folder is missing or is a file), else None. Writers check this first and refuse: they never create folders."""
    if target.is_dir():
        return errno.EISDIR, "it is a directory"
    parent = target.parent
    if parent.is_dir():
        return None
    if parent.exists():
        return errno.ENOTDIR, f"{parent} is not a folder"
    return errno.ENOENT, f"folder {parent} does not exist"


def create_temp_beside(target: Path) -> tuple[int, Path]:
    """A new, empty, read-write file next to ``target`` (same folder, so the final rename is atomic), mode
    ``0o666 & ~umask``. Raises the `OSError` of the failing call."""
    for _ in range(100):
        temp = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(temp, _TEMP_FLAGS, 0o666), temp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "every temporary file name tried exists", str(target))
