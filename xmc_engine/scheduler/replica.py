"""The worker interface the scheduler drives (``Replica``) and a deterministic fake for tests.

The scheduler never looks inside a model: it only asks a replica to train on some rows, and
reads/writes its parameter list at merges (STYLE.md "Scheduler logic is testable without
hardware"). :class:`xmc_engine.model` implements the real one; :class:`FakeReplica` has no real
compute, a fixed latency per sample and per step, and a small convex problem whose parameters
change deterministically with every step, so merges can be checked exactly.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Protocol, runtime_checkable

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["Replica", "FakeReplica", "HostBackend"]


@runtime_checkable
class Replica(Protocol):
    """One model copy on one device (arXiv 2110.07029 §III: a "worker" replica ``w_i``).

    Attributes
    ----------
    backend
        The device backend: a :class:`~xmc_engine.backends.base.SchedulerBackend` (the
        scheduler, the merges and the algorithms use nothing else of it).

    Notes
    -----
    The ``sync`` baseline (:mod:`xmc_engine.scheduler.sync`) also needs the optional gradient
    pair ``grad_batch(rows) -> (loss_sum, grads)`` and ``apply_grads(grads, lr)``; ``grads``
    follows :meth:`params`, its first entry row-sparse ``(rows int64 sorted, grad_rows)``
    (:meth:`xmc_engine.model.MLPReplica.grad_batch`).

    The row-sparse merge (:func:`xmc_engine.scheduler.merge.merge_changed_rows`) needs the
    optional pair ``changed_rows()`` (a boolean mask of the first parameter's rows that steps
    changed since the parameters were last set, or ``None``) and ``set_params(params, rows=)``
    (copy only those rows of the first parameter, the others in full); replicas without them
    are merged densely.
    """

    backend: Any

    def train_batch(self, rows: np.ndarray, lr: float) -> float:
        """One SGD step on the training rows ``rows`` (int64, host); returns the summed loss."""

    def params(self) -> list:
        """The live parameter arrays on the device (same order and shapes for every replica)."""

    def set_params(self, params: list) -> None:
        """Copy ``params`` into this replica's own arrays (peer copy across GPUs)."""


class HostBackend:
    """NumPy backend of any dtype for fakes: the whole
    :class:`~xmc_engine.backends.base.SchedulerBackend` protocol, none of the model's kernels.

    It is what the scheduler, the merges and the algorithms call (arrays and transfers, the
    worker context, the merge launchers), written with plain NumPy so that
    :class:`FakeReplica`'s float64 parameters merge exactly. ``tracks_rows`` is False: fakes
    keep no record of changed rows, so ``merge_rows`` / ``copy_rows`` (and the column pair)
    raise.
    """

    name = "cpu"
    xp = np
    device_id = None
    threads = None
    tracks_rows = False

    def asarray(self, a, dtype=None):
        return np.asarray(a, dtype=dtype)

    def to_host(self, a):
        return np.asarray(a)

    def to_float(self, x) -> float:
        return float(x)

    def empty(self, shape, dtype=np.float32):
        return np.empty(shape, dtype)

    def zeros(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype)

    def copy_into(self, dst, src) -> None:
        np.copyto(dst, src)

    def activate(self):
        return contextlib.nullcontext()

    def thread_budget(self, n: int | None = None):
        return contextlib.nullcontext()

    def kernel_threads(self, n: int):
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        """Nothing queued: NumPy returns when done."""

    def fence(self) -> None:
        """Nothing to order: NumPy returns when done."""

    def all_finite(self, a) -> bool:
        return bool(np.isfinite(a).all())

    def weighted_sum(self, arrays, weights, out):
        np.multiply(arrays[0], weights[0], out=out)
        for a, w in zip(arrays[1:], weights[1:], strict=True):
            out += w * a
        return out

    def momentum(self, wbar, z1, z2, mu, out):
        np.subtract(z1, z2, out=out)
        out *= mu
        out += wbar
        return out

    def elastic(self, x, center, alpha, diff_out):
        np.subtract(x, center, out=diff_out)
        diff_out *= alpha
        x -= diff_out
        return diff_out

    def merge_rows(self, arrays, weights, rows, out, broadcast=False, norm=True):
        raise NotImplementedError("HostBackend.tracks_rows is False: no row-sparse merge "
                                  "(merge densely with weighted_sum)")

    def copy_rows(self, dst, src, rows) -> None:
        raise NotImplementedError("HostBackend.tracks_rows is False: no row-sparse copy "
                                  "(copy whole arrays with copy_into)")

    def merge_columns(self, arrays, weights, cols, out, broadcast=False) -> bool:
        raise NotImplementedError("HostBackend.tracks_rows is False: no column-sparse merge "
                                  "(merge densely with weighted_sum)")

    def copy_columns(self, dst, src, cols) -> None:
        raise NotImplementedError("HostBackend.tracks_rows is False: no column-sparse copy "
                                  "(copy whole arrays with copy_into)")


class FakeReplica:
    """A replica without real compute, for scheduler tests and integration scaffolding.

    The model is the convex problem ``loss_j(w) = 0.5 * ||w - t_j||^2`` per sample ``j``, with
    targets ``t_j`` drawn once from ``seed`` (the same for every replica built with the same
    ``seed``). One step sets ``w <- w - lr * (w - mean_{j in rows} t_j)`` on every parameter
    array and returns the summed loss: deterministic, order-sensitive, cheap.

    Parameters
    ----------
    n_samples : int
        Training rows this replica can be asked for.
    shapes : sequence of tuple
        Shapes of the parameter arrays (float64, host).
    latency_per_sample, latency_per_step : float
        Seconds one step on ``b`` rows takes: ``latency_per_step + b * latency_per_sample``. In the
        threaded scheduler the replica sleeps that long; the simulated scheduler reads it from
        :meth:`simulated_seconds` instead and never sleeps.
    sleep : bool
        Whether :meth:`train_batch` really sleeps (set False for the simulated scheduler).
    fail_at_step : int, optional
        Raise ``RuntimeError`` at this step (0-based), to test failure propagation.
    nan_at_step : int, optional
        Make the parameters NaN at this step, to test non-finite detection.
    hang_at_step : int, optional
        Sleep ``hang_seconds`` at this step (to test scheduler timeouts).
    record : bool
        Keep ``self.history`` = list of ``(rows, lr)`` for every step.
    seed : int
        Seeds the targets and the initial parameters.
    """

    def __init__(self, n_samples: int, shapes=((4, 3), (3,)), *, latency_per_sample: float = 1e-5,
                 latency_per_step: float = 1e-4, sleep: bool = True,
                 fail_at_step: int | None = None, nan_at_step: int | None = None,
                 hang_at_step: int | None = None,
                 hang_seconds: float = 60.0, record: bool = True, seed: int = 0, backend=None):
        self.n_samples = int(n_samples)
        self.backend = backend if backend is not None else HostBackend()
        rng = np.random.default_rng(seed)
        self._targets = [rng.standard_normal((self.n_samples, *s)) for s in shapes]
        self._params = [rng.standard_normal(s) for s in shapes]
        self.latency_per_sample = float(latency_per_sample)
        self.latency_per_step = float(latency_per_step)
        self.sleep = sleep
        self.fail_at_step = fail_at_step
        self.nan_at_step = nan_at_step
        self.hang_at_step = hang_at_step
        self.hang_seconds = hang_seconds
        self.record = record
        self.steps = 0
        self.history: list[tuple[np.ndarray, float]] = []

    def simulated_seconds(self, n_rows: int) -> float:
        """Latency of one step on ``n_rows`` rows (used by the simulated scheduler's clock)."""
        return self.latency_per_step + n_rows * self.latency_per_sample

    def _begin_step(self, rows, lr: float) -> tuple[int, np.ndarray]:
        """Step counter, injected failures/hangs, latency and history shared by both steps."""
        step = self.steps
        self.steps += 1
        if self.fail_at_step is not None and step == self.fail_at_step:
            raise RuntimeError(f"FakeReplica: injected failure at step {step}")
        if self.hang_at_step is not None and step == self.hang_at_step:
            time.sleep(self.hang_seconds)
        if self.sleep:
            time.sleep(self.simulated_seconds(len(rows)))
        rows = np.asarray(rows, dtype=np.int64)
        if self.record:
            self.history.append((rows.copy(), float(lr)))
        return step, rows

    def grad_batch(self, rows: np.ndarray) -> tuple[float, list]:
        """``(loss_sum, grads)`` with ``grads[k] = w_k - mean_{j in rows} t_j`` (no update).

        Same layout as :meth:`xmc_engine.model.MLPReplica.grad_batch`: ``grads[0]`` is
        row-sparse, ``(arange(shape[0]) int64, dense gradient)`` (every row touched); the step
        counts as a step for ``fail_at_step`` / ``nan_at_step`` (NaN gradients) and is recorded
        in ``history`` with ``lr = nan``.
        """
        step, rows = self._begin_step(rows, float("nan"))
        loss = 0.0
        grads: list = []
        for w, t in zip(self._params, self._targets, strict=True):
            tb = t[rows]
            loss += 0.5 * float(((w[None] - tb) ** 2).sum())
            g = w - tb.mean(axis=0)
            if self.nan_at_step is not None and step == self.nan_at_step:
                g[...] = np.nan
            grads.append(g)
        grads[0] = (np.arange(grads[0].shape[0], dtype=np.int64), grads[0])
        return loss, grads

    def apply_grads(self, grads: list, lr: float) -> None:
        """``w -= lr * g``; ``grads[0]`` row-sparse ``(rows, grad_rows)`` (:meth:`grad_batch`)."""
        rows, g0 = grads[0]
        self._params[0][np.asarray(rows, dtype=np.int64)] -= lr * np.asarray(g0)
        for w, g in zip(self._params[1:], grads[1:], strict=True):
            w -= lr * np.asarray(g)

    def train_batch(self, rows: np.ndarray, lr: float) -> float:
        step, rows = self._begin_step(rows, lr)
        loss = 0.0
        for w, t in zip(self._params, self._targets, strict=True):
            tb = t[rows]
            loss += 0.5 * float(((w[None] - tb) ** 2).sum())
            w -= lr * (w - tb.mean(axis=0))
        if self.nan_at_step is not None and step == self.nan_at_step:
            for w in self._params:
                w[...] = np.nan
        return loss

    def params(self) -> list:
        return self._params

    def set_params(self, params: list) -> None:
        for dst, src in zip(self._params, params, strict=True):
            dst[...] = src
