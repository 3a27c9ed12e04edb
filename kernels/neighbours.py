"""Neighbour votes at prediction (CPU only; :mod:`xmc_engine.neighbours` composes them).

Arrays
------
q_indptr, q_indices, q_data : CSR of B query rows (int64 / int32 / float32)
rt_indptr, rt_indices, rt_data : CSR of the reference rows' transpose, (n_features, n_ref):
                                 for each feature, the reference rows that have it and the value
sims : (B, n_ref) float32            C-contiguous; similarities of every query to every
                                     reference row
top_idx : (B, k) int64, top_sim : (B, k) float32   the k nearest reference rows of each query
                                     (as ``topk.topk_cpu`` writes them)
y_indptr, y_indices : CSR of the reference rows' labels (n_ref, n_labels), values 1
out : (B, n_labels) float32          C-contiguous; the votes are added into it

Versions
--------
``sparse_dot_rows_cpu``  @njit, prange over query rows: ``sims[i] = Q[i] @ R^T`` by
                         scattering each query non-zero over the reference rows of its feature
                         (the product SciPy's ``Q @ R.T`` computes, single-threaded, into a
                         sparse result that is nearly dense when the rows share common
                         features; here straight into the dense rows).
``vote_cpu``             @njit, prange over query rows: ``out[i, l] += scale * sum_j w_ij
                         [l in labels of top_idx[i, j]]``, ``w_ij = max(top_sim[i, j], 0) **
                         power`` normalised to sum 1 over ``j`` (a row whose similarities are all
                         <= 0 adds nothing).
``add_sigmoid_cpu``       @njit, prange over query rows: adds ``w * sigmoid(Z[i, l])`` to the
                         entries of ``out`` that hold a vote (``> 0``) and sets it on the
                         network's top labels ``top_idx[i]`` that hold none; every other entry
                         stays 0. Their blended score ``w * sigmoid(Z[i, l])`` is at most that
                         of each of the network's top labels, so the top of ``out`` is the
                         top of the whole blend, without a sigmoid of every logit.
References: ``reference.sparse_dot_rows``, ``reference.neighbour_vote``; ``add_sigmoid_cpu``
against the dense blend in ``tests/test_neighbours.py``.
"""

from __future__ import annotations

import math

from numba import njit, prange


@njit(nogil=True, cache=True, parallel=True)
def sparse_dot_rows_cpu(q_indptr, q_indices, q_data, rt_indptr, rt_indices, rt_data, sims):
    """``sims[i, r] = sum_f Q[i, f] R[r, f]`` for every query row ``i`` and reference row
    ``r`` (``sims`` is overwritten)."""
    for i in prange(sims.shape[0]):
        row = sims[i]
        row[:] = 0.0
        for p in range(q_indptr[i], q_indptr[i + 1]):
            f = q_indices[p]
            v = q_data[p]
            for q in range(rt_indptr[f], rt_indptr[f + 1]):
                row[rt_indices[q]] += v * rt_data[q]


@njit(nogil=True, cache=True, parallel=True)
def vote_cpu(top_idx, top_sim, power, y_indptr, y_indices, scale, out):
    """Add ``scale`` times each query row's similarity-weighted share of neighbours holding each
    label into ``out``."""
    k = top_idx.shape[1]
    for i in prange(top_idx.shape[0]):
        total = 0.0
        for j in range(k):
            s = top_sim[i, j]
            if s > 0:
                total += s ** power
        if total <= 0:
            continue
        for j in range(k):
            s = top_sim[i, j]
            if s <= 0:
                continue
            w = scale * s ** power / total
            r = top_idx[i, j]
            for p in range(y_indptr[r], y_indptr[r + 1]):
                out[i, y_indices[p]] += w


@njit(nogil=True, cache=True, parallel=True)
def add_sigmoid_cpu(Z, top_idx, w, out):
    """``out[i, l] += w * sigmoid(Z[i, l])`` where ``out[i, l] > 0`` or ``l`` is in
    ``top_idx[i]`` (the latter, where ``out[i, l]`` is 0, set rather than added)."""
    for i in prange(Z.shape[0]):
        row, z = out[i], Z[i]
        for j in range(row.shape[0]):
            if row[j] > 0:
                row[j] += w * 0.5 * (1.0 + math.tanh(0.5 * z[j]))
        for t in range(top_idx.shape[1]):
            j = top_idx[i, t]
            if row[j] <= 0:
                row[j] = w * 0.5 * (1.0 + math.tanh(0.5 * z[j]))
