"""The defaults' single source and what a run records of them: the learning rate each optimizer
gets when ``lr`` is unset, and kernel compilation kept out of the training clock."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
from xmc_engine.datasets import make_synthetic

from xmc_engine import XMCClassifier, training
from xmc_engine.config import (
    DEFAULT_LR,
    DEFAULT_LR_BCE,
    DEFAULT_LR_DECAY,
    OPTIMIZERS,
    PLATEAU_MIN_ROWS,
    TrainConfig,
)
from xmc_engine.devices import parse_devices
from xmc_engine.errors import ConfigError
from xmc_engine.runlog import RunLog


@pytest.fixture(scope="module")
def small():
    return make_synthetic(n_train=400, n_test=100, n_features=300, n_labels=40, seed=3)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_unset_lr_is_the_optimizers_default(optimizer):
    assert TrainConfig(optimizer=optimizer).learning_rate == DEFAULT_LR[optimizer]
    assert TrainConfig(optimizer=optimizer, lr=0.3).learning_rate == 0.3
    bce = TrainConfig(optimizer=optimizer, loss="bce")
    assert bce.learning_rate == DEFAULT_LR_BCE[optimizer]
    assert TrainConfig(optimizer=optimizer, loss="bce", lr=0.3).learning_rate == 0.3


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_lr_decay_none_is_the_optimizers_fixed_decay(optimizer):
    cfg = TrainConfig(optimizer=optimizer, lr_decay=None)
    assert cfg.lr_decay_for(10) == cfg.lr_decay_for(10**7) == DEFAULT_LR_DECAY[optimizer]
    assert TrainConfig(optimizer=optimizer, lr_decay=0.0).lr_decay_for(10**7) == 0.0
    assert set(DEFAULT_LR_DECAY) == set(OPTIMIZERS)
    with pytest.raises(ConfigError, match="lr_decay=-0.5"):
        TrainConfig(lr_decay=-0.5)
    with pytest.raises(ConfigError, match="lr_decay='plateu'.*'plateau' or 'auto'"):
        TrainConfig(lr_decay="plateu")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_lr_decay_auto_follows_the_row_count(optimizer):
    """The default: Adagrad switches to the held-out plateau rule at PLATEAU_MIN_ROWS training
    rows (not one row before), SGD keeps its own fixed decay at any size."""
    cfg = TrainConfig(optimizer=optimizer)
    assert cfg.lr_decay == "auto"
    below = cfg.lr_decay_for(PLATEAU_MIN_ROWS - 1)
    at = cfg.lr_decay_for(PLATEAU_MIN_ROWS)
    assert below == DEFAULT_LR_DECAY[optimizer]
    assert at == ("plateau" if optimizer == "adagrad" else DEFAULT_LR_DECAY[optimizer])
    assert TrainConfig(optimizer=optimizer, lr_decay="plateau").lr_decay_for(10) == "plateau"


def test_configs_saved_before_the_auto_decay_keep_the_fixed_one():
    """A saved config's ``lr_decay: null`` meant the optimizer's fixed decay when it trained,
    and still does; today's configs save ``"auto"``."""
    old = TrainConfig.from_saved({"lr_decay": None})
    assert old.lr_decay_for(10**6) == DEFAULT_LR_DECAY["adagrad"]
    assert TrainConfig.from_saved(TrainConfig().to_dict()).lr_decay == "auto"


def test_configs_saved_before_frequency_negatives_keep_uniform_ones():
    """A saved config without ``negative_sampling`` trained with uniform negatives, the default
    then, and resumes with them; today's configs save the rule they train with."""
    assert TrainConfig.from_saved({}).negative_sampling == "uniform"
    assert TrainConfig.from_saved(TrainConfig().to_dict()).negative_sampling == "frequency"
    assert TrainConfig.from_dict({}).negative_sampling == "frequency"


def test_default_decay_reaches_the_schedule(small):
    """The run's learning rate per period is the default lr over (1 + default decay x whole
    epochs done): 0.05 in epoch 0, 0.05 / 1.5 in epoch 1 for Adagrad."""
    X, Y, _, _ = small
    m = XMCClassifier(epochs=2, threads=1, eval_every=0).fit(X, Y)
    start = next(r for r in m.history_ if r["event"] == "start")
    assert start["lr_decay"] == DEFAULT_LR_DECAY["adagrad"] == 0.5
    lrs = {r["epoch"]: r["lr"] for r in m.history_ if r["event"] == "merge"}
    assert lrs[0] == pytest.approx(0.05)
    assert lrs[1] == pytest.approx(0.05 / 1.5)


def test_every_optimizer_has_a_default_lr_and_a_bad_lr_is_named():
    assert set(DEFAULT_LR) == set(OPTIMIZERS) == set(DEFAULT_LR_BCE)
    with pytest.raises(ConfigError, match="lr=-1.0"):
        TrainConfig(lr=-1.0)


def test_defaults_round_trip_through_json():
    cfg = TrainConfig()
    assert TrainConfig.from_json(cfg.to_json()) == cfg


def test_run_log_records_the_lr_in_effect_and_the_compile_time(small):
    X, Y, Xt, Yt = small
    m = XMCClassifier(epochs=1, threads=1).fit(X, Y, eval_set=(Xt, Yt))
    events = [r["event"] for r in m.history_]
    start = m.history_[events.index("start")]
    assert start["config"]["lr"] is None
    assert start["lr"] == DEFAULT_LR[TrainConfig().optimizer]
    # Compiled after the start record and before the first training record.
    compile_at = events.index("compile")
    assert events.index("start") < compile_at < events.index("eval")
    assert m.history_[compile_at]["seconds"] >= 0.0


def test_weights_from_epoch_auto_follows_the_label_count():
    from xmc_engine import config
    from xmc_engine.config import AdaptiveConfig

    c = AdaptiveConfig()
    assert c.weights_from_epoch == "auto"
    n = config.AUTO_WEIGHTS_LABELS
    assert c.weights_from_epoch_for(n - 1) == 0 and c.weights_from_epoch_for(n) == 1
    assert AdaptiveConfig(weights_from_epoch=3).weights_from_epoch_for(10) == 3
    assert AdaptiveConfig(weights_from_epoch=0).weights_from_epoch_for(10 * n) == 0
    with pytest.raises(ConfigError, match="'often'"):
        AdaptiveConfig(weights_from_epoch="often")
    with pytest.raises(ConfigError, match="weights_from_epoch must be >= 0"):
        AdaptiveConfig(weights_from_epoch=-1)
    # from JSON / --algo-param: an epoch or "auto"
    cfg = TrainConfig.from_dict({"algorithm": "adaptive",
                                 "algorithm_params": {"weights_from_epoch": 2}})
    assert cfg.algorithm_params.weights_from_epoch == 2
    # a config saved before the option keeps its behaviour (from the start), a newer one its value
    old = TrainConfig.from_saved({"algorithm": "adaptive", "algorithm_params": {}})
    assert old.algorithm_params.weights_from_epoch == 0
    new = TrainConfig.from_saved(TrainConfig(algorithm="adaptive").to_dict())
    assert new.algorithm_params.weights_from_epoch == "auto"


def test_sum_sqrt_row_weights_scale_the_shared_rows_sum():
    """``row_weights="sum_sqrt"``: per-row weights with the sum of the changes (``row_sum``)
    scaled by ``k ** -0.5`` (``row_sum_power_for``); the per-row merge period under
    ``"auto"``; ``"sum_sqrt_unequal"`` only where the batches differ, from ``sqrt_from_epoch``
    (1) on; ``"sum"`` keeps the plain sum, the other weights have no sum; an unknown value is
    refused."""
    from xmc_engine import config
    from xmc_engine.config import AdaptiveConfig

    c = AdaptiveConfig(row_weights="sum_sqrt")
    assert c.per_row_weights and c.row_sum
    assert c.row_sum_power_for([64, 64]) == c.row_sum_power_for([128, 64]) == 0.5
    assert c.resolved(1000, "softmax").merge_period == config.AUTO_MERGE_PERIOD_TOUCHED
    u = AdaptiveConfig(row_weights="sum_sqrt_unequal")
    assert u.per_row_weights and u.row_sum and u.sqrt_from_epoch == 1
    assert [u.row_sum_power_for(b, e) for b, e in (([64, 64, 64], 1), ([128, 64, 32], 1),
                                                   ([128, 64, 32], 0))] == [0.0, 0.5, 0.0]
    assert AdaptiveConfig(row_weights="sum_sqrt_unequal",
                          sqrt_from_epoch=0).row_sum_power_for([128, 64], 0) == 0.5
    assert AdaptiveConfig(row_weights="sum").row_sum_power_for([128, 64]) == 0.0
    for w in ("touched", "updates"):
        assert not AdaptiveConfig(row_weights=w).row_sum
    with pytest.raises(ConfigError, match="row_weights"):
        AdaptiveConfig(row_weights="sqrt")
    with pytest.raises(ConfigError, match="sqrt_from_epoch"):
        AdaptiveConfig(sqrt_from_epoch=-1)


def test_auto_merge_weights_follow_the_label_count():
    """``row_weights`` / ``label_weights`` ``'auto'`` (the defaults): with the softmax loss the
    per-row / per-label weights below :data:`AUTO_WEIGHTS_LABELS` labels, the paper's from there
    on; with the logistic loss the paper's; a value given
    stays; configs saved before ``'auto'`` keep the per-row / per-label weights they had."""
    from xmc_engine import config
    from xmc_engine.config import AdaptiveConfig

    n = config.AUTO_WEIGHTS_LABELS
    c = AdaptiveConfig()
    assert (c.row_weights, c.label_weights) == ("auto", "auto")
    small, large = c.resolved(n - 1, "softmax"), c.resolved(n, "softmax")
    assert (small.row_weights, small.label_weights, small.weights_from_epoch) == (
        "sum_sqrt_unequal", "positives", 0)
    assert small.row_sum and not large.row_sum
    assert (large.row_weights, large.label_weights, large.weights_from_epoch) == (
        "updates", "updates", 1)
    assert small.per_row_weights and small.per_label_weights
    assert not (large.per_row_weights or large.per_label_weights)
    # the logistic loss keeps the paper's weights at every size
    exact = c.resolved(n - 1, "bce")
    assert (exact.row_weights, exact.label_weights, exact.weights_from_epoch) == (
        "updates", "updates", 0)
    given = AdaptiveConfig(row_weights="touched", label_weights="updates").resolved(n, "bce")
    assert (given.row_weights, given.label_weights) == ("touched", "updates")
    # resolving twice changes nothing
    assert c.resolved(n, "softmax").resolved(n - 1, "softmax") == large
    with pytest.raises(ConfigError, match="row_weights must be one of"):
        AdaptiveConfig(row_weights="often")
    old = TrainConfig.from_saved({"algorithm": "adaptive",
                                  "algorithm_params": {"weights_from_epoch": "auto"}})
    assert (old.algorithm_params.row_weights, old.algorithm_params.label_weights) == (
        "touched", "positives")


@pytest.mark.parametrize("weight_by, share", [("samples", "samples"), ("updates", "updates")])
def test_a_run_s_merge_weights_are_each_device_s_share_of_samples(small, weight_by, share):
    """``weight_by="samples"`` (the default below 200,000 labels) through the trainer: every
    merge weights each device by its share of the period's rows, as the run log's ``merge``
    record counts them (``"updates"``: the paper's share of updates). Small periods and batch
    steps so that the batch sizes adapt, where the two shares differ."""
    X, Y, _, _ = small
    params = {"merge_period": 128, "b_min": 8, "delta_b": 8}
    if weight_by != "samples":
        params["weight_by"] = weight_by
    m = XMCClassifier(epochs=3, algorithm="adaptive", devices="cpu,cpu@0.5", batch_size=32,
                      algorithm_params=params).fit(X, Y)
    merges = [r["devices"] for r in m.history_ if r["event"] == "merge"]
    assert len(merges) >= 6
    for devices in merges:
        counts = np.array([d[share] for d in devices], dtype=float)
        assert [d["weight"] for d in devices] == pytest.approx(list(counts / counts.sum()))
    start = next(r for r in m.history_ if r["event"] == "start")
    assert start["algorithm_params"]["weight_by"] == weight_by


def test_auto_weight_by_follows_the_label_count():
    """``weight_by="auto"`` (the default): the shares of rows below :data:`AUTO_WEIGHTS_LABELS`
    labels, the paper's shares of updates from there on, whatever the loss; a value given
    stays; a config saved before the option keeps the paper's shares."""
    from xmc_engine import config
    from xmc_engine.config import AdaptiveConfig

    n = config.AUTO_WEIGHTS_LABELS
    c = AdaptiveConfig()
    assert c.weight_by == "auto"
    for loss in ("softmax", "bce"):
        assert c.resolved(n - 1, loss).weight_by == "samples"
        assert c.resolved(n, loss).weight_by == "updates"
    assert AdaptiveConfig(weight_by="samples").resolved(n, "bce").weight_by == "samples"
    assert AdaptiveConfig(weight_by="updates").resolved(10, "bce").weight_by == "updates"
    old = TrainConfig.from_saved({"algorithm": "adaptive", "algorithm_params": {}})
    assert old.algorithm_params.weight_by == "updates"
    assert TrainConfig.from_saved(TrainConfig(algorithm="adaptive").to_dict()
                                  ).algorithm_params.weight_by == "auto"


@pytest.mark.parametrize("threshold, loss, expected, per_item", [
    (10**9, "softmax", 0, True), (1, "softmax", 1, False), (10**9, "bce", 0, False)])
def test_run_log_records_the_resolved_merge_weights(small, monkeypatch, threshold, loss,
                                                     expected, per_item):
    from xmc_engine import config

    monkeypatch.setattr(config, "AUTO_WEIGHTS_LABELS", threshold)
    X, Y, _, _ = small
    m = XMCClassifier(epochs=0.5, algorithm="adaptive", devices="cpu,cpu@0.5",
                      loss=loss).fit(X, Y)
    start = next(r for r in m.history_ if r["event"] == "start")
    for key in ("weights_from_epoch", "row_weights", "label_weights"):
        assert start["config"]["algorithm_params"][key] == "auto"
    assert start["loss"] == loss
    assert start["algorithm_params"]["weights_from_epoch"] == expected
    assert start["algorithm_params"]["row_weights"] == (
        "sum_sqrt_unequal" if per_item else "updates")
    assert start["algorithm_params"]["label_weights"] == ("positives" if per_item else "updates")
    assert start["config"]["algorithm_params"]["weight_by"] == "auto"
    assert start["algorithm_params"]["weight_by"] == ("updates" if threshold == 1 else "samples")


def test_compile_kernels_logs_its_time_and_says_when_slow(small, monkeypatch, caplog):
    X, Y, _, _ = small
    cfg = TrainConfig(hidden=[16, 12], devices="cpu,cpu", algorithm="adaptive", threads=1,
                      loss="softmax")
    class FiresAtOnce(threading.Timer):
        """The notice's timer, firing when started (a real 0 s timer races the compile)."""

        def start(self):
            self.function(*self.args, **self.kwargs)

    monkeypatch.setattr(training.threading, "Timer", FiresAtOnce)
    log, report = RunLog(None), {}
    with caplog.at_level(logging.WARNING, logger="xmc_engine.training"):
        seconds = training.compile_kernels(cfg, parse_devices(cfg.devices), X, Y, log,
                                           report=report)
    assert [r["event"] for r in log.records] == ["compile"]
    assert log.records[0]["seconds"] == seconds >= 0.0
    assert log.records[0]["compiled"] == report["compiled"] >= 0
    # the notice is due at once; it is given if and only if something compiled
    noticed = any("compiling kernels" in r.getMessage() for r in caplog.records)
    assert noticed == (report["compiled"] > 0)


def test_compile_watch_counts_numbas_compilations_and_shows_a_bar(monkeypatch):
    """The count is of real compilations: a new function compiles once, a second call of the
    same types compiles nothing. Past the notice a progress bar counts them."""
    from numba import njit

    bars = []

    class Bar:
        def __init__(self, **kwargs):
            self.n, self.closed = 0, False
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    monkeypatch.setattr(training.progress, "bar", Bar)
    with training._CompileWatch() as watch:
        @njit
        def twice(x):
            return 2 * x

        assert twice(3) == 6 and twice(4) == 8
    assert watch.count == 1 and bars == []  # under COMPILE_NOTICE_S: no notice, no bar
    monkeypatch.setattr(training, "COMPILE_NOTICE_S", 0.0)
    with training._CompileWatch() as watch:
        assert watch._due.wait(5)
        assert twice(5) == 10  # compiled already: the time is up, but no notice
        assert not watch._noticed.is_set() and watch.count == 0

        @njit
        def thrice(x):
            return 3 * x

        assert thrice(2.0) == 6.0 and thrice(1) == 3  # a float and an int: two compilations
        assert watch._noticed.is_set()
    assert watch.count == 2 and len(bars) == 1 and bars[0].n == 2 and bars[0].closed


def test_compile_watch_says_nothing_when_nothing_compiles(monkeypatch, caplog):
    """A setup past COMPILE_NOTICE_S that compiles nothing (kernels from the cache or already
    loaded, as in a benchmark's later runs) gives no "compiling kernels" warning and no bar."""
    from numba import njit

    @njit
    def once(x):
        return x + 1

    assert once(1) == 2
    bars = []
    monkeypatch.setattr(training.progress, "bar", lambda **kw: bars.append(kw))
    monkeypatch.setattr(training, "COMPILE_NOTICE_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="xmc_engine.training"):
        with training._CompileWatch() as watch:
            assert watch._due.wait(5)
            assert once(2) == 3
    assert watch.count == 0 and watch.started == 0 and bars == []
    assert not any("compiling kernels" in r.getMessage() for r in caplog.records)


_COMPILE_CHECK = """
import importlib, json, pkgutil, sys
import xmc_engine.kernels as kernels
from xmc_engine import XMCClassifier, training
from xmc_engine.datasets import make_synthetic

def signatures():
    out = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module("xmc_engine.kernels." + info.name)
        for name, obj in vars(mod).items():
            if hasattr(obj, "signatures") and hasattr(obj, "py_func"):
                out[info.name + "." + name] = [str(s) for s in obj.signatures]
    return out

X, Y, Xt, Yt = make_synthetic(n_train=300, n_test=60, n_features=300, n_labels=40, seed=3)
real, seen = training.compile_kernels, {}
def spy(*args, **kwargs):
    seconds = real(*args, **kwargs)
    seen.update(signatures())
    return seconds
training.compile_kernels = spy
XMCClassifier(epochs=2, threads=1, seed=1, hidden=[24], devices=sys.argv[1],
              algorithm=sys.argv[2], loss=sys.argv[3]).fit(X, Y, eval_set=(Xt, Yt))
after = signatures()
print(json.dumps({"compiled": sum(map(len, seen.values())),
                  "new_in_training": {k: v for k, v in after.items() if v != seen.get(k)},
                  "signatures": after}))
"""


@pytest.mark.parametrize("devices,algorithm,loss", [
    ("cpu", "single", "auto"), ("cpu,cpu", "adaptive", "auto"), ("cpu,cpu", "sync", "auto"),
    # the softmax: adaptive's per-row merge with the sum of the changes on shared rows
    ("cpu,cpu", "adaptive", "softmax")])
def test_kernels_are_compiled_before_the_clock(devices, algorithm, loss):
    """Compilation (or loading from numba's cache) happens in ``compile_kernels``, before the
    training clock starts: in a fresh process, no kernel gains a compiled signature while the
    model trains and is evaluated (a kernel first compiled inside an epoch would count in
    ``train_time``). And only what the run calls is compiled, once: the gradient step only for
    ``sync`` (the one algorithm that steps by gradient), the forward kernel for one type of row
    pointers (training's gathered batches and prediction's SciPy rows alike), the dense Adagrad
    rule for one shape (flat)."""
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _COMPILE_CHECK, devices, algorithm, loss],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["compiled"] > 0
    assert out["new_in_training"] == {}
    assert len(out["signatures"]["sparse_forward.sparse_forward_cpu"]) == 1
    assert len(out["signatures"]["adagrad.adagrad_dense_cpu"]) <= 1  # weights and biases alike
    assert bool(out["signatures"]["train_step.grad_step_cpu"]) == (algorithm == "sync")


def test_the_estimators_defaults_are_the_configs():
    assert XMCClassifier().get_config() == TrainConfig()
