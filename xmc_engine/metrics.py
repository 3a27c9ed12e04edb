"""Top-k ranking metrics of extreme multi-label classification, as streaming accumulators.

Metrics (all fractions in ``[0, 1]``, not percent), for a test set of ``n_samples`` rows, true
labels ``y_i`` (row ``i`` of ``Y``) and predicted label ids ``t_i1, t_i2, ...`` sorted by
descending score. ``hit_ij = 1`` when ``t_ij`` is in ``y_i``. Definitions follow the Extreme
Classification Repository and its reference code (pyxclib, ``xclib.evaluation.xc_metrics``):

``P@k``
    ``mean_i  sum_{j<=k} hit_ij / k``.
``R@k``
    ``mean_i  sum_{j<=k} hit_ij / |y_i|``.
``nDCG@k``
    ``mean_i  DCG_i@k / IDCG@min(k, |y_i|)`` with ``DCG_i@k = sum_{j<=k} hit_ij / log2(j + 1)``
    and ``IDCG@m = sum_{j<=m} 1 / log2(j + 1)``.
``PSP@k``
    ``[mean_i sum_{j<=k} hit_ij / p(t_ij)] / [mean_i sum_{j<=k} 1 / p(l_ij*)]`` where
    ``l_i1*, l_i2*, ...`` are the true labels of row ``i`` sorted by descending inverse propensity
    (the best achievable ranking; positions past ``|y_i|`` contribute 0). This is pyxclib's
    ``psprecision``: a ratio of two dataset-level means, not a mean of per-row ratios.
``PSnDCG@k``
    The same ratio with each row's sums discounted by ``1 / log2(j + 1)`` and divided by
    ``IDCG@min(k, |y_i|)`` (pyxclib's ``psndcg``).

Conventions (shared with the XC repository and pyxclib):

* Every test row counts, including rows without labels: such a row contributes 0 to ``P@k``,
  ``R@k`` and ``nDCG@k`` (and nothing to either side of the PS ratios). Removing those rows
  beforehand raises the numbers; the XC repository does not.
* ``P@k`` divides by ``k`` even when ``k > |y_i|`` or ``k > n_labels``.
* The predicted order is given, so ties do not arise. Ids in a row must be distinct; a negative id
  (e.g. ``-1``) is padding ("no prediction") and never hits. ``top_labels`` may have fewer than
  ``max(ks)`` columns only when it already holds every label (``n_labels < max(ks)``); missing
  positions are misses.
* Propensities are Jain et al. (2016), "Extreme multi-label loss functions for recommendation,
  tagging, ranking & other missing label applications" (KDD), eq. in section 5:
  ``p_l = 1 / (1 + C (N_l + B)^-A)``, ``C = (log N - 1) (B + 1)^A``, with ``N`` the number of
  training rows and ``N_l`` the training rows carrying label ``l`` (defaults ``A = 0.55``,
  ``B = 1.5``; the XC repository uses ``0.5, 0.4`` for Wikipedia and ``0.6, 2.6`` for Amazon sets).

Everything is vectorised over a batch and never densifies ``Y``: the cost of one ``update`` is
``O(nnz(Y_batch) log nnz(Y_batch) + n k log nnz(Y_batch))`` and memory is ``O(nnz + n k)``, so
millions of labels are fine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import scipy.sparse as sp

logger = logging.getLogger(__name__)

__all__ = ["MIN_PROPENSITY_ROWS", "TopKMetrics", "evaluate", "jain_propensity",
           "propensity_or_none"]

# Jain et al.'s C = (log N - 1)(B + 1)^A is positive only from N = 3 training rows.
MIN_PROPENSITY_ROWS = 3


def jain_propensity(label_counts_or_Y_train, n_samples: int | None = None,
                    A: float = 0.55, B: float = 1.5) -> np.ndarray:
    """Label propensities of Jain et al. (2016), from training label frequencies.

    Parameters
    ----------
    label_counts_or_Y_train : scipy.sparse matrix or array-like
        Either the training label matrix ``Y`` (sparse, ``(n_samples, n_labels)``, host; a stored
        non-zero entry is a label) or the per-label training counts ``N_l`` (1-D, length
        ``n_labels``, non-negative).
    n_samples : int, optional
        Number of training rows ``N``. Taken from ``Y.shape[0]`` when a matrix is given; required
        with counts. Must be at least 3 (so that ``C > 0``).
    A, B : float
        The dataset constants (``A > 0``, ``B > 0``).

    Returns
    -------
    numpy.ndarray
        float64, shape ``(n_labels,)``: ``p_l`` in ``(0, 1]``. Inverse propensities ``1 / p_l``
        weight the PS metrics.
    """
    if sp.issparse(label_counts_or_Y_train):
        Y = sp.csr_matrix(label_counts_or_Y_train)
        if n_samples is None:
            n_samples = Y.shape[0]
        counts = np.bincount(Y.indices[Y.data != 0], minlength=Y.shape[1]).astype(np.float64)
    else:
        counts = np.asarray(label_counts_or_Y_train, dtype=np.float64)
        if counts.ndim != 1:
            raise ValueError(
                f"label counts must be 1-D (n_labels,), got shape {counts.shape}; pass a sparse "
                "Y_train matrix for a label matrix")
        if n_samples is None:
            raise ValueError("n_samples (training rows) is required when label counts are given")
        if counts.size and (not np.all(np.isfinite(counts)) or counts.min() < 0):
            raise ValueError("label counts must be finite and non-negative")
    if n_samples < MIN_PROPENSITY_ROWS:
        raise ValueError(f"n_samples={n_samples}: Jain propensities need at least "
                         f"{MIN_PROPENSITY_ROWS} training rows (C = (log N - 1)(B + 1)^A must be "
                         "positive)")
    if not (A > 0 and B > 0):
        raise ValueError(f"A and B must be positive, got A={A}, B={B}")
    C = (np.log(n_samples) - 1.0) * (B + 1.0) ** A
    inv = 1.0 + C * np.exp(-A * np.log(counts + B))
    return 1.0 / inv


def propensity_or_none(label_counts, n_samples: int, A: float = 0.55,
                       B: float = 1.5) -> np.ndarray | None:
    """:func:`jain_propensity` of the training label counts, or ``None`` (with a warning) where
    the training set is too small for it.

    Evaluation uses this so that a model trained on fewer than :data:`MIN_PROPENSITY_ROWS` rows
    reports every metric except the propensity-scored ones (``TopKMetrics`` leaves ``PSP@k`` and
    ``PSnDCG@k`` out when given ``None``) instead of failing.

    Parameters
    ----------
    label_counts : array-like
        int or float, shape ``(n_labels,)``, host: training occurrences of each label.
    n_samples : int
        Training rows ``N``.
    A, B : float
        The dataset constants, as in :func:`jain_propensity`.

    Returns
    -------
    numpy.ndarray or None
        float64, shape ``(n_labels,)``; ``None`` when ``n_samples < MIN_PROPENSITY_ROWS``.
    """
    if n_samples < MIN_PROPENSITY_ROWS:
        logger.warning("PSP@k and PSnDCG@k left out: Jain propensities need at least %d training "
                       "rows, the model was trained on %d", MIN_PROPENSITY_ROWS, n_samples)
        return None
    return jain_propensity(label_counts, n_samples=n_samples, A=A, B=B)


def _as_host_int_array(top_labels) -> np.ndarray:
    """``top_labels`` as a 2-D NumPy integer array (copies CuPy arrays to the host)."""
    if type(top_labels).__module__.split(".")[0] == "cupy":
        top_labels = top_labels.get()
    top = np.asarray(top_labels)
    if top.ndim != 2:
        raise ValueError(f"top_labels must be 2-D (n_samples, k), got shape {top.shape}")
    if not np.issubdtype(top.dtype, np.integer):
        raise ValueError(
            f"top_labels must hold integer label ids sorted by descending score, got dtype "
            f"{top.dtype} (scores? take the top-k ids first, e.g. predict_topk)")
    return top.astype(np.int64, copy=False)


def _canonical_csr(Y) -> sp.csr_matrix:
    """CSR with sorted, unique indices and no explicit zeros; copies only when needed."""
    if not sp.issparse(Y):
        raise ValueError(f"Y must be a scipy.sparse matrix (CSR), got {type(Y).__name__}")
    Y = Y if (sp.isspmatrix_csr(Y) or isinstance(Y, sp.csr_array)) else sp.csr_matrix(Y)
    needs_copy = not Y.has_canonical_format or (Y.nnz and not np.all(Y.data != 0))
    if needs_copy:
        Y = Y.copy()
        Y.sum_duplicates()
        Y.eliminate_zeros()
    return Y


def _hits(top: np.ndarray, Y: sp.csr_matrix) -> np.ndarray:
    """Boolean ``(n, k)``: is ``top[i, j]`` one of row ``i``'s labels in canonical CSR ``Y``
    (negative ids, padding, never are), by a search in the sorted global keys."""
    n, n_labels = Y.shape
    n_pos = np.diff(Y.indptr).astype(np.int64)
    rows = np.repeat(np.arange(n, dtype=np.int64), n_pos)
    y_keys = rows * n_labels + Y.indices.astype(np.int64)  # sorted: canonical CSR
    if not y_keys.size:
        return np.zeros(top.shape, dtype=bool)
    q_keys = np.arange(n, dtype=np.int64)[:, None] * n_labels + top
    pos = np.minimum(np.searchsorted(y_keys, q_keys), y_keys.size - 1)
    return (y_keys[pos] == q_keys) & (top >= 0)


def label_hits(top_labels, Y) -> np.ndarray:
    """Boolean ``(n, k)``: is each predicted label id of ``top_labels`` (host or CuPy, as
    :meth:`TopKMetrics.update` takes them) one of its row's labels in ``Y``; the hits
    :class:`TopKMetrics` counts, row by row (the loss probe compares two models with them)."""
    top = _as_host_int_array(top_labels)
    Y = _canonical_csr(Y)
    if top.shape[0] != Y.shape[0]:
        raise ValueError(f"top_labels has {top.shape[0]} rows but Y has {Y.shape[0]}")
    return _hits(top, Y)


class TopKMetrics:
    """Streaming accumulator of P@k, nDCG@k, R@k (and PSP@k, PSnDCG@k) over test batches.

    Feeding the test set in batches gives the same result (up to float rounding) as one call on
    the whole set; see the module docstring for definitions and conventions.

    Parameters
    ----------
    ks : iterable of int
        Cut-offs, each ``>= 1``.
    propensity : array-like, optional
        float, shape ``(n_labels,)``, host: label propensities ``p_l > 0`` (e.g. from
        :func:`jain_propensity`). When given, ``PSP@k`` and ``PSnDCG@k`` are reported too.

    Attributes
    ----------
    n_samples : int
        Test rows seen so far.
    """

    def __init__(self, ks: Iterable[int] = (1, 3, 5), propensity=None):
        ks = tuple(sorted({int(k) for k in ks}))
        if not ks or ks[0] < 1:
            raise ValueError(f"ks must be a non-empty set of integers >= 1, got {ks}")
        self.ks = ks
        self.kmax = ks[-1]
        self.inv_propensity = None
        if propensity is not None:
            p = np.asarray(propensity, dtype=np.float64)
            if p.ndim != 1:
                raise ValueError(f"propensity must be 1-D (n_labels,), got shape {p.shape}")
            if p.size and not (np.all(np.isfinite(p)) and p.min() > 0):
                raise ValueError("propensities must be finite and > 0")
            self.inv_propensity = 1.0 / p
        # discount[j] = 1 / log2(j + 2) for 0-based position j; idcg[m] = sum of the first m
        self._discount = 1.0 / np.log2(np.arange(self.kmax) + 2.0)
        self._idcg = np.concatenate([[0.0], np.cumsum(self._discount)])
        self.reset()

    def reset(self) -> None:
        """Forget every batch seen so far."""
        self.n_samples = 0
        nk = len(self.ks)
        self._sums = {name: np.zeros(nk) for name in
                      ("P", "R", "nDCG", "PSP_num", "PSP_den", "PSnDCG_num", "PSnDCG_den")}

    def update(self, top_labels, Y_batch) -> TopKMetrics:
        """Add one batch of predictions.

        Parameters
        ----------
        top_labels : array-like of int
            Shape ``(n, k)`` with ``k >= min(max(ks), n_labels)``, host (NumPy, anything with
            ``__array__``, or CuPy, which is copied to the host): predicted label ids of each row
            sorted by descending score. Columns past ``max(ks)`` are ignored; negative ids are
            padding.
        Y_batch : scipy.sparse matrix
            Shape ``(n, n_labels)``, CSR preferred, host: the true labels of the same rows.

        Returns
        -------
        TopKMetrics
            ``self``.
        """
        top = _as_host_int_array(top_labels)
        Y = _canonical_csr(Y_batch)
        n, n_labels = Y.shape
        if top.shape[0] != n:
            raise ValueError(f"top_labels has {top.shape[0]} rows but Y_batch has {n}")
        if top.shape[1] < min(self.kmax, n_labels):
            raise ValueError(
                f"top_labels has {top.shape[1]} columns, fewer than max(ks)={self.kmax} "
                f"(n_labels={n_labels})")
        if self.inv_propensity is not None and self.inv_propensity.shape[0] != n_labels:
            raise ValueError(f"propensity has {self.inv_propensity.shape[0]} entries but Y_batch "
                             f"has n_labels={n_labels}")
        top = top[:, :self.kmax]
        if top.size and top.max() >= n_labels:
            raise ValueError(f"top_labels holds label id {int(top.max())} >= n_labels={n_labels}")
        if n == 0:
            return self
        k_avail = top.shape[1]
        if k_avail > 1:
            srt = np.sort(top, axis=1)
            dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(axis=1)
            if dup.any():
                row = int(np.flatnonzero(dup)[0])
                raise ValueError(f"top_labels row {row} repeats a label id: {top[row].tolist()}")

        hit = _hits(top, Y)
        n_pos = np.diff(Y.indptr).astype(np.int64)
        hit_pad = np.zeros((n, self.kmax))
        hit_pad[:, :k_avail] = hit

        ks_idx = np.array(self.ks) - 1
        ks_arr = np.array(self.ks, dtype=np.float64)
        cum_hits = np.cumsum(hit_pad, axis=1)[:, ks_idx]                # (n, len(ks))
        cum_dcg = np.cumsum(hit_pad * self._discount, axis=1)[:, ks_idx]
        idcg = self._idcg[np.minimum(n_pos[:, None], ks_arr[None, :].astype(np.int64))]
        has = n_pos > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            inv_idcg = np.where(idcg > 0, 1.0 / idcg, 0.0)
            inv_npos = np.where(has, 1.0 / np.maximum(n_pos, 1), 0.0)
        s = self._sums
        s["P"] += (cum_hits / ks_arr).sum(axis=0)
        s["R"] += (cum_hits * inv_npos[:, None]).sum(axis=0)
        s["nDCG"] += (cum_dcg * inv_idcg).sum(axis=0)

        if self.inv_propensity is not None:
            w_top = np.zeros((n, self.kmax))
            w_top[:, :k_avail] = np.where(hit, self.inv_propensity[np.maximum(top, 0)], 0.0)
            # best achievable: each row's true labels by descending inverse propensity
            rows = np.repeat(np.arange(n, dtype=np.int64), n_pos)
            w_true = self.inv_propensity[Y.indices]
            order = np.lexsort((-w_true, rows))
            rank = np.arange(Y.nnz, dtype=np.int64) - np.repeat(Y.indptr[:-1].astype(np.int64),
                                                                 n_pos)
            keep = rank < self.kmax
            w_best = np.zeros((n, self.kmax))
            w_best[rows[keep], rank[keep]] = w_true[order][keep]
            for key, w in (("num", w_top), ("den", w_best)):
                s["PSP_" + key] += (np.cumsum(w, axis=1)[:, ks_idx] / ks_arr).sum(axis=0)
                dcg = np.cumsum(w * self._discount, axis=1)[:, ks_idx]
                s["PSnDCG_" + key] += (dcg * inv_idcg).sum(axis=0)
        self.n_samples += n
        return self

    def result(self) -> dict:
        """Metrics over every row seen so far.

        Returns
        -------
        dict
            ``{"P@k": float, ..., "nDCG@k": ..., "R@k": ..., ["PSP@k": ..., "PSnDCG@k": ...]}``
            for each ``k`` in ``ks``, in that order; 0.0 everywhere before any row was seen
            (and a PS metric is 0.0 when no row has a label).
        """
        s, n = self._sums, max(self.n_samples, 1)
        out = {}
        names = [("P", "P"), ("nDCG", "nDCG"), ("R", "R")]
        for key, name in names:
            for i, k in enumerate(self.ks):
                out[f"{name}@{k}"] = float(s[key][i] / n)
        if self.inv_propensity is not None:
            for name in ("PSP", "PSnDCG"):
                for i, k in enumerate(self.ks):
                    den = s[name + "_den"][i]
                    out[f"{name}@{k}"] = float(s[name + "_num"][i] / den) if den > 0 else 0.0
        return out


def evaluate(top_labels, Y, ks: Iterable[int] = (1, 3, 5), propensity=None) -> dict:
    """Metrics of a whole test set at once (a one-call :class:`TopKMetrics`).

    Parameters
    ----------
    top_labels : array-like of int
        Shape ``(n_samples, k)``: predicted label ids sorted by descending score.
    Y : scipy.sparse matrix
        Shape ``(n_samples, n_labels)``: true labels.
    ks : iterable of int
        Cut-offs.
    propensity : array-like, optional
        float, shape ``(n_labels,)``: label propensities (adds ``PSP@k`` and ``PSnDCG@k``).

    Returns
    -------
    dict
        See :meth:`TopKMetrics.result`.
    """
    return TopKMetrics(ks, propensity).update(top_labels, Y).result()
