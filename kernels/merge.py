"""Model-merge arithmetic on flat parameter arrays (DESIGN.md §4: normalized merging, momentum,
EASGD / CROSSBOW elastic steps).

Arrays
------
arrays : list of n arrays, same shape, float32, C-contiguous    the replicas ``w_i`` (the flat
                                                                 loops' callers pass a
                                                                 Fortran-order array as its
                                                                 transpose, which is C order)
weights : (n,) float64 host array (or sequence)                  ``p_i``
out : same shape, float32                                        the result (may alias an input
                                                                 of ``momentum``, not of
                                                                 ``weighted_sum``)
wbar, z_prev, z_prev2 : same shape, float32                      merged model, last two centers
x, center, diff_out : same shape, float32                        replica, center, alpha (x - c)

Versions
--------
``*_cpu``      @njit, flattened prange loops (every array is viewed 1-D); the CPU only also has
               ``all_finite_cpu`` (the merge's NaN/inf check), ``copy_cpu`` (its broadcast) and
               the row-sparse pair ``merge_rows_cpu`` / ``copy_rows_cpu``, which merge and
               broadcast only the listed rows of ``W1`` (prange over rows), and the
               column-sparse pair ``merge_columns_cpu`` / ``copy_columns_cpu`` for the ``W2``
               columns a sampled output layer changed (prange over rows, listed columns; over
               the listed columns where ``W2`` is label-major, Fortran order); both
               merges can write the merged values back to the replicas in the same pass
               (``broadcast``), which the scheduler's sparse merge uses.
``*_kernel``   @cuda.jit grid-stride loops over the flattened arrays.
``weighted_sum`` over n replicas is applied pairwise on both sides (out = p0 w0, then
out += p_i w_i): n passes, no Python-level temporaries. Launchers never synchronise.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from xmc_engine.kernels._cuda import TPB, blocks_for, cuda, cuda_kernel, launch
from xmc_engine.kernels.sampled_output import label_major


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def axpby_cpu(out, x, a, b):
    """out = b * out + a * x (flattened); b == 0 ignores the old ``out``."""
    o = out.reshape(-1)
    v = x.reshape(-1)
    a32 = np.float32(a)
    b32 = np.float32(b)
    if b == 0.0:
        for t in prange(o.shape[0]):
            o[t] = a32 * v[t]
    else:
        for t in prange(o.shape[0]):
            o[t] = b32 * o[t] + a32 * v[t]


def weighted_sum_cpu(arrays, weights, out):
    """out = sum_i weights[i] * arrays[i] (``out`` must not alias an input)."""
    weights = np.asarray(weights, dtype=np.float64)
    if len(arrays) != len(weights) or len(arrays) == 0:
        raise ValueError(f"weighted_sum: {len(arrays)} arrays but {len(weights)} weights")
    for i, (a, w) in enumerate(zip(arrays, weights, strict=True)):
        axpby_cpu(out, a, float(w), 0.0 if i == 0 else 1.0)
    return out


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def momentum_cpu(wbar, z_prev, z_prev2, mu, out):
    """out = wbar + mu * (z_prev - z_prev2)."""
    o = out.reshape(-1)
    w = wbar.reshape(-1)
    z1 = z_prev.reshape(-1)
    z2 = z_prev2.reshape(-1)
    m = np.float32(mu)
    for t in prange(o.shape[0]):
        o[t] = w[t] + m * (z1[t] - z2[t])


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def elastic_cpu(x, center, alpha, diff_out):
    """diff_out = alpha * (x - center); x -= diff_out."""
    xv = x.reshape(-1)
    c = center.reshape(-1)
    d = diff_out.reshape(-1)
    a = np.float32(alpha)
    for t in prange(xv.shape[0]):
        dt = a * (xv[t] - c[t])
        d[t] = dt
        xv[t] -= dt


_EXP_MASK = np.uint32(0x7F800000)  # float32 exponent bits: all ones for NaN and +-inf


@njit(nogil=True, cache=True, parallel=True)
def all_finite_cpu(a):
    """True when no element of float32 ``a`` is NaN or infinite (one parallel read pass).

    Works on the bits: the largest exponent field seen is all ones only for NaN or +-inf. An
    integer max reduction vectorises (a float sum, kept exact, would wait on each add)."""
    v = a.reshape(-1).view(np.uint32)
    m = np.uint32(0)
    for t in prange(v.shape[0]):
        m = max(m, v[t] & _EXP_MASK)
    return m != _EXP_MASK


@njit(nogil=True, cache=True, parallel=True)
def copy_cpu(dst, src):
    """dst[...] = src (same shape, flattened; the merge's broadcast)."""
    d = dst.reshape(-1)
    v = src.reshape(-1)
    for t in prange(d.shape[0]):
        d[t] = v[t]


# Reassociation lets the row sums vectorise; no "nnan"/"ninf": the NaN/inf check must stay.
_REASSOC = {"reassoc", "contract", "arcp"}


@njit(nogil=True, cache=True, parallel=True, fastmath=_REASSOC)
def merge_rows_cpu(arrays, weights, rows, central, broadcast, norm):
    """Merge the listed rows of 2-D replicas into ``central``, in place (the row-sparse merge).

    ``central[r] = sum_i weights[i] * arrays[i][r]`` for every ``r`` in ``rows``; the other rows
    of ``central`` are left as they are. ``arrays`` is a tuple of float32 (n_rows, n_cols)
    arrays, ``weights`` float64 (len(arrays),), ``rows`` int64 (no repeats). With
    ``broadcast`` every merged row whose values are all finite is also written back to each
    replica (the merge's broadcast, while the row is in cache); a row with a non-finite value
    is left as it was in the replicas, so that the one that holds it can still be found.

    The passes over memory are what a merge costs, so none is made that cannot change a value:
    a replica of weight 0 is not read (its row is not in the sum; the per-row weights give 0 to
    the replicas that did not change the row, whose row is the central one), and where one
    replica has weight 1 and every other 0 (a row only that replica changed, under per-row
    weights) the merged row is that replica's row and is not written back to it. Without
    ``norm`` the old rows of ``central`` are not read either.

    Returns ``(finite, delta_sumsq)``: whether every merged value is finite (a NaN or infinity
    in a replica with a non-zero weight makes its merged value non-finite), and, with ``norm``,
    the change of ``sum(central**2)`` over those rows, accumulated in float64 (the merged
    model's L2 norm is kept up to date without reading the rows nobody changed); ``0.0``
    without it.
    """
    n = len(arrays)
    w = np.empty(n, np.float32)
    nonzero, last = 0, -1
    for i in range(n):
        w[i] = np.float32(weights[i])
        if w[i] != 0:
            nonzero += 1
            last = i
    # the replica whose row the merged row is (weight 1, every other 0): no write-back to it
    sole = last if nonzero == 1 and w[last] == 1 else -1
    cols = central.shape[1]
    delta = 0.0
    bad = 0
    for j in prange(rows.shape[0]):
        r = rows[j]
        out = central[r]
        old = 0.0
        if norm:
            for c in range(cols):
                old += np.float64(out[c]) * np.float64(out[c])
        first = True
        for i in range(n):
            wi = w[i]
            if wi == 0:
                continue
            a = arrays[i][r]
            if first:
                for c in range(cols):
                    out[c] = wi * a[c]
                first = False
            else:
                for c in range(cols):
                    out[c] += wi * a[c]
        if first:  # every weight 0
            for c in range(cols):
                out[c] = 0.0
        new = 0.0
        for c in range(cols):
            new += np.float64(out[c]) * np.float64(out[c])
        if norm:
            delta += new - old
        if not np.isfinite(new):  # a float32 square cannot overflow float64: NaN/inf only
            bad += 1
        elif broadcast:
            for i in range(n):
                if i == sole:
                    continue
                a = arrays[i][r]
                for c in range(cols):
                    a[c] = out[c]
    return bad == 0, delta


@njit(nogil=True, cache=True, parallel=True)
def copy_rows_cpu(dst, src, rows):
    """``dst[r] = src[r]`` for every ``r`` in ``rows`` (the row-sparse merge's broadcast, one
    replica at a time)."""
    cols = src.shape[1]
    for j in prange(rows.shape[0]):
        r = rows[j]
        for c in range(cols):
            dst[r, c] = src[r, c]


#: Columns per block of :func:`merge_columns_cpu`: a block is merged, checked and (with
#: ``broadcast``) written back while its cache lines are still in the core's cache.
COLUMN_BLOCK = 256


@njit(nogil=True, cache=True, inline="always")
def _merged_entry(arrays, weights, j, h, c):
    """``sum_i weights[i, j] * arrays[i][h, c]``, in the order of the replicas."""
    v = weights[0, j] * arrays[0][h, c]
    for i in range(1, len(arrays)):
        v += weights[i, j] * arrays[i][h, c]
    return v


@njit(nogil=True, cache=True, parallel=True, fastmath=_REASSOC)
def merge_columns_cpu(arrays, weights, cols, central, broadcast):
    """Merge the listed columns of 2-D replicas into ``central``, in place (the column-sparse
    merge of ``W2`` and, viewed as one row, ``b2``).

    ``central[h, cols[j]] = sum_i weights[i, j] * arrays[i][h, cols[j]]`` for every row ``h``;
    the other columns are left as they are. ``arrays`` is a tuple of float32 (n_rows, n_cols)
    C-order arrays, ``weights`` float32 (len(arrays), len(cols)): a weight per replica and
    column (equal columns for the paper's weights, renormalised ones per label), ``cols``
    int64 (no repeats). Returns whether every merged value is finite.

    One pass per row, in blocks of :data:`COLUMN_BLOCK` listed columns: each block is merged
    and checked, and with ``broadcast`` written back to every replica if all its values are
    finite (a block with a non-finite value stays as it was in the replicas). In ``W2``'s
    ``(hidden, labels)`` layout a listed column is one float per row, so a sparse column set
    touches most of every row's cache lines: merging and broadcasting in the same pass reads
    them once instead of once per replica and per pass (at the Amazon-670K shape, 6 % of the
    columns, two replicas: about half the time of the merge and two separate copies;
    ``bench/bench_w2_layout.py``).

    Where ``central`` is label-major (Fortran order: a column's entries adjacent, as the CPU
    replicas of the sampled layer hold ``W2``) the pass goes column by column instead, each
    column merged, checked and written back on its own (a column with a non-finite value
    stays as it was in the replicas).
    """
    n = len(arrays)
    m = cols.shape[0]
    bad = 0
    if label_major(central):  # a column's entries adjacent: one column per iteration
        for j in prange(m):
            c = cols[j]
            out = central[:, c]
            nb = 0
            for h in range(out.shape[0]):
                v = _merged_entry(arrays, weights, j, h, c)
                out[h] = v
                if not np.isfinite(v):
                    nb += 1
            if broadcast and nb == 0:
                for i in range(n):
                    a = arrays[i][:, c]
                    for h in range(out.shape[0]):
                        a[h] = out[h]
            bad += nb
        return bad == 0
    for h in prange(central.shape[0]):
        out = central[h]
        for j0 in range(0, m, COLUMN_BLOCK):
            j1 = min(j0 + COLUMN_BLOCK, m)
            nb = 0
            for j in range(j0, j1):
                c = cols[j]
                v = _merged_entry(arrays, weights, j, h, c)
                out[c] = v
                if not np.isfinite(v):
                    nb += 1
            if broadcast and nb == 0:
                for j in range(j0, j1):
                    c = cols[j]
                    v = out[c]
                    for i in range(n):
                        arrays[i][h, c] = v
            bad += nb
    return bad == 0


@njit(nogil=True, cache=True, parallel=True)
def copy_columns_cpu(dst, src, cols):
    """``dst[:, c] = src[:, c]`` for every ``c`` in ``cols`` (2-D: the column-sparse merge's
    broadcast; prange over the rows in C order, over the columns in Fortran order)."""
    if label_major(dst):
        for j in prange(cols.shape[0]):
            c = cols[j]
            for h in range(dst.shape[0]):
                dst[h, c] = src[h, c]
        return
    for h in prange(dst.shape[0]):
        d = dst[h]
        v = src[h]
        for j in range(cols.shape[0]):
            d[cols[j]] = v[cols[j]]


@cuda_kernel
def axpby_kernel(out, x, a, b):
    for t in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        if b == 0:
            out[t] = a * x[t]
        else:
            out[t] = b * out[t] + a * x[t]


@cuda_kernel
def momentum_kernel(wbar, z_prev, z_prev2, mu, out):
    for t in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        out[t] = wbar[t] + mu * (z_prev[t] - z_prev2[t])


@cuda_kernel
def elastic_kernel(x, center, alpha, diff_out):
    for t in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        d = alpha * (x[t] - center[t])
        diff_out[t] = d
        x[t] -= d


def _flat(a):
    return a.reshape(-1)


def weighted_sum_launch(arrays, weights, out, stream=0):
    """Queue out = sum_i weights[i] * arrays[i]; never synchronises."""
    weights = [float(w) for w in weights]
    if len(arrays) != len(weights) or len(arrays) == 0:
        raise ValueError(f"weighted_sum: {len(arrays)} arrays but {len(weights)} weights")
    o = _flat(out)
    if o.shape[0] == 0:
        return
    for i, (a, w) in enumerate(zip(arrays, weights, strict=True)):
        launch(axpby_kernel, blocks_for(o.shape[0]), TPB, stream, o, _flat(a), np.float32(w),
               np.float32(0.0 if i == 0 else 1.0))


def momentum_launch(wbar, z_prev, z_prev2, mu, out, stream=0):
    """Queue out = wbar + mu * (z_prev - z_prev2); never synchronises."""
    o = _flat(out)
    if o.shape[0]:
        launch(momentum_kernel, blocks_for(o.shape[0]), TPB, stream, _flat(wbar),
               _flat(z_prev), _flat(z_prev2), np.float32(mu), o)


def elastic_launch(x, center, alpha, diff_out, stream=0):
    """Queue diff_out = alpha (x - center); x -= diff_out; never synchronises."""
    xv = _flat(x)
    if xv.shape[0]:
        launch(elastic_kernel, blocks_for(xv.shape[0]), TPB, stream, xv, _flat(center),
               np.float32(alpha), _flat(diff_out))
