"""Both kernel paths of the mcf runner: every test taking ``kernels`` runs on the numpy path and on the compiled
(numba) path; the compiled run is skipped with its reason where numba is not installed, or when
``CARTON_MCF_KERNELS=numpy`` forces the numpy path for the whole run."""

from __future__ import annotations

import os

import pytest
from carton_runner_mcf._packed import KERNELS_ENV, compiled_kernels


@pytest.fixture(params=["numpy", "numba"])
def kernels(request: pytest.FixtureRequest) -> str:
    if request.param == "numba":
        if os.environ.get(KERNELS_ENV, "").strip().lower() == "numpy":
            pytest.skip(f"{KERNELS_ENV}=numpy forces the numpy path")
        if compiled_kernels("auto") is None and os.environ.get(KERNELS_ENV) != "numba":
            pytest.skip("numba is not installed (pip install 'carton-runtime[mcf]')")
    return str(request.param)
