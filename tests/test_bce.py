"""The one-vs-all logistic loss (``loss="bce"``): kernel, host-level layer, fused step, estimator.

The specification is ``kernels/reference.py``'s ``bce_xent``; the fused CPU step's reference is
the host-level step through the backend (as for the softmax, ``tests/test_train_step.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from xmc_engine.kernels import bce_output, reference

from tests.conftest import real_dataset
from tests.test_estimator import tiny_data
from tests.test_train_step import _assert_same_gradient, _assert_same_state, _data_with_edge_rows
from xmc_engine import XMCClassifier
from xmc_engine.backends import get_backend
from xmc_engine.config import TrainConfig
from xmc_engine.errors import ConfigError
from xmc_engine.model import MLPReplica, ModelShape, init_params, init_params_for_data
from xmc_engine.output_layer import output_layer_grad, output_layer_step

F32 = np.float32
_NONE = np.empty(0, F32)


def _batch(B=9, L=70, seed=0, empty_row=2):
    """Logits (B, L), bias, and a label CSR pattern with one row without labels."""
    rng = np.random.default_rng(seed)
    Z = (3 * rng.normal(size=(B, L))).astype(F32)
    b = rng.normal(size=L).astype(F32)
    ptr, idx = [0], []
    for i in range(B):
        k = 0 if i == empty_row else int(rng.integers(1, 6))
        idx += list(rng.choice(L, k, replace=False))
        ptr.append(len(idx))
    return Z, b, np.array(ptr, np.int64), np.array(idx, np.int64)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("n_parts", [1, 3])
def test_bce_kernel_matches_the_reference(weighted, n_parts):
    Z, b, yp, yi = _batch()
    B, L = Z.shape
    colw = np.random.default_rng(1).uniform(0.5, 4.0, L).astype(F32) if weighted else _NONE
    dZ, loss = reference.bce_xent(Z + b, yp, yi, 1.0 / B, colw if weighted else None)
    out, loss_rows = Z.copy(), np.zeros(B)
    parts = np.full((n_parts, L), np.nan, F32)  # the kernel zeroes its parts itself
    bce_output.bce_fused_cpu(out, b, True, 0, colw, yp, yi, 1.0 / B, loss_rows, parts)
    np.testing.assert_allclose(out, dZ, rtol=1e-5, atol=1e-7)
    assert loss_rows.sum() == pytest.approx(loss, rel=1e-5)
    assert loss_rows[2] == 0 and not out[2].any()  # the row without labels
    np.testing.assert_allclose(parts.sum(0), dZ.sum(0), rtol=1e-4, atol=1e-6)
    # sanity of the specification itself: the gradient of the loss (finite differences)
    z0 = (Z + b).astype(np.float64)
    i, j = 0, int(yi[0])
    for jj in (j, (j + 1) % L):
        zp, zm = z0.copy(), z0.copy()
        zp[i, jj] += 1e-4
        zm[i, jj] -= 1e-4
        fd = (reference.bce_xent(zp, yp, yi, 1.0, colw if weighted else None)[1]
              - reference.bce_xent(zm, yp, yi, 1.0, colw if weighted else None)[1]) / 2e-4
        assert dZ[i, jj] * B == pytest.approx(fd, rel=1e-3, abs=1e-4)


def test_bce_kernel_in_label_chunks_adds_up_to_the_whole():
    Z, b, yp, yi = _batch(L=75)
    B = Z.shape[0]
    whole, rows_w = Z.copy(), np.zeros(B)
    bce_output.bce_fused_cpu(whole, b, True, 0, _NONE, yp, yi, 1.0 / B, rows_w,
                             np.zeros((2, 75), F32))
    rows_c = np.zeros(B)  # the chunks add to one loss per row
    pieces = []
    for c0, c1 in [(0, 32), (32, 64), (64, 75)]:
        Zc = np.ascontiguousarray(Z[:, c0:c1])
        bce_output.bce_fused_cpu(Zc, b[c0:c1], True, c0, _NONE, yp, yi, 1.0 / B, rows_c,
                                 np.zeros((2, c1 - c0), F32))
        pieces.append(Zc)
    np.testing.assert_allclose(np.hstack(pieces), whole, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(rows_c, rows_w, rtol=1e-5)


def test_bce_xent_cpu_without_bias_and_the_extreme_logits():
    Z, _, yp, yi = _batch()
    Z[0, :4] = [80.0, -80.0, 1e-3, -1e-3]  # exp(-|z|) underflows / sits at 1
    dZ, loss = reference.bce_xent(Z, yp, yi, 0.5)
    out = Z.copy()
    assert bce_output.bce_xent_cpu(out, yp, yi, 0.5) == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(out, dZ, rtol=1e-5, atol=1e-7)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("label_chunk", [None, 16])
def test_host_output_layer_step_and_grad_with_bce(label_chunk):
    rng = np.random.default_rng(3)
    B, nh, L = 6, 5, 40
    H = np.maximum(rng.normal(size=(B, nh)), 0).astype(F32)
    W2 = rng.normal(size=(nh, L)).astype(F32)
    b2 = rng.normal(size=L).astype(F32)
    _, _, yp, yi = _batch(B=B, L=L)
    dZ, loss = reference.bce_xent(H @ W2 + b2, yp, yi, 1.0 / B)
    be = get_backend("cpu", threads=1)
    total, dW2, db2, dH = output_layer_grad(be, H, W2, b2, yp, yi, label_chunk=label_chunk,
                                            loss="bce")
    assert total == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(dW2, H.T @ dZ, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(db2, dZ.sum(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dH, dZ @ W2.T, rtol=1e-4, atol=1e-6)
    W2s, b2s, dHs = W2.copy(), b2.copy(), np.empty((B, nh), F32)
    step = output_layer_step(be, H, W2s, b2s, yp, yi, 0.3, dHs, label_chunk=label_chunk,
                             loss="bce")
    assert step == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(W2s, W2 - 0.3 * (H.T @ dZ), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(b2s, b2 - 0.3 * dZ.sum(0), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="loss='hinge'"):
        output_layer_grad(be, H, W2, b2, yp, yi, loss="hinge")


def _pair(X, Y, optimizer, **kw):
    params = init_params(ModelShape(X.shape[1], Y.shape[1], (16,)), seed=1)
    return [MLPReplica(get_backend("cpu", threads=1), X, Y, params, optimizer=optimizer,
                       fused=fused, loss="bce", **kw) for fused in (True, False)]


@pytest.mark.parametrize("output", ["exact", "sampled"])
@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_fused_bce_step_equals_the_host_level_step(optimizer, output):
    X, Y = _data_with_edge_rows()
    fused, host = _pair(X, Y, optimizer, output=output, negatives=5, seed=4)
    assert fused._fused and not host._fused
    rng = np.random.default_rng(0)
    for step in range(20):
        rows = rng.integers(0, X.shape[0], 1 + step % 9)
        if step == 4:
            rows = np.array([3, 50, 51])  # no labels at all
        lf, lh = fused.train_batch(rows, 0.1), host.train_batch(rows, 0.1)
        assert lf == pytest.approx(lh, rel=1e-5, abs=1e-6)
    _assert_same_state(fused, host, optimizer)
    _assert_same_gradient(fused, host, rng.integers(0, X.shape[0], 8))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
def test_sampled_bce_negatives_and_with_all_of_them_is_exact(monkeypatch, weighted, fused):
    """With every other label drawn (weight 1) the sampled step is the exact one; with a few
    uniform ones, each negative's gradient column is its exact value, or ``(L - n_pos) / K``
    times it with ``BCE_WEIGHTED_NEGATIVES``."""
    import xmc_engine.output_layer as host_layer

    monkeypatch.setattr(host_layer, "BCE_WEIGHTED_NEGATIVES", weighted)
    X, Y = tiny_data(n=120)[:2]
    L = Y.shape[1]
    params = init_params(ModelShape(X.shape[1], L, (8,)), seed=2)
    be = get_backend("cpu", threads=1)
    rows = np.arange(10)
    exact = MLPReplica(be, X, Y, params, loss="bce", output="exact")
    full = MLPReplica(be, X, Y, params, loss="bce", output="sampled", negatives=L, fused=fused,
                      negative_sampling="uniform")
    le, ge = exact.grad_batch(rows)
    ls, gs = full.grad_batch(rows)
    assert ls == pytest.approx(le, rel=1e-5)
    cols, dW2s = gs[-2]
    np.testing.assert_allclose(dW2s, ge[-2][:, cols], rtol=1e-4, atol=1e-7)
    few = MLPReplica(be, X, Y, params, loss="bce", output="sampled", negatives=3, seed=1,
                     fused=fused, negative_sampling="uniform")
    _, gf = few.grad_batch(rows)
    cols, db2s = gf[-1]
    n_pos = len(np.unique(Y[rows].indices))
    w = (L - n_pos) / (len(cols) - n_pos) if weighted else 1.0
    np.testing.assert_allclose(db2s[n_pos:], w * ge[-1][cols[n_pos:]], rtol=1e-4)
    np.testing.assert_allclose(db2s[:n_pos], ge[-1][cols[:n_pos]], rtol=1e-4, atol=1e-7)


def test_bce_output_biases_start_at_minus_log_labels():
    X, Y = tiny_data(n=50)[:2]
    shape = ModelShape(X.shape[1], Y.shape[1], (8,))
    soft = init_params_for_data(shape, X, 0)
    bce = init_params_for_data(shape, X, 0, loss="bce")
    np.testing.assert_allclose(bce[-1], soft[-1] - np.log(Y.shape[1]), rtol=1e-6)
    for a, b in zip(soft[:-1], bce[:-1], strict=True):
        np.testing.assert_array_equal(a, b)


def test_loss_is_validated_by_the_config_and_the_replica():
    with pytest.raises(ConfigError, match="loss='hinge'"):
        TrainConfig(loss="hinge")
    X, Y = tiny_data(n=20)[:2]
    params = init_params(ModelShape(X.shape[1], Y.shape[1], (4,)), seed=0)
    with pytest.raises(ValueError, match="loss='hinge'"):
        MLPReplica(get_backend("cpu", threads=1), X, Y, params, loss="hinge")


def test_estimator_with_bce_learns_and_gives_sigmoid_probabilities():
    X, Y = tiny_data()
    X, Xt, Y, Yt = X[:500], X[500:], Y[:500], Y[500:]
    # the network's own sigmoids (no neighbour votes blended in: tests/test_neighbours.py)
    clf = XMCClassifier(loss="bce", hidden=16, epochs=10, seed=0, eval_every=0,
                        neighbours=0).fit(X, Y)
    assert clf.score(Xt, Yt) > 0.4  # popularity: 0.1 (measured: 0.57; softmax 0.62)
    labels, scores = clf.predict_topk(Xt[:5], 4)
    P = clf.predict_proba(Xt[:5], k=4)
    expected = 1.0 / (1.0 + np.exp(-scores.astype(np.float64)))
    np.testing.assert_allclose(np.take_along_axis(P.toarray(), labels, 1), expected, rtol=1e-5)
    # a threshold keeps every label whose sigmoid reaches it, however many there are
    low = 0.5 * float(expected[:, -1].min())
    picked = clf.predict(Xt[:5], threshold=low)
    full = 1.0 / (1.0 + np.exp(-clf.decision_function(Xt[:5], k=Y.shape[1]).toarray()))
    dense = clf.decision_function(Xt[:5], k=Y.shape[1])
    want = sp.csr_matrix((full >= low) & (dense.toarray() != 0))
    assert (picked != want).nnz == 0
    assert picked.sum(axis=1).min() > 4


@pytest.mark.slow
def test_the_readmes_advice_for_real_data_band(data_dir):
    """``--loss bce`` (its default rate 0.1), what the README tells users with real
    multi-label data to pass,
    keeps its lead over the softmax default on debian_debtags (3 epochs, one thread; the
    default's band, ``tests/test_quality.py``: P@1 0.80, measured 0.818). Measured P@1 / P@3 /
    P@5 0.839 / 0.616 / 0.464."""
    from xmc_engine.datasets import load_dataset

    real_dataset(data_dir, "debian_debtags")  # skips with a reason when absent
    X, Y, Xt, Yt = load_dataset(str(data_dir / "debian_debtags"))
    m = XMCClassifier(loss="bce", epochs=3, threads=1, eval_every=0, seed=0).fit(
        X, Y, eval_set=(Xt, Yt))
    assert m.metrics_["P@1"] >= 0.83, m.metrics_
    assert m.metrics_["P@3"] >= 0.60, m.metrics_


def test_a_saved_bce_model_loads_with_its_loss(tmp_path):
    X, Y = tiny_data(n=120)
    clf = XMCClassifier(loss="bce", hidden=8, epochs=1, seed=0, eval_every=0).fit(X, Y)
    loaded = XMCClassifier.load(clf.save(tmp_path / "m"))
    assert loaded.loss == "bce"
    np.testing.assert_allclose(loaded.predict_proba(X[:4], k=3).toarray(),
                               clf.predict_proba(X[:4], k=3).toarray(), rtol=1e-6)
