"""Tests of the benchmark scripts' own logic (the files of bench/, which is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench_script(filename: str) -> ModuleType:
    """The module of ``bench/<filename>``, run under a private name. The scripts import their siblings by name (they
    run from bench/): bench/ is on ``sys.path`` while it runs, and it and the siblings it imported leave
    ``sys.modules`` after (the module keeps its own references to them)."""
    name = f"bench_script_{Path(filename).stem}"
    spec = importlib.util.spec_from_file_location(name, BENCH / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    loaded = set(sys.modules)
    sys.path.insert(0, str(BENCH))
    sys.modules[name] = module  # dataclasses look their module up there while their class is made
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
        for added in set(sys.modules) - loaded:
            if added == name or Path(getattr(sys.modules[added], "__file__", None) or "").parent == BENCH:
                del sys.modules[added]
    return module
