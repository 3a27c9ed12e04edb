"""``W2`` label-major (Fortran order) on the CPU with the sampled output layer
(:func:`xmc_engine.model.label_major_w2`): the column kernels and merges give exactly what they
give in C order, every buffer shaped like the parameters keeps the order, the flat kernels refuse
arrays of different orders, and whole runs of every algorithm train the same model in either
order."""

from __future__ import annotations

import numpy as np
import pytest
from xmc_engine.kernels import merge as mk
from xmc_engine.kernels import sampled_output as so

import xmc_engine.model as model
from tests._trainer import make_trainer
from tests.test_estimator import tiny_data
from xmc_engine.backends import get_backend
from xmc_engine.backends.base import empty_like
from xmc_engine.config import ALGORITHMS
from xmc_engine.devices import parse_devices
from xmc_engine.model import MLPReplica, ModelShape, init_params, label_major_w2

F32 = np.float32


@pytest.fixture(scope="module")
def be():
    return get_backend("cpu", threads=2)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def _orders(a):
    """``a`` in C order and in Fortran order (equal values)."""
    return np.ascontiguousarray(a), np.asfortranarray(a)


def test_the_kernels_tell_the_two_orders_apart():
    a = np.zeros((4, 9), F32)
    assert not so.label_major(a)
    assert so.label_major(np.asfortranarray(a))
    assert not so.label_major(np.zeros((1, 9), F32))  # one row: C and F at once


@pytest.mark.parametrize("m", [0, 1, 37, 300])
def test_column_kernels_give_the_c_order_results_bit_for_bit(rng, m):
    """The gathers are copies, and the Adagrad step is IEEE float32 in both loops (compiled
    without ``fastmath``: with it, the vectorised label-major loop could round
    ``w - lr g / (sqrt(acc) + eps)`` 1 ulp apart from the C-order one)."""
    nh, L = 33, 301
    W2 = rng.standard_normal((nh, L)).astype(F32)
    acc = rng.random((nh, L)).astype(F32)
    b2, acc_b = rng.standard_normal(L).astype(F32), rng.random(L).astype(F32)
    cols = np.sort(rng.choice(L, m, replace=False)).astype(np.int64)
    dW2s, db2s = rng.standard_normal((nh, m)).astype(F32), rng.standard_normal(m).astype(F32)
    out = {}
    for order, (W, A) in (("C", _orders(W2)[0:1] + _orders(acc)[0:1]),
                          ("F", _orders(W2)[1:] + _orders(acc)[1:])):
        W, A, b, ab = W.copy(order="K"), A.copy(order="K"), b2.copy(), acc_b.copy()
        assert so.label_major(W) == (order == "F")
        Ws, bs = np.full((nh, m), np.nan, F32), np.full(m, np.nan, F32)
        so.gather_columns_cpu(W, b, cols, Ws, bs)
        so.adagrad_columns_cpu(W, b, A, ab, cols, dW2s, db2s, 0.1, 1e-10)
        so.scatter_add_columns_cpu(W, b, cols, dW2s, db2s, -0.3)
        out[order] = (Ws, bs, np.array(W), np.array(A), b, ab)
    for c, f in zip(out["C"][:2], out["F"][:2], strict=True):  # the gathers
        np.testing.assert_array_equal(c, f)
    for c, f in zip(out["C"][2:], out["F"][2:], strict=True):  # after Adagrad and the scatter
        np.testing.assert_array_equal(c, f)
    np.testing.assert_array_equal(out["F"][0], W2[:, cols])  # the gather itself


@pytest.mark.parametrize("n", [1, 2, 3])
def test_column_merge_and_copy_give_the_c_order_results(rng, n):
    nh, L, m = 16, 500, 120
    reps = [rng.standard_normal((nh, L)).astype(F32) for _ in range(n)]
    reps[-1][3, 7] = np.nan  # a non-finite entry in a column that is not merged
    cols = np.sort(rng.choice(np.setdiff1d(np.arange(L), [7]), m, replace=False)).astype(np.int64)
    w = rng.random((n, m)).astype(F32)
    out = {}
    for order in ("C", "F"):
        rs = [_orders(r)[order == "F"].copy(order="K") for r in reps]
        central = _orders(np.zeros((nh, L), F32))[order == "F"].copy(order="K")
        assert mk.merge_columns_cpu(tuple(rs), w, cols, central, True)
        dst = _orders(np.zeros((nh, L), F32))[order == "F"].copy(order="K")
        mk.copy_columns_cpu(dst, central, cols)
        out[order] = [np.array(a) for a in (central, dst, *rs)]
    for c, f in zip(out["C"], out["F"], strict=True):
        np.testing.assert_array_equal(c, f)
    want = sum(w[i] * reps[i][:, cols] for i in range(n))
    np.testing.assert_allclose(out["F"][0][:, cols], want, rtol=1e-5, atol=1e-6)
    for r in out["F"][2:]:  # broadcast: the merged columns written back
        np.testing.assert_array_equal(r[:, cols], out["F"][0][:, cols])


def test_a_nonfinite_label_major_column_is_not_written_back(rng):
    nh, L = 8, 50
    reps = [np.asfortranarray(rng.standard_normal((nh, L)).astype(F32)) for _ in range(2)]
    reps[1][2, 5] = np.inf
    before = [r.copy(order="K") for r in reps]
    cols = np.array([1, 5, 9], np.int64)
    central = np.asfortranarray(np.zeros((nh, L), F32))
    assert not mk.merge_columns_cpu(tuple(reps), np.full((2, 3), 0.5, F32), cols, central, True)
    for r, b in zip(reps, before, strict=True):
        np.testing.assert_array_equal(r[:, 5], b[:, 5])  # the bad column stays as it was
        np.testing.assert_array_equal(r[:, 1], central[:, 1])  # the others are merged


def test_buffers_keep_the_order_and_the_flat_kernels_refuse_mixed_orders(be, rng):
    a = np.asfortranarray(rng.standard_normal((6, 40)).astype(F32))
    e, z = empty_like(be, a), empty_like(be, a, zero=True)
    assert e.shape == z.shape == a.shape
    assert e.flags.f_contiguous and not e.flags.c_contiguous and not z.any()
    assert empty_like(be, np.ascontiguousarray(a)).flags.c_contiguous
    # weighted sum, copy and the finite check on Fortran-order arrays
    b = np.asfortranarray(rng.standard_normal((6, 40)).astype(F32))
    be.weighted_sum([a, b], [0.25, 0.75], e)
    np.testing.assert_allclose(e, 0.25 * a + 0.75 * b, rtol=1e-5, atol=1e-6)
    be.copy_into(z, a)
    np.testing.assert_array_equal(z, a)
    assert be.all_finite(a)
    a[5, 39] = np.nan
    assert not be.all_finite(a)
    with pytest.raises(ValueError, match="different memory orders"):
        be.weighted_sum([a, np.ascontiguousarray(b)], [0.5, 0.5], e)
    # a copy across orders is by index (np.copyto), not by place in memory
    c = np.zeros((6, 40), F32)
    be.copy_into(c, b)
    np.testing.assert_array_equal(c, b)


@pytest.mark.parametrize("output", ["sampled", "exact"])
def test_only_cpu_replicas_of_the_sampled_layer_hold_w2_label_major(be, output):
    X, Y = tiny_data(n=60, n_features=40, n_labels=30)
    p = init_params(ModelShape(40, 30, (8,)), 0, avg_nnz=4.0)
    rep = MLPReplica(be, X, Y, p, optimizer="adagrad", output=output, negatives=4)
    W2, acc_W2 = rep.params()[-2], rep.accumulators()[-2]
    assert label_major_w2(be, output) == (output == "sampled")
    assert W2.flags.f_contiguous == acc_W2.flags.f_contiguous == (output == "sampled")
    assert W2.shape == (8, 30)
    np.testing.assert_array_equal(W2, p[-2])


@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a != "single"])
def test_every_algorithm_trains_the_same_model_in_either_order(be, monkeypatch, algorithm):
    """The sampled layer, Adagrad, two devices on the simulated clock (the same schedule in
    both runs): the central model after two epochs is the same with ``W2`` label-major (the
    default) as with it in C order."""
    X, Y = tiny_data(n=400, n_features=300, n_labels=400)
    results = {}
    for major in (True, False):
        monkeypatch.setattr(model, "label_major_w2", lambda b, o, major=major: major)
        p = init_params(ModelShape(300, 400, (16,)), 0, avg_nnz=8.0)
        reps = [MLPReplica(be, X, Y, p, optimizer="adagrad", output="sampled", negatives=6,
                           seed=i) for i in range(2)]
        assert reps[0].params()[-2].flags.f_contiguous == major
        with make_trainer(reps, parse_devices("cpu,cpu@0.5", cores=2), algorithm, X.shape[0],
                          lr=0.1, batch_size=32, warmup_epochs=0, lr_decay=0, seed=3,
                          mode="simulated", cost=lambda i, b: 1e-3 * b) as tr:
            for epoch in range(2):
                tr.run_epoch(epoch)
            results[major] = [np.array(q) for q in tr.central_params()]
    for a, b in zip(results[True], results[False], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not np.array_equal(results[True][-2], p[-2])  # it trained
