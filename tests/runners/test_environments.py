"""Runner environments: version choice, what gets installed, the registry's atomicity, the CLI, and (marked
``network``) real installs, including two onnxruntime versions side by side in one host process."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import venv
from pathlib import Path

import carton
import numpy as np
import onnxruntime as ort
import pytest
from carton._environments import _install as install_module
from carton._environments import plugin as environments_plugin
from carton._environments._frameworks import (
    FRAMEWORKS,
    carton_install_args,
    framework_distributions,
    runner_requirements,
)
from carton._environments._install import available_versions, choose_version
from carton._environments._registry import (
    ENTRY_FILE,
    RunnerEnvironment,
    environment_dir,
    runners_dir,
    stale_reason,
    sweep_leftovers,
    write_entry,
)
from carton._runtime import VersionReq
from carton.cli import main as cli_main
from runner_models import write_mlp

log = logging.getLogger(__name__)

#: An onnxruntime older than the installed one, with a cp311 wheel, that works with today's numpy.
OLD_ONNXRUNTIME = "1.19.2"


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CARTON_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


# --- choosing a version ------------------------------------------------------------------------------------------

OFFERED = ["1.32.0", "1.31.1", "1.31.0", "1.20.0rc1", "1.19.2", "1.19.0", "1.18.1", "1.17.3", "1!2.0.0"]


@pytest.mark.parametrize(
    "requirement, chosen",
    [
        ("=1.19.2", "1.19.2"),
        ("1.19", "1.32.0"),  # bare = caret: ^1.19 allows every 1.x >= 1.19
        ("~1.19", "1.19.2"),
        ("~1.18", "1.18.1"),
        ("<1.19", "1.18.1"),
        (">=1.17, <1.19.1", "1.19.0"),
        ("*", "1.32.0"),
        ("=1.20.0-rc.1", "1.20.0rc1"),  # a pre-release only when the requirement names one
        ("1.19.*", "1.19.2"),
    ],
)
def test_choose_the_highest_matching_version(requirement: str, chosen: str) -> None:
    assert (
        choose_version(OFFERED, VersionReq.parse(requirement), requirement_text=requirement, distribution="onnxruntime")
        == chosen
    )


def test_no_matching_version_lists_what_the_index_offers() -> None:
    with pytest.raises(
        carton.EnvironmentInstallError,
        match=r"no onnxruntime release matches '=1\.5\.0'; the package index offers: 1\.32\.0, ",
    ):
        choose_version(OFFERED, VersionReq.parse("=1.5.0"), requirement_text="=1.5.0", distribution="onnxruntime")


def test_invalid_requirement_and_unknown_runner_fail_before_anything_runs(data_dir: Path) -> None:
    with pytest.raises(carton.InvalidVersionReq):
        carton.install_runner("onnxruntime", framework_version="==1.19.2")
    with pytest.raises(carton.EnvironmentInstallError, match="cannot build environments for runner 'torch'"):
        carton.install_runner("torch", framework_version="*")
    assert not data_dir.exists()


# --- what an environment gets ------------------------------------------------------------------------------------


def test_requirements_pin_the_framework_and_take_only_what_the_runner_needs() -> None:
    onnx_requirements = runner_requirements(FRAMEWORKS["onnxruntime"], "1.19.2")
    assert onnx_requirements[0] == "onnxruntime==1.19.2"
    names = {requirement.split(">")[0].split("=")[0].split("<")[0] for requirement in onnx_requirements}
    assert names == {"onnxruntime", "onnx", "numpy", "pluggy", "pyzmq", "msgspec"}
    assert not any("extra" in requirement for requirement in onnx_requirements)
    xgboost_requirements = runner_requirements(FRAMEWORKS["xgboost"], "2.1.4")
    build = "xgboost" if sys.platform == "darwin" else "xgboost-cpu"  # the build the [xgboost] extra installs
    assert xgboost_requirements[0] == f"{build}==2.1.4" and not any("onnx" in r for r in xgboost_requirements)
    # Exactly one build of the framework, pinned: never the extra's unpinned one beside it.
    assert [r for r in xgboost_requirements if r.startswith("xgboost")] == [f"{build}==2.1.4"]
    assert runner_requirements(FRAMEWORKS["xgboost"], "2.0.3", "xgboost")[0] == "xgboost==2.0.3"
    assert not any(r.startswith("xgboost-cpu") for r in runner_requirements(FRAMEWORKS["xgboost"], "2.0.3", "xgboost"))


def test_xgboost_environments_prefer_the_cpu_build_and_fall_back_for_older_versions() -> None:
    preferred = framework_distributions(FRAMEWORKS["xgboost"])
    assert preferred == (["xgboost", "xgboost-cpu"] if sys.platform == "darwin" else ["xgboost-cpu", "xgboost"])
    assert framework_distributions(FRAMEWORKS["onnxruntime"]) == ["onnxruntime"]


def test_a_version_the_cpu_build_lacks_comes_from_the_full_build(monkeypatch: pytest.MonkeyPatch) -> None:
    offered = {"xgboost-cpu": ["3.2.0", "2.1.4", "2.1.1"], "xgboost": ["3.2.0", "2.1.4", "2.0.3", "1.7.6"]}
    monkeypatch.setattr(install_module, "available_versions", lambda distribution: offered[distribution])
    lines: list[str] = []
    preferred = framework_distributions(FRAMEWORKS["xgboost"])[0]
    choose = functools.partial(install_module._choose_build, FRAMEWORKS["xgboost"], report=lines.append)
    assert choose(VersionReq.parse("^2.1"), "^2.1") == (preferred, "2.1.4")
    assert choose(VersionReq.parse("=2.0.3"), "=2.0.3") == ("xgboost", "2.0.3")
    assert lines[-1] == "[1/5] looking up xgboost versions matching '=2.0.3'"
    with pytest.raises(carton.EnvironmentInstallError, match=rf"no {preferred} release matches '=1\.0\.0'"):
        choose(VersionReq.parse("=1.0.0"), "=1.0.0")


def test_carton_is_installed_from_where_it_is_installed() -> None:
    arguments = carton_install_args()
    direct_url = json.loads(carton._environments._frameworks._carton().read_text("direct_url.json") or "{}")
    if direct_url.get("dir_info", {}).get("editable"):
        assert arguments[0] == "-e" and (Path(arguments[1]) / "pyproject.toml").is_file()
        assert Path(arguments[1], "runners", "carton_runner_onnx").is_dir()
    else:  # installed from a local wheel or a URL: that same file is installed again
        assert arguments and (Path(arguments[-1]).exists() or arguments[-1].startswith("carton-runtime @ "))


# --- the registry ------------------------------------------------------------------------------------------------


def _registered(
    runner_name: str = "onnxruntime", version: str = "1.19.2", *, requirements: tuple[str, ...] | None = None
) -> RunnerEnvironment:
    """A real (pip-less) venv registered by hand, as the last step of an install does: with what this carton would
    install there, or with `requirements` (``()``: none recorded, as carton did before it recorded them)."""
    folder = environment_dir(runner_name, version)
    if not folder.exists():
        venv.EnvBuilder(symlinks=True, with_pip=False).create(folder)
    framework = FRAMEWORKS[runner_name]
    environment = RunnerEnvironment(
        runner_name=runner_name,
        framework_version=version,
        requirement=f"={version}",
        path=folder,
        runner_compat_version=1,
        entry="carton_runner_onnx.runner:OnnxRunner",
        concurrent=True,
        carton_version=carton.__version__,
        distribution=framework.distribution,
        requirements=tuple(runner_requirements(framework, version) if requirements is None else requirements),
    )
    write_entry(environment)
    return environment


def test_registered_environment_is_offered_to_discovery(data_dir: Path) -> None:
    environment = _registered()
    assert carton.list_runner_environments() == [environment]
    [spec] = environments_plugin.carton_runners()
    assert spec.runner_name == "onnxruntime" and spec.framework_version == "1.19.2"
    assert spec.python == str(environment.path / "bin" / "python") and Path(spec.python).exists()
    assert spec.environment == spec.source == str(environment.path)
    assert any(found.environment == spec.environment for found in carton.discover_runners())


def _any_onnxruntime_carton(tmp_path: Path) -> Path:
    """An MLP packed for any onnxruntime version (validated by the installed one), for loads that pin a version."""
    write_mlp(tmp_path / "model")
    return carton.pack(
        tmp_path / "model", tmp_path / "mlp.carton", runner_name="onnxruntime", required_framework_version="*"
    )


def test_no_matching_runner_names_the_command_that_would_install_one(tmp_path: Path, data_dir: Path) -> None:
    packed = _any_onnxruntime_carton(tmp_path)
    with pytest.raises(carton.NoCompatibleRunner) as raised:
        carton.load(packed, override_required_framework_version="=1.0.99")
    assert (
        'To install a matching runner environment: carton runner install onnxruntime --framework-version "=1.0.99"'
        in str(raised.value)
    )
    with pytest.raises(carton.NoCompatibleRunner) as raised:  # no recipe for this runner name: no hint
        carton.load(packed, override_runner_name="no-such-runner")
    assert "carton runner install" not in str(raised.value)


def test_unfinished_and_broken_environments_are_never_offered(data_dir: Path) -> None:
    environment = _registered()
    runners = runners_dir()
    (runners / ".tmp-onnxruntime-1.18.1-abc").mkdir()  # a build in progress or killed
    venv.EnvBuilder(with_pip=False).create(runners / "onnxruntime-1.17.3")  # renamed, never registered
    broken = runners / "onnxruntime-1.16.0"
    broken.mkdir()
    (broken / ENTRY_FILE).write_text("{not json")
    newer = runners / "xgboost-9.0.0"
    venv.EnvBuilder(with_pip=False).create(newer)
    (newer / ENTRY_FILE).write_text(json.dumps({**environment.to_json(), "format": 99}))
    assert [spec.framework_version for spec in environments_plugin.carton_runners()] == ["1.19.2"]
    removed = sorted(path.name for path in sweep_leftovers())
    assert removed == [".tmp-onnxruntime-1.18.1-abc", "onnxruntime-1.17.3"]
    assert broken.exists() and newer.exists()  # an entry we cannot read is not ours to delete


#: What an environment built before the wire moved from msgpack to msgspec holds.
OLD_WIRE = ("onnxruntime==1.19.2", "onnx>=1.16", "numpy>=1.26", "pluggy>=1.5", "pyzmq>=26", "msgpack>=1.0")


@pytest.mark.parametrize(
    ("requirements", "carton_version", "reason"),
    [
        ((), None, r"it records no dependencies \(it was built by an older carton\)"),
        (OLD_WIRE, None, r"this carton needs msgspec>=[0-9.]+ there, which it was not built with"),
        (None, "0.0.1", rf"it was built by carton 0\.0\.1, this is carton {carton.__version__}"),
    ],
)
def test_a_stale_environment_is_not_offered_and_resolution_says_how_to_rebuild_it(
    tmp_path: Path,
    data_dir: Path,
    capsys: pytest.CaptureFixture[str],
    requirements: tuple[str, ...] | None,
    carton_version: str | None,
    reason: str,
) -> None:
    """An environment built by another carton would fail at start (``No module named 'msgspec'``): it is skipped,
    and the error says why and what rebuilds it."""
    environment = _registered(requirements=requirements)
    if carton_version is not None:
        environment = dataclasses.replace(environment, carton_version=carton_version)
        write_entry(environment)
    assert re.fullmatch(reason, stale_reason(environment) or "")
    assert environments_plugin.carton_runners() == []
    assert carton.list_runner_environments() == [environment]  # still listed, and removable
    packed = _any_onnxruntime_carton(tmp_path)
    with pytest.raises(carton.NoCompatibleRunner) as raised:
        carton.load(packed, override_required_framework_version="=1.19.2")
    message = str(raised.value)
    assert "Runner environments skipped, built for another carton:" in message
    assert re.search(
        rf"onnxruntime 1\.19\.2 \({re.escape(str(environment.path))}\): {reason}; rebuild it: "
        r'carton runner install onnxruntime --framework-version "=1\.19\.2"',
        message,
    )
    assert cli_main(["runner", "list"]) == 0
    assert re.search(
        rf"stale: onnxruntime 1\.19\.2 is not offered to models \({reason}\); rebuild it: ", capsys.readouterr().out
    )
    assert cli_main(["runner", "list", "--json"]) == 0
    assert re.fullmatch(reason, json.loads(capsys.readouterr().out)[0]["stale"])


def test_a_runner_that_cannot_start_names_its_environment_and_the_rebuild_command(
    tmp_path: Path, data_dir: Path
) -> None:
    """An environment that records the right requirements but lost them (here: a venv with nothing installed, so
    its interpreter cannot even import carton_protocol) is offered, and its runner dies before the handshake: the
    error names the environment and the command that rebuilds it."""
    environment = _registered()
    assert stale_reason(environment) is None
    packed = _any_onnxruntime_carton(tmp_path)
    with pytest.raises(carton.RunnerStartError) as raised:
        carton.load(packed, override_required_framework_version="=1.19.2")
    message = str(raised.value)
    assert "before completing the handshake" in message
    assert "No module named carton_protocol" in message  # the log: what went wrong in the environment
    assert message.endswith(
        "(the runner runs in the runner environment onnxruntime 1.19.2; if it is broken, rebuild it: "
        'carton runner install onnxruntime --framework-version "=1.19.2" --force)'
    )
    assert str(environment.path) not in message.rpartition("runner log ends with")[0]


def test_install_rebuilds_a_stale_environment_and_reuses_a_fresh_one(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(install_module, "available_versions", lambda distribution: ["1.19.2"])
    fresh = _registered()
    lines: list[str] = []
    assert carton.install_runner("onnxruntime", framework_version="=1.19.2", progress=lines.append) == fresh
    assert lines[-1].strip() == f"onnxruntime 1.19.2 is already installed in {fresh.path}"

    class Building(Exception):
        """The install went on to build a new environment (what follows needs the package index)."""

    def building(*arguments: object) -> Path:
        raise Building

    monkeypatch.setattr(install_module, "new_build_dir", building)
    _registered(requirements=OLD_WIRE)
    with pytest.raises(Building):
        carton.install_runner("onnxruntime", framework_version="=1.19.2", progress=lines.append)
    assert re.fullmatch(
        r"rebuilding onnxruntime 1\.19\.2 in .*: this carton needs msgspec>=\S+ there, which it "
        r"was not built with",
        lines[-1].strip(),
    )


def test_environment_whose_interpreter_is_gone_is_not_offered(data_dir: Path) -> None:
    environment = _registered()
    environment.python.unlink()
    assert environments_plugin.carton_runners() == []


def test_entry_is_written_atomically(data_dir: Path) -> None:
    environment = _registered()
    assert [path.name for path in environment.path.iterdir() if path.name.startswith(".entry-")] == []
    assert json.loads((environment.path / ENTRY_FILE).read_text())["framework_version"] == "1.19.2"


def test_remove(data_dir: Path) -> None:
    _registered(version="1.19.2")
    _registered(version="1.18.1")
    [removed] = carton.remove_runner_environment("onnxruntime", "1.18.1")
    assert removed.framework_version == "1.18.1" and not removed.path.exists()
    assert [env.framework_version for env in carton.list_runner_environments()] == ["1.19.2"]
    assert carton.remove_runner_environment("onnxruntime", "1.0.0") == []
    assert len(carton.remove_runner_environment("onnxruntime")) == 1
    assert carton.list_runner_environments() == [] and sorted(os.listdir(runners_dir())) == [".lock"]


# --- CLI ---------------------------------------------------------------------------------------------------------


def test_cli_list_and_remove(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["runner", "list"]) == 0
    assert "no runner environments installed" in capsys.readouterr().out
    environment = _registered()
    assert cli_main(["runner", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUNNER", "FRAMEWORK", "COMPAT", "REQUIREMENT", "PATH"]
    assert lines[1].split() == ["onnxruntime", "1.19.2", "1", "=1.19.2", str(environment.path)]
    assert cli_main(["runner", "list", "--json"]) == 0
    [listed] = json.loads(capsys.readouterr().out)
    assert listed["python"] == str(environment.python) and listed["framework_version"] == "1.19.2"
    assert cli_main(["runner", "remove", "onnxruntime"]) == 2
    assert "give either a VERSION or --all" in capsys.readouterr().err
    assert cli_main(["runner", "remove", "onnxruntime", "1.0.0"]) == 1
    assert cli_main(["runner", "remove", "onnxruntime", "1.19.2"]) == 0
    assert f"removed onnxruntime 1.19.2 ({environment.path})" in capsys.readouterr().out


def test_cli_install_refuses_bad_input(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main(["runner", "install", "torch"])
    assert exited.value.code == 2 and "invalid choice: 'torch'" in capsys.readouterr().err
    assert cli_main(["runner", "install", "onnxruntime", "--framework-version", "1.2.3.4.5"]) == 1
    assert "InvalidVersionReq" in capsys.readouterr().err


# --- real installs (package registry needed) ---------------------------------------------------------------------


@functools.cache
def _registry_problem() -> str | None:
    try:
        available_versions("onnxruntime")
    except carton.EnvironmentInstallError as exc:
        return str(exc)
    return None


def _require_registry() -> None:
    problem = _registry_problem()
    if problem is not None:
        log.warning("skipping: the package registry cannot be reached: %s", problem)
        pytest.skip(f"the package registry cannot be reached: {problem.splitlines()[0]}")


def _cached_data_dir() -> Path:
    """A data directory kept across test runs so the environment is built once per carton checkout, carton version
    and set of requirements: a change of dependencies (of the wire, say) gets a fresh build."""
    built_with = [
        *carton_install_args(),
        carton.__version__,
        *runner_requirements(FRAMEWORKS["onnxruntime"], OLD_ONNXRUNTIME),
    ]
    key = hashlib.sha256("\n".join(built_with).encode()).hexdigest()[:12]
    base = os.environ.get("CARTON_TEST_ENVIRONMENTS_DIR") or Path.home() / ".cache" / "carton-tests"
    return Path(base) / f"environments-{key}"


@pytest.mark.network
@pytest.mark.slow
def test_two_onnxruntime_versions_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _require_registry()
    monkeypatch.setenv("CARTON_DATA_DIR", str(_cached_data_dir()))
    lines: list[str] = []
    environment = carton.install_runner("onnxruntime", framework_version=f"={OLD_ONNXRUNTIME}", progress=lines.append)
    assert lines[0].startswith("[1/5] looking up onnxruntime versions matching")
    assert environment.framework_version == OLD_ONNXRUNTIME and environment.python.exists()
    assert ort.__version__ != OLD_ONNXRUNTIME
    # It records what it was built with, so that a later carton can tell it is stale.
    assert environment.requirements == tuple(runner_requirements(FRAMEWORKS["onnxruntime"], OLD_ONNXRUNTIME))
    assert environment.carton_version == carton.__version__ and stale_reason(environment) is None

    path = write_mlp(tmp_path / "model")
    # Packing for the old version validates the model in the old environment's runner.
    packed = carton.pack(
        tmp_path / "model",
        tmp_path / "mlp.carton",
        runner_name="onnxruntime",
        required_framework_version=f"={OLD_ONNXRUNTIME}",
    )
    x = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    in_process = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with carton.load(packed) as old, carton.load(packed, override_required_framework_version="*") as new:
        assert old.runner.framework_version == OLD_ONNXRUNTIME and old.runner.environment == str(environment.path)
        assert new.runner.framework_version == ort.__version__ and new.runner.environment is None
        old_out, new_out = old.infer({"x": x})["probs"], new.infer({"x": x})["probs"]
    assert np.array_equal(new_out, in_process)
    assert np.allclose(old_out, in_process, rtol=1e-6, atol=1e-7)  # two onnxruntime builds: kernels may differ


@pytest.mark.network
def test_install_with_no_matching_release(data_dir: Path) -> None:
    _require_registry()
    with pytest.raises(carton.EnvironmentInstallError, match=r"no onnxruntime release matches '=1\.0\.99'"):
        carton.install_runner("onnxruntime", framework_version="=1.0.99")
    assert carton.list_runner_environments() == []


@pytest.mark.network
def test_killed_install_leaves_nothing_resolution_would_pick(data_dir: Path) -> None:
    _require_registry()
    process = subprocess.Popen(
        [sys.executable, "-m", "carton", "runner", "install", "onnxruntime", "--framework-version", "=1.18.1"],
        env={**os.environ, "CARTON_DATA_DIR": str(data_dir)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(path.name.startswith(".tmp-") for path in data_dir.glob("runners/*")):
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            assert time.monotonic() < deadline, "the install never started building"
            time.sleep(0.05)
        time.sleep(1.0)  # let it get into pip
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert any(path.name.startswith(".tmp-") for path in (data_dir / "runners").iterdir())
    assert carton.list_runner_environments() == [] and environments_plugin.carton_runners() == []
    assert not any(spec.environment for spec in carton.discover_runners())
    carton.remove_runner_environment("onnxruntime")  # any later install or removal sweeps the leftovers
    assert sorted(os.listdir(data_dir / "runners")) == [".lock"]
