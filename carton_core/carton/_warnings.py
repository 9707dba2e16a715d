"""Warnings that point at the caller's line, not at carton's internals."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

__all__ = ["warn_user"]

_OUR_PACKAGES = tuple(
    str(Path(module.__file__).parent) for module in (sys.modules["carton"], sys.modules["carton_protocol"])
    if module.__file__ is not None
)


def warn_user(message: str, category: type[Warning]) -> None:
    """`warnings.warn` with the stack level of the first frame outside carton (Python 3.12's ``skip_file_prefixes``,
    by hand), so the warning names the user's line that called into carton."""
    level = 2  # stacklevel 2 is frame(1), warn_user's caller
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OUR_PACKAGES):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level)
