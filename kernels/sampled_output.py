"""Column gather and column-sparse updates of the output layer for the sampled mode
(``TrainConfig.output="sampled"``, :func:`xmc_engine.output_layer.sampled_output_grad`).

A sampled step computes logits only for the candidate labels ``cols`` of the batch: it gathers
their ``W2`` columns and ``b2`` entries into a compact block, runs the GEMMs and the softmax on
that block, and writes the block's gradient back to those columns only. ``cols`` holds unique
label ids, so no two threads ever write the same entry.

Arrays
------
W2 : (n_hidden, n_labels) float32, C- or F-contiguous  output weights (a column per label)
b2 : (n_labels,) float32                            output bias
cols : (m,) int64, unique                           candidate labels of the batch
W2s : (n_hidden, m) float32, C-contiguous           gathered block ``W2[:, cols]``
b2s : (m,) float32                                  gathered ``b2[cols]``
dW2s, db2s : same shapes as W2s, b2s                the block's gradient
acc_W2, acc_b2 : same shapes as W2, b2              Adagrad accumulators; only ``cols`` touched

Versions
--------
``*_cpu``      @njit, for either memory order of ``W2`` (and of ``acc_W2``, which has the same):
               C order (row-major, a label's column one float per row): a prange over the rows
               of ``W2``, each row reading or writing the ``m`` entries of its candidate
               columns; Fortran order (label-major, a label's column ``n_hidden`` contiguous
               floats: what the CPU replicas of the sampled layer hold, see
               :func:`xmc_engine.model.label_major_w2`): a prange over the candidates, each
               reading or writing its contiguous column. Then a serial loop over the ``m`` bias
               entries.
``*_kernel``   @cuda.jit, one thread per entry of the ``(n_hidden, m)`` block in a grid-stride
               loop (entries ``t >= n_hidden * m`` handle the ``m`` bias entries);
               ``*_launch`` queues them on a stream and never synchronises.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from xmc_engine.kernels._cuda import TPB, blocks_for, cuda, cuda_kernel, launch
from xmc_engine.kernels.adagrad import adagrad_entry_cpu, adagrad_entry_device


@njit(nogil=True, cache=True)
def label_major(W2):
    """Whether ``W2`` (2-D) is stored label-major: a column's entries adjacent in memory
    (Fortran order), so that a kernel should visit it column by column."""
    return W2.shape[0] > 1 and W2.strides[0] < W2.strides[1]


@njit(nogil=True, cache=True, parallel=True)
def gather_columns_cpu(W2, b2, cols, W2s, b2s):
    """``W2s[:, j] = W2[:, cols[j]]``; ``b2s[j] = b2[cols[j]]``."""
    m = cols.shape[0]
    if label_major(W2):
        for j in prange(m):
            src = W2[:, cols[j]]
            for h in range(src.shape[0]):
                W2s[h, j] = src[h]
    else:
        for h in prange(W2.shape[0]):
            src = W2[h]
            dst = W2s[h]
            for j in range(m):
                dst[j] = src[cols[j]]
    for j in range(m):
        b2s[j] = b2[cols[j]]


@njit(nogil=True, cache=True, parallel=True)
def scatter_add_columns_cpu(W2, b2, cols, dW2s, db2s, alpha):
    """``W2[:, cols[j]] += alpha dW2s[:, j]``; ``b2[cols[j]] += alpha db2s[j]``."""
    m = cols.shape[0]
    a = np.float32(alpha)
    if label_major(W2):
        for j in prange(m):
            dst = W2[:, cols[j]]
            for h in range(dst.shape[0]):
                dst[h] += a * dW2s[h, j]
    else:
        for h in prange(W2.shape[0]):
            dst = W2[h]
            src = dW2s[h]
            for j in range(m):
                dst[cols[j]] += a * src[j]
    for j in range(m):
        b2[cols[j]] += a * db2s[j]


@njit(nogil=True, cache=True, parallel=True)  # IEEE float32, as kernels/adagrad.py
def adagrad_columns_cpu(W2, b2, acc_W2, acc_b2, cols, dW2s, db2s, lr, eps):
    """Adagrad (``acc += g^2; w -= lr g / (sqrt(acc) + eps)``) on the columns ``cols`` of
    ``W2`` / ``acc_W2`` and the entries ``cols`` of ``b2`` / ``acc_b2`` only."""
    m = cols.shape[0]
    lr32 = np.float32(lr)
    eps32 = np.float32(eps)
    if label_major(W2):
        for j in prange(m):
            c = cols[j]
            w = W2[:, c]
            acc = acc_W2[:, c]
            for h in range(w.shape[0]):
                w[h], acc[h] = adagrad_entry_cpu(w[h], acc[h], dW2s[h, j], lr32, eps32)
    else:
        for h in prange(W2.shape[0]):
            w = W2[h]
            acc = acc_W2[h]
            g = dW2s[h]
            for j in range(m):
                c = cols[j]
                w[c], acc[c] = adagrad_entry_cpu(w[c], acc[c], g[j], lr32, eps32)
    for j in range(m):
        c = cols[j]
        b2[c], acc_b2[c] = adagrad_entry_cpu(b2[c], acc_b2[c], db2s[j], lr32, eps32)


@cuda_kernel
def gather_columns_kernel(W2, b2, cols, W2s, b2s):
    m = cols.shape[0]
    n = W2.shape[0] * m
    for t in range(cuda.grid(1), n + m, cuda.gridsize(1)):
        if t < n:
            h = t // m
            j = t - h * m
            W2s[h, j] = W2[h, cols[j]]
        else:
            b2s[t - n] = b2[cols[t - n]]


@cuda_kernel
def scatter_add_columns_kernel(W2, b2, cols, dW2s, db2s, alpha):
    m = cols.shape[0]
    n = W2.shape[0] * m
    for t in range(cuda.grid(1), n + m, cuda.gridsize(1)):
        if t < n:
            h = t // m
            j = t - h * m
            W2[h, cols[j]] += alpha * dW2s[h, j]
        else:
            b2[cols[t - n]] += alpha * db2s[t - n]


@cuda_kernel
def adagrad_columns_kernel(W2, b2, acc_W2, acc_b2, cols, dW2s, db2s, lr, eps):
    m = cols.shape[0]
    n = W2.shape[0] * m
    for t in range(cuda.grid(1), n + m, cuda.gridsize(1)):
        if t < n:
            h = t // m
            j = t - h * m
            c = cols[j]
            W2[h, c], acc_W2[h, c] = adagrad_entry_device(W2[h, c], acc_W2[h, c], dW2s[h, j],
                                                          lr, eps)
        else:
            c = cols[t - n]
            b2[c], acc_b2[c] = adagrad_entry_device(b2[c], acc_b2[c], db2s[t - n], lr, eps)


def _entries(W2, cols) -> int:
    """Threads' work items of a column kernel: the ``(n_hidden, m)`` block and ``m`` biases."""
    return W2.shape[0] * cols.shape[0] + cols.shape[0]


def gather_columns_launch(W2, b2, cols, W2s, b2s, stream=0):
    """Queue the column gather; never synchronises."""
    if cols.shape[0]:
        launch(gather_columns_kernel, blocks_for(_entries(W2, cols)), TPB, stream, W2, b2, cols,
               W2s, b2s)


def scatter_add_columns_launch(W2, b2, cols, dW2s, db2s, alpha, stream=0):
    """Queue ``W2[:, cols] += alpha dW2s``, ``b2[cols] += alpha db2s``; never synchronises."""
    if cols.shape[0]:
        launch(scatter_add_columns_kernel, blocks_for(_entries(W2, cols)), TPB, stream, W2, b2,
               cols, dW2s, db2s, np.float32(alpha))


def adagrad_columns_launch(W2, b2, acc_W2, acc_b2, cols, dW2s, db2s, lr, eps, stream=0):
    """Queue the column-sparse Adagrad update; never synchronises."""
    if cols.shape[0]:
        launch(adagrad_columns_kernel, blocks_for(_entries(W2, cols)), TPB, stream, W2, b2,
               acc_W2, acc_b2, cols, dW2s, db2s, np.float32(lr), np.float32(eps))
