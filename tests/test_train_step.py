"""The fused CPU training step (kernels/train_step.py) against the host-level step it replaces.

Its reference is the engine's own step through the backend (``MLPReplica(fused=False)``): same
batches, same start, parameters and accumulators equal to float32 rounding (the GEMMs go to
another BLAS build), the same loss, the same record of changed ``W1`` rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from tests.test_estimator import tiny_data
from xmc_engine.backends import get_backend
from xmc_engine.model import MLPReplica, ModelShape, init_params


def _data_with_edge_rows():
    """tiny_data with rows without labels and rows without features."""
    X, Y = tiny_data(n=200)[:2]
    X, Y = X.tolil(), Y.tolil()
    for i in (3, 50, 51):
        Y[i, :] = 0
    for i in (7, 51, 120):
        X[i, :] = 0
    return sp.csr_matrix(X, dtype=np.float32), sp.csr_matrix(Y, dtype=np.float32)


def _pair(X, Y, optimizer, hidden=(16,), **kw):
    params = init_params(ModelShape(X.shape[1], Y.shape[1], hidden), seed=1)
    return [MLPReplica(get_backend("cpu", threads=1), X, Y, params, optimizer=optimizer,
                       fused=fused, **kw) for fused in (True, False)]


def _assert_same_state(fused, host, optimizer="sgd"):
    """The two replicas' parameters (and Adagrad accumulators) agree to float32 rounding."""
    for a, b in zip(fused.params(), host.params(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if optimizer == "adagrad":
        for a, b in zip(fused.optimizer_state(), host.optimizer_state(), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _assert_same_gradient(fused, host, rows):
    """``grad_batch(rows)`` of both replicas agree (the same W1 rows and, for a sampled layer,
    the same candidate columns), and so do the replicas after each applies its own."""
    lf, gf = fused.grad_batch(rows)
    lh, gh = host.grad_batch(rows)
    assert lf == pytest.approx(lh, rel=1e-5, abs=1e-6)
    np.testing.assert_array_equal(gf[0][0], gh[0][0])  # the same W1 rows
    np.testing.assert_allclose(gf[0][1], gh[0][1], rtol=1e-5, atol=1e-7)
    for a, b in zip(gf[1:], gh[1:], strict=True):
        if isinstance(a, tuple):  # column-sparse W2, b2: (cols, values)
            np.testing.assert_array_equal(a[0], b[0])
            a, b = a[1], b[1]
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    fused.apply_grads(gf, 0.1)
    host.apply_grads(gh, 0.1)
    _assert_same_state(fused, host)


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_fused_step_equals_the_host_level_step(optimizer):
    X, Y = _data_with_edge_rows()
    fused, host = _pair(X, Y, optimizer)
    assert fused._fused and not host._fused
    rng = np.random.default_rng(0)
    for step in range(30):
        rows = rng.integers(0, X.shape[0], 1 + step % 9)  # batch sizes 1..9
        if step == 4:
            rows = np.array([3, 50, 51])  # no labels at all (51: no features either)
        lf, lh = fused.train_batch(rows, 0.1), host.train_batch(rows, 0.1)
        assert lf == pytest.approx(lh, rel=1e-5, abs=1e-6)
        np.testing.assert_array_equal(fused.changed_rows(), host.changed_rows())
        if step == 0:  # one row's features: a few W1 rows
            assert 0 < fused.changed_rows().sum() < X.shape[1] // 2
    _assert_same_state(fused, host, optimizer)


def test_fused_step_with_an_empty_batch_changes_nothing():
    X, Y = tiny_data(n=50)[:2]
    fused, _ = _pair(X, Y, "adagrad")
    before = [p.copy() for p in fused.params()]
    assert fused.train_batch(np.zeros(0, np.int64), 0.1) == 0.0
    for a, b in zip(before, fused.params(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not fused.changed_rows().any()


def test_fused_step_learns():
    X, Y = tiny_data(n=400)[:2]
    fused, _ = _pair(X, Y, "adagrad", hidden=(32,))
    rng = np.random.default_rng(0)
    losses = [fused.train_batch(rng.integers(0, X.shape[0], 32), 0.1) for _ in range(300)]
    assert np.mean(losses[-30:]) < 0.6 * np.mean(losses[:30])


@pytest.mark.parametrize("kw", [{"hidden": (16, 8)}, {"label_chunk": 7},
                                {"hidden": (16, 8), "output": "sampled"}])
def test_other_shapes_keep_the_host_level_step(kw):
    """Two hidden layers, a label chunk narrower than the labels: the fused step does not cover
    them, so the replica keeps the step through the backend."""
    X, Y = tiny_data(n=50)[:2]
    hidden = kw.pop("hidden", (16,))
    fused, _ = _pair(X, Y, "adagrad", hidden=hidden, **kw)
    assert not fused._fused
    assert np.isfinite(fused.train_batch(np.arange(8), 0.1))


def test_fused_gradient_equals_the_host_level_gradient():
    """grad_batch (what sync computes on each device) through the fused kernel."""
    X, Y = _data_with_edge_rows()
    fused, host = _pair(X, Y, "adagrad")
    rng = np.random.default_rng(1)
    for rows in (rng.integers(0, X.shape[0], 7), np.array([3, 50, 51]), np.array([12]),
                 np.zeros(0, np.int64)):
        _assert_same_gradient(fused, host, rows)


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
@pytest.mark.parametrize("rule", ["uniform", "frequency", "lsh"])
def test_fused_sampled_step_equals_the_host_level_step(optimizer, rule):
    """The sampled output layer: the same candidates (same seed), the same step on W1's rows and
    W2's candidate columns, the same record of changed rows and columns."""
    X, Y = _data_with_edge_rows()
    fused, host = _pair(X, Y, optimizer, output="sampled", negatives=6, negative_sampling=rule)
    assert fused._fused and not host._fused
    rng = np.random.default_rng(2)
    for step in range(25):
        rows = rng.integers(0, X.shape[0], 1 + step % 7)
        if step == 3:
            rows = np.array([3, 50, 51])  # no labels (51: no features either)
        lf, lh = fused.train_batch(rows, 0.1), host.train_batch(rows, 0.1)
        assert lf == pytest.approx(lh, rel=1e-5, abs=1e-6)
        np.testing.assert_array_equal(fused.changed_rows(), host.changed_rows())
        np.testing.assert_array_equal(fused.changed_columns(), host.changed_columns())
        if step == 0:
            assert 0 < fused.changed_columns().sum() < Y.shape[1]
    _assert_same_state(fused, host, optimizer)


@pytest.mark.parametrize("rule", ["uniform", "frequency"])
def test_fused_sampled_gradient_equals_the_host_level_gradient(rule):
    """grad_batch with the sampled output layer (sync's gradient): the same candidates, the same
    column-sparse gradient, and the same step when applied."""
    X, Y = _data_with_edge_rows()
    fused, host = _pair(X, Y, "adagrad", output="sampled", negatives=6, negative_sampling=rule)
    rng = np.random.default_rng(3)
    for rows in (rng.integers(0, X.shape[0], 7), np.array([3, 50, 51]), np.array([12]),
                 np.zeros(0, np.int64)):
        _assert_same_gradient(fused, host, rows)
