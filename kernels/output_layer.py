"""Output layer: softmax cross-entropy vs ``y/|y|``, fused SGD step, top-k scores (DESIGN.md §2).

Arrays
------
Z : (B, L) float32                        logits, C-contiguous; turned into dZ in place
H : (B, n_hidden) float32                 hidden activations, C-contiguous
W2 : (n_hidden, L) float32                C-contiguous, updated in place by the step
b2 : (L,) float32                         updated in place by the step
y_indptr : (B + 1,) int32/int64           CSR row pointers of the batch's labels (no data)
y_indices : (n_pos,) int32/int64          label ids, unique within a row
dH_out : (B, n_hidden) float32            gradient w.r.t. H (computed with W2 BEFORE the update)
loss_rows : (B,) float64                  per-row loss (0 for rows without labels)
m, s, ysum : (B,) float32                 running row max, sum of exp(z - m), sum of true logits
lse : (B,) float32                        log-sum-exp of each row

Loss of row i with labels y_i: ``-(1/|y_i|) sum_{l in y_i} log softmax(z_i)_l``, and 0 (with a zero
gradient) when ``y_i`` is empty; ``dZ = scale * (softmax(Z) - y/|y|)``. The step functions use
``scale = 1/B`` (mean over all B rows of the batch), and return the summed, unscaled loss.

Versions
--------
``softmax_xent_cpu``     @njit, one parallel region, rows split into one contiguous block per
                         thread; per row (L2-resident) three vectorised sweeps: bias add +
                         lane-wise max (``_row_max_bias``), exp + sum (``exp_neg``: 2^t by a
                         degree-7 polynomial, 2^round(t) written into the exponent bits via an
                         int32 -> float32 bitcast intrinsic; rel. error < 1e-6 - numba has no
                         SVML here and libm's scalar expf costs ~9 ns/element), normalise +
                         per-thread column sums (for db2).
``softmax_xent_launch``  @cuda.jit, tiled over rows x label segments so that every SM is busy at
                         any batch size: (1) ``softmax_seg_stats_kernel``, one block per (label
                         segment of ``SOFTMAX_SEG`` labels, row): online max and sum of exp;
                         (2) ``softmax_row_finish_kernel``, one thread per row: merges its
                         segments into the log-sum-exp and the loss; (3)
                         ``softmax_grad_colsum_kernel``, one thread per label over a group of
                         ``SOFTMAX_GRAD_ROWS`` rows (coalesced): dZ in place and its column sum
                         (db2, one atomic per label and row group); (4)
                         ``softmax_positives_kernel``: ``- y/|y|`` on the true labels. Z is read
                         twice and written once. Shared-memory tree reductions, no warp
                         intrinsics, so it runs in the simulator.
``softmax_rowblock_launch``  the previous design (one block per row, three sweeps, and a separate
                         column-sum pass), kept for ``bench/gpu_check.py``'s comparison.
``softmax_chunk_stats_*`` / ``softmax_chunk_grad_*``  the two passes of the label-chunked path.
CPU helpers of the host-level output layer: ``sum_parts_cpu`` (per-thread column sums -> db2),
``axpy_serial_cpu`` / ``axpy_parallel_cpu``, ``add_bias_cpu``. The host-level step (GEMMs, label
chunks) lives in :mod:`xmc_engine.output_layer`, written once against the backend.
Launchers take a numba stream and never synchronise.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir as llvm_ir
from numba import float32 as nb_float32
from numba import int32 as nb_int32
from numba import njit, prange
from numba.extending import intrinsic
from xmc_engine.kernels._cuda import CUDASIM, MAX_BLOCKS, TPB, cuda, cuda_kernel, launch, rows_grid

_LOG2E = np.float32(1.4426950408889634)
_LN2 = 0.6931471805599453
# Taylor coefficients of 2^f = exp(f ln 2), f in [-0.5, 0.5]
_C1, _C2, _C3 = np.float32(_LN2), np.float32(_LN2**2 / 2), np.float32(_LN2**3 / 6)
_C4, _C5 = np.float32(_LN2**4 / 24), np.float32(_LN2**5 / 120)
_C6, _C7 = np.float32(_LN2**6 / 720), np.float32(_LN2**7 / 5040)
_TMIN = np.float32(-125.0)
_ONE = np.float32(1.0)
_HALF = np.float32(0.5)
_F0 = np.float32(0.0)
#: start value of running row maxima: "minus infinity" that stays finite (the kernels are compiled
#: with fastmath, which assumes finite values; -1e30 * log2(e) is still a finite float32)
RUNNING_MAX_START = np.float32(-1.0e30)
_SH = 256  # shared-memory reduction buffer (>= any block size used)
_NEG_INF = np.float32(-np.inf)
#: labels per block of the tiled softmax's statistics pass (16 per thread at 256 threads)
SOFTMAX_SEG = 64 if CUDASIM else 4096
#: rows per block of the tiled softmax's gradient pass (one column-sum atomic per label per group)
SOFTMAX_GRAD_ROWS = 4 if CUDASIM else 32


# ----------------------------------------------------------------------------------------- CPU
@intrinsic
def _f32_from_bits(typingctx, bits):
    """Reinterpret an int32 as a float32 (an LLVM bitcast: free, and vectorisable)."""
    sig = nb_float32(nb_int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_ir.FloatType())

    return sig, codegen


@njit(nogil=True, cache=True, fastmath=True)
def exp_neg(x):
    """exp(x) for float32 x <= 0 (x < -86.6 gives ~2^-125, not 0); rel. error < 1e-6.

    2^t with t = x log2(e) = r + f: r = round(t) by truncating t - 1/2 (t <= 0), 2^f by a degree-7
    polynomial on [-1/2, 1/2], 2^r by writing r + 127 into the exponent bits. Only float32 and
    int32 operations and a bitcast: a loop of these vectorises (no SVML needed)."""
    t = max(x * _LOG2E, _TMIN)
    ri = np.int32(t - _HALF)
    f = t - nb_float32(ri)
    p = _C7
    p = p * f + _C6
    p = p * f + _C5
    p = p * f + _C4
    p = p * f + _C3
    p = p * f + _C2
    p = p * f + _C1
    p = p * f + _ONE
    return p * _f32_from_bits(np.int32((ri + np.int32(127)) << np.int32(23)))


@njit(nogil=True, cache=True, fastmath=True)
def _exp_row(z, m):
    """z[j] = exp(z[j] - m) for z <= m (in place); returns the sum (one vectorised loop)."""
    s = _F0
    for j in range(z.shape[0]):
        e = exp_neg(z[j] - m)
        z[j] = e
        s += e
    return s


@njit(nogil=True, cache=True, fastmath=True)
def fill_zero(a):
    """``a[:] = 0`` for a 1-D float32 array (a row of dZ, a part of the column sums) inside
    the kernels' parallel regions."""
    for j in range(a.shape[0]):
        a[j] = _F0


_LANES = 64  # independent running maxima: LLVM does not vectorise a max reduction itself


@njit(nogil=True, cache=True, fastmath=True)
def _row_max_bias(z, bias, use_bias, lanes):
    """Adds ``bias`` to ``z`` in place when ``use_bias``; returns max(z) (float32).

    ``lanes`` (>= _LANES,) float32 scratch: a max per lane over blocks of _LANES, an elementwise
    loop that vectorises (a plain ``m = max(m, z[j])`` compiles to scalar ``maxss``: 3 ns/el)."""
    n = z.shape[0]
    nf = n - n % _LANES
    for k in range(_LANES):
        lanes[k] = RUNNING_MAX_START
    if use_bias:
        for j0 in range(0, nf, _LANES):
            for k in range(_LANES):
                v = z[j0 + k] + bias[j0 + k]
                z[j0 + k] = v
                lanes[k] = max(v, lanes[k])
    else:
        for j0 in range(0, nf, _LANES):
            for k in range(_LANES):
                lanes[k] = max(z[j0 + k], lanes[k])
    m = RUNNING_MAX_START
    for k in range(_LANES):
        m = max(lanes[k], m)
    for j in range(nf, n):
        if use_bias:
            z[j] += bias[j]
        m = max(z[j], m)
    return m


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def softmax_xent_fused_cpu(Z, bias, use_bias, y_indptr, y_indices, scale, loss_rows, colsum_parts):
    """Z (+ bias) -> dZ in place; loss_rows[i] = loss of row i.

    ``colsum_parts`` (n_parts, L) or (n_parts, 0): when it has columns, part t receives the
    column sums of dZ over the t-th block of rows (sum the parts for db2).

    One parallel region; thread t owns rows [t B / n_parts, (t + 1) B / n_parts) and makes three
    vectorised sweeps over each row while it sits in L2 (120 KB for L = 30,000): bias add + max,
    exp + sum, normalise + column sum.
    """
    B, L = Z.shape
    n_parts = colsum_parts.shape[0]
    want_colsum = colsum_parts.shape[1] > 0
    scale32 = nb_float32(scale)
    for t in prange(n_parts):
        lanes = np.empty(_LANES, np.float32)
        part = colsum_parts[t]
        if want_colsum:
            fill_zero(part)
        for i in range(t * B // n_parts, (t + 1) * B // n_parts):
            z = Z[i]
            p0, p1 = y_indptr[i], y_indptr[i + 1]
            if p1 == p0:
                fill_zero(z)
                loss_rows[i] = 0.0
                continue
            m = _row_max_bias(z, bias, use_bias, lanes)
            ysum = 0.0
            for p in range(p0, p1):
                ysum += z[y_indices[p]]
            s = _exp_row(z, m)
            loss_rows[i] = m + math.log(s) - ysum / (p1 - p0)
            c = scale32 / s
            if want_colsum:
                for j in range(L):
                    v = z[j] * c
                    z[j] = v
                    part[j] += v
            else:
                for j in range(L):
                    z[j] *= c
            g = scale32 / nb_float32(p1 - p0)
            for p in range(p0, p1):
                z[y_indices[p]] -= g
                if want_colsum:
                    part[y_indices[p]] -= g


@njit(nogil=True, cache=True)
def softmax_xent_cpu(Z, y_indptr, y_indices, scale):
    """Z -> scale * (softmax(Z) - y/|y|) in place; returns the summed (unscaled) loss."""
    loss_rows = np.empty(Z.shape[0], np.float64)
    # row blocks for prange (no column sums); numba.get_num_threads() here would stop caching
    parts = np.empty((max(1, min(64, Z.shape[0])), 0), np.float32)
    softmax_xent_fused_cpu(Z, np.empty(0, np.float32), False, y_indptr, y_indices, scale,
                           loss_rows, parts)
    return loss_rows.sum()


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def softmax_chunk_stats_cpu(Zc, bias_c, c0, y_indptr, y_indices, m, s, ysum, n_parts):
    """Pass 1 of the chunked path on the logits ``Zc`` (B, C) of labels [c0, c0 + C).

    Adds the bias, gathers the true logits of the chunk into ``ysum``, folds the chunk into the
    running max ``m`` and sum ``s`` (online softmax). ``Zc`` is clobbered. One parallel region
    over ``n_parts`` row blocks. ``m`` starts at a very negative finite value (not -inf:
    fastmath assumes finite values), ``s`` and ``ysum`` at 0.
    """
    B, C = Zc.shape
    for t in prange(n_parts):
        lanes = np.empty(_LANES, np.float32)
        for i in range(t * B // n_parts, (t + 1) * B // n_parts):
            z = Zc[i]
            mc = _row_max_bias(z, bias_c, True, lanes)
            for p in range(y_indptr[i], y_indptr[i + 1]):
                lab = y_indices[p] - c0
                if lab >= 0 and lab < C:
                    ysum[i] += z[lab]
            if mc > m[i]:
                s[i] = s[i] * exp_neg(m[i] - mc) + _exp_row(z, mc)
                m[i] = mc
            else:
                s[i] += _exp_row(z, m[i])


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def softmax_chunk_grad_cpu(Zc, bias_c, c0, y_indptr, y_indices, lse, scale, colsum_parts):
    """Pass 2: recomputed logits ``Zc`` -> dZ chunk in place; per-part column sums for db2.

    One parallel region, one sweep per row: bias add, exp(z - lse), scale, column sum."""
    B, C = Zc.shape
    n_parts = colsum_parts.shape[0]
    scale32 = nb_float32(scale)
    for t in prange(n_parts):
        part = colsum_parts[t]
        fill_zero(part)
        for i in range(t * B // n_parts, (t + 1) * B // n_parts):
            z = Zc[i]
            p0, p1 = y_indptr[i], y_indptr[i + 1]
            if p1 == p0:
                fill_zero(z)
                continue
            li = lse[i]
            for j in range(C):
                e = scale32 * exp_neg(min(z[j] + bias_c[j] - li, _F0))
                z[j] = e
                part[j] += e
            g = scale32 / nb_float32(p1 - p0)
            for p in range(p0, p1):
                lab = y_indices[p] - c0
                if lab >= 0 and lab < C:
                    z[lab] -= g
                    part[lab] -= g


@njit(nogil=True, cache=True)
def chunk_loss_cpu(m, s, ysum, y_indptr, lse):
    """lse = m + log s; returns sum over labelled rows of lse - ysum / |y|."""
    total = 0.0
    for i in range(m.shape[0]):
        lse[i] = m[i] + np.float32(math.log(s[i]))
        ny = y_indptr[i + 1] - y_indptr[i]
        if ny > 0:
            total += lse[i] - ysum[i] / ny
    return total


@njit(nogil=True, cache=True, fastmath=True)
def sum_parts_cpu(parts, out, alpha, beta):
    """out = beta * out + alpha * parts.sum(0) (serial: a few parts of one row each).

    ``beta == 0`` never reads ``out`` (it may be uninitialised: 0 * NaN is NaN)."""
    for j in range(out.shape[0]):
        acc = np.float32(0.0)
        for t in range(parts.shape[0]):
            acc += parts[t, j]
        if beta == 0.0:
            out[j] = alpha * acc
        else:
            out[j] = beta * out[j] + alpha * acc


@njit(nogil=True, cache=True, parallel=True, fastmath=True)
def axpy_parallel_cpu(Y, X, alpha):
    """Y += alpha * X (Y may be a strided view)."""
    a32 = np.float32(alpha)
    for i in prange(Y.shape[0]):
        for j in range(Y.shape[1]):
            Y[i, j] += a32 * X[i, j]


@njit(nogil=True, cache=True, fastmath=True)
def axpy_serial_cpu(Y, X, alpha):
    """Y += alpha * X, 1-D or 2-D, serial (small arrays: a parallel region costs more)."""
    a32 = np.float32(alpha)
    for i in np.ndindex(Y.shape):
        Y[i] += a32 * X[i]


#: below this many elements, CPU helpers run serially (one parallel region costs ~10-50 us,
#: and a full OS time slice when the cores are oversubscribed)
SERIAL_BELOW = 1 << 16


@njit(nogil=True, cache=True, parallel=True)
def add_bias_cpu(Z, b):
    """Z += b on every row (parallel over rows)."""
    for i in prange(Z.shape[0]):
        for j in range(Z.shape[1]):
            Z[i, j] += b[j]


# ----------------------------------------------------------------------------------------- GPU
@cuda_kernel
def softmax_rowblock_kernel(Z, bias, use_bias, y_indptr, y_indices, scale, loss_rows):
    """The previous softmax: one block per row (grid-stride); block size a power of two <= _SH."""
    sh = cuda.shared.array(_SH, nb_float32)
    B, L = Z.shape
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for i in range(cuda.blockIdx.x, B, cuda.gridDim.x):
        p0 = y_indptr[i]
        p1 = y_indptr[i + 1]
        lm = -math.inf
        for j in range(t, L, nt):
            v = Z[i, j]
            if use_bias:
                v += bias[j]
                Z[i, j] = v
            lm = max(lm, v)
        sh[t] = lm
        cuda.syncthreads()
        st = nt // 2
        while st > 0:
            if t < st:
                sh[t] = max(sh[t], sh[t + st])
            cuda.syncthreads()
            st //= 2
        m = sh[0]
        cuda.syncthreads()
        ls = nb_float32(0.0)
        for j in range(t, L, nt):
            ls += math.exp(Z[i, j] - m)
        sh[t] = ls
        cuda.syncthreads()
        st = nt // 2
        while st > 0:
            if t < st:
                sh[t] += sh[t + st]
            cuda.syncthreads()
            st //= 2
        s = sh[0]
        cuda.syncthreads()
        if t == 0:
            ysum = 0.0
            for p in range(p0, p1):
                ysum += Z[i, y_indices[p]]
            loss_rows[i] = m + math.log(s) - ysum / (p1 - p0) if p1 > p0 else 0.0
        cuda.syncthreads()  # the true logits are read before the row is overwritten
        c = scale / s if p1 > p0 else nb_float32(0.0)
        for j in range(t, L, nt):
            Z[i, j] = c * math.exp(Z[i, j] - m)
        cuda.syncthreads()
        if p1 > p0:
            g = scale / (p1 - p0)
            for p in range(p0 + t, p1, nt):
                Z[i, y_indices[p]] -= g
        cuda.syncthreads()


@cuda_kernel
def softmax_seg_stats_kernel(Z, bias, use_bias, seg, pm, ps):
    """Pass 1: block (segment g, row i) -> ``pm[i, g]``, ``ps[i, g]``: max and sum of
    ``exp(z - max)`` over row i's labels ``[g seg, (g + 1) seg)`` (+ bias). Each thread keeps an
    online (max, sum) pair over four elements at a time (one exp per element); the block merges
    the pairs in shared memory."""
    shm = cuda.shared.array(_SH, nb_float32)
    shs = cuda.shared.array(_SH, nb_float32)
    B, L = Z.shape
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    n_seg = pm.shape[1]
    for i in range(cuda.blockIdx.y, B, cuda.gridDim.y):
        for g in range(cuda.blockIdx.x, n_seg, cuda.gridDim.x):
            m = _NEG_INF
            s = nb_float32(0.0)
            end = min(L, (g + 1) * seg)
            for j in range(g * seg + t, end, 4 * nt):
                # four independent loads in flight per thread before any arithmetic (one at a
                # time left the pass at about a quarter of the memory bandwidth)
                v0 = Z[i, j]
                v1 = Z[i, j + nt] if j + nt < end else _NEG_INF
                v2 = Z[i, j + 2 * nt] if j + 2 * nt < end else _NEG_INF
                v3 = Z[i, j + 3 * nt] if j + 3 * nt < end else _NEG_INF
                if use_bias:
                    v0 += bias[j]
                    if j + nt < end:
                        v1 += bias[j + nt]
                    if j + 2 * nt < end:
                        v2 += bias[j + 2 * nt]
                    if j + 3 * nt < end:
                        v3 += bias[j + 3 * nt]
                mv = max(max(v0, v1), max(v2, v3))
                if mv > m:  # exp(-inf) is 0 on the first elements
                    s = s * math.exp(m - mv)
                    m = mv
                s += (math.exp(v0 - m) + math.exp(v1 - m)) + (math.exp(v2 - m) + math.exp(v3 - m))
            shm[t] = m
            shs[t] = s
            cuda.syncthreads()
            st = nt // 2
            while st > 0:
                if t < st and shs[t + st] > 0:
                    m1, s1, m2, s2 = shm[t], shs[t], shm[t + st], shs[t + st]
                    if s1 == 0:
                        shm[t] = m2
                        shs[t] = s2
                    elif m1 >= m2:
                        shs[t] = s1 + s2 * math.exp(m2 - m1)
                    else:
                        shm[t] = m2
                        shs[t] = s2 + s1 * math.exp(m1 - m2)
                cuda.syncthreads()
                st //= 2
            if t == 0:
                pm[i, g] = shm[0]
                ps[i, g] = shs[0]
            cuda.syncthreads()


@cuda_kernel
def softmax_row_finish_kernel(Z, bias, use_bias, y_indptr, y_indices, scale, pm, ps, lse, rowc,
                              loss_rows):
    """Pass 2, one thread per row: merge the row's segments into ``lse[i]``; the loss
    ``lse - mean of the true logits`` (0 without labels); ``rowc[i]`` = ``scale``, or 0 for a
    row without labels (its gradient is zero)."""
    B = Z.shape[0]
    for i in range(cuda.grid(1), B, cuda.gridsize(1)):
        m = _NEG_INF
        s = nb_float32(0.0)
        for g in range(pm.shape[1]):
            m2 = pm[i, g]
            s2 = ps[i, g]
            if s2 > 0:
                if s == 0:
                    m = m2
                    s = s2
                elif m >= m2:
                    s += s2 * math.exp(m2 - m)
                else:
                    s = s2 + s * math.exp(m - m2)
                    m = m2
        lse_i = m + math.log(s)
        lse[i] = lse_i
        p0 = y_indptr[i]
        p1 = y_indptr[i + 1]
        ysum = 0.0
        for p in range(p0, p1):
            y = y_indices[p]
            v = Z[i, y]
            if use_bias:
                v += bias[y]
            ysum += v
        if p1 > p0:
            loss_rows[i] = lse_i - ysum / (p1 - p0)
            rowc[i] = scale
        else:
            loss_rows[i] = 0.0
            rowc[i] = 0.0


@cuda_kernel
def softmax_grad_colsum_kernel(Z, bias, use_bias, lse, rowc, rows_per_block, colsum, want_colsum):
    """Pass 3: thread = label j, block row = a group of ``rows_per_block`` rows:
    ``Z[i, j] = rowc[i] exp(Z[i, j] + bias[j] - lse[i])`` (coalesced along j), and the group's
    sum into ``colsum[j]`` (one atomic)."""
    B, L = Z.shape
    for j in range(cuda.grid(1), L, cuda.gridsize(1)):
        bj = bias[j] if use_bias else nb_float32(0.0)
        for r0 in range(cuda.blockIdx.y * rows_per_block, B, cuda.gridDim.y * rows_per_block):
            r1 = min(r0 + rows_per_block, B)
            acc = nb_float32(0.0)
            i = r0
            while i + 4 <= r1:  # four rows' loads in flight before the first store
                z0 = Z[i, j]
                z1 = Z[i + 1, j]
                z2 = Z[i + 2, j]
                z3 = Z[i + 3, j]
                c0, c1, c2, c3 = rowc[i], rowc[i + 1], rowc[i + 2], rowc[i + 3]
                v0 = c0 * math.exp(z0 + bj - lse[i]) if c0 != 0 else nb_float32(0.0)
                v1 = c1 * math.exp(z1 + bj - lse[i + 1]) if c1 != 0 else nb_float32(0.0)
                v2 = c2 * math.exp(z2 + bj - lse[i + 2]) if c2 != 0 else nb_float32(0.0)
                v3 = c3 * math.exp(z3 + bj - lse[i + 3]) if c3 != 0 else nb_float32(0.0)
                Z[i, j] = v0
                Z[i + 1, j] = v1
                Z[i + 2, j] = v2
                Z[i + 3, j] = v3
                acc += (v0 + v1) + (v2 + v3)
                i += 4
            while i < r1:
                c = rowc[i]
                v = c * math.exp(Z[i, j] + bj - lse[i]) if c != 0 else nb_float32(0.0)
                Z[i, j] = v
                acc += v
                i += 1
            if want_colsum:
                cuda.atomic.add(colsum, j, acc)


@cuda_kernel
def softmax_positives_kernel(Z, y_indptr, y_indices, scale, colsum, want_colsum):
    """Pass 4, one thread per row: ``- scale / |y|`` on the row's true labels (and in
    ``colsum``)."""
    B = Z.shape[0]
    for i in range(cuda.grid(1), B, cuda.gridsize(1)):
        p0 = y_indptr[i]
        p1 = y_indptr[i + 1]
        if p1 > p0:
            g = scale / nb_float32(p1 - p0)
            for p in range(p0, p1):
                y = y_indices[p]
                Z[i, y] -= g
                if want_colsum:
                    cuda.atomic.add(colsum, y, -g)


@cuda_kernel
def softmax_chunk_stats_kernel(Zc, bias_c, c0, y_indptr, y_indices, m, s, ysum):
    sh = cuda.shared.array(_SH, nb_float32)
    B, C = Zc.shape
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for i in range(cuda.blockIdx.x, B, cuda.gridDim.x):
        lm = -math.inf
        for j in range(t, C, nt):
            v = Zc[i, j] + bias_c[j]
            Zc[i, j] = v
            lm = max(lm, v)
        sh[t] = lm
        cuda.syncthreads()
        st = nt // 2
        while st > 0:
            if t < st:
                sh[t] = max(sh[t], sh[t + st])
            cuda.syncthreads()
            st //= 2
        mc = max(sh[0], m[i])
        cuda.syncthreads()
        ls = nb_float32(0.0)
        for j in range(t, C, nt):
            ls += math.exp(Zc[i, j] - mc)
        sh[t] = ls
        cuda.syncthreads()
        st = nt // 2
        while st > 0:
            if t < st:
                sh[t] += sh[t + st]
            cuda.syncthreads()
            st //= 2
        if t == 0:
            acc = nb_float32(0.0)
            for p in range(y_indptr[i], y_indptr[i + 1]):
                lab = y_indices[p] - c0
                if lab >= 0 and lab < C:
                    acc += Zc[i, lab]
            ysum[i] += acc
            s[i] = s[i] * math.exp(m[i] - mc) + sh[0]
            m[i] = mc
        cuda.syncthreads()


@cuda_kernel
def softmax_chunk_grad_kernel(Zc, bias_c, c0, y_indptr, y_indices, lse, scale):
    B, C = Zc.shape
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for i in range(cuda.blockIdx.x, B, cuda.gridDim.x):
        p0 = y_indptr[i]
        p1 = y_indptr[i + 1]
        c = scale if p1 > p0 else nb_float32(0.0)
        for j in range(t, C, nt):
            Zc[i, j] = c * math.exp(Zc[i, j] + bias_c[j] - lse[i])
        cuda.syncthreads()
        if p1 > p0:
            g = scale / (p1 - p0)
            for p in range(p0 + t, p1, nt):
                lab = y_indices[p] - c0
                if lab >= 0 and lab < C:
                    Zc[i, lab] -= g
        cuda.syncthreads()


def _row_block():
    return TPB if TPB <= 256 else 256


def softmax_rowblock_launch(Z, y_indptr, y_indices, scale, loss_rows, stream=0, bias=None):
    """The previous design, for the GPU check's comparison: ``softmax_rowblock_kernel`` (adds
    ``bias`` into Z first when given); per-row losses into ``loss_rows``. Never synchronises."""
    if Z.shape[0] == 0:
        return
    use_bias = bias is not None
    if bias is None:
        bias = Z[0, :1]  # unused placeholder of the right dtype
    launch(softmax_rowblock_kernel, rows_grid(Z.shape[0]), _row_block(), stream, Z, bias,
           use_bias, y_indptr, y_indices, np.float32(scale), loss_rows)


def softmax_work_size(B: int, L: int, seg: int | None = None) -> int:
    """float32 elements of the scratch ``work`` of :func:`softmax_xent_launch`."""
    n_seg = -(-int(L) // int(seg or SOFTMAX_SEG))
    return 2 * int(B) * n_seg + 2 * int(B)


def softmax_xent_launch(Z, y_indptr, y_indices, scale, loss_rows, work, colsum, stream=0,
                        bias=None, seg=None):
    """Queue the tiled softmax cross-entropy (module docstring): ``Z (+ bias)`` -> ``dZ =
    scale * (softmax - y/|y|)`` in place, per-row losses into ``loss_rows`` (B,) float64, and,
    when ``colsum`` is not None, ``colsum += dZ.sum(0)`` (the caller zeroes it for db2).

    ``work`` is float32 scratch of :func:`softmax_work_size` elements (the backend's workspace:
    nothing is allocated here); ``seg`` overrides :data:`SOFTMAX_SEG` (tests). Never
    synchronises."""
    B, L = Z.shape
    if B == 0:
        return
    seg = int(seg or SOFTMAX_SEG)
    n_seg = -(-L // seg)
    if work.shape[0] < softmax_work_size(B, L, seg):
        raise ValueError(f"softmax work has {work.shape[0]} elements, needs "
                         f"{softmax_work_size(B, L, seg)} for B={B}, L={L}")
    pm = work[: B * n_seg].reshape(B, n_seg)
    ps = work[B * n_seg: 2 * B * n_seg].reshape(B, n_seg)
    lse = work[2 * B * n_seg: 2 * B * n_seg + B]
    rowc = work[2 * B * n_seg + B: 2 * B * n_seg + 2 * B]
    use_bias = bias is not None
    if bias is None:
        bias = lse  # unused placeholder of the right dtype
    want_colsum = colsum is not None
    if colsum is None:
        colsum = lse  # unused placeholder
    scale = np.float32(scale)
    grid_y = min(B, MAX_BLOCKS)
    if n_seg > 0:
        launch(softmax_seg_stats_kernel, (min(n_seg, MAX_BLOCKS), grid_y), _row_block(), stream,
               Z, bias, use_bias, np.int64(seg), pm, ps)
    launch(softmax_row_finish_kernel, max(1, min(MAX_BLOCKS, -(-B // TPB))), TPB, stream, Z,
           bias, use_bias, y_indptr, y_indices, scale, pm, ps, lse, rowc, loss_rows)
    if L > 0:
        rpb = SOFTMAX_GRAD_ROWS
        launch(softmax_grad_colsum_kernel,
               (max(1, min(MAX_BLOCKS, -(-L // TPB))), max(1, min(MAX_BLOCKS, -(-B // rpb)))),
               TPB, stream, Z, bias, use_bias, lse, rowc, np.int64(rpb), colsum, want_colsum)
    launch(softmax_positives_kernel, max(1, min(MAX_BLOCKS, -(-B // TPB))), TPB, stream, Z,
           y_indptr, y_indices, scale, colsum, want_colsum)


def softmax_chunk_stats_launch(Zc, bias_c, c0, y_indptr, y_indices, m, s, ysum, stream=0):
    """Queue pass 1 of the chunked path (``m`` starts at -inf, ``s`` and ``ysum`` at 0)."""
    if Zc.shape[0] > 0:
        launch(softmax_chunk_stats_kernel, rows_grid(Zc.shape[0]), _row_block(), stream,
               Zc, bias_c, np.int64(c0), y_indptr, y_indices, m, s, ysum)


def softmax_chunk_grad_launch(Zc, bias_c, c0, y_indptr, y_indices, lse, scale, stream=0):
    """Queue pass 2 of the chunked path: recomputed logits -> dZ chunk in place."""
    if Zc.shape[0] > 0:
        launch(softmax_chunk_grad_kernel, rows_grid(Zc.shape[0]), _row_block(), stream,
               Zc, bias_c, np.int64(c0), y_indptr, y_indices, lse, np.float32(scale))
