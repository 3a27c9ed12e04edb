"""Synchronous data-parallel SGD: the ``sync`` baseline (DESIGN.md §4).

The scheme of TensorFlow's MirroredStrategy, Horovod and PyTorch DDP (e.g. Goyal et al. 2017,
"Accurate, Large Minibatch SGD", arXiv 1706.02677; Sergeev & Del Balso 2018, arXiv 1802.05799).
Every step ``t`` the global batch ``G_t`` is split over the ``n`` devices (``b_i`` rows each),
each device computes the gradient of its mean loss at the common model ``w_t``, and::

    ḡ_t = Σ_i (b_i / Σ_j b_j) ∇ℓ_i(w_t)          (gradient all-reduce, on the host)
    w_{t+1} = w_t − lr(t) ḡ_t                     (the same update on every replica)

so the run equals one device stepping on the global batch. The ``W1`` gradient is row-sparse
(union of the rows the devices touched); ``W2`` and the biases are dense. The slowest device sets
the pace (every step waits for the last gradient). The loop is
:class:`xmc_engine.scheduler.sync.SyncLoop`; this module holds the options and the schedule.

Global batch
------------
By default ``batch_size`` is the *per-device* batch ``B`` and the global batch is ``n B`` (the
DDP / Horovod convention: more devices, larger global batch, fewer updates per epoch).
``split_global_batch = True`` makes ``batch_size`` the global batch, split equally (``B / n`` rows
per device; ``B`` must be a multiple of ``n``, since the queue's static quotas are equal): the
same updates per epoch as one device with batch ``B``. ``lr_scaling = True`` applies the linear
scaling rule (Goyal et al. 2017 §2.1): ``lr × (global batch / batch_size)``, i.e. ``× n`` in the
default mode. Warm-up and decay are the
shared schedule (:func:`~xmc_engine.scheduler.controller.learning_rate`), with the same defaults
as ``adaptive`` and ``average`` so that only the algorithm differs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from xmc_engine.algorithms.base import ConfigMixin, Policy
from xmc_engine.errors import ConfigError
from xmc_engine.scheduler.controller import learning_rate

logger = logging.getLogger(__name__)

__all__ = ["SyncConfig", "SyncSGD"]


@dataclass
class SyncConfig(ConfigMixin):
    """Options of synchronous SGD (module docstring).

    Attributes
    ----------
    batch_size : int
        Per-device batch ``B`` (global batch ``n B``), or the global batch when
        ``split_global_batch``.
    split_global_batch : bool
        Treat ``batch_size`` as the global batch, split equally over the devices (must divide).
    lr_scaling : bool
        Linear scaling rule: multiply the learning rate by ``global batch / batch_size``.
    period_steps : int
        Steps per log record (a ``"merge"`` event of the run log, the learning-rate schedule's
        granularity and the divergence check). Not a merge: replicas are identical every step.
    warmup_epochs : float
        Linear learning-rate ramp over these epochs.
    lr_decay : float
        ``λ`` in ``lr(e) = lr0 / (1 + λ (e − e_warm))``.
    """

    batch_size: int = 128
    split_global_batch: bool = False
    lr_scaling: bool = False
    period_steps: int = 64
    warmup_epochs: float = 1.0
    lr_decay: float = 0.1

    def __post_init__(self):
        self._check_min(1, "batch_size", "period_steps")
        self._check_min(0, "warmup_epochs", "lr_decay")


class SyncSGD(Policy):
    """Synchronous data-parallel SGD with a per-step gradient all-reduce (module docstring).

    ``synchronous = True`` makes :class:`~xmc_engine.scheduler.ParallelTrainer` run
    :class:`~xmc_engine.scheduler.sync.SyncLoop` instead of its merge-period loop; the replicas
    stay identical, so the central model is replica 0's live parameters (no extra copy).
    """

    name = "sync"
    static = True
    synchronous = True

    def __init__(self, config: SyncConfig | None = None, **overrides):
        self.config = self._make_config(SyncConfig, config, overrides)
        self.merge_period = self.config.period_steps * self.config.batch_size

    def setup(self, replicas: Sequence, n_samples: int) -> None:
        self.n_devices = len(replicas)
        self.n_samples = int(n_samples)
        self.backend = replicas[0].backend
        self._replicas = list(replicas)
        self.merge_period = self.period_samples(self.n_devices)
        B, n = self.config.batch_size, self.n_devices
        if self.config.split_global_batch and B % n:
            raise ConfigError(f"sync: split_global_batch needs batch_size divisible by the "
                              f"{n} devices, got batch_size={B}")

    def period_samples(self, n_devices: int) -> int:
        """Samples per period: ``period_steps`` global batches."""
        return self.config.period_steps * sum(self._sizes(n_devices))

    def _sizes(self, n: int) -> list[int]:
        B = self.config.batch_size
        return [B // n if self.config.split_global_batch else B] * n

    def batch_sizes(self) -> list[int]:
        return self._sizes(self.n_devices)

    def learning_rates(self, lr0: float, progress: float) -> tuple[float, list[float]]:
        c = self.config
        lr = learning_rate(lr0, progress, warmup_epochs=c.warmup_epochs, decay=c.lr_decay)
        if c.lr_scaling:
            lr *= sum(self.batch_sizes()) / c.batch_size
        return lr, [lr] * self.n_devices

    def merge(self, replicas: Sequence, updates: Sequence[int]) -> dict[str, Any]:
        raise NotImplementedError("sync has no merge: ParallelTrainer runs it through "
                                  "xmc_engine.scheduler.sync.SyncLoop (synchronous = True)")

    def central_params(self) -> list:
        """Replica 0's live parameters (all replicas are identical after every step)."""
        return self._replicas[0].params()
