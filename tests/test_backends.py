"""Backend objects: the interface of backends/__init__.py, on every available backend."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import scipy.sparse as sps
from xmc_engine.kernels import reference

from xmc_engine.backends import get_backend

F32 = np.float32

METHODS = [
    "asarray", "to_host", "csr_parts", "synchronize", "thread_budget", "empty", "zeros",
    "copy_into", "sparse_forward", "sparse_backward_update", "sparse_grad", "sparse_rows_update",
    "relu_backward", "softmax_xent", "output_layer_step", "output_layer_grad",
    "predict_scores_topk", "topk", "weighted_sum", "momentum", "elastic",
]


def test_cpu_and_cuda_backends_mirror_each_other():
    from xmc_engine.backends import cpu, cuda  # importing cuda.py must work without a GPU

    def params(f):
        return [p for p in inspect.signature(f).parameters if p != "self"]

    for name in METHODS:
        c, g = getattr(cpu.CPUBackend, name), getattr(cuda.CUDABackend, name)
        assert params(c) == params(g), name


def test_attributes(backend_name):
    be = get_backend(backend_name)
    assert be.name == backend_name
    assert be.xp.__name__ in ("numpy", "cupy")
    assert (be.device_id is None) == (backend_name == "cpu")


def test_training_like_round_trip(backend_name):
    """forward -> output step -> relu backward -> sparse update, against the reference."""
    be = get_backend(backend_name)
    rng = np.random.default_rng(0)
    B, F, nh, L = 9, 40, 8, 25
    X = sps.random(B, F, density=0.2, format="csr", dtype=F32, random_state=1)
    Y = sps.random(B, L, density=0.1, format="csr", dtype=F32, random_state=2)
    W1 = rng.standard_normal((F, nh)).astype(F32)
    b1 = np.zeros(nh, F32)
    W2 = (rng.standard_normal((nh, L)) * 0.1).astype(F32)
    b2 = np.zeros(L, F32)
    ip, ix, d = be.csr_parts(X)
    yp, yi = be.asarray(Y.indptr), be.asarray(Y.indices)
    dW1, db1, dW2, db2 = (be.asarray(a.copy()) for a in (W1, b1, W2, b2))
    H = be.zeros((B, nh))
    be.sparse_forward(ip, ix, d, dW1, db1, H)
    dH = be.empty((B, nh))
    loss = be.output_layer_step(H, dW2, db2, yp, yi, 0.1, dH)
    be.relu_backward(dH, H)
    be.sparse_backward_update(ip, ix, d, dH, dW1, db1, 0.1)
    be.synchronize()

    Hr = reference.sparse_forward(X.indptr, X.indices, X.data, W1, b1)
    loss_r, W2r, b2r, dHr = reference.output_layer_step(Hr, W2, b2, Y.indptr, Y.indices, 0.1)
    dHr = reference.relu_backward(dHr, Hr)
    W1r, b1r = reference.sparse_backward_update(X.indptr, X.indices, X.data, dHr, W1, b1, 0.1)
    assert float(loss) == pytest.approx(loss_r, rel=1e-5)
    for got, want in [(H, Hr), (dW2, W2r), (db2, b2r), (dW1, W1r), (db1, b1r)]:
        np.testing.assert_allclose(be.to_host(got), want, atol=1e-5)


def test_sparse_grad_then_rows_update(backend_name):
    be = get_backend(backend_name)
    rng = np.random.default_rng(1)
    X = sps.random(6, 30, density=0.2, format="csr", dtype=F32, random_state=3)
    dZ1 = rng.standard_normal((6, 4)).astype(F32)
    W1 = rng.standard_normal((30, 4)).astype(F32)
    rows, g, gb = be.sparse_grad(*be.csr_parts(X), be.asarray(dZ1))
    Wd = be.asarray(W1.copy())
    be.sparse_rows_update(Wd, rows, g, 0.5)
    r_rows, r_g, r_gb = reference.sparse_grad(X.indptr, X.indices, X.data, dZ1)
    np.testing.assert_array_equal(be.to_host(rows), r_rows)
    np.testing.assert_allclose(be.to_host(g), r_g, atol=1e-5)
    np.testing.assert_allclose(be.to_host(gb), r_gb, atol=1e-5)
    np.testing.assert_allclose(be.to_host(Wd), reference.sparse_rows_update(W1, r_rows, r_g, 0.5),
                               atol=1e-5)


def test_topk_merge_ops_and_copies(backend_name):
    be = get_backend(backend_name)
    rng = np.random.default_rng(2)
    s = rng.standard_normal((5, 40)).astype(F32)
    idx, val = be.topk(be.asarray(s), 3)
    ir, vr = reference.topk(s, 3)
    np.testing.assert_array_equal(be.to_host(idx), ir)
    np.testing.assert_array_equal(be.to_host(val), vr)
    a, b = be.asarray(s.copy()), be.asarray(s * 2)
    out = be.empty(s.shape)
    be.weighted_sum([a, b], [0.25, 0.75], out)
    np.testing.assert_allclose(be.to_host(out), 1.75 * s, rtol=1e-6)
    be.momentum(a, b, a, 0.5, out)
    np.testing.assert_allclose(be.to_host(out), s + 0.5 * s, rtol=1e-6)
    diff = be.empty(s.shape)
    be.elastic(b, a, 0.5, diff)
    np.testing.assert_allclose(be.to_host(diff), 0.5 * s, rtol=1e-6)
    np.testing.assert_allclose(be.to_host(b), 1.5 * s, rtol=1e-6)
    c = be.zeros(s.shape)
    be.copy_into(c, a)
    np.testing.assert_array_equal(be.to_host(c), s)


def test_cpu_thread_budget_is_per_thread():
    import threading

    import numba

    be = get_backend("cpu")
    seen = {}

    def worker():
        with be.thread_budget(1):
            seen["inner"] = numba.get_num_threads()

    before = numba.get_num_threads()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["inner"] == 1
    assert numba.get_num_threads() == before
