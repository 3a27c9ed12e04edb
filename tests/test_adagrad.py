"""Adagrad: kernels against the reference, and the optimiser through the estimator."""

from __future__ import annotations

import numpy as np
import pytest
from xmc_engine.kernels import adagrad, reference

from tests.test_estimator import tiny_data
from xmc_engine import XMCClassifier
from xmc_engine.backends import get_backend


@pytest.mark.parametrize("shape", [(0,), (1,), (257,), (33, 7)])
def test_adagrad_dense_matches_reference(shape):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    acc = rng.random(shape).astype(np.float32)
    w_ref, acc_ref = reference.adagrad_dense(w, g, acc, 0.1, 1e-10)
    adagrad.adagrad_dense_cpu(w, g, acc, 0.1, 1e-10)
    np.testing.assert_allclose(acc, acc_ref, rtol=1e-6)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_rows", [0, 1, 5, 40])
def test_adagrad_rows_touches_only_its_rows(n_rows):
    rng = np.random.default_rng(1)
    W = rng.standard_normal((40, 9)).astype(np.float32)
    acc = rng.random((40, 9)).astype(np.float32)
    rows = np.sort(rng.choice(40, n_rows, replace=False)).astype(np.int64)
    grad = rng.standard_normal((n_rows, 9)).astype(np.float32)
    W_ref, acc_ref = reference.adagrad_rows(W, rows, grad, acc, 0.5, 1e-10)
    untouched = np.setdiff1d(np.arange(40), rows)
    W0 = W.copy()
    adagrad.adagrad_rows_cpu(W, rows, grad, acc, 0.5, 1e-10)
    np.testing.assert_allclose(W, W_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acc, acc_ref, rtol=1e-6)
    np.testing.assert_array_equal(W[untouched], W0[untouched])


def _float32_rule(w, acc, g, lr, eps):
    """The rule evaluated by NumPy in float32, in the formula's order: ``(w, acc)``."""
    a = acc + g * g
    return w - np.float32(lr) * g / (np.sqrt(a) + np.float32(eps)), a


@pytest.mark.parametrize("size", [1, 7, 64, 1000, 4099])
def test_cpu_kernels_round_as_the_float32_rule(size):
    """The CPU kernels are compiled without ``fastmath``: every entry, in a vectorised loop or
    not, in either memory order of ``W2``, is the float32 rule's to the last bit (with
    ``fastmath`` 1-2 % of them were 1 ulp off, and the label-major loop could round
    apart from the C-order one: ``bench/bench_adagrad.py``)."""
    from xmc_engine.kernels import sampled_output

    rng = np.random.default_rng(size)
    nh, lr, eps = 33, 0.05, 1e-10
    W = rng.standard_normal((nh, size)).astype(np.float32)
    acc = (rng.random((nh, size)) * 3).astype(np.float32)
    g = rng.standard_normal((nh, size)).astype(np.float32)
    w_want, a_want = _float32_rule(W, acc, g, lr, eps)
    w, a = W.copy(), acc.copy()
    adagrad.adagrad_dense_cpu(w, g, a, lr, eps)
    np.testing.assert_array_equal(w, w_want)
    np.testing.assert_array_equal(a, a_want)
    Wt, At = W.T.copy(), acc.T.copy()  # features x hidden: rows of W1
    rows = np.sort(rng.choice(size, (size + 1) // 2, replace=False)).astype(np.int64)
    adagrad.adagrad_rows_cpu(Wt, rows, np.ascontiguousarray(g.T[rows]), At, lr, eps)
    np.testing.assert_array_equal(Wt[rows], w_want.T[rows])
    np.testing.assert_array_equal(At[rows], a_want.T[rows])
    b, ab = rng.standard_normal(size).astype(np.float32), rng.random(size).astype(np.float32)
    gb = rng.standard_normal(rows.size).astype(np.float32)
    b_want, ab_want = _float32_rule(b[rows], ab[rows], gb, lr, eps)
    for order in "CF":
        w, a, bo, abo = np.array(W, order=order), np.array(acc, order=order), b.copy(), ab.copy()
        sampled_output.adagrad_columns_cpu(w, bo, a, abo, rows,
                                           np.ascontiguousarray(g[:, rows]), gb, lr, eps)
        np.testing.assert_array_equal(w[:, rows], w_want[:, rows], err_msg=order)
        np.testing.assert_array_equal(a[:, rows], a_want[:, rows], err_msg=order)
        np.testing.assert_array_equal(bo[rows], b_want, err_msg=order)
        np.testing.assert_array_equal(abo[rows], ab_want, err_msg=order)


def test_backend_exposes_adagrad():
    be = get_backend("cpu")
    w, g, a = np.ones(4, np.float32), np.full(4, 2.0, np.float32), np.zeros(4, np.float32)
    be.adagrad_dense(w, g, a, 0.5, 0.0)
    np.testing.assert_allclose(w, 0.5)  # 1 - 0.5 * 2 / sqrt(4)
    np.testing.assert_allclose(a, 4.0)


@pytest.mark.parametrize("order", ["C", "F"])
def test_backend_adagrad_on_matrices_of_either_order(order):
    """The backend hands the kernel flat views, so its updates land in the arrays themselves,
    whatever their memory order; a strided array (whose flat form would be a copy) is refused."""
    rng = np.random.default_rng(3)
    w, g = (np.asarray(rng.standard_normal((7, 5)), np.float32, order=order) for _ in range(2))
    acc = np.asarray(rng.random((7, 5)), np.float32, order=order)
    w_ref, acc_ref = reference.adagrad_dense(w.copy(), g, acc.copy(), 0.1, 1e-10)
    get_backend("cpu").adagrad_dense(w, g, acc, 0.1, 1e-10)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acc, acc_ref, rtol=1e-6)
    with pytest.raises(ValueError, match="C-contiguous"):
        get_backend("cpu").adagrad_dense(w[:, ::2], g[:, ::2], acc[:, ::2], 0.1, 1e-10)


def test_adagrad_trains_and_resumes_exactly(tmp_path):
    X, Y = tiny_data()
    kw = dict(hidden=16, epochs=3, batch_size=50, lr=0.05, optimizer="adagrad", seed=2)
    full = XMCClassifier(**kw).fit(X[:500], Y[:500], eval_set=(X[500:], Y[500:]))
    assert full.metrics_["P@1"] > 0.5
    part = XMCClassifier(**{**kw, "epochs": 1.5}, log_dir=str(tmp_path), checkpoint_every=200)
    part.fit(X[:500], Y[:500])
    resumed = XMCClassifier(**kw, log_dir=str(tmp_path), checkpoint_every=200)
    resumed.fit(X[:500], Y[:500], resume=True)
    for a, b in zip(full.params_, resumed.params_, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_unknown_optimizer_is_a_config_error():
    from xmc_engine.errors import ConfigError

    with pytest.raises(ConfigError, match="optimizer"):
        XMCClassifier(optimizer="adam").fit(*tiny_data(n=50))


def test_apply_grads_uses_the_replicas_optimizer():
    """Synchronous SGD applies averaged gradients through the replica: Adagrad replicas step
    with Adagrad (same result as their own train_batch)."""
    from xmc_engine.model import MLPReplica, ModelShape, init_params

    X, Y = tiny_data(n=100)
    be = get_backend("cpu")
    params = init_params(ModelShape(X.shape[1], Y.shape[1], (8,)), seed=0)
    a = MLPReplica(be, X, Y, params, optimizer="adagrad")
    b = MLPReplica(be, X, Y, params, optimizer="adagrad")
    rows = np.arange(0, 40, dtype=np.int64)
    a.train_batch(rows, 0.1)
    _, grads = b.grad_batch(rows)
    b.apply_grads(grads, 0.1)
    for pa, pb in zip(a.params(), b.params(), strict=True):
        np.testing.assert_allclose(pa, pb, rtol=1e-5, atol=1e-6)


def test_adagrad_bench_times_both_builds_and_counts_the_rounding(tmp_path, capsys):
    """``bench/bench_adagrad.py`` end to end on a small shape: the engine's kernels round as
    the float32 rule in every update, and the result file holds both builds' times."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_adagrad

    out = tmp_path / "adagrad.json"
    bench_adagrad.main(["--hidden", "16", "--labels", "3000", "--features", "500",
                        "--batch-rows", "300", "--columns", "200", "--repeats", "2",
                        "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["update"] for r in rows] == ["dense", "rows", "columns (C order)",
                                           "columns (label-major)"]
    for r in rows:
        assert r["ieee_differ"] == 0, r
        assert r["ieee_ms"] > 0 and r["fastmath_ms"] > 0
        assert r["entries"] > 0
    assert rows[0]["entries"] == 16 * 3000
    assert "fastmath / IEEE" in capsys.readouterr().out
