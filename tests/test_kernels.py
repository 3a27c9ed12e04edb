"""CPU kernels of xmc_engine.kernels against kernels/reference.py (and finite differences)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sps
from xmc_engine.kernels import merge, output_layer, reference, sparse_backward, sparse_forward
from xmc_engine.kernels import topk as topk_mod

from xmc_engine.backends.cpu import CPUBackend

F32 = np.float32


def random_csr(rng, n_rows, n_cols, density, index_dtype=np.int32, empty_rows=True):
    X = sps.random(n_rows, n_cols, density=density, format="csr", dtype=F32, random_state=rng)
    X.data = rng.uniform(0.1, 1.0, X.nnz).astype(F32)
    if empty_rows and n_rows > 2:
        X = X.tolil()
        X[1, :] = 0  # an empty row
        X = X.tocsr()
        X.eliminate_zeros()
    X.sort_indices()
    return X.indptr.astype(index_dtype), X.indices.astype(index_dtype), X.data.astype(F32)


def random_labels(rng, n_rows, n_labels, index_dtype=np.int32):
    rows = []
    for i in range(n_rows):
        n = 0 if i % 3 == 1 else int(rng.integers(1, min(4, n_labels) + 1))
        rows.append(np.sort(rng.choice(n_labels, size=n, replace=False)))
    indptr = np.zeros(n_rows + 1, np.int64)
    indptr[1:] = np.cumsum([len(r) for r in rows])
    idx = np.concatenate(rows) if rows else np.zeros(0)
    return indptr.astype(index_dtype), idx.astype(index_dtype)


SHAPES = [  # (B, n_features, n_hidden, density)
    (1, 10, 8, 0.5),
    (7, 50, 13, 0.1),
    (33, 200, 37, 0.05),
    (5, 20, 16, 0.0),  # nnz == 0
]


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", SHAPES)
def test_sparse_forward(rng, shape, index_dtype):
    B, F, nh, dens = shape
    ip, ix, d = random_csr(rng, B, F, dens, index_dtype)
    W1 = rng.standard_normal((F, nh)).astype(F32)
    b1 = rng.standard_normal(nh).astype(F32)
    out = np.full((B, nh), np.nan, F32)
    sparse_forward.sparse_forward_cpu(ip, ix, d, W1, b1, out)
    np.testing.assert_allclose(out, reference.sparse_forward(ip, ix, d, W1, b1), atol=1e-5)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", SHAPES)
def test_sparse_grad_and_updates(rng, shape, index_dtype):
    B, F, nh, dens = shape
    ip, ix, d = random_csr(rng, B, F, dens, index_dtype)
    dZ1 = rng.standard_normal((B, nh)).astype(F32)
    rows, g, gb = sparse_backward.sparse_grad_cpu(ip, ix, d, dZ1)
    r_rows, r_g, r_gb = reference.sparse_grad(ip, ix, d, dZ1)
    assert rows.dtype == np.int64
    np.testing.assert_array_equal(rows, r_rows)
    np.testing.assert_allclose(g, r_g, atol=1e-5)
    np.testing.assert_allclose(gb, r_gb, atol=1e-5)

    W1 = rng.standard_normal((F, nh)).astype(F32)
    b1 = rng.standard_normal(nh).astype(F32)
    W, b = W1.copy(), b1.copy()
    sparse_backward.sparse_backward_update_cpu(ip, ix, d, dZ1, W, b, 0.3)
    Wr, br = reference.sparse_backward_update(ip, ix, d, dZ1, W1, b1, 0.3)
    np.testing.assert_allclose(W, Wr, atol=1e-5)
    np.testing.assert_allclose(b, br, atol=1e-5)
    untouched = np.setdiff1d(np.arange(F), r_rows)
    np.testing.assert_array_equal(W[untouched], W1[untouched])  # bitwise: never written

    W = W1.copy()
    sparse_backward.sparse_rows_update_cpu(W, rows, g, 0.3)
    np.testing.assert_allclose(W, reference.sparse_rows_update(W1, r_rows, r_g, 0.3), atol=1e-5)


def test_sparse_backward_matches_finite_differences(rng):
    """d/dW1 of sum(relu(X W1 + b1) * G) through relu_backward and sparse_grad (float64 ref)."""
    B, F, nh = 6, 15, 5
    ip, ix, d = random_csr(rng, B, F, 0.3)
    W1 = rng.standard_normal((F, nh))
    b1 = rng.standard_normal(nh)
    G = rng.standard_normal((B, nh))

    def f(W, b):
        return float((reference.sparse_forward(ip, ix, d, W, b) * G).sum())

    H = reference.sparse_forward(ip, ix, d, W1.astype(F32), b1.astype(F32))
    dZ1 = G.astype(F32).copy()
    sparse_backward.relu_backward_cpu(dZ1, H)
    rows, g, gb = sparse_backward.sparse_grad_cpu(ip, ix, d, dZ1)
    eps = 1e-6
    for u, fi in enumerate(rows[:3]):
        for j in range(nh):
            Wp, Wm = W1.copy(), W1.copy()
            Wp[fi, j] += eps
            Wm[fi, j] -= eps
            assert g[u, j] == pytest.approx((f(Wp, b1) - f(Wm, b1)) / (2 * eps), abs=1e-4)
    for j in range(nh):
        bp, bm = b1.copy(), b1.copy()
        bp[j] += eps
        bm[j] -= eps
        assert gb[j] == pytest.approx((f(W1, bp) - f(W1, bm)) / (2 * eps), abs=1e-4)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (17, 130)])
def test_relu_backward(rng, shape):
    dH = rng.standard_normal(shape).astype(F32)
    H = np.maximum(rng.standard_normal(shape), 0).astype(F32)
    expect = reference.relu_backward(dH, H)
    sparse_backward.relu_backward_cpu(dH, H)
    np.testing.assert_array_equal(dH, expect)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("B,L", [(1, 1), (1, 5), (7, 33), (20, 1000)])
def test_softmax_xent(rng, B, L, index_dtype):
    Z = (rng.standard_normal((B, L)) * 5).astype(F32)
    Z[0, 0] = 80.0  # large logit: the max subtraction must keep exp finite
    yp, yi = random_labels(rng, B, L, index_dtype)
    dZr, loss_r = reference.softmax_xent(Z.astype(np.float64), yp, yi, 0.25)
    loss = output_layer.softmax_xent_cpu(Z, yp, yi, 0.25)
    assert loss == pytest.approx(loss_r, rel=1e-5, abs=1e-5)
    np.testing.assert_allclose(Z, dZr, atol=2e-6)
    for i in range(B):
        if yp[i + 1] == yp[i]:
            assert not Z[i].any()  # rows without labels: zero gradient


def test_softmax_xent_extreme_logits():
    Z = np.array([[1000.0, -1000.0, 0.0], [-1e4, -1e4, -1e4]], F32)
    yp, yi = np.array([0, 1, 2]), np.array([1, 0])
    loss = output_layer.softmax_xent_cpu(Z, yp, yi, 1.0)
    assert np.isfinite(loss) and loss == pytest.approx(2000.0 + np.log(3), rel=1e-5)
    assert np.isfinite(Z).all()


def _problem(rng, B, nh, L, index_dtype=np.int32):
    H = np.maximum(rng.standard_normal((B, nh)), 0).astype(F32)
    W2 = (rng.standard_normal((nh, L)) * 0.5).astype(F32)
    b2 = (rng.standard_normal(L) * 0.1).astype(F32)
    yp, yi = random_labels(rng, B, L, index_dtype)
    return H, W2, b2, yp, yi


CHUNKS = [None, 1, 7, 16, 40]  # 7 does not divide L=30; 40 >= L is the plain path


@pytest.mark.parametrize("label_chunk", CHUNKS)
@pytest.mark.parametrize("B", [1, 9])
def test_output_layer_step_matches_reference(rng, B, label_chunk):
    be = CPUBackend()
    H, W2, b2, yp, yi = _problem(rng, B, 6, 30)
    loss_r, W2r, b2r, dHr = reference.output_layer_step(
        H.astype(np.float64), W2.astype(np.float64), b2.astype(np.float64), yp, yi, 0.5)
    W, b, dH = W2.copy(), b2.copy(), np.full_like(H, np.nan)
    loss = be.output_layer_step(H, W, b, yp, yi, 0.5, dH, label_chunk=label_chunk)
    assert isinstance(loss, float)
    assert loss == pytest.approx(loss_r, rel=1e-5)
    np.testing.assert_allclose(W, W2r, atol=2e-6)
    np.testing.assert_allclose(b, b2r, atol=2e-6)
    np.testing.assert_allclose(dH, dHr, atol=2e-6)


@pytest.mark.parametrize("label_chunk", CHUNKS)
def test_output_layer_grad_matches_finite_differences(rng, label_chunk):
    be = CPUBackend()
    B, nh, L = 5, 4, 30
    H, W2, b2, yp, yi = _problem(rng, B, nh, L)
    loss, dW2, db2, dH = be.output_layer_grad(H, W2, b2, yp, yi, label_chunk=label_chunk)
    H64, W64, b64 = H.astype(np.float64), W2.astype(np.float64), b2.astype(np.float64)

    def mean_loss(H_, W_, b_):
        return reference.output_layer_loss(H_, W_, b_, yp, yi) / B

    eps = 1e-6
    for (a, g, idx) in [(W64, dW2, (1, 3)), (W64, dW2, (3, 29)), (b64, db2, (7,)),
                        (H64, dH, (2, 1)), (H64, dH, (0, 0))]:
        ap, am = a.copy(), a.copy()
        ap[idx] += eps
        am[idx] -= eps
        args_p = [ap if x is a else x for x in (H64, W64, b64)]
        args_m = [am if x is a else x for x in (H64, W64, b64)]
        fd = (mean_loss(*args_p) - mean_loss(*args_m)) / (2 * eps)
        assert g[idx] == pytest.approx(fd, abs=1e-5)
    assert loss == pytest.approx(reference.output_layer_loss(H64, W64, b64, yp, yi), rel=1e-5)


def test_chunked_equals_plain(rng):
    be = CPUBackend()
    H, W2, b2, yp, yi = _problem(rng, 12, 8, 101)
    outs = []
    for ch in (None, 10, 33):
        W, b, dH = W2.copy(), b2.copy(), np.empty_like(H)
        loss = be.output_layer_step(H, W, b, yp, yi, 0.1, dH, label_chunk=ch)
        outs.append((loss, W, b, dH))
    for loss, W, b, dH in outs[1:]:
        assert loss == pytest.approx(outs[0][0], rel=1e-5)
        np.testing.assert_allclose(W, outs[0][1], atol=1e-6)
        np.testing.assert_allclose(b, outs[0][2], atol=1e-6)
        np.testing.assert_allclose(dH, outs[0][3], atol=1e-6)


def test_output_layer_empty_batch():
    be = CPUBackend()
    H = np.zeros((0, 4), F32)
    W2, b2 = np.ones((4, 6), F32), np.ones(6, F32)
    dH = np.zeros((0, 4), F32)
    assert be.output_layer_step(H, W2, b2, np.zeros(1, np.int32), np.zeros(0, np.int32), 0.1,
                                dH) == 0.0
    assert (W2 == 1).all() and (b2 == 1).all()


@pytest.mark.parametrize("B,L,k", [(1, 1, 1), (4, 10, 3), (13, 100, 10), (3, 5, 9)])
def test_topk(rng, B, L, k):
    scores = rng.standard_normal((B, L)).astype(F32)
    idx, val = CPUBackend.topk(scores, k)
    ir, vr = reference.topk(scores, k)
    np.testing.assert_array_equal(idx, ir)
    np.testing.assert_array_equal(val, vr)


def test_topk_ties_prefer_lower_index():
    scores = np.array([[1, 3, 3, 0, 3, 2]], F32)
    idx, val = CPUBackend.topk(scores, 4)
    np.testing.assert_array_equal(idx, [[1, 2, 4, 5]])


def test_topk_merge(rng):
    a = rng.standard_normal((6, 20)).astype(F32)
    b = rng.standard_normal((6, 15)).astype(F32)
    ia, va = reference.topk(a, 5)
    ib, vb = reference.topk(b, 5)
    ib += 20
    io, vo = np.empty((6, 5), np.int64), np.empty((6, 5), F32)
    topk_mod.topk_merge_cpu(ia, va, ib, vb, io, vo)
    ir, vr = reference.topk(np.hstack([a, b]), 5)
    np.testing.assert_array_equal(io, ir)
    np.testing.assert_array_equal(vo, vr)


@pytest.mark.parametrize("label_chunk", [None, 3, 7, 64])
def test_predict_scores_topk(rng, label_chunk):
    H, W2, b2, _, _ = _problem(rng, 9, 5, 50)
    idx, val = CPUBackend().predict_scores_topk(H, W2, b2, 5, label_chunk=label_chunk)
    ir, vr = reference.predict_scores_topk(H, W2, b2, 5)
    np.testing.assert_array_equal(idx, ir)
    np.testing.assert_allclose(val, vr, rtol=1e-5, atol=1e-6)


def _bench(name):
    """A module of ``bench/`` (its helpers serve the tests too)."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    return importlib.import_module(name)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("label_chunk", [None, 1, 3, 7, 64])
@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("blocks", [1, 3])
def test_the_folded_prediction_is_the_merged_one(rng, monkeypatch, order, label_chunk, k,
                                                 blocks):
    """Folding each chunk into the running lists (bias added in the pass) gives the labels and
    scores of bias, top-k and merge per chunk, bit for bit, ties (small integer logits, many
    equal) to the lower label; also where the backend folds blocks of rows on several
    threads (``blocks=3``: 11 rows in blocks of 3, 4 and 4, two of them on the pool)."""
    from xmc_engine.backends import cpu as cpu_mod
    from xmc_engine.output_layer import predict_scores_topk

    submitted = []
    if blocks > 1:
        monkeypatch.setattr(cpu_mod, "FOLD_ENTRIES_PER_THREAD", 1)
        monkeypatch.setattr(CPUBackend, "_n_parts", staticmethod(lambda B: min(blocks, B)))
        pool = cpu_mod._fold_pool()
        monkeypatch.setattr(pool, "submit",
                            lambda *a, _s=pool.submit: submitted.append(a) or _s(*a))
    H = rng.integers(0, 3, (11, 4)).astype(F32)
    W2 = np.asarray(rng.integers(-2, 3, (4, 50)), F32, order=order)
    b2 = rng.integers(-1, 2, 50).astype(F32)
    folded = predict_scores_topk(CPUBackend(), H, W2, b2, k, label_chunk=label_chunk)
    n_chunks = 1 if label_chunk is None else -(-50 // label_chunk)
    assert len(submitted) == (blocks - 1) * n_chunks
    # the CPU backend without topk_fold: the path of every other backend
    unfolded = _bench("bench_predict").Unfolded(CPUBackend())
    assert not hasattr(unfolded, "topk_fold") and hasattr(CPUBackend(), "topk_fold")
    merged = predict_scores_topk(unfolded, H, W2, b2, k, label_chunk=label_chunk)
    for a, b in zip(folded, merged, strict=True):
        np.testing.assert_array_equal(a, b)
    ir, vr = reference.predict_scores_topk(H, np.ascontiguousarray(W2), b2, k)
    np.testing.assert_array_equal(folded[0], ir)


def test_topk_fold_skips_nan_and_keeps_its_count(rng):
    """A NaN logit is never taken; a row's count of kept labels grows chunk by chunk up to k."""
    from xmc_engine.kernels import topk as topk_kernels

    idx, val = np.empty((2, 3), np.int64), np.empty((2, 3), F32)
    filled = np.zeros(2, np.int64)
    Z = np.array([[np.nan, 1.0], [2.0, 0.5]], F32)
    topk_kernels.topk_fold_cpu(Z, np.zeros(2, F32), 0, idx, val, filled)
    assert filled.tolist() == [1, 2]
    topk_kernels.topk_fold_cpu(np.array([[3.0], [0.5]], F32), np.array([1.0], F32), 2, idx, val,
                               filled)
    assert filled.tolist() == [2, 3]
    assert idx[0, :2].tolist() == [2, 1] and val[0, :2].tolist() == [4.0, 1.0]
    assert idx[1].tolist() == [0, 2, 1] and val[1].tolist() == [2.0, 1.5, 0.5]


@pytest.mark.parametrize("shape", [(1,), (1000,), (7, 13)])
def test_merge_ops(rng, shape):
    arrs = [rng.standard_normal(shape).astype(F32) for _ in range(3)]
    w = [0.2, 0.5, 0.3]
    out = np.empty(shape, F32)
    merge.weighted_sum_cpu(arrs, w, out)
    np.testing.assert_allclose(out, reference.weighted_sum(arrs, w), atol=1e-6)
    merge.momentum_cpu(arrs[0], arrs[1], arrs[2], 0.9, out)
    np.testing.assert_allclose(out, reference.momentum(arrs[0], arrs[1], arrs[2], 0.9),
                               atol=1e-6)
    x = arrs[0].copy()
    diff = np.empty(shape, F32)
    merge.elastic_cpu(x, arrs[1], 0.3, diff)
    xr, dr = reference.elastic(arrs[0], arrs[1], 0.3)
    np.testing.assert_allclose(x, xr, atol=1e-6)
    np.testing.assert_allclose(diff, dr, atol=1e-6)


def test_weighted_sum_rejects_mismatch():
    with pytest.raises(ValueError, match="2 arrays but 3 weights"):
        merge.weighted_sum_cpu([np.zeros(2, F32)] * 2, [1, 0, 0], np.zeros(2, F32))


def test_sgemm_rm_strided_views_in_place(rng):
    from xmc_engine.backends.cpu import sgemm_rm

    W = rng.standard_normal((6, 40)).astype(F32)
    H = rng.standard_normal((5, 6)).astype(F32)
    Z = rng.standard_normal((5, 9)).astype(F32)
    W0, Wc = W.copy(), W[:, 7:16]                       # strided chunk, updated in place
    assert sgemm_rm(-0.5, H.T, Z, 1.0, Wc)
    ref = W0.copy()
    ref[:, 7:16] -= 0.5 * H.T @ Z
    np.testing.assert_allclose(W, ref, atol=1e-5)
    dH = rng.standard_normal((5, 6)).astype(F32)
    d0 = dH.copy()
    assert sgemm_rm(1.0, Z, W[:, 7:16].T, 1.0, dH)      # dH += Z @ W_chunk^T
    np.testing.assert_allclose(dH, d0 + Z @ W[:, 7:16].T, atol=1e-5)
    assert not sgemm_rm(1.0, Z, W[:, 7:16].T, 1.0, dH[:, :3])  # shape mismatch: nothing done


def test_predict_bench_times_the_paths_and_finds_them_equal(tmp_path, capsys):
    """``bench/bench_predict.py`` end to end on a small shape: the three paths give the same
    labels and scores, and the file holds the four timings per chunk and k."""
    import json

    bench_predict = _bench("bench_predict")
    out = tmp_path / "predict.json"
    bench_predict.main(["--labels", "3000", "--hidden", "8", "--rows", "16", "--chunks", "700",
                        "--k", "1", "5", "--repeats", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["label_chunk"], r["k"]) for r in rows] == [(700, 1), (700, 5)]
    for r in rows:
        assert r["same_labels"] and r["same_scores"]
        assert min(r["folded_s"], r["region_s"], r["merged_s"], r["sgemm_s"]) > 0
    assert "bare sgemm" in capsys.readouterr().out
