"""``loss="auto"``: the probe that picks the training loss (``training.choose_loss``), and what a
run, a checkpoint and a saved model keep of its choice."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import xmc_engine.config as config
import xmc_engine.training as training
from tests._helpers import final_record
from tests.conftest import real_dataset
from tests.test_estimator import tiny_data
from xmc_engine import XMCClassifier
from xmc_engine.config import TrainConfig
from xmc_engine.devices import parse_devices
from xmc_engine.errors import ConfigError


def test_auto_is_a_loss_of_the_config_and_unknown_names_list_it():
    assert TrainConfig(loss="auto").loss == "auto"
    with pytest.raises(ConfigError, match="softmax, bce, auto"):
        TrainConfig(loss="hinge")


@pytest.mark.parametrize("rows, batch", [(600, 64), (2400, 1100)],
                         ids=["below-the-minimum", "a-batch-larger-than-what-is-left"])
def test_too_few_rows_train_the_softmax_without_a_probe(rows, batch):
    """Below ``LOSS_PROBE_MIN_ROWS`` rows, or where 240 held-out rows and a batch of 1,100
    leave less than a batch of the 2,400 to train on, no probe."""
    X, Y = tiny_data(n=rows)
    clf = XMCClassifier(loss="auto", hidden=8, epochs=1, seed=0, eval_every=0,
                        batch_size=batch).fit(X, Y)
    assert clf.loss_ == "softmax"
    probe = [r for r in clf.history_ if r["event"] == "loss_probe"]
    assert len(probe) == 1 and probe[0]["rows"] == 0 and probe[0]["p1"] == {}
    assert probe[0]["threads"] is None and probe[0]["together"] is False
    start = next(r for r in clf.history_ if r["event"] == "start")
    assert start["loss"] == "softmax" and start["config"]["loss"] == "auto"


def _blas_threads():
    from threadpoolctl import threadpool_info

    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def _indexed_rows(n):
    """Rows whose single feature value is the row's number + 1 (so the probe's subsets can be
    traced), one label each."""
    X = sp.csr_matrix((np.arange(1, n + 1, dtype=np.float32), (np.arange(n), np.zeros(n))),
                      shape=(n, 3))
    Y = sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), np.arange(n) % 4)), shape=(n, 4))
    return X, Y


def _fit_result(eval_set, hit):
    """What a probe fit returns to :func:`training.choose_loss`: the held-out rows' top labels
    (those of ``_indexed_rows``, one label each), right on the rows of ``hit`` (a slice), and
    their P@1."""
    label = eval_set[1].tocsr().indices
    right = np.zeros(len(label), dtype=bool)
    right[hit] = True
    return {"metrics": {"P@1": float(right.mean())},
            "eval_top1": np.where(right, label, (label + 1) % 4)}


def _probe_with(monkeypatch, fake_fit, threads=1):
    """:func:`training.choose_loss` with ``fake_fit`` for its fits, ``threads`` from the
    calibration and the fits in turn (the host said to hold one at a time)."""
    monkeypatch.setattr(training, "fit_model", fake_fit)
    monkeypatch.setattr(training, "calibrate_device", lambda cfg, X, Y, **kw: threads)
    monkeypatch.setattr(training, "_host_holds", lambda *a: False)


# on 500 held-out rows: (the rows each loss gets right, the choice, the softmax's margin z)
@pytest.mark.parametrize("hits, chosen, z", [
    ({"softmax": slice(0, 200), "bce": slice(0, 250)}, "bce", -7.45),  # bce ahead
    ({"softmax": slice(0, 250), "bce": slice(0, 200)}, "softmax", 7.45),  # clearly ahead
    # softmax 0.02 ahead with the rows split: within chance, the logistic loss
    ({"softmax": slice(0, 260), "bce": slice(240, 490)}, "bce", 0.46),
    ({"softmax": slice(0, 250), "bce": slice(0, 250)}, "bce", 0.0)])  # a tie
def test_the_probe_keeps_the_logistic_loss_unless_the_softmax_is_clearly_ahead(
        monkeypatch, hits, chosen, z):
    monkeypatch.setattr(config, "LOSS_PROBE_HELDOUT_SHARE", 0.1)  # 500 of the 5,000 rows
    monkeypatch.setattr(config, "LOSS_PROBE_SAMPLES", 2100)  # 2 whole periods of 1,024
    seen = {}

    def fake_fit(cfg, X, Y, eval_set, **kw):
        assert kw["one_node"]  # never across MPI ranks
        assert kw["keep_optimizer_state"]  # the winner's, for the run to continue
        seen[cfg.loss] = (cfg, X.data.astype(int) - 1, eval_set[0].data.astype(int) - 1)
        return _fit_result(eval_set, hits[cfg.loss])

    _probe_with(monkeypatch, fake_fit, threads=2)
    X, Y = _indexed_rows(5000)
    cfg = TrainConfig(loss="auto", devices="cpu,cpu@0.5", algorithm="adaptive", epochs=7,
                      max_train_seconds=30.0, seed=3)
    rec = training.choose_loss(cfg, X, Y, parse_devices(cfg.devices)[0])
    p1 = {loss: (h.stop - h.start) / 500 for loss, h in hits.items()}
    assert rec["loss"] == chosen and rec["p1"] == p1 and rec["z"] == pytest.approx(z, abs=0.01)
    assert rec["margin"] == config.LOSS_PROBE_SOFTMAX_Z  # the exact output layer's
    assert rec["threads"] == 2 and rec["together"] is False  # calibrated once, passed on
    assert (rec["rows"], rec["heldout"], rec["epochs"]) == (2048, 500, 0.4096)
    assert set(seen) == set(config.TRAIN_LOSSES)
    (c1, rows1, held1), (c2, rows2, held2) = seen["softmax"], seen["bce"]
    np.testing.assert_array_equal(rows1, np.arange(5000))  # the run's rows, as they are
    np.testing.assert_array_equal(rows2, np.arange(5000))
    np.testing.assert_array_equal(held1, held2)
    # held out: the 500 rows the run's first epoch trains after the probe's 2,048
    order = training.epoch_permutation(5000, 3, 0)
    np.testing.assert_array_equal(held1, np.sort(order[2048:2548]))
    for c in (c1, c2):  # on the first device alone, everything else as given; 2,048 samples
        assert (c.epochs * 5000, c.algorithm, c.devices, c.max_train_seconds) == (
            pytest.approx(2048), "single", "cpu", None)
        assert c.algorithm_params.merge_period == 1024 and c.normalize == "none"
        assert c.lr_decay == 0.0  # "auto" given: no plateau rule of the fit's own
        assert c.hidden == cfg.hidden and c.seed == cfg.seed
    assert (c1.threads, c2.threads) == (2, 2)  # one calibration for both fits


def test_row_hits_counts_a_row_without_labels_as_a_miss():
    Y = sp.csr_matrix(np.array([[1, 0, 1], [0, 0, 0], [0, 1, 0], [1, 1, 0]], dtype=np.float32))
    np.testing.assert_array_equal(training.row_hits([2, 0, 0, 1], Y),
                                  [True, False, False, True])


def test_pick_loss_needs_the_softmax_ahead_by_more_than_the_margin(monkeypatch):
    ones, zeros = np.ones(100, bool), np.zeros(100, bool)
    # the softmax right on every row, the logistic loss on none: no spread, the floor 1/rows
    assert training.pick_loss({"softmax": ones, "bce": zeros}) == ("softmax", 100.0)
    assert training.pick_loss({"softmax": zeros, "bce": ones}) == ("bce", -100.0)
    assert training.pick_loss({"softmax": ones, "bce": ones}) == ("bce", 0.0)
    # 12 rows only the softmax gets right, 4 only the logistic loss: z = 0.08 / 0.0394 = 2.03
    sm, bce = zeros.copy(), zeros.copy()
    sm[:12], bce[12:16] = True, True
    assert training.pick_loss({"softmax": sm, "bce": bce}) == ("softmax", 2.03)
    monkeypatch.setattr(config, "LOSS_PROBE_SOFTMAX_Z", 2.5)  # the margin is the config's
    assert training.pick_loss({"softmax": sm, "bce": bce}) == ("bce", 2.03)


def test_the_sampled_output_layer_has_its_own_smaller_margin(monkeypatch):
    zeros = np.zeros(100, bool)
    # 8 rows only the softmax gets right, 4 only the logistic loss: z = 0.04 / 0.0345 = 1.16,
    # under the exact layer's margin of 2 and over the sampled layer's 1
    sm, bce = zeros.copy(), zeros.copy()
    sm[:8], bce[8:12] = True, True
    assert config.LOSS_PROBE_SOFTMAX_Z_SAMPLED < 1.16 < config.LOSS_PROBE_SOFTMAX_Z
    assert training.pick_loss({"softmax": sm, "bce": bce}) == ("bce", 1.16)
    assert training.pick_loss({"softmax": sm, "bce": bce}, "exact") == ("bce", 1.16)
    assert training.pick_loss({"softmax": sm, "bce": bce}, "sampled") == ("softmax", 1.16)
    assert training.probe_margin("sampled") == config.LOSS_PROBE_SOFTMAX_Z_SAMPLED
    monkeypatch.setattr(config, "LOSS_PROBE_SOFTMAX_Z_SAMPLED", 1.5)
    assert training.pick_loss({"softmax": sm, "bce": bce}, "sampled") == ("bce", 1.16)


def test_a_device_with_a_share_of_the_cores_calibrates_itself(monkeypatch):
    """With two CPU devices on four cores each device has two threads, while the probe's device
    (the first alone) has four: its budget is not the run's devices', which calibrate their own."""
    import xmc_engine.devices as devices
    from xmc_engine.model import MLPReplica

    monkeypatch.setattr(devices, "available_cores", lambda: 4)
    calls = []

    def fake_calibrate(self, batch_size, max_threads, run_samples=None):
        calls.append(max_threads)
        self.backend.threads = max_threads
        return max_threads

    monkeypatch.setattr(MLPReplica, "calibrate_threads", fake_calibrate)
    X, Y = tiny_data(n=2400)
    clf = XMCClassifier(loss="auto", hidden=8, epochs=1, seed=0, eval_every=0,
                        devices="cpu,cpu", algorithm="adaptive").fit(X, Y)
    assert calls == [4, 2, 2]  # the probe's device, then each of the run's
    recs = [r for r in clf.history_ if r["event"] == "threads"]
    assert [r["threads"] for r in recs] == [2, 2]
    assert not any("loss probe" in r["note"] for r in recs)


@pytest.mark.parametrize("calibrated, holds, together, fit_threads", [
    (1, True, True, 1),    # one thread won: one each, side by side
    (4, True, True, 2),    # all four won: two each, side by side
    (4, False, False, 4),  # the host holds one fit at a time: in turn, all four each
])
def test_the_probe_fits_run_side_by_side_and_leave_blas_as_it_was(
        monkeypatch, calibrated, holds, together, fit_threads):
    """On a device with a core per loss, where the host holds both, the fits run at once (each
    on one thread where one thread won the calibration, else on its share); the BLAS limit is
    theirs while they run and what it was afterwards."""
    import threading

    import xmc_engine.devices as devices

    before = _blas_threads()
    monkeypatch.setattr(devices, "available_cores", lambda: 4)
    monkeypatch.setattr(training, "calibrate_device", lambda cfg, X, Y, **kw: calibrated)
    monkeypatch.setattr(training, "_host_holds", lambda *a: holds)
    started, seen = threading.Barrier(2, timeout=30), {}

    def fake_fit(cfg, X, Y, eval_set, **kw):
        if together:
            started.wait()  # both fits are running at once (in turn, this would time out)
        seen[cfg.loss] = (cfg.threads, threading.current_thread().name, _blas_threads())
        return _fit_result(eval_set, {"softmax": slice(0, 250), "bce": slice(0, 200)}[cfg.loss])

    monkeypatch.setattr(training, "fit_model", fake_fit)
    X, Y = _indexed_rows(5000)
    cfg = TrainConfig(loss="auto")
    rec = training.choose_loss(cfg, X, Y, parse_devices("cpu")[0])
    assert rec["together"] is together and rec["threads"] == calibrated  # the run's budget
    assert rec["loss"] == "softmax"
    assert {t for t, _, _ in seen.values()} == {fit_threads}
    assert seen["softmax"][1] == threading.current_thread().name  # the caller's thread
    assert seen["bce"][1].startswith("xmc-probe") is together
    if together:
        assert all(max(b, default=0) <= fit_threads for _, _, b in seen.values())
    assert _blas_threads() == before
    # a thread count given by the user is kept to: the fits go in turn, in the caller's thread
    names = set()

    def fit_in_turn(cfg, X, Y, eval_set, **kw):
        names.add(threading.current_thread().name)
        return _fit_result(eval_set, slice(0, 250))

    monkeypatch.setattr(training, "fit_model", fit_in_turn)
    rec = training.choose_loss(TrainConfig(loss="auto", threads=1), X, Y,
                               parse_devices("cpu")[0])
    assert rec["together"] is False and rec["threads"] is None
    assert names == {threading.current_thread().name}


def test_one_thread_calibration_serves_the_probe_and_the_run(monkeypatch):
    """Each calibration costs 0.2-0.6 s (more than a small set's training), and the loss does
    not change which budget is faster: the probe's first fit calibrates, its second fit and the
    run's device reuse the budget (a budget of 1 here, which no default gives a 2-core device)."""
    import xmc_engine.devices as devices
    from xmc_engine.model import MLPReplica

    monkeypatch.setattr(devices, "available_cores", lambda: 2)
    calls = []

    def fake_calibrate(self, batch_size, max_threads, run_samples=None):
        calls.append(max_threads)
        self.backend.threads = 1
        return 1

    monkeypatch.setattr(MLPReplica, "calibrate_threads", fake_calibrate)
    X, Y = tiny_data(n=2400)
    clf = XMCClassifier(loss="auto", hidden=8, epochs=1, seed=0, eval_every=0).fit(X, Y)
    assert calls == [2]
    probe = next(r for r in clf.history_ if r["event"] == "loss_probe")
    assert probe["threads"] == 1 and probe["rows"] > 0 and probe["together"] is True
    # both losses' kernels were loaded before the probe (its seconds are its own), the run's
    # after the start, as without the probe
    events = [r["event"] for r in clf.history_]
    assert events[:4] == ["start", "compile", "loss_probe", "compile"]
    assert clf.history_[1]["losses"] == list(config.TRAIN_LOSSES)
    (rec,) = [r for r in clf.history_ if r["event"] == "threads"]
    assert rec["threads"] == 1 and "loss probe" in rec["note"]
    # a given thread count: nothing calibrated, nothing passed on
    clf = XMCClassifier(loss="auto", hidden=8, epochs=1, seed=0, eval_every=0, threads=2).fit(X, Y)
    assert calls == [2]
    assert next(r for r in clf.history_ if r["event"] == "loss_probe")["threads"] is None


def test_the_probe_picks_the_softmax_on_the_synthetic_topic_data():
    """The synthetic generator's rows are mixtures of their labels' feature topics, where the
    softmax is far ahead (``bench/RESULTS.md``, "Defaults": synth1k P@1 0.865 against 0.790
    after 5 epochs; the probe's held-out P@1 here, after the first 2,048 rows of the first
    epoch, measured: softmax 0.780 against bce 0.557, 8.9 standard errors)."""
    from xmc_engine.datasets import make_synthetic

    X, Y, _, _ = make_synthetic(n_train=3000, n_test=0, n_features=2000, n_labels=300)
    rec = training.choose_loss(TrainConfig(loss="auto", threads=1), X, Y,
                               parse_devices("cpu")[0])
    assert rec["loss"] == "softmax", rec
    assert rec["p1"]["softmax"] > rec["p1"]["bce"] + 0.02, rec


@pytest.mark.slow
def test_the_probe_picks_bce_on_debian_debtags(data_dir):
    """On the real tag data the logistic loss is ahead (5 epochs: P@1 0.843 against 0.827)
    and the probe sees it."""
    from xmc_engine.datasets import load_dataset

    real_dataset(data_dir, "debian_debtags")  # skips with a reason when absent
    X, Y, _, _ = load_dataset(str(data_dir / "debian_debtags"))
    rec = training.choose_loss(TrainConfig(loss="auto", threads=1), X, Y,
                               parse_devices("cpu")[0])
    assert rec["loss"] == "bce", rec


def _choose(loss):
    def choose(cfg, X, Y, device):
        return {"loss": loss, "p1": {"softmax": 0.1, "bce": 0.2}, "rows": 1, "heldout": 1,
                "seconds": 0.0, "compile_seconds": 0.0, "compiled": 0, "fit": None}
    return choose


def test_the_choice_is_the_fitted_models_and_a_saved_model_keeps_it(monkeypatch, tmp_path):
    monkeypatch.setattr(training, "choose_loss", _choose("bce"))
    X, Y = tiny_data(n=200)
    # the network's own probabilities (no neighbour votes blended in)
    clf = XMCClassifier(loss="auto", hidden=8, epochs=1, seed=0, eval_every=0,
                        neighbours=0).fit(X, Y)
    assert clf.loss == "auto" and clf.loss_ == "bce"  # the parameter is left as given
    scores = clf.decision_function(X[:3], k=2).toarray()
    P = clf.predict_proba(X[:3], k=2).toarray()
    np.testing.assert_allclose(P[scores != 0], 1 / (1 + np.exp(-scores[scores != 0])),
                               rtol=1e-5)  # sigmoids: the model was trained with bce
    loaded = XMCClassifier.load(clf.save(tmp_path / "m"))
    assert loaded.loss == "auto" and loaded.loss_ == "bce"  # as given, and its choice
    np.testing.assert_allclose(loaded.predict_proba(X[:3], k=2).toarray(), P, rtol=1e-6)


def test_a_resumed_run_keeps_its_checkpoints_loss_without_a_new_probe(monkeypatch, tmp_path):
    monkeypatch.setattr(training, "choose_loss", _choose("bce"))
    X, Y = tiny_data(n=200)
    kw = dict(loss="auto", hidden=8, seed=0, eval_every=0, log_dir=str(tmp_path / "run"),
              checkpoint_every=100)
    XMCClassifier(epochs=1, **kw).fit(X, Y)

    def no_probe(*a, **k):
        raise AssertionError("a resumed run must not probe again")

    monkeypatch.setattr(training, "choose_loss", no_probe)
    clf = XMCClassifier(epochs=2, **kw).fit(X, Y, resume=True)
    assert clf.loss_ == "bce"
    assert not [r for r in clf.history_ if r["event"] == "loss_probe"]


def test_a_saved_model_with_an_unknown_fitted_loss_is_refused(tmp_path):
    import json

    from xmc_engine.errors import CheckpointError

    X, Y = tiny_data(n=120)
    folder = XMCClassifier(hidden=8, epochs=1, seed=0, eval_every=0).fit(X, Y).save(tmp_path / "m")
    cfg_path = folder / "config.json"
    config = json.loads(cfg_path.read_text())
    assert config["fitted_loss"] == "softmax"  # the default "auto" with 120 rows: no probe
    cfg_path.write_text(json.dumps({**config, "fitted_loss": "hinge"}))
    with pytest.raises(CheckpointError, match="fitted_loss 'hinge'"):
        XMCClassifier.load(folder)


def test_a_failing_side_fit_fails_the_probe_and_restores_blas(monkeypatch):
    """An error in the fit that runs beside the caller's (here a stand-in for, say, a
    DivergenceError) reaches the caller once both are done; the BLAS limit is back."""
    import xmc_engine.devices as devices

    before = _blas_threads()
    monkeypatch.setattr(devices, "available_cores", lambda: 2)
    monkeypatch.setattr(training, "calibrate_device", lambda cfg, X, Y, **kw: 1)
    monkeypatch.setattr(training, "_host_holds", lambda *a: True)
    done = []

    def fake_fit(cfg, X, Y, eval_set, **kw):
        if cfg.loss == "bce":
            raise RuntimeError("bce fit failed")
        done.append(cfg.loss)
        return _fit_result(eval_set, slice(0, 250))

    monkeypatch.setattr(training, "fit_model", fake_fit)
    X, Y = _indexed_rows(5000)
    with pytest.raises(RuntimeError, match="bce fit failed"):
        training.choose_loss(TrainConfig(loss="auto"), X, Y, parse_devices("cpu")[0])
    assert done == ["softmax"] and _blas_threads() == before


def test_a_run_too_short_to_repay_the_calibration_keeps_one_thread_untimed(monkeypatch):
    """The calibration is told how many samples its budget serves (the probe's fits and the
    run): a tiny run keeps one thread without timing two, and the run log says so; the same
    run told it is long is timed."""
    import numba

    import xmc_engine.devices as devices
    from xmc_engine import model
    from xmc_engine.model import MLPReplica

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here: no budget to choose")
    monkeypatch.setattr(devices, "available_cores", lambda: 2)
    X, Y = tiny_data(n=2400)
    clf = XMCClassifier(loss="auto", hidden=8, epochs=1, seed=0, eval_every=0).fit(X, Y)
    probe = next(r for r in clf.history_ if r["event"] == "loss_probe")
    assert probe["threads"] == 1 and probe["threads_timed"] is False
    clf = XMCClassifier(loss="softmax", hidden=8, epochs=1, seed=0, eval_every=0).fit(X, Y)
    (rec,) = [r for r in clf.history_ if r["event"] == "threads"]
    assert rec["threads"] == 1 and rec["note"].startswith("not timed")
    monkeypatch.setattr(model, "CALIBRATE_MIN_STEP_S", 0.0)  # only the run's length decides
    clf = XMCClassifier(loss="softmax", hidden=8, epochs=1, seed=0, eval_every=0).fit(X, Y)
    (rec,) = [r for r in clf.history_ if r["event"] == "threads"]
    assert rec["note"] == training._UNTIMED["run"]
    seen = []
    real = MLPReplica.calibrate_threads

    def told_long(self, batch_size, max_threads, run_samples=None):
        seen.append(run_samples)
        return real(self, batch_size, max_threads, 1e9)  # a very long run: timed

    monkeypatch.setattr(MLPReplica, "calibrate_threads", told_long)
    monkeypatch.setattr(model, "CALIBRATE_MIN_STEP_S", 0.0)  # this model's steps are tiny
    clf = XMCClassifier(loss="softmax", hidden=8, epochs=1, seed=0, eval_every=0).fit(X, Y)
    (rec,) = [r for r in clf.history_ if r["event"] == "threads"]
    assert rec["note"].startswith("calibrated") and seen == [2400]  # 1 epoch of 2,400 rows


def _synthetic(n=2400):
    from xmc_engine.datasets import make_synthetic

    X, Y, _, _ = make_synthetic(n_train=n, n_test=0, n_features=300, n_labels=40, seed=3)
    return X, Y


@pytest.fixture
def spy(monkeypatch):
    """What a run continued from the probe started with: ``fits`` (each probe's winning fit,
    :func:`training.choose_loss`'s ``fit``) and ``starts`` (per run, once the trainer got its
    state: every replica's model and Adagrad state, copied, the central model and the queue's
    position)."""
    seen = {"fits": [], "starts": []}
    real_choose, real_restore = training.choose_loss, training.restore_trainer

    def choose(*a, **k):
        rec = real_choose(*a, **k)
        seen["fits"].append(rec["fit"])
        return rec

    def restore(trainer, extra):
        real_restore(trainer, extra)
        seen["starts"].append({  # copies: training goes on in place
            "replicas": [([np.array(p) for p in rep.params()],
                          [np.array(a) for a in rep.optimizer_state()])
                         for rep in trainer.replicas],
            "central": [np.array(p) for p in training.host_params(trainer)],
            "position": trainer.queue.position()})

    monkeypatch.setattr(training, "choose_loss", choose)
    monkeypatch.setattr(training, "restore_trainer", restore)
    return seen


def test_the_run_goes_on_from_the_winning_fit_where_it_stopped(spy):
    """``continue_probe`` (the default): the run starts from the winning probe fit's model and
    Adagrad state, counts its samples and training time as its own and goes on with the rest
    of its first epoch: ``epochs x rows`` samples in all, not the probe's on top. The fit was
    the start of the run itself, so on one device the continued run is the run of the chosen
    loss (and the decay the choice gave) from the initialisation, to the bit."""
    X, Y = _synthetic()
    kw = dict(hidden=8, threads=1, seed=0, eval_every=0)
    clf = XMCClassifier(epochs=12, **kw).fit(X, Y)
    (fit,) = spy["fits"]
    probe = next(r for r in clf.history_ if r["event"] == "loss_probe")
    start = next(r for r in clf.history_ if r["event"] == "start")
    final = final_record(clf.history_)
    n = X.shape[0]
    # 2,400 rows, 240 held out: two periods of 1,024 rows leave them and a batch
    assert fit["loss"] == clf.loss_ and fit["samples"] == probe["rows"] == 2048
    assert probe["heldout"] == 240
    assert probe["continued"] == {"samples": 2048, "train_time": fit["train_time"]}
    assert (start["samples"], start["epoch"]) == (2048, 0)
    assert final["event"] == "final" and final["samples"] == 12 * n  # the rest, no more
    assert final["train_time"] > fit["train_time"]  # the fit's seconds are the run's too
    (begun,) = spy["starts"]
    (_, state), position = begun["replicas"][0], begun["position"]
    for got, want in zip(state, fit["optimizer_state"], strict=True):  # where the fit ended
        np.testing.assert_array_equal(got, want)
    assert position == {"epoch": 0, "cursor": 2048, "period": -1}  # the epoch's next rows
    fixed = XMCClassifier(epochs=12, loss=clf.loss_, lr_decay=start["lr_decay"],
                          **kw).fit(X, Y)  # no probe; the decay the probe's choice gave
    assert not any(r["event"] == "loss_probe" for r in fixed.history_)
    for got, want in zip(clf.params_, fixed.params_, strict=True):
        np.testing.assert_array_equal(got, want)
    # a run with no time left trains nothing more: its model is the fit's
    clf = XMCClassifier(epochs=12, max_train_seconds=1e-9, **kw).fit(X, Y)
    for got, want in zip(clf.params_, spy["fits"][1]["params"], strict=True):
        np.testing.assert_array_equal(got, want)


def test_after_a_second_look_the_run_goes_on_from_the_longer_fit(spy, monkeypatch):
    """Real fits, the second look forced (one period first, two after): the record keeps the
    first look, the run goes on from the second look's winning fit at its 2,048 samples, and on
    one device that is the run of the chosen loss from the initialisation, to the bit."""
    monkeypatch.setattr(config, "LOSS_PROBE_SAMPLES", 1100)  # one period of 1,024
    looks = []

    def forced(output, z, samples, *a, **k):
        looks.append((samples, z))
        return 2048 if samples == 1024 else 0

    monkeypatch.setattr(training, "second_look_samples", forced)
    X, Y = _synthetic()
    kw = dict(hidden=8, threads=1, seed=0, eval_every=0)
    clf = XMCClassifier(epochs=3, **kw).fit(X, Y)
    (fit,) = spy["fits"]
    probe = next(r for r in clf.history_ if r["event"] == "loss_probe")
    assert [s for s, _ in looks] == [1024]  # asked once, after the first look
    assert probe["first_look"]["rows"] == 1024 and probe["first_look"]["z"] == looks[0][1]
    assert probe["rows"] == fit["samples"] == 2048 and probe["heldout"] == 240
    assert probe["continued"]["samples"] == 2048 and fit["loss"] == clf.loss_
    assert final_record(clf.history_)["samples"] == 3 * X.shape[0]
    start = next(r for r in clf.history_ if r["event"] == "start")
    fixed = XMCClassifier(epochs=3, loss=clf.loss_, lr_decay=start["lr_decay"], **kw).fit(X, Y)
    for got, want in zip(clf.params_, fixed.params_, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kw", [dict(continue_probe=False), dict(epochs=0.5)],
                         ids=["off", "shorter-than-the-probe"])
def test_runs_that_start_from_the_initialisation(kw):
    """No continuation when it is switched off or when the probe trained more samples than
    the run asks (half an epoch of 2,400 rows against 2,048)."""
    X, Y = _synthetic()
    clf = XMCClassifier(**{"epochs": 12, "hidden": 8, "threads": 1, "seed": 0,
                           "eval_every": 0, **kw}).fit(X, Y)
    probe = next(r for r in clf.history_ if r["event"] == "loss_probe")
    start = next(r for r in clf.history_ if r["event"] == "start")
    assert probe["rows"] > 0 and probe["continued"] is None
    assert start["samples"] == 0
    # (half an epoch, 1,200 rows, ends at the first barrier after it: two periods of 1,024)
    assert final_record(clf.history_)["samples"] == (12 * X.shape[0] if "continue_probe" in kw
                                                     else 2048)


def test_a_continued_run_stopped_in_its_first_epoch_resumes_as_if_uninterrupted(tmp_path):
    """A continued run checkpointed in the rest of the first epoch (after the probe's rows) and
    resumed ends with the model of the run that never stopped. (3,400 rows: the probe's
    2,048 leave two periods of the first epoch, 1,024 rows and the last 328.)"""
    X, Y = _synthetic(3400)
    kw = dict(hidden=8, threads=1, seed=0, eval_every=0)
    full = XMCClassifier(epochs=12, **kw).fit(X, Y)
    probe = next(r for r in full.history_ if r["event"] == "loss_probe")
    start = probe["continued"]["samples"]
    n = X.shape[0]
    run = tmp_path / "run"
    part = XMCClassifier(epochs=(start + 200) / n, log_dir=str(run), checkpoint_every=100,
                         **kw).fit(X, Y)
    ckpt = [r["samples"] for r in part.history_ if r["event"] == "checkpoint"]
    assert start == 2048 and ckpt[-1] == 3072  # stopped in the first epoch, at a period's end
    resumed = XMCClassifier(epochs=12, log_dir=str(run), checkpoint_every=100, **kw)
    resumed.fit(X, Y, resume=True)
    for a, b in zip(full.params_, resumed.params_, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cap, rows", [(1100, 1024), (1000, 960)],
                         ids=["whole-periods", "one-shorter-period"])
def test_the_probe_trains_whole_periods_of_the_first_epoch_and_the_run_the_rest(
        monkeypatch, spy, cap, rows):
    """The probe's fits train at most ``LOSS_PROBE_SAMPLES`` rows of the run's first epoch, in
    whole periods of one device (1,024 rows) where that leaves any; else in one period of
    whole batches. The run goes on with the rest of that epoch, each row once."""
    monkeypatch.setattr(config, "LOSS_PROBE_SAMPLES", cap)
    X, Y = _synthetic()
    n = X.shape[0]
    clf = XMCClassifier(epochs=3, hidden=8, threads=1, seed=0, eval_every=0).fit(X, Y)
    probe = next(r for r in clf.history_ if r["event"] == "loss_probe")
    assert (probe["rows"], probe["heldout"]) == (rows, int(n * config.LOSS_PROBE_HELDOUT_SHARE))
    assert probe["continued"]["samples"] == rows == spy["fits"][0]["samples"]
    (begun,) = spy["starts"]
    assert begun["position"] == {"epoch": 0, "cursor": rows, "period": -1}
    assert final_record(clf.history_)["samples"] == 3 * n
    assert final_record(clf.history_)["epoch"] == 3


@pytest.mark.parametrize("algorithm", ["adaptive", "sync", "average", "easgd", "crossbow"])
def test_every_device_goes_on_from_the_winning_fit(spy, algorithm):
    """On several devices every replica starts with the fit's model and Adagrad state, and so
    does the central model the averaging methods pull the replicas toward."""
    X, Y = _synthetic()
    clf = XMCClassifier(epochs=12, hidden=8, threads=1, seed=0, eval_every=0,
                        devices="cpu,cpu", algorithm=algorithm).fit(X, Y)
    (fit,), (begun,) = spy["fits"], spy["starts"]
    replicas = begun["replicas"]
    probe = next(r for r in clf.history_ if r["event"] == "loss_probe")
    assert probe["continued"]["samples"] == fit["samples"]
    # the devices share the rest of the first epoch, from the row where the fit stopped
    assert begun["position"] == {"epoch": 0, "cursor": fit["samples"], "period": -1}
    assert len(replicas) == 2
    for got, want in zip(begun["central"], fit["params"], strict=True):
        np.testing.assert_array_equal(got, want)
    for params, opt in replicas:
        for got, want in zip(params, fit["params"], strict=True):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(opt, fit["optimizer_state"], strict=True):
            np.testing.assert_array_equal(got, want)
    assert final_record(clf.history_)["samples"] == 12 * X.shape[0]


def test_a_run_of_one_device_with_its_own_period_is_still_the_run_from_the_start(spy):
    """The probe stops at a barrier of the run's own period (here 768 rows: 1,536 of the 2,400,
    not the default period's 2,048), so that a run of one device with another ``merge_period``
    also goes on as the run of the chosen loss from the initialisation."""
    X, Y = _synthetic()
    kw = dict(hidden=8, threads=1, seed=1, eval_every=0, epochs=3,
              algorithm_params={"merge_period": 768})
    clf = XMCClassifier(**kw).fit(X, Y)
    probe = next(r for r in clf.history_ if r["event"] == "loss_probe")
    assert probe["rows"] == 1536 and probe["continued"]["samples"] == 1536
    start = next(r for r in clf.history_ if r["event"] == "start")
    fixed = XMCClassifier(loss=clf.loss_, lr_decay=start["lr_decay"], **kw).fit(X, Y)
    for got, want in zip(clf.params_, fixed.params_, strict=True):
        np.testing.assert_array_equal(got, want)


def test_under_the_plateau_rule_the_continued_run_is_the_run_from_the_start(spy):
    """With ``lr_decay="plateau"`` (the default from ``PLATEAU_MIN_ROWS`` rows) the run's rate
    is constant in its first epoch, and so is the probe's: the continued run is the chosen
    loss's run from the initialisation (3,400 rows, 340 held out for the rule; the probe's
    fits train 2,048 of the other 3,060)."""
    X, Y = _synthetic(3400)
    kw = dict(hidden=8, threads=1, seed=0, eval_every=0, epochs=3, lr_decay="plateau")
    clf = XMCClassifier(**kw).fit(X, Y)
    probe = next(r for r in clf.history_ if r["event"] == "loss_probe")
    assert probe["continued"]["samples"] == probe["rows"] == 2048
    assert spy["fits"][0]["history"][0]["lr_decay"] == 0.0  # the probe's fit: no decay
    fixed = XMCClassifier(loss=clf.loss_, **kw).fit(X, Y)
    for got, want in zip(clf.params_, fixed.params_, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("output, chosen", [("exact", "bce"), ("sampled", "softmax")])
def test_the_probe_uses_the_margin_of_the_output_layer_the_run_trains(monkeypatch, output,
                                                                      chosen):
    """The softmax 1.42 standard errors ahead: enough with the sampled layer, not with the
    exact one (the layer the run trains, resolved from ``output``)."""
    monkeypatch.setattr(config, "LOSS_PROBE_HELDOUT_SHARE", 0.1)
    monkeypatch.setattr(config, "LOSS_PROBE_SAMPLES", 2100)
    hits = {"softmax": slice(0, 280), "bce": slice(240, 490)}
    seen = {}

    def fake_fit(cfg, X, Y, eval_set, **kw):
        seen[cfg.loss] = cfg.output
        return _fit_result(eval_set, hits[cfg.loss])

    _probe_with(monkeypatch, fake_fit)
    X, Y = _indexed_rows(5000)
    cfg = TrainConfig(loss="auto", output=output, epochs=2, seed=3)
    rec = training.choose_loss(cfg, X, Y, parse_devices(cfg.devices)[0])
    assert seen == {"softmax": output, "bce": output}
    assert rec["z"] == pytest.approx(1.42, abs=0.01) and rec["loss"] == chosen
    assert rec["margin"] == training.probe_margin(output)


def test_the_second_look_is_for_a_thin_softmax_lead_on_the_sampled_layer_early_in_an_epoch():
    """The Amazon-670K shape's figures: 490,449 rows, a first look of 19,456 rows (4 % of the
    epoch), periods of 1,024: a sixth of the epoch in whole periods. Not with the exact layer,
    a margin outside (0, 2], or a first look that saw a sixth of the epoch already."""
    look = training.second_look_samples
    assert config.LOSS_PROBE_SECOND_LOOK_SHARE == pytest.approx(1 / 6)
    args = dict(samples=19_456, n=490_449, n_held=2000, batch_size=64, period=1024)
    assert look("sampled", 0.63, **args) == 80_896 == 490_449 // 6 // 1024 * 1024
    assert look("sampled", 2.0, **args) == 80_896  # the exact layer's margin: not above it
    for output, z in (("exact", 0.63), ("sampled", 0.0), ("sampled", -0.5), ("sampled", 2.01)):
        assert look(output, z, **args) == 0
    # debian_builddeps: 27,235 rows, the first look 71 % of the epoch
    assert look("sampled", 0.88, samples=19_456, n=27_235, n_held=2000, batch_size=64,
                period=1024) == 0


def test_a_second_look_trains_longer_and_decides(monkeypatch):
    """The softmax 0.46 standard errors ahead after 1,024 of 5,000 rows with the sampled layer:
    both losses train again on the first 2,048 rows (half the epoch here), are scored on the
    500 rows after those, and that look (the softmax clearly ahead) decides; the record keeps
    what the first look saw."""
    monkeypatch.setattr(config, "LOSS_PROBE_HELDOUT_SHARE", 0.1)
    monkeypatch.setattr(config, "LOSS_PROBE_SAMPLES", 1100)  # one period of 1,024
    monkeypatch.setattr(config, "LOSS_PROBE_SECOND_LOOK_SHARE", 0.5)  # 2,500: two periods
    first = {"softmax": slice(0, 260), "bce": slice(240, 490)}  # z 0.46
    second = {"softmax": slice(0, 250), "bce": slice(0, 200)}  # z 7.45
    seen = []

    def fake_fit(cfg, X, Y, eval_set, **kw):
        rows = round(cfg.epochs * 5000)
        seen.append((cfg.loss, rows, eval_set[0].data.astype(int) - 1))
        return _fit_result(eval_set, (first if rows == 1024 else second)[cfg.loss])

    _probe_with(monkeypatch, fake_fit)
    X, Y = _indexed_rows(5000)
    cfg = TrainConfig(loss="auto", output="sampled", epochs=2, seed=3)
    rec = training.choose_loss(cfg, X, Y, parse_devices(cfg.devices)[0])
    assert [(loss, rows) for loss, rows, _ in seen] == [
        ("softmax", 1024), ("bce", 1024), ("softmax", 2048), ("bce", 2048)]
    order = training.epoch_permutation(5000, 3, 0)
    np.testing.assert_array_equal(seen[0][2], np.sort(order[1024:1524]))
    np.testing.assert_array_equal(seen[2][2], np.sort(order[2048:2548]))
    assert rec["loss"] == "softmax" and rec["z"] == pytest.approx(7.45, abs=0.01)
    assert (rec["rows"], rec["heldout"], rec["epochs"]) == (2048, 500, 0.4096)
    assert rec["first_look"]["rows"] == 1024 and rec["first_look"]["loss"] == "bce"
    assert rec["first_look"]["z"] == pytest.approx(0.46, abs=0.01)
    assert rec["first_look"]["p1"] == {"softmax": 0.52, "bce": 0.5}
    # with the share at 0 the probe looks once and the first look decides, as before
    monkeypatch.setattr(config, "LOSS_PROBE_SECOND_LOOK_SHARE", 0.0)
    seen.clear()
    rec = training.choose_loss(cfg, X, Y, parse_devices(cfg.devices)[0])
    assert len(seen) == 2 and rec["loss"] == "bce" and rec["first_look"] is None


@pytest.mark.slow
def test_probe_margin_bench_records_what_the_probe_saw(monkeypatch, tmp_path, capsys):
    """``bench/bench_probe_margin.py`` end to end on the built-in synthetic set with a short
    probe: one record per seed, the probe's length as asked, and a pick that follows the
    record's margin."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_probe_margin

    out = tmp_path / "margin.json"
    # the bench sets the engine's probe length; put back after the test
    monkeypatch.setattr(config, "LOSS_PROBE_SAMPLES", config.LOSS_PROBE_SAMPLES)
    monkeypatch.setattr(config, "LOSS_PROBE_SECOND_LOOK_SHARE", config.LOSS_PROBE_SECOND_LOOK_SHARE)
    bench_probe_margin.main(["--data", "synthetic", "--seeds", "0-1", "--probe-samples", "3000",
                             "--second-look-share", "0", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["probe_samples"] == 3000 and [r["seed"] for r in saved["rows"]] == [0, 1]
    assert saved["second_look_share"] == 0 and saved["summary"]["second_looks"] == 0
    for r in saved["rows"]:
        assert 0 < r["rows"] <= 3000 and r["heldout"] == 2000
        assert r["loss"] == ("softmax" if r["z"] > r["margin"] else "bce")
    assert saved["summary"]["picked"]["softmax"] + saved["summary"]["picked"]["bce"] == 2
    assert "z over 2 seeds" in capsys.readouterr().out
    assert bench_probe_margin.seeds_arg("0-2,5") == [0, 1, 2, 5]


def _merge_lrs(history) -> dict:
    """The base learning rate of each epoch's periods (one value per epoch)."""
    out: dict = {}
    for r in history:
        if r["event"] == "merge":
            out.setdefault(r["epoch"], set()).add(round(r["lr"], 9))
    return out


def test_the_softmax_the_probe_picks_trains_without_the_decay():
    """``lr_decay="auto"`` below the plateau rule's rows: where the probe compared the losses
    and picked the softmax (the synthetic topic data), no decay (``PROBED_SOFTMAX_DECAY``):
    epoch 1 runs at epoch 0's rate. The softmax given, on the same data, keeps the fixed decay
    (the shared sets lose P@1 without it)."""
    X, Y = _synthetic(3000)
    kw = dict(hidden=8, threads=1, seed=0, eval_every=0, epochs=2)
    probed = XMCClassifier(**kw).fit(X, Y)
    rec = next(r for r in probed.history_ if r["event"] == "loss_probe")
    start = next(r for r in probed.history_ if r["event"] == "start")
    assert rec["loss"] == "softmax" and rec["z"] is not None, rec
    assert start["lr_decay"] == config.PROBED_SOFTMAX_DECAY == 0.0
    assert _merge_lrs(probed.history_) == {0: {0.05}, 1: {0.05}}
    given = XMCClassifier(loss="softmax", **kw).fit(X, Y)
    assert next(r for r in given.history_ if r["event"] == "start")["lr_decay"] == 0.5
    assert _merge_lrs(given.history_) == {0: {0.05}, 1: {round(0.05 / 1.5, 9)}}


def test_the_decay_follows_the_probes_choice_not_the_loss_alone():
    """The rule of ``TrainConfig.lr_decay_for``: the softmax the probe picked gets no decay, the
    logistic loss it picked, a softmax no probe compared and SGD keep their fixed decay, a
    decay given stays, and the plateau rule's rows come first."""
    cfg = TrainConfig()
    n = config.PLATEAU_MIN_ROWS - 1
    assert cfg.lr_decay_for(n, probed="softmax") == config.PROBED_SOFTMAX_DECAY
    assert cfg.lr_decay_for(n, probed="bce") == cfg.lr_decay_for(n) == 0.5
    assert cfg.lr_decay_for(n + 1, probed="softmax") == "plateau"
    assert TrainConfig(optimizer="sgd").lr_decay_for(n, probed="softmax") == 0.0
    for given in (None, 0.25):
        assert (TrainConfig(lr_decay=given).lr_decay_for(n, probed="softmax")
                == (0.5 if given is None else given))


def test_a_logistic_loss_the_probe_picked_keeps_the_fixed_decay(monkeypatch):
    def choose(cfg, X, Y, device):
        return {"loss": "bce", "p1": {"softmax": 0.1, "bce": 0.2}, "z": -3.0, "rows": 1,
                "heldout": 1, "seconds": 0.0, "compile_seconds": 0.0, "compiled": 0,
                "fit": None}

    monkeypatch.setattr(training, "choose_loss", choose)
    X, Y = tiny_data(n=200)
    clf = XMCClassifier(hidden=8, epochs=1, seed=0, eval_every=0).fit(X, Y)
    assert next(r for r in clf.history_ if r["event"] == "start")["lr_decay"] == 0.5


def test_an_ensembles_members_train_with_the_decay_the_first_members_probe_gave():
    X, Y = _synthetic(3000)
    clf = XMCClassifier(hidden=8, threads=1, seed=0, eval_every=0, epochs=2,
                        ensemble=2).fit(X, Y)
    starts = [r for r in clf.history_ if r["event"] == "start"]
    assert len(starts) == 2 and starts[0]["loss"] == starts[1]["loss"] == "softmax"
    assert starts[0]["lr_decay"] == starts[1]["lr_decay"] == config.PROBED_SOFTMAX_DECAY
    assert starts[1]["config"]["lr_decay"] == 0.0  # given to the member
