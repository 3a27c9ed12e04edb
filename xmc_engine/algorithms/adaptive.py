"""Adaptive SGD (arXiv 2110.07029 §III): dynamic scheduling, normalized merging, adaptive batches.

Per merge period of ``S`` samples (DESIGN.md §4): devices draw batches from one shared cursor
(faster devices make more updates), each steps with ``lr_i = lr(t) b_i / B``; the merge weights
are the shares of updates ``p_i = c_i / Σ c``, boosted by adaptive normalization while the merged
model's L2 norm rises; the merged model gets momentum ``z_t = w̄_t + μ (z_{t-1} − z_{t-2})`` and is
broadcast; after warm-up the batch sizes adapt so that all devices make the same number of
updates per period.

How the defaults were chosen (the lead benchmarks them on real data; paper values marked)
-------------------------------------------------------------------------------------------
``batch_size = 128``: SLIDE's and the field's reference batch for Amazon-670K / Delicious-200K, in
the middle (log scale) of the paper's range. ``b_min, b_max, delta_b = 32, 1024, 32``: the paper.
``merge_period = 4096`` samples (32 base batches): each device needs >= ~10 updates per period
for ``p_i`` to resolve a 10 % speed difference (2-3 devices at ``B = 128`` make 10-16 each), and
a merge must stay cheap against the period. The row-sparse merge (``sparse_merge``, the CPU)
reads and writes only the ``W1`` rows the period changed: on debian_debtags at hidden 256
(59 % of the rows touched per period) a merge takes about 10 ms against 19 ms dense, some 10 % of
a period of two devices. Measured with ``bench/bench_tta_sweep.py`` (``cpu,cpu@0.5``, median
time to 97 % of the study's best P@1 over 15 / 12 seeds; ``bench/results/tta_sweep/``): 4096 and
8192 were level (debian_debtags 0.55 / 0.54 s, delicious 0.44 / 0.44 s), 2048 slower (0.63 s on
debian_debtags: more merges, each hardly cheaper). 4096 keeps the replicas closer and gives
twice the barriers for mid-epoch evaluation at no measured cost; ~130 merges per epoch on
Amazon-670K.
``momentum = 0.0``: chosen by measurement (``bench/bench_heterogeneous.py
--ablation``, delicious, 3 seeds, ``cpu,cpu@0.5`` and ``cpu,cpu@0.5,cpu@0.25``): final P@1 with
μ = 0 / 0.5 / 0.9 was 0.595 / 0.587 / 0.566 and 0.574 / 0.562 / 0.601 with SGD (lr 1), and
0.641 / 0.618 / 0.505 and 0.635 / 0.623 / 0.514 with Adagrad (lr 0.05). The block-momentum
reasoning (BMUF, Chen & Huo 2016: ``1 − 1/n``) suggested 0.5; on these runs it did not pay, and
0.9 diverged with Adagrad. Checked again on the current engine (``bench/bench_tta_sweep.py``,
``cpu,cpu@0.5``, 10 seeds, Adagrad; ``bench/results/tta_sweep/*_momentum.json``): median time
to the study's target with μ = 0 / 0.5 / 0.9 was 0.58 / 0.85 s / never on debian_debtags and
0.42 / 0.45 s / never on delicious. μ = 0 also lets the merge stay row-sparse.
``boost = True`` with ``flag_rule = "norm_rise"``: the paper's method (its flag condition is
unpublished; ours is defined in :class:`~xmc_engine.scheduler.merge.NormTrend`); ``"never"`` is
the no-boost control.
``warmup_epochs = 1``: the paper warms up with equal batches for its first epochs; one epoch is
enough for the ramp on the XC datasets (~60+ merges). ``lr_decay = 0.1``: halves ``lr`` after ten
epochs past warm-up, in line with the 10–30 epochs XMC models train for. ``rule = "step"``: the
paper's; ``"proportional"`` is the improvement to measure against it. ``deadband = 0.05``:
the step rule leaves a device alone when its update count is within 5 % of the mean, which
stops it oscillating between the two ``Δb`` grid points around the steady state (0 = the paper's
strict rule, still at least half an update). Periods shorter than ``S / 2`` (the remainder at the
end of an epoch) merge normally but do not adapt the batch sizes: one or two updates per device
are too few to measure anything.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xmc_engine.algorithms.base import ConfigMixin, Policy
from xmc_engine.distributed import combine_nodes
from xmc_engine.errors import ConfigError
from xmc_engine.scheduler.controller import RULES, BatchSizeController, learning_rate
from xmc_engine.scheduler.merge import (
    FLAG_RULES,
    NormTrend,
    adaptive_normalization,
    central_momentum,
    merge_weights,
    sq_norms,
    weighted_merge,
)

logger = logging.getLogger(__name__)

__all__ = ["AdaptiveConfig", "AdaptiveSGD"]


@dataclass
class AdaptiveConfig(ConfigMixin):
    """Options of Adaptive SGD (defaults and their reasons: module docstring).

    Attributes
    ----------
    merge_period : int
        ``S``, samples per merge period ("mega-batch").
    warmup_epochs : float
        Epochs of equal batches ``B`` and a linear learning-rate ramp.
    batch_size : int
        ``B``, the base batch size.
    b_min, b_max, delta_b : int
        Batch-size bounds and step (paper: 32, 1024, 32).
    rule : {'step', 'proportional', 'fixed'}
        Batch-size adaptation (:class:`~xmc_engine.scheduler.controller.BatchSizeController`).
    deadband : float
        Step rule: leave a device alone when its update count is within this fraction of the
        mean count (at least half an update; 0 = the paper's strict rule).
    momentum : float
        ``μ`` of the central momentum, in [0, 1).
    boost : bool
        Adaptive normalization on/off.
    boost_factor : float
        Relative raise/lower of the largest/smallest weight (paper: 0.1).
    flag_rule : {'norm_rise', 'always', 'never'}
        When the boost applies (:class:`~xmc_engine.scheduler.merge.NormTrend`).
    lr_decay : float
        ``λ`` in ``lr(e) = lr0 / (1 + λ (e − e_warm))``.
    sparse_merge : bool
        Merge and broadcast only the ``W1`` rows the replicas changed in the period, where the
        replicas and backend support it (the CPU) and ``momentum == 0``
        (:func:`~xmc_engine.scheduler.merge.merge_changed_rows`). The merged model is the same
        (to float32 rounding); ``False`` forces the dense merge.
    """

    merge_period: int = 4096
    warmup_epochs: float = 1.0
    batch_size: int = 128
    b_min: int = 32
    b_max: int = 1024
    delta_b: int = 32
    rule: str = "step"
    deadband: float = 0.05
    momentum: float = 0.0
    boost: bool = True
    boost_factor: float = 0.1
    flag_rule: str = "norm_rise"
    lr_decay: float = 0.1
    sparse_merge: bool = True

    def __post_init__(self):
        if self.merge_period < 1:
            raise ConfigError(f"merge_period must be >= 1, got {self.merge_period}")
        if self.warmup_epochs < 0:
            raise ConfigError(f"warmup_epochs must be >= 0, got {self.warmup_epochs}")
        if not (1 <= self.b_min <= self.batch_size <= self.b_max):
            raise ConfigError("need 1 <= b_min <= batch_size <= b_max, got "
                              f"{self.b_min}, {self.batch_size}, {self.b_max}")
        if self.delta_b < 1:
            raise ConfigError(f"delta_b must be >= 1, got {self.delta_b}")
        if self.rule not in RULES:
            raise ConfigError(f"rule must be one of {RULES}, got {self.rule!r}")
        if self.deadband < 0:
            raise ConfigError(f"deadband must be >= 0, got {self.deadband}")
        if not (0.0 <= self.momentum < 1.0):
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if not (0.0 <= self.boost_factor < 1.0):
            raise ConfigError(f"boost_factor must be in [0, 1), got {self.boost_factor}")
        if self.flag_rule not in FLAG_RULES:
            raise ConfigError(f"flag_rule must be one of {FLAG_RULES}, got {self.flag_rule!r}")
        if self.lr_decay < 0:
            raise ConfigError(f"lr_decay must be >= 0, got {self.lr_decay}")


class AdaptiveSGD(Policy):
    """Adaptive SGD policy (arXiv 2110.07029 §III-A..C); see the module docstring."""

    name = "adaptive"
    static = False

    def __init__(self, config: AdaptiveConfig | None = None, **overrides):
        self.config = self._make_config(AdaptiveConfig, config, overrides)
        self.merge_period = self.config.merge_period

    def setup(self, replicas: Sequence, n_samples: int) -> None:
        super().setup(replicas, n_samples)
        c = self.config
        self.controller = BatchSizeController(
            self.n_devices, c.batch_size, b_min=c.b_min, b_max=c.b_max, delta_b=c.delta_b,
            rule=c.rule, warmup_epochs=c.warmup_epochs, deadband=c.deadband)
        self.trend = NormTrend(c.flag_rule if c.boost else "never")
        # sum(W1**2) of the central model, kept up to date by the row-sparse merge.
        self._sq_w1 = None
        xp = self.backend.xp
        self._wbar = [xp.empty_like(a) for a in self.central]
        if c.momentum > 0:
            # z_{t-1} and z_{t-2} start at the initial model: the first merge has no momentum.
            self._z1 = self.central
            self._z2 = [xp.array(a, copy=True) for a in self.central]
            self._spare = [xp.empty_like(a) for a in self.central]

    def batch_sizes(self) -> list[int]:
        return list(self.controller.batch_sizes)

    def learning_rates(self, lr0: float, progress: float) -> tuple[float, list[float]]:
        c = self.config
        lr = learning_rate(lr0, progress, warmup_epochs=c.warmup_epochs, decay=c.lr_decay)
        return lr, self.controller.learning_rates(lr)

    def merge(self, replicas: Sequence, updates: Sequence[int]) -> dict[str, Any]:
        """Normalized merge + adaptive normalization + central momentum + broadcast (§III-B)."""
        c = self.config
        flag = self.trend.flag
        if c.sparse_merge and c.momentum == 0:
            info = self._merge_rows_only(replicas, updates, flag)
            if info is not None:
                return info
        params = [r.params() for r in replicas]
        counts, bad = self._finite_updates(params, updates)
        p = adaptive_normalization(merge_weights(counts), flag, c.boost_factor)
        weighted_merge(params, p, self._wbar, self.backend, check=False)
        # Across nodes (DESIGN.md §6): w̄ <- Σ c_node w̄_node / Σ c_node, before the norm trend
        # and the momentum so that both see the global model, identically on every rank.
        nodes = combine_nodes(self, self._wbar, float(np.asarray(updates)[counts > 0].sum()))
        norm = None
        if self.trend.rule == "norm_rise":
            sq = sq_norms(self._wbar, self.backend)
            self._sq_w1 = sq[0]
            norm = math.sqrt(sum(sq))
            self.trend.observe(norm)
        if c.momentum > 0:
            central_momentum(self._wbar, self._z1, self._z2, c.momentum, self._spare,
                             self.backend)
            self._z2, self._z1, self._spare = self._z1, self._spare, self._z2
            self.central = self._z1
        else:
            self.central, self._wbar = self._wbar, self.central
        self._broadcast(replicas, self.central)
        return {"weights": [float(x) for x in p], "flag": int(flag), "norm": norm,
                "nonfinite": bad, **nodes}

    def _merge_rows_only(self, replicas, updates, flag) -> dict[str, Any] | None:
        """The merge with the row-sparse path (``sparse_merge``); ``None`` where it does not
        apply or a replica is non-finite (then the dense merge runs, which finds it)."""
        p = adaptive_normalization(merge_weights(updates), flag, self.config.boost_factor)
        norm_rise = self.trend.rule == "norm_rise"
        if norm_rise and self._sq_w1 is None:
            self._sq_w1 = sq_norms(self.central[:1], self.backend)[0]
        delta = self._merge_changed_rows(replicas, p)
        if delta is None:
            return None
        norm = None
        if norm_rise:
            self._sq_w1 += delta
            norm = math.sqrt(max(self._sq_w1, 0.0) + sum(sq_norms(self.central[1:],
                                                                  self.backend)))
            self.trend.observe(norm)
        return {"weights": [float(x) for x in p], "flag": int(flag), "norm": norm,
                "nonfinite": []}

    def state_dict(self) -> dict[str, Any]:
        """Batch sizes and the norm history of the trend flag (momentum buffers restart at the
        central model on resume)."""
        return {"name": self.name, "batch_sizes": self.batch_sizes(),
                "norms": list(self.trend.norms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        b = [int(x) for x in state.get("batch_sizes", self.batch_sizes())]
        if len(b) == self.n_devices:
            self.controller.batch_sizes = b
        self.trend.norms = [float(x) for x in state.get("norms", [])][-2:]

    def end_period(self, progress, updates, samples, busy_s) -> None:
        """Adapt the batch sizes (§III-C), except after a short epoch-remainder period."""
        if 2 * sum(samples) >= self.merge_period:
            self.controller.update(progress, updates, samples, busy_s)
