"""A whole training step of the default network on the CPU in one ``nogil`` call.

The default model (one hidden layer, the exact softmax in one label chunk) trained with SGD or
Adagrad takes, step by step through the backend, some fifteen kernel and BLAS calls with Python
in between. Each call releases the GIL and must take it back; with several CPU devices in one
process (the scheduler's worker threads) a worker then waits for the others' Python glue, and
measured on a 2-core machine each of two devices ran 1.3-1.45x slower per sample than one device
alone (``bench/bench_contention.py``). Here the same kernels and GEMMs run from one ``@njit``
function, which holds no GIL from the first kernel to the loss.

``train_step_cpu`` composes the modules' own kernels in the order of the host-level step
(:func:`xmc_engine.model.grad_step` then :func:`xmc_engine.model.apply_adagrad`, or
:func:`xmc_engine.model.train_step` for SGD), and ``grad_step_cpu`` the gradient alone
(:func:`xmc_engine.model.grad_step`, what ``sync`` computes on each device), so their reference
is that path: the tests compare the two on the same batches. The GEMMs are ``np.dot`` inside
numba (SciPy's BLAS).

Arrays
------
indptr, indices, data : CSR of the batch X (B, n_features); int32/int64, int32/int64, float32
y_indptr, y_indices : CSR pattern of the batch's labels (B, L) (values unused)
W1 (n_features, n_hidden), b1 (n_hidden,), W2 (n_hidden, L), b2 (L,) : float32, C order,
    updated in place
acc_W1, acc_b1, acc_W2, acc_b2 : Adagrad accumulators of the same shapes (read and written only
    with ``adagrad``; any float32 arrays of the right dimensions otherwise)
H, dH : (B, n_hidden) float32 scratch; Z : (B, L) scratch (logits, then dZ); dW2 (n_hidden, L),
    db2 (L,) scratch; loss_rows (B,) float64; colsum_parts (n_parts, L) float32, n_parts >= 1
changed : (n_features,) bool; ``changed[f] = True`` for the batch's features (the row-sparse
    merge's record), or a length-0 array for none

Versions
--------
CPU only. On a GPU the calls are queued on a stream without waiting, so the Python between them
overlaps the device's work; the CUDA backend keeps the host-level step.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from xmc_engine.kernels.adagrad import adagrad_dense_cpu, adagrad_rows_cpu
from xmc_engine.kernels.bce_output import bce_fused_cpu
from xmc_engine.kernels.output_layer import (
    axpy_parallel_cpu,
    axpy_serial_cpu,
    softmax_xent_fused_cpu,
    sum_parts_cpu,
)
from xmc_engine.kernels.sampled_output import (
    adagrad_columns_cpu,
    gather_columns_cpu,
    scatter_add_columns_cpu,
)
from xmc_engine.kernels.sparse_backward import (
    relu_backward_cpu,
    sparse_backward_update_cpu,
    sparse_grad_cpu,
)
from xmc_engine.kernels.sparse_forward import sparse_forward_cpu


@njit(nogil=True, cache=True)
def _forward_backward(indptr, indices, data, y_indptr, y_indices, W1, b1, W2, b2, bce, colw,
                      H, Z, dH, dW2, db2, loss_rows, colsum_parts):
    """Forward, loss and the output layer's backward of a non-empty batch into the scratch
    arrays: ``Z`` holds dZ, ``db2`` and ``dW2`` the output layer's gradients, ``dH`` the
    gradient of the hidden pre-activation (with ``W2`` as given). The loss: softmax
    cross-entropy, or with ``bce`` the one-vs-all logistic loss with column weights ``colw``
    (length 0: none). Returns the summed loss."""
    scale = 1.0 / (indptr.shape[0] - 1)
    sparse_forward_cpu(indptr, indices, data, W1, b1, H)
    np.dot(H, W2, Z)                                        # GEMM 1: logits
    if bce:
        loss_rows[:] = 0.0
        bce_fused_cpu(Z, b2, True, 0, colw, y_indptr, y_indices, scale, loss_rows, colsum_parts)
    else:
        softmax_xent_fused_cpu(Z, b2, True, y_indptr, y_indices, scale, loss_rows,
                               colsum_parts)
    sum_parts_cpu(colsum_parts, db2, 1.0, 0.0)              # db2 = dZ.sum(0)
    np.dot(Z, W2.T, dH)                                     # GEMM 2: dH with the old W2
    np.dot(H.T, Z, dW2)                                     # GEMM 3: dW2
    relu_backward_cpu(dH, H)
    return loss_rows.sum()


@njit(nogil=True, cache=True)
def _mark(changed, idx):
    """``changed[idx[p]] = True`` for every ``p`` (a ``changed`` of length 0: nothing)."""
    if changed.shape[0] > 0:
        for p in range(idx.shape[0]):
            changed[idx[p]] = True


@njit(nogil=True, cache=True)
def _first_layer_update(indptr, indices, data, dH, W1, b1, acc_W1, acc_b1, adagrad, lr, eps):
    """The step of ``W1`` (the batch's feature rows) and ``b1`` from ``dH``: Adagrad, or SGD."""
    if adagrad:
        rows, grad_rows, grad_b1 = sparse_grad_cpu(indptr, indices, data, dH)
        if rows.shape[0] > 0:
            adagrad_rows_cpu(W1, rows, grad_rows, acc_W1, lr, eps)
        adagrad_dense_cpu(b1, grad_b1, acc_b1, lr, eps)
    else:
        sparse_backward_update_cpu(indptr, indices, data, dH, W1, b1, lr)


@njit(nogil=True, cache=True)
def train_step_cpu(indptr, indices, data, y_indptr, y_indices, W1, b1, W2, b2,
                   acc_W1, acc_b1, acc_W2, acc_b2, adagrad, lr, eps, bce,
                   H, Z, dH, dW2, db2, loss_rows, colsum_parts, changed):
    """One step on the batch; returns the loss summed over its rows (rows without labels: 0).
    ``bce``: the one-vs-all logistic loss instead of the softmax.

    ``dH`` is taken with ``W2`` before its update, as in the host-level step."""
    _mark(changed, indices)
    if indptr.shape[0] <= 1:
        return 0.0
    loss = _forward_backward(indptr, indices, data, y_indptr, y_indices, W1, b1, W2, b2,
                             bce, np.empty(0, np.float32), H, Z, dH, dW2, db2, loss_rows,
                             colsum_parts)
    _first_layer_update(indptr, indices, data, dH, W1, b1, acc_W1, acc_b1, adagrad, lr, eps)
    if adagrad:  # flat views: the rule compiles once, for weights and biases alike
        adagrad_dense_cpu(W2.reshape(-1), dW2.reshape(-1), acc_W2.reshape(-1), lr, eps)
        adagrad_dense_cpu(b2, db2, acc_b2, lr, eps)
    else:
        axpy_parallel_cpu(W2, dW2, -lr)
        axpy_serial_cpu(b2, db2, -lr)
    return loss


@njit(nogil=True, cache=True)
def grad_step_cpu(indptr, indices, data, y_indptr, y_indices, W1, b1, W2, b2, bce,
                  H, Z, dH, dW2, db2, loss_rows, colsum_parts):
    """The step's gradients without an update (``sync``): returns ``(loss, rows, grad_rows,
    grad_b1)`` (``W1``'s row-sparse gradient as ``sparse_grad_cpu`` gives it), with ``dW2`` and
    ``db2`` in their scratch arrays; an empty batch gives zeros."""
    if indptr.shape[0] <= 1:
        dW2[...] = 0
        db2[...] = 0
        rows, grad_rows, grad_b1 = sparse_grad_cpu(indptr, indices, data, dH[:0])
        return 0.0, rows, grad_rows, grad_b1
    loss = _forward_backward(indptr, indices, data, y_indptr, y_indices, W1, b1, W2, b2,
                             bce, np.empty(0, np.float32), H, Z, dH, dW2, db2, loss_rows,
                             colsum_parts)
    rows, grad_rows, grad_b1 = sparse_grad_cpu(indptr, indices, data, dH)
    return loss, rows, grad_rows, grad_b1


@njit(nogil=True, cache=True)
def _sampled_forward_backward(indptr, indices, data, y_indptr, local_y, cols, n_pos, neg_weight,
                              bce, W1, b1, W2, b2, H, W2s, b2s, Zs, dH, dW2s, db2s, loss_rows,
                              colsum_parts):
    """:func:`_forward_backward` on the candidate columns ``cols`` of ``W2``, ``b2`` (gathered
    into ``W2s``, ``b2s``). The negatives' log-weights ``neg_weight``: added to their biases
    (the sampled-softmax correction), or with ``bce`` their weights ``exp(neg_weight)`` on
    their loss terms (length 0: unweighted)."""
    gather_columns_cpu(W2, b2, cols, W2s, b2s)
    colw = np.empty(0, np.float32)
    if bce:
        if neg_weight.shape[0] > 0:
            colw = np.ones(cols.shape[0], np.float32)
            for j in range(n_pos, cols.shape[0]):
                colw[j] = np.exp(neg_weight[j - n_pos])
    else:
        for j in range(n_pos, cols.shape[0]):
            b2s[j] += neg_weight[j - n_pos]
    return _forward_backward(indptr, indices, data, y_indptr, local_y, W1, b1, W2s, b2s,
                             bce, colw, H, Zs, dH, dW2s, db2s, loss_rows, colsum_parts)


@njit(nogil=True, cache=True)
def sampled_grad_step_cpu(indptr, indices, data, y_indptr, local_y, cols, n_pos, neg_weight,
                          bce, W1, b1, W2, b2, H, W2s, b2s, Zs, dH, dW2s, db2s, loss_rows,
                          colsum_parts):
    """The gradient of :func:`sampled_train_step_cpu` without the update (``sync``): returns
    ``(loss, rows, grad_rows, grad_b1)``, with the candidate columns' ``dW2s``, ``db2s`` in their
    scratch arrays; an empty batch or no candidates give zeros."""
    if indptr.shape[0] <= 1 or cols.shape[0] == 0:
        dW2s[...] = 0
        db2s[...] = 0
        rows, grad_rows, grad_b1 = sparse_grad_cpu(indptr, indices, data, dH[:0])
        return 0.0, rows, grad_rows, grad_b1
    loss = _sampled_forward_backward(indptr, indices, data, y_indptr, local_y, cols, n_pos,
                                     neg_weight, bce, W1, b1, W2, b2, H, W2s, b2s, Zs, dH, dW2s,
                                     db2s, loss_rows, colsum_parts)
    rows, grad_rows, grad_b1 = sparse_grad_cpu(indptr, indices, data, dH)
    return loss, rows, grad_rows, grad_b1


@njit(nogil=True, cache=True)
def sampled_train_step_cpu(indptr, indices, data, y_indptr, local_y, cols, n_pos, neg_weight,
                           bce, W1, b1, W2, b2, acc_W1, acc_b1, acc_W2, acc_b2, adagrad, lr, eps,
                           H, W2s, b2s, Zs, dH, dW2s, db2s, loss_rows, colsum_parts, changed,
                           changed_cols):
    """One step with the sampled output layer on the candidate labels ``cols`` (the batch's
    ``n_pos`` distinct positives, then the negatives; ``local_y`` the labels' positions in
    ``cols``); ``neg_weight`` (one per negative) is added to the negatives' logits (the
    sampled-softmax correction, :func:`xmc_engine.output_layer.sample_candidates`). ``W2``,
    ``b2`` (and their accumulators) change on the columns ``cols`` only; ``changed_cols``
    (length 0: none) records them. Scratch: ``W2s``, ``dW2s`` (n_hidden, m), ``b2s``,
    ``db2s`` (m,), ``Zs`` (B, m), ``colsum_parts`` (n_parts, m). Returns the summed loss.

    Reference: :meth:`xmc_engine.model.MLPReplica` without ``fused`` (``sampled_grad_step``,
    then ``apply_adagrad`` or ``apply_grads``)."""
    _mark(changed, indices)
    _mark(changed_cols, cols)
    m = cols.shape[0]
    if indptr.shape[0] <= 1 or m == 0:
        return 0.0
    loss = _sampled_forward_backward(indptr, indices, data, y_indptr, local_y, cols, n_pos,
                                     neg_weight, bce, W1, b1, W2, b2, H, W2s, b2s, Zs, dH, dW2s,
                                     db2s, loss_rows, colsum_parts)
    _first_layer_update(indptr, indices, data, dH, W1, b1, acc_W1, acc_b1, adagrad, lr, eps)
    if adagrad:
        adagrad_columns_cpu(W2, b2, acc_W2, acc_b2, cols, dW2s, db2s, lr, eps)
    else:
        scatter_add_columns_cpu(W2, b2, cols, dW2s, db2s, -lr)
    return loss
