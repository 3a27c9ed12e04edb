"""CUDA plumbing shared by the kernel modules: lazy ``numba.cuda``, launch configs, simulator lock.

Every ``@cuda.jit`` kernel of :mod:`xmc_engine.kernels` is declared through :func:`cuda_kernel`,
which compiles lazily (no eager signature), so the modules import on machines without CUDA and
even without ``numba-cuda`` installed (the kernel then raises when launched). Launchers go
through :func:`launch`, which takes a numba stream (``cuda.external_stream(cupy_stream.ptr)`` on
a GPU, ``0`` for the default stream) and never synchronises. Under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, STYLE.md "Kernels under the CUDA simulator") launches are kept small
(grid-stride loops make every kernel correct for any grid) and serialised by one lock, because the
simulator is not thread-safe.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext

from xmc_engine import _env


def _numpy_compat() -> None:
    """numba-cuda 0.30.4 registers an overload of ``np.row_stack`` when it compiles its first
    kernel; NumPy 2.5 removed that alias of ``vstack``, and every CUDA kernel then fails to
    compile with ``AttributeError: module 'numpy' has no attribute 'row_stack'`` (seen on the
    GPU machine: numpy 2.5.2, numba-cuda 0.30.4). Give NumPy back a function of that name (a
    distinct one: numba-cuda overloads ``vstack`` itself as well)."""
    import numpy as np

    if not hasattr(np, "row_stack"):
        def row_stack(tup, *, dtype=None, casting="same_kind"):
            return np.vstack(tup, dtype=dtype, casting=casting)

        np.row_stack = row_stack


_numpy_compat()

try:  # numba-cuda is an optional extra ('gpu'/'dev'); kernels only need it when launched
    from numba import cuda

    HAVE_NUMBA_CUDA = True
except Exception:  # noqa: BLE001 - any import failure means "no numba.cuda"
    cuda = None
    HAVE_NUMBA_CUDA = False


def _quiet_small_grids() -> None:
    """Silence numba-cuda's "Grid size N will likely result in GPU under-utilization" warning
    (one per launch of fewer than 128 blocks) unless ``NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS`` is
    set: the engine launches small grids on purpose for small arrays (a merge of a 64-wide
    hidden layer, a batch's few rows), and the first H200 run's log held thousands of them."""
    import os

    if cuda is None or "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS" in os.environ:
        return
    try:
        from numba.cuda.core import config
    except ImportError:  # another numba-cuda layout: keep its default
        return
    config.CUDA_LOW_OCCUPANCY_WARNINGS = 0


_quiet_small_grids()

CUDASIM = _env.cudasim()
_SIM_LOCK = threading.Lock()

#: threads per block of the 1-D kernels (a power of two; the reductions rely on it)
TPB = 32 if CUDASIM else 256
#: upper bound on blocks per launch (grid-stride loops cover the rest)
MAX_BLOCKS = 4 if CUDASIM else 65535


class _Unavailable:
    """Stand-in for a kernel when ``numba.cuda`` cannot be imported."""

    def __init__(self, name: str):
        self.__name__ = name

    def __getitem__(self, config):
        raise RuntimeError(
            f"CUDA kernel {self.__name__} needs numba-cuda (pip install 'xmc-engine[gpu]')"
        )


def cuda_kernel(fn):
    """``@cuda.jit`` (lazy, no signature) or an informative stand-in without numba-cuda."""
    if cuda is None:
        return _Unavailable(fn.__name__)
    return cuda.jit(fn)


def cuda_device(fn):
    """``@cuda.jit(device=True)``: a function the kernels call (``None`` without numba-cuda:
    the kernels that call it are stand-ins then)."""
    if cuda is None:
        return None
    return cuda.jit(device=True)(fn)


def blocks_for(n_items: int, tpb: int = TPB) -> int:
    """Blocks for a grid-stride loop over ``n_items`` with ``tpb`` threads per block."""
    return max(1, min(MAX_BLOCKS, (int(n_items) + tpb - 1) // tpb))


def rows_grid(n_rows: int) -> int:
    """Blocks for a block-per-row kernel (rows beyond the grid are covered by striding)."""
    return max(1, min(MAX_BLOCKS, int(n_rows)))


def launch(kernel, grid: int, block: int, stream, *args) -> None:
    """Queue ``kernel[grid, block, stream](*args)``; never synchronises.

    ``stream`` is a numba stream (``cuda.external_stream(ptr)``) or ``0``/``None`` for the
    default stream. Under the simulator the launch runs under a process-wide lock.
    """
    if stream is None:
        stream = 0
    with _SIM_LOCK if CUDASIM else nullcontext():
        kernel[grid, block, stream](*args)
