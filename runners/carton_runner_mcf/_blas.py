"""BLAS's thread count in the runner process: the ``threads`` runner option bounds prefill's products too.

A prompt's products are sgemm calls on the BLAS numpy links (its bundled OpenBLAS), which by default runs one thread
per CPU whatever the runner's own team is (``OPENBLAS_NUM_THREADS`` aside). When a model is loaded with ``threads``
given, `limit_blas_threads` sets every BLAS library loaded in the process to that many threads through threadpoolctl
(the ``mcf`` extra's library for this); the explicit option wins over ``OPENBLAS_NUM_THREADS``. Without the option
BLAS keeps what its environment says.
"""

from __future__ import annotations

import os

__all__ = ["limit_blas_threads"]


def limit_blas_threads(threads: int) -> str | None:
    """Run the process's BLAS libraries on ``threads`` threads (at most the CPU count), once, at load: numpy's
    OpenBLAS keeps one thread pool for the whole process (its pthreads build), which the runner's request threads
    and forked ``processes`` helpers then share. Returns a warning for the runner to pass on when BLAS cannot be
    bounded (threadpoolctl missing, or no BLAS library found), else None."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return (
            "mcf runner: threadpoolctl is not installed, so runner option 'threads' does not bound BLAS's threads "
            "(a prompt's products); install carton-runtime[mcf]"
        )
    blas = ThreadpoolController().select(user_api="blas")
    if len(blas) == 0:
        return "mcf runner: no BLAS library found in the runner process; option 'threads' bounds the kernels only"
    blas.limit(limits=min(threads, os.cpu_count() or 1))
    return None
