"""Entry point of the ``mcf`` runner (``carton`` entry-point group).

The "framework" is carton's own `carton.mcf` library, so the framework version is the version of the distribution
carton is installed from (``carton-runtime``), read from package metadata (discovery imports nothing heavy).
"""

from __future__ import annotations

import importlib.metadata
import os

from carton_protocol import RunnerSpec, hookimpl

__all__ = ["CARTON_DISTRIBUTION", "FORWARDED_ENV", "RUNNER_COMPAT_VERSION", "RUNNER_NAME", "carton_runners"]

RUNNER_NAME = "mcf"

#: Version of the layout of ``model/`` this runner reads: one ``.mcf`` file with a config.json section.
RUNNER_COMPAT_VERSION = 1

#: The distribution that ships carton (and this runner). The index's "carton" is another project: never read it.
CARTON_DISTRIBUTION = "carton-runtime"
#: Settings of the kernels that the host's environment passes on to the runner process (which otherwise starts
#: with a clean environment): the kernel path, and numba's cache folder, pool size and threading layer.
FORWARDED_ENV = ("CARTON_MCF_KERNELS", "NUMBA_CACHE_DIR", "NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER")


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
            env=tuple((name, os.environ[name]) for name in FORWARDED_ENV if name in os.environ),
        )
    ]
