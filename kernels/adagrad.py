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
               conflict-free because the rows are unique).
``*_kernel``   @cuda.jit grid-stride loops; ``*_launch`` queues them on a stream and never
               synchronises.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange
from xmc_engine.kernels._cuda import TPB, blocks_for, cuda, cuda_kernel, launch, rows_grid


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def adagrad_dense_cpu(w, g, acc, lr, eps):
    """acc += g^2; w -= lr g / (sqrt(acc) + eps), flattened."""
    wv = w.reshape(-1)
    gv = g.reshape(-1)
    av = acc.reshape(-1)
    lr32 = np.float32(lr)
    eps32 = np.float32(eps)
    for t in prange(wv.shape[0]):
        gt = gv[t]
        a = av[t] + gt * gt
        av[t] = a
        wv[t] -= lr32 * gt / (np.sqrt(a) + eps32)


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
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
            gj = g[j]
            aj = a[j] + gj * gj
            a[j] = aj
            w[j] -= lr32 * gj / (np.sqrt(aj) + eps32)


@cuda_kernel
def adagrad_dense_kernel(w, g, acc, lr, eps):
    for t in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        gt = g[t]
        a = acc[t] + gt * gt
        acc[t] = a
        w[t] -= lr * gt / (math.sqrt(a) + eps)


@cuda_kernel
def adagrad_rows_kernel(W, rows, grad_rows, acc_W, lr, eps):
    n_hidden = W.shape[1]
    for u in range(cuda.blockIdx.x, rows.shape[0], cuda.gridDim.x):
        f = rows[u]
        for j in range(cuda.threadIdx.x, n_hidden, cuda.blockDim.x):
            gj = grad_rows[u, j]
            a = acc_W[f, j] + gj * gj
            acc_W[f, j] = a
            W[f, j] -= lr * gj / (math.sqrt(a) + eps)


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
