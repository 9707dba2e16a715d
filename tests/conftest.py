"""Suite-wide isolation: every test session gets its own carton cache and data directories, so tests never read or
write the user's ~/.cache/carton or ~/.local/share/carton (tests that want a persistent cache set their own)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_carton_dirs() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="carton-tests-") as root:
        saved = {key: os.environ.get(key) for key in ("CARTON_CACHE_DIR", "CARTON_DATA_DIR")}
        os.environ["CARTON_CACHE_DIR"] = str(Path(root, "cache"))
        os.environ["CARTON_DATA_DIR"] = str(Path(root, "data"))
        try:
            yield Path(root)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
