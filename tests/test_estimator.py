"""XMCClassifier: validation, determinism, save/load, checkpoints and resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_engine import XMCClassifier
from xmc_engine.config import TrainConfig
from xmc_engine.errors import CheckpointError, ConfigError


def tiny_data(n=600, n_features=60, n_labels=25, seed=0):
    """Learnable toy data: each label owns a few features."""
    rng = np.random.default_rng(seed)
    rows, cols, ycols, yrows = [], [], [], []
    for i in range(n):
        labs = rng.choice(n_labels, size=rng.integers(1, 4), replace=False)
        feats = set()
        for lab in labs:
            feats.update((lab * 2 + rng.integers(0, 3, size=3)) % n_features)
        feats.update(rng.integers(0, n_features, size=2))
        for f in sorted(feats):
            rows.append(i)
            cols.append(f)
        yrows += [i] * len(labs)
        ycols += list(labs)
    X = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(n, n_features))
    Y = sp.csr_matrix((np.ones(len(yrows), np.float32), (yrows, ycols)), shape=(n, n_labels))
    return X, Y


@pytest.fixture(scope="module")
def toy():
    X, Y = tiny_data()
    return X[:500], Y[:500], X[500:], Y[500:]


def test_fit_predict_beats_popular(toy):
    Xtr, Ytr, Xte, Yte = toy
    model = XMCClassifier(hidden=32, epochs=8, batch_size=32, lr=0.5, seed=0)
    assert model.fit(Xtr, Ytr, eval_set=(Xte, Yte)) is model
    labels, scores = model.predict_topk(Xte, k=5)
    assert labels.shape == (100, 5) and scores.shape == (100, 5)
    assert labels.dtype == np.int64 and scores.dtype == np.float32
    assert np.all(np.diff(scores, axis=1) <= 1e-6)  # descending
    p1 = model.metrics_["P@1"]
    popular = int(np.asarray(Ytr.sum(0)).argmax())
    p1_popular = float(Yte[:, popular].mean())
    assert p1 > p1_popular + 0.2, (p1, p1_popular)
    events = [r["event"] for r in model.history_]
    assert events[0] == "start" and events[-1] == "final" and "eval" in events


def test_seed_repeats_exactly(toy):
    Xtr, Ytr, _, _ = toy
    # A fixed thread count: otherwise it is calibrated per run, and the summation order of a
    # few reductions (e.g. the b2 gradient, one partial sum per thread) follows it.
    kw = dict(hidden=16, epochs=2, batch_size=50, lr=0.3, threads=1)
    a = XMCClassifier(**kw, seed=3).fit(Xtr, Ytr)
    b = XMCClassifier(**kw, seed=3).fit(Xtr, Ytr)
    c = XMCClassifier(**kw, seed=4).fit(Xtr, Ytr)
    for pa, pb in zip(a.params_, b.params_, strict=True):
        np.testing.assert_array_equal(pa, pb)
    assert not np.array_equal(a.params_[0], c.params_[0])


def test_two_hidden_layers_and_label_chunk(toy):
    Xtr, Ytr, Xte, Yte = toy
    m = XMCClassifier(hidden=[32, 16], epochs=6, batch_size=32, lr=0.5, optimizer="sgd",
                      label_chunk=7, normalize="none")  # the rate suits the raw toy rows
    m.fit(Xtr, Ytr, eval_set=(Xte, Yte))
    assert [p.shape for p in m.params_] == [(60, 32), (32,), (32, 16), (16,), (16, 25), (25,)]
    assert m.metrics_["P@1"] > 0.4


def test_chunked_equals_plain(toy):
    Xtr, Ytr, _, _ = toy
    a = XMCClassifier(hidden=16, epochs=1, batch_size=64, lr=0.3).fit(Xtr, Ytr)
    b = XMCClassifier(hidden=16, epochs=1, batch_size=64, lr=0.3, label_chunk=6).fit(Xtr, Ytr)
    for pa, pb in zip(a.params_, b.params_, strict=True):
        np.testing.assert_allclose(pa, pb, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad, msg", [
    (lambda X, Y: (X.toarray()[0], Y), "X must be 2-D"),
    (lambda X, Y: (X, Y[:-1]), "Y has 499 rows but X has 500"),
    (lambda X, Y: (X, Y * 2), "Y row 0: value 2.0 is not 0 or 1"),
    (lambda X, Y: (X.astype(np.complex64), Y), "Complex data not supported: X"),
    (lambda X, Y: (X, np.ones(X.shape[0])), "MultiLabelBinarizer"),
])
def test_bad_input_is_value_error(toy, bad, msg):
    Xtr, Ytr, _, _ = toy
    X, Y = bad(Xtr, Ytr)
    with pytest.raises(ValueError, match=msg):
        XMCClassifier(epochs=1).fit(X, Y)


def test_non_finite_feature_is_named(toy):
    Xtr, Ytr, _, _ = toy
    X = Xtr.copy()
    X.data[X.indptr[7]] = np.nan
    with pytest.raises(ValueError, match="row 7"):
        XMCClassifier(epochs=1).fit(X, Ytr)


def test_predict_checks_features(toy):
    Xtr, Ytr, _, _ = toy
    m = XMCClassifier(hidden=8, epochs=1).fit(Xtr, Ytr)
    with pytest.raises(ValueError, match="features"):
        m.predict_topk(Xtr[:, :10])
    with pytest.raises(RuntimeError, match="not fitted"):
        XMCClassifier().predict_topk(Xtr)


def test_save_load_roundtrip(toy, tmp_path):
    Xtr, Ytr, Xte, _ = toy
    m = XMCClassifier(hidden=[16, 8], epochs=1, lr=0.3).fit(Xtr, Ytr)
    m.save(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["n_labels"] == 25
    m2 = XMCClassifier.load(tmp_path / "m")
    l1, s1 = m.predict_topk(Xte, 3)
    l2, s2 = m2.predict_topk(Xte, 3)
    np.testing.assert_array_equal(l1, l2)
    np.testing.assert_array_equal(s1, s2)
    assert m2.hidden == [16, 8]


def test_load_errors(tmp_path):
    with pytest.raises(CheckpointError):
        XMCClassifier.load(tmp_path / "missing")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError):
        XMCClassifier.load(tmp_path / "junk")


def test_config_roundtrip_and_unknown_key():
    cfg = TrainConfig(hidden=[64, 32], lr=0.2, algorithm="adaptive",
                      algorithm_params={"merge_period": 4096})
    assert TrainConfig.from_dict(json.loads(cfg.to_json())) == cfg
    with pytest.raises(ConfigError, match="unknown key"):
        TrainConfig.from_dict({"hiden": 3})
    with pytest.raises(ConfigError, match="lr"):
        TrainConfig(lr=-1)
    with pytest.raises(ConfigError, match="algorithm"):
        TrainConfig(algorithm="magic")


def test_checkpoint_and_resume_match_uninterrupted(toy, tmp_path):
    Xtr, Ytr, _, _ = toy
    kw = dict(hidden=16, epochs=3, batch_size=50, lr=0.3, seed=1)
    full = XMCClassifier(**kw).fit(Xtr, Ytr)
    # A run that "stops" after one epoch and a half, then resumes from its checkpoint.
    run = tmp_path / "run"
    part = XMCClassifier(**{**kw, "epochs": 1.5}, log_dir=str(run), checkpoint_every=250)
    part.fit(Xtr, Ytr)
    resumed = XMCClassifier(**kw, log_dir=str(run), checkpoint_every=250)
    resumed.fit(Xtr, Ytr, resume=True)
    for pa, pb in zip(full.params_, resumed.params_, strict=True):
        np.testing.assert_allclose(pa, pb, rtol=1e-5, atol=1e-6)
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert any(r["event"] == "checkpoint" for r in log)


def test_checkpoint_needs_log_dir(toy):
    Xtr, Ytr, _, _ = toy
    with pytest.raises(ConfigError, match="log_dir"):
        XMCClassifier(epochs=1, checkpoint_every=100).fit(Xtr, Ytr)
    with pytest.raises(ConfigError, match="checkpoint_every"):
        XMCClassifier(epochs=1, checkpoint_every="soon", log_dir="x").fit(Xtr, Ytr)


def test_multi_device_evaluates_between_merge_periods(toy, tmp_path):
    """``eval_every < 1`` on several devices: evaluations at the merge barriers after each mark
    (more than one per epoch); checkpoints still only at epoch ends (an open epoch's queue is
    not saved)."""
    Xtr, Ytr, Xte, Yte = toy  # 500 training rows
    run = tmp_path / "run"
    clf = XMCClassifier(hidden=16, epochs=2, batch_size=32, lr=0.3, seed=0, devices="cpu,cpu",
                        algorithm="adaptive", threads=1, eval_every=0.25, lr_warmup_epochs=0,
                        algorithm_params={"merge_period": 100, "rule": "fixed"},
                        log_dir=str(run), checkpoint_every=120)
    clf.fit(Xtr, Ytr, eval_set=(Xte, Yte))
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    evals = [r for r in log if r["event"] == "eval"]
    samples = [r["samples"] for r in evals]
    assert len(evals) == 8 and samples[-1] == 1000
    # each at the first barrier at or after its mark (periods of ~100 rows, whole batches)
    for k, s in enumerate(samples, start=1):
        assert 125 * k <= s < 125 * k + 100 + 32, samples
    assert any(0 < r["epoch"] < 1 for r in evals)
    ckpts = [r for r in log if r["event"] == "checkpoint"]
    # checkpoints fall on barriers, mid-epoch included (the trainer saves where the epoch stands)
    assert ckpts and ckpts[-1]["samples"] == 1000 and any(r["samples"] % 500 for r in ckpts)
    final = [r for r in log if r["event"] == "final"][0]
    assert final["samples"] == 1000


@pytest.fixture(scope="module")
def fitted(toy):
    Xtr, Ytr, _, _ = toy
    return XMCClassifier(hidden=[32, 16], epochs=8, batch_size=32, lr=0.5, threads=1,
                         eval_k=4).fit(Xtr, Ytr)


def test_predict_is_a_top1_indicator_matrix(fitted, toy):
    _, _, Xte, _ = toy
    labels, _ = fitted.predict_topk(Xte, 3)
    P = fitted.predict(Xte)
    assert sp.isspmatrix_csr(P) and P.shape == (100, 25) and P.dtype == np.float32
    np.testing.assert_array_equal(P.indices, labels[:, 0])
    np.testing.assert_array_equal(P.data, 1.0)
    P3 = fitted.predict(Xte, k=3)
    np.testing.assert_array_equal(P3.indices.reshape(100, 3), np.sort(labels, axis=1))
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        fitted.predict(Xte, k=0)


def test_scores_as_sparse_rows(fitted, toy):
    _, _, Xte, _ = toy
    labels, logits = fitted.predict_topk(Xte, 4)
    D = fitted.decision_function(Xte)  # default k = eval_k = 4
    assert D.shape == (100, 25) and D.getnnz(axis=1).tolist() == [4] * 100
    np.testing.assert_allclose(np.take_along_axis(D.toarray(), labels, axis=1), logits)
    P = fitted.predict_proba(Xte)
    # probabilities of the same labels, in the same order, a softmax of the logits
    Pd = np.take_along_axis(P.toarray(), labels, axis=1)
    assert np.all(np.diff(Pd, axis=1) <= 1e-7) and np.all(Pd > 0) and np.all(Pd <= 1)
    shift = np.log(Pd) - logits  # minus the row's log normaliser, in every column
    np.testing.assert_allclose(shift, np.repeat(shift[:, :1], 4, axis=1), atol=1e-4)
    # over every label a row sums to 1: the host normaliser matches the engine's logits
    full = fitted.predict_proba(Xte, k=100)
    np.testing.assert_allclose(np.asarray(full.sum(axis=1)).ravel(), 1.0, rtol=1e-4)


def test_predict_with_threshold(fitted, toy):
    _, _, Xte, _ = toy
    probs = fitted.predict_proba(Xte, k=25).toarray()
    for t in (0.05, 0.2, 0.5):
        P = fitted.predict(Xte, threshold=t)
        np.testing.assert_array_equal(P.toarray(), (probs >= t).astype(np.float32))
        assert 0 < P.nnz < 25 * 100
    top2 = fitted.predict(Xte, k=2, threshold=0.05).toarray()
    assert top2.sum(axis=1).max() <= 2 and np.all(top2 <= (probs >= 0.05))
    for bad in (0, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="threshold"):
            fitted.predict(Xte, threshold=bad)


def test_score_is_p_at_1_or_the_named_metric(fitted, toy):
    _, _, Xte, Yte = toy
    metrics = fitted.evaluate(Xte, Yte, ks=(1, 3))
    assert fitted.score(Xte, Yte) == metrics["P@1"]
    assert fitted.score(Xte, Yte, metric="nDCG@3") == pytest.approx(metrics["nDCG@3"], rel=1e-12)
    assert fitted.score(Xte, Yte, metric="PSP@3") == metrics["PSP@3"]
    for bad in ("P1", "P@0", "F1@3"):
        with pytest.raises(ValueError, match="metric"):
            fitted.score(Xte, Yte, metric=bad)


def test_tiny_training_sets(toy):
    """One and two rows train; propensity metrics are left out below 3 training rows."""
    Xtr, Ytr, Xte, Yte = toy
    for n in (1, 2):
        m = XMCClassifier(hidden=4, epochs=1, threads=1).fit(Xtr[:n], Ytr[:n])
        metrics = m.evaluate(Xte, Yte)
        assert "P@1" in metrics and "PSP@1" not in metrics
    m = XMCClassifier(hidden=4, epochs=1, threads=1).fit(Xtr[:3], Ytr[:3])
    assert "PSP@1" in m.evaluate(Xte, Yte)


# -- feature rows normalised (TrainConfig.normalize) -------------------------------------------
def test_normalize_rows_scales_each_row_to_unit_norm_and_leaves_the_input_alone():
    from xmc_engine.validation import normalize_rows

    X = sp.csr_matrix(np.array([[3, 4, 0], [0, 0, 0], [0, 2, 0], [1, 1, 1]], np.float32))
    before = X.copy()
    N = normalize_rows(X, "l2")
    np.testing.assert_allclose(np.sqrt(np.asarray(N.multiply(N).sum(1)).ravel()), [1, 0, 1, 1],
                               rtol=1e-6)
    np.testing.assert_allclose(N.toarray()[0], [0.6, 0.8, 0], rtol=1e-6)
    assert N.dtype == np.float32 and N.nnz == X.nnz
    assert (X != before).nnz == 0  # the caller's matrix is not modified
    assert normalize_rows(X, "none") is X
    assert normalize_rows(N, "l2") is N  # already unit rows (tf-idf data): nothing to do
    empty = sp.csr_matrix((5, 3), dtype=np.float32)
    assert normalize_rows(empty, "l2") is empty
    trailing_empty = sp.csr_matrix(np.array([[2, 0], [0, 0], [0, 0]], np.float32))
    np.testing.assert_allclose(normalize_rows(trailing_empty, "l2").toarray(),
                               [[1, 0], [0, 0], [0, 0]])
    with pytest.raises(ValueError, match="normalize='max'"):
        normalize_rows(X, "max")
    with pytest.raises(ConfigError, match="normalize='max'.*l2, none"):
        XMCClassifier(normalize="max").get_config()


def test_l2_normalised_model_ignores_the_scale_of_a_row(toy):
    Xtr, Ytr, Xte, Yte = toy
    m = XMCClassifier(hidden=16, epochs=2, threads=1, seed=0).fit(Xtr, Ytr)
    assert m.get_config().normalize == "l2"
    scaled = sp.diags(np.linspace(0.5, 7.0, Xte.shape[0]).astype(np.float32)) @ Xte
    np.testing.assert_array_equal(m.predict_topk(scaled, 3)[0], m.predict_topk(Xte, 3)[0])
    assert m.evaluate(scaled, Yte) == m.evaluate(Xte, Yte)
    # trained on rows scaled 3x: the same model as on the rows themselves
    m3 = XMCClassifier(hidden=16, epochs=2, threads=1, seed=0).fit(3 * Xtr, Ytr)
    for a, b in zip(m.params_, m3.params_, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    raw = XMCClassifier(hidden=16, epochs=2, threads=1, seed=0, normalize="none").fit(Xtr, Ytr)
    assert not np.allclose(raw.params_[0], m.params_[0])


def test_a_model_saved_before_normalize_existed_loads_as_unnormalised(toy, tmp_path):
    Xtr, Ytr, Xte, _ = toy
    m = XMCClassifier(hidden=8, epochs=1, threads=1, normalize="none").fit(Xtr, Ytr)
    m.save(tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    config = json.loads(cfg_path.read_text())
    del config["train_config"]["normalize"]
    cfg_path.write_text(json.dumps(config))
    back = XMCClassifier.load(tmp_path / "m")
    assert back.get_config().normalize == "none"
    np.testing.assert_array_equal(back.predict_topk(Xte, 3)[0], m.predict_topk(Xte, 3)[0])
