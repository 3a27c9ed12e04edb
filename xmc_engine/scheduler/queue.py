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
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["BatchQueue", "PeriodAccount", "epoch_permutation"]


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
    """

    def __init__(self, n_samples: int, n_devices: int, merge_period: int, *, seed: int = 0,
                 static: bool = False):
        if n_samples < 1 or n_devices < 1 or merge_period < 1:
            raise ValueError(f"BatchQueue needs n_samples, n_devices, merge_period >= 1, got "
                             f"{n_samples}, {n_devices}, {merge_period}")
        self.n_samples = int(n_samples)
        self.n_devices = int(n_devices)
        self.merge_period = int(merge_period)
        self.seed = int(seed)
        self.static = bool(static)
        self._lock = threading.Lock()
        self._perm = np.empty(0, dtype=np.int64)
        self._cursor = 0
        self.epoch = -1
        self.period = -1
        self.account: PeriodAccount | None = None
        self.history: list[PeriodAccount] = []

    # -- epoch / period boundaries (main thread, between periods) -------------------------------
    def start_epoch(self, epoch: int) -> None:
        """Shuffle the rows for ``epoch`` and reset the cursor."""
        self._perm = epoch_permutation(self.n_samples, self.seed, epoch)
        self._cursor = 0
        self.epoch = int(epoch)
        self.period = -1
        self.history = []

    @property
    def remaining(self) -> int:
        """Samples of the epoch not yet handed out."""
        return self.n_samples - self._cursor

    @property
    def epoch_done(self) -> bool:
        return self._cursor >= self.n_samples

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
        self._max_b = bmax
        self._taken = 0
        self.period += 1
        if self.static:
            q, r = divmod(budget, self.n_devices)
            self._quota = [q + (1 if i < r else 0) for i in range(self.n_devices)]
        self.account = PeriodAccount(self.period, budget, b, [0] * self.n_devices,
                                     [0] * self.n_devices)
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
            if self.static:
                n = min(bi, self._quota[device_id] - acct.samples[device_id])
            elif self._taken + self._max_b <= acct.budget or self._taken == 0 or self._last:
                n = min(bi, left)
            else:
                return None
            if n <= 0:
                return None
            rows = self._perm[self._cursor:self._cursor + n]
            self._cursor += n
            self._taken += n
            acct.samples[device_id] += n
            acct.updates[device_id] += 1
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
