"""Slow, obvious NumPy versions of every kernel: the specification the fast kernels are tested on.

Arrays are host NumPy arrays. CSR parts follow the project vocabulary: ``indptr`` (n_rows + 1,)
int32/int64, ``indices`` (nnz,) int32/int64, ``data`` (nnz,) float32. Label sets are CSR without
data: ``y_indptr`` (B + 1,), ``y_indices`` (n_labels_in_batch,). Every function computes in the
dtype of its inputs unless ``dtype`` says otherwise (tests pass float64 for finite differences).
"""

from __future__ import annotations

import numpy as np


def dense_from_csr(indptr, indices, data, n_cols, dtype=np.float64):
    """CSR parts -> dense (n_rows, n_cols) array (duplicates are summed)."""
    n_rows = len(indptr) - 1
    out = np.zeros((n_rows, n_cols), dtype=dtype)
    for i in range(n_rows):
        for p in range(indptr[i], indptr[i + 1]):
            out[i, indices[p]] += data[p]
    return out


def label_targets(y_indptr, y_indices, n_labels, dtype=np.float64):
    """Row-normalised label matrix ``y / |y|`` (B, n_labels); rows without labels stay zero."""
    B = len(y_indptr) - 1
    T = np.zeros((B, n_labels), dtype=dtype)
    for i in range(B):
        labs = y_indices[y_indptr[i] : y_indptr[i + 1]]
        if len(labs):
            T[i, labs] += 1.0 / len(labs)
    return T


def sparse_forward(indptr, indices, data, W1, b1):
    """relu(X @ W1 + b1), (B, n_hidden)."""
    X = dense_from_csr(indptr, indices, data, W1.shape[0], dtype=W1.dtype)
    return np.maximum(X @ W1 + b1, 0)


def sparse_grad(indptr, indices, data, dZ1, n_features=None):
    """Row-sparse gradient of W1: (rows sorted unique int64, grad_rows, grad_b1)."""
    if n_features is None:
        n_features = int(indices.max()) + 1 if len(indices) else 0
    X = dense_from_csr(indptr, indices, data, n_features, dtype=dZ1.dtype)
    G = X.T @ dZ1
    rows = np.unique(np.asarray(indices, dtype=np.int64))
    return rows, G[rows], dZ1.sum(axis=0)


def sparse_backward_update(indptr, indices, data, dZ1, W1, b1, lr):
    """Return updated copies ``(W1 - lr X^T dZ1, b1 - lr sum_i dZ1[i])``."""
    X = dense_from_csr(indptr, indices, data, W1.shape[0], dtype=W1.dtype)
    return W1 - lr * (X.T @ dZ1), b1 - lr * dZ1.sum(axis=0)


def sparse_rows_update(W1, rows, grad_rows, lr):
    """Return a copy of W1 with ``W1[rows] -= lr * grad_rows``."""
    W = W1.copy()
    W[rows] -= lr * grad_rows
    return W


def relu_backward(dH, H):
    """dH with dH[H <= 0] = 0 (a copy)."""
    return np.where(H > 0, dH, 0).astype(dH.dtype)


def softmax_xent_loss_rows(Z, y_indptr, y_indices):
    """Per-row loss ``-sum_l y_l/|y| log softmax(Z)_l``; 0 for rows without labels."""
    T = label_targets(y_indptr, y_indices, Z.shape[1], dtype=Z.dtype)
    m = Z.max(axis=1, keepdims=True)
    logp = Z - m - np.log(np.exp(Z - m).sum(axis=1, keepdims=True))
    return -(T * logp).sum(axis=1)


def softmax_xent(Z, y_indptr, y_indices, scale):
    """(dZ, loss_sum): dZ = scale * (softmax(Z) - y/|y|), zero on rows without labels."""
    T = label_targets(y_indptr, y_indices, Z.shape[1], dtype=Z.dtype)
    m = Z.max(axis=1, keepdims=True)
    P = np.exp(Z - m)
    P /= P.sum(axis=1, keepdims=True)
    has = np.diff(y_indptr) > 0
    dZ = scale * (P - T) * has[:, None]
    return dZ.astype(Z.dtype), float(softmax_xent_loss_rows(Z, y_indptr, y_indices).sum())


def output_layer_loss(H, W2, b2, y_indptr, y_indices):
    """Summed loss of the output layer (for finite differences: pass float64)."""
    return float(softmax_xent_loss_rows(H @ W2 + b2, y_indptr, y_indices).sum())


def output_layer_grad(H, W2, b2, y_indptr, y_indices):
    """(loss_sum, dW2, db2, dH) of the MEAN loss (scale 1/B, B = number of rows)."""
    B = H.shape[0]
    dZ, loss = softmax_xent(H @ W2 + b2, y_indptr, y_indices, 1.0 / max(B, 1))
    return loss, H.T @ dZ, dZ.sum(axis=0), dZ @ W2.T


def output_layer_step(H, W2, b2, y_indptr, y_indices, lr):
    """(loss_sum, W2_new, b2_new, dH): one SGD step of the output layer, dH with the old W2."""
    loss, dW2, db2, dH = output_layer_grad(H, W2, b2, y_indptr, y_indices)
    return loss, W2 - lr * dW2, b2 - lr * db2, dH


def topk(scores, k):
    """(idx int64 (B, k), val (B, k)) sorted by descending score (ties: lower index first)."""
    k = min(k, scores.shape[1])
    idx = np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int64)
    return idx, np.take_along_axis(scores, idx, axis=1)


def predict_scores_topk(H, W2, b2, k):
    """Top-k of ``H @ W2 + b2``."""
    return topk(H @ W2 + b2, k)


def weighted_sum(arrays, weights):
    """sum_i weights[i] * arrays[i]."""
    return sum(w * a for w, a in zip(weights, arrays, strict=True))


def momentum(wbar, z_prev, z_prev2, mu):
    """wbar + mu * (z_prev - z_prev2)."""
    return wbar + mu * (z_prev - z_prev2)


def elastic(x, center, alpha):
    """(x_new, diff) with diff = alpha * (x - center), x_new = x - diff."""
    diff = alpha * (x - center)
    return x - diff, diff


def adagrad_dense(w, g, acc, lr, eps):
    """(w_new, acc_new): acc + g^2 and w - lr g / (sqrt(acc_new) + eps), in float64."""
    acc_new = acc.astype(np.float64) + g.astype(np.float64) ** 2
    w_new = w.astype(np.float64) - lr * g / (np.sqrt(acc_new) + eps)
    return w_new, acc_new


def adagrad_rows(W, rows, grad_rows, acc_W, lr, eps):
    """The dense rule applied to ``W[rows]`` / ``acc_W[rows]`` only (copies, float64)."""
    W_new, acc_new = W.astype(np.float64), acc_W.astype(np.float64)
    w, a = adagrad_dense(W[rows], grad_rows, acc_W[rows], lr, eps)
    W_new[rows], acc_new[rows] = w, a
    return W_new, acc_new


def gather_columns(W2, b2, cols):
    """``(W2[:, cols], b2[cols])`` (copies)."""
    return W2[:, cols].copy(), b2[cols].copy()


def scatter_add_columns(W2, b2, cols, dW2s, db2s, alpha):
    """Copies of ``W2``, ``b2`` with ``alpha dW2s`` / ``alpha db2s`` added at columns ``cols``
    (unique)."""
    W, b = W2.copy(), b2.copy()
    W[:, cols] += alpha * dW2s
    b[cols] += alpha * db2s
    return W, b


def adagrad_columns(W2, b2, acc_W2, acc_b2, cols, dW2s, db2s, lr, eps):
    """The dense Adagrad rule on columns ``cols`` of ``W2`` / ``acc_W2`` and entries ``cols``
    of ``b2`` / ``acc_b2`` only: ``(W2, b2, acc_W2, acc_b2)`` as float64 copies."""
    W, aW = W2.astype(np.float64), acc_W2.astype(np.float64)
    b, ab = b2.astype(np.float64), acc_b2.astype(np.float64)
    W[:, cols], aW[:, cols] = adagrad_dense(W2[:, cols], dW2s, acc_W2[:, cols], lr, eps)
    b[cols], ab[cols] = adagrad_dense(b2[cols], db2s, acc_b2[cols], lr, eps)
    return W, b, aW, ab


def sampled_output_grad(H, W2, b2, y_indptr, y_indices, cols, log_weight):
    """The sampled output layer's ``(loss_sum, dW2, db2, dH)`` with dense ``dW2`` / ``db2``
    (zero outside ``cols``), the mean over the ``B`` rows.

    Logits only for the candidate labels ``cols`` (every label of the batch among them):
    ``Zs = H @ W2[:, cols] + b2[cols] + log_weight``, softmax cross-entropy of ``Zs`` against
    the row-normalised labels, ``dZs = (softmax(Zs) - y/|y|) / B``; ``dW2[:, cols] = H^T dZs``,
    ``db2[cols] = dZs.sum(0)``, ``dH = dZs W2[:, cols]^T``.
    """
    B = H.shape[0]
    pos = {int(c): j for j, c in enumerate(cols)}
    local = np.array([pos[int(y)] for y in y_indices], dtype=np.int64)
    Zs = H @ W2[:, cols] + b2[cols] + log_weight
    dZs, loss = softmax_xent(Zs, y_indptr, local, 1.0 / max(B, 1))
    dW2 = np.zeros_like(W2)
    db2 = np.zeros_like(b2)
    dW2[:, cols] = H.T @ dZs
    db2[cols] = dZs.sum(axis=0)
    return loss, dW2, db2, dZs @ W2[:, cols].T


def uniform_negatives(pos, n_labels, k, rng):
    """The uniform negatives of a sampled step (``output_layer.sample_candidates``): rounds of
    ``2 k + len(pos)`` draws from ``rng``, keeping in draw order the first ``k`` distinct labels
    that are not in ``pos`` (sorted positives), with NumPy's set operations."""
    neg = np.empty(0, dtype=np.int64)
    while len(neg) < k:
        draw = rng.integers(0, n_labels, size=2 * k + len(pos))
        draw = np.concatenate([neg, draw[~np.isin(draw, pos)]])
        _, first = np.unique(draw, return_index=True)
        neg = draw[np.sort(first)][:k]
    return neg


def frequency_negatives(q, pos, k, rng, cdf=None):
    """The frequency negatives of a sampled step (``output_layer.FrequencyProposal.negatives``):
    ``k`` uniforms from ``rng``, each mapped to the first label whose cumulative ``q`` exceeds
    it (``searchsorted`` over the whole cdf, ``np.cumsum(q)`` unless given), then the distinct
    labels not in ``pos`` (sorted) and ``-log(1 - (1 - q_j) ** k)`` of each (float32), with
    NumPy's set operations."""
    cdf = np.cumsum(q) if cdf is None else cdf
    drawn = np.minimum(np.searchsorted(cdf, rng.random(int(k)) * cdf[-1], side="right"),
                       len(q) - 1)
    neg = np.unique(drawn)
    neg = neg[~np.isin(neg, pos)]
    return neg, (-np.log(-np.expm1(int(k) * np.log1p(-q[neg])))).astype(np.float32)


def bce_xent(Z, y_indptr, y_indices, scale, colw=None):
    """(dZ, loss_sum): one-vs-all logistic loss, ``dZ = scale * w * (sigmoid(Z) - Y)``, loss of
    a row ``sum_j w_j (softplus(z_j) - Y_j z_j)``; rows without labels: zero gradient, loss 0."""
    Z64 = Z.astype(np.float64)
    B, L = Z.shape
    Y = label_targets(y_indptr, y_indices, L) > 0
    w = np.ones(L) if colw is None else np.asarray(colw, dtype=np.float64)
    has = np.diff(y_indptr) > 0
    sig = 1.0 / (1.0 + np.exp(-Z64))
    dZ = scale * w * (sig - Y) * has[:, None]
    loss_rows = ((np.logaddexp(0.0, Z64) - Y * Z64) * w).sum(1) * has
    return dZ.astype(Z.dtype), float(loss_rows.sum())


def sparse_dot_rows(q_indptr, q_indices, q_data, r_indptr, r_indices, r_data, n_features):
    """``Q @ R.T`` of two CSR matrices (rows of ``n_features`` columns), dense float64."""
    Q = dense_from_csr(q_indptr, q_indices, q_data, n_features)
    R = dense_from_csr(r_indptr, r_indices, r_data, n_features)
    return Q @ R.T


def neighbour_vote(top_idx, top_sim, power, y_indptr, y_indices, n_labels):
    """Per query row: the labels of its neighbours ``top_idx[i]``, each weighted by
    ``max(sim, 0) ** power`` normalised to sum 1 (all zero: no vote), dense float64."""
    Yd = label_targets(y_indptr, y_indices, n_labels) > 0
    out = np.zeros((top_idx.shape[0], n_labels))
    for i in range(top_idx.shape[0]):
        w = np.maximum(top_sim[i].astype(np.float64), 0) ** power
        if w.sum() > 0:
            out[i] = (w[:, None] * Yd[top_idx[i]]).sum(axis=0) / w.sum()
    return out
