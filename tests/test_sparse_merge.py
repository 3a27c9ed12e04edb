"""The row-sparse merge (``merge_changed_rows``): its CPU kernels against NumPy, the replicas'
record of changed ``W1`` rows, and whole runs that must give the dense merge's model."""

from __future__ import annotations

import numpy as np
import pytest

from tests._trainer import make_trainer
from tests.test_estimator import tiny_data
from xmc_engine.backends import get_backend
from xmc_engine.devices import parse_devices
from xmc_engine.model import MLPReplica, ModelShape, init_params
from xmc_engine.scheduler import FakeReplica
from xmc_engine.scheduler.merge import (
    find_nonfinite,
    merge_changed_rows,
    sq_norms,
    weighted_merge,
)


@pytest.fixture(scope="module")
def be():
    return get_backend("cpu", threads=1)


@pytest.fixture(scope="module")
def wide():
    """Toy data over 2,000 features: a few batches touch only some rows of ``W1``."""
    X, Y = tiny_data(n=400, n_features=2000)
    return X, Y


@pytest.fixture(scope="module")
def many_labels():
    """Toy data over 400 labels: a sampled step (a batch's positives plus 6 negatives) changes
    a few columns of ``W2``."""
    return tiny_data(n=400, n_features=300, n_labels=400)


def mlp(be, X, Y, seed=0, optimizer="sgd", output="exact", loss="softmax"):
    p = init_params(ModelShape(X.shape[1], Y.shape[1], (16,)), seed, avg_nnz=8.0)
    return MLPReplica(be, X, Y, p, optimizer=optimizer, output=output, negatives=6, seed=seed,
                      loss=loss)


def sq64(a):
    return float((np.asarray(a, np.float64) ** 2).sum())


# -- kernels -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3])
def test_merge_rows_matches_numpy_on_the_rows_only(be, n):
    rng = np.random.default_rng(n)
    arrays = [rng.standard_normal((50, 7)).astype(np.float32) for _ in range(n)]
    w = rng.dirichlet(np.ones(n))
    rows = np.array([0, 3, 4, 17, 49], np.int64)
    out = rng.standard_normal((50, 7)).astype(np.float32)
    before = out.copy()
    ok, delta = be.merge_rows(arrays, w, rows, out)
    expect = before.copy()
    expect[rows] = sum(np.float32(wi) * a[rows] for wi, a in zip(w, arrays, strict=True))
    assert ok
    np.testing.assert_allclose(out, expect, rtol=1e-6, atol=1e-6)
    untouched = np.setdiff1d(np.arange(50), rows)
    assert np.array_equal(out[untouched], before[untouched])
    assert delta == pytest.approx(sq64(out) - sq64(before), rel=1e-9)


def test_merge_rows_without_norm_merges_the_same_and_reports_no_change(be):
    """``norm=False`` (no L2-norm trend to feed) gives the same rows and a change of 0.0."""
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((30, 6)).astype(np.float32) for _ in range(2)]
    rows = np.array([1, 4, 9, 28], np.int64)
    a = rng.standard_normal((30, 6)).astype(np.float32)
    b = a.copy()
    ok_a, delta_a = be.merge_rows(arrays, [0.3, 0.7], rows, a)
    ok_b, delta_b = be.merge_rows(arrays, [0.3, 0.7], rows, b, norm=False)
    assert ok_a and ok_b
    np.testing.assert_array_equal(a, b)
    assert delta_a != 0.0 and delta_b == 0.0


def test_merge_rows_leaves_out_replicas_of_weight_zero(be):
    """A replica of weight 0 is not read: not even a NaN in it reaches the merged row (the
    per-row weights give 0 to the replicas that did not change a row)."""
    rng = np.random.default_rng(6)
    arrays = [rng.standard_normal((10, 4)).astype(np.float32) for _ in range(3)]
    arrays[1][:] = np.nan
    rows = np.array([0, 5, 9], np.int64)
    out = np.zeros((10, 4), np.float32)
    ok, _ = be.merge_rows(arrays, [0.25, 0.0, 0.75], rows, out, broadcast=True)
    assert ok
    expect = np.float32(0.25) * arrays[0][rows] + np.float32(0.75) * arrays[2][rows]
    np.testing.assert_allclose(out[rows], expect, rtol=1e-6)
    for a in arrays:  # the broadcast still reaches every replica, the weight-0 one too
        np.testing.assert_array_equal(a[rows], out[rows])
    assert np.isnan(arrays[1][1]).all()  # rows not listed: not touched


@pytest.mark.parametrize("sole", [0, 1, 2])
def test_merge_rows_with_one_replica_of_weight_one_takes_its_rows(be, sole):
    """Weight 1 for one replica and 0 for the others (a row only it changed): the merged rows
    are its rows, bit for bit, and every replica holds them afterwards."""
    rng = np.random.default_rng(7 + sole)
    arrays = [rng.standard_normal((12, 5)).astype(np.float32) for _ in range(3)]
    mine = arrays[sole].copy()
    w = np.zeros(3)
    w[sole] = 1.0
    rows = np.array([2, 3, 11], np.int64)
    out = np.zeros((12, 5), np.float32)
    ok, delta = be.merge_rows(arrays, w, rows, out, broadcast=True)
    assert ok
    np.testing.assert_array_equal(out[rows], mine[rows])
    for a in arrays:
        np.testing.assert_array_equal(a[rows], mine[rows])
    assert delta == pytest.approx(sq64(mine[rows]), rel=1e-9)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_merge_rows_reports_a_nonfinite_value(be, bad):
    arrays = [np.ones((6, 4), np.float32), np.ones((6, 4), np.float32)]
    arrays[1][2, 3] = bad
    out = np.zeros((6, 4), np.float32)
    assert be.merge_rows(arrays, [0.5, 0.5], np.arange(6), out)[0] is False
    # a bad value outside the listed rows is not read
    assert be.merge_rows(arrays, [0.5, 0.5], np.array([0, 1, 5]), out)[0] is True


def test_merge_rows_broadcast_writes_the_finite_merged_rows_back(be):
    """With ``broadcast`` each merged row goes back to every replica in the same pass, except a
    row with a non-finite value: its replicas keep what they had (the NaN stays findable)."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((20, 5)).astype(np.float32) for _ in range(3)]
    arrays[2][7, 1] = np.nan
    before = [a.copy() for a in arrays]
    rows = np.array([2, 7, 11, 19], np.int64)
    out = np.zeros((20, 5), np.float32)
    ok, _ = be.merge_rows(arrays, [0.2, 0.3, 0.5], rows, out, broadcast=True)
    assert ok is False
    good = np.array([2, 11, 19])
    for a, b in zip(arrays, before, strict=True):
        np.testing.assert_array_equal(a[good], out[good])  # merged and written back
        np.testing.assert_array_equal(a[7], b[7])  # the bad row: left as it was
        rest = np.setdiff1d(np.arange(20), rows)
        np.testing.assert_array_equal(a[rest], b[rest])  # rows not listed: not touched
    assert np.isnan(arrays[2][7, 1])


def test_copy_rows_copies_only_the_rows(be):
    src = np.arange(40, dtype=np.float32).reshape(10, 4)
    dst = np.zeros_like(src)
    be.copy_rows(dst, src, np.array([1, 7], np.int64))
    assert np.array_equal(dst[[1, 7]], src[[1, 7]])
    assert not dst[[0, 2, 3, 4, 5, 6, 8, 9]].any()


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("shape", [(5, 40), (40,)], ids=["W2", "b2"])
def test_merge_columns_matches_numpy_on_the_columns_only(be, n, shape):
    rng = np.random.default_rng(n)
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
    cols = np.array([0, 3, 4, 17, 39], np.int64)
    Q = rng.dirichlet(np.ones(n), size=cols.size).T.astype(np.float32)  # (n, len(cols))
    out = rng.standard_normal(shape).astype(np.float32)
    before = out.copy()
    assert be.merge_columns(arrays, Q, cols, out) is True
    expect = before.copy()
    expect[..., cols] = sum(Q[i] * arrays[i][..., cols] for i in range(n))
    np.testing.assert_allclose(out, expect, rtol=1e-6, atol=1e-6)
    untouched = np.setdiff1d(np.arange(shape[-1]), cols)
    assert np.array_equal(out[..., untouched], before[..., untouched])
    dst = np.zeros(shape, np.float32)
    be.copy_columns(dst, arrays[0], cols)
    assert np.array_equal(dst[..., cols], arrays[0][..., cols])
    assert not dst[..., untouched].any()


@pytest.mark.parametrize("n_cols", [5, 700])  # one block of columns, and several
def test_merge_columns_broadcast_writes_back_all_but_a_nonfinite_block(be, n_cols):
    from xmc_engine.kernels.merge import COLUMN_BLOCK

    rng = np.random.default_rng(n_cols)
    L = 2 * n_cols + 3
    arrays = [rng.standard_normal((4, L)).astype(np.float32) for _ in range(2)]
    cols = np.sort(rng.choice(L, n_cols, replace=False)).astype(np.int64)
    Q = rng.random((2, n_cols)).astype(np.float32)
    out = np.zeros((4, L), np.float32)
    expect = Q[0] * arrays[0][:, cols] + Q[1] * arrays[1][:, cols]
    before = [a.copy() for a in arrays]
    assert be.merge_columns(arrays, Q, cols, out, broadcast=True) is True
    np.testing.assert_allclose(out[:, cols], expect, rtol=1e-6, atol=1e-6)
    rest = np.setdiff1d(np.arange(L), cols)
    for a, b in zip(arrays, before, strict=True):
        np.testing.assert_array_equal(a[:, cols], out[:, cols])
        np.testing.assert_array_equal(a[:, rest], b[:, rest])
    # a NaN in row 1, column cols[-1]: that row's last block stays as it was, the rest is merged
    arrays = [b.copy() for b in before]
    arrays[1][1, cols[-1]] = np.nan
    assert be.merge_columns(arrays, Q, cols, np.zeros((4, L), np.float32),
                            broadcast=True) is False
    last = cols[(n_cols - 1) // COLUMN_BLOCK * COLUMN_BLOCK:]
    kept = [before[0][1, last], before[1][1, last].copy()]
    kept[1][-1] = np.nan
    for i in range(2):
        np.testing.assert_array_equal(arrays[i][1, last], kept[i])  # the bad block: as it was
        np.testing.assert_allclose(arrays[i][[0, 2, 3]][:, cols], expect[[0, 2, 3]],
                                   rtol=1e-6, atol=1e-6)  # the other rows: merged
    assert not np.isnan(arrays[0]).any()


def test_merge_columns_reports_a_nonfinite_value(be):
    arrays = [np.ones((3, 6), np.float32), np.ones((3, 6), np.float32)]
    arrays[1][2, 4] = np.nan
    Q = np.full((2, 6), 0.5, np.float32)
    out = np.zeros((3, 6), np.float32)
    assert be.merge_columns(arrays, Q, np.arange(6), out) is False
    assert be.merge_columns(arrays, Q[:, :3], np.array([0, 1, 5]), out) is True


# -- the replica's record of changed rows --------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_replica_records_the_rows_its_steps_change(be, wide, optimizer):
    X, Y = wide
    rep = mlp(be, X, Y, optimizer=optimizer)
    w0 = np.array(rep.params()[0])
    assert not rep.changed_rows().any()
    rows = np.arange(0, 40, 3)
    rep.train_batch(rows, 0.5)
    rep.train_batch(rows + 1, 0.5)
    mask = rep.changed_rows()
    feats = np.zeros(X.shape[1], bool)
    feats[X[np.concatenate([rows, rows + 1])].indices] = True
    assert np.array_equal(mask, feats)
    changed = np.flatnonzero((rep.params()[0] != w0).any(axis=1))
    assert mask[changed].all(), "a changed row is missing from the record"
    assert 0 < mask.sum() < X.shape[1]
    rep.set_params([w0] + rep.params()[1:])
    assert not rep.changed_rows().any()


def test_set_params_with_rows_copies_those_rows_of_w1_and_the_rest(be, wide):
    X, Y = wide
    a, b = mlp(be, X, Y, seed=0), mlp(be, X, Y, seed=1)
    a.train_batch(np.arange(10), 0.5)
    rows = np.array([2, 5, 11], np.int64)
    w1_before = np.array(a.params()[0])
    a.set_params(b.params(), rows=rows)
    assert not a.changed_rows().any()
    assert np.array_equal(a.params()[0][rows], b.params()[0][rows])
    others = np.setdiff1d(np.arange(X.shape[1]), rows)
    assert np.array_equal(a.params()[0][others], w1_before[others])
    for x, y in zip(a.params()[1:], b.params()[1:], strict=True):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_sampled_replica_records_the_columns_its_steps_change(be, many_labels, optimizer):
    X, Y = many_labels
    assert mlp(be, X, Y).changed_columns() is None  # the exact softmax changes every column
    rep = mlp(be, X, Y, optimizer=optimizer, output="sampled")
    W2, b2 = np.array(rep.params()[-2]), np.array(rep.params()[-1])
    assert not rep.changed_columns().any()
    rows = np.arange(0, 40, 3)
    rep.train_batch(rows, 0.5)
    rep.train_batch(rows + 1, 0.5)
    mask = rep.changed_columns()
    changed = (rep.params()[-2] != W2).any(axis=0) | (rep.params()[-1] != b2)
    assert mask[changed].all(), "a changed column is missing from the record"
    positives = np.zeros(Y.shape[1], bool)
    positives[Y[np.concatenate([rows, rows + 1])].indices] = True
    assert mask[positives].all() and 0 < mask.sum() < Y.shape[1]
    rep.set_params(rep.params())
    assert not rep.changed_columns().any()


# -- merge_changed_rows --------------------------------------------------------------------------
def _period(reps, lr=0.5):
    for i, r in enumerate(reps):
        for s in range(3):
            r.train_batch(np.arange(i * 30 + s * 8, i * 30 + s * 8 + 8), lr)


@pytest.mark.parametrize("n", [2, 3])
def test_merge_changed_rows_gives_the_dense_merge(be, wide, n):
    X, Y = wide
    reps = [mlp(be, X, Y) for _ in range(n)]
    central = [np.array(p) for p in reps[0].params()]
    _period(reps)
    p = np.random.default_rng(n).dirichlet(np.ones(n))
    dense = [np.empty_like(a) for a in central]
    weighted_merge([r.params() for r in reps], p, dense, be)
    sq_before = sq64(central[0])
    delta = merge_changed_rows(reps, p, central, be)
    assert delta is not None
    for c, d in zip(central, dense, strict=True):
        np.testing.assert_allclose(c, d, rtol=1e-6, atol=1e-7)
    assert delta == pytest.approx(sq64(central[0]) - sq_before, rel=1e-9)
    for r in reps:  # broadcast: every replica holds the central model, record cleared
        assert not r.changed_rows().any()
        for x, c in zip(r.params(), central, strict=True):
            assert np.array_equal(x, c)


def _after_a_period(be, wide, n):
    """``n`` replicas after a toy period from one central model: ``(replicas, central,
    central W1 before the merge, the replicas' changed-row masks, copies of their params,
    merge weights)``."""
    X, Y = wide
    reps = [mlp(be, X, Y) for _ in range(n)]
    central = [np.array(a) for a in reps[0].params()]
    start = np.array(central[0])
    _period(reps)
    masks = np.stack([r.changed_rows() for r in reps])
    params = [[np.array(a) for a in r.params()] for r in reps]
    return reps, central, start, masks, params, np.random.default_rng(n).dirichlet(np.ones(n))


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("n", [2, 3])
def test_per_row_weights_renormalize_over_the_replicas_that_changed_a_row(be, wide, n, norm):
    """``per_row``: a row changed by one replica takes that replica's value whole; a row changed
    by several, their weights renormalized; the rest of the model the paper's merge; the touch
    statistics count the rows; every replica holds the merged model afterwards; without
    ``norm`` the same merge reports no change of the norm."""
    reps, central, start, masks, params, p = _after_a_period(be, wide, n)
    want = start.copy()
    for row in np.flatnonzero(masks.any(axis=0)):
        q = p * masks[:, row]
        want[row] = sum(q[i] / q.sum() * params[i][0][row] for i in range(n))
    stats = {}
    delta = merge_changed_rows(reps, p, central, be, per_row=True, stats=stats, norm=norm)
    if norm:
        assert delta == pytest.approx(sq64(central[0]) - sq64(start), rel=1e-9)
    else:
        assert delta == 0.0
    np.testing.assert_allclose(central[0], want, rtol=1e-6, atol=1e-7)
    for r in reps:
        for x, c in zip(r.params(), central, strict=True):
            assert np.array_equal(x, c)
    single = np.flatnonzero(masks.sum(axis=0) == 1)
    assert single.size > 0  # the toy periods leave rows that one replica alone changed
    assert stats == {"rows_touched": int(masks.any(axis=0).sum()), "rows_single": single.size}
    for i, row in [(int(np.flatnonzero(masks[:, r])[0]), r) for r in single[:5]]:
        np.testing.assert_array_equal(central[0][row], params[i][0][row])
    rest = [np.empty_like(a) for a in central[1:]]
    weighted_merge([ps[1:] for ps in params], p, rest, be)
    for c, d in zip(central[1:], rest, strict=True):
        np.testing.assert_allclose(c, d, rtol=1e-6, atol=1e-7)


def _in_parts(k, calls):
    """A ``run_shards`` that splits ``range(n)`` into ``k`` contiguous parts and runs them one
    after the other, recording each ``(start, stop)`` in ``calls``."""
    def run(n, fn):
        bounds = np.linspace(0, n, k + 1).round().astype(int)
        calls.extend(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))
        return [fn(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if a < b]
    return run


@pytest.mark.parametrize("weights", ["paper", "per_row", "row_sum"])
@pytest.mark.parametrize("n", [2, 3])
def test_merge_in_parts_gives_the_merge_in_one_pass(be, wide, n, weights, monkeypatch):
    """``run_shards``: the changed rows merged with the weights ``p`` in parts (each part by
    one device worker in a run) give the model of one pass bit for bit, and the same change
    of the norm up to the order of its sums; below :data:`SHARD_MIN_VALUES`, and with the
    per-row weights, the rows are merged in one pass."""
    import xmc_engine.scheduler.merge as merge

    opts = {"paper": {}, "per_row": {"per_row": True},
            "row_sum": {"per_row": True, "row_sum": True, "row_sum_power": 0.5}}[weights]
    merged = []  # the rows of each merge_rows call: every changed row once, in one part

    def merge_rows(arrays, weights, rows, *args, **kwargs):
        merged.append(np.array(rows))
        return type(be).merge_rows(arrays, weights, rows, *args, **kwargs)

    monkeypatch.setattr(be, "merge_rows", merge_rows)
    out = {}
    for k in (1, 3):
        monkeypatch.setattr(merge, "SHARD_MIN_VALUES", 0 if k > 1 else 1 << 62)
        reps, central, *_, p = _after_a_period(be, wide, n)
        calls, stats = [], {}
        merged.clear()
        delta = merge_changed_rows(reps, p, central, be, run_shards=_in_parts(3, calls),
                                   stats=stats, **opts)
        assert delta is not None
        rows = np.concatenate(merged)
        assert rows.size == np.unique(rows).size == stats["rows_touched"]
        out[k] = (central, [r.params() for r in reps], delta, calls)
    (one, one_reps, d1, calls1), (parts, part_reps, d3, calls3) = out[1], out[3]
    assert calls1 == []
    if weights == "paper":  # 3 parts of the rows
        assert len(calls3) == 3 and calls3[-1][1] > 100
    else:  # the per-row weights: one pass (the split measured slower with them)
        assert calls3 == []
    for a, b in zip(one, parts, strict=True):
        np.testing.assert_array_equal(a, b)
    for ra, rb in zip(one_reps, part_reps, strict=True):
        for a, b in zip(ra, rb, strict=True):
            np.testing.assert_array_equal(a, b)
    assert d3 == pytest.approx(d1, rel=1e-9)


@pytest.mark.parametrize("power", [0.0, 0.5])
@pytest.mark.parametrize("n", [2, 3])
def test_row_sum_adds_the_changes_of_the_replicas_that_changed_a_row(be, wide, n, power):
    """``row_sum`` (``row_weights="sum"``): a row several replicas changed becomes the central
    row plus the sum of their changes, whatever the weights (``row_sum_power=0.5``,
    ``"sum_sqrt"``: that sum over the square root of their number); a row one replica changed
    is that replica's; the rest of the model the paper's merge; every replica holds the
    result."""
    reps, central, start, masks, params, p = _after_a_period(be, wide, n)
    assert (masks.sum(axis=0) > 1).any()  # the toy periods share rows between replicas
    assert (masks.sum(axis=0) == 1).any()
    want = start.copy()
    for row in np.flatnonzero(masks.any(axis=0)):
        k = int(masks[:, row].sum())
        want[row] = start[row] + k ** -power * sum(params[i][0][row] - start[row]
                                                   for i in range(n) if masks[i, row])
    delta = merge_changed_rows(reps, p, central, be, per_row=True, row_sum=True,
                               row_sum_power=power)
    assert delta == pytest.approx(sq64(central[0]) - sq64(start), rel=1e-9)
    np.testing.assert_allclose(central[0], want, rtol=1e-5, atol=1e-6)
    for r in reps:
        for x, c in zip(r.params(), central, strict=True):
            assert np.array_equal(x, c)
    rest = [np.empty_like(a) for a in central[1:]]
    weighted_merge([ps[1:] for ps in params], p, rest, be)
    for c, d in zip(central[1:], rest, strict=True):
        np.testing.assert_allclose(c, d, rtol=1e-6, atol=1e-7)


def test_per_label_weights_renormalize_over_the_replicas_that_saw_a_label(be, wide):
    """``per_label``: W2's column and b2's entry of a label are merged over the replicas whose
    batches held it as a positive; labels nobody saw keep the weights ``p``."""
    X, Y = wide
    reps = [mlp(be, X, Y) for _ in range(3)]
    assert reps[0].seen_labels() is None  # not recorded unless asked for
    for r in reps:
        r.track_labels()
    central = [np.array(a) for a in reps[0].params()]
    _period(reps)
    seen = np.stack([r.seen_labels() for r in reps])
    for i in range(len(reps)):  # what each replica's batches held (rows of _period)
        want = np.zeros(Y.shape[1], bool)
        want[Y[np.arange(i * 30, i * 30 + 24)].indices] = True
        np.testing.assert_array_equal(seen[i], want)
    params = [[np.array(a) for a in r.params()] for r in reps]
    p = np.array([0.5, 0.3, 0.2])
    Q = np.where(seen.any(axis=0), p[:, None] * seen / (p[:, None] * seen).sum(axis=0).clip(1e-30),
                 p[:, None])
    stats = {}
    assert merge_changed_rows(reps, p, central, be, per_label=True, stats=stats) is not None
    np.testing.assert_allclose(central[2], sum(Q[i] * params[i][2] for i in range(3)),
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(central[3], sum(Q[i] * params[i][3] for i in range(3)),
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(central[1], sum(p[i] * params[i][1] for i in range(3)),
                               rtol=1e-6, atol=1e-7)
    assert stats["labels_seen"] == int(seen.any(axis=0).sum())
    assert stats["labels_single"] == int((seen.sum(axis=0) == 1).sum())
    assert (seen.sum(axis=0) < 3).any()  # some label's weights were renormalized
    assert not any(r.seen_labels().any() for r in reps)  # the broadcast starts a new record


@pytest.mark.parametrize("per_label", [False, True])
def test_sampled_replicas_merge_only_changed_columns_and_give_the_dense_merge(be, many_labels,
                                                                            per_label):
    """With the sampled output layer the merge reads and writes only the ``W2`` columns (``b2``
    entries) some replica changed; the merged model is the dense merge's (with ``per_label``
    its per-label weights), and every replica ends holding it."""
    X, Y = many_labels
    reps = [mlp(be, X, Y, seed=i, optimizer="adagrad", output="sampled") for i in range(3)]
    for r in reps[1:]:
        r.set_params(reps[0].params())
    if per_label:
        for r in reps:
            r.track_labels()
    central = [np.array(a) for a in reps[0].params()]
    _period(reps)
    changed = np.logical_or.reduce([r.changed_columns() for r in reps])
    seen = np.stack([r.seen_labels() for r in reps]) if per_label else None
    params = [[np.array(a) for a in r.params()] for r in reps]
    p = np.array([0.5, 0.3, 0.2])
    Q = np.repeat(p[:, None], Y.shape[1], axis=1)
    if per_label:
        Q = np.where(seen.any(axis=0), p[:, None] * seen / (p[:, None] * seen).sum(0).clip(1e-30),
                     Q)
    stats = {}
    assert merge_changed_rows(reps, p, central, be, per_label=per_label, stats=stats) is not None
    assert stats["labels_changed"] == int(changed.sum()) < Y.shape[1]
    for k in (-2, -1):
        np.testing.assert_allclose(central[k], sum(Q[i] * params[i][k] for i in range(3)),
                                   rtol=1e-6, atol=1e-7)
    for r in reps:
        assert not r.changed_columns().any()
        for x, c in zip(r.params(), central, strict=True):
            assert np.array_equal(x, c)


def test_a_nonfinite_changed_column_sends_a_sampled_merge_to_the_dense_path(be, many_labels):
    """The merge writes the finite merged blocks back as it goes; the non-finite value stays in
    the replica that holds it (the dense merge then finds and drops that one) and reaches no
    other replica."""
    X, Y = many_labels
    reps = [mlp(be, X, Y, output="sampled") for _ in range(2)]
    central = [np.array(a) for a in reps[0].params()]
    _period(reps)
    col = int(np.flatnonzero(reps[1].changed_columns())[0])
    reps[1].params()[-2][3, col] = np.inf
    assert merge_changed_rows(reps, [0.5, 0.5], central, be) is None
    assert reps[1].params()[-2][3, col] == np.inf
    assert find_nonfinite([r.params() for r in reps], be) == [1]
    assert reps[1].changed_columns().any()  # not reset: the dense merge resets it


def test_a_nonfinite_row_stays_in_its_replica_and_the_merge_goes_dense(be, wide):
    X, Y = wide
    reps = [mlp(be, X, Y) for _ in range(2)]
    central = [np.array(p) for p in reps[0].params()]
    _period(reps)
    row = int(np.flatnonzero(reps[1].changed_rows())[0])
    reps[1].params()[0][row, 0] = np.nan
    before = [[np.array(x) for x in r.params()] for r in reps]
    assert merge_changed_rows(reps, [0.5, 0.5], central, be) is None
    assert np.isnan(reps[1].params()[0][row, 0])
    assert find_nonfinite([r.params() for r in reps], be) == [1]
    for r, b in zip(reps, before, strict=True):  # W1's merge failed: nothing else written
        for x, y in zip(r.params()[1:], b[1:], strict=True):
            np.testing.assert_array_equal(x, y)
    reps[1].params()[0][row, 0] = 0.0
    before = [[np.array(x) for x in r.params()] for r in reps]
    reps[1].params()[1][0] = np.inf  # in a dense parameter: found before anything is written
    assert merge_changed_rows(reps, [0.5, 0.5], central, be) is None
    before[1][1][0] = np.inf
    for r, b in zip(reps, before, strict=True):
        for x, y in zip(r.params(), b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_merge_changed_rows_does_not_apply_without_a_record_or_with_a_zero_weight(be, wide):
    X, Y = wide
    reps = [mlp(be, X, Y) for _ in range(2)]
    central = [np.array(p) for p in reps[0].params()]
    assert merge_changed_rows(reps, [1.0, 0.0], central, be) is None
    fakes = [FakeReplica(10, sleep=False, shapes=((4, 2), (2,))) for _ in range(2)]
    assert merge_changed_rows(fakes, [0.5, 0.5], [np.zeros((4, 2)), np.zeros(2)], be) is None


# -- whole runs: the same model as the dense merge -----------------------------------------------
class MergeLog:
    def __init__(self):
        self.merges = []

    def write(self, event, **fields):
        if event == "merge":
            self.merges.append(fields)


@pytest.mark.parametrize("output", ["exact", "sampled"])
@pytest.mark.parametrize("algorithm", ["adaptive", "average"])
def test_runs_with_the_sparse_merge_give_the_dense_merge_model(be, wide, many_labels, algorithm,
                                                               output, monkeypatch):
    import xmc_engine.algorithms.base as base

    done = []

    def counted(*args, **kwargs):
        done.append(merge_changed_rows(*args, **kwargs))
        return done[-1]

    monkeypatch.setattr(base, "merge_changed_rows", counted)
    X, Y = wide if output == "exact" else many_labels
    results = {}
    for sparse in (True, False):
        reps = [mlp(be, X, Y, optimizer="adagrad", output=output) for _ in range(2)]
        log = MergeLog()
        with make_trainer(reps, parse_devices("cpu,cpu@0.5", cores=2), algorithm, X.shape[0],
                          lr=0.1, batch_size=32, warmup_epochs=0, lr_decay=0, merge_period=128,
                          sparse_merge=sparse, seed=3, mode="simulated",
                          cost=lambda i, b: 1e-3 * b, log=log,
                          # the paper's weights: per-row / per-label ones need the sparse merge
                          **({"boost": True, "row_weights": "updates",
                              "label_weights": "updates"} if algorithm == "adaptive" else {})
                          ) as tr:
            for epoch in range(2):
                tr.run_epoch(epoch)
            results[sparse] = ([np.array(p) for p in tr.central_params()], log.merges)
    (sparse_params, sparse_log), (dense_params, dense_log) = results[True], results[False]
    for a, b in zip(sparse_params, dense_params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert len(sparse_log) == len(dense_log) > 4
    assert len(done) == len(sparse_log) and None not in done  # every merge took the sparse path
    assert all(m["merge_s"] > 0 for m in sparse_log + dense_log)  # its time is logged
    if algorithm == "adaptive":  # the L2 norm of the merged model, kept up to date
        for s, d in zip(sparse_log, dense_log, strict=True):
            assert s["norm"] == pytest.approx(d["norm"], rel=1e-5)
            assert s["flag"] == d["flag"]
            assert ([x["weight"] for x in s["devices"]]
                    == pytest.approx([x["weight"] for x in d["devices"]], rel=1e-9))
        assert np.sqrt(sum(sq_norms(sparse_params, be))) == pytest.approx(sparse_log[-1]["norm"],
                                                                    rel=1e-5)


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("state", ["keep", "average", "reset"])
def test_optimizer_state_at_a_merge(be, wide, state, sparse, monkeypatch):
    """``optimizer_state``: after a merge the replicas keep their own Adagrad accumulators, get
    their merge-weighted average, or zeros, on the row-sparse and on the dense merge path."""
    import xmc_engine.algorithms.adaptive as adaptive

    seen = []
    real = adaptive.AdaptiveSGD._merge_optimizer_state

    def spy(self, replicas, p):
        before = [[np.array(a) for a in r.accumulators()] for r in replicas]
        real(self, replicas, p)
        seen.append((before, [float(x) for x in p],
                     [[np.array(a) for a in r.accumulators()] for r in replicas]))

    monkeypatch.setattr(adaptive.AdaptiveSGD, "_merge_optimizer_state", spy)
    X, Y = wide
    reps = [mlp(be, X, Y, optimizer="adagrad") for _ in range(2)]
    with make_trainer(reps, parse_devices("cpu,cpu@0.5", cores=2), "adaptive", X.shape[0],
                      lr=0.1, batch_size=32, warmup_epochs=0, lr_decay=0, merge_period=128,
                      sparse_merge=sparse, optimizer_state=state, seed=3, mode="simulated",
                      cost=lambda i, b: 1e-3 * b) as tr:
        tr.run_epoch(0)
    assert len(seen) >= 3
    for before, p, after in seen:
        assert not np.array_equal(before[0][0], before[1][0])  # the replicas' states differed
        for i in range(2):
            for k, a in enumerate(after[i]):
                if state == "keep":
                    want = before[i][k]
                elif state == "average":
                    want = p[0] * before[0][k] + p[1] * before[1][k]
                else:
                    want = np.zeros_like(a)
                np.testing.assert_allclose(a, want, rtol=1e-6, atol=1e-7)


def test_delta_stats_measure_each_replica_s_change_by_row_sharing_and_label_tail(be, wide):
    """``delta_stats`` (AdaptiveConfig.delta_stats): per replica the RMS of ``w_i - central``
    on the W1 rows it alone changed, on rows shared with another replica, and on W2's head and
    tail label columns; the merge log gets the four lists."""
    from xmc_engine.scheduler.merge import delta_stats

    X, Y = wide
    reps = [mlp(be, X, Y) for _ in range(2)]
    central = [np.array(a) for a in reps[0].params()]
    _period(reps)
    tail = np.zeros(Y.shape[1], bool)
    tail[::2] = True
    got = delta_stats(reps, central, tail)
    masks = np.stack([r.changed_rows() for r in reps])
    for i, r in enumerate(reps):
        d1 = np.asarray(r.params()[0], np.float64) - central[0]
        d2 = np.asarray(r.params()[-2], np.float64) - central[-2]
        single = masks[i] & (masks.sum(0) == 1)
        shared = masks[i] & (masks.sum(0) == 2)
        assert single.any() and shared.any()
        assert got["delta_w1_single"][i] == pytest.approx(np.sqrt(np.mean(d1[single] ** 2)))
        assert got["delta_w1_shared"][i] == pytest.approx(np.sqrt(np.mean(d1[shared] ** 2)))
        assert got["delta_w2_head"][i] == pytest.approx(np.sqrt(np.mean(d2[:, ~tail] ** 2)))
        assert got["delta_w2_tail"][i] == pytest.approx(np.sqrt(np.mean(d2[:, tail] ** 2)))
        assert got["delta_w1_single"][i] > 0 and got["delta_w2_tail"][i] > 0
    fakes = [FakeReplica(10, sleep=False, shapes=((4, 2), (2,))) for _ in range(2)]
    assert delta_stats(fakes, [np.zeros((4, 2)), np.zeros(2)], tail) is None

    log = MergeLog()
    reps = [mlp(be, X, Y, optimizer="adagrad") for _ in range(2)]
    with make_trainer(reps, parse_devices("cpu,cpu@0.5", cores=2), "adaptive", X.shape[0],
                      lr=0.1, batch_size=32, warmup_epochs=0, lr_decay=0, merge_period=128,
                      delta_stats=True, seed=3, mode="simulated", cost=lambda i, b: 1e-3 * b,
                      log=log) as tr:
        tr.run_epoch(0)
    assert log.merges and all(len(m["delta_w2_tail"]) == 2 for m in log.merges)


def _merge_weights_run(be, wide, monkeypatch, epochs, above_labels, loss="softmax",
                       kwargs_seen=None, **params):
    """``adaptive`` on ``cpu,cpu@0.5`` (simulated clock) for ``epochs`` epochs, replicas training
    ``loss``, with the 'auto' label threshold at the label count plus ``above_labels``
    (None: left alone); returns each merge's ``(per_row, per_label)``, the merge log, the
    replicas and the policy's options; each merge's keyword arguments are appended to
    ``kwargs_seen`` where given."""
    import xmc_engine.algorithms.base as base
    from xmc_engine import config

    calls = []

    def spy(*args, **kwargs):
        calls.append((kwargs["per_row"], kwargs["per_label"]))
        if kwargs_seen is not None:
            kwargs_seen.append(kwargs)
        return merge_changed_rows(*args, **kwargs)

    monkeypatch.setattr(base, "merge_changed_rows", spy)
    X, Y = wide
    if above_labels is not None:
        monkeypatch.setattr(config, "AUTO_WEIGHTS_LABELS", Y.shape[1] + above_labels)
    reps = [mlp(be, X, Y, optimizer="adagrad", loss=loss) for _ in range(2)]
    log = MergeLog()
    # every period a merge of both replicas: no first periods on one device (solo_epochs,
    # whose "auto" gives half an epoch with the logistic loss; tests/test_solo.py)
    params.setdefault("solo_epochs", 0)
    with make_trainer(reps, parse_devices("cpu,cpu@0.5", cores=2), "adaptive", X.shape[0],
                      lr=0.1, batch_size=32, warmup_epochs=0, lr_decay=0, merge_period=128,
                      seed=3, mode="simulated", cost=lambda i, b: 1e-3 * b, log=log,
                      **params) as tr:
        for epoch in range(epochs):
            tr.run_epoch(epoch)
        resolved = tr.policy.config
    return calls, log, reps, resolved


@pytest.mark.parametrize("value, above_labels, first", [(1, None, 1), ("auto", 0, 1),
                                                        ("auto", 1, 0)])
def test_weights_from_epoch_keeps_the_paper_s_weights_until_that_epoch(be, wide, monkeypatch,
                                                                        value, above_labels,
                                                                        first):
    """``weights_from_epoch=1``: the merges of epoch 0 run with the paper's weights (no
    per-row / per-label renormalization), those from epoch 1 on with ``row_weights`` /
    ``label_weights`` (given here: their own ``'auto'`` is the paper's weights from the same
    threshold on). ``'auto'``: the same from :data:`AUTO_WEIGHTS_LABELS` labels on, from the
    start below."""
    calls, log, _, _ = _merge_weights_run(be, wide, monkeypatch, 3, above_labels,
                                          weights_from_epoch=value, row_weights="touched",
                                          label_weights="positives")
    epochs = [m["epoch"] for m in log.merges]
    assert len(calls) == len(epochs) and epochs.count(0) >= 2 and epochs.count(2) >= 2
    for epoch, (per_row, per_label) in zip(epochs, calls, strict=True):
        assert per_row is per_label is (epoch >= first)


@pytest.mark.parametrize("above_labels, loss, per_row_weights",
                         [(0, "softmax", False), (1, "softmax", True), (1, "bce", False)])
def test_auto_merge_weights_are_the_paper_s_on_a_large_label_space(be, wide, monkeypatch,
                                                                   above_labels, loss,
                                                                   per_row_weights):
    """The defaults (``row_weights`` / ``label_weights`` / ``weights_from_epoch`` ``'auto'``):
    from :data:`AUTO_WEIGHTS_LABELS` labels on, and with the logistic loss at any size, every
    merge uses the paper's weights and the replicas record no labels; with the softmax below
    it the per-row / per-label weights (the rows' ``'sum'``) from the first merge."""
    calls, log, reps, resolved = _merge_weights_run(be, wide, monkeypatch, 2, above_labels,
                                                    loss)
    assert len(calls) == len(log.merges) >= 4
    assert set(calls) == {(per_row_weights, per_row_weights)}
    assert (resolved.row_weights, resolved.label_weights) == (
        ("sum_sqrt_unequal", "positives") if per_row_weights else ("updates", "updates"))
    assert [r.seen_labels() is not None for r in reps] == [per_row_weights] * 2


@pytest.mark.parametrize("row_weights, from_epoch", [("sum", 1), ("sum_sqrt", 1),
                                                     ("sum_sqrt_unequal", 0),
                                                     ("sum_sqrt_unequal", 1)])
def test_row_weights_reach_the_merge_with_their_sum_power(be, wide, monkeypatch, row_weights,
                                                          from_epoch):
    """``row_weights="sum"`` / ``"sum_sqrt"``: every merge of the run is per-row with the sum,
    scaled by ``k ** -power`` (0, 0.5); ``"sum_sqrt_unequal"``: 0.5 in the periods whose
    batches differed (the step rule grows the fast device's after the first) from epoch
    ``sqrt_from_epoch`` on, 0 in those at equal batches and before it; the run log's merge
    record gives the power."""
    seen: list = []
    calls, log, _, resolved = _merge_weights_run(be, wide, monkeypatch, 2, None,
                                                 kwargs_seen=seen, row_weights=row_weights,
                                                 sqrt_from_epoch=from_epoch)
    assert resolved.row_weights == row_weights and len(seen) == len(log.merges) >= 4
    unequal = [len({d["batch_size"] for d in m["devices"]}) > 1 for m in log.merges]
    late = [m["epoch"] >= from_epoch for m in log.merges]
    assert True in unequal and False in unequal and (False in late) == (from_epoch > 0)
    for k, m, u, e in zip(seen, log.merges, unequal, late, strict=True):
        power = {"sum": 0.0, "sum_sqrt": 0.5,
                 "sum_sqrt_unequal": 0.5 if u and e else 0.0}[row_weights]
        assert (k["per_row"], k["row_sum"], k["row_sum_power"]) == (True, True, power)
        assert m["row_sum_power"] == power
    if row_weights == "sum_sqrt_unequal" and from_epoch == 1:  # both kinds of merge happened
        assert {m["row_sum_power"] for m in log.merges} == {0.0, 0.5}
