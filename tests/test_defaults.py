"""The defaults' single source and what a run records of them: the learning rate each optimizer
gets when ``lr`` is unset, and kernel compilation kept out of the training clock."""

from __future__ import annotations

import logging

import pytest
from xmc_engine.datasets import make_synthetic

from xmc_engine import XMCClassifier, training
from xmc_engine.config import DEFAULT_LR, OPTIMIZERS, TrainConfig
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


def test_every_optimizer_has_a_default_lr_and_a_bad_lr_is_named():
    assert set(DEFAULT_LR) == set(OPTIMIZERS)
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


def test_compile_kernels_logs_its_time_and_says_when_slow(small, monkeypatch, caplog):
    X, Y, _, _ = small
    cfg = TrainConfig(hidden=[16, 12], devices="cpu,cpu", algorithm="adaptive", threads=1)
    monkeypatch.setattr(training, "COMPILE_NOTICE_S", 0.0)
    log = RunLog(None)
    with caplog.at_level(logging.WARNING, logger="xmc_engine.training"):
        seconds = training.compile_kernels(cfg, parse_devices(cfg.devices), X, Y, log)
    assert [r["event"] for r in log.records] == ["compile"]
    assert log.records[0]["seconds"] == seconds >= 0.0
    assert any("compiling kernels" in r.getMessage() for r in caplog.records)


def test_compiled_before_the_clock_the_first_epoch_is_not_slower(small):
    """Kernels compiled (or loaded) outside ``train_time``: the first of three equal epochs
    takes no more than twice the mean of the other two (compiling would add seconds)."""
    X, Y, Xt, Yt = small
    m = XMCClassifier(epochs=3, threads=1, seed=1).fit(X, Y, eval_set=(Xt, Yt))
    t = [r["train_time"] for r in m.history_ if r["event"] == "eval"]
    first, rest = t[0], (t[2] - t[0]) / 2
    assert first <= 2 * rest + 0.05, t


def test_the_estimators_defaults_are_the_configs():
    assert XMCClassifier().get_config() == TrainConfig()
