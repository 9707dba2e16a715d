"""The built-in runners register through the ``carton`` entry-point group like any third-party plugin, and
discovery never imports a framework."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import carton
import onnxruntime
import xgboost


def test_entry_points_name_the_plugin_modules() -> None:
    entry_points = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="carton")}
    assert entry_points["onnxruntime"] == "carton_runner_onnx.plugin"
    assert entry_points["xgboost"] == "carton_runner_xgboost.plugin"


def test_discovery_reports_installed_framework_versions() -> None:
    specs = {spec.runner_name: spec for spec in carton.discover_runners() if spec.environment is None}
    onnx_spec, xgboost_spec = specs["onnxruntime"], specs["xgboost"]
    assert onnx_spec.framework_version == onnxruntime.__version__
    assert onnx_spec.entry == "carton_runner_onnx.runner:OnnxRunner" and onnx_spec.concurrent
    assert xgboost_spec.framework_version == xgboost.__version__
    assert xgboost_spec.entry == "carton_runner_xgboost.runner:XGBoostRunner"
    assert onnx_spec.runner_compat_version == xgboost_spec.runner_compat_version == 1


def test_discovery_and_serialization_import_no_framework(tmp_path) -> None:
    script = f"""
import json, sys
from pathlib import Path
import carton_runner_onnx.plugin as onnx_plugin, carton_runner_xgboost.plugin as xgb_plugin
specs = onnx_plugin.carton_runners() + xgb_plugin.carton_runners()
class NotAModel: pass
assert xgb_plugin.carton_serialize_model(NotAModel(), "xgboost", Path({str(tmp_path)!r})) is None
print(json.dumps({{"specs": [s.runner_name for s in specs],
                  "loaded": sorted(m for m in ("onnxruntime", "onnx", "xgboost", "sklearn") if m in sys.modules)}}))
"""
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    result = json.loads(completed.stdout)
    assert result == {"specs": ["onnxruntime", "xgboost"], "loaded": []}


def test_runner_module_does_not_drag_in_scikit_learn() -> None:
    script = ("import sys, carton_runner_xgboost.runner as r; "
              "print('sklearn' in sys.modules, r.xgb.__name__); import sklearn; print('ok')")
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert completed.stdout.split() == ["False", "xgboost", "ok"]


def test_onnx_runner_process_gets_huge_page_malloc(monkeypatch) -> None:
    import carton_runner_onnx.plugin as onnx_plugin

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    (spec,) = onnx_plugin.carton_runners()
    assert dict(spec.env) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")  # the host's own choice wins
    (spec,) = onnx_plugin.carton_runners()
    assert dict(spec.env) == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}


def test_onnx_runner_process_environment_has_the_tunable(tmp_path, monkeypatch) -> None:
    from runner_models import write_mlp

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    write_mlp(tmp_path)
    with carton.load_unpacked(tmp_path, runner_name="onnxruntime", required_framework_version="*") as model:
        process = model._workers[0].process
        assert process is not None and process.runner_pid is not None
        environ = Path(f"/proc/{process.runner_pid}/environ").read_bytes().split(b"\0")
        assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in environ
