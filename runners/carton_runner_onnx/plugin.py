"""Entry point of the ``onnxruntime`` runner (``carton`` entry-point group).

Discovery must stay cheap and must not import onnxruntime: the framework version comes from package metadata.
"""

from __future__ import annotations

import os

from carton_protocol import RunnerSpec, hookimpl, installed_version

__all__ = ["FRAMEWORK_DISTRIBUTIONS", "MALLOC_TUNABLES", "RUNNER_COMPAT_VERSION", "RUNNER_NAME", "carton_runners"]

RUNNER_NAME = "onnxruntime"

#: Version of the layout of ``model/`` this runner reads: a ``.onnx`` file (plus its external data files).
RUNNER_COMPAT_VERSION = 1

#: Distributions that provide the ``onnxruntime`` module, in the order their version is looked up.
FRAMEWORK_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino", "onnxruntime-directml")

#: glibc (>= 2.35) malloc tunables for the runner process: ``hugetlb=1`` backs malloc's large allocations with
#: transparent huge pages (madvise). Creating a session faults in every byte of the model two to three times (the
#: protobuf, the initializers, the pre-packed weights); with 2 MiB pages a 100 MB model takes about 4,000 page faults
#: instead of 67,000, and session creation in a fresh process about a third of the time. Other C libraries, and
#: glibc versions without the tunable, ignore it. A ``GLIBC_TUNABLES`` set in the host's environment is used instead.
MALLOC_TUNABLES = "glibc.malloc.hugetlb=1"


@hookimpl
def carton_runners() -> list[RunnerSpec]:
    """Offer the runner when onnxruntime is installed in this environment; offer nothing otherwise."""
    framework_version = installed_version(*FRAMEWORK_DISTRIBUTIONS)
    if framework_version is None:
        return []
    return [
        RunnerSpec(
            runner_name=RUNNER_NAME,
            framework_version=framework_version,
            runner_compat_version=RUNNER_COMPAT_VERSION,
            entry="carton_runner_onnx.runner:OnnxRunner",
            concurrent=True,
            env=(("GLIBC_TUNABLES", os.environ.get("GLIBC_TUNABLES", MALLOC_TUNABLES)),),
        )
    ]
