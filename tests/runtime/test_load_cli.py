"""The packed path: carton.pack (validated in a runner) -> carton.load -> infer / self tests, the CLI, and the
third-party echo plugin installed from examples/carton-runner-echo."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import carton
import numpy as np
import pytest
from carton._runtime import pack_in_runner, plugin_manager, serialize_model
from carton.cli import main
from carton.errors import InvalidOutput, NoCompatibleRunner, PackError
from carton_protocol import DType, RunnerSpec, TensorSpec, hookimpl

pytestmark = pytest.mark.usefixtures("runtime_plugin")


@pytest.fixture
def affine_carton(affine_dir: Path, tmp_path: Path) -> Path:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    return carton.pack(
        affine_dir,
        tmp_path / "affine.carton",
        runner_name="affine",
        required_framework_version="^1",
        model_name="affine",
        self_tests=[
            {"name": "right", "inputs": {"x": x}, "expected_out": {"y": x + 0.5 + 1e-7}},
            {"name": "wrong", "inputs": {"x": x}, "expected_out": {"y": x}},
            {"name": "runs", "inputs": {"x": x}},
        ],
    )


def test_pack_in_runner_fills_specs_and_compat(affine_dir: Path) -> None:
    outcome = pack_in_runner(
        runner_name="affine", required_framework_version="=1.0.0", model_dir=affine_dir, opts={"scale": 2.0}
    )
    assert outcome.runner.framework_version == "1.0.0"
    assert [s.name for s in outcome.result.inputs] == ["x"]
    assert [s.name for s in outcome.result.outputs] == ["y", "pid"]
    assert dict(outcome.result.opts) == {"scale": 2.0}


def test_pack_in_runner_errors(affine_dir: Path) -> None:
    (affine_dir / "offset.txt").unlink()
    with pytest.raises(PackError, match=r"runner affine 1\.1\.0 refused .*offset.txt is missing from the model"):
        pack_in_runner(runner_name="affine", required_framework_version="^1", model_dir=affine_dir)
    with pytest.raises(NoCompatibleRunner, match="needs runner 'nothing'"):
        pack_in_runner(runner_name="nothing", required_framework_version="*", model_dir=affine_dir)


class _Weights:
    def __init__(self, offset: float) -> None:
        self.offset = offset


class _Serializer:
    @hookimpl
    def carton_serialize_model(self, obj: object, runner_name: str, model_dir: Path) -> dict[str, object] | None:
        if runner_name != "affine" or not isinstance(obj, _Weights):
            return None
        if obj.offset < 0:
            raise ValueError("negative offsets are not supported")
        (model_dir / "offset.txt").write_text(str(obj.offset))
        return {"scale": 1.0}


def test_serialize_model(tmp_path: Path) -> None:
    manager = plugin_manager()
    serializer = _Serializer()
    manager.register(serializer, name="serializer")
    try:
        assert serialize_model(_Weights(2.5), runner_name="affine", model_dir=tmp_path) == {"scale": 1.0}
        assert (tmp_path / "offset.txt").read_text() == "2.5"
        with pytest.raises(PackError, match=r"no installed plugin can serialize a .*_Weights for runner 'other'"):
            serialize_model(_Weights(1), runner_name="other", model_dir=tmp_path)
        with pytest.raises(PackError, match="failed: ValueError: negative offsets are not supported"):
            serialize_model(_Weights(-1), runner_name="affine", model_dir=tmp_path)
        # carton.pack's object path goes through the same hook
        packed = carton.pack(
            _Weights(1.5), tmp_path / "w.carton", runner_name="affine", required_framework_version="^1"
        )
        with carton.load(packed) as model:
            np.testing.assert_array_equal(model.infer({"x": np.zeros((1, 1), np.float32)})["y"], [[1.5]])
    finally:
        manager.unregister(serializer)


def test_load_a_packed_carton(affine_carton: Path) -> None:
    with carton.load(affine_carton, runner_opts={"scale": 2.0}) as model:
        assert model.info.model_name == "affine"
        assert model.info.runner.runner_compat_version == 1
        assert model.runner.framework_version == "1.1.0"
        x = np.ones((1, 3), np.float32)
        np.testing.assert_array_equal(model.infer([x])["y"], x * 2 + 0.5)
        with pytest.raises(carton.InvalidInput, match="input 'x' has dtype int64"):
            model.infer([np.ones((1, 3), np.int64)])
    with carton.load(affine_carton, override_required_framework_version="=1.0.0") as model:
        assert model.runner.framework_version == "1.0.0"
    with carton.load(affine_carton, override_runner_name="affine-serial") as model:
        assert model.runner.runner_name == "affine-serial"
    with pytest.raises(carton.InvalidVersionReq, match="the required_framework_version override: invalid"):
        carton.load(affine_carton, override_required_framework_version="==1")
    with pytest.raises(NoCompatibleRunner):
        carton.load(affine_carton, override_required_framework_version="^9")


def test_self_tests(affine_carton: Path) -> None:
    with carton.load(affine_carton) as model:
        results = model.run_self_tests()
    assert [(r.name, r.passed) for r in results] == [("right", True), ("wrong", False), ("runs", True)]
    assert results[0].checked == ("y",)
    assert "output 'y' differs in 6 of 6 element(s) (max abs difference 0.5" in results[1].failures[0]
    assert str(results[2]) == "PASS self_test 2 (runs): ran (no expected outputs)"


def test_cli_runners(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runners", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["host"] == carton.target_triple()
    affine = [r for r in listing["runners"] if r["runner_name"] == "affine"]
    assert {r["framework_version"] for r in affine} == {"1.0.0", "1.1.0", "2.0.0"}
    assert affine[0]["source"] == "plugin runtime-tests"
    assert main(["runners"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[1].split() == ["NAME", "FRAMEWORK", "COMPAT", "PLATFORMS", "CONCURRENT", "SOURCE"]
    assert any(line.split()[:5] == ["affine", "2.0.0", "2", "any", "yes"] for line in table.splitlines())


def test_cli_selftest(affine_carton: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selftest", str(affine_carton)]) == 1
    out = capsys.readouterr().out
    assert "PASS self_test 0 (right)" in out and "FAIL self_test 1 (wrong)" in out
    assert "2 of 3 self test(s) passed" in out
    assert main(["selftest", str(affine_carton), "--runner-opt", "scale=0", "--json"]) == 1
    results = json.loads(capsys.readouterr().out)
    assert [r["passed"] for r in results] == [False, False, True]


def test_cli_infer(affine_carton: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "x.npy", np.full((2, 2), 3, np.float32))
    out_dir = tmp_path / "out"
    assert (
        main(
            [
                "infer",
                str(affine_carton),
                "--input",
                f"x={tmp_path / 'x.npy'}",
                "-o",
                str(out_dir),
                "--runner-opt",
                "scale=2",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "y: float32 [2, 2]" in printed
    np.testing.assert_array_equal(np.load(out_dir / "y.npy"), np.full((2, 2), 6.5, np.float32))
    assert np.load(out_dir / "pid.npy").shape == ()
    # positional
    assert main(["infer", str(affine_carton), "-i", str(tmp_path / "x.npy")]) == 0
    capsys.readouterr()
    # bad inputs: typed errors, exit status 1, a message naming the file or tensor
    # Files that are not .npy/.npz are named as such; numpy's advice to unpickle is never passed on.
    for name, data, expected in (
        ("junk.npy", b"not numpy", "junk.npy is not a valid .npy file"),
        ("text.npy", b"x,y\n1,2\n", "text.npy is not a valid .npy file"),
        ("junk.npz", b"not a zip", "junk.npz is not a valid .npz file"),
        ("empty.npy", b"", "empty.npy is not a valid .npy file"),
    ):
        (tmp_path / name).write_bytes(data)
        assert main(["infer", str(affine_carton), "-i", f"x={tmp_path / name}"]) == 1
        err = capsys.readouterr().err
        assert expected in err and "pickle" not in err.lower(), err
    np.save(tmp_path / "objects.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    assert main(["infer", str(affine_carton), "-i", f"x={tmp_path / 'objects.npy'}"]) == 1
    err = capsys.readouterr().err
    assert "objects.npy holds Python objects (dtype object)" in err and "pickle" not in err.lower(), err
    np.savez(tmp_path / "objects.npz", a=np.array([1, "a"], dtype=object), allow_pickle=True)
    assert main(["infer", str(affine_carton), "-i", f"x={tmp_path / 'objects.npz'}"]) == 1
    err = capsys.readouterr().err
    assert "objects.npz holds Python objects (dtype object)" in err and "pickle" not in err.lower(), err
    assert main(["infer", str(affine_carton), "-i", f"x={tmp_path / 'x.npy'}", "-i", str(tmp_path / "x.npy")]) == 1
    assert "not a mix" in capsys.readouterr().err
    assert main(["infer", str(affine_carton), "-i", f"z={tmp_path / 'x.npy'}"]) == 1
    assert "unknown input 'z'" in capsys.readouterr().err


def test_pack_warns_when_no_required_platform_is_this_machine(affine_dir: Path, tmp_path: Path) -> None:
    host = carton.target_triple()
    foreign = ["aarch64-apple-darwin", "x86_64-pc-windows-msvc"]
    foreign = [triple for triple in foreign if triple != host]
    with pytest.warns(carton.PlatformWarning, match=rf"this machine is {host}") as caught:
        packed = carton.pack(
            affine_dir,
            tmp_path / "foreign.carton",
            runner_name="affine",
            required_framework_version="^1",
            required_platforms=foreign,
        )
    assert all(triple in str(caught[0].message) for triple in foreign)
    assert issubclass(carton.PlatformWarning, carton.CartonWarning)
    assert list(carton.get_model_info(packed).required_platforms) == foreign
    with warnings.catch_warnings():
        warnings.simplefilter("error", carton.PlatformWarning)
        carton.pack(
            affine_dir,
            tmp_path / "here.carton",
            runner_name="affine",
            required_framework_version="^1",
            required_platforms=[*foreign, host],
        )
        carton.pack(affine_dir, tmp_path / "any.carton", runner_name="affine", required_framework_version="^1")


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"carton {carton.__version__}"


def test_cli_output_names_cannot_escape(tmp_path: Path) -> None:
    from carton.cli._runtime import _save

    for name in ("../evil", "/abs", "a/b", "..", ".hidden"):
        with pytest.raises(InvalidOutput, match="cannot be saved under that name"):
            _save(tmp_path, name, np.zeros(1))
    assert _save(tmp_path, "nested", [np.zeros(1), np.ones(2)]).name == "nested.npz"


def test_cli_help_is_complete(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("runners", "selftest", "infer"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--" in capsys.readouterr().out


ECHO_INSTALLED = importlib.util.find_spec("carton_runner_echo") is not None


@pytest.mark.skipif(
    not ECHO_INSTALLED,
    reason="examples/carton-runner-echo is not installed (pip install -e examples/carton-runner-echo)",
)
def test_third_party_echo_plugin(tmp_path: Path) -> None:
    echo = [s for s in carton.discover_runners() if s.runner_name == "echo"]
    assert len(echo) == 1 and isinstance(echo[0], RunnerSpec)
    assert echo[0].source == "plugin echo (carton-runner-echo 0.1.0)"
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "README").write_text("the echo runner needs no files")
    packed = carton.pack(
        folder,
        tmp_path / "echo.carton",
        runner_name="echo",
        required_framework_version="^1",
        inputs=[TensorSpec(name="text", dtype=DType.STRING, shape=("n",))],
        runner_opts={"rename": {"text": "said"}},
    )
    assert [s.name for s in carton.get_model_info(packed).outputs] == ["said"]  # derived by the runner's pack
    with carton.load(packed) as model:
        out = model.infer({"text": np.array(["hello", "world"])})
        np.testing.assert_array_equal(out["said"], ["hello", "world"])
    with (
        pytest.warns(carton.RunnerWarning, match="unknown option 'volume'"),
        carton.load(packed, runner_opts={"volume": 11}) as model,
    ):
        pass
