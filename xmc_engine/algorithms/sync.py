"""Synchronous data-parallel SGD: the ``sync`` baseline (DESIGN.md §4).

The scheme of TensorFlow's MirroredStrategy, Horovod and PyTorch DDP (e.g. Goyal et al. 2017,
"Accurate, Large Minibatch SGD", arXiv 1706.02677; Sergeev & Del Balso 2018, arXiv 1802.05799).
Every step ``t`` the global batch ``G_t`` is split over the ``n`` devices (``b_i`` rows each),
each device computes the gradient of its mean loss at the common model ``w_t``, and::

    ḡ_t = Σ_i (b_i / Σ_j b_j) ∇ℓ_i(w_t)          (gradient all-reduce)
    w_{t+1} = w_t − lr(t) ḡ_t                     (the same update on every replica)

so the run equals one device stepping on the global batch. The ``W1`` gradient is row-sparse
(union of the rows the devices touched); ``W2`` and the biases are dense. The slowest device sets
the pace (every step waits for the last gradient).

In the one training loop (:class:`xmc_engine.scheduler.Trainer`) a period is one global step:
each device takes one batch and its :meth:`SyncSGD.step` computes the gradient without updating;
the merge reduces the gradients and every device applies the same update in its
own worker. The reduction runs on the first device's backend
(:func:`~xmc_engine.scheduler.merge.reduce_gradients`: on GPUs by peer reads, never through the
host).

Global batch
------------
By default ``batch_size`` is the *per-device* batch ``B`` and the global batch is ``n B`` (the
DDP / Horovod convention: more devices, larger global batch, fewer updates per epoch).
``split_global_batch = True`` makes ``batch_size`` the global batch, split equally (``B / n`` rows
per device; ``B`` must be a multiple of ``n``, since the queue's static quotas are equal): the
same updates per epoch as one device with batch ``B``. ``lr_scaling = True`` applies the linear
scaling rule (Goyal et al. 2017 §2.1): ``lr × (global batch / batch_size)``, i.e. ``× n`` in the
default mode. Warm-up and decay are the run's schedule, as for every algorithm. Options:
:class:`~xmc_engine.config.SyncConfig`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from xmc_engine.algorithms.base import Policy
from xmc_engine.errors import ConfigError, DivergenceError
from xmc_engine.scheduler.merge import reduce_gradients

logger = logging.getLogger(__name__)

__all__ = ["SyncSGD"]


class SyncSGD(Policy):
    """Synchronous data-parallel SGD with a per-step gradient all-reduce (module docstring).

    The replicas stay identical, so the central model is the first live replica's parameters
    (no extra copy).
    """

    name = "sync"
    static = True
    max_steps_per_period = 1
    steps_by_gradient = True

    def period_samples(self, n_devices: int, batch_size: int) -> int:
        """One global batch: ``n B`` (``B`` when ``split_global_batch``)."""
        return sum(self._sizes(n_devices, batch_size))

    def _sizes(self, n: int, B: int) -> list[int]:
        return [B // n if self.config.split_global_batch else B] * n

    def setup(self, replicas: Sequence, **kw) -> None:
        super().setup(replicas, **kw)
        B, n = self.batch_size, self.n_devices
        if self.config.split_global_batch and B % n:
            raise ConfigError(f"sync: split_global_batch needs batch_size divisible by the "
                              f"{n} devices, got batch_size={B}")
        self._replicas = list(replicas)
        self._grads: list = [None] * n
        self._live = 0  # a replica that took part in the last step (the central model)

    def batch_sizes(self) -> list[int]:
        return self._sizes(self.n_devices, self.batch_size)

    def device_lrs(self, lr: float) -> list[float]:
        if self.config.lr_scaling:
            lr *= sum(self.batch_sizes()) / self.batch_size
        return [lr] * self.n_devices

    def step(self, device: int, replica, rows: np.ndarray, lr: float) -> float:
        """The gradient of the device's rows, kept on its device for the merge; no update."""
        loss, grads = replica.grad_batch(rows)
        self._grads[device] = (len(rows), grads)
        return replica.backend.to_float(loss)  # synchronize!

    def merge(self, replicas: Sequence, updates: Sequence[int], ctx) -> dict[str, Any]:
        """All-reduce the period's gradients, then every live device applies the same step."""
        if ctx.nonfinite:
            raise DivergenceError(f"sync: the loss became non-finite on devices "
                                  f"{sorted(ctx.nonfinite)} in epoch {ctx.epoch} period "
                                  f"{ctx.period} (lr {max(ctx.lrs):g}); lower the learning rate")
        got = [g if i not in ctx.excluded else None for i, g in enumerate(self._grads)]
        self._grads = [None] * self.n_devices
        total = sum(g[0] for g in got if g is not None)
        weights = [g[0] / total if g is not None else 0.0 for g in got]
        if total:
            g = reduce_gradients([x[1] if x is not None else None for x in got], weights,
                                 self.backend)
            # a global batch short of the devices' batches (the epoch's last rows) steps at
            # the rate of its rows (Policy.batch_lr)
            full = sum(b for b, x in zip(self.batch_sizes(), got, strict=True) if x is not None)
            scale = self.batch_lr(1.0, total, full) if total < full else 1.0
            ctx.run_on_devices(lambda i: replicas[i].apply_grads(g, ctx.lrs[i] * scale))
        self._live = min(i for i in range(self.n_devices) if i not in ctx.excluded)
        return {"weights": weights, "nonfinite": []}

    def central_params(self) -> list:
        """A live replica's parameters (every live replica is identical after every step)."""
        return self._replicas[self._live].params()

    def load_model(self, replicas: Sequence, params: Sequence) -> None:
        self.broadcast(replicas, params)  # no central copy: every replica is the model
