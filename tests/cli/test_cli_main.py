"""The `carton` entry point itself: help, exit codes, broken pipes, warnings printed as messages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import carton
import numpy as np
import onnx
import pytest
from carton.cli import build_parser, main
from onnx import TensorProto, helper


def test_help_lists_every_command() -> None:
    text = build_parser().format_help()
    for command in ("info", "verify", "pack", "shrink", "runners", "runner", "selftest", "infer", "mcf", "serve",
                    "doctor"):
        assert f"    {command}" in text


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: carton" in capsys.readouterr().out


def _identity_carton(tmp_path: Path, description: str = "") -> Path:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (tmp_path / "model").mkdir()
    onnx.save(model, tmp_path / "model" / "model.onnx")
    return carton.pack(tmp_path / "model", tmp_path / "identity.carton", runner_name="onnxruntime",
                       required_framework_version="*", model_description=description or None)


def test_a_closed_pipe_is_not_a_traceback(tmp_path: Path) -> None:
    # A description far larger than a pipe's buffer, so `carton info` is still writing when the reader leaves.
    path = _identity_carton(tmp_path, description="a long description line\n" * 20000)
    producer = subprocess.Popen([sys.executable, "-m", "carton", "info", str(path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    assert producer.stdout is not None
    assert producer.stdout.read(10)
    producer.stdout.close()
    _, stderr = producer.communicate(timeout=60)
    assert b"Traceback" not in stderr, stderr.decode()
    assert b"BrokenPipeError" not in stderr
    assert producer.returncode == 0


def test_runner_warnings_print_as_messages(tmp_path: Path) -> None:
    path = _identity_carton(tmp_path)
    np.save(tmp_path / "x.npy", np.ones((1, 4), np.float32))
    result = subprocess.run(
        [sys.executable, "-m", "carton", "infer", str(path), "--input", f"x={tmp_path / 'x.npy'}",
         "--runner-opt", "bogus_option=1", "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "carton: warning: RunnerWarning:" in result.stderr
    assert "bogus_option" in result.stderr
    assert ".py:" not in result.stderr  # a message for the user, not a pointer into carton's source


def test_runner_warnings_point_at_the_callers_line(tmp_path: Path) -> None:
    path = _identity_carton(tmp_path)
    with pytest.warns(carton.RunnerWarning, match="bogus_option") as record:
        model = carton.load(path, runner_opts={"bogus_option": 1})
    model.close()
    assert record[0].filename == __file__
