"""Sparse input layer backward: row-sparse W1 gradient, in-place SGD of touched rows (DESIGN.md §2).

Only the rows of W1 of features present in the batch are read or written; a dense
(n_features, n_hidden) gradient is never materialised.

Arrays
------
indptr : (B + 1,) int32 or int64          CSR row pointers of the batch X (B, n_features)
indices : (nnz,) int32 or int64           feature index of each non-zero
data : (nnz,) float32                     value of each non-zero
dZ1 : (B, n_hidden) float32               gradient w.r.t. the hidden pre-activation (C-contiguous)
W1 : (n_features, n_hidden) float32       C-contiguous, updated in place
b1 : (n_hidden,) float32                  updated in place
rows : (n_rows,) int64                    sorted unique features of the batch
grad_rows : (n_rows, n_hidden) float32    grad_rows[u] = sum_i X[i, rows[u]] * dZ1[i]
grad_b1 : (n_hidden,) float32             sum_i dZ1[i]
dH, H : (B, n_hidden) float32             relu_backward zeroes dH where H <= 0 (in place)

Versions
--------
CPU (``*_cpu``, @njit nogil): the batch is transposed to CSC by a counting sort over features
(``batch_to_csc_cpu``, serial, O(nnz + n_features)); then a prange over the unique features
gives every thread its own W1 rows: conflict-free, deterministic, no atomics.
``sparse_backward_update_cpu`` subtracts ``lr * data * dZ1[i]`` straight into ``W1[f]``.
GPU (``*_kernel``): one block per batch row, threads over hidden units, ``cuda.atomic.add``
into W1 / grad_rows (features repeat across rows); bias sums by column blocks with atomics.
``sparse_grad`` on the GPU needs the sorted unique features and, for each non-zero, its position
among them (``inv``): the backend computes both with ``xp.unique`` / ``xp.searchsorted``.
Launchers (``*_launch``) take a numba stream and never synchronise.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from xmc_engine.kernels._cuda import TPB, blocks_for, cuda, cuda_kernel, launch, rows_grid

_F0 = np.float32(0.0)


# ----------------------------------------------------------------------------------------- CPU
@njit(nogil=True, cache=True)
def batch_to_csc_cpu(indptr, indices, data, n_features):
    """Counting sort of the batch's non-zeros by feature.

    Returns ``rows`` (n_rows,) int64 sorted unique features, ``colptr`` (n_rows + 1,) int64,
    ``srow`` (nnz,) int64 batch row of each sorted non-zero, ``sval`` (nnz,) float32 its value.
    Within a feature, non-zeros keep batch-row order (deterministic sums).
    """
    nnz = indices.shape[0]
    n_batch = indptr.shape[0] - 1
    pos = np.zeros(n_features + 1, np.int64)
    for p in range(nnz):
        pos[indices[p] + 1] += 1
    n_rows = 0
    for f in range(n_features):
        if pos[f + 1] > 0:
            n_rows += 1
        pos[f + 1] += pos[f]
    rows = np.empty(n_rows, np.int64)
    colptr = np.empty(n_rows + 1, np.int64)
    u = 0
    for f in range(n_features):
        if pos[f + 1] > pos[f]:
            rows[u] = f
            colptr[u] = pos[f]
            u += 1
    colptr[n_rows] = nnz
    srow = np.empty(nnz, np.int64)
    sval = np.empty(nnz, np.float32)
    for i in range(n_batch):
        for p in range(indptr[i], indptr[i + 1]):
            q = pos[indices[p]]
            pos[indices[p]] = q + 1
            srow[q] = i
            sval[q] = data[p]
    return rows, colptr, srow, sval


@njit(nogil=True, cache=True)
def _column_sum_into(dZ1, out, alpha, beta):
    """out = beta * out + alpha * dZ1.sum(axis=0) (serial: B * n_hidden is small)."""
    n_hidden = dZ1.shape[1]
    acc = np.zeros(n_hidden, np.float32)
    for i in range(dZ1.shape[0]):
        for j in range(n_hidden):
            acc[j] += dZ1[i, j]
    for j in range(n_hidden):
        out[j] = beta * out[j] + alpha * acc[j]


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def _csc_update(W1, rows, colptr, srow, sval, dZ1, lr):
    n_hidden = W1.shape[1]
    for u in prange(rows.shape[0]):
        w = W1[rows[u]]
        q = colptr[u]
        qe = colptr[u + 1]
        while q + 4 <= qe:  # four batch rows per sweep of the W1 row (popular features)
            c0, c1, c2, c3 = lr * sval[q], lr * sval[q + 1], lr * sval[q + 2], lr * sval[q + 3]
            g0, g1, g2, g3 = dZ1[srow[q]], dZ1[srow[q + 1]], dZ1[srow[q + 2]], dZ1[srow[q + 3]]
            for j in range(n_hidden):
                w[j] -= (c0 * g0[j] + c1 * g1[j]) + (c2 * g2[j] + c3 * g3[j])
            q += 4
        while q < qe:
            c = lr * sval[q]
            g = dZ1[srow[q]]
            for j in range(n_hidden):
                w[j] -= c * g[j]
            q += 1


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def _csc_grad(colptr, srow, sval, dZ1, grad_rows):
    n_hidden = dZ1.shape[1]
    for u in prange(grad_rows.shape[0]):
        acc = grad_rows[u]
        for j in range(n_hidden):
            acc[j] = _F0
        for q in range(colptr[u], colptr[u + 1]):
            c = sval[q]
            g = dZ1[srow[q]]
            for j in range(n_hidden):
                acc[j] += c * g[j]


@njit(nogil=True, cache=True)
def sparse_backward_update_cpu(indptr, indices, data, dZ1, W1, b1, lr):
    """W1[f] -= lr * sum_i X[i, f] dZ1[i] for the batch's features f; b1 -= lr * sum_i dZ1[i]."""
    lr32 = np.float32(lr)
    rows, colptr, srow, sval = batch_to_csc_cpu(indptr, indices, data, W1.shape[0])
    _csc_update(W1, rows, colptr, srow, sval, dZ1, lr32)
    _column_sum_into(dZ1, b1, -lr32, np.float32(1.0))


@njit(nogil=True, cache=True)
def sparse_grad_cpu(indptr, indices, data, dZ1):
    """(rows int64 sorted unique, grad_rows (n_rows, n_hidden) f32, grad_b1 (n_hidden,) f32)."""
    n_features = 0
    for p in range(indices.shape[0]):
        if indices[p] + 1 > n_features:
            n_features = indices[p] + 1
    rows, colptr, srow, sval = batch_to_csc_cpu(indptr, indices, data, n_features)
    grad_rows = np.empty((rows.shape[0], dZ1.shape[1]), np.float32)
    _csc_grad(colptr, srow, sval, dZ1, grad_rows)
    grad_b1 = np.zeros(dZ1.shape[1], np.float32)
    _column_sum_into(dZ1, grad_b1, np.float32(1.0), np.float32(0.0))
    return rows, grad_rows, grad_b1


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def sparse_rows_update_cpu(W1, rows, grad_rows, lr):
    """W1[rows[u]] -= lr * grad_rows[u] (rows unique, so prange is conflict-free)."""
    lr32 = np.float32(lr)
    n_hidden = W1.shape[1]
    for u in prange(rows.shape[0]):
        w = W1[rows[u]]
        g = grad_rows[u]
        for j in range(n_hidden):
            w[j] -= lr32 * g[j]


@njit(nogil=True, cache=True, parallel=True)
def relu_backward_cpu(dH, H):
    """dH[H <= 0] = 0, in place (flattened prange)."""
    d = dH.reshape(-1)
    h = H.reshape(-1)
    for t in prange(d.shape[0]):
        if h[t] <= _F0:
            d[t] = _F0


# ----------------------------------------------------------------------------------------- GPU
@cuda_kernel
def sparse_backward_update_kernel(indptr, indices, data, dZ1, W1, neg_lr):
    n_rows = indptr.shape[0] - 1
    n_hidden = W1.shape[1]
    for i in range(cuda.blockIdx.x, n_rows, cuda.gridDim.x):
        for j in range(cuda.threadIdx.x, n_hidden, cuda.blockDim.x):
            g = neg_lr * dZ1[i, j]
            for p in range(indptr[i], indptr[i + 1]):
                cuda.atomic.add(W1, (indices[p], j), data[p] * g)


@cuda_kernel
def sparse_grad_kernel(indptr, inv, data, dZ1, grad_rows):
    n_rows = indptr.shape[0] - 1
    n_hidden = dZ1.shape[1]
    for i in range(cuda.blockIdx.x, n_rows, cuda.gridDim.x):
        for j in range(cuda.threadIdx.x, n_hidden, cuda.blockDim.x):
            g = dZ1[i, j]
            for p in range(indptr[i], indptr[i + 1]):
                cuda.atomic.add(grad_rows, (inv[p], j), data[p] * g)


@cuda_kernel
def column_sum_kernel(dZ1, out, alpha, rows_per_block):
    """out[j] += alpha * sum over this block's rows of dZ1[:, j] (atomics across row blocks)."""
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    n_rows = dZ1.shape[0]
    if j < dZ1.shape[1]:
        for r0 in range(cuda.blockIdx.y * rows_per_block, n_rows, cuda.gridDim.y * rows_per_block):
            acc = dZ1[r0, j] * 0
            for i in range(r0, min(r0 + rows_per_block, n_rows)):
                acc += dZ1[i, j]
            cuda.atomic.add(out, j, alpha * acc)


@cuda_kernel
def sparse_rows_update_kernel(W1, rows, grad_rows, neg_lr):
    n_hidden = W1.shape[1]
    for u in range(cuda.blockIdx.x, rows.shape[0], cuda.gridDim.x):
        f = rows[u]
        for j in range(cuda.threadIdx.x, n_hidden, cuda.blockDim.x):
            W1[f, j] += neg_lr * grad_rows[u, j]


@cuda_kernel
def relu_backward_kernel(dH, H):
    start, step = cuda.grid(1), cuda.gridsize(1)
    for t in range(start, dH.shape[0], step):
        if H[t] <= 0:
            dH[t] = 0


def _hidden_block(n_hidden):
    return min(128, max(32, 32 * ((n_hidden + 31) // 32)))


def column_sum_launch(dZ1, out, alpha, stream=0):
    """out += alpha * dZ1.sum(0) (``out`` must hold its start value, e.g. zeros)."""
    n_rows, n_hidden = dZ1.shape
    if n_rows == 0 or n_hidden == 0:
        return
    rows_per_block = 64
    gx = (n_hidden + TPB - 1) // TPB
    gy = max(1, min(1 if TPB == 32 else 1024, (n_rows + rows_per_block - 1) // rows_per_block))
    launch(column_sum_kernel, (gx, gy), TPB, stream, dZ1, out, np.float32(alpha),
           np.int64(rows_per_block))


def sparse_backward_update_launch(indptr, indices, data, dZ1, W1, b1, lr, stream=0):
    """Queue the W1 scatter (atomics) and the b1 update; never synchronises."""
    n_rows = indptr.shape[0] - 1
    if n_rows > 0:
        launch(sparse_backward_update_kernel, rows_grid(n_rows), _hidden_block(W1.shape[1]),
               stream, indptr, indices, data, dZ1, W1, np.float32(-lr))
    column_sum_launch(dZ1, b1, -lr, stream)


def sparse_grad_launch(indptr, inv, data, dZ1, grad_rows, grad_b1, stream=0):
    """grad_rows += X^T dZ1 restricted to the batch's features; grad_b1 += dZ1.sum(0).

    ``grad_rows`` (n_rows, n_hidden) and ``grad_b1`` must be zeroed by the caller; ``inv`` (nnz,)
    gives each non-zero's row in ``grad_rows`` (``searchsorted(rows, indices)``).
    """
    n_rows = indptr.shape[0] - 1
    if n_rows > 0 and grad_rows.shape[0] > 0:
        launch(sparse_grad_kernel, rows_grid(n_rows), _hidden_block(dZ1.shape[1]), stream,
               indptr, inv, data, dZ1, grad_rows)
    column_sum_launch(dZ1, grad_b1, 1.0, stream)


def sparse_rows_update_launch(W1, rows, grad_rows, lr, stream=0):
    """Queue ``W1[rows] -= lr * grad_rows``; never synchronises."""
    if rows.shape[0] > 0:
        launch(sparse_rows_update_kernel, rows_grid(rows.shape[0]), _hidden_block(W1.shape[1]),
               stream, W1, rows, grad_rows, np.float32(-lr))


def relu_backward_launch(dH, H, stream=0):
    """Queue ``dH[H <= 0] = 0`` (C-contiguous arrays, flattened); never synchronises."""
    d, h = dH.reshape(-1), H.reshape(-1)
    if d.shape[0] > 0:
        launch(relu_backward_kernel, blocks_for(d.shape[0]), TPB, stream, d, h)
