"""Summary statistics of a ``(X, Y)`` pair: sizes, density, label-frequency skew, empty rows."""

from __future__ import annotations

import numpy as np


def describe(X, Y) -> dict:
    """Statistics of one split.

    Parameters
    ----------
    X : scipy.sparse.csr_matrix, shape (n_samples, n_features)
    Y : scipy.sparse.csr_matrix, shape (n_samples, n_labels)

    Returns
    -------
    dict
        ``n_samples, n_features, n_labels, nnz, avg_nnz, avg_labels, max_nnz, max_labels,
        rows_without_labels, rows_without_features, labels_seen, median_label_freq,
        max_label_freq, top1pct_label_share, top10pct_label_share`` (label shares: fraction of
        all label occurrences held by the most frequent 1% / 10% of the ``n_labels`` labels;
        the median is over labels that occur).
    """
    n, n_features = X.shape
    n_labels = Y.shape[1]
    x_nnz = np.diff(X.indptr)
    y_nnz = np.diff(Y.indptr)
    freq = np.bincount(Y.indices, minlength=n_labels)
    seen = freq[freq > 0]
    desc = np.sort(freq)[::-1]
    total = max(int(freq.sum()), 1)

    def share(frac):
        k = max(1, int(np.ceil(frac * n_labels))) if n_labels else 0
        return float(desc[:k].sum() / total)

    return dict(
        n_samples=int(n), n_features=int(n_features), n_labels=int(n_labels), nnz=int(X.nnz),
        avg_nnz=float(x_nnz.mean()) if n else 0.0,
        avg_labels=float(y_nnz.mean()) if n else 0.0,
        max_nnz=int(x_nnz.max()) if n else 0, max_labels=int(y_nnz.max()) if n else 0,
        rows_without_labels=int((y_nnz == 0).sum()),
        rows_without_features=int((x_nnz == 0).sum()),
        labels_seen=int(len(seen)),
        median_label_freq=float(np.median(seen)) if len(seen) else 0.0,
        max_label_freq=int(freq.max()) if n_labels else 0,
        top1pct_label_share=share(0.01), top10pct_label_share=share(0.10),
    )
