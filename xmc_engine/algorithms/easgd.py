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
τ ∈ {1, 4, 16, 64}; options: :class:`~xmc_engine.config.EASGDConfig`). Batch size and the
learning-rate schedule are the run's, so that only the algorithm differs.

Implementation: the centre update is one :func:`~xmc_engine.scheduler.merge.weighted_merge`,
``x̃' = (1 − n α) x̃ + α Σ_i x_i`` (the backend's ``weighted_sum`` kernel), then each replica takes
its elastic step toward the old centre with :func:`~xmc_engine.scheduler.merge.elastic_update`
(the ``elastic`` kernel). Replicas that went non-finite are left out of the centre update and
reset to the new centre; replicas of failed devices (``self.excluded``) are left out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from xmc_engine.algorithms.base import Policy
from xmc_engine.scheduler.merge import elastic_update, weighted_merge

logger = logging.getLogger(__name__)

__all__ = ["EASGD", "ElasticPolicy"]


class ElasticPolicy(Policy):
    """Shared part of the elastic baselines (EASGD, CROSSBOW): static equal shares, equal batch
    ``B`` and learning rate, a period of ``τ`` local steps per device (``S = n τ B``), a
    centre that is not broadcast. Subclasses implement :meth:`alpha_for` and :meth:`merge`."""

    static = True

    def period_samples(self, n_devices: int, batch_size: int) -> int:
        return n_devices * self.config.tau * batch_size

    def setup(self, replicas: Sequence, **kw) -> None:
        super().setup(replicas, **kw)
        self.alpha = self.alpha_for(self.n_devices)
        self._diff = self.empty_params(self.central)  # elastic scratch

    def alpha_for(self, n: int) -> float:
        """The elastic coefficient ``α`` on ``n`` devices."""
        raise NotImplementedError

    def _elastic_pull(self, params: Sequence, good: Sequence[int], center: Sequence) -> None:
        """``x_i <- x_i − α (x_i − center)`` for the replicas ``good``."""
        for i in good:
            elastic_update(params[i], center, self.alpha, self._diff, self.backend)

    def _split(self, replicas: Sequence, ctx) -> tuple[list, list[int], list[int]]:
        """``(params, good, bad)``: replicas taking part, and the non-finite ones (to reset)."""
        params = [r.params() for r in replicas]
        counts, bad = self.finite_updates(params, np.ones(len(replicas)), ctx)
        good = [i for i in range(len(replicas)) if counts[i] > 0]
        return params, good, bad

    def _info(self, good: Sequence[int], bad: Sequence[int]) -> dict[str, Any]:
        w = [self.alpha if i in good else 0.0 for i in range(self.n_devices)]
        return {"weights": w, "alpha": self.alpha, "nonfinite": list(bad)}


class EASGD(ElasticPolicy):
    """Synchronous Elastic Averaging SGD (Zhang et al. 2015, eq. 5-6); module docstring."""

    name = "easgd"

    def setup(self, replicas: Sequence, **kw) -> None:
        super().setup(replicas, **kw)
        self._spare = self.empty_params(self.central)

    def alpha_for(self, n: int) -> float:
        c = self.config
        return c.alpha if c.alpha > 0 else c.beta / n

    def merge(self, replicas: Sequence, updates: Sequence[int], ctx) -> dict[str, Any]:
        """``x̃' = x̃ + α Σ_i (x_i − x̃)``, then ``x_i <- x_i − α (x_i − x̃)`` (old ``x̃``)."""
        params, good, bad = self._split(replicas, ctx)
        a = self.alpha
        weighted_merge([self.central] + [params[i] for i in good],
                       [1.0 - a * len(good)] + [a] * len(good), self._spare, self.backend,
                       check=False)
        self._elastic_pull(params, good, self.central)
        self.central, self._spare = self._spare, self.central
        for i in bad:
            replicas[i].set_params(self.central)
        return self._info(good, bad)
