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
``sparse_forward_cpu``     @njit, prange over rows; each row gathers its W1 rows into an
                           L1-resident accumulator (an "embedding bag"), four non-zeros per
                           sweep, W1 rows prefetched 16 non-zeros ahead; b1 and ReLU fused.
``sparse_forward_kernel``  @cuda.jit, one block per row (grid-stride over rows), threads over the
                           hidden units: W1 row reads are coalesced across the block.
``sparse_forward_launch``  queues the kernel on a numba stream; never synchronises.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir as llvm_ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic
from xmc_engine.kernels._cuda import cuda, cuda_kernel, launch, rows_grid

_F0 = np.float32(0.0)


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Software prefetch (``llvm.prefetch``, read, high locality) of ``arr[idx]`` (1-D array)."""
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p = llvm_ir.IntType(8).as_pointer()
        i32 = llvm_ir.IntType(32)
        fnty = llvm_ir.FunctionType(llvm_ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), llvm_ir.Constant(i32, 0),
                          llvm_ir.Constant(i32, 3), llvm_ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


_AHEAD = 16  # prefetch the W1 rows of the non-zeros this far ahead


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def sparse_forward_cpu(indptr, indices, data, W1, b1, out):
    """out[i] = relu(b1 + sum_p data[p] * W1[indices[p]]) for every row i (in place).

    Four non-zeros per sweep of the (L1-resident) output row, and the W1 rows of the non-zeros
    ``_AHEAD`` positions later are prefetched: the gathers are the cost (uniform features miss
    the caches on every W1 row; a plain loop waits for each)."""
    n_rows = indptr.shape[0] - 1
    n_hidden = W1.shape[1]
    nnz = indices.shape[0]
    for i in prange(n_rows):
        acc = out[i]
        for j in range(n_hidden):
            acc[j] = b1[j]
        p = indptr[i]
        pe = indptr[i + 1]
        while p + 4 <= pe:
            for q in range(p + _AHEAD, min(p + _AHEAD + 4, nnz)):
                r = W1[indices[q]]
                for c in range(0, n_hidden, 16):  # one prefetch per 64-byte line
                    _prefetch(r, c)
            v0, v1, v2, v3 = data[p], data[p + 1], data[p + 2], data[p + 3]
            w0, w1 = W1[indices[p]], W1[indices[p + 1]]
            w2, w3 = W1[indices[p + 2]], W1[indices[p + 3]]
            for j in range(n_hidden):
                acc[j] += (v0 * w0[j] + v1 * w1[j]) + (v2 * w2[j] + v3 * w3[j])
            p += 4
        while p < pe:
            v = data[p]
            w = W1[indices[p]]
            for j in range(n_hidden):
                acc[j] += v * w[j]
            p += 1
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
