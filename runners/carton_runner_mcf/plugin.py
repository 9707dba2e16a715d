"""Entry point of the ``mcf`` runner (``carton`` entry-point group).

The "framework" is carton's own `carton.mcf` library, so the framework version is the version of the distribution
carton is installed from (``carton-runtime``), read from package metadata (discovery imports nothing heavy).
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping

from carton_protocol import RunnerSpec, hookimpl

__all__ = [
    "BLAS_THREAD_TIMEOUT",
    "CARTON_DISTRIBUTION",
    "FORWARDED_ENV",
    "RUNNER_COMPAT_VERSION",
    "RUNNER_NAME",
    "carton_runners",
    "runner_env",
]

RUNNER_NAME = "mcf"

#: Version of the layout of ``model/`` this runner reads: one ``.mcf`` file with a config.json section.
RUNNER_COMPAT_VERSION = 1

#: The distribution that ships carton (and this runner). The index's "carton" is another project: never read it.
CARTON_DISTRIBUTION = "carton-runtime"
#: Settings of the kernels that the host's environment passes on to the runner process (which otherwise starts
#: with a clean environment): the kernel path, numba's cache folder, pool size and threading layer, and BLAS's
#: thread count (prefill's products).
FORWARDED_ENV = (
    "CARTON_MCF_KERNELS",
    "NUMBA_CACHE_DIR",
    "NUMBA_NUM_THREADS",
    "NUMBA_THREADING_LAYER",
    "OPENBLAS_NUM_THREADS",
    "OPENBLAS_THREAD_TIMEOUT",
)
#: OpenBLAS's ``OPENBLAS_THREAD_TIMEOUT`` for the runner process (unless the host sets it): its threads poll for
#: the next product for ``2 ** value`` cycles of the time-stamp counter before they sleep, ``2 ** 28`` by default,
#: longer than many decode steps. After a prompt's products that poll takes a core from the decode steps that
#: follow, whose threads wait for each other at every barrier; ``2 ** 20`` cycles still bridge the gaps between one
#: prompt's products.
BLAS_THREAD_TIMEOUT = "20"


def runner_env(environ: Mapping[str, str] = os.environ) -> tuple[tuple[str, str], ...]:
    """The variables the runner process gets on top of its clean environment: `FORWARDED_ENV` from ``environ``, and
    `BLAS_THREAD_TIMEOUT` unless ``environ`` sets one."""
    found = {name: environ[name] for name in FORWARDED_ENV if name in environ}
    found.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)
    return tuple(found.items())


@hookimpl
def carton_runners() -> list[RunnerSpec]:
    """Offer the runner whenever carton itself is installed (it always is when this plugin is found)."""
    try:
        framework_version = importlib.metadata.version(CARTON_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return []
    return [
        RunnerSpec(
            runner_name=RUNNER_NAME,
            framework_version=framework_version,
            runner_compat_version=RUNNER_COMPAT_VERSION,
            entry="carton_runner_mcf.runner:MCFRunner",
            env=runner_env(),
        )
    ]
