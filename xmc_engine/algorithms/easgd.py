"""Elastic Averaging SGD: the ``easgd`` baseline (Zhang, Choromanska & LeCun, NeurIPS 2015).

"Deep learning with Elastic Averaging SGD" (arXiv 1412.6651), synchronous EASGD, §3 eq. (5)-(6).
Each of the ``n`` devices runs plain SGD on its own replica ``x_i`` (equal static shares of the
data, equal batches ``b``, the same learning rate); every ``τ`` local steps (one merge period of
``S = n τ b`` samples) all devices meet at the barrier and, with the centre ``x̃`` held by the
main thread::

    x_i <- x_i − α (x_i − x̃)                for every device i     (elastic pull)
    x̃   <- x̃ + α Σ_i (x_i − x̃)                                   (both with the old x_i, x̃)

The replicas are *not* overwritten with the centre (unlike model averaging): they keep exploring,
held to ``x̃`` by the elastic force. The centre ``x̃`` is the model that is evaluated, checkpointed
and returned (:meth:`~xmc_engine.algorithms.base.Policy.central_params`).

The paper also has an asynchronous variant (each worker meets the centre on its own clock every
``τ`` steps); we run the synchronous one, at the period barrier, as the paper's analysis does
(eq. 5-6): with heterogeneous devices the slowest sets the pace, as for ``average`` and ``sync``.

Defaults. ``β = n α = 0.9`` (the paper's recommended moving rate, §5: "β = 0.9", α = β/n);
``τ = 16`` local steps between elastic updates (in the middle of the paper's CIFAR-10 grid
τ ∈ {1, 4, 16, 64}; with ``b = 128`` and two devices a period is 4096 samples, the same order as
the ``merge_period`` of ``adaptive`` and ``average``). Batch size, warm-up and decay are the
shared defaults so that only the algorithm differs.

Implementation: the centre update is one :func:`~xmc_engine.scheduler.merge.weighted_merge`,
``x̃' = (1 − n α) x̃ + α Σ_i x_i`` (the backend's ``weighted_sum`` kernel), then each replica takes
its elastic step toward the old centre with :func:`~xmc_engine.scheduler.merge.elastic_update`
(the ``elastic`` kernel). Replicas that went non-finite are left out of the centre update and
reset to the new centre; replicas of failed devices (``self.excluded``) are left out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xmc_engine.algorithms.base import ConfigMixin, Policy
from xmc_engine.errors import ConfigError
from xmc_engine.scheduler.controller import learning_rate
from xmc_engine.scheduler.merge import elastic_update, weighted_merge

logger = logging.getLogger(__name__)

__all__ = ["EASGD", "EASGDConfig", "ElasticPolicy"]


@dataclass
class EASGDConfig(ConfigMixin):
    """Options of EASGD (module docstring).

    Attributes
    ----------
    batch_size : int
        ``b``, every device's batch.
    tau : int
        ``τ``, local steps per device between elastic updates (period ``S = n τ b``).
    beta : float
        ``β = n α``, the moving rate of the centre (paper: 0.9), in (0, 1].
    alpha : float
        ``α``, the elastic coefficient; ``0`` means ``β / n``.
    warmup_epochs : float
        Linear learning-rate ramp over these epochs.
    lr_decay : float
        ``λ`` in ``lr(e) = lr0 / (1 + λ (e − e_warm))``.
    """

    batch_size: int = 128
    tau: int = 16
    beta: float = 0.9
    alpha: float = 0.0
    warmup_epochs: float = 1.0
    lr_decay: float = 0.1

    def __post_init__(self):
        self._check_min(1, "batch_size", "tau")
        if not (0.0 < self.beta <= 1.0):
            raise ConfigError(f"beta must be in (0, 1], got {self.beta}")
        if not (0.0 <= self.alpha <= 1.0):
            raise ConfigError(f"alpha must be in [0, 1] (0 = beta / n), got {self.alpha}")
        self._check_min(0, "warmup_epochs", "lr_decay")


class ElasticPolicy(Policy):
    """Shared part of the elastic baselines (EASGD, CROSSBOW): static equal shares, equal batch
    ``b`` and learning rate, a period of ``τ`` local steps per device, a centre that is not
    broadcast. Subclasses set ``config_class`` and implement :meth:`merge`."""

    static = True
    config_class: type = EASGDConfig

    def __init__(self, config=None, **overrides):
        self.config = self._make_config(self.config_class, config, overrides)
        self.merge_period = self.config.tau * self.config.batch_size

    def setup(self, replicas: Sequence, n_samples: int) -> None:
        super().setup(replicas, n_samples)
        self.merge_period = self.n_devices * self.config.tau * self.config.batch_size
        self.alpha = self._alpha(self.n_devices)
        self._diff = [self.backend.xp.empty_like(a) for a in self.central]  # elastic scratch

    def _alpha(self, n: int) -> float:
        raise NotImplementedError

    def batch_sizes(self) -> list[int]:
        return [self.config.batch_size] * self.n_devices

    def learning_rates(self, lr0: float, progress: float) -> tuple[float, list[float]]:
        c = self.config
        lr = learning_rate(lr0, progress, warmup_epochs=c.warmup_epochs, decay=c.lr_decay)
        return lr, [lr] * self.n_devices

    def _elastic_pull(self, params: Sequence, good: Sequence[int], center: Sequence) -> None:
        """``x_i <- x_i − α (x_i − center)`` for the replicas ``good``."""
        for i in good:
            elastic_update(params[i], center, self.alpha, self._diff, self.backend)

    def _split(self, replicas: Sequence) -> tuple[list, list[int], list[int]]:
        """``(params, good, bad)``: replicas taking part, and the non-finite ones (to reset)."""
        params = [r.params() for r in replicas]
        counts, bad = self._finite_updates(params, np.ones(len(replicas)))
        good = [i for i in range(len(replicas)) if counts[i] > 0]
        return params, good, bad

    def _info(self, good: Sequence[int], bad: Sequence[int]) -> dict[str, Any]:
        w = [self.alpha if i in good else 0.0 for i in range(self.n_devices)]
        return {"weights": w, "alpha": self.alpha, "nonfinite": list(bad)}


class EASGD(ElasticPolicy):
    """Synchronous Elastic Averaging SGD (Zhang et al. 2015, eq. 5-6); module docstring."""

    name = "easgd"
    config_class = EASGDConfig

    def setup(self, replicas: Sequence, n_samples: int) -> None:
        super().setup(replicas, n_samples)
        self._spare = [self.backend.xp.empty_like(a) for a in self.central]

    def _alpha(self, n: int) -> float:
        c = self.config
        return c.alpha if c.alpha > 0 else c.beta / n

    def merge(self, replicas: Sequence, updates: Sequence[int]) -> dict[str, Any]:
        """``x̃' = x̃ + α Σ_i (x_i − x̃)``, then ``x_i <- x_i − α (x_i − x̃)`` (old ``x̃``)."""
        params, good, bad = self._split(replicas)
        a = self.alpha
        weighted_merge([self.central] + [params[i] for i in good],
                       [1.0 - a * len(good)] + [a] * len(good), self._spare, self.backend,
                       check=False)
        self._elastic_pull(params, good, self.central)
        self.central, self._spare = self._spare, self.central
        for i in bad:
            replicas[i].set_params(self.central)
        return self._info(good, bad)
