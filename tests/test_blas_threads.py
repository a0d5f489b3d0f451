"""The sim device keeps numpy's OpenBLAS on one thread (sim/blas_threads.py): its pool
would otherwise spin against torch's and slow the target's measured forwards."""

from __future__ import annotations

import ctypes

from sim.blas_threads import limit_numpy_blas_threads, numpy_openblas
from sim.device import SimDevice

GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
           "openblas_get_num_threads64_", "openblas_get_num_threads")


def blas_threads() -> int:
    lib = ctypes.CDLL(numpy_openblas()[0])
    return next(getattr(lib, name) for name in GETTERS if hasattr(lib, name))()


def test_the_sim_device_runs_numpy_blas_on_one_thread(tiny_engine):
    SimDevice(tiny_engine)
    assert numpy_openblas(), "numpy's OpenBLAS is not among the loaded libraries"
    assert blas_threads() == 1 and limit_numpy_blas_threads()
