"""Self-test comparisons, and the sandbox hook (`carton._sandbox.launch_wrapper`) the runtime calls."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from carton._runtime._isolation import RunnerLimits, SandboxPolicy, launch_wrapper
from carton._runtime._launch import LaunchPlan
from carton._runtime._selftest import compare_outputs

from .test_model import load_affine, special


def test_float_comparison_is_allclose() -> None:
    expected = np.array([1.0, 2.0, np.nan], np.float32)
    assert compare_outputs("y", expected + 1e-6, expected) is None
    problem = compare_outputs("y", np.array([1.0, 2.5, np.nan], np.float32), expected)
    assert problem == "output 'y' differs in 1 of 3 element(s) (max abs difference 0.5, rtol=1e-05, atol=1e-08)"
    assert compare_outputs("y", np.zeros(2, np.float32), np.zeros(3, np.float32)) == (
        "output 'y' has shape (2,), expected (3,)"
    )
    assert compare_outputs("y", np.zeros(3, np.int32), expected) == "output 'y' has dtype int32, expected float32"


def test_exact_comparison_for_the_rest() -> None:
    assert compare_outputs("i", np.array([1, 2]), np.array([1, 2])) is None
    assert compare_outputs("i", np.array([1, 3]), np.array([1, 2])) == (
        "output 'i' differs in 1 of 2 element(s) (exact comparison)"
    )
    assert compare_outputs("s", np.array(["a", "b"]), np.array(["a", "b"])) is None
    assert compare_outputs("s", np.array(["a", "c"]), np.array(["a", "b"])) is not None


def test_nested_comparison() -> None:
    nested = [np.zeros(2, np.float32), np.ones(3, np.float32)]
    assert compare_outputs("n", [a.copy() for a in nested], nested) is None
    assert compare_outputs("n", nested[:1], nested) == "output 'n' has 1 nested element(s), expected 2"
    assert compare_outputs("n", [nested[0], nested[1] * 2], nested) is not None
    assert "one of actual/expected is a nested tensor" in str(compare_outputs("n", nested[0], nested))


def test_policies_without_a_sandbox_layer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "carton._sandbox", None)  # an import of it now fails, as in a build without
    assert launch_wrapper(None, None, model_dir=tmp_path) is None
    assert launch_wrapper("none", RunnerLimits(request_seconds=2), model_dir=tmp_path) is None
    from carton.errors import SandboxUnavailable

    for policy in ("best_effort", SandboxPolicy.STRICT):
        with pytest.raises(SandboxUnavailable, match="needs the sandbox layer"):
            launch_wrapper(policy, None, model_dir=tmp_path)
    with pytest.raises(SandboxUnavailable, match="limits cpu_seconds, processes are enforced by the sandbox layer"):
        launch_wrapper("none", RunnerLimits(cpu_seconds=1, processes=4), model_dir=tmp_path)
    with pytest.raises(TypeError, match=r"limits must be a carton\.RunnerLimits"):
        launch_wrapper("none", {"memory_bytes": 1}, model_dir=tmp_path)  # type: ignore[arg-type]


@pytest.mark.usefixtures("runtime_plugin")
def test_a_sandbox_layer_wraps_every_runner_start(monkeypatch: pytest.MonkeyPatch, affine_dir: Path) -> None:
    calls: list[tuple[SandboxPolicy, RunnerLimits | None, Path]] = []
    plans: list[LaunchPlan] = []

    def provider(policy: SandboxPolicy, limits: RunnerLimits | None, *, model_dir: Path):  # type: ignore[no-untyped-def]
        calls.append((policy, limits, model_dir))

        def wrap(plan: LaunchPlan) -> LaunchPlan:
            plans.append(plan)
            return dataclasses.replace(plan, env={**plan.env, "WRAPPED_BY": "test-sandbox"})

        return wrap

    module = types.ModuleType("carton._sandbox")
    module.launch_wrapper = provider  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "carton._sandbox", module)
    limits = RunnerLimits(memory_bytes=1 << 30)
    with load_affine(affine_dir, sandbox="strict", limits=limits, workers=2) as model:
        model.infer({"x": special(1.0)})
    assert calls == [(SandboxPolicy.STRICT, limits, affine_dir.resolve())]
    assert len(plans) == 2
    assert all(plan.model_dir == affine_dir.resolve() for plan in plans)
