"""``AdaptiveConfig.solo_epochs``: the first device trains the first periods alone, then every
replica starts from its model and its Adagrad accumulators."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests._trainer import ListLog, make_trainer
from tests.test_sparse_merge import be, mlp, wide  # noqa: F401 - fixtures
from xmc_engine.config import AdaptiveConfig
from xmc_engine.devices import parse_devices
from xmc_engine.errors import ConfigError
from xmc_engine.scheduler import FakeReplica

SIM = {"mode": "simulated", "cost": lambda i, b: 1e-3 * b}


def _merges(log):
    return [f for e, f in log.records if e == "merge"]


def test_solo_epochs_auto_is_half_an_epoch_on_the_logistic_loss_of_a_small_set():
    """``'auto'`` (the default) resolves to :data:`AUTO_SOLO_EPOCHS` where the merge is the
    paper's weighted mean on the logistic loss below :data:`AUTO_WEIGHTS_LABELS` labels and
    :data:`AUTO_SOLO_MAX_ROWS` training rows, to 0 with the softmax, on larger label spaces
    and on more rows; a number given stays; a negative one or another string is refused."""
    from xmc_engine import config

    n = config.AUTO_WEIGHTS_LABELS
    c = AdaptiveConfig()
    assert c.solo_epochs == "auto" and config.AUTO_SOLO_EPOCHS == 0.5
    assert c.resolved(n - 1, "bce").solo_epochs == config.AUTO_SOLO_EPOCHS
    assert c.resolved(n - 1, "softmax").solo_epochs == 0.0
    assert c.resolved(n, "bce").solo_epochs == 0.0
    rows = config.AUTO_SOLO_MAX_ROWS
    assert c.resolved(n - 1, "bce", n_rows=rows - 1).solo_epochs == config.AUTO_SOLO_EPOCHS
    assert c.resolved(n - 1, "bce", n_rows=rows).solo_epochs == 0.0
    assert AdaptiveConfig(solo_epochs=0.25).resolved(n - 1, "softmax").solo_epochs == 0.25
    assert AdaptiveConfig(solo_epochs=0).resolved(n - 1, "bce").solo_epochs == 0
    with pytest.raises(ConfigError, match="solo_epochs must be >= 0"):
        AdaptiveConfig(solo_epochs=-0.5)
    with pytest.raises(ConfigError, match="solo_epochs must be a number of epochs"):
        AdaptiveConfig(solo_epochs="half")


@pytest.mark.parametrize("read", [True, False])
def test_the_solo_phase_is_one_device_s_run_then_every_replica_starts_from_it(be, wide,  # noqa: F811
                                                                              read):
    """The periods that start before ``solo_epochs`` are trained by device 0 alone, whose
    model after them is exactly a one-device run's over the same rows; the first period after
    them starts every replica from that model and its Adagrad accumulators (whether or not the
    central model was read in between, which catches it up), and from then on every device
    trains and the step rule adapts the batches."""
    X, Y = wide
    n = X.shape[0]  # 400 rows, periods of 128: periods 0 and 1 start before 0.5 epochs
    common = dict(lr=0.1, batch_size=32, warmup_epochs=0, lr_decay=0, merge_period=128, seed=3,
                  **SIM)
    single = [mlp(be, X, Y, optimizer="adagrad")]
    with make_trainer(single, parse_devices("cpu"), "single", n, **common) as tr:
        tr.run_epoch(0, stop_after=256)
        alone = [np.array(p) for p in tr.central_params()]
    reps = [mlp(be, X, Y, optimizer="adagrad") for _ in range(2)]
    log = ListLog()
    with make_trainer(reps, parse_devices("cpu,cpu@0.5", cores=2), "adaptive", n,
                      solo_epochs=0.5, log=log, **common) as tr:
        tr.run_epoch(0, stop_after=256)
        for a, b in zip(tr.central_params() if read else reps[0].params(), alone, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
        acc0 = [np.array(a) for a in reps[0].accumulators()]
        assert not np.array_equal(acc0[0], np.array(reps[1].accumulators()[0]))
        state = tr.state_dict()["policy"]
        assert state["solo_last"] == 0
        # a run resumed here still hands device 0's accumulators to the others
        again = [mlp(be, X, Y, optimizer="adagrad") for _ in range(2)]
        with make_trainer(again, parse_devices("cpu,cpu@0.5", cores=2), "adaptive", n,
                          solo_epochs=0.5, **common) as resumed:
            for dst, src in zip(again[0].accumulators(), acc0, strict=True):
                dst[...] = src
            resumed.policy.load_state_dict(json.loads(json.dumps(state)))
            assert resumed.policy.solo_device(again, 256 / n, [True, True]) is None
            for a, b in zip(again[1].accumulators(), acc0, strict=True):
                np.testing.assert_array_equal(np.asarray(a), b)
        tr.policy.solo_device(reps, 256 / n, [True, True])  # the first period after the phase
        for a, b in zip(reps[1].params(), alone, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
        for a, b in zip(tr.policy.central, alone, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
        for a, b in zip(reps[1].accumulators(), acc0, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
        tr.run_epoch(0)
        tr.run_epoch(1)
    merges = _merges(log)
    solo, rest = merges[:2], merges[2:]
    for m in solo:
        assert m["solo"] == 0 and [d["samples"] for d in m["devices"]][1] == 0
        assert [d["weight"] for d in m["devices"]] == [1.0, 0.0]
    assert len(rest) >= 4 and all("solo" not in m for m in rest)
    assert all(min(d["samples"] for d in m["devices"]) > 0 for m in rest)
    assert len({d["batch_size"] for d in rest[-1]["devices"]}) == 2  # the step rule went on


def test_without_solo_epochs_every_device_trains_from_the_first_period(be, wide):  # noqa: F811
    X, Y = wide
    log = ListLog()
    reps = [mlp(be, X, Y, optimizer="adagrad") for _ in range(2)]
    with make_trainer(reps, parse_devices("cpu,cpu@0.5", cores=2), "adaptive", X.shape[0],
                      lr=0.1, batch_size=32, warmup_epochs=0, lr_decay=0, merge_period=128,
                      seed=3, log=log, **SIM) as tr:
        tr.run_epoch(0)
    assert all(min(d["samples"] for d in m["devices"]) > 0 and "solo" not in m
               for m in _merges(log))


@pytest.mark.parametrize("read", [True, False])
def test_a_device_that_fails_alone_hands_the_solo_phase_to_the_next(read):
    """The solo device fails in the second of its periods: its rows go back, and the next live
    device trains the rest of the phase alone, starting from the central model as it was last
    brought up to date: with the model read after the first period (an evaluation), that
    period's model; without, the initial one (the centre catches up only where read). No row
    tracking here: the catch-up copies the replica whole."""
    n = 256  # periods of 64 rows, batches of 32: two steps a period; the phase: 0.5 epochs
    reps = [FakeReplica(n, sleep=False, seed=0, fail_at_step=3),
            FakeReplica(n, sleep=False, seed=0), FakeReplica(n, sleep=False, seed=0)]
    log = ListLog()
    with make_trainer(reps, parse_devices("cpu,cpu@0.5,cpu@0.25", cores=2), "adaptive", n,
                      lr=0.1, batch_size=32, warmup_epochs=0, lr_decay=0, merge_period=64,
                      solo_epochs=0.5, seed=1, log=log, **SIM) as tr:
        w = [np.array(p) for p in tr.central_params()]
        tr.run_epoch(0, stop_after=64)
        if read:
            first = [np.array(p) for p in tr.central_params()]
        tr.run_epoch(0, stop_after=128)
        central = [np.array(p) for p in tr.central_params()]
        tr.run_epoch(0)
    merges = _merges(log)
    assert [m.get("solo") for m in merges[:3]] == [0, 0, 1]
    assert [d["weight"] for d in merges[1]["devices"]] == [0.0] * 3  # the failed period
    assert all("solo" not in m and m["devices"][2]["samples"] > 0 for m in merges[3:])
    # device 1's two steps of the period it trained alone, after device 0's two of period 0
    # where the centre had caught up with them
    assert len(reps[1].history) > 2 and len(reps[2].history) > 0
    for rows, lr in (reps[0].history[:2] if read else []) + reps[1].history[:2]:
        for p, t in zip(w, reps[1]._targets, strict=True):
            p -= lr * (p - t[rows].mean(axis=0))
    for a, b in zip(central, w, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    if read:
        assert not all(np.array_equal(a, b) for a, b in zip(first, central, strict=True))


@pytest.mark.parametrize("loss, solo", [("bce", True), ("softmax", False)])
def test_a_default_adaptive_fit_trains_the_first_half_epoch_on_one_device(loss, solo):
    """With every default, ``adaptive`` on the logistic loss starts with device 0 alone (the
    start record says 0.5 epochs), with the softmax on every device at once."""
    from tests.test_estimator import tiny_data
    from xmc_engine import XMCClassifier

    X, Y = tiny_data(n=600, n_features=300)
    clf = XMCClassifier(epochs=1, devices="cpu,cpu@0.5", algorithm="adaptive", loss=loss,
                        batch_size=32, algorithm_params={"merge_period": 128}, seed=0)
    clf.fit(X, Y)
    start = next(r for r in clf.history_ if r.get("event") == "start")
    assert start["algorithm_params"]["solo_epochs"] == (0.5 if solo else 0.0)
    merges = [r for r in clf.history_ if r.get("event") == "merge"]
    alone = [m for m in merges if "solo" in m]
    assert all(m["solo"] == 0 and m["devices"][1]["samples"] == 0 for m in alone)
    # periods of 128 of 600 rows: those starting at 0, 128 and 256 (< 300) train alone
    assert [m["period"] for m in alone] == ([0, 1, 2] if solo else [])
    assert len(merges) >= 4


def test_fixed_shards_have_no_solo_phase():
    """With ``assignment="fixed"`` (each device its own rows, the single-process stand-in of a
    multi-node run) no period goes to one device alone: the others' shards would wait."""
    n = 256
    reps = [FakeReplica(n, sleep=False, seed=0), FakeReplica(n, sleep=False, seed=0)]
    log = ListLog()
    with make_trainer(reps, parse_devices("cpu,cpu", cores=2), "adaptive", n, lr=0.1,
                      batch_size=32, warmup_epochs=0, lr_decay=0, merge_period=64,
                      solo_epochs=0.5, seed=1, log=log, assignment="fixed", **SIM) as tr:
        tr.run_epoch(0)
    merges = _merges(log)
    assert len(merges) >= 2 and all("solo" not in m for m in merges)
    assert all(min(d["samples"] for d in m["devices"]) > 0 for m in merges)


@pytest.mark.parametrize("step, logged", [(0, 0), (1, 1), (3, 2)])
def test_a_solo_device_gone_non_finite_stops_the_run(step, logged):
    """Alone, a device whose parameters went NaN has no replica to fall back on: the run stops
    with ``DivergenceError``, as one device's does, at the barrier whose period loss says so:
    the first where NaN came at the first of its two steps, the second where it came at the
    last (whose loss was computed before), after one logged merge; where it came at the last
    step of the phase, the central model's catch-up at the phase's end finds it."""
    from xmc_engine.errors import DivergenceError

    n = 256
    reps = [FakeReplica(n, sleep=False, seed=0, nan_at_step=step),
            FakeReplica(n, sleep=False, seed=0)]
    log = ListLog()
    with make_trainer(reps, parse_devices("cpu,cpu@0.5", cores=2), "adaptive", n, lr=0.1,
                      batch_size=32, warmup_epochs=0, lr_decay=0, merge_period=64,
                      solo_epochs=0.5, seed=1, log=log, **SIM) as tr:
        with pytest.raises(DivergenceError, match="device 0, training alone"):
            tr.run_epoch(0)
    assert len(_merges(log)) == logged


def test_a_fit_that_ends_in_the_solo_phase_returns_the_solo_device_s_model():
    """The central model catches up with the solo device at every read, the fitted model
    included: a fit whose epochs lie inside the phase returns one device's model (the same
    rows, batches and rates as ``single``), not the initial one the centre held."""
    from tests.test_estimator import tiny_data
    from xmc_engine import XMCClassifier

    X, Y = tiny_data(n=600, n_features=300)
    common = dict(epochs=1, loss="bce", batch_size=32, seed=0, eval_every=0)
    one = XMCClassifier(devices="cpu", threads=1, algorithm="single",
                        algorithm_params={"merge_period": 128}, **common).fit(X, Y)
    alone = XMCClassifier(devices="cpu,cpu@0.5", algorithm="adaptive",
                          algorithm_params={"merge_period": 128, "solo_epochs": 2.0},
                          **common).fit(X, Y)
    merges = [r for r in alone.history_ if r.get("event") == "merge"]
    assert merges and all(m.get("solo") == 0 for m in merges)
    for a, b in zip(alone.params_, one.params_, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
