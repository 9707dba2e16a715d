"""A tiny progress bar on stderr, drawn only when stderr is a terminal (quiet in pipes, logs and tests).

    with Progress("extracting model/weights.bin", total=size) as bar:
        for chunk in chunks:
            bar.advance(len(chunk))

``total=None`` shows a running byte count instead of a bar. Redraws are throttled so that a hot loop calling
`advance` millions of times costs almost nothing.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

__all__ = ["Progress"]

_REDRAW_SECONDS = 0.1
_BAR_WIDTH = 30


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - the loop always returns


class Progress:
    """Progress of one long operation, in bytes. Does nothing unless ``stream`` (stderr) is a terminal."""

    def __init__(self, label: str, *, total: int | None, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = bool(getattr(self._stream, "isatty", lambda: False)())
        self._label = label
        self._total = total
        self._done = 0
        self._last_draw = 0.0
        self._started = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self._enabled

    def advance(self, n: int) -> None:
        self._done += n
        if not self._enabled:
            return
        now = time.monotonic()
        if now - self._last_draw >= _REDRAW_SECONDS:
            self._last_draw = now
            self._draw(final=False)

    def _draw(self, *, final: bool) -> None:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = f"{_human(self._done / elapsed)}/s"
        if self._total:
            fraction = min(self._done / self._total, 1.0)
            filled = int(fraction * _BAR_WIDTH)
            bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
            line = f"\r{self._label} [{bar}] {fraction:4.0%} {_human(self._done)}/{_human(self._total)} {rate}"
        else:
            line = f"\r{self._label} {_human(self._done)} {rate}"
        self._stream.write(line + ("\n" if final else ""))
        self._stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._enabled:
            self._draw(final=True)
