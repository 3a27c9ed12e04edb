"""Top-k per row of a score matrix, and the merge of two top-k lists (label-chunked prediction).

Arrays
------
scores : (B, L) float32                   C-contiguous
idx_out : (B, k) int64                    column of each kept score, sorted by descending score
val_out : (B, k) float32                  the kept scores
idx_a, val_a : (B, ka), idx_b, val_b : (B, kb)   two sorted top lists (e.g. running and chunk)

Order: descending score, ties broken by the lower column index (the order of a stable argsort of
``-scores``, :func:`xmc_engine.kernels.reference.topk`). ``k`` is clipped to ``L`` by the caller
(``k <= L``); NaN scores are never selected.

Versions
--------
``topk_cpu``          @njit, prange over rows; per row an insertion buffer of size k (partial
                      selection: O(L + inserts * k), inserts ~ k log(L/k) for random scores).
``topk_kernel``       @cuda.jit, one block per row: every thread keeps its own top-k of a strided
                      slice of the row in a global scratch ``(grid, block, k)``, then thread 0
                      merges the block's candidates into the output.
``topk_merge_cpu`` / ``topk_merge_kernel``  merge two sorted lists per row (two pointers).
``topk_fold_cpu``     @njit(nogil), serial: folds one label chunk of logits, its bias added on
                      the fly, into each row's running list (the insertion of ``topk_cpu``);
                      chunks folded in label order give ``topk_cpu`` of the whole biased row,
                      in one pass (the chunked prediction's bias, top-k and merge were three,
                      each after a BLAS call). Not a parallel region: the CPU backend runs it
                      on blocks of rows from Python threads
                      (:meth:`xmc_engine.backends.cpu.CPUBackend.topk_fold`). After a numba
                      parallel region libgomp's workers spin for milliseconds on the cores the
                      next chunk's sgemm needs; measured at 670,091 labels, that made the
                      prediction 1.19x (chunks of 32,768) and 1.65-1.86x (8,192) slower
                      (``bench/bench_predict.py``).
Launchers take a numba stream and never synchronise.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from xmc_engine.kernels._cuda import TPB, blocks_for, cuda, cuda_kernel, launch, rows_grid


@njit(nogil=True, cache=True, inline="always")
def _better(v1, i1, v2, i2):
    return v1 > v2 or (v1 == v2 and i1 < i2)


@njit(nogil=True, cache=True, inline="always")
def _insert(vi, ii, n, v, label):
    """Insert the score ``v`` of ``label`` into the descending list ``vi`` / ``ii`` of ``n``
    entries (``k = len(vi)`` at most; the lowest falls off): ties keep the earlier (lower)
    label, NaN is never taken. Returns the new count."""
    k = vi.shape[0]
    if n == k and not v > vi[k - 1]:
        return n
    if v != v:  # NaN
        return n
    pos = n if n < k else k - 1
    while pos > 0 and v > vi[pos - 1]:
        vi[pos] = vi[pos - 1]
        ii[pos] = ii[pos - 1]
        pos -= 1
    vi[pos] = v
    ii[pos] = label
    return n + 1 if n < k else n


@njit(nogil=True, cache=True, parallel=True)
def topk_cpu(scores, k, idx_out, val_out):
    """Write the top ``k`` of every row of ``scores`` into ``idx_out``/``val_out`` (k <= L)."""
    n_rows, L = scores.shape
    for i in prange(n_rows):
        row = scores[i]
        vi = val_out[i, :k]
        ii = idx_out[i, :k]
        n = 0
        for j in range(L):
            n = _insert(vi, ii, n, row[j], j)


@njit(nogil=True, cache=True)
def topk_fold_cpu(scores, bias, offset, idx, val, filled):
    """Fold the chunk ``scores + bias`` (labels ``offset .. offset + C - 1``) into each row's
    running top list ``idx[i, :filled[i]]`` / ``val[i, :filled[i]]`` (descending, ``k =
    idx.shape[1]``); ``filled`` (int64, one per row, 0 before the first chunk) is updated.
    Serial; blocks of rows (row slices of ``scores``, ``idx``, ``val``, ``filled``) can run in
    parallel from several threads, since it releases the GIL."""
    n_rows, C = scores.shape
    for i in range(n_rows):
        row = scores[i]
        vi = val[i]
        ii = idx[i]
        n = filled[i]
        for j in range(C):
            n = _insert(vi, ii, n, row[j] + bias[j], offset + j)
        filled[i] = n


@njit(nogil=True, cache=True, parallel=True)
def topk_merge_cpu(idx_a, val_a, idx_b, val_b, idx_out, val_out):
    """Merge two descending lists per row into the first ``idx_out.shape[1]`` entries."""
    n_rows, k = idx_out.shape
    ka, kb = idx_a.shape[1], idx_b.shape[1]
    for i in prange(n_rows):
        a = 0
        b = 0
        for t in range(k):
            take_a = b >= kb or (
                a < ka and _better(val_a[i, a], idx_a[i, a], val_b[i, b], idx_b[i, b])
            )
            if take_a:
                idx_out[i, t] = idx_a[i, a]
                val_out[i, t] = val_a[i, a]
                a += 1
            else:
                idx_out[i, t] = idx_b[i, b]
                val_out[i, t] = val_b[i, b]
                b += 1


@cuda_kernel
def topk_kernel(scores, k, cand_idx, cand_val, idx_out, val_out):
    """cand_* : (gridDim.x, blockDim.x, k) scratch."""
    n_rows, L = scores.shape
    blk = cuda.blockIdx.x
    t = cuda.threadIdx.x
    for i in range(blk, n_rows, cuda.gridDim.x):
        # stage 1: top-k of columns t, t + blockDim, ... (sorted insertion in the scratch)
        n = 0
        for j in range(t, L, cuda.blockDim.x):
            v = scores[i, j]
            if v != v:
                continue
            if n == k and not (v > cand_val[blk, t, k - 1]):
                continue
            pos = n if n < k else k - 1
            while pos > 0 and v > cand_val[blk, t, pos - 1]:
                cand_val[blk, t, pos] = cand_val[blk, t, pos - 1]
                cand_idx[blk, t, pos] = cand_idx[blk, t, pos - 1]
                pos -= 1
            cand_val[blk, t, pos] = v
            cand_idx[blk, t, pos] = j
            if n < k:
                n += 1
        for q in range(n, k):  # unfilled slots (fewer than k columns for this thread)
            cand_idx[blk, t, q] = -1
        cuda.syncthreads()
        # stage 2: thread 0 merges the block's candidate lists (value desc, index asc)
        if t == 0:
            m = 0
            for s in range(cuda.blockDim.x):
                for q in range(k):
                    j = cand_idx[blk, s, q]
                    if j < 0:
                        break
                    v = cand_val[blk, s, q]
                    if m == k and not (v > val_out[i, k - 1] or
                                       (v == val_out[i, k - 1] and j < idx_out[i, k - 1])):
                        break
                    pos = m if m < k else k - 1
                    while pos > 0 and (v > val_out[i, pos - 1] or
                                       (v == val_out[i, pos - 1] and j < idx_out[i, pos - 1])):
                        val_out[i, pos] = val_out[i, pos - 1]
                        idx_out[i, pos] = idx_out[i, pos - 1]
                        pos -= 1
                    val_out[i, pos] = v
                    idx_out[i, pos] = j
                    if m < k:
                        m += 1
        cuda.syncthreads()


@cuda_kernel
def topk_merge_kernel(idx_a, val_a, idx_b, val_b, idx_out, val_out):
    n_rows, k = idx_out.shape
    ka = idx_a.shape[1]
    kb = idx_b.shape[1]
    for i in range(cuda.grid(1), n_rows, cuda.gridsize(1)):
        a = 0
        b = 0
        for t in range(k):
            take_a = b >= kb
            if not take_a and a < ka:
                va = val_a[i, a]
                vb = val_b[i, b]
                take_a = va > vb or (va == vb and idx_a[i, a] < idx_b[i, b])
            if take_a:
                idx_out[i, t] = idx_a[i, a]
                val_out[i, t] = val_a[i, a]
                a += 1
            else:
                idx_out[i, t] = idx_b[i, b]
                val_out[i, t] = val_b[i, b]
                b += 1


def topk_launch(scores, k, cand_idx, cand_val, idx_out, val_out, stream=0, block=None):
    """Queue ``topk_kernel``; ``cand_*`` are scratch arrays of shape (grid, block, k) that
    :func:`topk_scratch_shape` gives. Never synchronises."""
    grid, block = topk_scratch_shape(scores.shape[0], k, block)[:2]
    if scores.shape[0] > 0 and k > 0:
        launch(topk_kernel, grid, block, stream, scores, np.int64(k), cand_idx, cand_val,
               idx_out, val_out)


def topk_scratch_shape(n_rows, k, block=None):
    """(grid, block, k): the launch shape of ``topk_kernel`` and of its scratch arrays."""
    block = block or (TPB if TPB <= 128 else 128)
    return rows_grid(n_rows), block, k


def topk_merge_launch(idx_a, val_a, idx_b, val_b, idx_out, val_out, stream=0):
    """Queue ``topk_merge_kernel``; never synchronises."""
    if idx_out.shape[0] > 0:
        launch(topk_merge_kernel, blocks_for(idx_out.shape[0]), TPB, stream,
               idx_a, val_a, idx_b, val_b, idx_out, val_out)
