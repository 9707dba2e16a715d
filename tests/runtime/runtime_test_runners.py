"""Runners the runtime tests start in real runner processes (entry ``runtime_test_runners:Name``).

`Affine` is a tiny real model: ``model/offset.txt`` holds a number, ``y = x * scale + offset``. Special input
values make it misbehave on request (crash, sleep, wrong outputs) so one runner covers the lifecycle tests.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from carton_protocol import DType, LoadContext, PackContext, PackResult, Runner, Tensor, TensorSpec

CRASH = 666.0  # x[0] == CRASH: the runner dies of SIGSEGV mid-request
SLEEP = 777.0  # x[0] == SLEEP: sleep x[1] seconds first (GIL released)
WRONG = 888.0  # x[0] == WRONG: return y as float64 (an output that breaks its declared dtype)
#: An environment variable naming a file that a SLEEP request touches before it sleeps.
STARTED_MARKER = "CARTON_TEST_SLEEP_STARTED"
#: The runner option doing the same (for a runner whose environment the test does not choose).
STARTED_OPT = "sleep_started"

KNOWN_OPTS = ("scale", "fail_load", STARTED_OPT)


class Affine(Runner):
    """``y = x * opts['scale'] + float(model/offset.txt)``; also returns ``pid`` (int64 scalar)."""

    concurrent = True

    def load(self, context: LoadContext) -> None:
        if context.opts.get("fail_load"):
            raise ValueError("refusing to load: fail_load is set")
        self.offset = np.float32(float((context.model_dir / "offset.txt").read_text()))
        self.scale = np.float32(float(context.opts.get("scale", 1.0)))  # type: ignore[arg-type]
        self.started = str(context.opts.get(STARTED_OPT, "")) or os.environ.get(STARTED_MARKER, "")
        for key in context.opts:
            if key not in KNOWN_OPTS:
                context.warn(f"unknown option {key!r}")

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        x = inputs["x"]
        assert isinstance(x, np.ndarray)
        first = float(x.flat[0]) if x.size else 0.0
        if first == CRASH:
            os.kill(os.getpid(), signal.SIGSEGV)
        if first == SLEEP:
            if self.started:
                Path(self.started).touch()  # tells a test watching from outside that the request is in the runner
            time.sleep(float(x.flat[1]))
        y = x * self.scale + self.offset
        if first == WRONG:
            y = y.astype(np.float64)
        return {"y": y, "pid": np.array(os.getpid(), dtype=np.int64)}

    @classmethod
    def pack(cls, context: PackContext) -> PackResult:
        offset = context.model_dir / "offset.txt"
        if not offset.is_file():
            raise ValueError(f"{offset.name} is missing from the model folder")
        float(offset.read_text())
        inputs = context.inputs or (TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", "n")),)
        outputs = context.outputs or (
            TensorSpec(name="y", dtype=DType.FLOAT32, shape=("batch", "n")),
            TensorSpec(name="pid", dtype=DType.INT64, shape=()),
        )
        return PackResult(inputs=inputs, outputs=outputs, opts={"scale": 1.0, **context.opts})


class SerialAffine(Affine):
    """The same model, declaring itself not concurrent (one request at a time per process)."""

    concurrent = False


class Passthrough(Runner):
    """Returns its inputs unchanged (strings, nested tensors, scalars)."""

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        return dict(inputs)


class Spin(Runner):
    """CPU-bound and holding the GIL: spins in Python for ``x[0]`` milliseconds (for workers=N benchmarks)."""

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        x = inputs["x"]
        assert isinstance(x, np.ndarray)
        deadline = time.perf_counter() + float(x.flat[0]) / 1000
        spins = 0
        while time.perf_counter() < deadline:
            spins += 1
        return {"y": np.array([spins], dtype=np.int64)}
