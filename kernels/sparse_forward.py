"""Sparse input layer forward: ``out = relu(X @ W1 + b1)`` with bias and ReLU fused (DESIGN.md §2).

Arrays
------
indptr : (B + 1,) int32 or int64          CSR row pointers of the batch X (B, n_features)
indices : (nnz,) int32 or int64           feature index of each non-zero, in [0, n_features)
data : (nnz,) float32                     value of each non-zero
W1 : (n_features, n_hidden) float32       C-contiguous
b1 : (n_hidden,) float32
out : (B, n_hidden) float32               C-contiguous, overwritten

All arrays live on the device of the version used (host for ``*_cpu``, GPU for the kernel).

Versions
--------
``sparse_forward_cpu``     @njit, prange over rows; each row gathers its W1 rows into a
                           register/L1-resident accumulator (an "embedding bag"), then adds b1
                           and applies ReLU while storing.
``sparse_forward_kernel``  @cuda.jit, one block per row (grid-stride over rows), threads over the
                           hidden units: W1 row reads are coalesced across the block.
``sparse_forward_launch``  queues the kernel on a numba stream; never synchronises.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from xmc_engine.kernels._cuda import cuda, cuda_kernel, launch, rows_grid

_F0 = np.float32(0.0)


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def sparse_forward_cpu(indptr, indices, data, W1, b1, out):
    """out[i] = relu(b1 + sum_p data[p] * W1[indices[p]]) for every row i (in place)."""
    n_rows = indptr.shape[0] - 1
    n_hidden = W1.shape[1]
    for i in prange(n_rows):
        acc = out[i]
        for j in range(n_hidden):
            acc[j] = b1[j]
        for p in range(indptr[i], indptr[i + 1]):
            v = data[p]
            w = W1[indices[p]]
            for j in range(n_hidden):
                acc[j] += v * w[j]
        for j in range(n_hidden):
            if acc[j] < _F0:
                acc[j] = _F0


@cuda_kernel
def sparse_forward_kernel(indptr, indices, data, W1, b1, out):
    n_rows = indptr.shape[0] - 1
    n_hidden = W1.shape[1]
    for i in range(cuda.blockIdx.x, n_rows, cuda.gridDim.x):
        start = indptr[i]
        stop = indptr[i + 1]
        for j in range(cuda.threadIdx.x, n_hidden, cuda.blockDim.x):
            acc = b1[j]
            for p in range(start, stop):
                acc += data[p] * W1[indices[p], j]
            out[i, j] = acc if acc > 0 else 0


def sparse_forward_launch(indptr, indices, data, W1, b1, out, stream=0):
    """Queue ``sparse_forward_kernel`` on ``stream`` (device arrays); never synchronises."""
    block = min(128, max(32, 32 * ((W1.shape[1] + 31) // 32)))
    launch(sparse_forward_kernel, rows_grid(out.shape[0]), block, stream,
           indptr, indices, data, W1, b1, out)
