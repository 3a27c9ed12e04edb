"""Adaptive SGD (arXiv 2110.07029 §III): dynamic scheduling, normalized merging, adaptive batches.

Per merge period of ``S`` samples (DESIGN.md §4): devices draw batches from one shared cursor
(faster devices make more updates), each steps with ``lr_i = lr(t) b_i / B``; the merge weights
are the shares of updates ``p_i = c_i / Σ c`` (the paper's, ``weight_by="updates"``, the default
from 200,000 labels) or of the rows each device trained on (``weight_by="samples"``, the
default below; the same while the batches are equal), with ``boost`` raised for the fastest
replica by adaptive normalization while the merged model's L2 norm rises; the merged model
gets momentum ``z_t = w̄_t + μ (z_{t-1} − z_{t-2})`` and is broadcast; after warm-up the batch
sizes adapt so that all devices make the same number of updates per period. The options and
their defaults are :class:`~xmc_engine.config.AdaptiveConfig`; the measurements behind the
defaults that are not the paper's (``merge_period``, ``momentum``, ``weight_by``,
``deadband``, ``sparse_merge``, ``boost``, ``b_max``, ``batch_scale``) are in
``bench/RESULTS.md``.

Periods shorter than ``S / 2`` (the remainder at the end of an epoch) merge normally but do not
adapt the batch sizes: one or two updates per device are too few to measure anything.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from xmc_engine.algorithms.base import Policy
from xmc_engine.backends.base import empty_like
from xmc_engine.distributed import combine_nodes
from xmc_engine.errors import ConfigError, DivergenceError
from xmc_engine.scheduler.controller import BatchSizeController, batch_lr_factor
from xmc_engine.scheduler.merge import (
    TAIL_MAX_POSITIVES,
    NormTrend,
    adaptive_normalization,
    central_momentum,
    delta_stats,
    find_nonfinite,
    merge_changed_rows,
    merge_weights,
    sq_norms,
    weighted_merge,
)

logger = logging.getLogger(__name__)

__all__ = ["AdaptiveSGD"]


class AdaptiveSGD(Policy):
    """Adaptive SGD policy (arXiv 2110.07029 §III-A..C); see the module docstring."""

    name = "adaptive"
    static = False
    supports_nodes = True

    def prepare(self, replicas: Sequence, batch_size: int, n_samples: int | None = None) -> None:
        """The ``'auto'`` options (merge weights, period, ``b_max``, ``solo_epochs``,
        ``batch_scale``) by the
        label count (the output bias's length), the replicas' loss, whether their backends
        track changed rows, the base batch and the training rows; :func:`fit_model` has
        resolved them already (by the rows of every node), a trainer built directly has not."""
        self.config = self.config.resolved(
            len(replicas[0].params()[-1]), getattr(replicas[0], "loss", "softmax"), batch_size,
            tracks_rows=all(getattr(r.backend, "tracks_rows", False) for r in replicas),
            n_rows=n_samples)

    def setup(self, replicas: Sequence, **kw) -> None:
        super().setup(replicas, **kw)
        # where setup is called without the trainer
        self.prepare(replicas, self.batch_size, self.n_samples)
        c = self.config
        self.batch_size = c.base_batch(self.batch_size)  # B: batch_scale x the run's batch
        if not c.b_min <= self.batch_size <= c.b_max:
            raise ConfigError(f"adaptive: batch_size {self.batch_size} is outside "
                              f"[b_min, b_max] = [{c.b_min}, {c.b_max}]")
        self.controller = BatchSizeController(
            self.n_devices, self.batch_size, b_min=c.b_min, b_max=c.b_max, delta_b=c.delta_b,
            rule=c.rule, warmup_epochs=self.warmup_epochs, deadband=c.deadband)
        self.trend = NormTrend(c.flag_rule if c.boost else "never")
        if c.per_label_weights:  # the replicas record the labels they see
            for r in replicas:
                if hasattr(r, "track_labels"):
                    r.track_labels()
        # sum(W1**2) of the central model, kept up to date by the row-sparse merge.
        self._sq_w1 = None
        self._wbar = self.empty_params(self.central)
        self._acc = None  # merged Adagrad accumulators (optimizer_state != 'keep'), lazily
        self._tail = None  # labels with few positives (delta_stats)
        if c.delta_stats and hasattr(replicas[0], "Y"):
            Y = replicas[0].Y
            counts = np.bincount(Y.indices, minlength=Y.shape[1])
            self._tail = counts <= TAIL_MAX_POSITIVES
        self._solo: int | None = None  # the device training the open period alone
        self._solo_last: int | None = None  # the last device that trained a period alone
        self._behind: int | None = None  # the solo device the centre has not caught up with
        self._replicas = list(replicas)
        if c.solo_epochs > 0 and self.n_devices > 1:
            logger.info("adaptive: the first device trains the periods that start before %g "
                        "epochs alone, then every device from its model (solo_epochs; 0 "
                        "trains every device from the start)", c.solo_epochs)
        if c.momentum > 0:
            # z_{t-1} and z_{t-2} start at the initial model: the first merge has no momentum.
            self._z1 = self.central
            self._z2 = self.copy_params(self.central)
            self._spare = self.empty_params(self.central)

    def batch_sizes(self) -> list[int]:
        return list(self.controller.batch_sizes)

    def device_lrs(self, lr: float) -> list[float]:
        """``lr_i = lr(t) b_i / B``: linear scaling with each device's batch (§III-C), or the
        rule of ``lr_scaling``."""
        return self.controller.learning_rates(lr, self.config.lr_scaling)

    def batch_lr(self, lr: float, n_rows: int, batch_size: int) -> float:
        """A short batch's rate by the rule of ``lr_scaling`` (the rate of a batch of
        ``n_rows`` rows), as for the devices' batches: with the default linear scaling the
        base policy's ``lr * n_rows / batch_size``."""
        return lr * batch_lr_factor(n_rows, batch_size, self.config.lr_scaling)

    def solo_device(self, replicas: Sequence, progress: float,
                    alive: Sequence[bool]) -> int | None:
        """``solo_epochs``: the first live device trains the periods that start before that
        many epochs alone. At the first period after them every other replica becomes the
        central model and gets that device's Adagrad accumulators (:meth:`_end_solo`); a
        device that takes over the solo training (the one before it failed) starts from the
        central model as it was last brought up to date (:meth:`_catch_up`)."""
        live = [i for i, a in enumerate(alive) if a]
        if progress < self.config.solo_epochs and len(live) > 1:
            self._solo = live[0]
            if self._solo_last is not None and self._solo_last != self._solo:
                replicas[self._solo].set_params(self.central)
            self._solo_last = self._solo
            return self._solo
        self._solo = None
        if self._solo_last is not None:
            self._end_solo(replicas, alive)
        return None

    def _end_solo(self, replicas: Sequence, alive: Sequence[bool]) -> None:
        """The solo phase is over: every replica but the one that trained it becomes the
        central model and takes its Adagrad accumulators (where it is still alive); the
        momentum and the norm trend start afresh from the central model, as after
        :meth:`load_model`."""
        self._catch_up()
        i, self._solo_last = self._solo_last, None
        self.broadcast([r for j, r in enumerate(replicas) if j != i], self.central)
        acc = (replicas[i].accumulators()
               if alive[i] and hasattr(replicas[i], "accumulators") else [])
        if acc:
            for j, r in enumerate(replicas):
                if j != i and r.accumulators():
                    self.copy_params_into(r.accumulators(), acc)
        self._start_afresh()

    def _merge_solo(self, replicas: Sequence, ctx) -> dict[str, Any]:
        """A period one device trained alone: nothing to merge. Its replica is the model, and
        the central model catches up with it only where it is read (:meth:`central_params`:
        an evaluation, a checkpoint) and at the end of the phase (:meth:`_end_solo`), so the
        barrier costs what one device's does (copying the changed rows at each barrier cost
        0.5-4 ms on the real sets, against 0.03 ms: ``bench/RESULTS.md``, "The solo phase
        without a copy at each barrier"). A non-finite loss stops the run here, as on one
        device; one in the parameters alone at the catch-up or in the next period's loss. A
        solo device that fails takes the periods since the last catch-up with it: the next
        device starts from the central model as it then was (its own period's rows go back to
        the queue, those periods' do not)."""
        i = self._solo
        weights = [0.0] * len(replicas)
        if i in ctx.excluded:  # it failed: the centre stays as it was last brought up to date
            self._behind = None
            return {"weights": weights, "flag": 0, "norm": None, "nonfinite": [], "solo": i}
        if i in ctx.nonfinite:
            raise DivergenceError(self._diverged_alone(i))
        self._behind = i
        weights[i] = 1.0
        return {"weights": weights, "flag": 0, "norm": None, "nonfinite": [], "solo": i}

    @staticmethod
    def _diverged_alone(i: int) -> str:
        return (f"device {i}, training alone, has non-finite parameters or loss; lower the "
                f"learning rate and resume from the last checkpoint")

    def _catch_up(self) -> None:
        """The central model becomes the solo device's replica where it is behind (the ``W1``
        rows the device changed since, by the row-sparse merge where it applies; else a whole
        copy); ``DivergenceError`` where that replica has non-finite parameters."""
        i, self._behind = self._behind, None
        if i is None:
            return
        r = self._replicas[i]
        # the row-sparse merge checks what it reads for NaN/inf and returns None where it does
        # not apply (no row tracking: a GPU) or finds one: then a full check and a whole copy
        if merge_changed_rows([r], [1.0], self.central, self.backend, norm=False) is None:
            if find_nonfinite([r.params()], self.backend):
                raise DivergenceError(self._diverged_alone(i))
            self.copy_params_into(self.central, r.params())

    def central_params(self) -> list:
        """The central model, caught up with the device training alone (:meth:`_merge_solo`)."""
        self._catch_up()
        return self.central

    def merge(self, replicas: Sequence, updates: Sequence[int], ctx) -> dict[str, Any]:
        """Normalized merge + adaptive normalization + central momentum + broadcast (§III-B);
        a period one device trained alone (``solo_epochs``) makes its model the central one."""
        if self._solo is not None:
            return self._merge_solo(replicas, ctx)
        c = self.config
        flag = self.trend.flag
        shares = self._weight_counts(updates, ctx)  # what p_i is the share of
        deltas = {}
        if self._tail is not None:  # delta_stats: read the replicas before the merge
            deltas = delta_stats(replicas, self.central, self._tail) or {}
        if c.sparse_merge and c.momentum == 0:
            info = self._merge_sparse(replicas, shares, flag, ctx)
            if info is not None:
                self._merge_optimizer_state(replicas, info["weights"])
                return {**info, **deltas}
        params = [r.params() for r in replicas]
        counts, bad = self.finite_updates(params, shares, ctx)
        p = adaptive_normalization(merge_weights(counts), flag, c.boost_factor)
        weighted_merge(params, p, self._wbar, self.backend, check=False)
        # Across nodes (DESIGN.md §6): w̄ <- Σ c_node w̄_node / Σ c_node (c: the node's rows or
        # updates, as weight_by says), before the norm trend and the momentum so that both see
        # the global model, identically on every rank.
        nodes = combine_nodes(ctx.comm, self._wbar, float(np.asarray(shares)[counts > 0].sum()),
                              self.backend)
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
        self.broadcast(replicas, self.central)
        self._merge_optimizer_state(replicas, p)
        return {"weights": [float(x) for x in p], "flag": int(flag), "norm": norm,
                "nonfinite": bad, **nodes, **deltas}

    def _weight_counts(self, updates: Sequence[int], ctx) -> Sequence[int]:
        """What the merge weights are the shares of (``weight_by``): each device's updates, or
        the rows it trained on in the period (``ctx.samples``; the updates where the caller
        counted none)."""
        if self.config.weight_by == "samples" and ctx.samples is not None:
            return ctx.samples
        return updates

    def _merge_sparse(self, replicas, shares, flag, ctx) -> dict[str, Any] | None:
        """The merge with the row-sparse path (``sparse_merge``); ``None`` where it does not
        apply or a replica is non-finite (then the dense merge runs, which finds it)."""
        p = adaptive_normalization(merge_weights(shares), flag, self.config.boost_factor)
        norm_rise = self.trend.rule == "norm_rise"
        if norm_rise and self._sq_w1 is None:
            self._sq_w1 = sq_norms(self.central[:1], self.backend)[0]
        stats: dict = {}
        # the per-row / per-label weights from c.weights_from_epoch on, the paper's before
        own = ctx.epoch >= self.config.weights_from_epoch
        per_row = own and self.config.per_row_weights
        power = 0.0
        if per_row and self.config.row_sum:  # the batches of the period that ends here
            power = stats["row_sum_power"] = self.config.row_sum_power_for(
                self.batch_sizes(), ctx.epoch)
        delta = self.merge_rows_only(replicas, p, ctx, per_row=per_row,
                                     row_sum=self.config.row_sum, row_sum_power=power,
                                     per_label=own and self.config.per_label_weights,
                                     stats=stats, norm=norm_rise)
        if delta is None:
            return None
        norm = None
        if norm_rise:
            self._sq_w1 += delta
            norm = math.sqrt(max(self._sq_w1, 0.0) + sum(sq_norms(self.central[1:],
                                                                  self.backend)))
            self.trend.observe(norm)
        return {"weights": [float(x) for x in p], "flag": int(flag), "norm": norm,
                "nonfinite": [], **stats}

    def _merge_optimizer_state(self, replicas, p) -> None:
        """``optimizer_state``: every replica's Adagrad accumulators become their merge-weighted
        average (``'average'``) or zeros (``'reset'``); nothing for ``'keep'`` or SGD."""
        mode = self.config.optimizer_state
        if mode == "keep":
            return
        accs = [r.accumulators() if hasattr(r, "accumulators") else [] for r in replicas]
        if not all(accs):
            return
        if self._acc is None:
            self._acc = [empty_like(self.backend, a, zero=True) for a in accs[0]]
        if mode == "average":
            weighted_merge(accs, p, self._acc, self.backend, check=False)
        for acc in accs:
            self.copy_params_into(acc, self._acc)

    def load_model(self, replicas: Sequence, params: Sequence) -> None:
        """As the base policy's; the momentum and the norm trend start afresh from it, as at
        the start (no momentum and no boost at the first merges after it)."""
        self._behind = None  # every replica, the solo one too, becomes ``params``
        super().load_model(replicas, params)
        self._start_afresh()

    def _start_afresh(self) -> None:
        """The momentum and the norm trend start from the central model as it now is, as at
        the start: no momentum and no boost at the first merges after it."""
        if self.config.momentum > 0:  # z_{t-1} is the central model; z_{t-2} becomes it too
            self.copy_params_into(self._z2, self.central)
        self._sq_w1 = None
        self.trend.norms = []

    def state_dict(self) -> dict[str, Any]:
        """Batch sizes, the norm history of the trend flag and the device that trained the
        last period alone (``solo_last``: a run resumed at the end of the solo phase still
        hands its accumulators to the others; momentum buffers restart at the central model
        on resume)."""
        return {"name": self.name, "batch_sizes": self.batch_sizes(),
                "norms": list(self.trend.norms), "solo_last": self._solo_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        b = [int(x) for x in state.get("batch_sizes", self.batch_sizes())]
        if len(b) == self.n_devices:
            self.controller.batch_sizes = b
        self.trend.norms = [float(x) for x in state.get("norms", [])][-2:]
        solo = state.get("solo_last")
        self._solo_last = solo if isinstance(solo, int) and 0 <= solo < self.n_devices else None

    def end_period(self, progress, updates, samples, busy_s) -> None:
        """Adapt the batch sizes (§III-C), except after a short epoch-remainder period or a
        period one device trained alone."""
        if 2 * sum(samples) >= self.merge_period and self._solo is None:
            self.controller.update(progress, updates, samples, busy_s)
