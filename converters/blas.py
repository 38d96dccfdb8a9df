"""The number of threads of NumPy's BLAS, for a block of code (no dependency on threadpoolctl).

The converter's NumPy analysis runs with one BLAS thread: most of it is element-wise work (one
thread anyway), and on a machine where other processes use the cores, OpenBLAS's busy-waiting
worker threads make its matrix products several times slower than one thread (measured here:
a 256x512x256 product 4x slower with 2 threads than with 1 while a benchmark ran beside it).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from collections.abc import Iterator

_SETTERS = (
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)
_GETTERS = (
    "scipy_openblas_get_num_threads64_",
    "scipy_openblas_get_num_threads",
    "openblas_get_num_threads64_",
    "openblas_get_num_threads",
)


def _openblas() -> tuple[object, object] | None:
    """(get, set) of the OpenBLAS NumPy uses, or None when it cannot be found."""
    try:
        import numpy
    except ImportError:  # pragma: no cover
        return None
    root = os.path.dirname(numpy.__file__)
    candidates = glob.glob(os.path.join(root, os.pardir, "numpy.libs", "*openblas*.so*"))
    candidates += glob.glob(os.path.join(root, ".dylibs", "*openblas*"))
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        get = next((getattr(lib, n) for n in _GETTERS if hasattr(lib, n)), None)
        set_ = next((getattr(lib, n) for n in _SETTERS if hasattr(lib, n)), None)
        if get is not None and set_ is not None:
            get.restype = ctypes.c_int
            set_.argtypes = [ctypes.c_int]
            set_.restype = None
            return get, set_
    return None


_LIB = _openblas()


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """Run the block with NumPy's OpenBLAS limited to ``n`` threads (no-op if not found)."""
    if _LIB is None:
        yield
        return
    get, set_ = _LIB
    before = int(get())
    set_(int(n))
    try:
        yield
    finally:
        set_(before)
