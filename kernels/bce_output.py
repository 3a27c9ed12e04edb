"""Output layer with one-vs-all logistic loss: ``dZ = scale * w * (sigmoid(Z) - Y)`` (DESIGN.md §2).

The other loss of the output layer (``TrainConfig.loss="bce"``; the softmax one is in
:mod:`xmc_engine.kernels.output_layer`): every label is its own binary problem, so a row's
positives do not compete for one unit of probability as they do under the softmax against
``y/|y|``.

Arrays
------
Z : (B, C) float32                        logits of labels [c0, c0 + C), C-contiguous rows; turned
                                          into dZ in place
bias : (C,) float32                       added to Z first when ``use_bias``
colw : (C,) float32 or (0,)               per-column weight of loss and gradient (length 0: all 1);
                                          the sampled layer's ``1 / P(drawn)`` of its negatives
y_indptr : (B + 1,) int32/int64           CSR row pointers of the batch's labels (no data)
y_indices : (n_pos,) int32/int64          label ids (all labels, not chunk positions), unique
                                          within a row; ids outside [c0, c0 + C) are skipped
loss_rows : (B,) float64                  the row's loss over these labels is ADDED (the chunked
                                          path sums its chunks; zero it first)
colsum_parts : (n_parts, C) float32       part t receives the column sums of dZ over the t-th
                                          block of rows (sum the parts for db2)
loss_sum : (1,) float64                   CUDA: the batch's loss over these labels is added
colsum : (C,) float32                     CUDA: dZ's column sums are added (zero it first)

Loss of row i with labels ``y_i``: ``sum_j w_j (softplus(z_ij) - [j in y_i] z_ij)``, and 0 (with a
zero gradient) when ``y_i`` is empty, as for the softmax; the step functions use ``scale = 1/B``.
``softplus(z) = max(z, 0) + log(1 + exp(-|z|))``.

Versions
--------
``bce_fused_cpu``  @njit, one parallel region over row blocks; per row one vectorised sweep
                   (bias add, ``exp(-|z|)`` by :func:`~xmc_engine.kernels.output_layer.exp_neg`,
                   sigmoid, ``log(1 + e)`` by a short series (:func:`_log1p_unit`), column sum).
``bce_launch``     @cuda.jit, three kernels: (1) ``bce_positives_kernel``, one thread per row:
                   subtracts the weighted true logits from the loss (before they are overwritten);
                   (2) ``bce_grad_kernel``, one thread per label over a group of
                   ``BCE_GRAD_ROWS`` rows (coalesced): dZ in place, its column sum (one atomic per
                   label and row group) and the softplus terms (a shared-memory block sum, one
                   atomic per block); (3) ``bce_targets_kernel``, one thread per row: ``- scale
                   w`` on the true labels and their column sums.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32 as nb_float32
from numba import njit, prange
from xmc_engine.kernels._cuda import CUDASIM, MAX_BLOCKS, TPB, cuda, cuda_kernel, launch
from xmc_engine.kernels.output_layer import exp_neg, fill_zero

_F0 = np.float32(0.0)
_ONE = np.float32(1.0)
_TWO = np.float32(2.0)
# 2 / (2k + 1): the series of 2 atanh(s)
_A3, _A5, _A7 = np.float32(2 / 3), np.float32(2 / 5), np.float32(2 / 7)
_A9, _A11, _A13 = np.float32(2 / 9), np.float32(2 / 11), np.float32(2 / 13)
#: rows per block of the CUDA gradient pass (one column-sum atomic per label per group)
BCE_GRAD_ROWS = 4 if CUDASIM else 32
_SH = 256  # shared-memory reduction buffer (>= any block size used)


# ----------------------------------------------------------------------------------------- CPU
@njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
def _true_logits(z, bias, use_bias, colw, c0, y_indices, p0, p1):
    """``sum w_j (z_j + bias_j)`` over the row's labels ``j`` in [c0, c0 + C) (read before the
    sweep overwrites ``z``)."""
    C = z.shape[0]
    total = 0.0
    for p in range(p0, p1):
        j = y_indices[p] - c0
        if j >= 0 and j < C:
            v = z[j] + bias[j] if use_bias else z[j]
            total += v * colw[j] if colw.shape[0] > 0 else v
    return total


@njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
def _add_bias(z, bias):
    for j in range(z.shape[0]):
        z[j] += bias[j]


@njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
def _log1p_unit(e, x):
    """``log(x)`` for ``x = 1 + e``, ``e`` in [0, 1]: ``2 atanh(s)``, ``s = e / (2 + e)`` in
    [0, 1/3], by its series to ``s^13`` (rel. error < 1e-7); vectorises, unlike libm's ``log``."""
    s = e / (x + _ONE)
    s2 = s * s
    p = _A13
    p = p * s2 + _A11
    p = p * s2 + _A9
    p = p * s2 + _A7
    p = p * s2 + _A5
    p = p * s2 + _A3
    p = p * s2 + _TWO
    return s * p


@njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
def _sigmoid_softplus(v):
    """``(sigmoid(v), softplus(v))`` from one ``exp(-|v|)``; branch-free (the ternary compiles
    to a select) and ``error_model="numpy"`` (no zero-division check on ``1 / x``), so that the
    sweeps below vectorise (~0.8 ns per label on one core)."""
    e = exp_neg(-abs(v))
    x = _ONE + e
    r = _ONE / x
    return (r if v >= _F0 else e * r), max(v, _F0) + _log1p_unit(e, x)


@njit(nogil=True, cache=True, fastmath=True)
def _add_into(part, z):
    for j in range(z.shape[0]):
        part[j] += z[j]


@njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
def _sweep_unweighted(z, scale32, part, want_colsum):
    """``z -> scale * sigmoid(z)`` in place; returns ``sum softplus(z)``."""
    total = _F0
    for j in range(z.shape[0]):
        sig, sp = _sigmoid_softplus(z[j])
        z[j] = scale32 * sig
        total += sp
    if want_colsum:
        _add_into(part, z)
    return total


@njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
def _sweep_weighted(z, colw, scale32, part, want_colsum):
    """:func:`_sweep_unweighted` with column weights: ``z -> scale w sigmoid(z)``, returns
    ``sum w softplus(z)``."""
    total = _F0
    for j in range(z.shape[0]):
        sig, sp = _sigmoid_softplus(z[j])
        z[j] = scale32 * colw[j] * sig
        total += colw[j] * sp
    if want_colsum:
        _add_into(part, z)
    return total


@njit(nogil=True, cache=True, parallel=True, fastmath=True, error_model="numpy")
def bce_fused_cpu(Z, bias, use_bias, c0, colw, y_indptr, y_indices, scale, loss_rows,
                  colsum_parts):
    """Z (+ bias) -> dZ in place for the labels [c0, c0 + C); adds each row's loss to
    ``loss_rows``; ``colsum_parts`` (n_parts, C), or (n_parts, 0) for no column sums.

    One parallel region; thread t owns rows [t B / n_parts, (t + 1) B / n_parts)."""
    B, C = Z.shape
    n_parts = colsum_parts.shape[0]
    want_colsum = colsum_parts.shape[1] > 0
    weighted = colw.shape[0] > 0
    scale32 = nb_float32(scale)
    for t in prange(n_parts):
        part = colsum_parts[t]
        if want_colsum:
            fill_zero(part)
        for i in range(t * B // n_parts, (t + 1) * B // n_parts):
            z = Z[i]
            p0, p1 = y_indptr[i], y_indptr[i + 1]
            if p1 == p0:
                fill_zero(z)
                continue
            ysum = _true_logits(z, bias, use_bias, colw, c0, y_indices, p0, p1)
            if use_bias:
                _add_bias(z, bias)
            if weighted:
                sp = _sweep_weighted(z, colw, scale32, part, want_colsum)
            else:
                sp = _sweep_unweighted(z, scale32, part, want_colsum)
            loss_rows[i] += sp - ysum
            for p in range(p0, p1):
                j = y_indices[p] - c0
                if j >= 0 and j < C:
                    g = scale32 * colw[j] if weighted else scale32
                    z[j] -= g
                    if want_colsum:
                        part[j] -= g


@njit(nogil=True, cache=True)
def bce_xent_cpu(Z, y_indptr, y_indices, scale):
    """Z -> scale * (sigmoid(Z) - Y) in place; returns the summed (unscaled) loss."""
    loss_rows = np.zeros(Z.shape[0], np.float64)
    parts = np.empty((max(1, min(64, Z.shape[0])), 0), np.float32)
    bce_fused_cpu(Z, np.empty(0, np.float32), False, 0, np.empty(0, np.float32), y_indptr,
                  y_indices, scale, loss_rows, parts)
    return loss_rows.sum()


# ---------------------------------------------------------------------------------------- CUDA
@cuda_kernel
def bce_positives_kernel(Z, bias, use_bias, c0, colw, y_indptr, y_indices, loss_sum):
    B = y_indptr.shape[0] - 1
    C = Z.shape[1]
    for i in range(cuda.grid(1), B, cuda.gridsize(1)):
        total = 0.0
        for p in range(y_indptr[i], y_indptr[i + 1]):
            j = y_indices[p] - c0
            if j >= 0 and j < C:
                v = Z[i, j]
                if use_bias:
                    v += bias[j]
                if colw.shape[0] > 0:
                    v *= colw[j]
                total += v
        if total != 0.0:
            cuda.atomic.add(loss_sum, 0, -total)


@cuda_kernel
def bce_grad_kernel(Z, bias, use_bias, colw, y_indptr, scale, loss_sum, colsum):
    B, C = Z.shape
    tid = cuda.threadIdx.x
    buf = cuda.shared.array(_SH, dtype=np.float64)
    lsum = 0.0
    for i0 in range(cuda.blockIdx.y * BCE_GRAD_ROWS, B, cuda.gridDim.y * BCE_GRAD_ROWS):
        i1 = min(i0 + BCE_GRAD_ROWS, B)
        for j in range(cuda.blockIdx.x * cuda.blockDim.x + tid, C,
                       cuda.gridDim.x * cuda.blockDim.x):
            w = colw[j] if colw.shape[0] > 0 else nb_float32(1.0)
            b = bias[j] if use_bias else nb_float32(0.0)
            cs = nb_float32(0.0)
            for i in range(i0, i1):
                if y_indptr[i + 1] == y_indptr[i]:
                    Z[i, j] = 0.0
                    continue
                v = Z[i, j] + b
                e = math.exp(-abs(v))
                r = nb_float32(1.0) / (nb_float32(1.0) + e)
                g = scale * w * (r if v >= 0 else e * r)
                lsum += w * (max(v, nb_float32(0.0)) + math.log1p(e))
                Z[i, j] = g
                cs += g
            if cs != 0:
                cuda.atomic.add(colsum, j, cs)
    buf[tid] = lsum
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            buf[tid] += buf[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0 and buf[0] != 0.0:
        cuda.atomic.add(loss_sum, 0, buf[0])


@cuda_kernel
def bce_targets_kernel(Z, c0, colw, y_indptr, y_indices, scale, colsum):
    B = y_indptr.shape[0] - 1
    C = Z.shape[1]
    for i in range(cuda.grid(1), B, cuda.gridsize(1)):
        for p in range(y_indptr[i], y_indptr[i + 1]):
            j = y_indices[p] - c0
            if j >= 0 and j < C:
                g = scale * (colw[j] if colw.shape[0] > 0 else nb_float32(1.0))
                Z[i, j] -= g
                cuda.atomic.add(colsum, j, -g)


def bce_launch(Z, bias, use_bias, c0, colw, y_indptr, y_indices, scale, loss_sum, colsum,
               stream=0):
    """Queue the three kernels of :func:`bce_fused_cpu` on ``stream`` (device arrays; ``bias``
    and ``colw`` may be length 0). ``loss_sum`` (1,) float64 and ``colsum`` (C,) float32 are
    ADDED to. Never synchronises."""
    B, C = Z.shape
    if B == 0 or C == 0:
        return
    row_grid = max(1, min(MAX_BLOCKS, -(-B // TPB)))
    launch(bce_positives_kernel, row_grid, TPB, stream,
           Z, bias, bool(use_bias), np.int64(c0), colw, y_indptr, y_indices, loss_sum)
    gx = max(1, min(MAX_BLOCKS, -(-C // TPB)))
    gy = max(1, min(MAX_BLOCKS, -(-B // BCE_GRAD_ROWS)))
    launch(bce_grad_kernel, (gx, gy), TPB, stream,
           Z, bias, bool(use_bias), colw, y_indptr, np.float32(scale), loss_sum, colsum)
    launch(bce_targets_kernel, row_grid, TPB, stream,
           Z, np.int64(c0), colw, y_indptr, y_indices, np.float32(scale), colsum)
