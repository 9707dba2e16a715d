"""Plugin discovery through real entry points of a distribution written to a temporary sys.path entry."""

from __future__ import annotations

import importlib
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pluggy
import pytest
from carton._runtime import _hookspecs
from carton._runtime._plugins import discover, plugin_manager, reset_plugins
from carton._runtime._resolve import RunnerRequest, resolve_runner
from carton.errors import CartonWarning, NoCompatibleRunner
from carton_protocol import RunnerSpec, hookimpl

PLUGINS = {
    "zz_good_plugin": """
        import importlib.metadata
        from carton_protocol import RunnerSpec, hookimpl

        @hookimpl
        def carton_runners():
            return [RunnerSpec(runner_name="good", framework_version="1.2.3", runner_compat_version=1,
                               entry="zz_good_plugin:Runner")]
    """,
    "zz_import_error_plugin": """
        import a_module_that_does_not_exist_anywhere
    """,
    "zz_raising_plugin": """
        from carton_protocol import hookimpl

        @hookimpl
        def carton_runners():
            raise RuntimeError("the plugin's own bug")
    """,
    "zz_garbage_plugin": """
        from carton_protocol import RunnerSpec, hookimpl

        @hookimpl
        def carton_runners():
            return ["not a spec", RunnerSpec(runner_name="half", framework_version="2.0.0", runner_compat_version=1,
                                             entry="no-colon"),
                    RunnerSpec(runner_name="half", framework_version="2.0.1", runner_compat_version=1,
                               entry="zz_garbage_plugin:Runner", source="explicit source")]
    """,
    "zz_bad_signature_plugin": """
        from carton_protocol import hookimpl

        @hookimpl
        def carton_runners(unexpected_argument):
            return []
    """,
}

ENTRY_POINTS = {
    "zz-good": "zz_good_plugin",
    "zz-import-error": "zz_import_error_plugin",
    "zz-raising": "zz_raising_plugin",
    "zz-garbage": "zz_garbage_plugin",
    "zz-bad-signature": "zz_bad_signature_plugin",
    "zz-missing-attribute": "zz_good_plugin:not_there",
}


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for module, source in PLUGINS.items():
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    dist_info = tmp_path / "zz_fake_runners-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: zz-fake-runners\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        "[carton]\n" + "".join(f"{name} = {value}\n" for name, value in ENTRY_POINTS.items())
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    reset_plugins()
    yield tmp_path
    reset_plugins()
    for module in PLUGINS:
        sys.modules.pop(module, None)


def test_broken_plugins_are_named_and_skipped(fake_distribution: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        discovery = discover()
    runners = {(s.runner_name, s.framework_version): s for s in discovery.runners}
    assert ("good", "1.2.3") in runners
    assert runners["good", "1.2.3"].source == "plugin zz-good (zz-fake-runners 0.1)"
    assert runners["half", "2.0.1"].source == "explicit source"
    assert ("half", "2.0.0") not in runners

    problems = {p.plugin: p.message for p in discovery.problems}
    assert "ModuleNotFoundError: No module named 'a_module_that_does_not_exist_anywhere'" in problems["zz-import-error"]
    assert "zz-fake-runners 0.1" in problems["zz-import-error"]
    assert problems["zz-raising"] == "carton_runners() raised RuntimeError: the plugin's own bug"
    assert "AttributeError" in problems["zz-missing-attribute"]
    assert "rejected by the plugin manager" in problems["zz-bad-signature"]
    assert "unexpected_argument" in problems["zz-bad-signature"]
    garbage = [p.message for p in discovery.problems if p.plugin == "zz-garbage"]
    assert any("returned a str, not a RunnerSpec" in m for m in garbage)
    assert any("entry 'no-colon' is not 'module:Class'" in m for m in garbage)

    messages = [str(w.message) for w in caught if issubclass(w.category, CartonWarning)]
    for name in ("zz-import-error", "zz-raising", "zz-missing-attribute", "zz-bad-signature", "zz-garbage"):
        assert any(f"plugin {name!r}" in m for m in messages), name


def test_resolution_through_entry_points_reports_skipped_plugins(fake_distribution: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CartonWarning)
        chosen = resolve_runner(RunnerRequest(runner_name="good", required_framework_version="^1"))
        assert chosen.entry == "zz_good_plugin:Runner"
        with pytest.raises(NoCompatibleRunner) as info:
            resolve_runner(RunnerRequest(runner_name="good", required_framework_version="^2"))
    message = str(info.value)
    assert "good 1.2.3 (compat 1, plugin zz-good (zz-fake-runners 0.1)): framework version 1.2.3" in message
    assert "plugin 'zz-raising': carton_runners() raised RuntimeError" in message


def test_plugin_manager_is_shared_and_accepts_registrations(fake_distribution: Path) -> None:
    class Extra:
        @hookimpl
        def carton_runners(self) -> list[RunnerSpec]:
            return [RunnerSpec(runner_name="extra", framework_version="0.1.0", runner_compat_version=1,
                               entry="x:Y")]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CartonWarning)
        manager = plugin_manager()
        assert plugin_manager() is manager
        manager.register(Extra(), name="extra")
        specs = discover().runners
    assert specs[-1].runner_name == "extra"
    assert specs[-1].source == "plugin extra"


def test_discovery_with_a_private_manager() -> None:
    manager = pluggy.PluginManager("carton")
    manager.add_hookspecs(_hookspecs)

    class One:
        @hookimpl
        def carton_runners(self) -> list[RunnerSpec]:
            return [RunnerSpec(runner_name="one", framework_version="1.0.0", runner_compat_version=1, entry="a:B")]

    class NotAList:
        @hookimpl
        def carton_runners(self) -> object:
            return {"runner_name": "dict"}

    manager.register(One(), name="one")
    manager.register(NotAList(), name="not-a-list")
    with pytest.warns(CartonWarning, match="plugin 'not-a-list': carton_runners\\(\\) returned a dict"):
        discovery = discover(manager)
    assert [s.runner_name for s in discovery.runners] == ["one"]
    assert [p.plugin for p in discovery.problems] == ["not-a-list"]


def test_serialize_hook_is_firstresult() -> None:
    manager = pluggy.PluginManager("carton")
    manager.add_hookspecs(_hookspecs)

    class Declines:
        @hookimpl
        def carton_serialize_model(self, obj: object, runner_name: str, model_dir: Path) -> None:
            return None

    class Takes:
        @hookimpl
        def carton_serialize_model(self, obj: object, runner_name: str, model_dir: Path) -> dict[str, object]:
            return {"taken_by": "takes"}

    manager.register(Takes(), name="takes")
    manager.register(Declines(), name="declines")
    assert manager.hook.carton_serialize_model(obj=object(), runner_name="x", model_dir=Path()) == {
        "taken_by": "takes"
    }


def test_discovery_never_imports_a_framework() -> None:
    import subprocess
    import sys

    code = (
        "import sys, warnings, carton\n"
        "warnings.simplefilter('ignore')\n"
        "specs = carton.discover_runners()\n"
        "print(len(specs), sorted(m for m in ('onnxruntime', 'onnx', 'xgboost', 'torch') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    count, imported = result.stdout.split(" ", 1)
    assert int(count) >= 1
    assert imported.strip() == "[]"
