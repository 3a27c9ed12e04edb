"""The parallel trainer: one host thread per device, merge barrier, merge on the main thread.

arXiv 2110.07029 §III (dynamic scheduling + normalized model merging), DESIGN.md §3-4. Each merge
period: the policy gives batch sizes and learning rates; the devices draw batches from the shared
:class:`~xmc_engine.scheduler.queue.BatchQueue` until it refuses them; at the barrier the main
thread runs the policy's merge (which broadcasts the central model) and lets the policy adapt.

Two modes share the queue, the controller and the merge code:

``"threads"``    one persistent host thread per device (the real thing). A worker sets its
                 device's thread budget once, in its own thread. A speed factor ``s < 1`` makes
                 the worker idle ``(1/s - 1)`` times the busy time of each step (emulated
                 heterogeneity, DESIGN.md §3).
``"simulated"``  a deterministic discrete-event run on a virtual clock, all on the main thread,
                 no sleeping: a step of device ``i`` on ``b`` rows lasts ``cost(i, b) / s_i``
                 virtual seconds, where ``cost`` defaults to ``replica.simulated_seconds(b)``
                 (:class:`~xmc_engine.scheduler.replica.FakeReplica`) or else the measured wall
                 time of the step. The device with the earliest clock takes the next batch
                 (ties: lowest id). Used by the tests on noisy machines.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue as _queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from xmc_engine.errors import DeviceFailure
from xmc_engine.scheduler.queue import BatchQueue

logger = logging.getLogger(__name__)

__all__ = ["ParallelTrainer"]

MODES = ("threads", "simulated")


class _Abort(Exception):
    pass


def _thread_budget(dev, rep):
    """Context manager that sets a worker thread's budget (call it in the worker thread): the
    backend's own ``threads`` when it has one (the CPU backend calibrates it), else the
    device's; a null context for a backend without ``thread_budget``."""
    budget = getattr(rep.backend, "thread_budget", None)
    n = getattr(rep.backend, "threads", None) or dev.threads
    return budget(n) if budget is not None else contextlib.nullcontext()


def _next_report(outbox, waiting, devices, timeout: float, fail, what: str):
    """The next ``(device, result, error)`` a worker put in ``outbox``; after ``timeout`` seconds
    of silence, ``fail`` (which stops the workers) gets a ``TimeoutError`` and ``DeviceFailure``
    names the devices in ``waiting`` that did not finish ``what``."""
    try:
        return outbox.get(timeout=timeout)
    except _queue.Empty:
        names = ", ".join(f"{j} ({devices[j]})" for j in sorted(waiting))
        fail(TimeoutError(f"no report for {timeout:g} s"))
        raise DeviceFailure(f"device(s) {names} did not finish {what} within {timeout:g} s"
                            ) from None


def _new_totals(n: int) -> dict[str, list]:
    """Per-device epoch totals, filled period by period by :func:`_tally_period`."""
    return {"samples": [0] * n, "updates": [0] * n, "busy_s": [0.0] * n, "idle_s": [0.0] * n}


def _tally_period(tot, acct, devices, busy, idle, loss, weights, lrs) -> list[dict]:
    """Add one period's per-device counts to ``tot``; returns the ``"merge"`` log's device rows."""
    rows = []
    for i in range(len(devices)):
        tot["samples"][i] += acct.samples[i]
        tot["updates"][i] += acct.updates[i]
        tot["busy_s"][i] += busy[i]
        tot["idle_s"][i] += idle[i]
        rows.append({"device": i, "name": str(devices[i]),
                     "batch_size": acct.batch_sizes[i], "updates": acct.updates[i],
                     "samples": acct.samples[i], "weight": weights[i],
                     "lr": lrs[i], "busy_s": busy[i],
                     "idle_s": idle[i], "loss": loss[i]})
    return rows


def _epoch_result(epoch, tot, devices, batch_sizes, *, updates, periods, loss_sum, lr,
                  train_s, merge_s, done: bool = True) -> dict[str, Any]:
    """The result dict of :meth:`ParallelTrainer.run_epoch` (and of the sync loop's)."""
    samples = sum(tot["samples"])
    return {
        "epoch": epoch, "done": bool(done), "samples": samples, "updates": updates,
        "periods": periods, "loss": loss_sum / max(samples, 1), "lr": lr,
        "train_seconds": train_s, "merge_seconds": merge_s,
        "devices": [{"device": i, "name": str(devices[i]),
                     "samples": tot["samples"][i], "updates": tot["updates"][i],
                     "busy_s": tot["busy_s"][i], "idle_s": tot["idle_s"][i],
                     "batch_size": batch_sizes[i]} for i in range(len(devices))],
    }


class ParallelTrainer:
    """Runs a training policy over several replicas, one per device.

    Parameters
    ----------
    replicas : sequence of Replica
        One per device (:class:`~xmc_engine.scheduler.replica.Replica`). At construction every
        replica is set to replica 0's parameters, so all start from the same model.
    devices : sequence of DeviceSpec
        Same length; provides the speed factor and thread budget of each worker. ``None`` means
        full-speed single-thread devices.
    policy : Policy or str
        A policy object (:mod:`xmc_engine.algorithms`) or an algorithm name with default options.
    n_samples : int
        Training rows; ``replica.train_batch`` receives int64 indices into ``range(n_samples)``.
    seed : int
        Seeds the epoch permutations.
    log : object with ``write(event, **fields)``, optional
        Receives one ``"merge"`` event per period (the run log, :mod:`xmc_engine.runlog`).
    mode : {'threads', 'simulated'}
        See the module docstring.
    cost : callable ``(device_id, n_rows) -> seconds``, optional
        Simulated mode's step latency (before the speed factor).
    timeout : float
        Seconds the main thread waits for a worker report before declaring the silent devices
        failed (``DeviceFailure``): no hang even if a device stalls.
    trace : bool
        Record ``self.events``: ``(kind, period, device)`` tuples in the order they happened,
        kinds ``"take"``, ``"merge_start"``, ``"merge_end"`` (for barrier tests).
    elastic : bool
        A device whose worker raises is dropped instead of failing the run: every row it took in
        the period goes back to the queue (:meth:`BatchQueue.give_back`), it gets merge weight 0
        (the weights renormalise over the others) and a ``device_dropped`` event is logged. Only
        when every device has failed does the run stop with ``DeviceFailure``. ``False``: the
        first failure stops the run.
    rejoin_after : int or None
        A dropped device rejoins, from the merged model, after this many further merge periods
        (``0``: at the next period; logged ``device_rejoined``); ``None``: never.
    faults : str, list of Fault or None
        Fault injection (:mod:`xmc_engine.faults`); ``None`` reads ``XMC_FAULT``.

    A replica whose parameters or period loss become non-finite is left out of the merge, reset
    to the merged model by the broadcast, and its learning rate is halved from then on (logged
    ``nonfinite``); when every remaining replica is non-finite the run stops with
    ``DivergenceError``.

    Notes
    -----
    Use as a context manager (or call :meth:`close`) to stop the worker threads.
    """

    def __init__(self, replicas: Sequence, devices: Sequence | None, policy, n_samples: int, *,
                 seed: int = 0, log=None, mode: str = "threads",
                 cost: Callable[[int, int], float] | None = None, timeout: float = 600.0,
                 trace: bool = False, elastic: bool = True, rejoin_after: int | None = None,
                 faults=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.replicas = list(replicas)
        n = len(self.replicas)
        if n == 0:
            raise ValueError("ParallelTrainer needs at least one replica")
        if devices is None:
            from xmc_engine.devices import DeviceSpec

            devices = [DeviceSpec("cpu")] * n
        self.devices = list(devices)
        if len(self.devices) != n:
            raise ValueError(f"{n} replicas but {len(self.devices)} devices")
        if isinstance(policy, str):
            from xmc_engine.algorithms import get_algorithm

            policy = get_algorithm(policy)
        self.policy = policy
        self.n_samples = int(n_samples)
        self.seed = int(seed)
        self.log = log
        self.mode = mode
        self.cost = cost
        self.timeout = float(timeout)
        self.trace = trace
        self.events: list[tuple[str, int, int]] = []
        self._trace_lock = threading.Lock()
        self.queue = BatchQueue(self.n_samples, n, policy.merge_period, seed=self.seed,
                                static=policy.static)
        init = self.replicas[0].params()
        for r in self.replicas[1:]:
            r.set_params(init)
        policy.setup(self.replicas, self.n_samples)
        self.queue.merge_period = int(policy.merge_period)  # setup may size it by the devices
        self.period_global = 0
        self.virtual_time = 0.0
        self.elastic = bool(elastic)
        if rejoin_after is not None and int(rejoin_after) < 0:
            raise ValueError(f"rejoin_after must be >= 0 or None, got {rejoin_after!r}")
        self.rejoin_after = None if rejoin_after is None else int(rejoin_after)
        from xmc_engine.faults import FaultInjector

        self.faults = FaultInjector.from_spec(faults)
        self.alive = [True] * n
        self.dropped_at: list[int | None] = [None] * n  # period_global of the drop
        self.lr_scale = [1.0] * n  # halved at each non-finite period of the device
        self._broken: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._abort = threading.Event()
        self._sync = None
        self._open: int | None = None  # the epoch a run_epoch(stop_after=...) call stopped in
        if getattr(policy, "synchronous", False):  # per-step gradient all-reduce (sync.py)
            from xmc_engine.scheduler.sync import SyncLoop

            self._sync = SyncLoop(self)
        if mode == "threads" and self._sync is None:
            self._start_workers()

    # -- public --------------------------------------------------------------------------------
    @property
    def n_devices(self) -> int:
        return len(self.replicas)

    def central_params(self) -> list:
        """The central model after the last merge (valid until the next merge)."""
        return self.policy.central_params()

    def state_dict(self) -> dict[str, Any]:
        """JSON-able scheduling state for checkpoints (policy state, period counter)."""
        return {"policy": self.policy.state_dict(), "period_global": self.period_global,
                "lr_scale": list(self.lr_scale)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output when resuming (the model is restored separately)."""
        self.policy.load_state_dict(state.get("policy", {}))
        self.period_global = int(state.get("period_global", 0))
        scale = [float(x) for x in state.get("lr_scale", self.lr_scale)]
        if len(scale) == self.n_devices:
            self.lr_scale = scale

    def run_epoch(self, epoch: int, lr: float, stop_after: int | None = None) -> dict[str, Any]:
        """Train one epoch (every sample exactly once), merging every ``S`` samples.

        Parameters
        ----------
        epoch : int
            Epoch number (seeds the shuffle, drives warm-up and decay).
        lr : float
            Base learning rate ``lr0``; the policy applies its schedule (warm-up ramp, decay,
            per-device linear scaling) on top.
        stop_after : int, optional
            Return at the first merge barrier at which at least this many samples of the epoch
            are done (mid-epoch evaluation); the next call with the same ``epoch`` continues it.
            The periods are the same as in an uninterrupted epoch. ``None``: the whole epoch.

        Returns
        -------
        dict
            Totals of this call: ``epoch, done`` (the epoch is complete), ``samples, updates,
            periods, loss`` (mean per sample), ``lr`` (base rate of the last period),
            ``train_seconds`` (wall time, or virtual time in simulated mode), ``merge_seconds``
            and ``devices``: one dict per device with ``device, samples, updates, busy_s,
            idle_s, batch_size`` (at the end of the call).

        Raises
        ------
        DeviceFailure
            Every device failed (or, with ``elastic=False``, one did), or a worker stayed
            silent for ``timeout`` seconds; names the devices.
        DivergenceError
            Every remaining replica became non-finite.
        """
        if self._broken is not None:
            raise DeviceFailure(f"trainer is unusable after an earlier failure: {self._broken}")
        if self._sync is not None:
            return self._sync.run_epoch(epoch, lr, stop_after)
        n = self.n_devices
        q = self.queue
        self._open_epoch(epoch)
        tot = _new_totals(n)
        loss_sum, periods, merge_s, train_s, lr_t = 0.0, 0, 0.0, 0.0, 0.0
        t_epoch = time.perf_counter()
        while not q.epoch_done and not self._stop_reached(stop_after):
            done_before = self.n_samples - q.remaining
            self._rejoin(epoch)
            q.set_active(self.alive)
            acct = q.start_period(self.policy.batch_sizes())
            progress = epoch + (done_before + acct.budget) / self.n_samples
            lr_t, lrs = self.policy.learning_rates(lr, progress)
            lrs = [x * s for x, s in zip(lrs, self.lr_scale, strict=True)]
            if self.mode == "threads":
                res = self._period_threads(lrs)
            else:
                res = self._period_simulated(lrs)
            for i, err in res.get("failed", []):
                self._drop(i, err, epoch, acct.period)
            train_s += res["seconds"]
            t0 = time.perf_counter()
            self._trace("merge_start", -1)
            self.policy.excluded = {i for i in range(n) if not self.alive[i]}
            self.policy.nonfinite = {i for i in range(n)
                                     if self.alive[i] and not math.isfinite(res["loss"][i])}
            try:
                info = self.policy.merge(self.replicas, acct.updates)
            finally:
                self.policy.excluded, self.policy.nonfinite = set(), set()
            self._trace("merge_end", -1)
            for i in info.get("nonfinite") or []:
                self.lr_scale[i] *= 0.5
                logger.warning("device %d (%s) went non-finite: left out of the merge, reset "
                               "to the merged model, learning rate x%g", i, self.devices[i],
                               self.lr_scale[i])
                if self.log is not None:
                    self.log.write("nonfinite", epoch=epoch, period=acct.period, device=i,
                                   name=str(self.devices[i]), lr_scale=self.lr_scale[i])
            dt_merge = time.perf_counter() - t0
            merge_s += dt_merge
            self.policy.end_period(progress, acct.updates, acct.samples, res["busy_s"])
            loss_sum += sum(res["loss"])
            rows = _tally_period(tot, acct, self.devices, res["busy_s"], res["idle_s"],
                                 res["loss"], info["weights"], lrs)
            if self.log is not None:
                extra = {k: v for k, v in info.items() if k != "weights"}
                self.log.write("merge", epoch=epoch, period=acct.period, lr=lr_t,
                               algorithm=self.policy.name, merge_s=dt_merge, devices=rows,
                               **extra)
            logger.debug("epoch %d period %d: updates %s weights %s", epoch, acct.period,
                         acct.updates, info["weights"])
            periods += 1
            self.period_global += 1
        if self.mode == "threads":
            train_s = time.perf_counter() - t_epoch
        return _epoch_result(epoch, tot, self.devices, self.policy.batch_sizes(),
                             updates=sum(tot["updates"]), periods=periods, loss_sum=loss_sum,
                             lr=lr_t, train_s=train_s, merge_s=merge_s, done=q.epoch_done)

    def close(self) -> None:
        """Stop the worker threads (idempotent). Threads stuck in a step are left as daemons."""
        self._abort.set()
        if getattr(self, "_sync", None) is not None:
            self._sync.close()
        for inbox in getattr(self, "_inboxes", []):
            inbox.put(None)
        for t in self._threads:
            t.join(timeout=1.0)
        self._threads = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _open_epoch(self, epoch: int) -> None:
        """Continue epoch ``epoch`` if a call stopped inside it, else shuffle and start it."""
        if self._open != epoch or self.queue.epoch_done:
            self.queue.start_epoch(epoch)
            self._open = epoch

    def _stop_reached(self, stop_after: int | None) -> bool:
        return stop_after is not None and self.n_samples - self.queue.remaining >= stop_after

    def _trace(self, kind: str, device: int) -> None:
        if self.trace:
            with self._trace_lock:
                self.events.append((kind, self.period_global, device))

    def _step(self, i: int, rows, lr: float) -> tuple[float, float]:
        """One step of device ``i``; returns ``(loss, wall seconds)``."""
        rep = self.replicas[i]
        t0 = time.perf_counter()
        if self.faults is not None:
            self.faults.before_step(i)
        loss = rep.train_batch(rows, lr)
        sync = getattr(rep.backend, "synchronize", None)
        if sync is not None:
            sync()
        if self.faults is not None:
            self.faults.after_step(i, rep)
        return float(loss), time.perf_counter() - t0

    # simulated mode ---------------------------------------------------------------------------
    def _simulated_seconds(self, i: int, n_rows: int, wall: float) -> float:
        """Virtual duration of a step of device ``i`` on ``n_rows`` rows that took ``wall`` s:
        ``cost(i, n_rows)``, else ``replica.simulated_seconds(n_rows)``, else ``wall``; divided
        by the device's speed factor."""
        if self.cost is not None:
            dt = float(self.cost(i, n_rows))
        elif hasattr(self.replicas[i], "simulated_seconds"):
            dt = float(self.replicas[i].simulated_seconds(n_rows))
        else:
            dt = wall
        return dt / self.devices[i].speed

    def _period_simulated(self, lrs: Sequence[float]) -> dict[str, Any]:
        n = self.n_devices
        clock = [0.0] * n
        busy = [0.0] * n
        loss = [0.0] * n
        failed: list[tuple[int, BaseException]] = []
        active = [i for i in range(n) if self.alive[i]]
        while active:
            i = min(active, key=lambda j: (clock[j], j))
            rows = self.queue.take(i)
            if rows is None:
                active.remove(i)
                continue
            self._trace("take", i)
            try:
                step_loss, wall = self._step(i, rows, lrs[i])
            except Exception as e:
                if not self.elastic:
                    self._broken = e
                    raise DeviceFailure(f"device {i} ({self.devices[i]}) failed: {e!r}") from e
                self.queue.give_back(i)
                failed.append((i, e))
                active.remove(i)
                busy[i] = loss[i] = 0.0
                if len(failed) + sum(not a for a in self.alive) == n:
                    self._all_failed(failed)
                continue
            dt = self._simulated_seconds(i, len(rows), wall)
            clock[i] += dt
            busy[i] += dt
            loss[i] += step_loss
        end = max(clock)
        self.virtual_time += end
        return {"seconds": end, "busy_s": busy, "idle_s": [end - c for c in clock],
                "loss": loss, "failed": failed}

    # threaded mode ----------------------------------------------------------------------------
    def _start_workers(self) -> None:
        n = self.n_devices
        self._inboxes = [_queue.SimpleQueue() for _ in range(n)]
        self._outbox: _queue.SimpleQueue = _queue.SimpleQueue()
        for i in range(n):
            t = threading.Thread(target=self._worker, args=(i,), daemon=True,
                                 name=f"xmc-device-{i}-{self.devices[i]}")
            t.start()
            self._threads.append(t)

    def _worker(self, i: int) -> None:
        try:
            with _thread_budget(self.devices[i], self.replicas[i]):
                while True:
                    job = self._inboxes[i].get()
                    if job is None:
                        return
                    try:
                        self._outbox.put((i, self._run_period(i, job), None))
                    except _Abort:
                        self._outbox.put((i, None, None))
                    except BaseException as e:  # noqa: BLE001 - reported to the main thread
                        self._outbox.put((i, None, e))
        except BaseException as e:  # noqa: BLE001 - e.g. the thread budget failed
            self._outbox.put((i, None, e))

    def _run_period(self, i: int, lr: float) -> dict[str, Any]:
        speed = self.devices[i].speed
        busy = loss = 0.0
        t_start = time.perf_counter()
        while True:
            if self._abort.is_set():
                raise _Abort
            rows = self.queue.take(i)
            if rows is None:
                break
            self._trace("take", i)
            try:
                step_loss, wall = self._step(i, rows, lr)
            except BaseException:
                if self.elastic:  # the main thread must see the rows back before the report
                    self.queue.give_back(i)
                raise
            if speed < 1.0:
                time.sleep(wall * (1.0 / speed - 1.0))
                wall /= speed
            busy += wall
            loss += step_loss
        return {"busy_s": busy, "loss": loss, "start": t_start}

    def _period_threads(self, lrs: Sequence[float]) -> dict[str, Any]:
        n = self.n_devices
        t0 = time.perf_counter()
        pending = {i for i in range(n) if self.alive[i]}
        for i in pending:
            self._inboxes[i].put(lrs[i])
        idle = {"busy_s": 0.0, "loss": 0.0}
        results: list[dict] = [idle] * n
        failed: list[tuple[int, BaseException]] = []
        while pending:
            i, res, err = _next_report(self._outbox, pending, self.devices, self.timeout,
                                       self._fail, "the merge period")
            if err is not None and not self.elastic:
                self._fail(err)
                raise DeviceFailure(f"device {i} ({self.devices[i]}) failed: {err!r}") from err
            pending.discard(i)
            if err is not None:
                failed.append((i, err))
                if len(failed) + sum(not a for a in self.alive) == n:
                    self._fail(err)
                    self._all_failed(failed)
                continue
            results[i] = res
        end = time.perf_counter()
        busy = [r["busy_s"] for r in results]
        return {"seconds": end - t0, "busy_s": busy, "loss": [r["loss"] for r in results],
                "idle_s": [max(0.0, (end - t0) - b) for b in busy], "failed": failed}

    # elastic device set -----------------------------------------------------------------------
    def _all_failed(self, failed) -> None:
        errs = "; ".join(f"device {i} ({self.devices[i]}): {e!r}" for i, e in failed)
        self._broken = failed[-1][1]
        raise DeviceFailure(f"every device has failed; last failures: {errs}") from failed[-1][1]

    def _drop(self, i: int, err: BaseException, epoch: int, period: int) -> None:
        """Take device ``i`` out of the run after its worker raised (rows already given back)."""
        self.alive[i] = False
        self.dropped_at[i] = self.period_global
        left = [j for j in range(self.n_devices) if self.alive[j]]
        logger.warning("device %d (%s) failed and is dropped: %r; continuing on %s", i,
                       self.devices[i], err, ", ".join(str(self.devices[j]) for j in left))
        if self.log is not None:
            self.log.write("device_dropped", epoch=epoch, period=period, device=i,
                           name=str(self.devices[i]), error=repr(err), remaining=left,
                           rejoin_after=self.rejoin_after)

    def _rejoin(self, epoch: int) -> None:
        """Bring back dropped devices whose ``rejoin_after`` periods are over."""
        if self.rejoin_after is None:
            return
        for i in range(self.n_devices):
            if self.alive[i] or self.period_global - self.dropped_at[i] <= self.rejoin_after:
                continue
            if self.mode == "threads" and not self._threads[i].is_alive():
                continue  # the worker thread itself died: it cannot come back
            self.replicas[i].set_params(self.central_params())
            self.alive[i] = True
            logger.warning("device %d (%s) rejoins from the merged model", i, self.devices[i])
            if self.log is not None:
                self.log.write("device_rejoined", epoch=epoch, period=self.period_global,
                               device=i, name=str(self.devices[i]))

    def _fail(self, err: BaseException) -> None:
        """Stop the other workers after a failure (they finish their current step)."""
        self._broken = err
        self._abort.set()
        logger.error("device failure: %r; stopping all workers", err)
        self.close()
