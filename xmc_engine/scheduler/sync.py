"""Synchronous data-parallel SGD over the devices: one gradient all-reduce and one update per step.

DESIGN.md §4 baseline ``sync`` (the TensorFlow MirroredStrategy / Horovod / PyTorch DDP scheme).
Each step every device ``i`` takes its ``b_i`` rows of the global batch from the shared
:class:`~xmc_engine.scheduler.queue.BatchQueue` (static quotas, the epoch permutation of every
other algorithm), computes the gradient of its mean loss ``g_i`` (``replica.grad_batch``), the
host reduces ``ḡ = Σ_i (b_i / Σ_j b_j) g_i`` (the gradient of the mean loss over the global
batch) and every replica applies the same step ``w <- w − lr ḡ`` (``replica.apply_grads``), so
the replicas stay identical. The ``W1`` gradient stays row-sparse: the reduce works on the union
of the rows the devices touched. The slowest device sets the pace: a step ends when the last
gradient arrives (a speed factor ``s < 1`` still idles a worker ``1/s − 1`` times its busy time).

:class:`SyncLoop` replaces the merge-period loop of
:class:`~xmc_engine.scheduler.runner.ParallelTrainer` for policies with ``synchronous = True``
(:class:`xmc_engine.algorithms.sync.SyncSGD`). A *period* here is ``period_steps`` steps: it
only groups steps for the run log (one ``"merge"`` record per period, the same fields as the
other algorithms), the learning-rate schedule and the divergence check. The pending averaged
update is applied together with the next gradient computation (one barrier per step).
"""

from __future__ import annotations

import logging
import queue as _queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from xmc_engine.errors import DeviceFailure, DivergenceError
from xmc_engine.scheduler.merge import find_nonfinite
from xmc_engine.scheduler.runner import (
    _epoch_result,
    _new_totals,
    _next_report,
    _tally_period,
    _thread_budget,
)

logger = logging.getLogger(__name__)

__all__ = ["SyncLoop", "allreduce_grads"]


def _weighted_sum(arrays: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``Σ_k w_k a_k`` of host arrays (same shape and dtype) in one output, no temporaries."""
    out = np.empty_like(arrays[0])
    if len(arrays) == 1 or out.dtype != np.float32:  # the kernel computes in float32
        np.multiply(arrays[0], out.dtype.type(weights[0]), out=out)
        for a, w in zip(arrays[1:], weights[1:], strict=True):
            out += out.dtype.type(w) * a
        return out
    from xmc_engine.kernels.merge import weighted_sum_cpu

    weighted_sum_cpu([np.ascontiguousarray(a) for a in arrays], list(weights), out)
    return out


def allreduce_grads(grads: Sequence[list | None], weights: Sequence[float]) -> list:
    """Weighted sum of per-device gradients on the host (the all-reduce of synchronous SGD).

    Parameters
    ----------
    grads : list (n_devices) of gradient lists or ``None``
        Host arrays in the layout of :meth:`xmc_engine.model.MLPReplica.grad_batch`: entry 0 is
        row-sparse ``(rows int64 (n_rows_i,) sorted unique, grad_rows (n_rows_i, h))``, the
        others dense. ``None`` (a device without rows this step) is skipped.
    weights : sequence of float, shape (n_devices,)
        ``b_i / Σ_j b_j``: each device's share of the global batch, so that the result is the
        gradient of the mean loss over the whole global batch. Weight 0 is skipped.

    Returns
    -------
    list
        Same layout: ``W1`` over the sorted union of the devices' rows (rows a device did not
        touch contribute 0), dense entries ``Σ_i w_i g_i``. Fresh arrays (inputs untouched).
    """
    used = [i for i, g in enumerate(grads) if g is not None and weights[i] != 0.0]
    if not used:
        raise ValueError("allreduce_grads: no device contributed a gradient")
    w = [float(weights[i]) for i in used]
    row_sets = [np.asarray(grads[i][0][0], dtype=np.int64) for i in used]
    parts = [np.asarray(grads[i][0][1]) for i in used]
    if len(used) == 1:
        rows = row_sets[0].copy()
        g1 = np.multiply(parts[0], parts[0].dtype.type(w[0]))
    else:
        rows = np.unique(np.concatenate(row_sets))
        g1 = np.zeros((rows.shape[0], *parts[0].shape[1:]), dtype=parts[0].dtype)
        for r, g, wi in zip(row_sets, parts, w, strict=True):
            # rows are unique within a device, so fancy-index += is an exact scatter-add
            g1[np.searchsorted(rows, r)] += g.dtype.type(wi) * g
    out = [(rows, g1)]
    for k in range(1, len(grads[used[0]])):
        out.append(_weighted_sum([np.asarray(grads[i][k]) for i in used], w))
    return out


def _to_host(backend, grads: list) -> list:
    to_host = getattr(backend, "to_host", np.asarray)
    rows, g1 = grads[0]
    return [(to_host(rows), to_host(g1))] + [to_host(g) for g in grads[1:]]


class SyncLoop:
    """The per-step synchronous loop of a :class:`ParallelTrainer` (module docstring).

    Built by the trainer for a policy with ``synchronous = True``; uses the trainer's replicas,
    devices, queue, mode, cost model, timeout, trace and run log. In ``"threads"`` mode it runs
    one persistent host thread per device (thread budget set once in the thread, as the
    trainer's own workers do); ``"simulated"`` runs on the main thread with a virtual clock.
    """

    def __init__(self, trainer):
        self.tr = trainer
        self.policy = trainer.policy
        n = trainer.n_devices
        for r in trainer.replicas:
            if not (hasattr(r, "grad_batch") and hasattr(r, "apply_grads")):
                raise TypeError(f"algorithm {self.policy.name!r} needs replicas with "
                                f"grad_batch() and apply_grads(); {type(r).__name__} has none")
        self._abort = threading.Event()
        self._threads: list[threading.Thread] = []
        if trainer.mode == "threads":
            self._inboxes = [_queue.SimpleQueue() for _ in range(n)]
            self._outbox: _queue.SimpleQueue = _queue.SimpleQueue()
            for i in range(n):
                t = threading.Thread(target=self._worker, args=(i,), daemon=True,
                                     name=f"xmc-sync-{i}-{trainer.devices[i]}")
                t.start()
                self._threads.append(t)

    # -- public --------------------------------------------------------------------------------
    def run_epoch(self, epoch: int, lr: float, stop_after: int | None = None) -> dict[str, Any]:
        """One epoch; same contract and result as :meth:`ParallelTrainer.run_epoch`."""
        tr, pol = self.tr, self.policy
        n = tr.n_devices
        q = tr.queue
        tr._open_epoch(epoch)
        tot = _new_totals(n)
        loss_sum, periods, steps_total, reduce_s, train_s, lr_t = 0.0, 0, 0, 0.0, 0.0, 0.0
        t_epoch = time.perf_counter()
        while not q.epoch_done and not tr._stop_reached(stop_after):
            done_before = tr.n_samples - q.remaining
            acct = q.start_period(pol.batch_sizes())
            progress = epoch + (done_before + acct.budget) / tr.n_samples
            lr_t, lrs = pol.learning_rates(lr, progress)
            step_lr = lrs[0]
            busy, idle, loss = [0.0] * n, [0.0] * n, [0.0] * n
            pending, steps, period_s = None, 0, 0.0
            while True:
                rows = [q.take(i) for i in range(n)]
                if all(r is None for r in rows):
                    break
                for i, r in enumerate(rows):
                    if r is not None:
                        tr._trace("take", i)
                res, dt = self._step(rows, pending, step_lr)
                period_s += dt
                total = sum(len(r) for r in rows if r is not None)
                weights = [len(r) / total if r is not None else 0.0 for r in rows]
                t0 = time.perf_counter()
                pending = allreduce_grads([g for _, g, _ in res], weights)
                reduce_s += time.perf_counter() - t0
                self._account(res, busy, idle, loss)
                steps += 1
            if pending is not None:  # flush: every replica is up to date between periods
                res, dt = self._step([None] * n, pending, step_lr)
                period_s += dt
                self._account(res, busy, idle, loss)
            bad = find_nonfinite([tr.replicas[0].params()], tr.replicas[0].backend)
            if bad:
                tr._broken = DivergenceError("non-finite model")
                raise DivergenceError(f"sync: the model became non-finite in epoch {epoch} "
                                      f"period {acct.period} (lr {step_lr:g})")
            if tr.mode == "simulated":
                tr.virtual_time += period_s
                train_s += period_s
            pol.end_period(progress, acct.updates, acct.samples, busy)
            loss_sum += sum(loss)
            tot_s = max(acct.total, 1)
            rows_log = _tally_period(tot, acct, tr.devices, busy, idle, loss,
                                     [acct.samples[i] / tot_s for i in range(n)], [step_lr] * n)
            if tr.log is not None:
                tr.log.write("merge", epoch=epoch, period=acct.period, lr=lr_t,
                             algorithm=pol.name, devices=rows_log, steps=steps, nonfinite=[])
            logger.debug("sync epoch %d period %d: %d steps", epoch, acct.period, steps)
            steps_total += steps
            periods += 1
            tr.period_global += 1
        if tr.mode == "threads":
            train_s = time.perf_counter() - t_epoch
        return _epoch_result(epoch, tot, tr.devices, pol.batch_sizes(), updates=steps_total,
                             periods=periods, loss_sum=loss_sum, lr=lr_t, train_s=train_s,
                             merge_s=reduce_s, done=q.epoch_done)

    def close(self) -> None:
        """Stop the worker threads (idempotent)."""
        self._abort.set()
        for inbox in getattr(self, "_inboxes", []):
            inbox.put(None)
        for t in self._threads:
            t.join(timeout=1.0)
        self._threads = []

    # -- internals -----------------------------------------------------------------------------
    @staticmethod
    def _account(res, busy, idle, loss) -> None:
        end = max(b for _, _, b in res)
        for i, (li, _, b) in enumerate(res):
            busy[i] += b
            idle[i] += end - b
            loss[i] += li

    def _job(self, i: int, rows, pending, lr: float) -> tuple[float, list | None, float]:
        """Apply the pending averaged update, then the gradient on ``rows`` (device ``i``).

        Returns ``(loss_sum, host grads or None, wall seconds)``.
        """
        rep = self.tr.replicas[i]
        t0 = time.perf_counter()
        if pending is not None:
            rep.apply_grads(pending, lr)
        loss, grads = 0.0, None
        if rows is not None:
            loss, grads = rep.grad_batch(rows)
            grads = _to_host(rep.backend, grads)  # synchronize! (device -> host)
        sync = getattr(rep.backend, "synchronize", None)
        if sync is not None:
            sync()
        return float(loss), grads, time.perf_counter() - t0

    def _step(self, rows, pending, lr: float) -> tuple[list, float]:
        """One barrier step on every device; returns ``([(loss, grads, busy)] * n, seconds)``."""
        if self.tr.mode == "simulated":
            return self._step_simulated(rows, pending, lr)
        return self._step_threads(rows, pending, lr)

    def _step_simulated(self, rows, pending, lr):
        tr = self.tr
        res = []
        for i in range(tr.n_devices):
            try:
                loss, grads, wall = self._job(i, rows[i], pending, lr)
            except Exception as e:
                tr._broken = e
                raise DeviceFailure(f"device {i} ({tr.devices[i]}) failed: {e!r}") from e
            n_rows = 0 if rows[i] is None else len(rows[i])
            res.append((loss, grads, tr._simulated_seconds(i, n_rows, wall)))
        return res, max(b for _, _, b in res)

    def _worker(self, i: int) -> None:
        tr = self.tr
        dev = tr.devices[i]
        try:
            with _thread_budget(dev, tr.replicas[i]):
                while True:
                    job = self._inboxes[i].get()
                    if job is None or self._abort.is_set():
                        return
                    try:
                        loss, grads, wall = self._job(i, *job)
                        if dev.speed < 1.0:
                            time.sleep(wall * (1.0 / dev.speed - 1.0))
                            wall /= dev.speed
                        self._outbox.put((i, (loss, grads, wall), None))
                    except BaseException as e:  # noqa: BLE001 - reported to the main thread
                        self._outbox.put((i, None, e))
        except BaseException as e:  # noqa: BLE001 - e.g. the thread budget failed
            self._outbox.put((i, None, e))

    def _step_threads(self, rows, pending, lr):
        tr = self.tr
        n = tr.n_devices
        t0 = time.perf_counter()
        for i in range(n):
            self._inboxes[i].put((rows[i], pending, lr))
        res: list = [None] * n
        waiting = set(range(n))
        while waiting:
            i, out, err = _next_report(self._outbox, waiting, tr.devices, tr.timeout,
                                       self._fail, "a synchronous step")
            if err is not None:
                self._fail(err)
                raise DeviceFailure(f"device {i} ({tr.devices[i]}) failed: {err!r}") from err
            waiting.discard(i)
            res[i] = out
        return res, time.perf_counter() - t0

    def _fail(self, err: BaseException) -> None:
        self.tr._broken = err
        logger.error("device failure: %r; stopping all sync workers", err)
        self.close()
