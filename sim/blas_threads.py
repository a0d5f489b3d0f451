"""Keep numpy's BLAS on one thread while the functional model stands in for the FPGA.

The functional model's MATMUL runs in float64 BLAS (exact for int8 × int16 sums, see
``FunctionalEngine._matmul``). numpy's OpenBLAS then starts its own thread pool, whose
threads spin for a while after every call. In a host process that also runs the target
on torch's OpenMP threads — ``dfvg generate`` and ``dfvg bench`` on ``sim://`` — the two
pools fight for the cores, and the target's *measured* verify time doubled on this
2-core machine (17 ms against 7.5 ms a forward, ``benchmarks/engine_tree.py``). On a card
nothing of the draft runs on the host's cores, so the simulator must not slow the target
either: its BLAS gets one thread. torch keeps its own threads (MKL/OpenMP, another
library), and matrix-vector work of the model's size gains little from more.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

__all__ = ["limit_numpy_blas_threads", "numpy_openblas"]

#: OpenBLAS's thread-count setters: numpy's bundled scipy-openblas (64-bit ints), then
#: plain OpenBLAS builds.
_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_", "openblas_set_num_threads")
_done: bool | None = None


def numpy_openblas() -> list[str]:
    """Paths of the OpenBLAS libraries numpy loaded (Linux: from /proc/self/maps)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    # A line is "address perms offset dev inode pathname"; the pathname may hold spaces.
    fields = (line.split(maxsplit=5) for line in maps.read_text().splitlines())
    paths = {f[5].strip() for f in fields if len(f) == 6 and "openblas" in f[5].lower()}
    return sorted(p for p in paths if ("numpy" in p or "scipy_openblas" in p) and not p.endswith("(deleted)"))


def limit_numpy_blas_threads(threads: int = 1) -> bool:
    """Set numpy's OpenBLAS to ``threads`` threads, once per process; whether it could
    (False with another BLAS, or where the library cannot be found: nothing changes)."""
    global _done
    if _done is None:
        import numpy  # noqa: F401 - loads the library whose threads are set
        _done = False
        for path in numpy_openblas():
            try:
                lib = ctypes.CDLL(path)
            except OSError:         # not loadable by that name: leave the threads alone
                continue
            setter = next((getattr(lib, name) for name in _SETTERS if hasattr(lib, name)), None)
            if setter is not None:
                setter(ctypes.c_int(threads))
                _done = True
    return _done
