"""Reliability: device faults, non-finite updates, crash and resume, memory planning, bad input.

Faults are injected with ``XMC_FAULT`` / ``faults=`` (:mod:`xmc_engine.faults`); everything runs
on the CPU on tiny data (tests.test_estimator.tiny_data).
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import time

import numpy as np
import pytest

from tests._helpers import cli_argv, cli_env, final_record, run_cli, write_tiny_xc
from tests._trainer import make_trainer
from tests.test_estimator import tiny_data
from xmc_engine import XMCClassifier
from xmc_engine.checkpoint import CheckpointManager, save_arrays
from xmc_engine.config import TrainConfig
from xmc_engine.devices import parse_devices
from xmc_engine.errors import ConfigError, DeviceFailure, DivergenceError, MemoryPlanError
from xmc_engine.faults import parse_faults
from xmc_engine.memory import parse_size, plan_memory
from xmc_engine.runlog import read_log
from xmc_engine.scheduler import FakeReplica


class ListLog:
    def __init__(self):
        self.events = []

    def write(self, event, **fields):
        self.events.append((event, fields))

    def of(self, kind):
        return [f for e, f in self.events if e == kind]


class PeriodReplica(FakeReplica):
    """Records the merge period of every completed step (``self.periods``, beside history)."""

    trainer = None

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.periods = []

    def train_batch(self, rows, lr):
        loss = super().train_batch(rows, lr)
        self.periods.append(self.trainer.period_global)
        return loss


def make(n, spec="cpu,cpu,cpu", mode="simulated", **kw):
    devs = parse_devices(spec, cores=2)
    reps = [PeriodReplica(n, sleep=(mode == "threads"), latency_per_sample=1e-6, seed=0)
            for _ in devs]
    log = ListLog()
    tr = make_trainer(reps, devs, "adaptive", n, lr=0.05, batch_size=50, warmup_epochs=0,
                      merge_period=400, b_min=10, momentum=0.0, seed=1, log=log, mode=mode,
                      timeout=30, **kw)
    for r in reps:
        r.trainer = tr
    return tr, reps, log


# -- 1. elastic device set -----------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["simulated", "threads"])
def test_failed_device_is_dropped_and_no_sample_is_lost(mode):
    n = 2000
    tr, reps, log = make(n, mode=mode, faults="device:1:step:4")
    with tr:
        res = tr.run_epoch(0)
    assert res["samples"] == n
    (drop,) = log.of("device_dropped")
    assert drop["device"] == 1 and "injected failure" in drop["error"]
    assert drop["remaining"] == [0, 2]
    # Accounting: the work that reached the model covers every sample exactly once; the failed
    # device's steps of the period it died in were given back and redone by the others.
    dead_period = tr.dropped_at[1]
    rows = [r for i, rep in enumerate(reps) for r, p in zip((h[0] for h in rep.history),
                                                            rep.periods, strict=True)
            if not (i == 1 and p == dead_period)]
    np.testing.assert_array_equal(np.sort(np.concatenate(rows)), np.arange(n))
    merges = log.of("merge")
    after = [m for m in merges if m["period"] >= drop["period"]]
    assert after and all(m["devices"][1]["weight"] == 0.0 for m in after)
    assert all(sum(d["weight"] for d in m["devices"]) == pytest.approx(1.0) for m in merges)
    assert sum(d["samples"] for m in merges for d in m["devices"]) == n
    assert tr.alive == [True, False, True]


def test_dropped_device_rejoins_from_the_merged_model():
    tr, reps, log = make(2000, faults="device:1:step:2", rejoin_after=1)
    tr.run_epoch(0)
    (back,) = log.of("device_rejoined")
    assert len(log.of("device_dropped")) == 1
    assert back["device"] == 1 and back["period"] == tr.dropped_at[1] + 2
    later = [m for m in log.of("merge") if m["period"] >= back["period"]]
    assert later and all(m["devices"][1]["updates"] > 0 for m in later)
    assert tr.alive == [True, True, True]


def test_every_device_failing_stops_with_device_failure():
    tr, _, _ = make(2000, spec="cpu,cpu", faults="device:*:step:2")
    with pytest.raises(DeviceFailure, match="every device has failed"):
        tr.run_epoch(0)
    with pytest.raises(DeviceFailure, match="earlier failure"):
        tr.run_epoch(1)


def test_fault_spec_grammar():
    f = parse_faults("device:1:step:40, nan:*:step:3+")
    assert [(x.kind, x.device, x.step, x.repeat) for x in f] == [
        ("device", 1, 40, False), ("nan", None, 3, True)]
    for bad in ("device:1", "boom:1:step:3", "device:x:step:3", "device:1:step:0", ""):
        with pytest.raises(ConfigError, match="fault"):
            parse_faults(bad)


@pytest.fixture(scope="module")
def toy():
    X, Y = tiny_data(n=600)
    return X[:500], Y[:500], X[500:], Y[500:]


# SGD's rate 0.5 was set for the toy rows as they are (binary, norm ~3), hence normalize="none".
KW = dict(hidden=32, epochs=6, batch_size=32, lr=0.5, optimizer="sgd", seed=0, devices="cpu,cpu",
          algorithm="adaptive", lr_warmup_epochs=0, normalize="none")
# Fixed batch sizes: these tests are about faults, and with adapting batches a loaded machine's
# thread timing can push one device to b_max (and 2x the learning rate) on this toy problem
# (a fault-free run once ended at P@1 0.47 in CI against 0.74-0.82 normally; fixed: 0.80 x 6).
AP = dict(merge_period=128, b_min=16, b_max=64, rule="fixed")


def test_injected_device_failure_still_reaches_the_quality_band(toy, monkeypatch):
    Xtr, Ytr, Xte, Yte = toy
    ref = XMCClassifier(**KW, algorithm_params=AP).fit(Xtr, Ytr, eval_set=(Xte, Yte))
    # early enough that device 1 reaches it however the threads are scheduled (at its 20th
    # step a CI run under load once finished without reaching it)
    monkeypatch.setenv("XMC_FAULT", "device:1:step:5")
    hurt = XMCClassifier(**KW, algorithm_params=AP).fit(Xtr, Ytr, eval_set=(Xte, Yte))
    events = [r["event"] for r in hurt.history_]
    assert "device_dropped" in events and events[-1] == "final"
    assert final_record(hurt.history_)["samples"] == 6 * 500  # nothing lost
    assert hurt.metrics_["P@1"] > 0.6 and abs(hurt.metrics_["P@1"] - ref.metrics_["P@1"]) < 0.1


# -- 2. non-finite guard ---------------------------------------------------------------------------
def test_nan_replica_is_excluded_reset_and_its_lr_halved(toy):
    Xtr, Ytr, Xte, Yte = toy
    m = XMCClassifier(**KW, algorithm_params={**AP, "fault": "nan:1:step:5"})
    m.fit(Xtr, Ytr, eval_set=(Xte, Yte))
    (nf,) = [r for r in m.history_ if r["event"] == "nonfinite"]
    assert nf["device"] == 1 and nf["lr_scale"] == 0.5
    assert all(np.isfinite(p).all() for p in m.params_)
    assert m.metrics_["P@1"] > 0.6


def test_all_replicas_diverging_stops_with_the_last_good_checkpoint_intact(toy, tmp_path):
    Xtr, Ytr, _, _ = toy
    run = tmp_path / "run"
    # One merge period per epoch and a static equal partition ("average": 8 steps of 32 rows
    # per device per epoch), so that both replicas diverge in epoch 2 whatever the thread
    # timing (with dynamic scheduling one device may not reach its 12th step in time).
    ap = {"merge_period": 500, "fault": "nan:*:step:9+"}
    m = XMCClassifier(**{**KW, "algorithm": "average"}, algorithm_params=ap,
                      log_dir=str(run), checkpoint_every=100)
    with pytest.raises(DivergenceError, match="last good checkpoint is .*ckpt-") as e:
        m.fit(Xtr, Ytr)
    assert "non-finite" in str(e.value)
    arrays, meta = CheckpointManager(run).latest_valid()
    assert meta["samples"] == 500 and all(np.isfinite(a).all() for a in arrays.values())
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert log[-1]["event"] == "diverged"


def test_single_device_nan_loss_is_a_divergence_error(toy):
    Xtr, Ytr, _, _ = toy
    m = XMCClassifier(hidden=16, epochs=2, batch_size=50,
                      algorithm_params={"fault": "nan:0:step:3"})
    with pytest.raises(DivergenceError, match="non-finite in epoch 0 period 0"):
        m.fit(Xtr, Ytr)


# -- 3. crash and resume (subprocesses) ------------------------------------------------------------
cli = functools.partial(run_cli, timeout=300)


def start(*args):
    return subprocess.Popen(cli_argv(*args), env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_tiny_xc(tmp_path_factory.mktemp("data"), n=1200, n_train=1000)


# 20 epochs of 1,000 rows, a checkpoint every 400 samples: a kill after the 4th checkpoint lands
# with most of the run still to go (with 6 epochs a fast step let the run finish first)
EPOCHS = 20
TRAIN = ("--hidden", 32, "--epochs", EPOCHS, "--batch-size", 32, "--lr", 0.5, "--eval-every", 0,
         "--checkpoint-every", 400)


def p_at_1(stdout):
    line = next(x for x in stdout.splitlines() if x.startswith("P@1"))
    return float(line.split()[1])


@pytest.fixture(scope="module")
def ref_p1(files, tmp_path_factory):
    """P@1 of an uninterrupted run."""
    return p_at_1(cli("train", "--data", files, *TRAIN, "--out",
                      tmp_path_factory.mktemp("ref") / "run").stdout)


def wait_for_checkpoints(proc, run, k, timeout=120):
    """Poll ``run``'s log until its ``k``-th checkpoint record; the records seen by then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended before its checkpoint {k}"
        if (run / "log.jsonl").exists():
            ckpts = [r for r in read_log(run) if r["event"] == "checkpoint"]
            if len(ckpts) >= k:
                return ckpts
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint {k} within {timeout} s")


@pytest.mark.parametrize("k", [1, 4])
def test_sigkill_after_the_kth_checkpoint_then_resume_continues_from_it(files, tmp_path, k,
                                                                         ref_p1):
    """SIGKILL once the k-th checkpoint record is in the log; the resumed run must start from
    the newest checkpoint on disk (the k-th or a later one written before the kill landed),
    never from scratch, and end where an uninterrupted run ends."""
    run = tmp_path / "run"
    proc = start("train", "--data", files, *TRAIN, "--out", run)
    kth = wait_for_checkpoints(proc, run, k)[k - 1]
    proc.kill()  # SIGKILL: no handler, no cleanup
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not any(r["event"] == "final" for r in read_log(run))
    _, newest = CheckpointManager(run).latest_valid()
    assert newest["samples"] >= kth["samples"] >= k * 400
    out = cli("train", "--resume", run).stdout
    log = read_log(run)
    (resumed,) = [r for r in log if r["event"] == "start" and r["resumed"]]
    assert resumed["samples"] == newest["samples"] and resumed["epoch"] == newest["epoch"]
    assert log[-1]["event"] == "final" and log[-1]["samples"] == EPOCHS * 1000
    assert (run / "model" / "config.json").exists() and (run / "model" / "params.npz").exists()
    assert abs(p_at_1(out) - ref_p1) <= 0.03, (k, p_at_1(out), ref_p1)


def test_truncated_checkpoint_falls_back_to_the_previous_one(files, tmp_path):
    run = tmp_path / "run"
    cli("train", "--data", files, *TRAIN[:3], 2, *TRAIN[4:], "--out", run)
    newest, previous = CheckpointManager(run).paths()[:2]
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    p = cli("train", "--resume", run)
    assert "skipping checkpoint" in p.stderr and newest.name in p.stderr
    assert "resuming from" in p.stderr and previous.name in p.stderr
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines() if x.strip()]
    starts = [r for r in log if r["event"] == "start"]
    assert starts[-1]["resumed"] and starts[-1]["samples"] < 2 * 1000
    assert log[-1]["event"] == "final" and log[-1]["samples"] == 2 * 1000


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_sigint_checkpoint_and_stop_cleanly(files, tmp_path, sig, code):
    """The signal must land while the run trains: 1,000 epochs (a run of 40 could finish on a
    busy machine between its first checkpoint and the signal, which the default handler then
    meets: 'xmc-engine: interrupted', once in CI)."""
    run = tmp_path / "run"
    epochs = 1000
    proc = start("train", "--data", files, *TRAIN[:3], epochs, *TRAIN[4:], "--out", run)
    deadline = time.time() + 60
    while not list(run.glob("ckpt-*.npz")) and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert f"interrupted by {signal.Signals(sig).name}" in err and "--resume" in err
    assert "Traceback" not in err
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines() if x.strip()]
    (stop,) = [r for r in log if r["event"] == "interrupted"]
    _, meta = CheckpointManager(run).latest_valid()
    assert meta["samples"] == stop["samples"] < epochs * 1000


# -- 4. memory planning ----------------------------------------------------------------------------
def test_plan_refuses_a_model_too_large_and_its_suggestion_fits():
    cfg = TrainConfig(devices="cpu,cpu", algorithm="adaptive", batch_size=128)
    shape = dict(n_samples=490449, n_features=135909, n_labels=670091, nnz=75.7 * 490449,
                 label_nnz=5.45 * 490449, n_test=153025, test_nnz=75.7 * 153025,
                 test_label_nnz=5.45 * 153025)
    plan = plan_memory(cfg, budget="8GiB", **shape)
    assert plan.fits is False and plan.suggestion
    fixed = TrainConfig.from_dict({**cfg.to_dict(), **plan.suggestion})
    assert plan_memory(fixed, budget="8GiB", **shape).fits is True
    tiny = plan_memory(cfg, budget="100MiB", **shape)
    assert tiny.fits is False and tiny.suggestion is None and "--hidden" in tiny.suggestion_text
    assert parse_size("8GiB") == 8 * 2**30 and parse_size("1.5k") == 1500


def test_plan_counts_the_process_once_on_the_host(monkeypatch):
    from xmc_engine.datasets import make_synthetic

    from xmc_engine import training
    from xmc_engine.memory import RUNTIME_BYTES, RUNTIME_ITEM

    cfg = TrainConfig(devices="cpu,cpu", algorithm="adaptive")
    plan = plan_memory(cfg, n_samples=1000, n_features=100, n_labels=50, nnz=10000,
                       label_nnz=2000, budget="1GiB")
    (host,) = plan.pools
    assert host.items[RUNTIME_ITEM] == RUNTIME_BYTES
    X, Y, _, _ = make_synthetic("default", n_train=300, n_test=10, n_features=40, n_labels=10,
                                seed=0)
    total = plan_memory(TrainConfig(), n_samples=300, n_features=40, n_labels=10, nnz=X.nnz,
                        label_nnz=Y.nnz, budget="1GiB").pools[0].total
    room = 2 * total - RUNTIME_BYTES  # two fits in one process: the process once
    for budget, holds in ((room, True), (room - 4096, False)):
        monkeypatch.setenv("XMC_MEMORY_BUDGET", str(budget))
        assert training._host_holds(2, TrainConfig(), X, Y, None) is holds


def test_fit_refuses_at_once_with_the_estimate(toy, monkeypatch, tmp_path):
    Xtr, Ytr, _, _ = toy
    monkeypatch.setenv("XMC_MEMORY_BUDGET", "300KiB")
    run = tmp_path / "run"
    with pytest.raises(MemoryPlanError, match=r"needs about .* on host .*a setting that fits"):
        XMCClassifier(hidden=512, epochs=1, log_dir=str(run)).fit(Xtr, Ytr)
    assert not (run / "log.jsonl").exists()  # refused before the run started (timing: bench/)


def test_plan_cli_amazon670k_shape(tmp_path):
    p = cli("plan", "--data", "synthetic-amazon670k", "--devices", "cpu*2", "--algorithm",
            "adaptive", "--memory-budget", "8GiB", check=False)
    assert p.returncode == 1 and "670,091 labels" in p.stdout and "DOES NOT FIT" in p.stdout
    assert "--label-chunk" in p.stderr
    flags = p.stderr.split("try ", 1)[1].split(" (")[0].split()
    ok = cli("plan", "--data", "synthetic-amazon670k", "--devices", "cpu*2", "--algorithm",
             "adaptive", "--memory-budget", "8GiB", *flags)
    assert "verdict: fits" in ok.stdout


# -- 5. bad input at every door --------------------------------------------------------------------
def test_bad_input_at_every_cli_door(files, tmp_path):
    (tmp_path / "broken.json").write_text('{"hidden": [16],')
    (tmp_path / "typed.json").write_text('{"hidden": "wide"}')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"format": "xmc-engine-model/1"}))
    np.savez(pickled / "params.npz", W1=np.array([{"x": 1}], dtype=object))
    train = ("train", "--data", files, "--out", tmp_path / "r")
    cases = [
        ((*train, "--config", tmp_path / "broken.json"), "broken.json"),
        ((*train, "--config", tmp_path / "typed.json"), "wide"),
        ((*train, "--devices", "cpu@2"), "cpu@2"),
        ((*train, "--devices", "cuda:-1"), "cuda:-1"),
        ((*train, "--batch-size", "abc"), "abc"),
        ((*train, "--epochs", "-1"), "epochs"),
        ((*train, "--checkpoint-every", "10x"), "10x"),
        ((*train, "--algo-param", "nonsense"), "nonsense"),
        ((*train, "--algorithm", "adaptive", "--algo-param", "bogus=1"), "bogus"),
        ((*train, "--algorithm", "adaptive", "--devices", "cpu,cpu", "--algo-param",
          "fault=device:one"), "device:one"),
        (("plan", "--data", "synthetic-amazon670k", "--memory-budget", "8XB"), "8XB"),
        (("evaluate", model, "--data", files), "config.json"),
        (("evaluate", pickled, "--data", files), "pickle"),
        (("train", "--resume", tmp_path / "nowhere"), "nowhere"),
    ]
    for args, needle in cases:
        p = cli(*args, check=False)
        assert p.returncode == 2, (args, p.returncode, p.stderr)
        assert needle in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    p = cli(*train, env={"XMC_FAULT": "explode"}, check=False)
    assert p.returncode == 2 and "explode" in p.stderr and "Traceback" not in p.stderr


def test_loading_never_unpickles(tmp_path):
    np.savez(tmp_path / "obj.npz", a=np.array([object()], dtype=object))
    from xmc_engine.checkpoint import load_arrays
    from xmc_engine.errors import CheckpointError

    with pytest.raises(CheckpointError, match="pickle"):
        load_arrays(tmp_path / "obj.npz")
    save_arrays(tmp_path / "ok.npz", {"a": np.arange(3)})
    assert load_arrays(tmp_path / "ok.npz")[0]["a"].tolist() == [0, 1, 2]


def test_a_signal_during_the_final_evaluation_still_stops_the_run(monkeypatch):
    """SIGINT while the last evaluation runs (after the loop's own check) stops the run like
    one during training, instead of being dropped (a loss probe's fit would otherwise swallow
    it and the whole run go on)."""
    import os

    from tests.test_estimator import tiny_data
    from xmc_engine import training
    from xmc_engine.errors import TrainingInterrupted

    X, Y = tiny_data(n=300)
    evaluate = training._Driver.evaluate

    def evaluate_and_signal(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(training._Driver, "evaluate", evaluate_and_signal)
    with pytest.raises(TrainingInterrupted, match="SIGINT"):
        XMCClassifier(loss="softmax", hidden=8, epochs=1, seed=0, eval_every=0,
                      threads=1).fit(X, Y, eval_set=(X, Y))
