"""The dynamic batch queue: one shared cursor over a shuffled epoch, cut into merge periods.

arXiv 2110.07029 §III-A ("dynamic scheduling"), DESIGN.md §4.1. Every device draws its next
batch from the same cursor, so a faster device simply draws more often; the merge period ends
when the period's sample budget is used up.

Period rule (dynamic mode)
--------------------------
At the start of a period with ``R`` samples left in the epoch and batch sizes ``b_j``, the
period's budget is ``T = R`` if ``R <= S + max_j b_j`` (the last period of the epoch takes the
whole remainder) and ``T = S`` otherwise. With ``P`` samples already taken in the period, device
``i`` may take its next ``b_i`` samples while ``P + max_j b_j <= T`` (the paper's condition
``processed + max_j b_j < S``, with ``<=`` so that periods of exactly ``S = k * b`` samples are
possible); the first batch of a period is always granted, truncated to ``T`` (so a period makes
progress even when ``S < max_j b_j``). Hence every period takes at most ``T`` samples: a
regular period takes between ``S - max_j b_j`` and ``S`` samples and never overshoots; the
leftover stays on the cursor for the next period. In the last period of the epoch, once that
condition fails, devices keep taking ``min(b_i, T - P)`` until the epoch is exhausted, so the
last period overshoots ``S`` by at most one batch and no sample is left behind.

Static mode (the ``average``/``sync`` baselines)
-------------------------------------------------
The budget ``T`` (same rule) is split into equal quotas ``T // n`` (+1 for the first ``T % n``
devices); device ``i`` takes ``min(b_i, quota_i - taken_i)`` until its quota is used.

In both modes each sample of the epoch permutation is handed out exactly once per epoch: takes
advance a single cursor under a lock.

Failed devices (elastic training)
---------------------------------
When a device fails, :meth:`BatchQueue.give_back` returns every row it took in the current period
(its in-flight batch and the batches whose updates die with its replica): they are handed out
again, before the cursor moves on, to the devices still running (in this period or the next), so
no sample of the epoch is lost. :meth:`BatchQueue.set_active` tells the static mode which devices
share the quotas.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["BatchQueue", "FixedAssignmentQueue", "PeriodAccount", "epoch_permutation"]


def epoch_permutation(n_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of the training rows in ``epoch`` (int64; depends only on its args)."""
    rng = np.random.default_rng([int(seed), int(epoch)])
    return rng.permutation(int(n_samples)).astype(np.int64)


@dataclass
class PeriodAccount:
    """What each device took in one merge period."""

    period: int
    budget: int
    batch_sizes: list[int]
    samples: list[int] = field(default_factory=list)
    updates: list[int] = field(default_factory=list)
    rows: list[list] = field(default_factory=list, repr=False)

    @property
    def total(self) -> int:
        return int(sum(self.samples))


class BatchQueue:
    """Shared, thread-safe batch queue over one epoch at a time.

    Parameters
    ----------
    n_samples : int
        Training rows; an epoch is a permutation of ``range(n_samples)``.
    n_devices : int
    merge_period : int
        ``S``, samples per merge period ("mega-batch").
    seed : int
        Seeds the epoch permutations (:func:`epoch_permutation`).
    static : bool
        Static equal quotas per period instead of the dynamic shared cursor.
    max_takes : int or None
        At most this many batches per device per period (``sync``: one, so that a period is
        one step); rows a period leaves stay on the cursor for the next one.
    """

    def __init__(self, n_samples: int, n_devices: int, merge_period: int, *, seed: int = 0,
                 static: bool = False, max_takes: int | None = None):
        if n_samples < 1 or n_devices < 1 or merge_period < 1:
            raise ValueError(f"BatchQueue needs n_samples, n_devices, merge_period >= 1, got "
                             f"{n_samples}, {n_devices}, {merge_period}")
        self.n_samples = int(n_samples)
        self.n_devices = int(n_devices)
        self.merge_period = int(merge_period)
        self.seed = int(seed)
        self.static = bool(static)
        self.max_takes = None if max_takes is None else int(max_takes)
        self._lock = threading.Lock()
        self._perm = np.empty(0, dtype=np.int64)
        self._cursor = 0
        self.epoch = -1
        self.period = -1
        self.account: PeriodAccount | None = None
        self.history: list[PeriodAccount] = []
        self._returned: list[np.ndarray] = []  # rows given back by failed devices
        self._first: dict | None = None  # put_first's rows in the open epoch, for position()
        self.active = [True] * self.n_devices
        #: Fixed number of merge periods per epoch (None: the ``S`` rule of the module docstring).
        #: Period ``k < P - 1`` ends at cursor ``(k + 1) n_samples // P``; the last takes the rest.
        #: Set by :mod:`xmc_engine.distributed` so that every node merges equally often.
        self.n_periods: int | None = None

    # -- epoch / period boundaries (main thread, between periods) -------------------------------
    def start_epoch(self, epoch: int) -> None:
        """Shuffle the rows for ``epoch`` and reset the cursor."""
        self._perm = epoch_permutation(self.n_samples, self.seed, epoch)
        self._cursor = 0
        self._returned = []
        self._first = None
        self.epoch = int(epoch)
        self.period = -1
        self.history = []

    def put_first(self, rows) -> None:
        """Serve ``rows`` (row indices, repeats allowed) next in the open epoch, in place of
        the rows its order would serve next; the epoch keeps its length, so as many rows of the
        end of its order go untrained in this epoch. Between periods only; :meth:`position`
        keeps them, so a resumed run serves the same rows (:meth:`seek`: the checkpoints of
        runs continued from a loss probe of engines before ``bench/RESULTS.md``'s "The probe
        trains the start of the run's first epoch", which trained the rows their probe's fit
        left first)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.n_samples):
            raise ValueError(f"put_first: rows must be in [0, {self.n_samples})")
        rest = self._perm[self._cursor:]
        k = min(rows.size, rest.size)
        self._perm = np.concatenate([self._perm[:self._cursor], rows[:k], rest[:rest.size - k]])
        self._first = {"at": self._cursor, "rows": rows[:k].tolist()}

    def position(self) -> dict | None:
        """Where the epoch stands between two periods, for a checkpoint (JSON-able); ``None``
        while rows given back by a failed device are still waiting (not resumable)."""
        if self._returned:
            return None
        out = {"epoch": self.epoch, "cursor": self._cursor, "period": self.period}
        if self._first is not None:
            out["first"] = self._first
        return out

    def seek(self, position: dict) -> None:
        """Continue the epoch of :meth:`position` from where it stood (resuming a run), with
        the rows :meth:`put_first` put in it (``first``, where it has them)."""
        self.start_epoch(int(position["epoch"]))
        first = position.get("first")
        if first is not None:
            self._cursor = int(first["at"])
            self.put_first(first["rows"])
        self._cursor = int(position["cursor"])
        self.period = int(position["period"])

    @property
    def remaining(self) -> int:
        """Samples of the epoch not yet handed out (given-back rows included)."""
        return self.n_samples - self._cursor + sum(len(r) for r in self._returned)

    @property
    def epoch_done(self) -> bool:
        return self._cursor >= self.n_samples and not self._returned

    def set_active(self, active) -> None:
        """Which devices take part from the next period on (static quotas skip the others)."""
        a = [bool(x) for x in active]
        if len(a) != self.n_devices or not any(a):
            raise ValueError(f"need {self.n_devices} flags with at least one True, got {a}")
        self.active = a

    def give_back(self, device_id: int) -> int:
        """Return every row ``device_id`` took in the current period to the queue (the device
        failed); its samples and updates are removed from the period's account. Thread-safe.

        Returns the number of samples given back.
        """
        acct = self.account
        if acct is None:
            return 0
        with self._lock:
            rows = acct.rows[device_id]
            n = int(sum(len(r) for r in rows))
            self._returned.extend(rows)
            acct.rows[device_id] = []
            acct.samples[device_id] -= n
            acct.updates[device_id] -= len(rows)
            self._taken -= n
        return n

    def start_period(self, batch_sizes) -> PeriodAccount:
        """Open the next merge period with per-device batch sizes ``b_i``; returns its account."""
        b = [int(x) for x in batch_sizes]
        if len(b) != self.n_devices or min(b) < 1:
            raise ValueError(f"need {self.n_devices} batch sizes >= 1, got {b}")
        if self.epoch_done:
            raise RuntimeError("start_period() after the end of the epoch")
        R, S, bmax = self.remaining, self.merge_period, max(b)
        self._last = R <= S + bmax
        budget = R if self._last else S
        if self.n_periods is not None:  # exactly n_periods per epoch (multi-node, DESIGN.md §6)
            k, done = self.period + 1, self.n_samples - R
            self._last = k >= self.n_periods - 1
            budget = R if self._last else max(1, (k + 1) * self.n_samples // self.n_periods - done)
        self._max_b = bmax
        self._taken = 0
        self.period += 1
        if self.static:
            ids = [i for i in range(self.n_devices) if self.active[i]]
            q, r = divmod(budget, len(ids))
            self._quota = [0] * self.n_devices
            for k, i in enumerate(ids):
                self._quota[i] = q + (1 if k < r else 0)
        self.account = PeriodAccount(self.period, budget, b, [0] * self.n_devices,
                                     [0] * self.n_devices, [[] for _ in range(self.n_devices)])
        self.history.append(self.account)
        return self.account

    # -- workers -------------------------------------------------------------------------------
    def take(self, device_id: int, b: int | None = None) -> np.ndarray | None:
        """Next batch of rows for ``device_id`` (int64 row indices), or ``None`` at period end.

        ``b`` overrides the device's batch size for this take. Thread-safe. Once a device has
        been refused in a period it stays refused until the next :meth:`start_period`.
        """
        acct = self.account
        if acct is None:
            return None
        with self._lock:
            bi = acct.batch_sizes[device_id] if b is None else int(b)
            left = acct.budget - self._taken
            if left <= 0:
                return None
            if self.max_takes is not None and acct.updates[device_id] >= self.max_takes:
                return None
            if self.static:
                n = min(bi, self._quota[device_id] - acct.samples[device_id])
            elif self._taken + self._max_b <= acct.budget or self._taken == 0 or self._last:
                n = min(bi, left)
            else:
                return None
            if n <= 0:
                return None
            if self._returned:  # rows of a failed device first
                rows = self._returned[0][:n]
                n = len(rows)
                if n == len(self._returned[0]):
                    self._returned.pop(0)
                else:
                    self._returned[0] = self._returned[0][n:]
            else:
                rows = self._perm[self._cursor:self._cursor + n]
                self._cursor += n
            self._taken += n
            acct.samples[device_id] += n
            acct.updates[device_id] += 1
            acct.rows[device_id].append(rows)
        return rows

    @property
    def period_done(self) -> bool:
        """True when no device can take anything more in the current period."""
        acct = self.account
        if acct is None:
            return True
        if self.static:
            return all(s >= q for s, q in zip(acct.samples, self._quota, strict=True))
        if self._last:
            return self._taken >= acct.budget
        return self._taken > 0 and self._taken + self._max_b > acct.budget


class FixedAssignmentQueue:
    """A batch queue with a fixed assignment of rows to devices (deterministic mode, for tests).

    Device ``i`` owns the rows ``[offsets[i], offsets[i] + counts[i])`` and visits them in the
    order ``rng([seed, epoch, ids[i]]).permutation(counts[i])``; each of the ``n_periods`` periods
    of an epoch it takes its quota ``floor((k+1) m/P) - floor(k m/P)`` in batches of its batch
    size. What a device computes depends only on its rows, its id and the batch sizes, not on
    timing or on which process it lives in: two ranks of one device each (``ids`` = the global
    device numbers) see exactly the batches of one process with two devices.
    """

    static = True

    def __init__(self, offsets, counts, ids, n_periods: int, *, seed: int = 0):
        self.offsets = [int(x) for x in offsets]
        self.counts = [int(x) for x in counts]
        self.ids = [int(x) for x in ids]
        self.n_devices = len(self.counts)
        self.n_samples = int(sum(self.counts))
        self.n_periods = int(n_periods)
        self.merge_period = max(1, self.n_samples // self.n_periods)
        self.seed = int(seed)
        self.active = [True] * self.n_devices
        self._lock = threading.Lock()
        self.period = -1
        self.account = None
        self.history: list = []

    def start_epoch(self, epoch: int) -> None:
        self._orders = [o + np.random.default_rng([self.seed, int(epoch), d]).permutation(m)
                        for o, m, d in zip(self.offsets, self.counts, self.ids, strict=True)]
        self._pos = [0] * self.n_devices
        self.epoch, self.period, self.history = int(epoch), -1, []

    def position(self) -> dict:
        """Where the epoch stands between two periods (see :meth:`BatchQueue.position`)."""
        return {"epoch": self.epoch, "pos": list(self._pos), "period": self.period}

    def seek(self, position: dict) -> None:
        self.start_epoch(int(position["epoch"]))
        self._pos = [int(x) for x in position["pos"]]
        self.period = int(position["period"])

    @property
    def remaining(self) -> int:
        return self.n_samples - sum(self._pos)

    @property
    def epoch_done(self) -> bool:
        return self.remaining == 0 or self.period >= self.n_periods - 1

    def set_active(self, active) -> None:
        if not all(active):
            raise ValueError("the fixed-assignment queue cannot drop a device")

    def give_back(self, device_id: int) -> int:
        raise ValueError("the fixed-assignment queue cannot drop a device")

    def start_period(self, batch_sizes):
        """Open the next of the ``n_periods`` periods."""
        k = self.period + 1
        P = self.n_periods
        self._end = [(k + 1) * m // P for m in self.counts]
        budget = sum(e - p for e, p in zip(self._end, self._pos, strict=True))
        self.period = k
        n = self.n_devices
        self.account = PeriodAccount(k, budget, [int(b) for b in batch_sizes], [0] * n,
                                     [0] * n, [[] for _ in range(n)])
        self.history.append(self.account)
        return self.account

    def take(self, device_id: int, b: int | None = None):
        acct = self.account
        with self._lock:
            bi = acct.batch_sizes[device_id] if b is None else int(b)
            n = min(bi, self._end[device_id] - self._pos[device_id])
            if n <= 0:
                return None
            p = self._pos[device_id]
            rows = self._orders[device_id][p:p + n]
            self._pos[device_id] = p + n
            acct.samples[device_id] += n
            acct.updates[device_id] += 1
            acct.rows[device_id].append(rows)
        return rows
