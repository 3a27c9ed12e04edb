"""Adagrad updates (Duchi, Hazan, Singer 2011), dense and row-sparse, for the optional adaptive
optimiser of :class:`xmc_engine.XMCClassifier` (``optimizer="adagrad"``).

For every parameter entry, with gradient ``g``, accumulator ``G`` and learning rate ``lr``::

    G += g * g
    w -= lr * g / (sqrt(G) + eps)

Arrays
------
w, g, acc : same shape, float32, C-contiguous       parameter, gradient, accumulator (dense form)
W : (n_features, n_hidden) float32                 the sparse input layer ``W1``
rows : (n_rows,) int64, sorted, unique             features present in the batch
grad_rows : (n_rows, n_hidden) float32             their gradient rows
acc_W : (n_features, n_hidden) float32             accumulator of ``W``; only ``rows`` touched

Versions
--------
``*_cpu``      @njit: a flattened prange (dense), a prange over the unique rows (row-sparse,
               conflict-free because the rows are unique). Compiled without ``fastmath``: each
               entry is the formula in IEEE float32, in its order (no fused multiply-add, an
               exact square root and division), so every loop layout, vectorised or not, and
               the float32 formula in NumPy give the same bits (``tests/test_adagrad.py``).
               ``fastmath`` was level on the dense and row updates (0.88-1.14x, this VM's
               noise) and at most 0.14 ms faster on a label-major column update
               (``bench/bench_adagrad.py``; ``bench/RESULTS.md``, "Adagrad in IEEE
               float32").
``*_kernel``   @cuda.jit grid-stride loops; ``*_launch`` queues them on a stream and never
               synchronises.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange
from xmc_engine.kernels._cuda import (
    TPB,
    blocks_for,
    cuda,
    cuda_device,
    cuda_kernel,
    launch,
    rows_grid,
)


def _adagrad_entry(w, acc, g, lr, eps):
    """The rule on one entry: returns the new ``(w, acc)``. The one place the formula is
    written; every Adagrad kernel (dense, row-sparse here, column-sparse in
    :mod:`xmc_engine.kernels.sampled_output`) calls it, compiled for the CPU or the device."""
    a = acc + g * g
    return w - lr * g / (math.sqrt(a) + eps), a


#: :func:`_adagrad_entry` for the ``@njit`` kernels (inlined into their loops, so compiled with
#: the caller's flags: every caller is compiled without ``fastmath``, see the module docstring)
adagrad_entry_cpu = njit(inline="always", cache=True)(_adagrad_entry)
#: :func:`_adagrad_entry` for the ``@cuda.jit`` kernels (``None`` without numba-cuda)
adagrad_entry_device = cuda_device(_adagrad_entry)


@njit(nogil=True, cache=True, parallel=True)
def adagrad_dense_cpu(w, g, acc, lr, eps):
    """acc += g^2; w -= lr g / (sqrt(acc) + eps), flattened."""
    wv = w.reshape(-1)
    gv = g.reshape(-1)
    av = acc.reshape(-1)
    lr32 = np.float32(lr)
    eps32 = np.float32(eps)
    for t in prange(wv.shape[0]):
        wv[t], av[t] = adagrad_entry_cpu(wv[t], av[t], gv[t], lr32, eps32)


@njit(nogil=True, cache=True, parallel=True)
def adagrad_rows_cpu(W, rows, grad_rows, acc_W, lr, eps):
    """The dense rule on rows ``rows`` of ``W`` / ``acc_W`` only."""
    lr32 = np.float32(lr)
    eps32 = np.float32(eps)
    n_hidden = W.shape[1]
    for u in prange(rows.shape[0]):
        w = W[rows[u]]
        a = acc_W[rows[u]]
        g = grad_rows[u]
        for j in range(n_hidden):
            w[j], a[j] = adagrad_entry_cpu(w[j], a[j], g[j], lr32, eps32)


@cuda_kernel
def adagrad_dense_kernel(w, g, acc, lr, eps):
    for t in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        w[t], acc[t] = adagrad_entry_device(w[t], acc[t], g[t], lr, eps)


@cuda_kernel
def adagrad_rows_kernel(W, rows, grad_rows, acc_W, lr, eps):
    n_hidden = W.shape[1]
    for u in range(cuda.blockIdx.x, rows.shape[0], cuda.gridDim.x):
        f = rows[u]
        for j in range(cuda.threadIdx.x, n_hidden, cuda.blockDim.x):
            W[f, j], acc_W[f, j] = adagrad_entry_device(W[f, j], acc_W[f, j], grad_rows[u, j],
                                                         lr, eps)


def adagrad_dense_launch(w, g, acc, lr, eps, stream=0):
    """Queue the dense Adagrad update; never synchronises."""
    wv = w.reshape(-1)
    if wv.shape[0]:
        launch(adagrad_dense_kernel, blocks_for(wv.shape[0]), TPB, stream, wv, g.reshape(-1),
               acc.reshape(-1), np.float32(lr), np.float32(eps))


def adagrad_rows_launch(W, rows, grad_rows, acc_W, lr, eps, stream=0):
    """Queue the row-sparse Adagrad update; never synchronises."""
    if rows.shape[0]:
        block = min(128, max(32, 32 * ((W.shape[1] + 31) // 32)))
        launch(adagrad_rows_kernel, rows_grid(rows.shape[0]), block, stream, W, rows, grad_rows,
               acc_W, np.float32(lr), np.float32(eps))
