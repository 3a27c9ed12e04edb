"""The one training loop pins the algorithm, not only its parts: the learning rate each device
really steps with, and a multi-device resume that ends where an uninterrupted run ends."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests._trainer import ListLog, make_trainer
from tests.test_estimator import tiny_data
from xmc_engine.backends import get_backend
from xmc_engine.devices import parse_devices
from xmc_engine.model import MLPReplica, ModelShape, init_params
from xmc_engine.scheduler import FakeReplica, Schedule
from xmc_engine.training import checkpoint_extra, host_params, restore_trainer


def test_each_device_steps_with_the_schedule_times_its_batch_share():
    """Adaptive SGD, arXiv 2110.07029 §III-C: device ``i`` steps with ``lr(t) b_i / B`` where
    ``lr(t)`` is the run's schedule at the end of the period, and a batch shorter than ``b_i``
    with ``lr(t) rows / B``; checked on the learning rates the replicas actually received,
    period by period, while the batch sizes adapt."""
    n, B, lr0 = 6000, 64, 0.2
    schedule = Schedule(lr0, warmup_epochs=0.5, decay=1.0)
    devs = parse_devices("cpu,cpu@0.5,cpu@0.25", cores=3)
    reps = [FakeReplica(n, sleep=False, seed=0) for _ in devs]
    log = ListLog()
    tr = make_trainer(reps, devs, "adaptive", n, lr=lr0, batch_size=B, warmup_epochs=0.5,
                      lr_decay=1.0, merge_period=1024, rule="step", delta_b=16, b_min=16,
                      mode="simulated", log=log)
    starts = [0] * len(reps)
    adapted = False
    for epoch in range(3):
        tr.run_epoch(epoch)
    merges = [f for e, f in log.records if e == "merge"]
    for m in merges:
        assert m["lr"] == pytest.approx(schedule(m["progress"]), rel=1e-12)
        for i, d in enumerate(m["devices"]):
            steps = reps[i].history[starts[i]:starts[i] + d["updates"]]
            starts[i] += d["updates"]
            assert d["lr"] == pytest.approx(m["lr"] * d["batch_size"] / B, rel=1e-12)
            for rows, lr in steps:  # a short batch at the rate of its rows (batch_lr)
                assert len(rows) <= d["batch_size"]
                assert lr == pytest.approx(m["lr"] * len(rows) / B, rel=1e-12)
            adapted |= d["batch_size"] != B
    assert starts == [len(r.history) for r in reps]
    assert adapted  # the faster device's batch grew: b_i / B was not 1 throughout
    warm = [m["lr"] for m in merges if m["progress"] < 0.5]
    assert warm == sorted(warm) and warm[0] < lr0  # the linear ramp


def _mlp_replicas(X, Y, n):
    params = init_params(ModelShape(X.shape[1], Y.shape[1], (16,)), 0, avg_nnz=8.0)
    return [MLPReplica(get_backend("cpu", threads=1), X, Y, params, optimizer="adagrad")
            for _ in range(n)]


@pytest.mark.parametrize("algorithm,options", [
    ("adaptive", {"merge_period": 96, "rule": "step", "delta_b": 8, "b_min": 8}),
    # stopped inside the solo phase (1.48 of its 1.5 epochs), whose central model is caught up
    # by the checkpoint's read, and resumed there
    ("adaptive", {"merge_period": 96, "rule": "step", "delta_b": 8, "b_min": 8,
                  "solo_epochs": 1.5}),
    ("average", {"merge_period": 96}),
    ("sync", {}),
    ("single", {"merge_period": 96}),
])
def test_resume_mid_epoch_equals_the_uninterrupted_run(algorithm, options):
    """On the simulated clock (deterministic): stop at a barrier in the middle of epoch 1,
    save what a checkpoint saves, build a fresh trainer from it, finish; the model equals the
    run that never stopped (the batch sizes, the queue position, the optimizer state and the
    norm-trend flag all travel through the checkpoint's JSON)."""
    X, Y = tiny_data(n=420)
    spec = "cpu" if algorithm == "single" else "cpu,cpu@0.5"
    devs = parse_devices(spec, cores=2)
    kw = dict(lr=0.3, batch_size=32, warmup_epochs=0.5, lr_decay=0.5, mode="simulated",
              cost=lambda i, b: 1e-3 * (1 + b), seed=5, **options)

    whole = make_trainer(_mlp_replicas(X, Y, len(devs)), devs, algorithm, X.shape[0], **kw)
    for epoch in range(3):
        whole.run_epoch(epoch)
    want = host_params(whole)

    first = make_trainer(_mlp_replicas(X, Y, len(devs)), devs, algorithm, X.shape[0], **kw)
    first.run_epoch(0)
    part = first.run_epoch(1, stop_after=200)
    assert not part["done"] and 200 <= part["samples"] < X.shape[0]
    assert first.can_checkpoint()
    if options.get("solo_epochs"):  # stopped inside the solo phase
        assert first.policy.state_dict()["solo_last"] == 0
    params = host_params(first)
    extra = json.loads(json.dumps({k: v.tolist() for k, v in checkpoint_extra(first).items()}))
    extra = {k: np.asarray(v, dtype=np.uint8 if k == "trainer_state" else np.float32)
             for k, v in extra.items()}

    reps = _mlp_replicas(X, Y, len(devs))
    for r in reps:
        r.set_params(params)
    resumed = make_trainer(reps, devs, algorithm, X.shape[0], **kw)
    restore_trainer(resumed, extra)
    rest = resumed.run_epoch(1)
    assert rest["done"] and part["samples"] + rest["samples"] == X.shape[0]
    resumed.run_epoch(2)
    for a, b in zip(host_params(resumed), want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    if algorithm == "adaptive":
        assert resumed.policy.batch_sizes() == whole.policy.batch_sizes()


def test_a_stop_request_returns_at_the_next_barrier():
    """A signal handler's request (``should_stop``) ends ``run_epoch`` at the next barrier, and
    the epoch continues from there on the next call."""
    n = 2000
    devs = parse_devices("cpu,cpu@0.5", cores=2)
    reps = [FakeReplica(n, sleep=False, seed=0) for _ in devs]
    tr = make_trainer(reps, devs, "adaptive", n, batch_size=50, merge_period=500,
                      mode="simulated")
    asked = []
    first = tr.run_epoch(0, should_stop=lambda: bool(asked.append(1)) or len(asked) > 1)
    assert first["periods"] == 1 and not first["done"] and tr.can_checkpoint()
    rest = tr.run_epoch(0)
    assert rest["done"] and first["samples"] + rest["samples"] == n


def test_fit_model_on_a_virtual_clock_is_deterministic_and_adapts_batches():
    """``fit_model(simulate=...)``: the schedule follows the cost function and the speed factors
    alone, so two runs end bit-identical, and adaptive gives the full-speed device the larger
    batches (what the GPU check compares a GPU run against a CPU run with)."""
    from xmc_engine.config import TrainConfig
    from xmc_engine.training import fit_model

    X, Y = tiny_data(n=1000)
    cfg = TrainConfig(devices="cpu,cpu@0.5", algorithm="adaptive", epochs=2, hidden=[8],
                      batch_size=32, seed=3, threads=1,
                      algorithm_params={"merge_period": 256})

    def cost(i, n):
        return 1e-3 + 1e-5 * n

    runs = [fit_model(cfg, X, Y, simulate=cost) for _ in range(2)]
    for a, b in zip(runs[0]["params"], runs[1]["params"], strict=True):
        np.testing.assert_array_equal(a, b)
    merges = [r for r in runs[0]["history"] if r.get("event") == "merge"]
    sizes = [[d["batch_size"] for d in m["devices"]] for m in merges]
    assert sizes and sizes[-1][0] > sizes[-1][1], sizes


@pytest.mark.parametrize("simulated", [False, True], ids=["threads", "virtual-clock"])
def test_max_train_seconds_stops_the_run_and_says_so(simulated):
    """``max_train_seconds``: training stops at the first barrier after the budget (long before
    ``epochs``), the run log says why, and the model is still evaluated at the end. On a
    virtual clock the budget counts virtual seconds."""
    from xmc_engine.config import TrainConfig
    from xmc_engine.training import fit_model

    X, Y = tiny_data(n=1000)
    budget = 0.5
    cfg = TrainConfig(devices="cpu,cpu@0.5", algorithm="adaptive", epochs=10_000, hidden=[8],
                      batch_size=32, seed=0, threads=1, max_train_seconds=budget,
                      algorithm_params={"merge_period": 256})
    simulate = (lambda i, n: 1e-3 + 1e-4 * n) if simulated else None
    out = fit_model(cfg, X[:800], Y[:800], (X[800:], Y[800:]), simulate=simulate)
    hist = out["history"]
    stop = [r for r in hist if r["event"] == "time_budget"]
    final = hist[-1]
    assert len(stop) == 1 and stop[0]["max_train_seconds"] == budget
    assert budget <= final["train_time"] < budget + 5.0, final["train_time"]
    assert 0 < final["samples"] < 10_000 * 800
    evals = [r for r in hist if r["event"] == "eval"]
    assert final["metrics"] is not None and evals[-1]["samples"] == final["samples"]
    if simulated:  # checked every ~2% of an epoch: 16 samples at 800 rows, a few ms virtual
        assert final["train_time"] < budget + 0.1, final["train_time"]


def test_max_train_seconds_must_be_positive():
    from xmc_engine.config import TrainConfig
    from xmc_engine.errors import ConfigError

    with pytest.raises(ConfigError, match="max_train_seconds"):
        TrainConfig(max_train_seconds=0)
    assert TrainConfig(max_train_seconds=1.5).max_train_seconds == 1.5
