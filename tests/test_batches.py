"""Host batch assembly (xmc_engine/batches.py): RowGather against SciPy's row indexing, and a
replica's step on gathered batches against the same step on SciPy batches."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from tests.test_estimator import tiny_data
from xmc_engine.backends import get_backend
from xmc_engine.batches import CSRBatch, RowGather
from xmc_engine.model import MLPReplica, ModelShape, grad_step, init_params, train_step


def _with_empty_rows(seed=0):
    """A CSR matrix with empty rows, float64 values, int32 indptr, unsorted indices in a row."""
    A = sp.random(50, 30, density=0.1, format="csr", random_state=seed, dtype=np.float64)
    keep = np.ones(50)
    keep[[3, 17, 49]] = 0
    A = sp.csr_matrix(sp.diags(keep) @ A)
    A.eliminate_zeros()
    A.indptr = A.indptr.astype(np.int32)
    # reverse the column order inside every row: the gather must keep the source order
    for i in range(A.shape[0]):
        s, e = A.indptr[i], A.indptr[i + 1]
        A.indices[s:e] = A.indices[s:e][::-1].copy()
        A.data[s:e] = A.data[s:e][::-1].copy()
    return A


@pytest.mark.parametrize("rows", [
    [0, 1, 2], [49, 3, 17, 3, 0], [], [3], list(range(50))[::-1],
])
def test_gather_equals_scipy_row_indexing(rows):
    A = _with_empty_rows()
    got = RowGather(A)(np.array(rows, dtype=np.int64))
    want = A[np.array(rows, dtype=np.int64)]
    assert isinstance(got, CSRBatch)
    assert got.shape == want.shape
    assert got.indptr.dtype == np.int64 and got.indices.dtype == np.int32
    assert got.data.dtype == np.float32
    np.testing.assert_array_equal(got.indptr, want.indptr)
    np.testing.assert_array_equal(got.indices, want.indices)  # same order within a row
    np.testing.assert_allclose(got.data, want.data.astype(np.float32))
    np.testing.assert_allclose(got.tocsr().toarray(), want.toarray(), rtol=1e-6)


def test_gather_random_batches_match():
    X, _ = tiny_data(n=300)
    g = RowGather(X)
    rng = np.random.default_rng(1)
    for _ in range(20):
        rows = rng.integers(0, X.shape[0], size=rng.integers(1, 64))
        np.testing.assert_array_equal(g(rows).tocsr().toarray(), X[rows].toarray())


@pytest.mark.parametrize("rows,err,match", [
    ([0, 50], IndexError, "row 50 is out of range for a matrix of 50 rows"),
    ([-1], IndexError, "row -1 is out of range"),
    ([0.5], TypeError, "row numbers must be integers"),
])
def test_gather_rejects_bad_rows(rows, err, match):
    with pytest.raises(err, match=match):
        RowGather(_with_empty_rows())(np.array(rows))


def test_cpu_backend_takes_a_batch_as_csr_parts():
    A = _with_empty_rows()
    b = RowGather(A)(np.array([1, 2]))
    indptr, indices, data = get_backend("cpu").csr_parts(b)
    assert indptr is b.indptr and indices is b.indices and data is b.data


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_replica_step_on_gathered_rows_equals_step_on_scipy_rows(optimizer):
    """MLPReplica gathers its batches with RowGather: the step must be the one train_step /
    grad_step make on SciPy's ``X[rows]``."""
    X, Y = tiny_data(n=200)
    be = get_backend("cpu", threads=1)
    params = init_params(ModelShape(X.shape[1], Y.shape[1], (16,)), seed=3)
    rep = MLPReplica(be, X, Y, params, optimizer=optimizer)
    rows = np.array([5, 9, 9, 120, 0, 77], dtype=np.int64)
    if optimizer == "sgd":
        ref = [p.copy() for p in params]
        want = train_step(be, ref, X[rows], Y[rows], 0.3)
        got = rep.train_batch(rows, 0.3)
        assert got == pytest.approx(want, rel=1e-6)
        for a, b in zip(rep.params(), ref, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    else:
        loss_a, ga = rep.grad_batch(rows)
        loss_b, gb = grad_step(be, [p.copy() for p in params], X[rows], Y[rows])
        assert loss_a == pytest.approx(loss_b, rel=1e-6)
        np.testing.assert_array_equal(ga[0][0], gb[0][0])
        for a, b in zip([ga[0][1], *ga[1:]], [gb[0][1], *gb[1:]], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        before = [p.copy() for p in rep.params()]
        rep.train_batch(rows, 0.1)
        assert any(not np.array_equal(a, b) for a, b in zip(before, rep.params(), strict=True))


def test_gather_shares_the_arrays_of_a_canonical_matrix():
    """Replicas of one training matrix (loader dtypes) hold no copies of it."""
    X, _ = tiny_data(n=50)
    X = sp.csr_matrix((X.data.astype(np.float32), X.indices.astype(np.int32),
                       X.indptr.astype(np.int32)), shape=X.shape)
    g = RowGather(X)
    assert g.indptr is X.indptr and g.indices is X.indices and g.data is X.data
    assert g(np.array([3, 1])).indptr.dtype == np.int64
