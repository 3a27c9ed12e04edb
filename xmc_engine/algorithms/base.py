"""The policy interface every training algorithm implements over the one training loop.

A *policy* decides, per merge period (DESIGN.md §4): the period's length in samples, how batches
are assigned (dynamic shared cursor or static equal quotas, and each device's batch size), each
device's learning rate given the schedule's ``lr(t)``, what a device's step does, and what the
merge does. The trainer (:class:`xmc_engine.scheduler.Trainer`) runs the devices and calls the
policy between periods, on the main thread, passing what the merge needs in a
:class:`~xmc_engine.scheduler.runner.MergeContext`.

How the algorithms of DESIGN.md §4 map onto it:

``single``    one device; the period only spaces the barriers (log, evaluation, checkpoints).
``adaptive``  dynamic cursor, adaptive ``b_i``, ``lr_i = lr(t) b_i / B``; normalized merge.
``average``   static quotas ``S / n``, equal ``B``, uniform average + broadcast.
``sync``      static, ``S = n B`` (one step per period); a step computes the gradient only, the
              merge all-reduces the gradients and every device applies the same update.
``easgd``     static, ``S = n τ B``; elastic moves toward a centre, centre += Σ of the moves.
``crossbow``  static, ``S = n τ B``; elastic moves + centre momentum.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from xmc_engine.backends.base import empty_like
from xmc_engine.config import ALGORITHMS, AlgorithmConfig, algorithm_config
from xmc_engine.errors import ConfigError, DivergenceError
from xmc_engine.scheduler.merge import find_nonfinite, merge_changed_rows

logger = logging.getLogger(__name__)

__all__ = ["Policy"]


class Policy:
    """Base class of the training algorithms (subclasses override the hooks they need).

    Parameters
    ----------
    config : AlgorithmConfig, dict or None
        The algorithm's options (:data:`xmc_engine.config.ALGORITHMS` names the class).
    **overrides
        Option fields overriding ``config``.

    Attributes
    ----------
    name : str
    static : bool
        Static equal quotas per period (``True``) or the dynamic shared cursor (``False``).
    max_devices : int or None
        The most devices the algorithm runs on (``None``: any number).
    supports_nodes : bool
        Whether it runs across MPI nodes (DESIGN.md §6).
    max_steps_per_period : int or None
        The most steps a device makes per period (``None``: as many as the queue grants).
    steps_by_gradient : bool
        Whether its steps compute gradients without updating (the replicas' ``grad_batch`` /
        ``apply_grads``) instead of training in place (``train_batch``): the kernels
        :func:`xmc_engine.training.compile_kernels` compiles beforehand.
    """

    name = "base"
    static = False
    max_devices: int | None = None
    supports_nodes = False
    max_steps_per_period: int | None = None
    steps_by_gradient = False

    def __init__(self, config: AlgorithmConfig | dict | None = None, **overrides):
        expected = ALGORITHMS[self.name]
        if isinstance(config, AlgorithmConfig) and not isinstance(config, expected):
            raise ConfigError(f"algorithm {self.name!r} takes {expected.__name__} options, got "
                              f"{type(config).__name__}")
        config = algorithm_config(self.name, config, source=f"{self.name} options")
        if overrides:
            config = algorithm_config(self.name, {**config.to_dict(), **overrides},
                                      source=f"{self.name} options")
        self.config = config

    # -- lifecycle -----------------------------------------------------------------------------
    def prepare(self, replicas: Sequence, batch_size: int, n_samples: int | None = None) -> None:
        """Called by the trainer first, before :meth:`period_samples`: options that depend on
        the model, the loss or the ``n_samples`` training rows (``'auto'`` values) can be
        resolved here. Nothing by default."""

    def period_samples(self, n_devices: int, batch_size: int) -> int:
        """``S``, the samples of one merge period on ``n_devices`` devices of base batch
        ``batch_size`` (the trainer may shorten it to split an epoch evenly over nodes)."""
        return int(self.config.merge_period)

    def setup(self, replicas: Sequence, *, n_samples: int, batch_size: int, merge_period: int,
              warmup_epochs: float) -> None:
        """Called once by the trainer after the replicas were made identical.

        ``merge_period`` is the period in effect on this node, ``warmup_epochs`` the schedule's
        warm-up (equal batches until it ends).
        """
        self.n_devices = len(replicas)
        self.n_samples = int(n_samples)
        self.batch_size = int(batch_size)
        self.merge_period = int(merge_period)
        self.warmup_epochs = float(warmup_epochs)
        self.backend = replicas[0].backend
        self.central = self.copy_params(replicas[0].params())

    def copy_params(self, params: Sequence) -> list:
        """A copy of ``params`` on this policy's backend, made on its stream (the central
        model's storage; never on a GPU's null stream)."""
        out = self.empty_params(params)
        self.copy_params_into(out, params)
        return out

    def copy_params_into(self, out: Sequence, params: Sequence) -> None:
        """Copy ``params`` into the arrays ``out`` (shaped alike), on this policy's stream."""
        for dst, src in zip(out, params, strict=True):
            self.backend.copy_into(dst, src)

    def empty_params(self, params: Sequence) -> list:
        """Uninitialised arrays shaped (and ordered in memory) like ``params`` on this
        policy's backend (merge scratch), allocated on its stream."""
        return [empty_like(self.backend, a) for a in params]

    # -- per period ----------------------------------------------------------------------------
    def batch_sizes(self) -> list[int]:
        """Batch size of each device for the next period (default: ``B`` for every device)."""
        return [self.batch_size] * self.n_devices

    def device_lrs(self, lr: float) -> list[float]:
        """Each device's learning rate for the next period, given the schedule's ``lr(t)``."""
        return [lr] * self.n_devices

    def solo_device(self, replicas: Sequence, progress: float,
                    alive: Sequence[bool]) -> int | None:
        """The device that trains the next period alone while the others wait, or ``None``
        (every live device trains; the default). Called by the trainer on the main thread
        before each period of a run on one node whose devices share one queue (not with
        ``assignment="fixed"``), with ``progress`` the epochs done at the period's start and
        ``alive`` the devices still in the run."""
        return None

    def step(self, device: int, replica, rows: np.ndarray, lr: float) -> float:
        """One step of ``device`` on ``rows`` (in that device's worker); returns the summed
        loss. Default: a local SGD/Adagrad step (``replica.train_batch``)."""
        return replica.train_batch(rows, lr)

    def batch_lr(self, lr: float, n_rows: int, batch_size: int) -> float:
        """The rate of a step on ``n_rows`` rows, fewer than the device's batch of
        ``batch_size`` rows whose rate is ``lr`` (the epoch's last rows, a period's truncated
        batch): ``lr * n_rows / batch_size``, so that each row of the short batch moves the
        model as much as a row of a full batch (a step's gradient is its rows' mean). At the
        full rate a batch of 3 rows, the end of an epoch of 27,203 rows at batch 160, took
        single-device P@1 on debian_builddeps from 0.821 to 0.744 for the next evaluation
        (``bench/RESULTS.md``, "The short batch at the end of an epoch")."""
        return lr * n_rows / batch_size

    def merge(self, replicas: Sequence, updates: Sequence[int], ctx) -> dict[str, Any]:
        """Merge the replicas after a period (main thread); returns loggable info.

        ``ctx`` is the :class:`~xmc_engine.scheduler.runner.MergeContext`. The info holds at
        least ``weights`` (one float per device) and ``nonfinite`` (devices reset because
        their replica went non-finite).
        """
        raise NotImplementedError

    def end_period(self, progress: float, updates: Sequence[int], samples: Sequence[int],
                   busy_s: Sequence[float]) -> None:
        """Observe the period's measurements (e.g. to adapt batch sizes)."""

    def central_params(self) -> list:
        """The central (merged) model: list of arrays on the first device's backend."""
        return self.central

    def load_model(self, replicas: Sequence, params: Sequence) -> None:
        """Training goes on from ``params`` (host or device arrays shaped like the model): the
        central model and every replica become them, and whatever the policy derived from
        earlier central models starts afresh (between periods, in the main thread; the
        plateau rule going back to its best epoch's model). The replicas' optimizer state
        is theirs and stays."""
        self.copy_params_into(self.central, params)
        self.broadcast(replicas, self.central)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able scheduling state for checkpoints (not the model arrays)."""
        return {"name": self.name, "batch_sizes": self.batch_sizes()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output after :meth:`setup` (for resuming)."""

    # -- helpers for subclasses ----------------------------------------------------------------
    def finite_updates(self, params: Sequence[Sequence], updates: Sequence[int], ctx):
        """Update counts with the replicas to leave out zeroed; raises ``DivergenceError`` if
        no finite replica is left.

        Replicas of ``ctx.excluded`` (failed devices) are zeroed without being checked; the
        others are checked for NaN/inf. Returns ``(counts, bad)`` with ``bad`` the non-finite
        replicas (found here, or flagged in ``ctx.nonfinite``); when every remaining replica
        has a zero count, they get count 1 (uniform).
        """
        check = [i for i in range(len(params)) if i not in ctx.excluded]
        bad = sorted({check[j] for j in find_nonfinite([params[i] for i in check], self.backend)}
                     | (set(ctx.nonfinite) & set(check)))
        skip = sorted(set(ctx.excluded) | set(bad))
        if len(skip) == len(params):
            raise DivergenceError(
                f"every remaining replica ({len(bad)}: devices {bad}) has non-finite parameters "
                f"or loss; lower the learning rate and resume from the last checkpoint")
        c = np.asarray(updates, dtype=np.float64).copy()
        if skip:
            if bad:
                logger.warning("replicas %s are non-finite: dropped from the merge and reset",
                               bad)
            c[skip] = 0.0
            if c.sum() == 0:
                c[:] = 1.0
                c[skip] = 0.0
        return c, bad

    def merge_rows_only(self, replicas: Sequence, p, ctx, *, per_row: bool = False,
                        row_sum: bool = False, row_sum_power: float = 0.0,
                        per_label: bool = False, stats: dict | None = None,
                        norm: bool = False) -> float | None:
        """:func:`~xmc_engine.scheduler.merge.merge_changed_rows` into ``self.central`` where it
        applies (every replica merged with a weight > 0, none flagged, one node); returns its
        result (``None``: merge densely). ``per_row``, ``row_sum``, ``row_sum_power``,
        ``per_label``, ``stats`` and ``norm`` are its own (``norm`` off unless asked for: only
        adaptive's L2-norm trend reads it)."""
        if ctx.excluded or ctx.nonfinite or ctx.multi_node:
            return None
        return merge_changed_rows(replicas, p, self.central, self.backend, per_row=per_row,
                                  row_sum=row_sum, row_sum_power=row_sum_power,
                                  per_label=per_label, stats=stats, norm=norm,
                                  run_shards=ctx.run_shards)

    @staticmethod
    def broadcast(replicas: Sequence, params: Sequence) -> None:
        """Every replica becomes ``params`` (the merged model)."""
        for r in replicas:
            r.set_params(params)
