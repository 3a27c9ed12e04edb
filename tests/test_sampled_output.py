"""The sampled output layer: its kernels against kernels/reference.py (CPU here, CUDA under the
simulator), the candidate sampler, the step against the exact softmax, and training with it."""

from __future__ import annotations

import numpy as np
import pytest
from xmc_engine.kernels import _cuda, reference
from xmc_engine.kernels import sampled_output as so

from tests.test_estimator import tiny_data
from xmc_engine import XMCClassifier, output_layer
from xmc_engine.backends import cuda_available
from xmc_engine.backends.cpu import CPUBackend
from xmc_engine.config import ALGORITHMS, TrainConfig
from xmc_engine.errors import ConfigError
from xmc_engine.model import MLPReplica, ModelShape, init_params
from xmc_engine.output_layer import (
    FrequencyProposal,
    LSHProposal,
    _guided_search,
    sample_candidates,
)

F32 = np.float32
# (n_hidden, n_labels, m): m = 0, one column, and sizes that are not multiples of a block
SHAPES = [(5, 9, 0), (3, 7, 1), (33, 70, 37), (8, 300, 257)]


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


def _case(rng, nh, L, m):
    W2 = rng.standard_normal((nh, L)).astype(F32)
    b2 = rng.standard_normal(L).astype(F32)
    cols = rng.choice(L, size=m, replace=False).astype(np.int64)
    dW2s = rng.standard_normal((nh, m)).astype(F32)
    db2s = rng.standard_normal(m).astype(F32)
    return W2, b2, cols, dW2s, db2s


@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_kernels_match_reference(rng, shape):
    W2, b2, cols, dW2s, db2s = _case(rng, *shape)
    nh, _, m = shape
    W2s, b2s = np.full((nh, m), np.nan, F32), np.full(m, np.nan, F32)
    so.gather_columns_cpu(W2, b2, cols, W2s, b2s)
    ref_W, ref_b = reference.gather_columns(W2, b2, cols)
    np.testing.assert_array_equal(W2s, ref_W)
    np.testing.assert_array_equal(b2s, ref_b)

    W, b = W2.copy(), b2.copy()
    so.scatter_add_columns_cpu(W, b, cols, dW2s, db2s, -0.3)
    ref_W, ref_b = reference.scatter_add_columns(W2, b2, cols, dW2s, db2s, F32(-0.3))
    np.testing.assert_allclose(W, ref_W, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(b, ref_b, rtol=1e-6, atol=1e-6)

    aW, ab = rng.random(W2.shape).astype(F32), rng.random(b2.shape).astype(F32)
    W, b, aW1, ab1 = W2.copy(), b2.copy(), aW.copy(), ab.copy()
    so.adagrad_columns_cpu(W, b, aW1, ab1, cols, dW2s, db2s, 0.1, 1e-10)
    refs = reference.adagrad_columns(W2, b2, aW, ab, cols, dW2s, db2s, 0.1, 1e-10)
    for got, want in zip((W, b, aW1, ab1), refs, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _labels(rng, B, L, empty_every=3):
    """Label CSR (indptr, indices int32) with rows 1, 1 + empty_every, ... without labels."""
    rows = [np.sort(rng.choice(L, size=0 if i % empty_every == 1 else
                               int(rng.integers(1, min(4, L) + 1)), replace=False))
            for i in range(B)]
    indptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    return indptr, np.concatenate([np.empty(0, np.int64), *rows]).astype(np.int32)


@pytest.mark.parametrize("negatives", [0, 5, 40, 10**6])
def test_sample_candidates(rng, negatives):
    L = 60
    _, y = _labels(rng, 9, L)
    cols, local_y, n_pos, log_weight = sample_candidates(y, L, negatives, rng)
    pos = np.unique(y)
    assert n_pos == len(pos) and np.array_equal(cols[:n_pos], pos)
    assert len(np.unique(cols)) == len(cols) and cols.dtype == np.int64
    assert np.array_equal(cols[local_y], y) and local_y.dtype == np.int32
    neg = cols[n_pos:]
    assert not np.isin(neg, pos).any()
    assert len(neg) == min(negatives, L - n_pos)
    expect = np.log((L - n_pos) / len(neg)) if len(neg) else 0.0
    assert log_weight == pytest.approx(expect)
    if negatives >= L:  # every label: the exact softmax
        assert sorted(cols) == list(range(L)) and log_weight == 0.0


@pytest.mark.parametrize("L, k", [(60, 5), (60, 40), (200, 150), (5000, 1024), (40, 30)])
def test_uniform_negatives_equal_the_numpy_specification(L, k):
    """Same draws, same negatives in the same order (several rounds where k is close to the
    free labels), and the scratch mask is left all False for the next call."""
    for seed in range(20):
        y = _labels(np.random.default_rng(seed), 9, L)[1]
        pos = np.unique(y.astype(np.int64))
        kk = min(k, L - len(pos))
        if kk in (0, L - len(pos)):
            continue
        cols, _, n_pos, _ = sample_candidates(y, L, k, np.random.default_rng(100 + seed))
        want = reference.uniform_negatives(pos, L, kk, np.random.default_rng(100 + seed))
        np.testing.assert_array_equal(cols[n_pos:], want)
        assert not output_layer._label_mask(L).any()


def test_sampled_negatives_are_uniform():
    rng = np.random.default_rng(0)
    y = np.array([3, 7], dtype=np.int32)
    counts = np.zeros(50)
    for _ in range(2000):
        cols, *_ = sample_candidates(y, 50, 6, rng)
        counts[cols[2:]] += 1
    assert counts[[3, 7]].sum() == 0
    free = np.delete(counts, [3, 7])
    expected = 2000 * 6 / 48
    assert np.abs(free - expected).max() < 0.25 * expected, free


def test_frequency_proposal_draws_in_proportion_to_a_power_of_the_counts():
    counts = np.array([0, 1, 10, 100, 1000, 3])
    p = FrequencyProposal(counts, power=0.75)
    want = (counts + 1.0) ** 0.75
    np.testing.assert_allclose(p.q, want / want.sum())
    draws = p.draw(np.random.default_rng(0), 200_000)
    assert draws.dtype == np.int64 and draws.min() >= 0 and draws.max() < len(counts)
    freq = np.bincount(draws, minlength=len(counts)) / len(draws)
    np.testing.assert_allclose(freq, p.q, rtol=0.05, atol=1e-3)
    np.testing.assert_allclose(FrequencyProposal(counts, power=0).q, 1 / len(counts))
    with pytest.raises(ValueError, match="count >= 0"):
        FrequencyProposal([3])
    with pytest.raises(ValueError, match="count >= 0"):
        FrequencyProposal([3, -1])


@pytest.mark.parametrize("n_labels", [2, 3, 60, 5_000, 200_000])
def test_frequency_negatives_match_the_reference_draw_for_draw(n_labels):
    """The guide-table search and the merge of sorted lists give exactly the labels and weights
    of a search over the whole cdf and NumPy's set operations, from the same generator state
    (fewer labels than guide cells, and a tail-heavy count profile, included)."""
    gen = np.random.default_rng(n_labels)
    counts = gen.zipf(1.3, n_labels) - 1
    p = FrequencyProposal(counts)
    for k in (1, 7, 1024, 3 * n_labels):
        pos = np.unique(gen.integers(0, n_labels, max(1, n_labels // 10)))
        seed = int(gen.integers(1 << 30))
        got = p.negatives(pos, k, np.random.default_rng(seed))
        want = reference.frequency_negatives(p.q, pos, k, np.random.default_rng(seed))
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert got[0].dtype == np.int64 and got[1].dtype == np.float32


def test_guided_search_equals_searchsorted_at_cell_edges_and_the_ends():
    gen = np.random.default_rng(3)
    p = FrequencyProposal(gen.zipf(1.5, 100_000) - 1)
    cdf, cells = p._cdf, len(p._guide) - 1
    edges = np.arange(cells) * (cdf[-1] / cells)
    u = np.sort(np.concatenate([edges, np.nextafter(edges, 0), np.nextafter(edges, 1),
                                cdf[:50], np.nextafter(cdf[:50], 0), [0.0],
                                [np.nextafter(cdf[-1], 0)]]))
    u = u[(u >= 0) & (u < cdf[-1])]
    want = np.minimum(np.searchsorted(cdf, u, side="right"), len(cdf) - 1)
    np.testing.assert_array_equal(_guided_search(cdf, p._guide, u), want)
    draws = p.draw(np.random.default_rng(0), 1000)
    assert (np.diff(draws) >= 0).all()  # ascending, as negatives() relies on


@pytest.mark.parametrize("negatives", [0, 1, 30, 5000])
def test_sample_candidates_with_a_frequency_proposal(rng, negatives):
    L = 60
    _, y = _labels(rng, 9, L)
    p = FrequencyProposal(rng.integers(0, 50, L))
    cols, local_y, n_pos, log_weight = sample_candidates(y, L, negatives, rng, p)
    pos = np.unique(y)
    assert n_pos == len(pos) and np.array_equal(cols[:n_pos], pos)
    assert len(np.unique(cols)) == len(cols) and np.array_equal(cols[local_y], y)
    neg = cols[n_pos:]
    assert not np.isin(neg, pos).any() and len(neg) <= negatives
    if negatives == 0:
        assert len(neg) == 0 and log_weight == 0.0
        return
    assert log_weight.dtype == np.float32 and log_weight.shape == neg.shape
    incl = 1 - (1 - p.q[neg]) ** negatives
    np.testing.assert_allclose(log_weight, -np.log(incl), rtol=1e-5, atol=1e-6)
    assert (log_weight >= 0).all()
    with pytest.raises(ValueError, match="proposal over 60 labels for 61 labels"):
        sample_candidates(y, 61, negatives, rng, p)


def _lsh(rng, L=300, h=8, **kw):
    W2 = rng.standard_normal((h, L)).astype(F32)
    p = LSHProposal(L, h, **kw)
    p.before_step(CPUBackend(threads=1), W2)
    return p, W2


def test_lsh_proposal_buckets_labels_by_the_signs_of_their_projected_columns(rng):
    p, W2 = _lsh(rng, bits=5)
    codes = ((W2.T @ p.planes) > 0) @ (1 << np.arange(5))
    pos = np.array([3, 17, 200])
    want = np.flatnonzero(np.isin(codes, codes[pos]))
    np.testing.assert_array_equal(p.bucket_mates(pos), want)
    assert np.isin(pos, want).all()
    assert len(p.bucket_mates(np.empty(0, np.int64))) == 0
    # W2 is hashed again every refresh_steps steps, and only then
    q = LSHProposal(300, 8, refresh_steps=3)
    with pytest.raises(RuntimeError, match="refresh"):
        q.bucket_mates(pos)
    seen, refresh = [], q.refresh
    q.refresh = lambda W: (seen.append(1), refresh(W))
    for _ in range(7):
        q.before_step(CPUBackend(threads=1), W2)
    assert len(seen) == 3  # steps 0, 3 and 6
    with pytest.raises(ValueError, match="0 <= mix <= 1"):
        LSHProposal(300, 8, mix=1.5)


@pytest.mark.parametrize("negatives", [1, 40, 3000])
def test_sample_candidates_with_an_lsh_proposal(rng, negatives):
    p, _ = _lsh(rng)
    _, y = _labels(rng, 9, 300)
    cols, local_y, n_pos, log_weight = sample_candidates(y, 300, negatives, rng, p)
    pos = np.unique(y)
    assert np.array_equal(cols[:n_pos], pos) and np.array_equal(cols[local_y], y)
    neg = cols[n_pos:]
    assert len(np.unique(cols)) == len(cols) and not np.isin(neg, pos).any()
    U = p.bucket_mates(pos)
    q = 0.5 / 300 + np.where(np.isin(neg, U), 0.5 / len(U), 0.0)
    np.testing.assert_allclose(log_weight, -np.log(1 - (1 - q) ** negatives), rtol=1e-5)
    if negatives == 3000:  # the hard half covers the positives' buckets
        assert np.isin(np.setdiff1d(U, pos), neg).all()


def test_frequency_weights_estimate_the_partition_sum_without_bias():
    """The weighted negatives' ``sum exp(z + log_weight)`` averages to the sum of ``exp(z)``
    over every label that is not a positive (what the exact softmax's denominator holds)."""
    rng = np.random.default_rng(1)
    L = 40
    p = FrequencyProposal(rng.zipf(1.5, L) - 1)
    z = rng.standard_normal(L)
    y = np.array([int(p.q.argmax()), 5], dtype=np.int32)
    want = np.exp(np.delete(z, np.unique(y))).sum()
    est, flat = [], []
    for _ in range(4000):
        cols, _, n_pos, log_weight = sample_candidates(y, L, 6, rng, p)
        neg = cols[n_pos:]
        est.append(np.exp(z[neg] + log_weight).sum())
        # a constant weight (the uniform rule's form) is biased under this proposal
        flat.append(np.exp(z[neg]).sum() * (L - n_pos) / max(len(neg), 1))
    se = np.std(est) / np.sqrt(len(est))
    assert abs(np.mean(est) - want) < 4 * se, (np.mean(est), want, se)
    assert abs(np.mean(flat) - want) > 10 * np.std(flat) / np.sqrt(len(flat)), np.mean(flat)
    # the LSH rule's weights too (a batch-dependent proposal)
    lsh, _ = _lsh(rng, L=L, h=4, bits=3)
    est = []
    for _ in range(4000):
        cols, _, n_pos, log_weight = sample_candidates(y, L, 6, rng, lsh)
        est.append(np.exp(z[cols[n_pos:]] + log_weight).sum())
    se = np.std(est) / np.sqrt(len(est))
    assert abs(np.mean(est) - want) < 4 * se, (np.mean(est), want, se)


@pytest.mark.parametrize("B", [0, 1, 7])
@pytest.mark.parametrize("rule", ["uniform", "frequency"])
def test_sampled_output_grad_matches_reference(rng, B, rule):
    """One weight for every negative (uniform), or one per negative (a frequency proposal)."""
    nh, L = 6, 40
    be = CPUBackend(threads=1)
    H = np.maximum(rng.standard_normal((B, nh)), 0).astype(F32)
    W2, b2 = rng.standard_normal((nh, L)).astype(F32), rng.standard_normal(L).astype(F32)
    y_indptr, y = _labels(rng, B, L)
    proposal = FrequencyProposal(rng.integers(0, 20, L)) if rule == "frequency" else None
    cols, local_y, n_pos, log_weight = sample_candidates(y, L, 11, rng, proposal)
    loss, dW2s, db2s, dH = be.sampled_output_grad(H, W2, b2, cols, n_pos, log_weight, y_indptr,
                                                  local_y)
    offs = np.zeros(len(cols))
    offs[n_pos:] = log_weight
    r_loss, r_dW2, r_db2, r_dH = reference.sampled_output_grad(
        H.astype(np.float64), W2.astype(np.float64), b2.astype(np.float64), y_indptr, y, cols,
        offs)
    assert loss == pytest.approx(r_loss, rel=1e-5, abs=1e-5)
    np.testing.assert_allclose(dW2s, r_dW2[:, cols], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(db2s, r_db2[cols], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dH, r_dH, rtol=1e-4, atol=1e-6)


def _replicas(optimizer, L=25, **kw):
    X, Y = tiny_data(n=200, n_labels=L)
    params = init_params(ModelShape(X.shape[1], L, (16,)), seed=1)
    exact = MLPReplica(CPUBackend(threads=1), X, Y, params, optimizer=optimizer)
    sampled = MLPReplica(CPUBackend(threads=1), X, Y, params, optimizer=optimizer,
                         output="sampled", **kw)
    return exact, sampled


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_sampled_step_with_every_label_is_the_exact_step(optimizer):
    exact, sampled = _replicas(optimizer, negatives=10**6)
    for start in range(0, 96, 32):
        rows = np.arange(start, start + 32)
        assert sampled.train_batch(rows, 0.3) == pytest.approx(exact.train_batch(rows, 0.3),
                                                                rel=1e-5)
    for a, b in zip(exact.params(), sampled.params(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(exact.optimizer_state(), sampled.optimizer_state(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_sampled_step_touches_only_the_candidate_columns(optimizer):
    _, rep = _replicas(optimizer, L=200, negatives=3)
    rows = np.arange(0, 4)
    before = [np.array(p) for p in rep.params()]
    rep.train_batch(rows, 0.5)
    batch_labels = np.unique(rep.Y[rows].indices)
    moved = np.flatnonzero((rep.params()[-2] != before[-2]).any(axis=0))
    assert set(batch_labels) <= set(moved) and len(moved) <= len(batch_labels) + 3
    assert np.array_equal(np.flatnonzero(rep.params()[-1] != before[-1]), moved)


def test_sampled_grad_batch_is_column_sparse_over_the_candidates():
    """``grad_batch`` with the sampled output layer: ``W2``, ``b2`` as ``(cols, values)`` over
    the candidate labels, and applying it is the step ``train_batch`` makes."""
    exact, rep = _replicas("sgd", L=200, negatives=5)
    rows = np.arange(10, 18)
    loss, grads = rep.grad_batch(rows)
    (cols, dW2), (cols_b, db2) = grads[-2], grads[-1]
    assert cols is cols_b and cols.dtype == np.int64 and np.unique(cols).size == cols.size
    assert dW2.shape == (rep.params()[-2].shape[0], cols.size) and db2.shape == cols.shape
    positives = np.unique(rep.Y[rows].indices)
    assert set(positives) <= set(cols) and len(cols) == len(positives) + 5
    assert loss > 0
    before = [np.array(p) for p in rep.params()]
    rep.apply_grads(grads, 0.5)
    moved = np.flatnonzero((rep.params()[-2] != before[-2]).any(axis=0))
    assert set(moved) <= set(cols) and len(moved) > 0


def test_output_auto_chooses_from_the_label_space_against_a_sampled_step_s_width():
    """``output="auto"``: sampled when ``n_labels >= AUTO_SAMPLED_RATIO x (batch x labels per
    row + negatives)``; a run says which it trained, and the planner plans that one."""
    from xmc_engine.config import AUTO_SAMPLED_RATIO
    from xmc_engine.memory import plan_memory

    cfg = TrainConfig(output="auto", batch_size=64, negatives=1024)
    width = 64 * 5.0 + 1024
    assert cfg.output_for(int(AUTO_SAMPLED_RATIO * width), 5.0) == "sampled"
    assert cfg.output_for(int(AUTO_SAMPLED_RATIO * width) - 1, 5.0) == "exact"
    assert cfg.output_for(983, 19.0) == "exact"  # delicious' shape
    for fixed in ("exact", "sampled"):  # an explicit choice is kept whatever the data
        assert TrainConfig(output=fixed).output_for(10**7, 1.0) == fixed
    shape = dict(n_samples=1000, n_features=50, nnz=10**4, label_nnz=5000)
    for n_labels, want in ((100_000, "sampled"), (1000, "exact")):
        plan = plan_memory(cfg, n_labels=n_labels, budget="1TiB", **shape)
        assert plan.settings["output"] == want
    X, Y = tiny_data(n=300, n_labels=400)  # ~2 labels per row: 8 x (8 x 2 + 6) < 400
    for n_labels, want in ((400, "sampled"), (40, "exact")):
        Xs, Ys = (X, Y) if n_labels == 400 else tiny_data(n=300, n_labels=40)
        clf = XMCClassifier(hidden=8, epochs=1, batch_size=8, output="auto", negatives=6,
                            threads=1, eval_every=0).fit(Xs, Ys)
        start = clf.history_[0]
        assert start["output"] == want and start["config"]["output"] == "auto"


def test_config_output_and_negatives():
    cfg = TrainConfig(output="sampled", negatives=64)
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    assert TrainConfig().output == "auto"
    with pytest.raises(ConfigError, match="output='softmax'.*exact, sampled, auto"):
        TrainConfig(output="softmax")
    with pytest.raises(ConfigError, match="negatives=-1"):
        TrainConfig(negatives=-1)
    X, Y = tiny_data(n=20)
    params = init_params(ModelShape(X.shape[1], Y.shape[1], (4,)))
    with pytest.raises(ValueError, match="output='fast'"):
        MLPReplica(CPUBackend(threads=1), X, Y, params, output="fast")
    with pytest.raises(ValueError, match="negatives=-2"):
        MLPReplica(CPUBackend(threads=1), X, Y, params, output="sampled", negatives=-2)
    assert TrainConfig().negative_sampling == "frequency"
    with pytest.raises(ConfigError, match="negative_sampling='popular'.*uniform, frequency, lsh"):
        TrainConfig(negative_sampling="popular")
    with pytest.raises(ValueError, match="negative_sampling='hard'"):
        MLPReplica(CPUBackend(threads=1), X, Y, params, output="sampled",
                   negative_sampling="hard")


@pytest.fixture(scope="module")
def toy():
    X, Y = tiny_data(n=600, n_labels=60)
    return X[:500], Y[:500], X[500:], Y[500:]


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_every_algorithm_trains_with_the_sampled_layer(toy, algorithm):
    Xtr, Ytr, Xte, Yte = toy
    devices = "cpu" if algorithm == "single" else "cpu,cpu"
    m = XMCClassifier(hidden=32, epochs=6, batch_size=32, lr=0.5, output="sampled",
                      negatives=8, devices=devices, algorithm=algorithm, threads=1,
                      eval_every=0, seed=0, optimizer="sgd",
                      normalize="none")  # SGD's rate suits the raw toy rows (norm ~3)
    m.fit(Xtr, Ytr, eval_set=(Xte, Yte))
    popular = int(np.asarray(Ytr.sum(0)).argmax())
    assert m.metrics_["P@1"] > float(Yte[:, popular].mean()) + 0.1, m.metrics_


def test_frequency_sampled_training_learns_and_draws_frequent_labels_more(toy):
    Xtr, Ytr, Xte, Yte = toy
    kw = dict(hidden=32, epochs=6, batch_size=32, output="sampled", negatives=8, threads=1,
              eval_every=0, seed=0)
    popular = int(np.asarray(Ytr.sum(0)).argmax())
    for rule in ("frequency", "lsh"):
        m = XMCClassifier(**kw, negative_sampling=rule).fit(Xtr, Ytr, eval_set=(Xte, Yte))
        assert m.metrics_["P@1"] > float(Yte[:, popular].mean()) + 0.1, (rule, m.metrics_)
        assert m.get_config().negative_sampling == rule
    params = init_params(ModelShape(Xtr.shape[1], Ytr.shape[1], (4,)))
    rep = MLPReplica(CPUBackend(threads=1), Xtr, Ytr, params, output="sampled", negatives=4,
                     negative_sampling="frequency")
    counts = np.bincount(Ytr.indices, minlength=Ytr.shape[1])
    want = (counts + 1.0) ** 0.75
    np.testing.assert_allclose(rep._proposal.q, want / want.sum())
    exact = MLPReplica(CPUBackend(threads=1), Xtr, Ytr, params, negative_sampling="frequency")
    assert exact._proposal is None  # the exact softmax draws nothing


def test_sampled_model_saves_and_resumes(toy, tmp_path):
    Xtr, Ytr, Xte, _ = toy
    kw = dict(hidden=16, epochs=2, batch_size=32, lr=0.05, output="sampled", negatives=8,
              optimizer="adagrad", threads=1, eval_every=0)
    m = XMCClassifier(**kw, log_dir=str(tmp_path / "run"), checkpoint_every=100).fit(Xtr, Ytr)
    m.save(tmp_path / "model")
    back = XMCClassifier.load(tmp_path / "model")
    assert back.get_config().output == "sampled" and back.get_config().negatives == 8
    np.testing.assert_array_equal(back.predict_topk(Xte, 3)[0], m.predict_topk(Xte, 3)[0])
    more = XMCClassifier(**{**kw, "epochs": 3}, log_dir=str(tmp_path / "run"),
                         checkpoint_every=100).fit(Xtr, Ytr, resume=True)
    assert np.isfinite(more.params_[-2]).all()


def test_sampled_run_resumed_from_a_checkpoint_draws_the_same_negatives(toy, tmp_path):
    """The checkpoint keeps the negative sampler's state: a run stopped mid-way and resumed ends
    with the model of the uninterrupted run."""
    Xtr, Ytr, _, _ = toy
    kw = dict(hidden=16, epochs=3, batch_size=32, lr=0.05, output="sampled", negatives=8,
              optimizer="adagrad", threads=1, eval_every=0, seed=4)
    full = XMCClassifier(**kw).fit(Xtr, Ytr)
    XMCClassifier(**{**kw, "epochs": 1.5}, log_dir=str(tmp_path), checkpoint_every=100).fit(
        Xtr, Ytr)
    resumed = XMCClassifier(**kw, log_dir=str(tmp_path), checkpoint_every=100).fit(
        Xtr, Ytr, resume=True)
    for a, b in zip(full.params_, resumed.params_, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# -- CUDA kernels (simulator or GPU; tests/test_kernels_cudasim.py runs them in a child) -------
def _device_arrays():
    if _cuda.CUDASIM:
        return _cuda.cuda.to_device, lambda d: d.copy_to_host(), 0
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    nb = _cuda.cuda.external_stream(stream.ptr)

    def to_dev(a):
        with stream:
            return _cuda.cuda.as_cuda_array(cupy.asarray(np.ascontiguousarray(a)), sync=False)

    def to_host(d):
        out = d.copy_to_host(stream=nb)
        stream.synchronize()  # synchronize!
        return out

    return to_dev, to_host, nb


@pytest.mark.cudasim
@pytest.mark.skipif(not (_cuda.CUDASIM or cuda_available()),
                    reason="CUDA kernels need NUMBA_ENABLE_CUDASIM=1 (set before numba is "
                    "imported) or a usable CUDA device")
@pytest.mark.parametrize("shape", [(3, 7, 0), (3, 7, 1), (5, 40, 13)])
def test_cuda_kernels_match_reference(rng, shape):
    dev, host, stream = _device_arrays()
    W2, b2, cols, dW2s, db2s = _case(rng, *shape)
    nh, _, m = shape
    W2s, b2s = dev(np.zeros((nh, m), F32)), dev(np.zeros(m, F32))
    so.gather_columns_launch(dev(W2), dev(b2), dev(cols), W2s, b2s, stream)
    ref_W, ref_b = reference.gather_columns(W2, b2, cols)
    np.testing.assert_array_equal(host(W2s), ref_W)
    np.testing.assert_array_equal(host(b2s), ref_b)

    Wd, bd = dev(W2), dev(b2)
    so.scatter_add_columns_launch(Wd, bd, dev(cols), dev(dW2s), dev(db2s), -0.3, stream)
    ref_W, ref_b = reference.scatter_add_columns(W2, b2, cols, dW2s, db2s, F32(-0.3))
    np.testing.assert_allclose(host(Wd), ref_W, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(host(bd), ref_b, rtol=1e-6, atol=1e-6)

    aW, ab = rng.random(W2.shape).astype(F32), rng.random(b2.shape).astype(F32)
    Wd, bd, aWd, abd = dev(W2), dev(b2), dev(aW), dev(ab)
    so.adagrad_columns_launch(Wd, bd, aWd, abd, dev(cols), dev(dW2s), dev(db2s), 0.1, 1e-10,
                              stream)
    refs = reference.adagrad_columns(W2, b2, aW, ab, cols, dW2s, db2s, 0.1, 1e-10)
    for got, want in zip((Wd, bd, aWd, abd), refs, strict=True):
        np.testing.assert_allclose(host(got), want, rtol=1e-5, atol=1e-6)



def test_memory_plan_knows_the_sampled_mode():
    from xmc_engine.memory import plan_memory

    shape = dict(n_samples=100_000, n_features=50_000, n_labels=500_000, nnz=5e6,
                 label_nnz=4e5, budget="1TiB")

    def act(plan):
        (pool,) = plan.pools
        return sum(v for k, v in pool.items.items() if k.startswith("activations"))

    exact = plan_memory(TrainConfig(batch_size=256, output="exact"), **shape)
    sampled = plan_memory(TrainConfig(batch_size=256, output="sampled", negatives=1000),
                          **shape)
    m = 256 * 4 + 1000  # b x labels per row + negatives
    assert act(sampled) == 2 * 256 * 128 * 4 + 256 * m * 4 + 2 * 129 * m * 4
    assert act(exact) > 100 * act(sampled)
    assert sampled.settings["output"] == "sampled" and "negatives 1000" in sampled.summary()
    # Adagrad adds its accumulators (the same decay for both: "auto" would add the plateau
    # rule's copy of the rows to Adagrad's plan alone at this size)
    ada = plan_memory(TrainConfig(output="sampled", optimizer="adagrad", lr_decay=0.0), **shape)
    P = ada.settings["param_bytes"]
    sgd = plan_memory(TrainConfig(output="sampled", optimizer="sgd", lr_decay=0.0), **shape)
    assert ada.pools[0].total - sgd.pools[0].total == P


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_thread_calibration_leaves_the_replica_as_it_was(optimizer):
    """Calibration times the replica's own step (sampled here: no full logits are built) at
    lr 0, and restores what those steps touch: the optimizer state, the negatives' random
    stream and the records of changed rows / columns / labels."""
    _, rep = _replicas(optimizer, L=200, negatives=3)
    rep.track_labels()
    rep.train_batch(np.arange(5), 0.1)  # some state to keep: accumulators, marks
    before = [np.array(p) for p in rep.params()]
    acc = [np.array(a) for a in rep.accumulators()]
    marks = [np.array(m) for m in (rep.changed_rows(), rep.changed_columns(), rep.seen_labels())]
    rng = dict(rep.rng_state())
    assert rep.calibrate_threads(32, 2) in (1, 2)
    assert rep.backend.threads in (1, 2)
    assert "Z" not in rep.backend._ws and "Zs" in rep.backend._ws  # the sampled path only
    for a, b in zip(before, rep.params(), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(acc, rep.accumulators(), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(marks, (rep.changed_rows(), rep.changed_columns(), rep.seen_labels()),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert rep.rng_state() == rng
    # a fresh replica's zero accumulators are zero again afterwards
    _, fresh = _replicas(optimizer, L=200, negatives=3)
    fresh.calibrate_threads(32, 2)
    assert not any(a.any() for a in fresh.accumulators())
    assert not fresh.changed_rows().any() and not fresh.changed_columns().any()


def test_thread_calibration_leaves_the_lsh_proposal_as_it_was():
    _, rep = _replicas("adagrad", L=200, negatives=3, negative_sampling="lsh")
    rep.train_batch(np.arange(5), 0.1)
    steps, codes = rep._proposal._steps, rep._proposal._codes
    rep.calibrate_threads(32, 2)
    assert rep._proposal._steps == steps and rep._proposal._codes is codes


def test_thread_calibration_times_steps_in_a_fresh_thread_and_needs_a_margin():
    import threading
    import time

    import numba

    from xmc_engine import model

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here: no budget to choose")
    be = CPUBackend(threads=2)
    seen = []

    def step_taking(ms_one, ms_two):  # the step's time under each budget
        def step():
            seen.append(threading.current_thread())
            time.sleep(1e-3 * (ms_one if numba.get_num_threads() == 1 else ms_two))
        return step

    assert model.calibrate_threads(be, step_taking(4, 2), 2) == 2
    assert seen and all(t is not threading.main_thread() for t in seen)
    assert model.calibrate_threads(be, step_taking(2, 4), 2) == 1
    assert model.calibrate_threads(be, step_taking(4, 3.9), 2) == 1  # within the margin
    assert model.calibrate_threads(be, step_taking(1, 1), 1) == 1  # nothing to choose

    def fail():
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        model.calibrate_threads(be, fail, 2)


def test_a_run_too_short_to_repay_the_calibration_keeps_one_thread_untimed():
    """With 4 ms steps, timing the budgets costs about 3 rounds x 2 budgets x 50 ms: a run of
    20 steps (80 ms on one thread, 40 ms to save at best) keeps one thread after the two warm-up
    steps, even where two threads would be faster; a run of 2,000 steps (8 s) is timed."""
    import time

    import numba

    from xmc_engine import model

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here: no budget to choose")
    be = CPUBackend(threads=2)
    calls = []

    def step():
        calls.append(numba.get_num_threads())
        time.sleep(4e-3 if numba.get_num_threads() == 1 else 2e-3)

    report = {}
    assert model.calibrate_threads(be, step, 2, run_steps=20, report=report) == 1
    assert calls == [1, 1] and report["timed"] is False  # the warm-up only
    assert report["skipped"] == "run"
    assert 0.06 < report["one_thread_run_s"] < 0.2
    calls.clear()
    assert model.calibrate_threads(be, step, 2, run_steps=2000, report=report) == 2
    assert report["timed"] is True and 2 in calls
    report.clear()
    assert model.calibrate_threads(be, step, 2, report=report) == 2  # no run length: timed
    speedup = report.pop("speedup")  # one thread's 4 ms over two threads' 2 ms, about 2
    rounds = report.pop("rounds")  # each round's seconds per step, by budget
    assert report == {"timed": True, "skipped": None, "one_thread_run_s": None}
    assert 1.3 < speedup < 3.0
    assert len(rounds) == 3 and all(set(r) == {1, 2} for r in rounds)
    assert min(r[1] for r in rounds) / min(r[2] for r in rounds) == pytest.approx(speedup)


def test_steps_too_short_to_gain_from_threads_keep_one_thread_untimed(monkeypatch):
    """A step of microseconds on one thread (under CALIBRATE_MIN_STEP_S) keeps one thread
    after the two warm-up steps, however long the run; with the floor at 0 it is timed."""
    import numba

    from xmc_engine import model

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here: no budget to choose")
    calls = []

    def step():
        calls.append(numba.get_num_threads())

    report = {}
    assert model.calibrate_threads(CPUBackend(threads=2), step, 2, run_steps=1e9,
                                   report=report) == 1
    assert calls == [1, 1] and report["timed"] is False and report["skipped"] == "step"
    monkeypatch.setattr(model, "CALIBRATE_MIN_STEP_S", 0.0)
    calls.clear()
    model.calibrate_threads(CPUBackend(threads=2), step, 2, run_steps=1e9, report=report)
    assert report["timed"] is True and 2 in calls


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_sampled_training_on_the_cuda_stand_in_equals_the_cpu(monkeypatch, optimizer):
    """The CUDA backend's sampled path (over tests/fake_cupy.py: NumPy kernels, a ledger of
    stream accesses) ends where the CPU backend ends, with no unordered access."""
    from tests import fake_cupy
    from xmc_engine.backends.cuda import CUDABackend

    ledger = fake_cupy.install(monkeypatch, n_devices=1)
    X, Y = tiny_data(n=96, n_labels=40)
    params = init_params(ModelShape(X.shape[1], Y.shape[1], (16, 8)), seed=3)
    reps = [MLPReplica(be, X, Y, params, optimizer=optimizer, output="sampled", negatives=6,
                       seed=5)
            for be in (CPUBackend(threads=1), CUDABackend(0, launch=fake_cupy.launch))]
    for start in range(0, 96, 16):
        losses = [r.train_batch(np.arange(start, start + 16), 0.5) for r in reps]
        assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    g = [r.grad_batch(np.arange(16)) for r in reps]
    assert g[1][0] == pytest.approx(g[0][0], rel=1e-4)
    for k in (0, 1):  # (cols, dW2 over them)
        np.testing.assert_allclose(reps[1].backend.to_host(g[1][1][-2][k]), g[0][1][-2][k],
                                   atol=1e-6)
    for a, b in zip(reps[0].params(), reps[1].params(), strict=True):
        np.testing.assert_allclose(reps[1].backend.to_host(b), a, rtol=2e-4, atol=2e-5)
    assert ledger.hazards == [] and ledger.null_stream_ops == []


def test_the_memory_plan_counts_the_frequency_proposal_per_replica():
    """With the sampled layer and frequency negatives each replica holds the draw probabilities
    and their running sum (two float64 arrays over the labels) and the draw's guide table (one
    int64 per cell, here a cell per label and one more) on the host; uniform negatives and the
    exact layer hold none of them."""
    from xmc_engine.memory import plan_memory

    shape = dict(n_samples=1000, n_features=100, n_labels=5000, nnz=10_000, label_nnz=3000,
                 budget="8GiB")
    cfg = TrainConfig(output="sampled", algorithm="adaptive", devices="cpu,cpu@0.5")
    items = plan_memory(cfg, **shape).pools[0].items
    assert [v for k, v in items.items() if "frequency proposal" in k] == [16 * 5000
                                                                           + 8 * 5001] * 2
    p = FrequencyProposal(np.ones(5000))  # what the plan counts is what the proposal holds
    assert p.q.nbytes + p._cdf.nbytes + p._guide.nbytes == 16 * 5000 + 8 * 5001
    for other in (dict(negative_sampling="uniform"), dict(output="exact")):
        cfg = TrainConfig(**{"output": "sampled", **other})
        assert not any("proposal" in k for k in plan_memory(cfg, **shape).pools[0].items)
