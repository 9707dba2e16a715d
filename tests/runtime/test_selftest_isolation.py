"""Self-test comparisons, and the sandbox hook (`carton._sandbox.launch_wrapper`) every load calls."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from carton._runtime._isolation import RunnerLimits, SandboxPolicy, check_limits, sandbox_policy
from carton._runtime._launch import LaunchPlan
from carton._runtime._selftest import compare_outputs
from carton._workflows import _load
from carton.errors import SandboxConfigError

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


def test_policies_and_limits_are_checked_before_any_runner_starts() -> None:
    assert sandbox_policy(None) is SandboxPolicy.NONE and sandbox_policy("strict") is SandboxPolicy.STRICT
    with pytest.raises(SandboxConfigError, match="unknown sandbox policy 'tight'"):
        sandbox_policy("tight")
    assert check_limits(None) is None
    with pytest.raises(TypeError, match=r"limits must be a carton\.RunnerLimits"):
        check_limits({"memory_bytes": 1})


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

    monkeypatch.setattr(_load, "launch_wrapper", provider)
    limits = RunnerLimits(memory_bytes=1 << 30)
    with load_affine(affine_dir, sandbox="strict", limits=limits, workers=2) as model:
        model.infer({"x": special(1.0)})
    assert calls == [(SandboxPolicy.STRICT, limits, affine_dir.resolve())]
    assert len(plans) == 2
    assert all(plan.model_dir == affine_dir.resolve() for plan in plans)
