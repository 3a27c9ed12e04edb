"""Neighbour votes at prediction (:mod:`xmc_engine.neighbours`, ``TrainConfig.neighbours``):
the votes and the blend against a brute-force computation, and what the estimator does with
them (fit, predict, save / load, the run log, when ``"auto"`` turns them on)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp

from tests.test_estimator import tiny_data
from xmc_engine import XMCClassifier, config
from xmc_engine.config import TrainConfig
from xmc_engine.errors import CheckpointError, ConfigError
from xmc_engine.neighbours import NeighbourIndex, host_hidden, network_probabilities


def _random(rng, n, d, density, dtype=np.float32):
    return sp.random(n, d, density=density, format="csr", random_state=rng, dtype=dtype)


def _naive_vote(Q, R, Y, k):
    """Votes of each row of the dense query rows ``Q`` over the reference rows ``R``, written
    out row by row: cosine similarity, the ``k`` highest, clipped at 0, cubed, normalised."""
    Y = Y.toarray() > 0
    out = np.zeros((Q.shape[0], Y.shape[1]))
    for i, q in enumerate(Q):
        qn = np.linalg.norm(q)
        sims = np.array([0.0 if qn == 0 or np.linalg.norm(r) == 0
                         else q @ r / (qn * np.linalg.norm(r)) for r in R])
        top = np.argsort(-sims, kind="stable")[:k]
        w = np.maximum(sims[top], 0) ** config.NEIGHBOURS_POWER
        if w.sum() > 0:
            out[i] = (w[:, None] * Y[top]).sum(axis=0) / w.sum()
    return out


def _random_network(seed, d, h, L):
    """Parameters of a one-hidden-layer network (the order of :mod:`xmc_engine.model`)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((d, h)).astype(np.float32), np.zeros(h, np.float32),
            rng.standard_normal((h, L)).astype(np.float32),
            rng.standard_normal(L).astype(np.float32)]


@pytest.fixture
def index_and_queries():
    rng = np.random.default_rng(3)
    n, d, h, L = 40, 30, 6, 12
    X = _random(rng, n, d, 0.2)
    H = np.maximum(rng.standard_normal((n, h)), 0).astype(np.float32)
    Y = _random(rng, n, L, 0.2)
    Y.data[:] = 1
    Xq = _random(rng, 9, d, 0.2)
    Hq = np.maximum(rng.standard_normal((9, h)), 0).astype(np.float32)
    Xq = sp.vstack([Xq, sp.csr_matrix((1, d), dtype=np.float32)]).tocsr()  # no features
    Hq = np.vstack([Hq, np.zeros((1, h), np.float32)])  # a dead hidden layer
    return X, H, Y, Xq, Hq


@pytest.mark.parametrize("k", [1, 5, 40, 100])
def test_votes_match_a_row_by_row_computation(index_and_queries, k):
    X, H, Y, Xq, Hq = index_and_queries
    votes = NeighbourIndex(X, H, Y, k).votes(Xq, Hq)
    want = 0.5 * (_naive_vote(Hq, H, Y, k) + _naive_vote(Xq.toarray(), X.toarray(), Y, k))
    # ties at the k-th similarity may pick other rows; these random rows have none
    np.testing.assert_allclose(votes, want, rtol=1e-4, atol=1e-6)
    assert votes.min() >= 0 and votes.max() <= 1 + 1e-6
    np.testing.assert_array_equal(votes[-1], 0)  # no features, no hidden activity: no vote


@pytest.mark.parametrize("loss", ["bce", "softmax"])
def test_blend_topk_ranks_the_blend_of_every_label(index_and_queries, loss):
    X, H, Y, Xq, _ = index_and_queries
    L = Y.shape[1]
    params = _random_network(5, X.shape[1], H.shape[1], L)
    index = NeighbourIndex(X, host_hidden(params, X), Y, 7)
    labels, scores = index.blend_topk(params, loss, Xq, 5, row_chunk=4)
    Hq = host_hidden(params, Xq)
    Z = Hq @ params[2] + params[3]
    if loss == "bce":
        p = 1 / (1 + np.exp(-Z.astype(np.float64)))
    else:
        p = np.exp(Z - Z.max(1, keepdims=True))
        p = np.minimum(p / p.sum(1, keepdims=True) * (Y.nnz / Y.shape[0]), 1)
    w = config.NEIGHBOURS_NETWORK_WEIGHT
    want = w * p + (1 - w) * index.votes(Xq, Hq)
    np.testing.assert_allclose(scores, -np.sort(-want, axis=1)[:, :5], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.take_along_axis(want, labels, 1), scores, rtol=1e-5,
                               atol=1e-6)
    assert labels.dtype == np.int64 and scores.dtype == np.float32
    assert (np.diff(scores, axis=1) <= 0).all()


def test_the_index_copies_what_it_keeps():
    rng = np.random.default_rng(0)
    X = _random(rng, 5, 8, 0.5)
    Y = sp.csr_matrix(np.array([[1, 0], [0, 1], [1, 1], [0, 1], [1, 0]], np.float32))
    Y_before = Y.copy()
    index = NeighbourIndex(X, np.ones((5, 3), np.float32), Y, 2)
    X.data[:] = 7
    assert (index.X.data != 7).all()
    assert (Y != Y_before).nnz == 0
    assert index.labels_per_row == pytest.approx(6 / 5)


def test_an_index_refuses_rows_that_disagree():
    X = sp.csr_matrix(np.eye(3, dtype=np.float32))
    with pytest.raises(ValueError, match="disagree"):
        NeighbourIndex(X, np.ones((2, 4), np.float32), X, 1)
    with pytest.raises(ValueError, match="k >= 1"):
        NeighbourIndex(X, np.ones((3, 4), np.float32), X, 0)


def test_softmax_probabilities_are_scaled_to_labels_per_row_and_capped():
    params = [None, None, np.eye(3, dtype=np.float32), np.zeros(3, np.float32)]
    H = np.array([[0, 0, 0], [50, 0, 0]], np.float32)
    p = network_probabilities(params, H, "softmax", labels_per_row=2.0)
    np.testing.assert_allclose(p[0], 2 / 3)
    np.testing.assert_allclose(p[1], [1.0, 0, 0], atol=1e-6)


def test_neighbours_option_is_checked():
    assert TrainConfig().neighbours == "auto"
    for bad in ("some", -1):
        with pytest.raises(ConfigError, match="neighbours"):
            TrainConfig(neighbours=bad)


def test_auto_votes_with_the_logistic_loss_on_sets_up_to_the_row_limit():
    cfg = TrainConfig()
    assert cfg.neighbours_for(config.NEIGHBOURS_MAX_ROWS, "bce") == config.NEIGHBOURS_K
    assert cfg.neighbours_for(config.NEIGHBOURS_MAX_ROWS + 1, "bce") == 0
    assert cfg.neighbours_for(100, "softmax") == 0  # no probe compared the losses
    # the softmax that won the probe by a close call votes, one far ahead does not
    assert cfg.neighbours_for(100, "softmax", config.NEIGHBOURS_SOFTMAX_Z - 0.1) \
        == config.NEIGHBOURS_K
    assert cfg.neighbours_for(100, "softmax", config.NEIGHBOURS_SOFTMAX_Z) == 0
    assert cfg.neighbours_for(config.NEIGHBOURS_MAX_ROWS + 1, "softmax", 0.5) == 0
    assert TrainConfig(neighbours=3).neighbours_for(10**9, "softmax") == 3
    assert TrainConfig(neighbours=0).neighbours_for(100, "bce") == 0


@pytest.fixture(scope="module")
def toy():
    X, Y = tiny_data()
    return X[:500], Y[:500], X[500:], Y[500:]


@pytest.fixture(scope="module")
def fitted(toy, tmp_path_factory):
    X, Y, Xt, Yt = toy
    log_dir = tmp_path_factory.mktemp("run")
    model = XMCClassifier(epochs=2, seed=0, threads=1, loss="bce", log_dir=str(log_dir)).fit(
        X, Y, eval_set=(Xt, Yt))
    return model, log_dir


def test_fit_keeps_the_training_rows_and_scores_the_blend(fitted, toy):
    model, log_dir = fitted
    X, Y, Xt, Yt = toy
    assert model.neighbours_ is not None and model.neighbours_.n_rows == X.shape[0]
    assert model.neighbours_.k == config.NEIGHBOURS_K
    record = [r for r in model.history_ if r["event"] == "neighbours"]
    assert len(record) == 1 and record[0]["rows"] == X.shape[0]
    assert record[0]["why"] == "the logistic loss"  # neighbours="auto" with loss="bce"
    # metrics_ is the blend's, the record keeps the network alone's from the last eval
    assert model.metrics_["P@1"] == pytest.approx(model.evaluate(Xt, Yt)["P@1"])
    last_eval = [r for r in model.history_ if r["event"] == "eval"][-1]
    assert record[0]["network"]["P@1"] == pytest.approx(last_eval["metrics"]["P@1"])
    written = [json.loads(line) for line in (log_dir / "log.jsonl").read_text().splitlines()]
    assert written[-1]["event"] == "neighbours"
    assert written[-1]["metrics"]["P@1"] == pytest.approx(model.metrics_["P@1"])


def test_predictions_blend_and_stay_consistent(fitted, toy):
    model = fitted[0]
    Xt = toy[2]
    labels, scores = model.predict_topk(Xt, 4)
    assert ((scores >= 0) & (scores <= 1)).all() and (np.diff(scores, axis=1) <= 0).all()
    P = model.predict_proba(Xt, k=4)
    np.testing.assert_allclose(np.sort(P.toarray(), axis=1)[:, ::-1][:, :4], scores,
                               rtol=1e-6)
    D = model.decision_function(Xt, k=4)
    np.testing.assert_allclose(D.toarray(), P.toarray())
    top1 = model.predict(Xt)
    np.testing.assert_array_equal(top1.indices, labels[:, 0])
    t = float(np.median(scores[:, 1]))
    chosen = model.predict(Xt, threshold=t)
    full = model.predict_proba(Xt, k=model.n_labels_).toarray()
    np.testing.assert_array_equal(chosen.toarray() > 0, full >= t)


def test_ranking_with_the_votes_shows_a_progress_bar_in_chunks(fitted, toy, monkeypatch, capsys):
    """The exact search is the slow part of a prediction: a bar counts its rows (on a
    terminal, or with ``XMC_PROGRESS=1``), and chunks of any size give the same ranking."""
    model, Xt = fitted[0], toy[2]
    whole = model.predict_topk(Xt, 4)
    monkeypatch.setenv("XMC_PROGRESS", "1")
    capsys.readouterr()
    chunked = model.predict_topk(Xt, 4, row_chunk=7)
    err = capsys.readouterr().err
    assert "ranking with the votes" in err and f"/{Xt.shape[0]} " in err, err
    np.testing.assert_array_equal(whole[0], chunked[0])
    np.testing.assert_allclose(whole[1], chunked[1], rtol=1e-6)  # BLAS blocks by chunk


def test_the_network_alone_is_what_neighbours_zero_predicts(toy):
    X, Y, Xt, _ = toy
    on = XMCClassifier(epochs=1, seed=0, threads=1, loss="bce").fit(X, Y)
    off = XMCClassifier(epochs=1, seed=0, threads=1, loss="bce", neighbours=0).fit(X, Y)
    assert off.neighbours_ is None
    assert not any(r["event"] == "neighbours" for r in off.history_)
    for a, b in zip(on.params_, off.params_, strict=True):
        np.testing.assert_array_equal(a, b)  # the votes change predictions, not training
    on.neighbours_ = None
    for a, b in zip(on.predict_topk(Xt, 3), off.predict_topk(Xt, 3), strict=True):
        np.testing.assert_array_equal(a, b)


def test_auto_leaves_the_softmax_and_large_sets_to_the_network(toy, monkeypatch):
    X, Y, _, _ = toy
    assert XMCClassifier(epochs=1, seed=0, threads=1, loss="softmax").fit(X, Y).neighbours_ \
        is None
    monkeypatch.setattr(config, "NEIGHBOURS_MAX_ROWS", X.shape[0] - 1)
    assert XMCClassifier(epochs=1, seed=0, threads=1, loss="bce").fit(X, Y).neighbours_ is None
    forced = XMCClassifier(epochs=1, seed=0, threads=1, loss="softmax", neighbours=5).fit(X, Y)
    assert forced.neighbours_ is not None and forced.neighbours_.k == 5


def test_save_and_load_keep_the_votes(fitted, toy, tmp_path):
    model = fitted[0]
    Xt = toy[2]
    model.save(tmp_path / "m")
    back = XMCClassifier.load(tmp_path / "m")
    assert back.neighbours_ is not None and back.neighbours_.k == model.neighbours_.k
    for a, b in zip(model.predict_topk(Xt, 5), back.predict_topk(Xt, 5), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_model_saved_without_votes_loads_without_them(toy, tmp_path):
    X, Y, _, _ = toy
    model = XMCClassifier(epochs=1, seed=0, threads=1, loss="bce", neighbours=0).fit(X, Y)
    model.save(tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    saved = json.loads(cfg_path.read_text())
    assert saved["neighbours_k"] == 0
    del saved["neighbours_k"]  # as a model saved before the votes existed
    cfg_path.write_text(json.dumps(saved))
    assert XMCClassifier.load(tmp_path / "m").neighbours_ is None


def test_load_refuses_votes_whose_arrays_are_missing(fitted, toy, tmp_path):
    model = fitted[0]
    model.save(tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved["neighbours_k"] = -2
    cfg_path.write_text(json.dumps(saved))
    with pytest.raises(CheckpointError, match="neighbours_k"):
        XMCClassifier.load(tmp_path / "m")
    no_votes = XMCClassifier(epochs=1, seed=0, threads=1, loss="bce", neighbours=0)
    no_votes.fit(toy[0], toy[1])
    no_votes.save(tmp_path / "n")
    cfg_path = tmp_path / "n" / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved["neighbours_k"] = 5
    cfg_path.write_text(json.dumps(saved))
    with pytest.raises(CheckpointError, match="missing"):
        XMCClassifier.load(tmp_path / "n")


def test_the_kernels_match_their_references():
    from xmc_engine.kernels import neighbours, reference

    rng = np.random.default_rng(11)
    Q, R = _random(rng, 7, 20, 0.3), _random(rng, 15, 20, 0.3)
    RT = R.T.tocsr()
    sims = np.full((7, 15), np.nan, np.float32)  # overwritten, whatever it held
    neighbours.sparse_dot_rows_cpu(Q.indptr, Q.indices, Q.data, RT.indptr, RT.indices,
                                   RT.data, sims)
    np.testing.assert_allclose(sims, reference.sparse_dot_rows(
        Q.indptr, Q.indices, Q.data, R.indptr, R.indices, R.data, 20), rtol=1e-5, atol=1e-6)
    Y = _random(rng, 15, 9, 0.3)
    top_idx = rng.integers(0, 15, size=(7, 4)).astype(np.int64)
    top_sim = rng.uniform(-0.5, 1, size=(7, 4)).astype(np.float32)
    top_sim[3] = -0.1  # no positive similarity: no vote
    out = np.ones((7, 9), np.float32)
    neighbours.vote_cpu(top_idx, top_sim, 3.0, Y.indptr, Y.indices, 0.25, out)
    want = 1 + 0.25 * reference.neighbour_vote(top_idx, top_sim, 3.0, Y.indptr, Y.indices, 9)
    np.testing.assert_allclose(out, want, rtol=1e-5)
    np.testing.assert_array_equal(out[3], 1)


def test_a_process_holding_part_of_the_rows_keeps_no_votes(toy, caplog):
    """Over MPI each rank fits on its own rows; ``n_train_`` counts every rank's. The votes
    would see this rank's rows only, so there are none (with a warning saying why)."""
    X, Y, _, _ = toy
    model = XMCClassifier(epochs=1, seed=0, threads=1, loss="bce", neighbours=0).fit(X, Y)
    with caplog.at_level("WARNING", logger="xmc_engine.estimator"):
        model._fit_neighbours(TrainConfig(neighbours=5), X, Y, None, processes=2)
    assert model.neighbours_ is None
    assert "off in a run over 2 processes" in caplog.text


def test_rows_held_out_of_training_vote_too(monkeypatch):
    """From 40,000 rows the plateau rule holds 2,000 training rows out of training: the run
    trains fewer rows than it was given, and every given row votes (a run of one process)."""
    from xmc_engine.datasets import make_synthetic

    monkeypatch.setattr(config, "PLATEAU_MIN_ROWS", 1000)
    monkeypatch.setattr(config, "KEEP_BEST_MIN_ROWS", 1000)
    X, Y, _, _ = make_synthetic(n_train=3000, n_test=10, n_features=500, n_labels=50, seed=0)
    model = XMCClassifier(epochs=1, seed=0, threads=1, loss="bce").fit(X, Y)
    start = next(r for r in model.history_ if r["event"] == "start")
    assert start["heldout_rows"] > 0 and model.n_train_ < X.shape[0]
    assert model.neighbours_ is not None and model.neighbours_.n_rows == X.shape[0]


def test_the_sparse_sigmoid_path_ranks_as_the_dense_blend(index_and_queries):
    """With the logistic loss and k below the label count the blend takes the sigmoid only of
    the voted labels and the network's own top k (kernels/neighbours.py: add_sigmoid_cpu);
    k = every label takes it of all: their first k agree."""
    X, H, Y, Xq, _ = index_and_queries
    L = Y.shape[1]
    params = _random_network(8, X.shape[1], H.shape[1], L)
    index = NeighbourIndex(X, host_hidden(params, X), Y, 3)
    for k in (1, 4):
        labels, scores = index.blend_topk(params, "bce", Xq, k)
        all_labels, all_scores = index.blend_topk(params, "bce", Xq, L)
        np.testing.assert_array_equal(labels, all_labels[:, :k])
        np.testing.assert_allclose(scores, all_scores[:, :k], rtol=1e-6)


@pytest.mark.parametrize("z, votes", [(2.5, True), (8.0, False)])
def test_a_probed_softmax_votes_where_it_won_by_a_close_call(toy, monkeypatch, z, votes):
    from xmc_engine import training

    def choose(cfg, X, Y, device):
        return {"loss": "softmax", "p1": {"softmax": 0.3, "bce": 0.2}, "z": z, "rows": 1,
                "heldout": 1, "seconds": 0.0, "compile_seconds": 0.0, "compiled": 0,
                "fit": None}

    monkeypatch.setattr(training, "choose_loss", choose)
    X, Y, _, _ = toy
    model = XMCClassifier(epochs=1, seed=0, threads=1).fit(X, Y)
    probe = next(r for r in model.history_ if r["event"] == "loss_probe")
    assert model.loss_ == "softmax" and probe["z"] == z
    assert (model.neighbours_ is not None) == votes
