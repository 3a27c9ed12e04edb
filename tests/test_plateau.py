"""``lr_decay="plateau"``: the rule (:class:`~xmc_engine.scheduler.controller.Plateau`), the
held-out P@1 it reads (:func:`xmc_engine.model.heldout_p1`, :func:`~xmc_engine.model.heldout_hits`),
and what a run does with both:
rows held out of training, the rate halved after an epoch that did not improve, the rule's
state in checkpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest
from xmc_engine.datasets import make_synthetic

from tests._helpers import script_heldout
from xmc_engine import XMCClassifier, training
from xmc_engine.backends.cpu import CPUBackend
from xmc_engine.checkpoint import CheckpointManager
from xmc_engine.cli.argtypes import lr_decay as lr_decay_arg
from xmc_engine.config import KEEP_BEST_Z, PLATEAU_HOLDOUT_ROWS, PLATEAU_STOP_SCALE
from xmc_engine.errors import ConfigError
from xmc_engine.model import ModelShape, heldout_p1, init_params
from xmc_engine.scheduler.controller import Plateau, Schedule


@pytest.fixture(scope="module")
def small():
    return make_synthetic(n_train=600, n_test=100, n_features=300, n_labels=40, seed=3)


def test_the_rule_halves_after_an_epoch_that_does_not_improve():
    rule = Plateau(0.5)
    steps = [rule.update(v) for v in (3.0, 2.5, 2.5, 2.6, 2.4, float("nan"), 2.3)]
    # 2.5 again is not below the best: lowered; NaN (a diverging epoch) lowers too
    assert steps == [False, False, True, True, False, True, False]
    assert rule.scale == 0.125
    assert rule.best == 2.3


def test_the_rule_is_done_once_its_scale_is_below_the_stop():
    rule = Plateau(0.5, stop_scale=0.25)
    assert not rule.update(1.0) and not rule.done  # the first epoch sets the best
    rule.update(1.0)  # x0.5
    rule.update(1.0)  # x0.25: at the stop, not below it
    assert rule.scale == 0.25 and not rule.done
    rule.update(0.5)  # an improvement keeps the rate (and does not undo the halvings)
    assert not rule.done
    rule.update(0.5)
    assert rule.scale == 0.125 and rule.done
    assert Plateau().stop_scale == PLATEAU_STOP_SCALE


def test_the_schedule_multiplies_its_rate_by_the_scale():
    base = Schedule(0.1, warmup_epochs=0.0, decay=0.5)
    assert Schedule(0.1, 0.0, 0.5, scale=0.25)(2.5) == pytest.approx(0.25 * base(2.5))


def test_heldout_p1_is_the_top_label_hit_rate(small):
    """Against numpy on the full logits, in row blocks and label chunks that do not divide the
    sizes; a row without labels counts 0 (as in the evaluation)."""
    X, Y, _, _ = small
    Y = Y.tolil()
    Y[3, :] = 0
    Y = Y.tocsr()
    rng = np.random.default_rng(0)
    W = [w + 0.1 * rng.standard_normal(w.shape).astype(np.float32)
         for w in init_params(ModelShape(X.shape[1], Y.shape[1], (16,)), seed=1)]
    top = (np.maximum(X @ W[0] + W[1], 0) @ W[2] + W[3]).argmax(axis=1)
    want = float(np.mean(Y.toarray()[np.arange(X.shape[0]), top]))
    for label_chunk in (None, 7):
        got = heldout_p1(CPUBackend(), W, X, Y, label_chunk=label_chunk, row_chunk=64)
        assert got == pytest.approx(want)
    assert 0 < want < 1


def _records(m, event):
    return [r for r in m.history_ if r["event"] == event]


@pytest.mark.parametrize("algorithm, devices", [("single", "cpu"), ("adaptive", "cpu,cpu@0.5")])
def test_a_plateau_run_holds_rows_out_and_halves_the_rate(small, monkeypatch, algorithm,
                                                           devices):
    """The held-out P@1 is scripted: 0.30, 0.35 (better), 0.35 (not): the rate of epoch 3 is
    half that of epochs 0-2, epoch 4 a quarter after 0.34; no decay by the epoch. The same on
    several devices (the central model is read at the epoch's last merge). ``keep_best`` reads
    the last model once more (0.36: it stays)."""
    X, Y, _, _ = small
    calls, _ = script_heldout(monkeypatch, [0.30, 0.35, 0.35, 0.34, 0.36])
    m = XMCClassifier(epochs=5, threads=1, eval_every=0, lr_decay="plateau", lr=0.05,
                      loss="softmax", algorithm=algorithm, devices=devices).fit(X, Y)
    start = _records(m, "start")[0]
    held = min(PLATEAU_HOLDOUT_ROWS, X.shape[0] // 10)
    assert start["lr_decay"] == "plateau" and start["heldout_rows"] == held
    assert m.n_train_ == X.shape[0] - held
    assert calls == [held] * 5  # after epochs 1-4 for the rule, and the last model
    plateau = _records(m, "plateau")
    assert [r["lowered"] for r in plateau] == [False, False, True, True]
    assert [r["lr_scale"] for r in plateau] == [1.0, 1.0, 0.5, 0.25]
    lrs = sorted({(r["epoch"], r["lr"]) for r in _records(m, "merge")})
    assert [e for e, _ in lrs] == [0, 1, 2, 3, 4]  # one rate per epoch, on every device
    assert [lr for _, lr in lrs] == pytest.approx([0.05, 0.05, 0.05, 0.025, 0.0125])


def test_a_trainer_built_without_the_driver_keeps_a_fixed_decay(small, monkeypatch):
    """``build_trainer`` alone has no held-out rows to read: where ``"auto"`` would choose the
    plateau rule (the threshold lowered to this data) it gets the optimizer's fixed decay, not
    the rule's undecayed rate with nothing to lower it; ``"plateau"`` given is no decay by the
    epoch (the driver's watch would rescale it)."""
    from xmc_engine import config
    from xmc_engine.config import DEFAULT_LR_DECAY, TrainConfig
    from xmc_engine.devices import parse_devices

    X, Y, _, _ = small
    monkeypatch.setattr(config, "PLATEAU_MIN_ROWS", 10)
    params = init_params(ModelShape(X.shape[1], Y.shape[1], (8,)), seed=0)
    for given, want in (("auto", DEFAULT_LR_DECAY["adagrad"]), ("plateau", 0.0), (0.25, 0.25)):
        cfg = TrainConfig(hidden=(8,), lr_decay=given, threads=1, loss="softmax")
        assert cfg.lr_decay_for(X.shape[0]) == ("plateau" if given == "auto" else given)
        trainer = training.build_trainer(cfg, parse_devices("cpu", cores=1), X, Y, params, None)
        try:
            assert trainer.schedule.decay == want and trainer.schedule.scale == 1.0
        finally:
            trainer.close()


def test_the_heldout_rows_are_the_same_for_a_seed_and_never_trained_on(small):
    X, Y, _, _ = small
    Xa, _, (Xh, _) = training.hold_out(X, Y, seed=4)
    Xb, _, (Xh2, _) = training.hold_out(X, Y, seed=4)
    assert (Xh != Xh2).nnz == 0 and (Xa != Xb).nnz == 0
    assert Xa.shape[0] + Xh.shape[0] == X.shape[0]
    rows = {tuple(r.indices) + tuple(r.data) for r in X}
    assert len(rows) == X.shape[0]  # distinct rows, so that membership below is exact
    trained = {tuple(r.indices) + tuple(r.data) for r in Xa}
    assert not trained & {tuple(r.indices) + tuple(r.data) for r in Xh}


def test_too_few_rows_for_the_plateau_rule_is_named(small):
    X, Y, _, _ = small
    with pytest.raises(ConfigError, match="9 rows are too few"):
        XMCClassifier(epochs=2, threads=1, lr_decay="plateau").fit(X[:9], Y[:9])


def test_a_checkpoint_keeps_the_rules_state_and_a_resume_restores_it(small, tmp_path,
                                                                       monkeypatch):
    X, Y, _, _ = small
    script_heldout(monkeypatch, 0.4)  # never improves
    kw = dict(threads=1, eval_every=0, lr_decay="plateau", lr=0.05, loss="softmax",
              log_dir=tmp_path / "run", checkpoint_every=X.shape[0] // 2)
    XMCClassifier(epochs=3, **kw).fit(X, Y)
    arrays, meta = CheckpointManager(tmp_path / "run").latest_valid()
    assert meta["lr_scale"] == 0.5  # after epochs 1 and 2
    assert meta["plateau_best_p1"] == pytest.approx(0.4)
    # the resumed run goes on at half the rate, and halves it again after epoch 4 (the first
    # run ended after epoch 3, where there was nothing left to schedule)
    m = XMCClassifier(epochs=5, **kw).fit(X, Y, resume=True)
    assert [r["lr_scale"] for r in _records(m, "plateau")][-1] == 0.25
    lrs = {r["epoch"]: r["lr"] for r in _records(m, "merge")}
    assert [lrs[3], lrs[4]] == pytest.approx([0.05 * 0.5, 0.05 * 0.25])


def test_the_cli_type_takes_numbers_and_the_two_names():
    assert lr_decay_arg("0.25") == 0.25
    assert lr_decay_arg("plateau") == "plateau" and lr_decay_arg("auto") == "auto"
    with pytest.raises(Exception, match="'fast' is not a number, 'plateau' or 'auto'"):
        lr_decay_arg("fast")
    assert not math.isnan(lr_decay_arg("0"))


def test_the_memory_plan_counts_the_plateau_rules_copy_and_workspace():
    """From PLATEAU_MIN_ROWS rows the default holds rows out (a copy of the kept ones on the
    host, the loss's logits block on the device); a fixed decay plans neither."""
    from xmc_engine.config import (
        HELDOUT_LOGITS,
        KEEP_BEST_MIN_ROWS,
        PLATEAU_MIN_ROWS,
        TrainConfig,
    )
    from xmc_engine.memory import plan_memory

    shape = dict(n_features=100, n_labels=50, nnz=10 * PLATEAU_MIN_ROWS,
                 label_nnz=2 * PLATEAU_MIN_ROWS, budget="8GiB")
    items = plan_memory(TrainConfig(), n_samples=PLATEAU_MIN_ROWS, **shape).pools[0].items
    assert items["held-out P@1 workspace (plateau, keep_best)"] == 4 * HELDOUT_LOGITS
    copy = items["training rows apart from the held-out ones (a copy)"]
    assert copy == items["training data (CSR X, Y)"]
    best = items["the best epoch's model (keep_best, back_to_best: P)"]
    assert best == items["host parameter copies (2 x P)"] // 2
    for one in (dict(keep_best=False), dict(back_to_best=False)):  # either keeps the copy
        on = plan_memory(TrainConfig(**one), n_samples=PLATEAU_MIN_ROWS, **shape)
        assert on.pools[0].items["the best epoch's model (keep_best, back_to_best: P)"] == best
    off = plan_memory(TrainConfig(keep_best=False, back_to_best=False),
                      n_samples=PLATEAU_MIN_ROWS, **shape)
    assert not any(k.startswith("the best epoch's model") for k in off.pools[0].items)
    for cfg, n in ((TrainConfig(lr_decay=0.5), PLATEAU_MIN_ROWS),
                   (TrainConfig(), KEEP_BEST_MIN_ROWS - 1)):
        assert not any("held-out" in k for k in plan_memory(cfg, n_samples=n,
                                                            **shape).pools[0].items)


@pytest.mark.parametrize("algorithm, devices", [("single", "cpu"), ("adaptive", "cpu,cpu@0.5")])
def test_a_run_stops_once_the_rule_is_below_its_stop(small, monkeypatch, algorithm, devices):
    """A held-out P@1 that never improves after epoch 1 halves the rate after epochs 2, 3, ...;
    below the default stop (x1/32) after epoch 7 (x1/64): training ends there, evaluated, with a
    ``plateau_stop`` record and ``final``'s status saying why."""
    X, Y, Xt, Yt = small
    script_heldout(monkeypatch, 0.4)
    m = XMCClassifier(epochs=12, threads=1, eval_every=0, lr_decay="plateau", lr=0.05,
                      loss="softmax", algorithm=algorithm, devices=devices)
    m.fit(X, Y, eval_set=(Xt, Yt))
    scales = [r["lr_scale"] for r in _records(m, "plateau")]
    assert scales == [0.5 ** k for k in range(7)] and scales[-1] < PLATEAU_STOP_SCALE
    stop, = _records(m, "plateau_stop")
    assert stop["epoch"] == 7 and stop["lr_scale"] == 1 / 64
    assert stop["stop_scale"] == PLATEAU_STOP_SCALE and stop["best_p1"] == pytest.approx(0.4)
    final, = _records(m, "final")
    assert final["status"] == "plateau_stop"
    assert final["samples"] == 7 * m.n_train_ and final["epoch"] == 7
    assert _records(m, "eval")[-1]["samples"] == 7 * m.n_train_  # the model it stopped with
    assert max(r["epoch"] for r in _records(m, "merge")) == 6
    # keep_best: the last reading (after epoch 7) is not read again; level with the best, the
    # last model stays
    kept, = _records(m, "keep_best")
    assert kept["heldout_p1"] == 0.4 and kept["best_epoch"] == 1 and not kept["restored"]


def test_a_run_that_keeps_improving_trains_every_epoch(small, monkeypatch):
    X, Y, _, _ = small
    script_heldout(monkeypatch, np.linspace(0.1, 0.5, 10))  # after epochs 1-9, the last model
    m = XMCClassifier(epochs=10, threads=1, eval_every=0, lr_decay="plateau",
                      loss="softmax").fit(X, Y)
    assert not _records(m, "plateau_stop")
    assert not _records(m, "keep_best")[0]["restored"]  # the last model is the best
    final, = _records(m, "final")
    assert final["status"] == "completed" and final["samples"] == 10 * m.n_train_


def test_a_resumed_run_whose_rule_had_stopped_trains_no_further(small, tmp_path, monkeypatch):
    X, Y, _, _ = small
    script_heldout(monkeypatch, 0.4)
    kw = dict(threads=1, eval_every=0, lr_decay="plateau", lr=0.05, loss="softmax",
              log_dir=tmp_path / "run", checkpoint_every=X.shape[0] // 2)
    first = XMCClassifier(epochs=12, **kw).fit(X, Y)
    assert _records(first, "final")[0]["status"] == "plateau_stop"
    again = XMCClassifier(epochs=14, **kw).fit(X, Y, resume=True)
    assert not _records(again, "merge") and not _records(again, "plateau")
    final, = _records(again, "final")
    assert final["status"] == "plateau_stop"
    assert final["samples"] == _records(first, "final")[0]["samples"]


@pytest.mark.parametrize("algorithm, devices", [("single", "cpu"), ("adaptive", "cpu,cpu@0.5"),
                                                ("sync", "cpu,cpu")])
def test_keep_best_ends_with_the_best_epochs_model(small, monkeypatch, algorithm, devices):
    """Held-out P@1 (60 rows) 0.30, 0.50 (the best, after epoch 2), 0.40, then 0.25 for the last
    model, 4.4 standard errors behind: the run ends with the model the rule read after epoch 2,
    and evaluates that one."""
    X, Y, Xt, Yt = small
    _, models = script_heldout(monkeypatch, [0.30, 0.50, 0.40, 0.25])
    m = XMCClassifier(epochs=4, threads=1, eval_every=0, lr_decay="plateau", lr=0.05,
                      loss="softmax", algorithm=algorithm, devices=devices)
    m.fit(X, Y, eval_set=(Xt, Yt))
    assert len(models) == 4
    kept, = _records(m, "keep_best")
    assert kept["restored"] and kept["best_epoch"] == 2 and kept["z"] > KEEP_BEST_Z
    assert kept["heldout_p1"] == pytest.approx(0.25) and kept["best_p1"] == pytest.approx(0.5)
    for got, want in zip(m.params_, models[1], strict=True):
        np.testing.assert_array_equal(got, want)
    assert any(not np.array_equal(a, b) for a, b in zip(models[1], models[3], strict=True))
    # the final evaluation is of the model kept, not of the last one
    final, = _records(m, "final")
    assert final["metrics"]["P@1"] == pytest.approx(m.evaluate(Xt, Yt)["P@1"])


@pytest.mark.parametrize("algorithm, devices", [("single", "cpu"), ("adaptive", "cpu,cpu@0.5")])
def test_keep_best_with_the_fixed_decay_holds_rows_out_and_never_lowers_the_rate(
        small, monkeypatch, algorithm, devices):
    """From KEEP_BEST_MIN_ROWS rows (lowered to this data) ``lr_decay="auto"`` below the plateau
    rule's threshold keeps its fixed decay and holds rows out for ``keep_best``: the same
    scripted held-out P@1 as above never changes the rate (each epoch's is ``lr / (1 + 0.5
    e)``), and the run ends with epoch 2's model."""
    from xmc_engine import config
    from xmc_engine.config import DEFAULT_LR_DECAY

    X, Y, _, _ = small
    monkeypatch.setattr(config, "KEEP_BEST_MIN_ROWS", 10)
    calls, models = script_heldout(monkeypatch, [0.30, 0.50, 0.40, 0.25])
    m = XMCClassifier(epochs=4, threads=1, eval_every=0, lr=0.05, loss="softmax",
                      algorithm=algorithm, devices=devices).fit(X, Y)
    start = _records(m, "start")[0]
    held = min(PLATEAU_HOLDOUT_ROWS, X.shape[0] // 10)
    assert start["lr_decay"] == DEFAULT_LR_DECAY["adagrad"] and start["heldout_rows"] == held
    assert m.n_train_ == X.shape[0] - held and calls == [held] * 4
    plateau = _records(m, "plateau")
    assert [r["lowered"] for r in plateau] == [False] * 3
    assert [r["lr_scale"] for r in plateau] == [1.0] * 3
    assert [r["best_p1"] for r in plateau] == pytest.approx([0.30, 0.50, 0.50])
    lrs = sorted({(r["epoch"], r["lr"]) for r in _records(m, "merge")})
    assert [lr for _, lr in lrs] == pytest.approx([0.05 / (1 + 0.5 * e) for e in range(4)])
    kept, = _records(m, "keep_best")
    assert kept["restored"] and kept["best_epoch"] == 2
    for got, want in zip(m.params_, models[1], strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kw, threshold, why", [
    (dict(lr_decay=0.5), 10, "a decay given trains every row"),
    (dict(keep_best=False), 10, "keep_best off"),
    ({}, 601, "fewer training rows than KEEP_BEST_MIN_ROWS"),
])
def test_the_fixed_decay_holds_no_rows_out(small, monkeypatch, kw, threshold, why):
    from xmc_engine import config

    X, Y, _, _ = small
    monkeypatch.setattr(config, "KEEP_BEST_MIN_ROWS", threshold)
    calls, _ = script_heldout(monkeypatch, [])
    m = XMCClassifier(epochs=2, threads=1, eval_every=0, lr=0.05, loss="softmax",
                      **kw).fit(X, Y)
    assert _records(m, "start")[0]["heldout_rows"] == 0, why
    assert m.n_train_ == X.shape[0] and calls == [], why
    assert not _records(m, "plateau") and not _records(m, "keep_best"), why


def test_the_margin_is_the_paired_difference_in_standard_errors():
    a = np.array([1, 1, 0, 0, 1, 0, 1, 1], dtype=bool)
    b = np.array([1, 0, 0, 0, 1, 0, 0, 1], dtype=bool)
    d = a.astype(float) - b
    assert training.paired_z(a, b) == pytest.approx(d.mean() / (d.std(ddof=1) / np.sqrt(8)))
    assert training.paired_z(b, a) == pytest.approx(-training.paired_z(a, b))
    assert training.paired_z(a, a) == 0.0  # the 1/rows floor: no division by zero


@pytest.mark.parametrize("kw, values, why", [
    (dict(keep_best=False), [0.50, 0.30], "off: no reading of the last model"),
    ({}, [0.50, 0.30, 0.55], "the last model is the best"),
    ({}, [0.45, 0.40, 0.4333], "the best is 1 of 60 rows ahead: within chance"),
])
def test_the_last_model_stays(small, monkeypatch, kw, values, why):
    X, Y, _, _ = small
    calls, models = script_heldout(monkeypatch, values)
    m = XMCClassifier(epochs=3, threads=1, eval_every=0, lr_decay="plateau", lr=0.05,
                      loss="softmax", **kw).fit(X, Y)
    assert len(calls) == len(values), why
    kept = _records(m, "keep_best")
    if kw.get("keep_best") is False:
        assert not kept, why
        assert any(not np.array_equal(a, b) for a, b in zip(m.params_, models[0], strict=True))
        return
    assert not kept[0]["restored"] and kept[0]["best_epoch"] == 1, why
    assert kept[0]["z"] <= KEEP_BEST_Z, why
    for got, last in zip(m.params_, models[-1], strict=True):
        np.testing.assert_array_equal(got, last)


def test_a_run_of_one_epoch_has_no_earlier_model_to_keep(small, monkeypatch):
    """The rule reads nothing after the last epoch, so one epoch leaves no best epoch's model,
    and the end reads nothing either."""
    X, Y, _, _ = small
    calls, _ = script_heldout(monkeypatch, [])
    m = XMCClassifier(epochs=1, threads=1, eval_every=0, lr_decay="plateau", lr=0.05,
                      loss="softmax").fit(X, Y)
    kept, = _records(m, "keep_best")
    assert calls == [] and not kept["restored"]
    assert kept["best_epoch"] is None and kept["z"] is None and kept["heldout_p1"] is None


def test_a_checkpoint_keeps_the_best_model_and_a_resume_can_return_it(small, tmp_path,
                                                                       monkeypatch):
    """The best epoch's model and its held-out hits travel in the checkpoints (``best.<name>``,
    ``best.heldout_hits``): a run resumed after its best epoch still ends with that model."""
    X, Y, _, _ = small
    kw = dict(threads=1, eval_every=0, lr_decay="plateau", lr=0.05, loss="softmax",
              log_dir=tmp_path / "run", checkpoint_every=X.shape[0] // 2)
    _, models = script_heldout(monkeypatch, [0.50, 0.30, 0.30])  # epochs 1, 2; the last model
    XMCClassifier(epochs=3, **kw).fit(X, Y)
    arrays, meta = CheckpointManager(tmp_path / "run").latest_valid()
    assert meta["best_epoch"] == 1
    names = ModelShape(X.shape[1], Y.shape[1], (128,)).param_names
    for n, want in zip(names, models[0], strict=True):
        np.testing.assert_array_equal(arrays["best." + n], want)
    assert arrays["best.heldout_hits"].sum() == 30
    best = models[0]
    script_heldout(monkeypatch, [0.35, 0.2])  # after epoch 3; the last model
    m = XMCClassifier(epochs=4, **kw).fit(X, Y, resume=True)
    kept, = _records(m, "keep_best")
    assert kept["restored"] and kept["best_epoch"] == 1
    for got, want in zip(m.params_, best, strict=True):
        np.testing.assert_array_equal(got, want)
    # resumed again, a better epoch replaces the loaded best (copied into its arrays)
    _, models = script_heldout(monkeypatch, [0.6, 0.2])  # after epoch 5; the last model
    m = XMCClassifier(epochs=6, **kw).fit(X, Y, resume=True)
    kept, = _records(m, "keep_best")
    assert kept["restored"] and kept["best_epoch"] == 5
    for got, want in zip(m.params_, models[0], strict=True):
        np.testing.assert_array_equal(got, want)


def _capture_loads(monkeypatch):
    """Record, at every ``Trainer.load_model``, host copies of the central model and of each
    replica's parameters just after it (and the policy, for its own state)."""
    from xmc_engine.scheduler.runner import Trainer

    seen = []
    original = Trainer.load_model

    def load(self, params):
        original(self, params)
        be = self.replicas[0].backend

        def host(arrays):
            return [np.array(be.to_host(p)) for p in arrays]

        policy = self.policy
        seen.append({"central": host(self.central_params()),
                     "replicas": [host(r.params()) for r in self.replicas],
                     "momentum": [host(getattr(policy, k)) for k in ("_z2", "_z_prev")
                                  if getattr(policy, k, None) is not None],
                     "norms": list(policy.trend.norms) if hasattr(policy, "trend") else None})

    monkeypatch.setattr(Trainer, "load_model", load)
    return seen


@pytest.mark.parametrize("algorithm, devices, options", [
    ("single", "cpu", {}), ("adaptive", "cpu,cpu@0.5", {}),
    ("adaptive", "cpu,cpu@0.5", {"momentum": 0.5}), ("average", "cpu,cpu", {}),
    ("easgd", "cpu,cpu", {}), ("crossbow", "cpu,cpu", {}), ("sync", "cpu,cpu", {})])
def test_back_to_best_goes_on_from_the_best_epochs_model(small, monkeypatch, algorithm,
                                                         devices, options):
    """Held-out P@1 (60 rows) 0.30, 0.50 (epoch 2: the best), 0.25 (4.9 standard errors
    behind: the rate halves and training goes on from epoch 2's model, on every replica, with
    the policy's momentum and norm trend started afresh), then 0.55, 0.60: the run trains on
    from there and ends with its last model."""
    X, Y, _, _ = small
    _, models = script_heldout(monkeypatch, [0.30, 0.50, 0.25, 0.55, 0.60])
    loads = _capture_loads(monkeypatch)
    m = XMCClassifier(epochs=5, threads=1, eval_every=0, lr_decay="plateau", lr=0.05,
                      loss="softmax", algorithm=algorithm, devices=devices,
                      algorithm_params=options).fit(X, Y)
    plateau = _records(m, "plateau")
    assert [r["back_to"] for r in plateau] == [None, None, 2, None]
    assert plateau[2]["lowered"] and plateau[2]["z"] > KEEP_BEST_Z
    assert [r["lr_scale"] for r in plateau] == [1.0, 1.0, 0.5, 0.5]
    load, = loads
    for got in (load["central"], *load["replicas"]):
        for a, want in zip(got, models[1], strict=True):
            np.testing.assert_array_equal(a, want)
    # the previous central model of the momentum is the loaded one: no momentum at once
    assert len(load["momentum"]) == (algorithm == "crossbow" or "momentum" in options)
    for before in load["momentum"]:
        for a, want in zip(before, models[1], strict=True):
            np.testing.assert_array_equal(a, want)
    assert load["norms"] == ([] if algorithm == "adaptive" else None)  # the trend afresh
    # epoch 4 trained from epoch 2's model at half the rate, and the run ends with its last
    # model (the rule read 0.60 last, the best)
    assert any(not np.array_equal(a, b) for a, b in zip(models[3], models[2], strict=True))
    kept, = _records(m, "keep_best")
    assert not kept["restored"]
    for got, want in zip(m.params_, models[-1], strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kw, values, why", [
    ({}, [0.45, 0.40, 0.4333, 0.4], "the best is 1 of 60 rows ahead: within chance"),
    (dict(back_to_best=False), [0.50, 0.25, 0.3, 0.3], "off"),
    (dict(keep_best=False, back_to_best=False), [0.50, 0.25, 0.3, 0.3], "both off"),
])
def test_back_to_best_does_not_go_back(small, monkeypatch, kw, values, why):
    X, Y, _, _ = small
    script_heldout(monkeypatch, values)
    loads = _capture_loads(monkeypatch)
    m = XMCClassifier(epochs=4, threads=1, eval_every=0, lr_decay="plateau", lr=0.05,
                      loss="softmax", **kw).fit(X, Y)
    assert not loads, why
    plateau = _records(m, "plateau")
    assert all(r.get("back_to") is None for r in plateau), why
    assert ("z" in plateau[0]) == kw.get("back_to_best", True), why


def test_going_back_before_the_plateau_stop_leaves_the_best_model_kept(small, monkeypatch):
    """A run that goes back to its best epoch's model at every halving until the rule stops
    it ends with that model, and ``keep_best`` has nothing to put back (its record reads the
    model the run ended with: the best)."""
    X, Y, _, _ = small
    _, models = script_heldout(monkeypatch, [0.5] + [0.2] * 11)
    loads = _capture_loads(monkeypatch)
    m = XMCClassifier(epochs=12, threads=1, eval_every=0, lr_decay="plateau", lr=0.05,
                      loss="softmax").fit(X, Y)
    assert _records(m, "final")[0]["status"] == "plateau_stop"
    assert len(loads) == 6  # each of the six halvings went back (the sixth stops the run)
    kept, = _records(m, "keep_best")
    assert not kept["restored"] and kept["heldout_p1"] == pytest.approx(0.5)
    for got, want in zip(m.params_, models[0], strict=True):
        np.testing.assert_array_equal(got, want)


def test_back_to_best_takes_a_smaller_margin_once_the_best_epoch_is_two_epochs_old(
        small, monkeypatch):
    """Held-out P@1 (60 rows) 0.50 after epoch 1, then 0.45 (1.8 standard errors behind) after
    epochs 2 and 3: one epoch after the best that is within :data:`BACK_TO_BEST_Z` and training
    goes on from the last model; two epochs after it the margin is
    :data:`BACK_TO_BEST_STALE_Z` and training goes back to epoch 1's model."""
    from xmc_engine.config import BACK_TO_BEST_STALE_Z, BACK_TO_BEST_Z

    X, Y, _, _ = small
    script_heldout(monkeypatch, [0.50, 0.45, 0.45, 0.55])
    m = XMCClassifier(epochs=4, threads=1, eval_every=0, lr_decay="plateau", lr=0.05,
                      loss="softmax").fit(X, Y)
    plateau = _records(m, "plateau")
    assert [r["back_to"] for r in plateau] == [None, None, 1]
    assert BACK_TO_BEST_STALE_Z < plateau[1]["z"] == plateau[2]["z"] < BACK_TO_BEST_Z
