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

try:  # numba-cuda is an optional extra ('gpu'/'dev'); kernels only need it when launched
    from numba import cuda

    HAVE_NUMBA_CUDA = True
except Exception:  # noqa: BLE001 - any import failure means "no numba.cuda"
    cuda = None
    HAVE_NUMBA_CUDA = False

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
