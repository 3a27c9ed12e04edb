"""Regressions found by training on real data, kept beside the kernel tests."""

import numpy as np
from xmc_engine.kernels import output_layer


def test_sum_parts_ignores_uninitialised_output_when_beta_is_zero():
    # The b2 gradient buffer comes from np.empty: beta = 0 must not read it (0 * NaN = NaN).
    parts = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.full(4, np.nan, dtype=np.float32)
    output_layer.sum_parts_cpu(parts, out, 0.5, 0.0)
    np.testing.assert_allclose(out, 0.5 * parts.sum(0))


def test_delicious_shaped_step_stays_finite():
    """983 labels, up to 25 labels per row, rows without labels: one plain step is finite."""
    from xmc_engine.backends import get_backend

    rng = np.random.default_rng(0)
    B, H, L = 64, 128, 983
    be = get_backend("cpu")
    Hact = np.maximum(rng.standard_normal((B, H)) * 4, 0).astype(np.float32)
    W2 = (rng.standard_normal((H, L)) * 0.05).astype(np.float32)
    b2 = np.zeros(L, np.float32)
    counts = rng.integers(0, 26, size=B)
    y_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    y_indices = np.concatenate([np.sort(rng.choice(L, c, replace=False)) for c in counts])
    for _ in range(3):  # workspaces are reused between steps
        dH = np.empty_like(Hact)
        be.output_layer_step(Hact, W2, b2, y_indptr, y_indices.astype(np.int32), 0.5, dH)
        assert np.isfinite(b2).all() and np.isfinite(W2).all() and np.isfinite(dH).all()
