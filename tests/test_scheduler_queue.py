"""The dynamic batch queue: exactly-once epochs, the period rule, static quotas, thread safety."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xmc_engine.scheduler.queue import BatchQueue, epoch_permutation


def drain_period(q, order):
    """Take round-robin over ``order`` until every device is refused; returns the rows taken."""
    taken, active = [], list(order)
    while active:
        for i in list(active):
            rows = q.take(i)
            if rows is None:
                active.remove(i)
            else:
                taken.append(rows)
    return taken


@settings(max_examples=60, deadline=None)
@given(n_samples=st.integers(1, 3000), n_devices=st.integers(1, 4),
       S=st.integers(1, 1500), data=st.data(), static=st.booleans())
def test_epoch_exactly_once_and_period_bounds(n_samples, n_devices, S, data, static):
    q = BatchQueue(n_samples, n_devices, S, seed=7, static=static)
    q.start_epoch(3)
    seen = []
    while not q.epoch_done:
        b = data.draw(st.lists(st.integers(1, 300), min_size=n_devices, max_size=n_devices))
        R = q.remaining
        acct = q.start_period(b)
        rows = drain_period(q, range(n_devices))
        assert q.period_done
        total = sum(len(r) for r in rows)
        assert total == acct.total == sum(acct.samples)
        assert sum(acct.updates) == len(rows)
        if R <= S + max(b):           # last period: the whole remainder, < S + one batch
            assert total == R
            assert total <= S + max(b)
        else:                         # regular period: never overshoots S
            assert total <= S
            if static:
                assert total == S
            else:
                assert total > S - max(b)
        assert max(len(r) for r in rows) <= max(b)
        seen.extend(rows)
    allrows = np.concatenate(seen)
    assert len(allrows) == n_samples
    np.testing.assert_array_equal(np.sort(allrows), np.arange(n_samples))
    np.testing.assert_array_equal(allrows, epoch_permutation(n_samples, 7, 3))


def test_paper_rule_equal_batches_divide_period():
    q = BatchQueue(1000, 2, 256, seed=0)
    q.start_epoch(0)
    acct = q.start_period([64, 64])
    drain_period(q, [0, 1])
    assert acct.samples == [128, 128] and acct.updates == [2, 2]


def test_refused_device_stays_refused_and_others_continue():
    q = BatchQueue(10_000, 2, 300, seed=0)
    q.start_epoch(0)
    acct = q.start_period([32, 200])
    assert len(q.take(1)) == 200           # P = 200; 200 + max_b(200) > 300
    assert q.take(0) is None and q.take(1) is None
    assert acct.total == 200 and q.period_done


def test_static_quotas_are_equal():
    q = BatchQueue(1000, 3, 300, seed=0, static=True)
    q.start_epoch(0)
    acct = q.start_period([64, 64, 64])
    drain_period(q, [0, 0, 0, 1, 2])  # device 0 asks more often; quotas still hold
    assert acct.samples == [100, 100, 100]
    assert acct.updates == [2, 2, 2]


def test_epoch_permutation_depends_on_seed_and_epoch():
    a, b, c = (epoch_permutation(100, s, e) for s, e in [(0, 0), (0, 1), (1, 0)])
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    np.testing.assert_array_equal(a, epoch_permutation(100, 0, 0))


def test_threaded_takes_exactly_once():
    n_samples = 50_000
    q = BatchQueue(n_samples, 4, 5000, seed=1)
    q.start_epoch(0)
    got = [[] for _ in range(4)]

    def worker(i):
        while (rows := q.take(i)) is not None:
            got[i].append(rows)

    while not q.epoch_done:
        q.start_period([7, 13, 32, 5])
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=30)
    allrows = np.concatenate([r for g in got for r in g])
    np.testing.assert_array_equal(np.sort(allrows), np.arange(n_samples))


def test_bad_arguments():
    with pytest.raises(ValueError):
        BatchQueue(0, 1, 10)
    q = BatchQueue(10, 2, 10)
    q.start_epoch(0)
    with pytest.raises(ValueError):
        q.start_period([1])
    assert BatchQueue(10, 1, 10).take(0) is None  # no period open


def _drain_epoch(q, b=7):
    rows = []
    while not q.epoch_done:
        q.start_period([b])
        rows.extend(drain_period(q, [0]))
    return np.concatenate(rows)


def test_rows_put_first_come_next_and_the_epoch_keeps_its_length():
    n = 50
    q = BatchQueue(n, 1, 10, seed=7)
    q.start_epoch(2)
    q.start_period([4])
    before = np.concatenate(drain_period(q, [0]))  # one period: 8 rows (two batches of 4)
    at = len(before)
    first = [3, 3, 40, 1]  # repeats allowed
    q.put_first(first)
    after = _drain_epoch(q)
    order = epoch_permutation(n, 7, 2)
    np.testing.assert_array_equal(before, order[:at])
    np.testing.assert_array_equal(after[:4], first)
    np.testing.assert_array_equal(after[4:], order[at:n - 4])  # the order's last 4 left out
    # a resumed queue serves the same rows from a position taken after them
    q2 = BatchQueue(n, 1, 10, seed=7)
    q2.start_epoch(2)
    q2.start_period([4])
    drain_period(q2, [0])
    q2.put_first(first)
    q2.start_period([3])
    more = len(np.concatenate(drain_period(q2, [0])))  # the 4 first rows among them
    pos = q2.position()
    assert pos["first"] == {"at": at, "rows": first} and pos["cursor"] == at + more > at + 4
    q3 = BatchQueue(n, 1, 10, seed=7)
    q3.seek(pos)
    np.testing.assert_array_equal(_drain_epoch(q3), after[more:])
    q3.start_epoch(3)  # the next epoch is the plain order again
    assert q3.position().get("first") is None
    with pytest.raises(ValueError, match=r"rows must be in \[0, 50\)"):
        q3.put_first([50])
