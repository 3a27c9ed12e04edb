"""CROSSBOW synchronous model averaging (SMA): the ``crossbow`` baseline.

Koliousis, Watcharapichat, Weidlich, Mai, Costa & Pietzuch, "CROSSBOW: Scaling Deep Learning with
Small Batch Sizes on Multi-GPU Servers", VLDB 2019 (arXiv 1901.02244), §3, Algorithm 1. Every
device is a learner ``w_j`` that runs plain SGD on its own small batches (equal static shares,
equal batch ``b``, the same learning rate). After every step (``τ = 1``: one merge period of
``S = n b`` samples) the learners are corrected toward the central average model ``z``, which
moves with the corrections plus momentum::

    c_j = α (w_j − z)                              for every learner j
    w_j <- w_j − c_j
    z   <- z + Σ_j c_j + μ (z − z_prev)            (z_prev: the centre before this update)

``z`` is the model that is evaluated, checkpointed and returned; learners are never overwritten
with it. Defaults: ``μ = 0.9`` (DESIGN.md §4; the momentum of the paper's SMA) and ``α = 1/n``
for ``n`` learners (our reading of the paper's choice, which scales the correction with the
number of learners like EASGD's ``α = β/n``; with ``α = 1/n`` the first two terms make ``z`` the
plain mean of the learners, so ``z_t = mean_j w_j + μ (z_{t−1} − z_{t−2})``, CROSSBOW's
"trajectory of the average model"). ``tau`` > 1 corrects every ``τ`` steps (not the paper).

Order within a step. Algorithm 1 computes ``c_j`` from the learner *before* its gradient step
(on the GPU the correction runs concurrently with the gradient): ``w_j <- w_j − γ ∇ℓ(w_j) −
α (w_j − z)``. We run the ``τ`` SGD steps in the period and then the correction from the learner
*after* them (``c_j = α (w_j − γ ∇ℓ(w_j) − z)``), which avoids keeping a copy of every learner;
the two differ by ``α γ ∇ℓ(w_j)`` per step, second order in the step sizes. Heterogeneous
devices: the slowest sets the pace (synchronous, as in the paper).

Implementation: ``w̄ = (1 − n α) z + α Σ_j w_j`` (``weighted_sum`` kernel; equals
``z + Σ_j α (w_j − z)``), then every learner's elastic step toward the old ``z`` (``elastic``
kernel), then ``z' = w̄ + μ (z − z_prev)`` (``momentum`` kernel). Non-finite learners are left
out of ``Σ`` and reset to the new ``z``; failed devices are left out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from xmc_engine.algorithms.easgd import ElasticPolicy
from xmc_engine.scheduler.merge import central_momentum, weighted_merge

logger = logging.getLogger(__name__)

__all__ = ["Crossbow"]


class Crossbow(ElasticPolicy):
    """CROSSBOW synchronous model averaging (Koliousis et al. 2019, Algorithm 1; options:
    :class:`~xmc_engine.config.CrossbowConfig`)."""

    name = "crossbow"

    def setup(self, replicas: Sequence, **kw) -> None:
        super().setup(replicas, **kw)
        self._wbar = self.empty_params(self.central)
        self._z_prev = self.copy_params(self.central)  # no momentum at first

    def alpha_for(self, n: int) -> float:
        return self.config.alpha if self.config.alpha > 0 else 1.0 / n

    def load_model(self, replicas: Sequence, params: Sequence) -> None:
        super().load_model(replicas, params)
        self.copy_params_into(self._z_prev, self.central)  # no momentum at the next merge

    def merge(self, replicas: Sequence, updates: Sequence[int], ctx) -> dict[str, Any]:
        """SMA correction: learners toward ``z``; ``z <- z + Σ α (w_j − z) + μ (z − z_prev)``."""
        params, good, bad = self._split(replicas, ctx)
        a, mu = self.alpha, self.config.momentum
        z = self.central
        weighted_merge([z] + [params[i] for i in good], [1.0 - a * len(good)] + [a] * len(good),
                       self._wbar, self.backend, check=False)
        self._elastic_pull(params, good, z)
        if mu > 0:
            # z' = w̄ + μ (z − z_prev) into the elastic scratch (free again); z becomes z_prev
            central_momentum(self._wbar, z, self._z_prev, mu, self._diff, self.backend)
            self._z_prev, self.central, self._diff = z, self._diff, self._z_prev
        else:
            self._z_prev, self.central, self._wbar = z, self._wbar, self._z_prev
        for i in bad:
            replicas[i].set_params(self.central)
        info = self._info(good, bad)
        info["momentum"] = mu
        return info
