"""Merge math as pure functions: property tests (STYLE.md), formulas of arXiv 2110.07029 §III-B."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xmc_engine.errors import DivergenceError
from xmc_engine.scheduler.merge import (
    NormTrend,
    adaptive_normalization,
    central_momentum,
    elastic_update,
    find_nonfinite,
    l2_norm,
    merge_weights,
    weighted_merge,
)
from xmc_engine.scheduler.replica import HostBackend

SHAPES = [(5, 3), (3,)]
FAST = settings(max_examples=40, deadline=None)


class KernelBackend(HostBackend):
    """A backend whose merge launchers count their calls: the merges go through them."""

    def __init__(self):
        self.calls = {"weighted_sum": 0, "momentum": 0, "elastic": 0}

    def weighted_sum(self, arrays, weights, out):
        self.calls["weighted_sum"] += 1
        out[...] = sum(w * a for w, a in zip(weights, arrays, strict=True))

    def momentum(self, wbar, z1, z2, mu, out):
        self.calls["momentum"] += 1
        out[...] = wbar + mu * (z1 - z2)

    def elastic(self, x, center, alpha, diff_out):
        self.calls["elastic"] += 1
        diff_out[...] = alpha * (x - center)
        x -= diff_out


def replicas(seed, n, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(n)]


def empty():
    return [np.empty(s) for s in SHAPES]


counts = st.lists(st.integers(0, 50), min_size=1, max_size=6)


@FAST
@given(counts)
def test_merge_weights_are_update_shares(c):
    p = merge_weights(c)
    assert p.shape == (len(c),)
    assert p.sum() == pytest.approx(1.0)
    if sum(c):
        np.testing.assert_allclose(p, np.asarray(c) / sum(c))
    else:
        np.testing.assert_allclose(p, 1 / len(c))


def test_merge_weights_reject_negative():
    with pytest.raises(ValueError):
        merge_weights([1, -1])


@FAST
@given(st.lists(st.integers(1, 50), min_size=2, max_size=6), st.sampled_from([0, 1]))
def test_adaptive_normalization(c, flag):
    p = merge_weights(c)
    q = adaptive_normalization(p, flag, 0.1)
    assert q.sum() == pytest.approx(1.0)
    if flag == 0 or p.max() == p.min():
        np.testing.assert_array_equal(q, p)
        return
    hi, lo = int(np.argmax(p)), int(np.argmin(p))
    expect = p.copy()
    expect[hi] *= 1.1
    expect[lo] *= 0.9
    np.testing.assert_allclose(q, expect / expect.sum())
    assert q[hi] > p[hi] and q[lo] < p[lo]


def test_adaptive_normalization_example():
    q = adaptive_normalization([0.5, 0.3, 0.2], 1)
    np.testing.assert_allclose(q, np.array([0.55, 0.3, 0.18]) / 1.03)


def test_norm_trend_rules():
    t = NormTrend("norm_rise")
    assert t.flag == 0
    t.observe(1.0)
    assert t.flag == 0
    t.observe(2.0)
    assert t.flag == 1
    t.observe(1.5)
    assert t.flag == 0
    assert NormTrend("always").flag == 1
    never = NormTrend("never")
    never.observe(1.0)
    never.observe(2.0)
    assert never.flag == 0
    with pytest.raises(ValueError):
        NormTrend("sometimes")


@pytest.mark.parametrize("backend", [HostBackend(), KernelBackend()])
@FAST
@given(seed=st.integers(0, 2**31), n=st.integers(1, 5))
def test_identical_replicas_merge_to_themselves(backend, seed, n):
    base = replicas(seed, 1)[0]
    reps = [[a.copy() for a in base] for _ in range(n)]
    w = np.random.default_rng(seed).random(n) + 0.1
    out = weighted_merge(reps, w / w.sum(), empty(), backend)
    for a, b in zip(out, base, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", [HostBackend(), KernelBackend()])
@FAST
@given(seed=st.integers(0, 2**31), n=st.integers(2, 5), data=st.data())
def test_order_does_not_matter(backend, seed, n, data):
    reps = replicas(seed, n)
    w = np.random.default_rng(seed + 1).random(n)
    perm = data.draw(st.permutations(range(n)))
    a = weighted_merge(reps, w, empty(), backend)
    b = weighted_merge([reps[i] for i in perm], w[list(perm)], empty(), backend)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)


@FAST
@given(seed=st.integers(0, 2**31), n=st.integers(1, 5), k=st.integers(0, 4))
def test_one_hot_weights_select_one_replica(seed, n, k):
    k = k % n
    reps = replicas(seed, n, np.float32)
    w = np.zeros(n)
    w[k] = 1.0
    out = weighted_merge(reps, w, [np.empty(s, np.float32) for s in SHAPES], HostBackend())
    for a, b in zip(out, reps[k], strict=True):
        np.testing.assert_array_equal(a, b)  # exact


@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
def test_nonfinite_replica_is_caught(bad_value):
    reps = replicas(0, 3)
    reps[1][0][2, 1] = bad_value
    assert find_nonfinite(reps, HostBackend()) == [1]
    with pytest.raises(DivergenceError, match=r"\[1\]"):
        weighted_merge(reps, [0.2, 0.3, 0.5], empty(), HostBackend())
    # with weight 0 the bad replica is skipped and cannot poison the merge
    out = weighted_merge(reps, [0.5, 0.0, 0.5], empty(), HostBackend())
    assert all(np.isfinite(a).all() for a in out)


@pytest.mark.parametrize("backend", [HostBackend(), KernelBackend()])
@FAST
@given(seed=st.integers(0, 2**31), mu=st.floats(0.0, 0.99))
def test_momentum_matches_formula(backend, seed, mu):
    wbar, z1, z2 = replicas(seed, 3)
    out = central_momentum(wbar, z1, z2, mu, empty(), backend)
    for o, w, a, b in zip(out, wbar, z1, z2, strict=True):
        np.testing.assert_allclose(o, w + mu * (a - b), rtol=1e-12, atol=1e-12)


def test_momentum_zero_is_exact_copy():
    wbar, z1, z2 = replicas(3, 3)
    z1[0][0, 0] = np.inf  # ignored entirely when mu == 0
    out = central_momentum(wbar, z1, z2, 0.0, empty(), HostBackend())
    for o, w in zip(out, wbar, strict=True):
        np.testing.assert_array_equal(o, w)


@pytest.mark.parametrize("backend", [HostBackend(), KernelBackend()])
def test_elastic_update(backend):
    x, c = replicas(5, 2)
    x0 = [a.copy() for a in x]
    d = elastic_update(x, c, 0.3, empty(), backend)
    for xi, x0i, ci, di in zip(x, x0, c, d, strict=True):
        np.testing.assert_allclose(di, 0.3 * (x0i - ci))
        np.testing.assert_allclose(xi, x0i - 0.3 * (x0i - ci))


def test_kernel_path_is_used():
    be = KernelBackend()
    reps = replicas(1, 2)
    weighted_merge(reps, [0.5, 0.5], empty(), be)
    central_momentum(reps[0], reps[1], reps[0], 0.5, empty(), be)
    assert be.calls["weighted_sum"] == len(SHAPES) and be.calls["momentum"] == len(SHAPES)


def test_l2_norm():
    p = [np.full((2, 2), 1.0), np.full(3, 2.0)]
    assert l2_norm(p, HostBackend()) == pytest.approx(np.sqrt(4 + 12))


# -- the CPU backend's merge helpers: all_finite (NaN/inf check) and the parallel broadcast copy --

@pytest.mark.parametrize("n", [0, 1, 7, 100_003])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
def test_cpu_all_finite_finds_every_nan_and_inf(n, bad):
    from xmc_engine.backends import get_backend

    be = get_backend("cpu")
    a = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    a[: min(n, 3)] = [3.4e38, -3.4e38, 1e-45][: min(n, 3)]  # extremes and a subnormal: finite
    if bad is not None and n:
        a[n // 2] = bad
    want = bool(np.isfinite(a).all())
    assert be.all_finite(a) is want
    assert be.all_finite(a.reshape(-1, 1) if n else a) is want
    assert be.all_finite(a.astype(np.float64)) is want  # other dtypes: NumPy's check


def test_find_nonfinite_uses_the_backend_check():
    from xmc_engine.backends import get_backend

    be = get_backend("cpu")
    reps = [[np.ones((400, 300), np.float32), np.zeros(3, np.float32)] for _ in range(3)]
    reps[2][1][1] = np.nan
    reps[0][0][399, 299] = np.inf
    assert find_nonfinite(reps, be) == [0, 2]
    assert find_nonfinite(reps, HostBackend()) == [0, 2]  # NumPy's isfinite agrees


@pytest.mark.parametrize("shape", [(3,), (300, 300), (70_000,)])
def test_cpu_copy_into_copies_small_and_large_arrays(shape):
    from xmc_engine.backends import get_backend

    be = get_backend("cpu")
    src = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    dst = np.zeros(shape, np.float32)
    be.copy_into(dst, src)
    np.testing.assert_array_equal(dst, src)
    d64 = np.zeros(shape, np.float64)  # other dtypes: np.copyto's conversion
    be.copy_into(d64, src)
    np.testing.assert_array_equal(d64, src.astype(np.float64))


# -- the all-reduce of synchronous SGD ------------------------------------------------------------
def sparse_grads(seed, n_rows, dtype):
    """Gradients in grad_batch's layout: W1 over a random subset of 9 rows, two dense arrays."""
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(9, size=n_rows, replace=False)).astype(np.int64)
    return [(rows, rng.standard_normal((n_rows, 3)).astype(dtype)),
            rng.standard_normal(3).astype(dtype), rng.standard_normal((3, 4)).astype(dtype)]


@pytest.mark.parametrize("backend", ["host", "cpu"])
def test_reduce_gradients_is_the_weighted_sum_over_the_union_of_rows(backend):
    from xmc_engine.backends import get_backend
    from xmc_engine.scheduler.merge import reduce_gradients

    be = HostBackend() if backend == "host" else get_backend("cpu", threads=1)
    dtype = np.float64 if backend == "host" else np.float32
    grads = [sparse_grads(0, 4, dtype), None, sparse_grads(1, 6, dtype), sparse_grads(2, 2, dtype)]
    weights = [0.5, 0.2, 0.3, 0.0]  # device 1 has no gradient, device 3 weight 0
    out = reduce_gradients(grads, weights, be)
    dense_w1 = np.zeros((9, 3))
    for g, wi in zip(grads, weights, strict=True):
        if g is not None:
            dense_w1[g[0][0]] += wi * g[0][1]
    rows = np.union1d(grads[0][0][0], grads[2][0][0])  # device 3's rows: weight 0, left out
    np.testing.assert_array_equal(out[0][0], rows)
    np.testing.assert_allclose(out[0][1], dense_w1[rows], rtol=1e-6)
    for k in (1, 2):
        np.testing.assert_allclose(out[k], 0.5 * grads[0][k] + 0.3 * grads[2][k], rtol=1e-5,
                                   atol=1e-6)
    assert all(o.dtype == dtype for o in [out[0][1], out[1], out[2]])
    with pytest.raises(ValueError, match="no device"):
        reduce_gradients([None, grads[0]], [0.5, 0.0], be)


def test_reduce_gradients_sums_a_sampled_output_layer_over_the_union_of_columns():
    """With the sampled output layer ``W2`` and ``b2`` arrive as ``(cols, values)`` over each
    device's candidate labels: the sum is over the union of the columns, as if each were
    scattered into a dense array first."""
    from xmc_engine.backends import get_backend
    from xmc_engine.scheduler.merge import reduce_gradients

    be = get_backend("cpu", threads=1)
    rng = np.random.default_rng(4)
    grads, dense = [], []
    for n_cols in (5, 7):
        w1 = sparse_grads(n_cols, 3, np.float32)[0]
        cols = rng.choice(12, size=n_cols, replace=False).astype(np.int64)  # not sorted
        dW2 = rng.standard_normal((4, n_cols)).astype(np.float32)
        db2 = rng.standard_normal(n_cols).astype(np.float32)
        grads.append([w1, rng.standard_normal(4).astype(np.float32), (cols, dW2), (cols, db2)])
        full_W2, full_b2 = np.zeros((4, 12), np.float32), np.zeros(12, np.float32)
        full_W2[:, cols], full_b2[cols] = dW2, db2
        dense.append((full_W2, full_b2))
    out = reduce_gradients(grads, [0.25, 0.75], be)
    union = np.union1d(grads[0][2][0], grads[1][2][0])
    for k, j in ((2, 0), (3, 1)):
        cols, values = out[k]
        np.testing.assert_array_equal(cols, union)
        want = 0.25 * dense[0][j] + 0.75 * dense[1][j]
        np.testing.assert_allclose(values, want[..., union], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out[1], 0.25 * grads[0][1] + 0.75 * grads[1][1], rtol=1e-6)
