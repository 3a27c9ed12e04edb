"""CUDA kernels of xmc_engine.kernels against kernels/reference.py.

Runs under the numba CUDA simulator (CI: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m cudasim``,
NumPy arrays through ``cuda.to_device``, small sizes) or on a real GPU (CuPy arrays, one
non-blocking stream shared by CuPy and numba). Skipped, with the reason, otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sps
from xmc_engine.kernels import _cuda, bce_output, merge, output_layer, reference, sparse_backward
from xmc_engine.kernels import sparse_forward as sf
from xmc_engine.kernels import topk as tk

from xmc_engine.backends import cuda_available

pytestmark = [
    pytest.mark.cudasim,
    pytest.mark.skipif(
        not (_cuda.CUDASIM or cuda_available()),
        reason="CUDA kernels need NUMBA_ENABLE_CUDASIM=1 (set before numba is imported) or a "
        "usable CUDA device",
    ),
]

F32 = np.float32


def random_csr(rng, n_rows, n_cols, density, index_dtype=np.int32):
    """CSR parts with an empty row 1 (when n_rows > 2); density 0 gives nnz == 0."""
    X = sps.random(n_rows, n_cols, density=density, format="csr", dtype=F32, random_state=rng)
    X.data = rng.uniform(0.1, 1.0, X.nnz).astype(F32)
    if n_rows > 2:
        X = X.tolil()
        X[1, :] = 0
        X = X.tocsr()
        X.eliminate_zeros()
    return X.indptr.astype(index_dtype), X.indices.astype(index_dtype), X.data.astype(F32)


def random_labels(rng, n_rows, n_labels):
    """Label CSR (indptr, indices) where every third row (1, 4, ...) has no label."""
    rows = [np.sort(rng.choice(n_labels, size=0 if i % 3 == 1 else
                               int(rng.integers(1, min(4, n_labels) + 1)), replace=False))
            for i in range(n_rows)]
    indptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
    return indptr, np.concatenate(rows).astype(np.int32)


class Device:
    """Moves arrays in and out: cuda.to_device under the simulator, CuPy on a real GPU."""

    def __init__(self):
        self.sim = _cuda.CUDASIM
        if self.sim:
            self.stream = 0
        else:
            import cupy

            self.cp = cupy
            self.cp_stream = cupy.cuda.Stream(non_blocking=True)
            self.stream = _cuda.cuda.external_stream(self.cp_stream.ptr)

    def __call__(self, a):
        a = np.ascontiguousarray(a)
        if self.sim:
            return _cuda.cuda.to_device(a)
        with self.cp_stream:
            return _cuda.cuda.as_cuda_array(self.cp.asarray(a), sync=False)

    def host(self, d):
        if self.sim:
            return d.copy_to_host()
        out = d.copy_to_host(stream=self.stream)
        self.cp_stream.synchronize()  # synchronize!
        return out


@pytest.fixture(scope="module")
def dev():
    return Device()


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


SHAPES = [(1, 10, 8, 0.5), (5, 40, 37, 0.1), (4, 20, 16, 0.0)]


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", SHAPES)
def test_sparse_forward_kernel(dev, rng, shape, index_dtype):
    B, F, nh, dens = shape
    ip, ix, d = random_csr(rng, B, F, dens, index_dtype)
    W1 = rng.standard_normal((F, nh)).astype(F32)
    b1 = rng.standard_normal(nh).astype(F32)
    out = dev(np.full((B, nh), np.nan, F32))
    sf.sparse_forward_launch(dev(ip), dev(ix), dev(d), dev(W1), dev(b1), out, dev.stream)
    np.testing.assert_allclose(dev.host(out), reference.sparse_forward(ip, ix, d, W1, b1),
                               atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_sparse_backward_kernels(dev, rng, shape):
    B, F, nh, dens = shape
    ip, ix, d = random_csr(rng, B, F, dens, np.int64)
    dZ1 = rng.standard_normal((B, nh)).astype(F32)
    W1 = rng.standard_normal((F, nh)).astype(F32)
    b1 = rng.standard_normal(nh).astype(F32)
    Wd, bd = dev(W1), dev(b1)
    sparse_backward.sparse_backward_update_launch(dev(ip), dev(ix), dev(d), dev(dZ1), Wd, bd,
                                                  0.3, dev.stream)
    Wr, br = reference.sparse_backward_update(ip, ix, d, dZ1, W1, b1, 0.3)
    np.testing.assert_allclose(dev.host(Wd), Wr, atol=1e-5)
    np.testing.assert_allclose(dev.host(bd), br, atol=1e-5)

    rows = np.unique(ix.astype(np.int64))
    inv = np.searchsorted(rows, ix)
    g, gb = dev(np.zeros((len(rows), nh), F32)), dev(np.zeros(nh, F32))
    sparse_backward.sparse_grad_launch(dev(ip), dev(inv), dev(d), dev(dZ1), g, gb, dev.stream)
    r_rows, r_g, r_gb = reference.sparse_grad(ip, ix, d, dZ1)
    np.testing.assert_array_equal(rows, r_rows)
    np.testing.assert_allclose(dev.host(g), r_g, atol=1e-5)
    np.testing.assert_allclose(dev.host(gb), r_gb, atol=1e-5)

    Wd = dev(W1)
    sparse_backward.sparse_rows_update_launch(Wd, dev(rows), dev(r_g.astype(F32)), 0.3,
                                              dev.stream)
    np.testing.assert_allclose(dev.host(Wd), reference.sparse_rows_update(W1, rows, r_g, 0.3),
                               atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1), (9, 70)])
def test_relu_backward_kernel(dev, rng, shape):
    dH = rng.standard_normal(shape).astype(F32)
    H = np.maximum(rng.standard_normal(shape), 0).astype(F32)
    d = dev(dH)
    sparse_backward.relu_backward_launch(d, dev(H), dev.stream)
    np.testing.assert_array_equal(dev.host(d), reference.relu_backward(dH, H))


@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("B,L,seg", [(1, 1, None), (4, 45, None), (5, 45, 8), (3, 70, 16),
                                     (9, 300, 256)])
def test_softmax_xent_kernel(dev, rng, B, L, seg, use_bias):
    """The tiled softmax (several label segments when ``seg`` < L, a row without labels) gives
    the reference dZ, per-row losses and column sums."""
    Z = (rng.standard_normal((B, L)) * 5).astype(F32)
    Z[0, 0] = 80.0
    bias = rng.standard_normal(L).astype(F32)
    yp, yi = random_labels(rng, B, L)  # row 1 has no label: zero gradient, zero loss
    Zb = Z + bias if use_bias else Z
    dZr, loss_r = reference.softmax_xent(Zb.astype(np.float64), yp, yi, 0.25)
    Zd, loss_rows = dev(Z), dev(np.zeros(B, np.float64))
    work = dev(np.full(output_layer.softmax_work_size(B, L, seg), np.nan, F32))
    colsum = dev(np.zeros(L, F32))
    output_layer.softmax_xent_launch(Zd, dev(yp), dev(yi), 0.25, loss_rows, work, colsum,
                                     dev.stream, bias=dev(bias) if use_bias else None, seg=seg)
    np.testing.assert_allclose(dev.host(Zd), dZr, atol=2e-6)
    assert dev.host(loss_rows).sum() == pytest.approx(loss_r, rel=1e-5)
    np.testing.assert_allclose(dev.host(colsum), dZr.sum(axis=0), atol=1e-5)
    if B > 1:
        assert not dev.host(Zd)[1].any() and dev.host(loss_rows)[1] == 0


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("C", [11, 40])
def test_bce_kernels_in_chunks_match_the_reference(dev, rng, C, weighted):
    """The logistic loss's three kernels, a label chunk at a time (labels outside a chunk are
    skipped; a row without labels has zero gradient), give the reference dZ, loss and column
    sums; with column weights too."""
    B, L = 5, 40
    Z = (rng.standard_normal((B, L)) * 5).astype(F32)
    Z[0, 0] = 80.0
    bias = rng.standard_normal(L).astype(F32)
    colw = rng.uniform(0.5, 3.0, L).astype(F32) if weighted else None
    yp, yi = random_labels(rng, B, L)
    dZr, loss_r = reference.bce_xent((Z + bias).astype(np.float64), yp, yi, 0.25, colw)
    ypd, yid = dev(yp), dev(yi)
    loss = dev(np.zeros(1, np.float64))
    got, sums = [], []
    for c0 in range(0, L, C):
        Zc = dev(np.ascontiguousarray(Z[:, c0:c0 + C]))
        w = dev(colw[c0:c0 + C] if weighted else np.zeros(0, F32))
        colsum = dev(np.zeros(Z[:, c0:c0 + C].shape[1], F32))
        bce_output.bce_launch(Zc, dev(bias[c0:c0 + C]), True, c0, w, ypd, yid, 0.25, loss,
                              colsum, dev.stream)
        got.append(dev.host(Zc))
        sums.append(dev.host(colsum))
    np.testing.assert_allclose(np.hstack(got), dZr, atol=2e-6)
    assert dev.host(loss)[0] == pytest.approx(loss_r, rel=1e-5)
    np.testing.assert_allclose(np.concatenate(sums), dZr.sum(axis=0), atol=1e-5)
    assert not np.hstack(got)[1].any()


def test_softmax_rowblock_kernel_matches_the_reference(dev, rng):
    """The previous design, kept for the GPU check's timing comparison, stays correct."""
    B, L = 3, 40
    Z = (rng.standard_normal((B, L)) * 5).astype(F32)
    bias = rng.standard_normal(L).astype(F32)
    yp, yi = random_labels(rng, B, L)
    dZr, loss_r = reference.softmax_xent((Z + bias).astype(np.float64), yp, yi, 0.5)
    Zd, loss_rows = dev(Z), dev(np.zeros(B, np.float64))
    output_layer.softmax_rowblock_launch(Zd, dev(yp), dev(yi), 0.5, loss_rows, dev.stream,
                                         bias=dev(bias))
    np.testing.assert_allclose(dev.host(Zd), dZr, atol=2e-6)
    assert dev.host(loss_rows).sum() == pytest.approx(loss_r, rel=1e-5)


@pytest.mark.parametrize("C", [7, 20])
def test_softmax_chunk_kernels_compose_to_the_full_gradient(dev, rng, C):
    B, L = 4, 30
    Z = (rng.standard_normal((B, L)) * 3).astype(F32)
    bias = rng.standard_normal(L).astype(F32)
    yp, yi = random_labels(rng, B, L)
    dZr, loss_r = reference.softmax_xent((Z + bias).astype(np.float64), yp, yi, 0.5)
    m, s, ys = dev(np.full(B, -np.inf, F32)), dev(np.zeros(B, F32)), dev(np.zeros(B, F32))
    ypd, yid = dev(yp), dev(yi)
    for c0 in range(0, L, C):
        Zc = dev(Z[:, c0:c0 + C])
        output_layer.softmax_chunk_stats_launch(Zc, dev(bias[c0:c0 + C]), c0, ypd, yid, m, s,
                                                ys, dev.stream)
    m, s, ys = dev.host(m), dev.host(s), dev.host(ys)
    lse = np.empty(B, F32)
    loss = output_layer.chunk_loss_cpu(m, s, ys, yp, lse)
    assert loss == pytest.approx(loss_r, rel=1e-5)
    for c0 in range(0, L, C):
        Zc = dev(Z[:, c0:c0 + C])
        output_layer.softmax_chunk_grad_launch(Zc, dev(bias[c0:c0 + C]), c0, ypd, yid, dev(lse),
                                               0.5, dev.stream)
        np.testing.assert_allclose(dev.host(Zc), dZr[:, c0:c0 + C], atol=2e-6)


def test_column_sum_kernel(dev, rng):
    X = rng.standard_normal((70, 5)).astype(F32)
    out = dev(np.ones(5, F32))
    sparse_backward.column_sum_launch(dev(X), out, -0.5, dev.stream)
    np.testing.assert_allclose(dev.host(out), 1 - 0.5 * X.sum(0), atol=1e-5)


@pytest.mark.parametrize("B,L,k", [(1, 1, 1), (3, 50, 4), (2, 5, 5)])
def test_topk_kernel(dev, rng, B, L, k):
    scores = rng.standard_normal((B, L)).astype(F32)
    if L > 2:
        scores[0, :2] = scores[0, 2]  # ties: lower index first
    shape = tk.topk_scratch_shape(B, k)
    ci, cv = dev(np.zeros(shape, np.int64)), dev(np.zeros(shape, F32))
    idx, val = dev(np.zeros((B, k), np.int64)), dev(np.zeros((B, k), F32))
    tk.topk_launch(dev(scores), k, ci, cv, idx, val, dev.stream)
    ir, vr = reference.topk(scores, k)
    np.testing.assert_array_equal(dev.host(idx), ir)
    np.testing.assert_array_equal(dev.host(val), vr)


def test_topk_merge_kernel(dev, rng):
    a = rng.standard_normal((5, 12)).astype(F32)
    b = rng.standard_normal((5, 9)).astype(F32)
    ia, va = reference.topk(a, 4)
    ib, vb = reference.topk(b, 4)
    io, vo = dev(np.zeros((5, 4), np.int64)), dev(np.zeros((5, 4), F32))
    tk.topk_merge_launch(dev(ia), dev(va), dev(ib + 12), dev(vb), io, vo, dev.stream)
    ir, vr = reference.topk(np.hstack([a, b]), 4)
    np.testing.assert_array_equal(dev.host(io), ir)
    np.testing.assert_array_equal(dev.host(vo), vr)


@pytest.mark.parametrize("n", [1, 300])
def test_merge_kernels(dev, rng, n):
    arrs = [rng.standard_normal(n).astype(F32) for _ in range(3)]
    out = dev(np.zeros(n, F32))
    merge.weighted_sum_launch([dev(a) for a in arrs], [0.2, 0.5, 0.3], out, dev.stream)
    np.testing.assert_allclose(dev.host(out), reference.weighted_sum(arrs, [0.2, 0.5, 0.3]),
                               atol=1e-6)
    merge.momentum_launch(dev(arrs[0]), dev(arrs[1]), dev(arrs[2]), 0.9, out, dev.stream)
    np.testing.assert_allclose(dev.host(out), reference.momentum(*arrs, 0.9), atol=1e-6)
    x, diff = dev(arrs[0]), dev(np.zeros(n, F32))
    merge.elastic_launch(x, dev(arrs[1]), 0.3, diff, dev.stream)
    xr, dr = reference.elastic(arrs[0], arrs[1], 0.3)
    np.testing.assert_allclose(dev.host(x), xr, atol=1e-6)
    np.testing.assert_allclose(dev.host(diff), dr, atol=1e-6)


@pytest.mark.parametrize("n_rows", [0, 1, 7])
def test_adagrad_kernels(dev, rng, n_rows):
    from xmc_engine.kernels import adagrad

    w = rng.standard_normal(37).astype(F32)
    g = rng.standard_normal(37).astype(F32)
    acc = rng.random(37).astype(F32)
    w_ref, acc_ref = reference.adagrad_dense(w, g, acc, 0.1, 1e-10)
    wd, ad = dev(w), dev(acc)
    adagrad.adagrad_dense_launch(wd, dev(g), ad, 0.1, 1e-10, dev.stream)
    np.testing.assert_allclose(dev.host(wd), w_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dev.host(ad), acc_ref, rtol=1e-5)
    W = rng.standard_normal((11, 5)).astype(F32)
    accW = rng.random((11, 5)).astype(F32)
    rows = np.sort(rng.choice(11, n_rows, replace=False)).astype(np.int64)
    grad = rng.standard_normal((n_rows, 5)).astype(F32)
    W_ref, accW_ref = reference.adagrad_rows(W, rows, grad, accW, 0.2, 1e-10)
    Wd, aWd = dev(W), dev(accW)
    adagrad.adagrad_rows_launch(Wd, dev(rows), dev(grad), aWd, 0.2, 1e-10, dev.stream)
    np.testing.assert_allclose(dev.host(Wd), W_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dev.host(aWd), accW_ref, rtol=1e-5)
