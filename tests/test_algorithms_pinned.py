"""Behaviour of the policies that the mutation run (``bench/MUTATION.md``) found unpinned.

Each test states a property of the algorithm from its docstring or paper; the mutants they kill
are listed in ``bench/MUTATION.md``.
"""

from __future__ import annotations

import numpy as np
import pytest

from xmc_engine.algorithms import get_algorithm
from xmc_engine.scheduler import MergeContext
from xmc_engine.scheduler.merge import reduce_gradients
from xmc_engine.scheduler.replica import FakeReplica, HostBackend


def _setup(pol, reps, batch_size=4):
    pol.setup(reps, n_samples=100, batch_size=batch_size, merge_period=64, warmup_epochs=0.0)


def _dense(rows, g1, n_rows=10):
    full = np.zeros((n_rows, *g1.shape[1:]), g1.dtype)
    full[rows] = g1
    return full


@pytest.mark.parametrize("dtype,rtol", [(np.float32, 1e-6), (np.float64, 1e-13)])
def test_allreduce_of_two_devices_is_the_weighted_sum_in_the_inputs_precision(dtype, rtol):
    """``ḡ = Σ_i w_i g_i`` over the union of the two devices' ``W1`` rows, dense entries in the
    gradients' own dtype: float64 gradients (the fakes', on their host backend) are summed in
    float64, without float32 weights."""
    rng = np.random.default_rng(5)
    rows = [np.array([0, 2, 5], np.int64), np.array([2, 3, 9], np.int64)]
    g1 = [rng.standard_normal((3, 4)).astype(dtype) for _ in rows]
    b = [rng.standard_normal(6).astype(dtype) for _ in rows]
    w = [0.7, 0.3]  # not float32 numbers: a float32 weight would show in float64 sums
    out = reduce_gradients([[(r, g), bi] for r, g, bi in zip(rows, g1, b, strict=True)], w,
                           HostBackend())
    np.testing.assert_array_equal(out[0][0], [0, 2, 3, 5, 9])
    ref1 = w[0] * _dense(rows[0], g1[0]) + w[1] * _dense(rows[1], g1[1])
    np.testing.assert_allclose(out[0][1], ref1[out[0][0]], rtol=rtol)
    ref_b = w[0] * b[0].astype(np.float64) + w[1] * b[1].astype(np.float64)
    assert out[1].dtype == dtype
    np.testing.assert_allclose(out[1], ref_b, rtol=rtol)


def test_allreduce_skips_a_device_without_a_gradient():
    """A device that took no rows (``None``) contributes nothing: one contributing device gives
    its own gradient times its weight."""
    rows = np.array([1, 4], np.int64)
    g1 = np.arange(6, dtype=np.float64).reshape(2, 3)
    b = np.array([2.0, -4.0])
    out = reduce_gradients([None, [(rows, g1), b]], [0.0, 0.5], HostBackend())
    np.testing.assert_array_equal(out[0][0], rows)
    np.testing.assert_allclose(out[0][1], 0.5 * g1)
    np.testing.assert_allclose(out[1], 0.5 * b)


def test_easgd_uses_the_configured_alpha_else_beta_over_n():
    """EASGD eq. (5)-(6) with an explicit ``α``: ``x̃' = x̃ + α Σ (x_i − x̃)`` and
    ``x_i <- x_i − α (x_i − x̃)``; ``α = 0`` means ``β / n``."""
    for alpha, expect in ((0.25, 0.25), (0.0, 0.9 / 3)):
        reps = [FakeReplica(100, sleep=False, seed=s) for s in range(3)]
        pol = get_algorithm("easgd", alpha=alpha)
        _setup(pol, reps)
        assert pol.alpha == pytest.approx(expect)
        center = [a.copy() for a in pol.central_params()]
        x = [[a.copy() for a in r.params()] for r in reps]
        x = [[a + i + 1.0 for a in xi] for i, xi in enumerate(x)]
        for r, xi in zip(reps, x, strict=True):
            r.set_params(xi)
        pol.merge(reps, [1, 1, 1], MergeContext())
        for k, c in enumerate(center):
            np.testing.assert_allclose(pol.central_params()[k],
                                       c + expect * sum(xi[k] - c for xi in x), rtol=1e-12)
            for r, xi in zip(reps, x, strict=True):
                np.testing.assert_allclose(r.params()[k], xi[k] - expect * (xi[k] - c),
                                           rtol=1e-12)
