"""Trainer: dynamic scheduling, adaptation, barrier, accounting, failures.

Deterministic tests use the simulated mode (virtual clock, FakeReplica latencies); a few short
threaded runs assert only robust properties (the machine is small and shared).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests._trainer import make_trainer
from xmc_engine.devices import DeviceSpec, parse_devices
from xmc_engine.errors import DeviceFailure, DivergenceError
from xmc_engine.scheduler import FakeReplica, epoch_permutation


class ListLog:
    def __init__(self):
        self.events = []

    def write(self, event, **fields):
        self.events.append((event, fields))


def make(spec, n_samples=4096, *, mode="simulated", sleep=None, per_sample=1e-5, per_step=0.0,
         log=None, algorithm="adaptive", timeout=600.0, trace=False, replica_kw=None, **cfg):
    devs = parse_devices(spec, cores=2)
    sleep = (mode == "threads") if sleep is None else sleep
    reps = [FakeReplica(n_samples, sleep=sleep, seed=0, latency_per_sample=per_sample,
                        latency_per_step=per_step, **((replica_kw or {}).get(i, {})))
            for i in range(len(devs))]
    return make_trainer(reps, devs, algorithm, n_samples, seed=1, log=log, mode=mode,
                        timeout=timeout, trace=trace, **cfg), reps


def rows_of_epoch(reps, start_steps):
    return np.concatenate([r for rep, s in zip(reps, start_steps, strict=True)
                           for r, _ in rep.history[s:]])


def test_faster_devices_take_more_batches_simulated():
    tr, _ = make("cpu,cpu@0.5,cpu@0.25", merge_period=1024, batch_size=32, b_min=32,
                 warmup_epochs=5, momentum=0.0, lr=0.1)
    r = tr.run_epoch(0)
    u = [d["updates"] for d in r["devices"]]
    assert u[0] > u[1] > u[2]
    assert u[0] / u[2] == pytest.approx(4, rel=0.15)
    assert r["samples"] == 4096


@pytest.mark.parametrize("mode", ["simulated", "threads"])
def test_every_sample_exactly_once_and_accounting(mode):
    n = 3000
    tr, reps = make("cpu,cpu@0.5", n, mode=mode, per_sample=2e-6, merge_period=700,
                    batch_size=64, warmup_epochs=0, delta_b=32, lr=0.05)
    with tr:
        for epoch in range(2):
            start = [len(r.history) for r in reps]
            res = tr.run_epoch(epoch)
            rows = rows_of_epoch(reps, start)
            assert len(rows) == n == res["samples"]
            np.testing.assert_array_equal(np.sort(rows), np.arange(n))
            steps = [len(r.history) - s for r, s in zip(reps, start, strict=True)]
            assert [d["updates"] for d in res["devices"]] == steps
            assert [d["samples"] for d in res["devices"]] == [
                sum(len(x) for x, _ in r.history[s:]) for r, s in zip(reps, start, strict=True)]


@pytest.mark.parametrize("mode", ["simulated", "threads"])
def test_one_device_equals_plain_loop(mode):
    n, B, lr = 1000, 50, 0.05
    tr, (rep,) = make("cpu", n, mode=mode, per_sample=1e-7, merge_period=300, batch_size=B,
                      b_min=B, warmup_epochs=0, momentum=0.0, lr_decay=0.0, lr=lr)
    plain = FakeReplica(n, sleep=False, seed=0)
    with tr:
        for epoch in range(2):
            tr.run_epoch(epoch)
            perm = epoch_permutation(n, 1, epoch)
            for k in range(0, n, B):
                plain.train_batch(perm[k:k + B], lr)
    for a, b in zip(rep.params(), plain.params(), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(tr.central_params(), plain.params(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("algorithm,short", [("single", [6]), ("adaptive", [6]),
                                             ("average", [3, 3])])
def test_a_short_batch_steps_at_the_rate_of_its_rows(algorithm, short):
    """An epoch of 70 rows at batch 8 ends with a batch of 6 rows (``average``'s equal quotas:
    35 rows a device, the last 3 of each a batch): it steps at 6/8 of the rate, so that each of
    its rows moves the model as much as a row of a full batch (a step is its rows' mean);
    every full batch steps at the full rate."""
    spec = "cpu" if algorithm == "single" else "cpu,cpu@0.5"
    n, B, lr = 70, 8, 0.1
    extra = {"b_min": B} if algorithm == "adaptive" else {}
    tr, reps = make(spec, n, algorithm=algorithm, merge_period=4096, batch_size=B, lr=lr,
                    warmup_epochs=0, lr_decay=0.0, **extra)
    with tr:
        tr.run_epoch(0)
    steps = [(len(rows), step_lr) for rep in reps for rows, step_lr in rep.history]
    assert sum(k for k, _ in steps) == n
    assert sorted(k for k, _ in steps if k < B) == short
    for k, step_lr in steps:
        assert step_lr == pytest.approx(lr * k / B)


@pytest.mark.parametrize("scaling,factor", [("linear", 0.25), ("sqrt", 0.5), ("none", 1.0)])
def test_adaptive_scales_a_short_batch_by_its_lr_scaling(scaling, factor):
    """Adaptive SGD's short batch follows the rule its devices' batches follow
    (``lr_scaling``): the rate of a batch of 2 rows against one of 8."""
    from xmc_engine.algorithms import get_algorithm

    pol = get_algorithm("adaptive", lr_scaling=scaling)
    assert pol.batch_lr(0.2, 2, 8) == pytest.approx(0.2 * factor)


def period_updates(log, epoch):
    return [[d["updates"] for d in f["devices"]] for e, f in log.events
            if e == "merge" and f["epoch"] == epoch]


def test_step_rule_converges_to_equal_updates():
    log = ListLog()
    tr, _ = make("cpu,cpu@0.5", 32768, log=log, per_step=1e-5, merge_period=8192,
                 batch_size=128, b_min=16, b_max=1024, delta_b=16, rule="step",
                 warmup_epochs=1, momentum=0.0, lr=0.01)
    for epoch in range(4):
        tr.run_epoch(epoch)
    assert period_updates(log, 0)[0][0] >= 1.8 * period_updates(log, 0)[0][1]  # warm-up
    for u in period_updates(log, 3)[:-1]:  # the last period is the epoch remainder
        assert abs(u[0] - u[1]) <= 0.1 * max(u), u
    bs = tr.policy.batch_sizes()
    assert bs[0] > 1.6 * bs[1]


def test_proportional_rule_converges_in_one_period():
    log = ListLog()
    tr, _ = make("cpu,cpu@0.5,cpu@0.8", 8192, log=log, per_step=2e-5, merge_period=2048,
                 batch_size=64, b_min=8, b_max=1024, rule="proportional", warmup_epochs=1,
                 momentum=0.0, lr=0.01)
    tr.run_epoch(0)
    tr.run_epoch(1)
    u0 = period_updates(log, 0)[0]
    assert max(u0) >= 1.8 * min(u0)  # warm-up: equal batches, unequal updates
    for u in period_updates(log, 1)[:-1]:  # adapted at the end of warm-up, first period equal
        assert max(u) - min(u) <= 0.1 * max(u), u


def test_log_records_per_device_period_stats_and_weights():
    log = ListLog()
    tr, _ = make("cpu,cpu@0.5", 2048, log=log, merge_period=512, batch_size=32,
                 warmup_epochs=0, momentum=0.0, boost=False, lr=0.1)
    res = tr.run_epoch(0)
    merges = [f for e, f in log.events if e == "merge"]
    assert len(merges) == res["periods"] >= 4
    differ = 0  # merges where the shares of samples (the default weights) and of updates differ
    for f in merges:
        devs = f["devices"]
        assert {"batch_size", "updates", "samples", "weight", "busy_s", "idle_s"} <= set(devs[0])
        s = np.array([d["samples"] for d in devs], float)
        c = np.array([d["updates"] for d in devs], float)
        np.testing.assert_allclose([d["weight"] for d in devs], s / s.sum())
        differ += not np.allclose(s / s.sum(), c / c.sum())
        # the virtual period length is the same for every device: busy + idle
        assert devs[0]["busy_s"] + devs[0]["idle_s"] == pytest.approx(
            devs[1]["busy_s"] + devs[1]["idle_s"])
    assert differ  # the batch sizes adapted
    assert sum(f["devices"][0]["samples"] + f["devices"][1]["samples"] for f in merges) == 2048


def test_average_baseline_static_partition():
    tr, _ = make("cpu,cpu@0.25", 4000, algorithm="average", merge_period=1000, batch_size=100,
                 warmup_epochs=0, lr=0.1)
    res = tr.run_epoch(0)
    assert [d["samples"] for d in res["devices"]] == [2000, 2000]
    assert [d["updates"] for d in res["devices"]] == [20, 20]
    assert res["devices"][0]["idle_s"] > res["devices"][1]["idle_s"]  # fast one waits


def test_barrier_holds_threads():
    tr, _ = make("cpu,cpu@0.5,cpu", 3000, mode="threads", trace=True, per_sample=2e-6,
                 merge_period=600, batch_size=50, warmup_epochs=0, lr=0.1)
    with tr:
        tr.run_epoch(0)
        tr.run_epoch(1)
    ev = tr.events
    periods = sorted({p for _, p, _ in ev})
    assert len(periods) >= 8
    for p in periods:
        takes = [k for k, (kind, q, _) in enumerate(ev) if kind == "take" and q == p]
        start = ev.index(("merge_start", p, -1))
        end = ev.index(("merge_end", p, -1))
        assert takes and max(takes) < start < end
        later = [k for k, (kind, q, _) in enumerate(ev) if kind == "take" and q > p]
        assert not later or min(later) > end


def test_threads_faster_device_takes_more_batches():
    tr, _ = make("cpu,cpu@0.25", 4000, mode="threads", per_sample=2e-5, per_step=5e-4,
                 merge_period=2000, batch_size=50, warmup_epochs=5, lr=0.1)
    with tr:
        res = tr.run_epoch(0)
    u = [d["updates"] for d in res["devices"]]
    assert u[0] > 1.5 * u[1], u
    assert res["samples"] == 4000


@pytest.mark.parametrize("mode", ["simulated", "threads"])
def test_worker_exception_becomes_device_failure(mode):
    # One failing device is dropped (elastic, tests/test_reliability.py); all failing stops.
    tr, _ = make("cpu,cpu@0.5", 2000, mode=mode, per_sample=1e-6, merge_period=500,
                 batch_size=50, timeout=20,
                 replica_kw={0: {"fail_at_step": 3}, 1: {"fail_at_step": 3}}, lr=0.1)
    t0 = time.perf_counter()
    with tr, pytest.raises(DeviceFailure, match=r"device 1 \(cpu@0.5\).*injected failure"):
        tr.run_epoch(0)
    assert time.perf_counter() - t0 < 10
    with pytest.raises(DeviceFailure, match="earlier failure"):
        tr.run_epoch(1)


def test_stalled_worker_times_out():
    tr, _ = make("cpu,cpu", 2000, mode="threads", per_sample=1e-6, merge_period=500,
                 batch_size=50, timeout=0.5,
                 replica_kw={0: {"hang_at_step": 1, "hang_seconds": 3.0}}, lr=0.1)
    t0 = time.perf_counter()
    with tr, pytest.raises(DeviceFailure, match=r"device\(s\) 0 \(cpu\) did not finish"):
        tr.run_epoch(0)
    assert time.perf_counter() - t0 < 2.9


def test_nan_replica_recovers_and_all_nan_diverges():
    tr, reps = make("cpu,cpu", 2000, merge_period=500, batch_size=50, momentum=0.0,
                    replica_kw={1: {"nan_at_step": 2}}, lr=0.1)
    res = tr.run_epoch(0)
    assert res["samples"] == 2000
    assert all(np.isfinite(a).all() for r in reps for a in r.params())
    tr2, _ = make("cpu", 2000, merge_period=500, batch_size=50,
                  replica_kw={0: {"nan_at_step": 2}}, lr=0.1)
    with pytest.raises(DivergenceError):
        tr2.run_epoch(0)


def test_thread_budget_is_entered_in_worker_threads():
    import contextlib
    import threading

    seen = []

    class Budget(FakeReplica):
        pass

    devs = [DeviceSpec("cpu", threads=3), DeviceSpec("cpu", threads=3)]
    reps = [Budget(500, sleep=False) for _ in devs]
    merges = []
    for r in reps:
        r.backend.thread_budget = lambda n: (seen.append((n, threading.current_thread().name)),
                                             contextlib.nullcontext())[1]
        r.backend.kernel_threads = lambda n: (
            merges.append((n, threading.current_thread().name)), contextlib.nullcontext())[1]
    with make_trainer(reps, devs, "average", 500, merge_period=100) as tr:
        periods = tr.run_epoch(0)["periods"]
    assert sorted(n for n, _ in seen) == [3, 3]
    assert all(name.startswith("xmc-device-") for _, name in seen)
    # the main thread merges on one kernel thread while merges are short
    # (MERGE_ONE_THREAD_MAX_S), without the BLAS limits of thread_budget (2 ms per entry)
    assert len(merges) == periods >= 4 and {n for n, _ in merges} == {1}
    assert not any(name.startswith("xmc-device-") for _, name in merges)


def test_workers_enter_their_budget_before_the_training_clock():
    """Entering a worker's thread budget (threadpoolctl: milliseconds) is set-up: the
    constructor waits for it, so the first period's training seconds do not hold it."""
    import contextlib

    devs = [DeviceSpec("cpu"), DeviceSpec("cpu")]
    reps = [FakeReplica(256, sleep=False) for _ in devs]

    @contextlib.contextmanager
    def slow_budget(n):
        time.sleep(0.3)
        yield

    for r in reps:
        r.backend.thread_budget = slow_budget
    t0 = time.perf_counter()
    with make_trainer(reps, devs, "average", 256, merge_period=256) as tr:
        built = time.perf_counter() - t0
        res = tr.run_epoch(0)
    assert built >= 0.3  # the constructor waited for both workers (they enter side by side)
    assert res["samples"] == 256 and res["train_seconds"] < 0.25


def test_slow_merges_switch_the_main_thread_to_the_full_budget(monkeypatch):
    """After a merge longer than MERGE_ONE_THREAD_MAX_S the main thread stops limiting itself
    to one thread (the backend's default budget: no kernel_threads call); simulated
    mode, where no worker runs beside the merges, never limits it."""
    import contextlib
    import threading

    from xmc_engine.scheduler import runner

    monkeypatch.setattr(runner, "MERGE_ONE_THREAD_MAX_S", 1e-9)
    seen = []
    devs = [DeviceSpec("cpu", threads=3), DeviceSpec("cpu", threads=3)]
    reps = [FakeReplica(500, sleep=False) for _ in devs]
    for r in reps:
        r.backend.kernel_threads = lambda n: (
            seen.append((n, threading.current_thread().name)), contextlib.nullcontext())[1]
    with make_trainer(reps, devs, "average", 500, merge_period=100) as tr:
        tr.run_epoch(0)
        assert tr._merge_threads is None
    assert [n for n, _ in seen] == [1]  # the first merge only
    with make_trainer([FakeReplica(500, sleep=False) for _ in devs], devs, "average", 500,
                      merge_period=100, mode="simulated") as tr:
        assert tr._merge_threads is None


@pytest.mark.parametrize("algorithm", ["adaptive", "average", "sync"])
def test_epoch_cut_at_barriers_equals_the_whole_epoch(algorithm):
    """``run_epoch(stop_after=...)`` returns at a merge barrier and the next call continues the
    same epoch: the same periods, the same rows on the same devices, the same model."""
    n = 3000
    kw = dict(per_sample=2e-6, merge_period=700, batch_size=64, warmup_epochs=0)
    if algorithm == "sync":
        kw = dict(per_sample=2e-6, batch_size=64, warmup_epochs=0)
    whole, reps_w = make("cpu,cpu@0.5", n, algorithm=algorithm, **kw, lr=0.05)
    cut, reps_c = make("cpu,cpu@0.5", n, algorithm=algorithm, **kw, lr=0.05)
    with whole, cut:
        for epoch in range(2):
            w = whole.run_epoch(epoch)
            assert w["done"] and w["samples"] == n
            parts, stop = [], 1
            while True:
                r = cut.run_epoch(epoch, stop_after=stop)
                parts.append(r)
                if r["done"]:
                    break
                done = sum(p["samples"] for p in parts)
                assert done >= stop  # stopped at the first barrier at or after the mark
                stop = done + 900
            assert len(parts) > 1
            assert sum(p["samples"] for p in parts) == n
            assert sum(p["periods"] for p in parts) == w["periods"]
            assert all(p["periods"] >= 1 for p in parts)
    for a, b in zip(reps_w, reps_c, strict=True):
        assert [len(x) for x, _ in a.history] == [len(x) for x, _ in b.history]
        np.testing.assert_array_equal(np.concatenate([x for x, _ in a.history]),
                                      np.concatenate([x for x, _ in b.history]))
        for p, q in zip(a.params(), b.params(), strict=True):
            np.testing.assert_array_equal(p, q)


def test_a_new_epoch_number_starts_a_new_epoch():
    """A call for another epoch abandons the open one (a fresh shuffle, all rows again)."""
    n = 2000
    tr, _ = make("cpu,cpu", n, merge_period=500, batch_size=50, warmup_epochs=0, lr=0.05)
    first = tr.run_epoch(0, stop_after=600)
    assert not first["done"] and 600 <= first["samples"] < n
    res = tr.run_epoch(1)
    assert res["done"] and res["samples"] == n
