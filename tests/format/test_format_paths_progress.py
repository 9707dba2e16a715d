"""carton._paths (cache/data directories) and carton._progress (terminal-only progress bar)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from carton import _paths
from carton._progress import Progress


def test_cache_and_data_dirs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("CARTON_CACHE_DIR", "CARTON_DATA_DIR", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _paths.cache_dir() == tmp_path / ".cache" / "carton"
    assert _paths.data_dir() == tmp_path / ".local" / "share" / "carton"
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg/cache")
    monkeypatch.setenv("XDG_DATA_HOME", "relative/ignored")
    assert _paths.cache_dir() == Path("/xdg/cache/carton")
    assert _paths.data_dir() == tmp_path / ".local" / "share" / "carton"
    monkeypatch.setenv("CARTON_CACHE_DIR", "/explicit/cache")
    monkeypatch.setenv("CARTON_DATA_DIR", "/explicit/data")
    assert (_paths.cache_dir(), _paths.data_dir()) == (Path("/explicit/cache"), Path("/explicit/data"))


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_quiet_off_a_terminal() -> None:
    stream = io.StringIO()
    with Progress("x", total=10, stream=stream) as bar:
        bar.advance(10)
    assert stream.getvalue() == "" and not bar.enabled


def test_progress_draws_on_a_terminal() -> None:
    stream = FakeTerminal()
    with Progress("extracting", total=2048, stream=stream) as bar:
        bar.advance(1024)
        bar.advance(1024)
    out = stream.getvalue()
    assert out.endswith("\n") and "extracting [" in out and "100%" in out and "2.0 KiB/2.0 KiB" in out
    stream = FakeTerminal()
    with Progress("fetching", total=None, stream=stream) as bar:
        bar.advance(5)
    assert "fetching 5 B" in stream.getvalue()
