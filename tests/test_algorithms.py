"""Algorithm configs (JSON round trip, validation), the registry, and the policies' merges."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from xmc_engine.algorithms import POLICIES, AdaptiveSGD, ModelAveraging, get_algorithm
from xmc_engine.config import ALGORITHMS, AdaptiveConfig, AverageConfig, TrainConfig
from xmc_engine.errors import ConfigError, DivergenceError
from xmc_engine.scheduler import MergeContext
from xmc_engine.scheduler.replica import FakeReplica, HostBackend


@pytest.mark.parametrize("cls", [AdaptiveConfig, AverageConfig])
def test_config_json_round_trip(cls):
    c = cls()
    assert cls.from_json(c.to_json()) == c
    d = json.loads(c.to_json())
    d["merge_period"] = 4096
    assert cls.from_dict(d).merge_period == 4096


def test_config_errors():
    with pytest.raises(ConfigError, match="unknown key.*mergeperiod"):
        AdaptiveConfig.from_dict({"mergeperiod": 5})
    with pytest.raises(ConfigError, match="momentum"):
        AdaptiveConfig.from_dict({"momentum": "high"})
    with pytest.raises(ConfigError, match="momentum"):
        AdaptiveConfig(momentum=1.0)
    with pytest.raises(ConfigError, match="rule"):
        AdaptiveConfig(rule="magic")
    with pytest.raises(ConfigError, match="flag_rule"):
        AdaptiveConfig(flag_rule="sometimes")
    for name in ("row_weights", "label_weights", "optimizer_state", "lr_scaling", "weight_by"):
        with pytest.raises(ConfigError, match=f"{name} must be one of .*got 'bogus'"):
            AdaptiveConfig(**{name: "bogus"})
    with pytest.raises(ConfigError, match="b_min"):
        AdaptiveConfig(b_min=64, b_max=32)
    with pytest.raises(ConfigError, match="boost"):
        AdaptiveConfig.from_dict({"boost": 1})
    with pytest.raises(ConfigError, match="JSON"):
        AdaptiveConfig.from_json("{not json")
    with pytest.raises(ConfigError, match="unknown key.*warmup_epochs"):
        AdaptiveConfig.from_dict({"warmup_epochs": 2})  # the run's schedule, one place


def test_registry():
    assert POLICIES.keys() == ALGORITHMS.keys()
    for name, cls in POLICIES.items():
        assert cls.name == name and isinstance(get_algorithm(name).config, ALGORITHMS[name])
    a = get_algorithm("adaptive", merge_period=1000)
    assert isinstance(a, AdaptiveSGD) and a.period_samples(2, 128) == 1000 and not a.static
    b = get_algorithm("average", {"merge_period": 32})
    assert isinstance(b, ModelAveraging) and b.static and b.config.merge_period == 32
    c = get_algorithm("adaptive", AdaptiveConfig(momentum=0.0), rule="proportional")
    assert c.config.momentum == 0.0 and c.config.rule == "proportional"
    with pytest.raises(ConfigError, match="unknown algorithm"):
        get_algorithm("sgd")
    with pytest.raises(ConfigError, match="unknown key"):
        get_algorithm("average", momentum=0.9)
    with pytest.raises(ConfigError):
        get_algorithm("average", AdaptiveConfig())


def fakes(n, n_samples=100):
    reps = [FakeReplica(n_samples, sleep=False, seed=s) for s in range(n)]
    return reps


def setup(pol, reps, batch_size=128, warmup_epochs=1.0):
    pol.setup(reps, n_samples=100, batch_size=batch_size, merge_period=4096,
              warmup_epochs=warmup_epochs)


def set_all(reps, seed):
    rng = np.random.default_rng(seed)
    vals = []
    for r in reps:
        v = [rng.standard_normal(a.shape) for a in r.params()]
        r.set_params(v)
        vals.append(v)
    return vals


def test_adaptive_merge_weights_and_broadcast():
    reps = fakes(3)
    pol = get_algorithm("adaptive", momentum=0.0, boost=False)
    setup(pol, reps)
    vals = set_all(reps, 1)
    info = pol.merge(reps, [3, 2, 1], MergeContext())
    p = np.array([3, 2, 1]) / 6
    assert info["weights"] == pytest.approx(list(p))
    for k, a in enumerate(pol.central_params()):
        np.testing.assert_allclose(a, sum(p[i] * vals[i][k] for i in range(3)))
        for r in reps:
            np.testing.assert_array_equal(r.params()[k], a)


def test_adaptive_merge_boost_always():
    reps = fakes(3)
    pol = get_algorithm("adaptive", momentum=0.0, boost=True, flag_rule="always")
    setup(pol, reps)
    set_all(reps, 1)
    info = pol.merge(reps, [3, 2, 1], MergeContext())
    q = np.array([3 * 1.1, 2, 0.9]) / 6
    assert info["weights"] == pytest.approx(list(q / q.sum())) and info["flag"] == 1


def test_adaptive_merge_weights_by_default_are_the_shares_of_updates():
    """No adaptive normalization by default (``boost=False``, bench/RESULTS.md "Adaptive SGD
    with defaults"): the weights are ``c_i / sum c`` even while the norm rises."""
    reps = fakes(3)
    pol = get_algorithm("adaptive", momentum=0.0, flag_rule="always")
    setup(pol, reps)
    set_all(reps, 1)
    info = pol.merge(reps, [3, 2, 1], MergeContext())
    assert info["weights"] == pytest.approx([0.5, 2 / 6, 1 / 6]) and info["flag"] == 0


def test_adaptive_merge_weights_are_the_shares_of_samples_by_default():
    """``weight_by="samples"`` (the default below 200,000 labels): ``p_i`` is device ``i``'s share
    of the rows the period trained on, where the trainer counted them (``ctx.samples``);
    ``"updates"`` is the paper's share of updates; a merge called without sample counts falls
    back to the updates."""
    for weight_by, expected in (("samples", [300 / 800, 400 / 800, 100 / 800]),
                                ("updates", [3 / 6, 2 / 6, 1 / 6])):
        reps = fakes(3)
        pol = get_algorithm("adaptive", weight_by=weight_by)
        setup(pol, reps)
        vals = set_all(reps, 4)
        info = pol.merge(reps, [3, 2, 1], MergeContext(samples=[300, 400, 100]))
        assert info["weights"] == pytest.approx(expected)
        for k, a in enumerate(pol.central_params()):
            np.testing.assert_allclose(a, sum(expected[i] * vals[i][k] for i in range(3)))
    assert AdaptiveConfig().weight_by == "auto"  # "samples" at this size (test_defaults)
    pol = get_algorithm("adaptive")
    reps = fakes(2)
    setup(pol, reps)
    set_all(reps, 5)
    assert pol.merge(reps, [3, 1], MergeContext())["weights"] == pytest.approx([0.75, 0.25])
    # a device left out (failed) gets weight 0 whatever it counted
    reps = fakes(3)
    setup(pol, reps)
    set_all(reps, 6)
    info = pol.merge(reps, [1, 1, 1], MergeContext(excluded={2}, samples=[30, 10, 60]))
    assert info["weights"] == pytest.approx([0.75, 0.25, 0.0])


def test_adaptive_momentum_recursion():
    mu = 0.5
    reps = fakes(2)
    pol = get_algorithm("adaptive", momentum=mu, boost=False)
    z0 = [a.copy() for a in reps[0].params()]
    setup(pol, reps)
    hist = [z0, z0]
    for t in range(4):
        vals = set_all(reps, 10 + t)
        pol.merge(reps, [1, 3], MergeContext())
        wbar = [0.25 * a + 0.75 * b for a, b in zip(vals[0], vals[1], strict=True)]
        expect = [w + mu * (z1 - z2) for w, z1, z2 in zip(wbar, hist[-1], hist[-2], strict=True)]
        for a, e in zip(pol.central_params(), expect, strict=True):
            np.testing.assert_allclose(a, e, rtol=1e-12)
        for r in reps:
            for a, e in zip(r.params(), expect, strict=True):
                np.testing.assert_allclose(a, e, rtol=1e-12)
        hist.append([a.copy() for a in pol.central_params()])


def test_nonfinite_replica_dropped_and_reset_all_nonfinite_raises():
    reps = fakes(3)
    pol = get_algorithm("adaptive", momentum=0.0, boost=False)
    setup(pol, reps)
    vals = set_all(reps, 2)
    reps[1].params()[0][0, 0] = np.nan
    info = pol.merge(reps, [1, 5, 1], MergeContext())
    assert info["nonfinite"] == [1] and info["weights"] == pytest.approx([0.5, 0.0, 0.5])
    np.testing.assert_allclose(reps[1].params()[1], 0.5 * (vals[0][1] + vals[2][1]))
    for r in reps:
        r.params()[1][0] = np.inf
    with pytest.raises(DivergenceError):
        pol.merge(reps, [1, 1, 1], MergeContext())


def test_average_merge_is_uniform():
    reps = fakes(4)
    pol = get_algorithm("average")
    setup(pol, reps)
    vals = set_all(reps, 3)
    info = pol.merge(reps, [9, 1, 1, 1], MergeContext())
    assert info["weights"] == pytest.approx([0.25] * 4)
    np.testing.assert_allclose(pol.central_params()[0], np.mean([v[0] for v in vals], axis=0))
    assert pol.batch_sizes() == [128] * 4
    assert pol.device_lrs(0.1) == [0.1] * 4


def test_adaptive_state_dict_round_trip():
    reps = fakes(2)
    pol = get_algorithm("adaptive", boost=True)  # the norm trend is kept only with the boost
    setup(pol, reps, warmup_epochs=0)
    pol.controller.batch_sizes = [160, 96]
    pol.trend.observe(1.0)
    pol.trend.observe(2.0)
    state = json.loads(json.dumps(pol.state_dict()))
    other = get_algorithm("adaptive", boost=True)
    setup(other, fakes(2), warmup_epochs=0)
    other.load_state_dict(state)
    assert other.batch_sizes() == [160, 96] and other.trend.flag == 1


def test_one_schedule_for_every_algorithm():
    """``lr_warmup_epochs`` / ``lr_decay`` are the run's schedule, whatever the algorithm;
    ``lr_warmup_epochs=None`` takes the algorithm's own warm-up (none, measured:
    ``bench/RESULTS.md``, "Defaults"), defined once on its options class."""
    for name in ALGORITHMS:
        cfg = TrainConfig(algorithm=name)
        assert cfg.warmup_epochs == ALGORITHMS[name].default_warmup_epochs == 0.0
        assert TrainConfig(algorithm=name, lr_warmup_epochs=0.25).warmup_epochs == 0.25
    with pytest.raises(ConfigError, match="lr_warmup_epochs"):
        TrainConfig(lr_warmup_epochs=-1.0)
    with pytest.raises(ConfigError, match="lr_decay: option.* of the run.*--lr-decay"):
        TrainConfig(algorithm="adaptive", algorithm_params={"lr_decay": 0.5})


def test_train_config_types_and_nested_options():
    cfg = TrainConfig.from_dict({"algorithm": "adaptive",
                                 "algorithm_params": {"merge_period": 2048}})
    assert isinstance(cfg.algorithm_params, AdaptiveConfig)
    assert cfg.algorithm_params.merge_period == 2048
    back = TrainConfig.from_json(cfg.to_json())
    assert back == cfg and back.to_dict()["algorithm_params"]["merge_period"] == 2048
    with pytest.raises(ConfigError, match="TrainConfig.lr must be a finite float"):
        TrainConfig.from_dict({"lr": "fast"})
    with pytest.raises(ConfigError, match="algorithm_params.*momentum must be a finite float"):
        TrainConfig.from_dict({"algorithm": "adaptive", "algorithm_params": {"momentum": "x"}})
    with pytest.raises(ConfigError, match="label_chunk"):
        TrainConfig(label_chunk=0)


def test_b_max_auto_is_four_base_batches():
    """``b_max="auto"`` (the default): the step rule stops raising the fastest device's batch,
    and with it its linearly scaled rate, at 4x the base batch; the paper's 1,024 given
    explicitly lets it go on. A device the rule keeps finding ahead (3 updates to 1) is capped."""
    from xmc_engine.config import AUTO_B_MAX_BATCHES

    c = AdaptiveConfig()
    assert c.b_max == "auto" and AUTO_B_MAX_BATCHES == 4
    assert c.b_max_for(64) == 256 and c.b_max_for(4) == c.b_min  # never below b_min
    assert AdaptiveConfig(b_max=1024).b_max_for(64) == 1024
    assert c.resolved(1000, "softmax").b_max == "auto"  # no batch: left for the policy
    assert c.resolved(1000, "bce", 128).b_max == 512
    assert c.resolved(1000, "softmax", 128).b_max == 512  # rows not known: batch_scale 1
    assert c.resolved(1000, "softmax", 128, n_rows=20_000).b_max == 1024  # base batch 256
    with pytest.raises(ConfigError, match="b_max must be a batch size or 'auto', got 'big'"):
        AdaptiveConfig(b_max="big")

    def grown(pol) -> list[int]:
        setup(pol, fakes(2), batch_size=64, warmup_epochs=0)
        for _ in range(40):
            pol.controller.update(1.0, [30, 10], [1, 1], [1, 1])
        return pol.batch_sizes()

    assert grown(get_algorithm("adaptive", batch_scale=1))[0] == 256
    assert grown(get_algorithm("adaptive", batch_scale=2))[0] == 512  # base batch 128
    assert grown(get_algorithm("adaptive", b_max=1024))[0] == 1024
    # a base batch above the paper's bound is not refused under "auto"
    pol = get_algorithm("adaptive", batch_scale=1)
    setup(pol, fakes(2), batch_size=2048)
    assert pol.controller.b_max == 8192


def test_batch_scale_auto_doubles_the_base_batch_with_the_softmax():
    """``batch_scale="auto"`` (the default): ``adaptive``'s base batch ``B`` is two run batches
    with the softmax below 200,000 labels (where the per-row weights apply) on at least 10,000
    training rows, one elsewhere; a
    number given is kept. ``B`` is what every device starts at, the batch whose rate is ``lr``,
    and ``b_max``'s unit; the config resolves it by the loss and the labels, the policy
    applies it."""
    from xmc_engine.config import AUTO_BATCH_SCALE_MIN_ROWS, AUTO_SOFTMAX_BATCH_SCALE

    c = AdaptiveConfig()
    assert c.batch_scale == "auto" and AUTO_SOFTMAX_BATCH_SCALE == 2
    n = AUTO_BATCH_SCALE_MIN_ROWS
    assert n == 10_000
    assert c.batch_scale_for(30_000, "softmax", n) == 2.0
    assert c.batch_scale_for(30_000, "softmax", n - 1) == 1.0  # too few rows
    assert c.batch_scale_for(30_000, "softmax") == 1.0  # rows not known
    assert c.batch_scale_for(30_000, "bce", n) == 1.0
    assert c.batch_scale_for(670_091, "softmax", n) == 1.0
    assert c.batch_scale_for(30_000, "auto", n) == 2.0  # not probed yet: the larger, to plan
    assert AdaptiveConfig(batch_scale=1).batch_scale_for(30_000, "softmax", n) == 1.0
    r = c.resolved(30_000, "softmax", 64, n_rows=n)
    assert (r.batch_scale, r.b_max, r.base_batch(64)) == (2.0, 512, 128)
    r = c.resolved(30_000, "bce", 64, n_rows=n)
    assert (r.batch_scale, r.b_max, r.base_batch(64)) == (1.0, 256, 64)
    once = c.resolved(30_000, "softmax", 64, n_rows=n)
    assert once == once.resolved(30_000, "softmax", 64, n_rows=n)  # fit_model, then the policy
    assert AdaptiveConfig(batch_scale=1.5).resolved(100, "softmax", 64).base_batch(64) == 96
    assert AdaptiveConfig(batch_scale=0.1).base_batch(64) == 32  # never below b_min
    with pytest.raises(ValueError, match="needs n_labels"):
        c.base_batch(64)
    with pytest.raises(ConfigError, match="batch_scale must be a number > 0 or 'auto'"):
        AdaptiveConfig(batch_scale="big")
    with pytest.raises(ConfigError, match="batch_scale must be > 0"):
        AdaptiveConfig(batch_scale=0)

    def started(pol, loss, n_samples=20_000) -> tuple[int, list[int], list[float]]:
        reps = fakes(2)
        for rep in reps:
            rep.loss = loss
        pol.setup(reps, n_samples=n_samples, batch_size=64, merge_period=4096, warmup_epochs=0)
        return pol.batch_size, pol.batch_sizes(), pol.device_lrs(0.05)

    assert started(get_algorithm("adaptive"), "softmax") == (128, [128, 128], [0.05, 0.05])
    assert started(get_algorithm("adaptive"), "bce") == (64, [64, 64], [0.05, 0.05])
    assert started(get_algorithm("adaptive", batch_scale=1), "softmax")[0] == 64
    assert started(get_algorithm("adaptive"), "softmax", n_samples=n - 1)[0] == 64
    # the memory plan counts the largest batch the scaled base allows
    from xmc_engine.memory import _max_batch

    cfg = TrainConfig(algorithm="adaptive", devices="cpu,cpu@0.5")
    assert _max_batch(cfg, 30_000, n) == 512 and _max_batch(cfg, 670_091, n) == 256
    assert _max_batch(cfg, 30_000, n - 1) == 256
    assert _max_batch(dataclasses.replace(cfg, loss="bce"), 30_000, n) == 256
    # a config saved before the option keeps the run's batch as the base batch
    old = TrainConfig.from_saved({"algorithm": "adaptive", "algorithm_params": {}})
    assert old.algorithm_params.batch_scale == 1
    assert TrainConfig.from_saved(cfg.to_dict()).algorithm_params.batch_scale == "auto"
    assert TrainConfig.from_dict({"algorithm": "adaptive", "algorithm_params": {
        "batch_scale": 1.5}}).algorithm_params.batch_scale == 1.5


def test_merge_period_auto_follows_the_row_weights():
    """``merge_period="auto"`` (the default): 1,024 samples where a ``W1`` row's weights are
    renormalized over the replicas that touched it (the softmax below 200,000 labels), 4,096
    with the paper's weights (the logistic loss, or from 200,000 labels on, or where the
    row-sparse merge is off); a number given is kept. A trainer built directly resolves it
    before its queue is made."""
    from tests._trainer import make_trainer
    from xmc_engine.config import AUTO_MERGE_PERIOD_PAPER_WEIGHTS, AUTO_MERGE_PERIOD_TOUCHED

    c = AdaptiveConfig()
    assert c.merge_period == "auto"
    assert (AUTO_MERGE_PERIOD_TOUCHED, AUTO_MERGE_PERIOD_PAPER_WEIGHTS) == (1024, 4096)
    assert c.resolved(30_000, "softmax").merge_period == 1024
    assert c.resolved(30_000, "bce").merge_period == 4096
    assert c.resolved(670_091, "softmax").merge_period == 4096
    assert AdaptiveConfig(row_weights="updates").resolved(1000, "softmax").merge_period == 4096
    assert AdaptiveConfig(row_weights="touched").resolved(1000, "bce").merge_period == 1024
    assert AdaptiveConfig(momentum=0.5).resolved(1000, "softmax").merge_period == 4096
    assert AdaptiveConfig(merge_period=2048).resolved(1000, "softmax").merge_period == 2048
    with pytest.raises(ConfigError, match="merge_period must be a number of samples or 'auto'"):
        AdaptiveConfig(merge_period="short")
    with pytest.raises(ConfigError, match="merge_period"):
        AdaptiveConfig(merge_period=0)

    # without row tracking (a GPU's backend) the touched weights cannot apply: the paper's period
    assert c.resolved(1000, "softmax", tracks_rows=False).merge_period == 4096

    class Tracking(HostBackend):
        tracks_rows = True

    def period(reps) -> int:
        with make_trainer(reps, None, "adaptive", 5000, batch_size=64, mode="simulated") as tr:
            assert tr.policy.config.merge_period == tr.queue.merge_period
            return tr.queue.merge_period

    reps = fakes(2, n_samples=5000)  # no loss attribute: the softmax, 3 labels
    assert period(reps) == 4096  # fakes track no rows
    for r in reps:
        r.backend = Tracking()
    assert period(reps) == 1024
    for r in reps:
        r.loss = "bce"
    assert period(reps) == 4096
