"""Behaviour of the scheduler that the mutation run (``bench/MUTATION.md``) found unpinned.

Each test states a property from the docstrings or the paper (arXiv 2110.07029); the mutants
they kill are listed in ``bench/MUTATION.md``.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from tests._trainer import ListLog, make_trainer
from xmc_engine.algorithms import ModelAveraging
from xmc_engine.backends import get_backend
from xmc_engine.devices import parse_devices
from xmc_engine.errors import DeviceFailure
from xmc_engine.scheduler import FakeReplica, Schedule
from xmc_engine.scheduler.controller import BatchSizeController
from xmc_engine.scheduler.merge import find_nonfinite
from xmc_engine.scheduler.queue import BatchQueue, FixedAssignmentQueue
from xmc_engine.scheduler.replica import HostBackend


def test_schedule_without_warmup_starts_at_lr0():
    """``Schedule(lr)`` has no warm-up and no decay by default: ``lr(t) = lr0`` from the first
    period on."""
    s = Schedule(0.3)
    assert [s(p) for p in (0.01, 0.5, 1.0, 7.5)] == [0.3] * 4


def test_proportional_rule_keeps_the_sizes_when_a_device_measured_no_time():
    """§III-C proportional rule: ``b_i ∝`` samples per busy second; a device with no samples
    *or* no measured busy time in the period gives no speed, so the sizes are kept."""
    c = BatchSizeController(2, 64, b_min=16, b_max=256, rule="proportional")
    assert c.update(2.0, [4, 4], [256, 256], [1.0, 0.0]) == [64, 64]
    assert c.update(2.0, [4, 0], [256, 0], [1.0, 0.5]) == [64, 64]
    assert c.update(2.0, [4, 4], [256, 256], [1.0, 3.0]) == [96, 32]


def test_find_nonfinite_names_each_bad_replica_once():
    """A replica with NaN/inf in several arrays is listed once, in replica order."""
    good = [np.ones((2, 2)), np.ones(3)]
    bad = [np.full((2, 2), np.nan), np.array([np.inf, 0.0, 1.0])]
    for backend in (HostBackend(), get_backend("cpu", threads=1)):
        assert find_nonfinite([bad, good, bad], backend) == [0, 2]


def _take_all(q, order):
    """Let the devices in ``order`` (repeated) take until the period refuses them all; every
    granted batch holds at least one row."""
    got = {i: [] for i in set(order)}
    open_ = set(order)
    for _ in range(10_000):
        if not open_:
            return got
        for i in order:
            if i in open_:
                rows = q.take(i)
                if rows is None:
                    open_.discard(i)
                else:
                    assert len(rows) > 0
                    got[i].append(rows)
    raise AssertionError("the period never refused the devices")


def test_given_back_rows_go_to_the_other_devices_in_the_same_period():
    """§III-A with a failed device: :meth:`BatchQueue.give_back` removes every row the device
    took from the period's account and the surviving devices take those rows first, within the
    same period budget; the epoch still hands out every row exactly once."""
    q = BatchQueue(64, 2, 32, seed=1)
    q.start_epoch(0)
    acct = q.start_period([6, 8])
    lost = [q.take(1), q.take(1, 5)]
    first = q.take(0)
    assert q.give_back(1) == 13
    assert acct.samples == [6, 0] and acct.updates == [1, 0] and q.remaining == 64 - 6
    q.set_active([True, False])
    got = _take_all(q, [0])
    # 6 of the first given-back batch, its last 2, then the 5 of the second
    assert [len(r) for r in got[0][:3]] == [6, 2, 5]
    np.testing.assert_array_equal(np.concatenate(got[0][:3]), np.concatenate(lost))
    # the given-back rows freed their share of the budget S = 32: device 0 takes while
    # P + max_j b_j <= S, i.e. up to 25 samples (not 12, as if the 13 still counted)
    assert acct.samples == [25, 0] and acct.updates == [5, 0]
    seen = [first, *got[0]]
    while not q.epoch_done:
        q.start_period([6, 8])
        seen += _take_all(q, [0])[0]
    assert sorted(np.concatenate(seen).tolist()) == list(range(64))


def test_static_quotas_skip_inactive_devices():
    """Static mode (``average``/``sync``): the period budget is split equally over the active
    devices only; an inactive device takes nothing."""
    q = BatchQueue(90, 3, 30, static=True)
    q.start_epoch(0)
    q.set_active([True, False, True])
    acct = q.start_period([4, 4, 4])
    got = _take_all(q, [0, 1, 2])
    assert acct.samples == [15, 0, 15] and got[1] == []


def test_fixed_assignment_queue_takes_each_devices_own_rows_in_equal_periods():
    """:class:`FixedAssignmentQueue`: device ``i`` takes only its rows
    ``[offsets[i], offsets[i] + counts[i])``, period ``k`` its quota
    ``floor((k+1) m/P) - floor(k m/P)`` in batches of its size, every row once per epoch."""
    offsets, counts, P = [0, 10], [10, 14], 3
    q = FixedAssignmentQueue(offsets, counts, [0, 1], P, seed=4)
    q.start_epoch(2)
    assert q.remaining == 24 and not q.epoch_done
    seen = {0: [], 1: []}
    for k in range(P):
        acct = q.start_period([3, 4])
        # the period's budget (which sets the schedule's progress) is the sum of the quotas
        assert acct.budget == sum((k + 1) * m // P - k * m // P for m in counts)
        got = _take_all(q, [1, 0])
        for i, m in enumerate(counts):
            quota = (k + 1) * m // P - k * m // P
            assert acct.samples[i] == quota
            assert acct.updates[i] == len(got[i]) == -(-quota // acct.batch_sizes[i])
            seen[i] += got[i]
        assert q.remaining == 24 - sum((k + 1) * m // P for m in counts)
        assert q.history[-1] is acct
    assert q.epoch_done and q.remaining == 0
    for i, (o, m) in enumerate(zip(offsets, counts, strict=True)):
        assert sorted(np.concatenate(seen[i]).tolist()) == list(range(o, o + m))


def test_fixed_number_of_periods_per_epoch():
    """``BatchQueue.n_periods = P`` (multi-node, every node merges equally often): period
    ``k < P - 1`` ends at cursor ``(k + 1) n_samples // P``, the last takes the rest."""
    q = BatchQueue(30, 2, 1000, seed=2)
    q.n_periods = 3
    q.start_epoch(0)
    taken = []
    while not q.epoch_done:
        acct = q.start_period([5, 5])
        _take_all(q, [0, 1])
        taken.append(acct.total)
    assert taken == [10, 10, 10]


def test_resume_keeps_the_halved_rate_of_a_device_that_went_non_finite():
    """A device whose replica went non-finite steps at half the rate from then on; the
    checkpoint state carries that scale, so a resumed run keeps stepping it at half the rate."""
    n = 64

    def trainer(reps):
        return make_trainer(reps, None, "average", n, lr=0.1, batch_size=8, warmup_epochs=0.0,
                            lr_decay=0.0, merge_period=32, mode="simulated")

    reps = [FakeReplica(n, sleep=False, seed=0), FakeReplica(n, sleep=False, seed=0,
                                                             nan_at_step=0)]
    tr = trainer(reps)
    tr.run_epoch(0)
    assert tr.lr_scale == [1.0, 0.5]
    state = json.loads(json.dumps(tr.state_dict()))
    fresh = [FakeReplica(n, sleep=False, seed=0) for _ in range(2)]
    resumed = trainer(fresh)
    resumed.load_state_dict(state)
    resumed.run_epoch(1)
    assert {lr for _, lr in fresh[0].history} == {0.1}
    assert {lr for _, lr in fresh[1].history} == {0.05}


def test_epoch_loss_and_virtual_time():
    """``run_epoch()["loss"]`` is the summed step loss over the epoch divided by its samples:
    with ``lr = 0`` the model stays put and it equals the mean over the rows of the fake's
    ``0.5 ||w - t_j||^2``. In the simulated mode ``train_seconds`` is the virtual time the
    epoch's periods took."""
    n = 48
    reps = [FakeReplica(n, sleep=False, seed=3) for _ in range(2)]
    w = [a.copy() for a in reps[0].params()]
    tr = make_trainer(reps, None, "average", n, lr=0.0, batch_size=8, merge_period=16,
                      mode="simulated")
    out = tr.run_epoch(0)
    expect = np.mean([sum(0.5 * np.sum((wk - t[j]) ** 2) for wk, t in
                          zip(w, reps[0]._targets, strict=True)) for j in range(n)])
    assert out["samples"] == n and out["loss"] == pytest.approx(expect, rel=1e-12)
    assert out["train_seconds"] == pytest.approx(tr.virtual_time) and tr.virtual_time > 0
    # each of the 3 periods: device 0 takes 8 rows (1e-4 + 8e-5 s), device 1 the next 8
    assert tr.virtual_time == pytest.approx(3 * (1e-4 + 8 * 1e-5))


class _RecordingAverage(ModelAveraging):
    """Model averaging that also runs a job on every device at each merge and keeps the
    results :attr:`MergeContext.run_on_devices` returns."""

    def merge(self, replicas, updates, ctx):
        self.calls.append(ctx.run_on_devices(lambda i: (i, threading.current_thread().name)))
        return super().merge(replicas, updates, ctx)


@pytest.mark.parametrize("mode", ["threads", "simulated"])
def test_run_on_devices_returns_each_live_devices_result(mode):
    """``MergeContext.run_on_devices(fn)`` runs ``fn(i)`` for every live device (in that
    device's worker thread in the threaded mode) and returns the results in device order."""
    pol = _RecordingAverage(merge_period=16)
    pol.calls = []
    reps = [FakeReplica(32, sleep=False, seed=0) for _ in range(3)]
    with make_trainer(reps, None, pol, 32, batch_size=4, mode=mode, timeout=30) as tr:
        tr.run_epoch(0)
    assert len(pol.calls) == 2
    for call in pol.calls:
        assert [i for i, _ in call] == [0, 1, 2]
        if mode == "threads":
            assert all(name.startswith(f"xmc-device-{i}-") for i, name in call)


class _ShardingAverage(ModelAveraging):
    """Model averaging that also splits ``n_items`` over the devices at each merge
    (:attr:`MergeContext.run_shards`) and keeps what each part saw."""

    n_items = 0

    def merge(self, replicas, updates, ctx):
        self.calls.append(ctx.run_shards(
            self.n_items, lambda a, b: (a, b, threading.current_thread().name)))
        return super().merge(replicas, updates, ctx)


@pytest.mark.parametrize("mode", ["threads", "simulated"])
@pytest.mark.parametrize("spec, n_items, parts, on", [
    ("cpu,cpu@0.5", 90, [(0, 60), (60, 90)], [0, 1]),
    ("cpu,cpu@0.5,cpu@0.25", 7, [(0, 4), (4, 6), (6, 7)], [0, 1, 2]),
    ("cpu,cpu", 1, [(0, 1)], [1]),  # device 0's part is empty (rounded): not run
])
def test_run_shards_splits_by_speed_over_the_device_workers(mode, spec, n_items, parts, on):
    """``MergeContext.run_shards(n, fn)`` runs ``fn(start, stop)`` over contiguous parts of
    ``range(n)``, one per live device in proportion to its speed factor (in that device's
    worker thread in the threaded mode), and returns the results in device order."""
    pol = _ShardingAverage(merge_period=16)
    pol.calls, pol.n_items = [], n_items
    devices = parse_devices(spec, cores=len(spec.split(",")))
    reps = [FakeReplica(32, sleep=False, seed=0) for _ in devices]
    with make_trainer(reps, devices, pol, 32, batch_size=4, mode=mode, timeout=30) as tr:
        tr.run_epoch(0)
    assert len(pol.calls) == 2
    for call in pol.calls:
        assert [(a, b) for a, b, _ in call] == parts
        if mode == "threads":
            assert [name.split("-")[2] for *_, name in call] == [str(i) for i in on]


def test_run_shards_stays_on_the_main_thread_where_it_merges_with_every_thread():
    """Once the main thread merges with the full thread budget (merges longer than
    ``MERGE_ONE_THREAD_MAX_S``), ``run_shards(n, fn)`` runs ``fn(0, n)`` there, in one part."""
    pol = _ShardingAverage(merge_period=16)
    pol.calls, pol.n_items = [], 90
    devices = parse_devices("cpu,cpu@0.5", cores=2)
    reps = [FakeReplica(32, sleep=False, seed=0) for _ in devices]
    with make_trainer(reps, devices, pol, 32, batch_size=4, timeout=30) as tr:
        tr._merge_threads = None  # as after a merge of more than MERGE_ONE_THREAD_MAX_S
        tr.run_epoch(0)
    assert pol.calls == [[(0, 90, threading.current_thread().name)]] * 2


def test_threaded_busy_time_is_the_devices_step_time():
    """Threaded mode: ``busy_s`` of a device is the time its steps took (each fake step sleeps
    at least its latency), stretched by ``1 / s`` on a device of speed factor ``s`` (the
    emulated slow-down counts as busy), never more than the epoch's wall time."""
    n, latency = 64, 2e-3
    reps = [FakeReplica(n, latency_per_step=latency, latency_per_sample=0.0, seed=0)
            for _ in range(2)]
    devices = parse_devices("cpu,cpu@0.5", cores=2)
    with make_trainer(reps, devices, "average", n, batch_size=8, merge_period=32,
                      timeout=30) as tr:
        out = tr.run_epoch(0)
    for d, speed in zip(out["devices"], (1.0, 0.5), strict=True):
        assert d["updates"] * latency / speed <= d["busy_s"] <= out["train_seconds"]
        assert d["idle_s"] >= 0.0


class _SpinningReplica(FakeReplica):
    """A fake replica whose step burns CPU for its latency instead of sleeping."""

    def train_batch(self, rows, lr):
        end = time.thread_time() + self.latency_per_step
        while time.thread_time() < end:
            pass
        return super().train_batch(rows, lr)


def test_threaded_cpu_time_is_the_worker_threads():
    """``cpu_s`` counts the CPU time of the thread that ran a device's steps: about none for a
    step that sleeps (busy but waiting), at least the burnt time for a step that computes, and
    never more than its busy time (one thread)."""
    n, latency = 64, 2e-3
    reps = [FakeReplica(n, latency_per_step=latency, latency_per_sample=0.0, seed=0),
            _SpinningReplica(n, latency_per_step=latency, latency_per_sample=0.0, sleep=False,
                             seed=0)]
    devices = parse_devices("cpu,cpu", cores=2)
    with make_trainer(reps, devices, "average", n, batch_size=8, merge_period=32,
                      timeout=30) as tr:
        out = tr.run_epoch(0)
    sleeper, spinner = out["devices"]
    assert sleeper["updates"] > 0 and spinner["updates"] > 0
    assert sleeper["cpu_s"] < 0.5 * sleeper["busy_s"]
    assert spinner["updates"] * latency <= spinner["cpu_s"] <= spinner["busy_s"] * 1.05 + 1e-3


def test_a_timed_out_trainer_refuses_further_epochs():
    """After a worker stayed silent past ``timeout`` the workers are stopped and the trainer
    is unusable: the next epoch raises at once instead of waiting again."""
    reps = [FakeReplica(400, latency_per_sample=1e-6, hang_at_step=1, hang_seconds=3.0),
            FakeReplica(400, latency_per_sample=1e-6)]
    with make_trainer(reps, None, "average", 400, batch_size=50, merge_period=200,
                      timeout=0.5) as tr:
        with pytest.raises(DeviceFailure, match="did not finish"):
            tr.run_epoch(0)
        with pytest.raises(DeviceFailure, match="unusable after an earlier failure"):
            tr.run_epoch(0)


def test_a_failed_device_is_dropped_and_rejoins_from_the_merged_model():
    """Elastic training: the rows of a device that fails go back to the queue and its work of
    that period is discarded (no loss, no busy time in the merge record); with
    ``rejoin_after=0`` it rejoins at the next period, from the merged model, and takes rows
    again; the epoch still trains on every row once."""
    n = 64
    reps = [FakeReplica(n, sleep=False, seed=0),
            FakeReplica(n, sleep=False, seed=0, fail_at_step=1)]
    log = ListLog()
    tr = make_trainer(reps, None, "adaptive", n, batch_size=8, b_min=8, merge_period=32,
                      delta_b=8, mode="simulated", rejoin_after=0, log=log)
    out = tr.run_epoch(0)
    events = [e for e, _ in log.records]
    assert events.index("device_dropped") < events.index("device_rejoined")
    first = next(f for e, f in log.records if e == "merge")
    assert first["devices"][1]["loss"] == 0.0 and first["devices"][1]["busy_s"] == 0.0
    assert tr.alive == [True, True] and len(reps[1].history) > 1
    assert out["samples"] == n
