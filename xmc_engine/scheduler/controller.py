"""The learning-rate schedule of every algorithm, and Adaptive SGD's per-device batch sizes.

arXiv 2110.07029 §III-C ("adaptive batch size") and §IV (warm-up, learning-rate schedule),
DESIGN.md §4.2, §4.4, §4.5.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xmc_engine.config import BATCH_RULES, LR_SCALINGS, PLATEAU_FACTOR, PLATEAU_STOP_SCALE

logger = logging.getLogger(__name__)

__all__ = ["BatchSizeController", "Plateau", "Schedule", "batch_lr_factor", "learning_rate"]


def learning_rate(lr0: float, progress: float, *, warmup_epochs: float = 0.0,
                  decay: float = 0.0) -> float:
    """Base learning rate ``lr(t)`` after ``progress`` epochs (float, e.g. 1.25).

    Warm-up (``progress < warmup_epochs``): linear ramp ``lr0 * progress / warmup_epochs`` — the
    caller passes the progress at the *end* of the period about to run, so the first period does
    not get ``lr = 0``. After warm-up: ``lr0 / (1 + decay * (e - warmup_epochs))`` with ``e`` the
    whole epochs done when the period starts (DESIGN.md §4.5:
    ``lr(e) = lr0 / (1 + λ (e − e_warm))``); a period never spans two epochs, so a period
    ending at ``progress`` runs in epoch ``ceil(progress) - 1`` (the last period of epoch 0,
    ending at 1.0, still gets ``lr0``).
    """
    if warmup_epochs > 0 and progress < warmup_epochs:
        return lr0 * max(progress, 0.0) / warmup_epochs
    e = int(np.ceil(progress - 1e-9)) - 1 - warmup_epochs
    return lr0 / (1.0 + decay * max(e, 0.0))


@dataclass(frozen=True)
class Schedule:
    """The learning-rate schedule of a run, the same for every algorithm (DESIGN.md §4.5).

    ``lr(progress)`` = ``scale`` x :func:`learning_rate` ``(lr, progress, warmup_epochs,
    decay)``; the trainer evaluates it once per period at the progress (epochs) reached at the
    end of that period. ``warmup_epochs`` also ends the equal-batch warm-up of Adaptive SGD's
    batch-size control. ``scale`` is what :class:`Plateau` has made of the rate so far (1
    otherwise); the driver replaces the schedule with a new ``scale`` between epochs.
    """

    lr: float
    warmup_epochs: float = 0.0
    decay: float = 0.0
    scale: float = 1.0

    def __call__(self, progress: float) -> float:
        return self.scale * learning_rate(self.lr, progress, warmup_epochs=self.warmup_epochs,
                                          decay=self.decay)


@dataclass
class Plateau:
    """``lr_decay="plateau"``: the rate's multiplier from a held-out error after each epoch.

    :meth:`update` takes the error on the held-out rows after an epoch (the driver passes the
    top-1 error, ``1 - P@1``): below ``best`` it becomes the new best and the rate stays;
    otherwise (level, higher, or not finite) the multiplier ``scale`` is multiplied by
    ``factor``. Like a fixed decay it lowers the rate where more of it stops helping (the small
    sets overfit from epoch 1-4, bench/RESULTS.md), and unlike one it leaves the rate alone for
    as long as every epoch still improves on held-out rows (large data that is far from fitting
    its training rows). Once ``scale`` is below ``stop_scale`` the rule is :attr:`done`: the
    driver stops training there (a converged model would otherwise go on halving a rate that
    no longer changes it)."""

    factor: float = PLATEAU_FACTOR
    best: float = math.inf
    scale: float = 1.0
    stop_scale: float = PLATEAU_STOP_SCALE

    @property
    def done(self) -> bool:
        """Has the rate been lowered below ``stop_scale`` (training should stop)?"""
        return self.scale < self.stop_scale

    def update(self, error: float) -> bool:
        """Record one epoch's held-out error; returns whether the rate was lowered."""
        if error < self.best:  # False for NaN: a diverging epoch lowers the rate
            self.best = float(error)
            return False
        self.scale *= self.factor
        return True


def batch_lr_factor(b: int, base: int, scaling: str = "linear") -> float:
    """A batch of ``b`` rows steps at ``lr(t) x`` this factor, ``lr(t)`` being the rate of a batch
    of ``base`` rows: ``b / base`` (``scaling="linear"``, arXiv 2110.07029 §III-C),
    ``sqrt(b / base)`` (``"sqrt"``) or 1 (``"none"``)."""
    if scaling == "linear":
        return b / base
    if scaling == "sqrt":
        return math.sqrt(b / base)
    if scaling == "none":
        return 1.0
    raise ValueError(f"learning-rate scaling {scaling!r}: choose one of {', '.join(LR_SCALINGS)}")


class BatchSizeController:
    """Batch size ``b_i`` of every device, updated after each merge period.

    Parameters
    ----------
    n_devices : int
    batch_size : int
        ``B``, the base batch size; every device uses it during warm-up.
    b_min, b_max, delta_b : int
        Bounds and step of the adaptation (paper: 32, 1024, 32).
    rule : {'step', 'proportional', 'fixed'}
        ``step`` — the paper's rule (arXiv 2110.07029 §III-C): ``b_i -= Δb`` if ``p_i < 1/n``,
        ``b_i += Δb`` if ``p_i > 1/n``, clipped to ``[b_min, b_max]``. Since
        ``p_i - 1/n = (c_i - c̄)/Σc`` this compares ``c_i`` with the mean ``c̄``; a device with
        ``|c_i - c̄| <= max(0.5, deadband * c̄)`` is left alone. ``deadband = 0`` is the paper's
        strict rule, which keeps oscillating between the two ``Δb`` grid points around the
        steady state (e.g. 18 % apart in update counts for ``B = 128, Δb = 16`` and a 2:1 speed
        ratio); the default 5 % stops at the first grid point close enough to it.
        ``proportional`` — ``b_i = n B v_i / Σ_j v_j`` with ``v_i`` = samples per busy second
        measured in the period (busy time includes the emulated slow-down, excludes barrier
        waits): every device then needs the same time per update, which is the steady state
        of the step rule, reached in one period. Rounded so that ``Σ b_i = n B``, then clipped.
        ``fixed`` — ``b_i = B`` always (the baselines).
    warmup_epochs : float
        No adaptation while ``progress < warmup_epochs`` (equal batches ``B``).
    deadband : float
        Relative dead band of the step rule (fraction of the mean update count), see ``step``.
    """

    def __init__(self, n_devices: int, batch_size: int, *, b_min: int = 32, b_max: int = 1024,
                 delta_b: int = 32, rule: str = "step", warmup_epochs: float = 0.0,
                 deadband: float = 0.05):
        if rule not in BATCH_RULES:
            raise ValueError(f"unknown batch-size rule {rule!r}; expected one of {BATCH_RULES}")
        if not (1 <= b_min <= b_max):
            raise ValueError(f"need 1 <= b_min <= b_max, got {b_min}, {b_max}")
        self.n_devices = int(n_devices)
        self.batch_size = int(batch_size)
        self.b_min, self.b_max, self.delta_b = int(b_min), int(b_max), int(delta_b)
        self.rule = rule
        self.warmup_epochs = float(warmup_epochs)
        self.deadband = float(deadband)
        self.batch_sizes = [self.batch_size] * self.n_devices

    def learning_rates(self, lr: float, scaling: str = "linear") -> list[float]:
        """Per-device ``lr_i = lr(t) * b_i / B`` (``scaling="linear"``, arXiv 2110.07029
        §III-C), ``lr(t) * sqrt(b_i / B)`` (``"sqrt"``) or ``lr(t)`` (``"none"``)."""
        return [lr * batch_lr_factor(b, self.batch_size, scaling) for b in self.batch_sizes]

    def update(self, progress: float, updates: Sequence[int], samples: Sequence[int],
               busy_s: Sequence[float]) -> list[int]:
        """Adapt the batch sizes after a merge period; returns (and keeps) the new sizes.

        Parameters
        ----------
        progress : float
            Epochs done at the end of the period that just merged.
        updates, samples, busy_s : sequences of length n_devices
            ``c_i``, samples taken and busy seconds of each device in that period.
        """
        if self.rule == "fixed" or progress < self.warmup_epochs or self.n_devices == 1:
            return self.batch_sizes
        c = np.asarray(updates, dtype=np.float64)
        if c.sum() <= 0:
            return self.batch_sizes
        if self.rule == "step":
            mean = c.mean()
            band = max(0.5, self.deadband * mean)
            new = []
            for b, ci in zip(self.batch_sizes, c, strict=True):
                if ci < mean - band:
                    b -= self.delta_b
                elif ci > mean + band:
                    b += self.delta_b
                new.append(int(min(max(b, self.b_min), self.b_max)))
            self.batch_sizes = new
            return new
        s = np.asarray(samples, dtype=np.float64)
        t = np.asarray(busy_s, dtype=np.float64)
        if np.any(s <= 0) or np.any(t <= 0):
            return self.batch_sizes  # a device sat out the period: keep the sizes
        v = s / t
        target = self.n_devices * self.batch_size * v / v.sum()
        base = np.floor(target).astype(np.int64)
        short = int(self.n_devices * self.batch_size - base.sum())
        order = np.argsort(-(target - base), kind="stable")
        base[order[:short]] += 1
        self.batch_sizes = [int(min(max(b, self.b_min), self.b_max)) for b in base]
        return self.batch_sizes
