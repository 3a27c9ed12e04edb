"""Synthetic generator: determinism, shapes, statistics, power-law head, learnability."""

from __future__ import annotations

import time

import numpy as np
import pytest
from xmc_engine.datasets import make_synthetic


def test_default_shapes_speed_and_stats():
    t0 = time.perf_counter()
    Xtr, Ytr, Xte, Yte = make_synthetic()
    assert time.perf_counter() - t0 < 3.0
    assert Xtr.shape == (20000, 5000) and Ytr.shape == (20000, 2000)
    assert Xte.shape == (5000, 5000) and Yte.shape == (5000, 2000)
    for M in (Xtr, Ytr, Xte, Yte):
        assert M.dtype == np.float32 and M.has_canonical_format
        M2 = M.copy()
        M2.sort_indices()
        assert (M2 != M).nnz == 0
    assert 36 <= Xtr.nnz / 20000 <= 44 and 3.6 <= Ytr.nnz / 20000 <= 4.4
    nnz = np.diff(Xtr.indptr)
    assert np.percentile(nnz, 99) > 3 * np.median(nnz)  # heavy tail
    np.testing.assert_allclose(np.sqrt(Xtr.multiply(Xtr).sum(1)).A1, 1, rtol=1e-5)


def test_seeded_determinism():
    a = make_synthetic(n_train=500, n_test=100, seed=7)
    b = make_synthetic(n_train=500, n_test=100, seed=7)
    c = make_synthetic(n_train=500, n_test=100, seed=8)
    assert all((x != y).nnz == 0 and np.array_equal(x.data, y.data) for x, y in zip(a, b,
                                                                                     strict=True))
    assert (a[0] != c[0]).nnz > 0


def test_power_law_head():
    _, Y, _, _ = make_synthetic(n_train=20000, n_test=0)
    freq = np.sort(np.bincount(Y.indices, minlength=Y.shape[1]))[::-1]
    top1 = freq[:20].sum() / freq.sum()  # top 1% of 2000 labels
    assert top1 > 0.15  # uniform would give 0.01
    assert freq[0] > 20 * np.median(freq[freq > 0])


@pytest.mark.parametrize("preset,nnz,lab", [("amazon670k", 75.7, 5.45),
                                            ("delicious200k", 301.0, 75.54)])
def test_large_presets_small_override(preset, nnz, lab):
    Xtr, Ytr, Xte, Yte = make_synthetic(preset, n_train=3000, n_test=500)
    assert Xtr.shape[0] == 3000 and Xte.shape[0] == 500
    assert Xtr.shape[1] == {"amazon670k": 135909, "delicious200k": 782585}[preset]
    assert abs(Xtr.nnz / 3000 - nnz) / nnz < 0.1
    assert abs(Ytr.nnz / 3000 - lab) / lab < 0.1


def test_learnable_knn_beats_popular():
    Xtr, Ytr, Xte, Yte = make_synthetic(n_train=8000, n_test=1000, seed=3)
    freq = np.asarray(Ytr.sum(0)).ravel()
    popular = Yte[:, int(freq.argmax())].toarray().mean()
    S = (Xte @ Xtr.T).toarray()  # cosine: rows are L2-normalised
    nn = np.argpartition(-S, 10, axis=1)[:, :10]
    hits = 0
    for i in range(Xte.shape[0]):
        votes = np.asarray(Ytr[nn[i]].sum(0)).ravel()
        hits += Yte[i, int(votes.argmax())]
    knn = hits / Xte.shape[0]
    assert knn > popular + 0.25 and knn > 2 * popular, (knn, popular)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown synthetic preset"):
        make_synthetic("nope")
    with pytest.raises(ValueError, match="n_labels"):
        make_synthetic(n_labels=0)
