"""Running a carton's ``[[self_test]]`` entries and comparing outputs (allclose for floats, exact for the rest)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from carton_protocol import Tensor

from ..errors import CartonError

if TYPE_CHECKING:
    from .._format import SelfTest

__all__ = ["ATOL", "RTOL", "SelfTestResult", "compare_outputs", "run_self_tests"]

#: Tolerances of the float comparison (numpy.allclose's defaults; NaN equals NaN).
RTOL = 1e-5
ATOL = 1e-8


@dataclass(frozen=True, slots=True, kw_only=True)
class SelfTestResult:
    """The outcome of one ``[[self_test]]``: ``failures`` says what differed or what went wrong (empty if passed).

    ``checked`` names the outputs that were compared; a self test without ``expected_out`` only has to run.
    """

    index: int
    name: str | None
    passed: bool
    checked: tuple[str, ...] = ()
    failures: tuple[str, ...] = ()

    def __str__(self) -> str:
        label = f"self_test {self.index}" + (f" ({self.name})" if self.name else "")
        if self.passed:
            what = f"outputs {', '.join(self.checked)} match" if self.checked else "ran (no expected outputs)"
            return f"PASS {label}: {what}"
        return f"FAIL {label}: " + "; ".join(self.failures)


class _Inferer(Protocol):
    def infer(self, inputs: Mapping[str, object] | Sequence[object], *, timeout: float | None = None) -> dict[
        str, Tensor
    ]: ...


def _compare_arrays(name: str, actual: np.ndarray[Any, Any], expected: np.ndarray[Any, Any]) -> str | None:
    if actual.shape != expected.shape:
        return f"output {name!r} has shape {actual.shape}, expected {expected.shape}"
    if actual.dtype.kind != expected.dtype.kind:
        return f"output {name!r} has dtype {actual.dtype}, expected {expected.dtype}"
    if expected.dtype.kind in "fc":
        if np.allclose(actual, expected, rtol=RTOL, atol=ATOL, equal_nan=True):
            return None
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
        worst = float(np.nanmax(diff)) if diff.size and not np.all(np.isnan(diff)) else float("nan")
        mismatched = int(np.count_nonzero(~np.isclose(actual, expected, rtol=RTOL, atol=ATOL, equal_nan=True)))
        return (
            f"output {name!r} differs in {mismatched} of {expected.size} element(s) "
            f"(max abs difference {worst:.6g}, rtol={RTOL:g}, atol={ATOL:g})"
        )
    if np.array_equal(actual, expected):
        return None
    mismatched = int(np.count_nonzero(actual != expected))
    return f"output {name!r} differs in {mismatched} of {expected.size} element(s) (exact comparison)"


def compare_outputs(name: str, actual: Tensor, expected: Tensor) -> str | None:
    """Why ``actual`` does not match ``expected`` (allclose for floats, exact otherwise), or None if it does."""
    if isinstance(expected, list) or isinstance(actual, list):
        if not isinstance(expected, list) or not isinstance(actual, list):
            return f"output {name!r}: one of actual/expected is a nested tensor and the other is not"
        if len(actual) != len(expected):
            return f"output {name!r} has {len(actual)} nested element(s), expected {len(expected)}"
        for index, (inner_actual, inner_expected) in enumerate(zip(actual, expected, strict=True)):
            problem = _compare_arrays(f"{name}[{index}]", inner_actual, inner_expected)
            if problem is not None:
                return problem
        return None
    return _compare_arrays(name, actual, expected)


def _run_one(model: _Inferer, index: int, test: SelfTest) -> SelfTestResult:
    try:
        inputs = {name: ref.load() for name, ref in test.inputs.items()}
        outputs = model.infer(inputs)
        expected = {name: ref.load() for name, ref in (test.expected_out or {}).items()}
    except CartonError as exc:
        return SelfTestResult(index=index, name=test.name, passed=False,
                              failures=(f"{type(exc).__name__}: {exc}",))
    failures: list[str] = []
    for name, want in expected.items():
        if name not in outputs:
            failures.append(f"output {name!r} was not returned (got {', '.join(map(repr, outputs)) or 'none'})")
            continue
        problem = compare_outputs(name, outputs[name], want)
        if problem is not None:
            failures.append(problem)
    return SelfTestResult(
        index=index, name=test.name, passed=not failures, checked=tuple(expected), failures=tuple(failures)
    )


def run_self_tests(model: _Inferer, tests: Sequence[SelfTest]) -> tuple[SelfTestResult, ...]:
    """Run each self test on ``model``; errors and mismatches become failed results, never exceptions."""
    return tuple(_run_one(model, index, test) for index, test in enumerate(tests))
