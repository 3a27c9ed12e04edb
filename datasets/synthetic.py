"""Seeded generator of XMC-like data sets whose labels depend on the features.

Generative story (per row, vectorised over chunks of rows):

1. Label popularity follows a power law: the label of popularity rank ``r`` is drawn with
   probability proportional to ``r ** -label_alpha`` (label ids are a seeded permutation of the
   ranks, so id 0 is not the most popular label).
2. A row draws ``k`` labels (geometric, mean ``avg_labels``: many rows with one or two labels, a
   long tail), with repeats removed.
3. Every label owns ``topic_size`` "topic" features (uniform at random). A row draws ``m``
   feature tokens (log-normal, mean ``avg_nnz``: heavy-tailed): a share ``signal`` of them picks
   one of the row's labels and one of its topic features, the rest is noise drawn from a
   power-law feature popularity (``feature_alpha``).
4. Token counts give the values ``1 + log(count)``; every row is L2-normalised.

A short pilot run measures how many draws repeats remove and scales the draws so that the
averages of the result match ``avg_nnz`` and ``avg_labels``. The same ``seed`` and sizes give
the same matrices on every machine (NumPy's PCG64 ``default_rng``).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import scipy.sparse as sp

from xmc_engine import progress

logger = logging.getLogger(__name__)

_DRAWS_PER_CHUNK = 4_000_000


@dataclasses.dataclass(frozen=True)
class SyntheticPreset:
    """Sizes and statistics of a synthetic data set (see :func:`make_synthetic`)."""

    n_train: int
    n_test: int
    n_features: int
    n_labels: int
    avg_nnz: float
    avg_labels: float
    label_alpha: float = 0.9
    feature_alpha: float = 1.0
    topic_size: int = 0  # 0: max(10, ceil(2 * avg_nnz / avg_labels))
    signal: float = 0.45
    note: str = ""


PRESETS: dict[str, SyntheticPreset] = {
    "default": SyntheticPreset(
        20_000, 5_000, 5_000, 2_000, 40.0, 4.0,
        note="the CLI main job's data set: a 128-hidden MLP trains a few epochs in ~1 min on "
             "2 cores"),
    "amazon670k": SyntheticPreset(
        490_449, 153_025, 135_909, 670_091, 75.7, 5.45,
        note="shape of Amazon-670K (XC repository)"),
    "delicious200k": SyntheticPreset(
        196_606, 100_095, 782_585, 205_443, 301.0, 75.54,
        note="shape of Delicious-200K (XC repository)"),
}


def make_synthetic(preset: str = "default", *, n_train: int | None = None,
                   n_test: int | None = None, n_features: int | None = None,
                   n_labels: int | None = None, seed: int = 0):
    """Generate a seeded XMC-like train/test pair.

    Parameters
    ----------
    preset : {"default", "amazon670k", "delicious200k"}
        Sizes and statistics (:data:`PRESETS`); the keyword arguments override the sizes.
    n_train, n_test, n_features, n_labels : int, optional
        Override the preset's sizes (statistics such as the average nnz stay).
    seed : int
        Seed of the generator; equal arguments give equal matrices.

    Returns
    -------
    X_train : scipy.sparse.csr_matrix, shape (n_train, n_features), float32
    Y_train : scipy.sparse.csr_matrix, shape (n_train, n_labels), float32 ones
    X_test : scipy.sparse.csr_matrix, shape (n_test, n_features), float32
    Y_test : scipy.sparse.csr_matrix, shape (n_test, n_labels), float32 ones
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown synthetic preset {preset!r}; choose from {sorted(PRESETS)}")
    p = PRESETS[preset]
    sizes = dict(n_train=n_train, n_test=n_test, n_features=n_features, n_labels=n_labels)
    p = dataclasses.replace(p, **{k: v for k, v in sizes.items() if v is not None})
    for k in ("n_train", "n_test"):
        if getattr(p, k) < 0:
            raise ValueError(f"{k}={getattr(p, k)} must be >= 0")
    for k in ("n_features", "n_labels"):
        if getattr(p, k) < 1:
            raise ValueError(f"{k}={getattr(p, k)} must be >= 1")
    gen = _Generator(p, seed)
    X, Y = gen.rows(p.n_train + p.n_test)
    return X[: p.n_train], Y[: p.n_train], X[p.n_train:], Y[p.n_train:]


def _power_law_cdf(n: int, alpha: float, rng) -> tuple[np.ndarray, np.ndarray]:
    w = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    return cdf, rng.permutation(n).astype(np.int64)


class _Generator:
    def __init__(self, p: SyntheticPreset, seed: int):
        self.p = p
        rng = np.random.default_rng([seed, 0])
        self.label_cdf, self.label_ids = _power_law_cdf(p.n_labels, p.label_alpha, rng)
        self.feat_cdf, self.feat_ids = _power_law_cdf(p.n_features, p.feature_alpha, rng)
        t = p.topic_size or max(10, int(np.ceil(2 * p.avg_nnz / p.avg_labels)))
        self.topic_size = min(t, p.n_features)
        self.topics = rng.integers(0, p.n_features, size=(p.n_labels, self.topic_size),
                                   dtype=np.int32 if p.n_features < 2**31 else np.int64)
        self.max_labels = max(1, min(p.n_labels, int(10 * p.avg_labels)))
        self.max_nnz = max(1, min(p.n_features, int(20 * p.avg_nnz)))
        # Pilot: how much do repeats shrink the draws? Scale the draws to compensate.
        self.label_scale = self.nnz_scale = 1.0
        pilot = np.random.default_rng([seed, 1])
        X, Y = self._chunk(pilot, 2000)
        self.label_scale = float(np.clip(p.avg_labels / max(Y.nnz / 2000, 1e-9), 1.0, 3.0))
        for _ in range(2):
            X, Y = self._chunk(pilot, 2000)
            self.nnz_scale = float(np.clip(self.nnz_scale * p.avg_nnz / max(X.nnz / 2000, 1e-9),
                                           1.0, 3.0))
        self.rng = np.random.default_rng([seed, 2])

    def rows(self, n_rows: int):
        chunk = max(1, int(_DRAWS_PER_CHUNK // max(self.p.avg_nnz * self.nnz_scale, 1.0)))
        xs, ys = [], []
        with progress.bar(total=n_rows, desc="synthetic", unit="rows") as pbar:
            for start in range(0, n_rows, chunk):
                n = min(chunk, n_rows - start)
                X, Y = self._chunk(self.rng, n)
                xs.append(X)
                ys.append(Y)
                pbar.update(n)
        if not xs:
            return (sp.csr_matrix((0, self.p.n_features), dtype=np.float32),
                    sp.csr_matrix((0, self.p.n_labels), dtype=np.float32))
        X = sp.vstack(xs, format="csr") if len(xs) > 1 else xs[0]
        Y = sp.vstack(ys, format="csr") if len(ys) > 1 else ys[0]
        return X, Y

    def _chunk(self, rng, n: int):
        p = self.p
        # ---- labels: geometric counts, power-law choice, repeats removed
        mean_k = max(p.avg_labels * self.label_scale, 1.0)
        k = np.minimum(rng.geometric(1.0 / mean_k, size=n), self.max_labels)
        rows = np.repeat(np.arange(n, dtype=np.int64), k)
        lab = self.label_ids[np.searchsorted(self.label_cdf, rng.random(len(rows)), side="right")
                             .clip(max=p.n_labels - 1)]
        Y = _dedup_csr(rows, lab, n, p.n_labels, counts=False)
        # ---- features: topic tokens of the row's labels + power-law noise
        sigma = 0.8
        mu = np.log(p.avg_nnz * self.nnz_scale) - sigma**2 / 2
        m = np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), 1, self.max_nnz).astype(np.int64)
        rows = np.repeat(np.arange(n, dtype=np.int64), m)
        feats = self.feat_ids[np.searchsorted(self.feat_cdf, rng.random(len(rows)), side="right")
                              .clip(max=p.n_features - 1)]
        y_count = np.diff(Y.indptr)
        is_signal = (rng.random(len(rows)) < p.signal) & (y_count[rows] > 0)
        r = rows[is_signal]
        pos = Y.indptr[r] + (rng.random(len(r)) * y_count[r]).astype(np.int64)
        topic = rng.integers(0, self.topic_size, size=len(r))
        feats[is_signal] = self.topics[Y.indices[pos], topic]
        X = _dedup_csr(rows, feats, n, p.n_features, counts=True)
        return X, Y


def _dedup_csr(rows, cols, n_rows, n_cols, *, counts: bool):
    """CSR of the distinct ``(row, col)`` pairs; ``counts``: values ``1 + log(count)``, L2-norm."""
    key = rows * np.int64(n_cols) + cols
    if counts:
        key, cnt = np.unique(key, return_counts=True)
    else:
        key = np.unique(key)
    r = key // n_cols
    c = (key - r * n_cols).astype(np.int32)
    indptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(r, minlength=n_rows), out=indptr[1:])
    if counts:
        data = (1.0 + np.log(cnt)).astype(np.float32)
        norms = np.sqrt(np.add.reduceat(data.astype(np.float64) ** 2, indptr[:-1])
                        if len(data) else np.zeros(n_rows))
        row_of = np.repeat(np.arange(n_rows), np.diff(indptr))
        data /= norms[row_of].astype(np.float32)
    else:
        data = np.ones(len(c), dtype=np.float32)
    if indptr[-1] < 2**31:
        indptr = indptr.astype(np.int32)
    M = sp.csr_matrix((data, c, indptr), shape=(n_rows, n_cols))
    M.has_canonical_format = True
    return M
