"""Every dataset in ../shared/data loads with the counts its README gives."""

from __future__ import annotations

import numpy as np
import pytest
from xmc_engine.datasets import get_dataset_info, load_dataset, load_xc

from tests.conftest import real_dataset

# README summary table: train, test, D, L, feat nnz (train), labels/point (train), and the
# absolute tolerance implied by the digits the README prints for nnz.
README = {
    "bibtex": (4880, 2515, 1836, 159, 68.49, 2.38, 0.005),
    "delicious": (12920, 3185, 500, 983, 18.54, 19.05, 0.005),
    "corel5k": (4500, 500, 499, 374, 8.2, 3.52, 0.05),
    "stackex_cooking": (8393, 2098, 577, 400, 16.0, 2.22, 0.05),
    "stackex_cs": (7416, 1854, 635, 274, 20.0, 2.56, 0.05),
    "rcv1sub1": (4800, 1200, 47236, 101, 77.4, 2.90, 0.05),
    "imdb": (96735, 24184, 1001, 28, 19.4, 2.00, 0.05),
    "debian_debtags": (24215, 6088, 29261, 590, 47.4, 3.70, 0.05),
}


@pytest.mark.parametrize("name", sorted(README))
def test_real_dataset_counts(data_dir, name, tmp_path, monkeypatch):
    monkeypatch.setenv("XMC_CACHE_DIR", str(tmp_path))
    train, test = real_dataset(data_dir, name)
    n_train, n_test, d, ell, nnz, lab, tol = README[name]
    X, Y = load_xc(train, cache=False)
    Xt, Yt = load_xc(test, cache=False)
    assert X.shape == (n_train, d) and Y.shape == (n_train, ell)
    assert Xt.shape == (n_test, d) and Yt.shape == (n_test, ell)
    assert abs(X.nnz / n_train - nnz) <= tol + 1e-9
    assert abs(Y.nnz / n_train - lab) <= 0.005 + 1e-9
    for M in (X, Y, Xt, Yt):
        assert M.has_canonical_format and M.dtype == np.float32
    assert np.all(Y.data == 1) and np.all(np.isfinite(X.data))
    info = get_dataset_info(name)
    assert (info.n_train, info.n_test, info.n_features, info.n_labels) == (n_train, n_test, d, ell)


def test_real_edge_cases(data_dir):
    X, Y = load_xc(real_dataset(data_dir, "stackex_cooking")[0], cache=False)
    empty = (np.diff(X.indptr) == 0) & (np.diff(Y.indptr) == 0)
    assert empty.sum() >= 1  # the empty line counted by the header
    assert (np.diff(Y.indptr) == 0).sum() == 108
    X, Y = load_xc(real_dataset(data_dir, "delicious")[0], cache=False)
    assert (np.diff(Y.indptr) == 0).sum() == 10  # README: 10 train points without labels
    X, Y = load_xc(real_dataset(data_dir, "imdb")[0], cache=False)
    Xt, Yt = load_xc(real_dataset(data_dir, "imdb")[1], cache=False)
    assert (np.diff(X.indptr) == 0).sum() + (np.diff(Xt.indptr) == 0).sum() == 24


def test_load_dataset_by_name_and_folder(data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XMC_CACHE_DIR", str(tmp_path))
    real_dataset(data_dir, "corel5k")
    a = load_dataset("corel5k")
    b = load_dataset(data_dir / "corel5k")
    c = load_dataset(data_dir / "corel5k" / "test.txt.xz")
    assert [m.shape for m in a] == [(4500, 499), (4500, 374), (500, 499), (500, 374)]
    assert all((x != y).nnz == 0 for x, y in zip(a, b, strict=True))
    assert c[2] is None and c[3] is None and (c[0] != a[2]).nnz == 0
