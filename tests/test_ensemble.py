"""``TrainConfig.ensemble``: several networks trained one after the other and combined into one
network whose logits are the mean of theirs (``model.combine_members``,
``training._fit_ensemble``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp

from tests._helpers import final_record, run_cli, write_tiny_xc
from tests.test_estimator import tiny_data
from xmc_engine import XMCClassifier
from xmc_engine.errors import CheckpointError, ConfigError
from xmc_engine.model import ModelShape, combine_members, fitted_hidden, init_params


def _logits(params, X):
    """The network's logits on the host: ``relu`` after every hidden layer."""
    H = X
    for k in range((len(params) - 2) // 2):
        H = np.maximum(H @ params[2 * k] + params[2 * k + 1], 0.0)
    return H @ params[-2] + params[-1]


@pytest.mark.parametrize("hidden", [(6,), (5, 4), (3, 4, 2)])
def test_the_combined_network_computes_the_mean_of_the_members_logits(hidden):
    shape = ModelShape(20, 7, hidden)
    rng = np.random.default_rng(0)
    members = []
    for seed in range(3):
        params = init_params(shape, seed)
        for p in params:  # biases not zero, so that their combination is checked too
            p += rng.normal(size=p.shape).astype(np.float32) * 0.3
        members.append(params)
    combined = combine_members(members)
    assert fitted_hidden(combined) == tuple(3 * h for h in hidden)
    assert [p.dtype for p in combined] == [np.float32] * len(combined)
    X = rng.normal(size=(11, 20)).astype(np.float32)
    want = np.mean([_logits(m, X) for m in members], axis=0)
    np.testing.assert_allclose(_logits(combined, X), want, rtol=1e-5, atol=1e-5)
    # one member is that member
    for a, b in zip(combine_members(members[:1]), members[0], strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_ensemble_is_its_members_runs_combined():
    """``ensemble=2`` trains exactly the runs of ``seed`` and of ``member_seed(seed, 1)``
    with every other setting, and its model is their combination."""
    from xmc_engine.training import member_seed

    X, Y = tiny_data(n=400)
    kw = dict(hidden=[8], epochs=2, threads=1, loss="softmax", eval_every=0)
    ens = XMCClassifier(ensemble=2, seed=3, **kw).fit(X[:300], Y[:300], (X[300:], Y[300:]))
    assert member_seed(3, 0) == 3 and member_seed(3, 1) not in (3, member_seed(4, 1))
    runs = [XMCClassifier(seed=member_seed(3, j), **kw).fit(X[:300], Y[:300]) for j in (0, 1)]
    for a, b in zip(ens.params_, combine_members([r.params_ for r in runs]), strict=True):
        np.testing.assert_array_equal(a, b)
    # the reported metrics are the combined network's
    assert ens.metrics_["P@1"] == pytest.approx(ens.score(X[300:], Y[300:]))
    assert ens.metrics_["P@5"] == pytest.approx(ens.score(X[300:], Y[300:], metric="P@5"))
    rec = next(r for r in ens.history_ if r["event"] == "ensemble")
    assert rec["members"] == 2 and rec["hidden"] == [16]
    assert rec["seeds"] == [3, member_seed(3, 1)]
    assert rec["metrics"]["P@1"] == ens.metrics_["P@1"]
    final = final_record(ens.history_)
    assert final["event"] == "final" and final["status"] == "ensemble"
    starts = [r for r in ens.history_ if r["event"] == "start"]
    assert [s["config"]["seed"] for s in starts] == [3, member_seed(3, 1)]


def test_the_members_share_the_probed_loss_and_the_time_budget(monkeypatch):
    from xmc_engine import training

    seen = []
    real = training.fit_model

    def spy(cfg, *a, **kw):
        if cfg.ensemble == 1 and kw.get("progress_desc", "").startswith("train "):
            seen.append(cfg)
        return real(cfg, *a, **kw)

    monkeypatch.setattr(training, "fit_model", spy)
    X, Y = tiny_data(n=2400)
    XMCClassifier(ensemble=3, hidden=[4], epochs=1, threads=1, max_train_seconds=60,
                  eval_every=0).fit(X, Y)
    assert len(seen) == 3
    assert seen[0].loss == "auto" and seen[1].loss == seen[2].loss != "auto"
    assert [c.max_train_seconds for c in seen] == [20, 20, 20]


def test_save_and_load_keep_the_combined_network(tmp_path):
    X, Y = tiny_data(n=300)
    m = XMCClassifier(ensemble=2, hidden=[8], epochs=1, threads=1, loss="bce").fit(X, Y)
    path = m.save(tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    assert config["fitted_hidden"] == [16] and config["train_config"]["hidden"] == [8]
    back = XMCClassifier.load(path)
    np.testing.assert_array_equal(back.predict_topk(X)[0], m.predict_topk(X)[0])
    np.testing.assert_allclose(back.predict_proba(X, k=3).toarray(),
                               m.predict_proba(X, k=3).toarray(), rtol=1e-6)
    config["fitted_hidden"] = [0]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="fitted_hidden"):
        XMCClassifier.load(path)


@pytest.mark.parametrize("threads", [1, None], ids=["in-turn", "side-by-side"])
def test_each_member_keeps_its_log_and_a_resumed_ensemble_trains_nothing_twice(tmp_path,
                                                                               threads):
    """(``threads=None``: the budget calibrated, one thread on so short a run, and the members
    side by side where the machine has two cores.)"""
    X, Y = tiny_data(n=300)
    kw = dict(ensemble=2, hidden=[8], epochs=2, threads=threads, loss="softmax",
              log_dir=tmp_path / "run", checkpoint_every=300)
    m = XMCClassifier(**kw).fit(X, Y, (X, Y))
    for j in (0, 1):
        events = [json.loads(line)["event"]
                  for line in (tmp_path / "run" / f"member-{j}" / "log.jsonl").open()]
        assert events[0] == "start" and events[-1] == "final"
    top = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").open()]
    assert [r["event"] for r in top] == ["ensemble", "final"]
    assert top[0]["lanes"] == (2 if threads is None and _cores() >= 2 else 1)
    again = XMCClassifier(**kw).fit(X, Y, (X, Y), resume=True)
    for a, b in zip(again.params_, m.params_, strict=True):
        np.testing.assert_array_equal(a, b)
    assert (final_record(again.history_)["samples"] == final_record(m.history_)["samples"]
            == 2 * 2 * 300)


def test_the_memory_plan_counts_the_members():
    from xmc_engine.memory import plan_for_data

    X, Y = tiny_data(n=300)
    plan = plan_for_data(XMCClassifier(ensemble=3).get_config(), X, Y)
    items = next(p for p in plan.pools if p.name == "host").items
    key = next(k for k in items if k.startswith("ensemble"))
    assert "5 x P" in key and items[key] > 0


def test_bad_ensemble_sizes_are_refused():
    with pytest.raises(ConfigError, match="ensemble"):
        XMCClassifier(ensemble=0).get_config()
    X = sp.random(30, 10, density=0.3, format="csr", random_state=0)
    with pytest.raises(ConfigError, match="ensemble"):
        XMCClassifier(ensemble=0).fit(X, X)


def test_the_cli_trains_an_ensemble_and_says_so(tmp_path):
    data = write_tiny_xc(tmp_path / "data", n=400, n_train=300)
    out = run_cli("train", "--data", data, "--hidden", 8, "--epochs", 1, "--threads", 1,
                  "--ensemble", 2, "--out", tmp_path / "run").stdout
    line = next(x for x in out.splitlines() if x.startswith("ensemble:"))
    assert "2 networks combined into one of hidden 16; each alone P@1 " in line, line
    assert (tmp_path / "run" / "member-1" / "log.jsonl").exists()
    assert (tmp_path / "run" / "curves.png").exists()
    if _cores() >= 2:  # the thread budget calibrated (one thread on so short a run)
        out = run_cli("train", "--data", data, "--hidden", 8, "--epochs", 1, "--ensemble", 2,
                      "--out", tmp_path / "side").stdout
        line = next(x for x in out.splitlines() if x.startswith("ensemble:"))
        assert "of hidden 16, trained 2 at a time; each alone P@1 " in line, line


def test_the_plan_command_counts_an_ensemble(tmp_path):
    data = write_tiny_xc(tmp_path / "data", n=400, n_train=300)
    out = run_cli("plan", "--data", data, "--ensemble", 3).stdout
    assert "ensemble: the other members and the combined network (5 x P)" in out, out


def test_the_members_reuse_the_first_ones_thread_budget():
    """The first member calibrates its CPU thread budget (or keeps one thread on a run too
    short to time it); the others take it instead of calibrating again."""
    from xmc_engine.devices import parse_devices

    if parse_devices("cpu")[0].threads < 2:
        pytest.skip("one CPU thread here: no budget to calibrate")
    X, Y = tiny_data(n=300)
    m = XMCClassifier(ensemble=3, hidden=[8], epochs=1, loss="softmax").fit(X, Y)
    recs = [r for r in m.history_ if r["event"] == "threads"]
    assert len(recs) == 3
    assert "first member" not in recs[0]["note"]
    assert all(r["note"] == "by the ensemble's first member (its record says how)"
               and r["threads"] == recs[0]["threads"] for r in recs[1:])


def test_an_ensemble_refused_before_training_leaves_no_run_behind(tmp_path):
    """A setting refused inside the first member's fit (the plateau rule on too few rows)
    exits with status 2, and the run folder keeps neither its files nor the member's
    folder."""
    data = write_tiny_xc(tmp_path / "data", n=12, n_train=9)
    run = tmp_path / "run"
    bad = run_cli("train", "--data", data, "--hidden", 4, "--epochs", 1, "--ensemble", 2,
                  "--lr-decay", "plateau", "--out", run, check=False)
    assert bad.returncode == 2 and "too few" in bad.stderr, bad.stderr
    assert not (run / "run.json").exists() and not (run / "member-0").exists()


def test_the_cli_resumes_every_member(tmp_path):
    """A finished ensemble made longer in its run file: ``--resume`` takes each member on
    from its last checkpoint."""
    data = write_tiny_xc(tmp_path / "data", n=400, n_train=300)
    run = tmp_path / "run"
    run_cli("train", "--data", data, "--hidden", 8, "--epochs", 2, "--threads", 1,
            "--ensemble", 2, "--out", run, "--checkpoint-every", 100)
    run_json = json.loads((run / "run.json").read_text())
    run_json["config"]["epochs"] = 3
    (run / "run.json").write_text(json.dumps(run_json))
    assert "ensemble: 2 networks" in run_cli("train", "--resume", run).stdout
    for j in (0, 1):
        log = [json.loads(x) for x in (run / f"member-{j}" / "log.jsonl").open()]
        starts = [r for r in log if r["event"] == "start"]
        assert len(starts) == 2 and starts[1]["resumed"] and starts[1]["samples"] == 600
        assert log[-1]["event"] == "final" and log[-1]["samples"] == 900
    top = [json.loads(x) for x in (run / "log.jsonl").open()]
    assert [r["event"] for r in top] == ["ensemble", "final"] * 2
    assert top[-1]["samples"] == 1800


def test_the_plot_labels_the_combination():
    from pathlib import Path

    from xmc_engine.plots import _run_label

    assert _run_label(Path("runs/r"), [{"event": "ensemble", "members": 3}]) == \
        "r (ensemble of 3)"


def test_an_ensemble_that_does_not_fit_is_refused_before_training(monkeypatch):
    """The memory check counts the members' copies: with a budget between one network's plan
    and the ensemble's, one network trains and the ensemble is refused before any member."""
    from xmc_engine.errors import MemoryPlanError
    from xmc_engine.memory import plan_for_data

    X, Y = tiny_data(n=300)
    kw = dict(hidden=[64], epochs=1, threads=1, loss="softmax", output="exact")

    def host(ensemble):
        plan = plan_for_data(XMCClassifier(ensemble=ensemble, **kw).get_config(), X, Y)
        return next(p for p in plan.pools if p.name == "host").total

    one, many = host(1), host(40)
    assert many > one
    monkeypatch.setenv("XMC_MEMORY_BUDGET", str((one + many) // 2))
    XMCClassifier(**kw).fit(X, Y)
    with pytest.raises(MemoryPlanError, match="ensemble"):
        XMCClassifier(ensemble=40, **kw).fit(X, Y)


def _cores() -> int:
    from xmc_engine.devices import parse_devices

    return parse_devices("cpu")[0].threads


def test_members_train_side_by_side_where_one_thread_won():
    """On a run too short to time the thread budgets (one thread, untimed) the members train
    a core each, side by side, and the ensemble is the combination of each member's run on
    one thread (a summation order may differ in the last bits: not bitwise)."""
    from xmc_engine.training import member_seed

    if _cores() < 2:
        pytest.skip("one CPU core here: members cannot train side by side")
    X, Y = tiny_data(n=1200)
    kw = dict(hidden=[8], epochs=2, loss="softmax", eval_every=0)
    ens = XMCClassifier(ensemble=3, seed=5, **kw).fit(X, Y)
    rec = next(r for r in ens.history_ if r["event"] == "ensemble")
    assert rec["lanes"] == min(3, _cores())
    assert [r["threads"] for r in ens.history_ if r["event"] == "threads"] == [1, 1, 1]
    runs = [XMCClassifier(seed=member_seed(5, j), threads=1, **kw).fit(X, Y) for j in range(3)]
    for a, b in zip(ens.params_, combine_members([r.params_ for r in runs]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # the training time is the longest lane's, not the members' sum
    final = final_record(ens.history_)
    assert final["train_time"] < sum(rec["member_train_time"])


def test_member_lanes_only_where_one_thread_runs_one_cpu_device():
    import dataclasses

    from xmc_engine.config import LANES_MAX_SPEEDUP, TrainConfig
    from xmc_engine.training import _member_lanes

    if _cores() < 2:
        pytest.skip("one CPU core here: one lane")
    X, Y = tiny_data(n=300)
    cfg = TrainConfig(ensemble=3, hidden=[8])
    lanes = min(3, _cores())
    assert _member_lanes(cfg, {0: 1}, {0: None}, X, Y, None, {}) == lanes
    # all the threads won, by less than LANES_MAX_SPEEDUP: one thread each, side by side
    assert _member_lanes(cfg, {0: 2}, {0: LANES_MAX_SPEEDUP - 0.2}, X, Y, None, {}) == lanes
    # by more, or not measured: the cores are the budget's
    assert _member_lanes(cfg, {0: 2}, {0: LANES_MAX_SPEEDUP + 0.2}, X, Y, None, {}) == 1
    assert _member_lanes(cfg, {0: 2}, {0: None}, X, Y, None, {}) == 1
    assert _member_lanes(dataclasses.replace(cfg, threads=1), {0: 1}, {}, X, Y, None, {}) == 1
    two = dataclasses.replace(cfg, devices="cpu,cpu@0.5")
    assert _member_lanes(two, {0: 1, 1: 1}, {}, X, Y, None, {}) == 1
    assert _member_lanes(cfg, {0: 1}, {}, X, Y, None, {"simulate": lambda i, n: 1.0}) == 1


def test_a_member_that_fails_beside_the_first_fails_the_ensemble(monkeypatch, tmp_path):
    """An error in a member training beside the first stops the others and is raised by the
    ensemble, not swallowed by its thread."""
    from xmc_engine import training

    if _cores() < 2:
        pytest.skip("one CPU core here: members cannot train side by side")
    real = training.fit_model

    def failing(cfg, *a, **kw):
        if cfg.ensemble == 1 and kw.get("progress_desc", "").endswith("2/2"):
            raise RuntimeError("member 2 broke")
        return real(cfg, *a, **kw)

    monkeypatch.setattr(training, "fit_model", failing)
    X, Y = tiny_data(n=600)
    with pytest.raises(RuntimeError, match="member 2 broke"):
        XMCClassifier(ensemble=2, hidden=[4], epochs=20, loss="softmax",
                      log_dir=tmp_path / "run", checkpoint_every=600).fit(X, Y)
    # the first member stopped at its next barrier, with a checkpoint, rather than train on
    log = [json.loads(x) for x in (tmp_path / "run" / "member-0" / "log.jsonl").open()]
    assert log[-1]["event"] == "interrupted" and log[-1]["samples"] < 20 * 600


def test_a_stop_event_stops_a_run_like_a_signal(tmp_path):
    """``fit_model(stop=...)``: a set event stops the run at the next barrier with a
    checkpoint and TrainingInterrupted (a member beside others when one fails or the main
    thread is interrupted)."""
    import threading

    from xmc_engine.config import TrainConfig
    from xmc_engine.errors import TrainingInterrupted
    from xmc_engine.training import fit_model

    X, Y = tiny_data(n=300)
    stop = threading.Event()
    stop.set()
    with pytest.raises(TrainingInterrupted, match="SIGINT"):
        fit_model(TrainConfig(hidden=[4], epochs=2, threads=1, loss="softmax"), X, Y,
                  log_dir=tmp_path / "run", checkpoint_every=100, stop=stop)
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").open()]
    assert log[-1]["event"] == "interrupted" and log[-1]["checkpoint"]


def test_blas_stays_at_one_thread_under_members_side_by_side(monkeypatch):
    """BLAS's thread limit is process-wide: every step of members training side by side runs
    under one BLAS thread, the first member's included (its device worker starts where the
    process limit is the machine's, and used to put that back under the other member)."""
    import threading

    from threadpoolctl import ThreadpoolController

    from xmc_engine import model

    if _cores() < 2:
        pytest.skip("one CPU core here: members cannot train side by side")
    blas = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
    if not blas:
        pytest.skip("no BLAS library that threadpoolctl controls")
    seen, real = [], model.MLPReplica.train_batch

    def spy(self, *a, **kw):
        if threading.current_thread().name.startswith("xmc-device"):
            seen.append(max(c.get_num_threads() for c in blas))
        return real(self, *a, **kw)

    monkeypatch.setattr(model.MLPReplica, "train_batch", spy)
    X, Y = tiny_data(n=3000)
    ens = XMCClassifier(ensemble=2, hidden=[8], epochs=3, loss="softmax", eval_every=0).fit(X, Y)
    assert next(r for r in ens.history_ if r["event"] == "ensemble")["lanes"] == 2
    assert seen and set(seen) == {1}, sorted(set(seen))


def test_members_go_side_by_side_where_all_threads_win_by_little(monkeypatch):
    """The first member's calibration keeps all the device's threads, but they are less than
    LANES_MAX_SPEEDUP times as fast as one: the members train side by side on one thread
    each, and the first's threads record says why and what the calibration measured."""
    from xmc_engine import model

    if _cores() < 2:
        pytest.skip("one CPU core here: members cannot train side by side")

    def calibrate(self, batch_size, max_threads, run_samples=None):
        self.backend.threads, self.threads_timed, self.threads_speedup = max_threads, True, 1.1
        return max_threads

    monkeypatch.setattr(model.MLPReplica, "calibrate_threads", calibrate)
    X, Y = tiny_data(n=600)
    ens = XMCClassifier(ensemble=2, hidden=[4], epochs=1, loss="softmax", eval_every=0).fit(X, Y)
    assert next(r for r in ens.history_ if r["event"] == "ensemble")["lanes"] == 2
    recs = [r for r in ens.history_ if r["event"] == "threads"]
    assert [r["threads"] for r in recs] == [1, 1]
    assert "side by side" in recs[0]["note"] and recs[0]["speedup"] == 1.1
    one = XMCClassifier(hidden=[4], epochs=1, loss="softmax", eval_every=0).fit(X, Y)
    rec = next(r for r in one.history_ if r["event"] == "threads")
    assert rec["threads"] == _cores() and rec["speedup"] == 1.1  # one network keeps them


def test_members_side_by_side_share_the_time_budget_by_lane(monkeypatch):
    """``max_train_seconds`` is shared out by the members a lane trains: one after the other
    each of 3 members gets a third, side by side on 2 lanes (2 members on the busier lane)
    each gets half, the first member too (its share set when the lanes are known)."""
    from xmc_engine import training

    if _cores() < 2:
        pytest.skip("one CPU core here: members cannot train side by side")
    seen = []
    real = training._Driver

    class Spy(real):
        def __init__(self, cfg, *a, **kw):
            if kw.get("desc", a[8] if len(a) > 8 else "").startswith("train "):
                seen.append(cfg.max_train_seconds)
            super().__init__(cfg, *a, **kw)

    monkeypatch.setattr(training, "_Driver", Spy)
    X, Y = tiny_data(n=600)
    ens = XMCClassifier(ensemble=3, hidden=[4], epochs=1, loss="softmax", eval_every=0,
                        max_train_seconds=60).fit(X, Y)
    rec = next(r for r in ens.history_ if r["event"] == "ensemble")
    assert rec["lanes"] == 2 and rec["member_max_train_seconds"] == 30
    assert seen == [30, 30, 30]
