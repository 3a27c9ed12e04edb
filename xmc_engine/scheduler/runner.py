"""The one training loop: one host thread per device, merge periods, the merge barrier.

arXiv 2110.07029 §III (dynamic scheduling + normalized model merging), DESIGN.md §3-4. Every
algorithm runs through :class:`Trainer`, ``single`` (one device) and ``sync`` (one step per
period, a gradient all-reduce at the barrier) included. Each merge period: the schedule gives
the base learning rate ``lr(t)``, the policy gives batch sizes and per-device rates; the devices
draw batches from the shared :class:`~xmc_engine.scheduler.queue.BatchQueue` and step
(``policy.step``) until it refuses them; at the barrier the main thread runs ``policy.merge``
with a :class:`MergeContext` (which replicas to leave out, the node communicator, a way to run
work on every device) and lets the policy adapt.

Two modes share the queue, the policies and the merge code:

``"threads"``    one persistent host thread per device (the real thing), which enters its
                 device's thread budget once for its lifetime and runs whatever job the main
                 thread hands it (a period of steps, or a merge's per-device work). A speed
                 factor ``s < 1`` makes the worker idle ``(1/s - 1)`` times the busy time of
                 each step (emulated heterogeneity, DESIGN.md §3).
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
from dataclasses import dataclass, field
from typing import Any

from xmc_engine.errors import DeviceFailure
from xmc_engine.scheduler.controller import Schedule
from xmc_engine.scheduler.queue import BatchQueue

logger = logging.getLogger(__name__)

__all__ = ["MODES", "MergeContext", "Trainer"]

MODES = ("threads", "simulated")

#: In threaded mode with several devices the main thread merges with one CPU thread until a
#: merge takes longer than this (seconds), then with the CPU backend's full budget for the rest
#: of the run (0: always the full budget). A merge on two numba threads leaves libgomp's helper
#: thread spinning for about a millisecond (``GOMP_SPINCOUNT``, 300,000 by default) on a core
#: that a device's worker needs as the next period starts: with two one-thread devices in one
#: process the workers waited inside their steps for 9-13 % of their busy time on delicious
#: and debian_debtags (``bench/bench_omp_wait.py``). Two threads merge 1.2-1.4x faster, which
#: is worth that millisecond only for merges of more than about 10 ms (the Amazon-670K shape's
#: column merge of 11 % of the labels: 55 ms on one thread, 39 ms on two,
#: ``bench/bench_w2_layout.py``).
MERGE_ONE_THREAD_MAX_S = 0.010


class _Abort(Exception):
    """A worker's job was cancelled because another device failed."""


@dataclass
class MergeContext:
    """What a policy's merge needs from the trainer, passed explicitly at every barrier.

    Attributes
    ----------
    excluded : set of int
        Failed (dropped) devices: left out of this merge without being looked at.
    nonfinite : set of int
        Live devices whose period loss went non-finite: left out of the merge and reset to the
        merged model (by the broadcast, or by the policy).
    lrs : list of float
        The learning rate each device stepped with in the period.
    samples : list of int or None
        The training rows each device stepped on in the period (``None``: not counted, as
        where a test calls a merge directly).
    comm : NodeComm or None
        The node communicator of a multi-node run (:mod:`xmc_engine.distributed`); ``None`` on
        one node.
    run_on_devices : callable ``(fn) -> list``
        Runs ``fn(i)`` for every live device ``i`` in that device's worker (in parallel in the
        threaded mode, in order on the main thread in the simulated one); returns the results.
    run_shards : callable ``(n, fn) -> list``
        Splits ``range(n)`` into contiguous parts, one per live device in proportion to its
        speed factor, and runs ``fn(start, stop)`` for each non-empty part in that device's
        worker, as ``run_on_devices`` does; returns the results in device order. The
        row-sparse merge hands it the changed rows of ``W1`` it merges with the replicas'
        weights (:func:`~xmc_engine.scheduler.merge.merge_changed_rows`). Default:
        ``fn(0, n)`` on the calling thread.
    epoch, period : int
        Where the run is (for messages and logs).
    """

    excluded: set = field(default_factory=set)
    nonfinite: set = field(default_factory=set)
    lrs: list = field(default_factory=list)
    samples: list | None = None
    comm: Any = None
    run_on_devices: Callable[[Callable[[int], Any]], list] = lambda fn: []
    run_shards: Callable[[int, Callable[[int, int], Any]], list] = (
        lambda n, fn: [fn(0, n)])
    epoch: int = 0
    period: int = 0

    @property
    def multi_node(self) -> bool:
        return self.comm is not None and self.comm.size > 1


def _new_totals(n: int) -> dict[str, list]:
    return {"samples": [0] * n, "updates": [0] * n, "busy_s": [0.0] * n, "idle_s": [0.0] * n,
            "cpu_s": [0.0] * n}


class Trainer:
    """Runs a training policy over one or more replicas, one per device.

    Parameters
    ----------
    replicas : sequence of Replica
        One per device (:class:`~xmc_engine.scheduler.replica.Replica`). At construction every
        replica is set to replica 0's parameters, so all start from the same model.
    devices : sequence of DeviceSpec or None
        Same length; the speed factor and thread budget of each worker. ``None``: full-speed
        single-thread CPU devices.
    policy : Policy
        The algorithm (:func:`xmc_engine.algorithms.get_algorithm`).
    n_samples : int
        Training rows (of this node); ``replica.train_batch`` receives int64 indices into
        ``range(n_samples)``.
    batch_size : int
        ``B``, the base batch size (:attr:`xmc_engine.config.TrainConfig.batch_size`).
    schedule : Schedule
        The learning-rate schedule (:class:`~xmc_engine.scheduler.controller.Schedule`).
    seed : int
        Seeds the epoch permutations.
    log : object with ``write(event, **fields)``, optional
        Receives one ``"merge"`` record per period (the run log, :mod:`xmc_engine.runlog`).
    mode : {'threads', 'simulated'}
        See the module docstring.
    cost : callable ``(device_id, n_rows) -> seconds``, optional
        Simulated mode's step latency (before the speed factor).
    timeout : float
        Seconds the main thread waits for a worker before declaring the silent devices failed
        (``DeviceFailure``): no hang even if a device stalls.
    trace : bool
        Record ``self.events``: ``(kind, period, device)`` tuples in the order they happened,
        kinds ``"take"``, ``"merge_start"``, ``"merge_end"`` (for barrier tests).
    elastic : bool
        A device whose worker raises is dropped instead of failing the run: every row it took in
        the period goes back to the queue, it is left out of the merge and a ``device_dropped``
        record is logged. Only when every device has failed does the run stop with
        ``DeviceFailure``. ``False``: the first failure stops the run.
    rejoin_after : int or None
        A dropped device rejoins, from the merged model, after this many further merge periods
        (``0``: at the next period; logged ``device_rejoined``); ``None``: never.
    faults : str, list of Fault or None
        Fault injection (:mod:`xmc_engine.faults`); ``None`` reads ``XMC_FAULT``.
    comm : NodeComm or None
        One node of a multi-node run (DESIGN.md §6): every node merges equally often and the
        policy combines the nodes' merged models (:func:`xmc_engine.distributed.node_queue`).
    assignment : {'shared', 'fixed'}
        ``"fixed"``: a deterministic row-to-device assignment
        (:class:`~xmc_engine.scheduler.queue.FixedAssignmentQueue`, for tests).

    A replica whose period loss becomes non-finite is left out of the merge, reset to the merged
    model, and its learning rate is halved from then on (logged ``nonfinite``); when every
    remaining replica is non-finite the run stops with ``DivergenceError``.

    Use as a context manager (or call :meth:`close`) to stop the worker threads.
    """

    def __init__(self, replicas: Sequence, devices: Sequence | None, policy, n_samples: int, *,
                 batch_size: int, schedule: Schedule, seed: int = 0, log=None,
                 mode: str = "threads", cost: Callable[[int, int], float] | None = None,
                 timeout: float = 600.0, trace: bool = False, elastic: bool = True,
                 rejoin_after: int | None = None, faults=None, comm=None,
                 assignment: str = "shared"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.replicas = list(replicas)
        n = len(self.replicas)
        if n == 0:
            raise ValueError("Trainer needs at least one replica")
        if devices is None:
            from xmc_engine.devices import DeviceSpec

            devices = [DeviceSpec("cpu")] * n
        self.devices = list(devices)
        if len(self.devices) != n:
            raise ValueError(f"{n} replicas but {len(self.devices)} devices")
        if n > 1 and policy.max_devices == 1:
            raise ValueError(f"algorithm {policy.name!r} trains on one device, got {n}")
        if rejoin_after is not None and int(rejoin_after) < 0:
            raise ValueError(f"rejoin_after must be >= 0 or None, got {rejoin_after!r}")
        self.policy = policy
        self.n_samples = int(n_samples)
        self.batch_size = int(batch_size)
        self.schedule = schedule
        self.seed = int(seed)
        self.log = log
        self.mode = mode
        self.cost = cost
        self.timeout = float(timeout)
        self.trace = trace
        self.events: list[tuple[str, int, int]] = []
        self._trace_lock = threading.Lock()
        self.elastic = bool(elastic)
        self.rejoin_after = None if rejoin_after is None else int(rejoin_after)
        from xmc_engine.faults import FaultInjector

        self.faults = FaultInjector.from_spec(faults)
        self.comm = comm
        policy.prepare(self.replicas, self.batch_size, n_samples=self.n_samples)
        period = policy.period_samples(n, self.batch_size)
        # a period may go to one device alone (Policy.solo_device) only where the devices
        # draw from one shared queue on one node: with fixed shards the others' rows would wait
        self._solo_allowed = assignment == "shared" and (comm is None or comm.size == 1)
        if not self._solo_allowed:  # per-node queues: fixed shards or several nodes
            from xmc_engine.distributed import LocalComm, node_queue

            self.queue, period, self.n_global = node_queue(
                comm if comm is not None else LocalComm(), policy, self.n_samples, n, period,
                assignment=assignment, seed=self.seed)
        else:
            self.queue = BatchQueue(self.n_samples, n, period, seed=self.seed,
                                    static=policy.static, max_takes=policy.max_steps_per_period)
            self.n_global = self.n_samples
        init = self.replicas[0].params()
        for r in self.replicas[1:]:
            r.set_params(init)
        policy.setup(self.replicas, n_samples=self.n_samples, batch_size=self.batch_size,
                     merge_period=period, warmup_epochs=schedule.warmup_epochs)
        self.period_global = 0
        self.virtual_time = 0.0
        self.alive = [True] * n
        self._working = [True] * n  # the devices that train the open period
        self.dropped_at: list[int | None] = [None] * n  # period_global of the drop
        self.lr_scale = [1.0] * n  # halved at each non-finite period of the device
        self._broken: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._abort = threading.Event()
        self._open: int | None = None  # the epoch a run_epoch(stop_after=...) call stopped in
        # the main thread's CPU thread budget for merges (MERGE_ONE_THREAD_MAX_S); None: full
        self._merge_threads = (1 if mode == "threads" and n > 1 and MERGE_ONE_THREAD_MAX_S > 0
                               else None)
        self._merge_cpu = next((r.backend for r in self.replicas
                                if getattr(getattr(r, "backend", None), "name", None) == "cpu"),
                               None)  # whose kernel_threads limits the main thread's merges
        if mode == "threads":
            self._start_workers()

    # -- public --------------------------------------------------------------------------------
    @property
    def n_devices(self) -> int:
        return len(self.replicas)

    def central_params(self) -> list:
        """The central model after the last merge (valid until the next merge)."""
        return self.policy.central_params()

    def load_model(self, params) -> None:
        """Training goes on from ``params`` (the model's arrays, host or device): the central
        model and every replica become them (:meth:`Policy.load_model
        <xmc_engine.algorithms.base.Policy.load_model>`); between epochs, from the driver."""
        self.policy.load_model(self.replicas, params)

    def can_checkpoint(self) -> bool:
        """Whether :meth:`state_dict` can describe the run now: between two periods, with no
        rows of a failed device waiting in the queue."""
        return self.queue.position() is not None

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for checkpoints: the policy's state, the period counter, the devices'
        learning-rate scales and where the open epoch stands (the model and the optimizer
        state are saved separately)."""
        open_epoch = None
        if self._open is not None and not self.queue.epoch_done:
            open_epoch = self.queue.position()
        return {"policy": self.policy.state_dict(), "period_global": self.period_global,
                "lr_scale": list(self.lr_scale), "queue": open_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output when resuming (after the replicas got the model)."""
        self.policy.load_state_dict(state.get("policy", {}))
        self.period_global = int(state.get("period_global", 0))
        scale = [float(x) for x in state.get("lr_scale", self.lr_scale)]
        if len(scale) == self.n_devices:
            self.lr_scale = scale
        position = state.get("queue")
        if position is not None:
            self.queue.seek(position)
            self._open = int(position["epoch"])

    def run_epoch(self, epoch: int, stop_after: int | None = None,
                  should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Train epoch ``epoch`` (every sample exactly once), merging every period.

        Parameters
        ----------
        epoch : int
            Epoch number (seeds the shuffle, drives warm-up and decay).
        stop_after : int, optional
            Return at the first barrier at which at least this many samples of the epoch are
            done (mid-epoch evaluation or checkpoint); the next call with the same ``epoch``
            continues it with the same periods as an uninterrupted epoch. ``None``: the whole
            epoch.
        should_stop : callable ``() -> bool``, optional
            Asked at every barrier; ``True`` returns there (a signal asked the run to stop).

        Returns
        -------
        dict
            Totals of this call: ``epoch, done`` (the epoch is complete), ``samples, updates,
            periods, loss`` (mean per sample), ``lr`` (base rate of the last period),
            ``train_seconds`` (wall time, or virtual time in simulated mode), ``merge_seconds``
            and ``devices``: one dict per device with ``device, samples, updates, busy_s,
            idle_s, cpu_s, batch_size`` (at the end of the call); ``cpu_s`` is the CPU time of
            the thread that ran the device's steps (``time.thread_time``: the worker thread,
            or the main thread in simulated mode; helper threads of a step's parallel kernels
            and BLAS are not in it), so ``busy_s`` well above ``cpu_s`` on a one-thread device
            means the thread waited (preempted, the GIL, a GPU), ``cpu_s`` per sample above
            another device's means its core did the same work slower.

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
        n, q = self.n_devices, self.queue
        if self._open != epoch or q.epoch_done:
            q.start_epoch(epoch)
            self._open = epoch
        tot = _new_totals(n)
        loss_sum, periods, merge_s, train_s, lr_t = 0.0, 0, 0.0, 0.0, 0.0
        t_epoch = time.perf_counter()
        while not q.epoch_done and not (stop_after is not None
                                        and self.n_samples - q.remaining >= stop_after):
            if should_stop is not None and should_stop():
                break
            done_before = self.n_samples - q.remaining
            self._rejoin(epoch)
            solo = (self.policy.solo_device(self.replicas, epoch + done_before / self.n_samples,
                                            list(self.alive))
                    if self._solo_allowed else None)
            self._working = ([i == solo for i in range(n)] if solo is not None
                             else list(self.alive))
            q.set_active(self._working)
            acct = q.start_period(self.policy.batch_sizes())
            progress = epoch + (done_before + acct.budget) / self.n_samples
            lr_t = self.schedule(progress)
            lrs = [x * s for x, s in zip(self.policy.device_lrs(lr_t), self.lr_scale,
                                         strict=True)]
            if self.mode == "threads":
                res = self._period_threads(lrs)
            else:
                res = self._period_simulated(lrs)
            for i, err in res["failed"]:
                self._drop(i, err, epoch, acct.period)
            train_s += res["seconds"]
            t0 = time.perf_counter()
            self._trace("merge_start", -1)
            nonfinite = {i for i in range(n)
                         if self.alive[i] and not math.isfinite(res["loss"][i])}
            ctx = MergeContext(excluded={i for i in range(n) if not self.alive[i]},
                               nonfinite=nonfinite, lrs=lrs, samples=list(acct.samples),
                               comm=self.comm,
                               run_on_devices=self._run_on_devices,
                               run_shards=self._run_shards, epoch=epoch,
                               period=acct.period)
            with self._merge_budget():
                info = self.policy.merge(self.replicas, acct.updates, ctx)
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
            if self._merge_threads == 1 and dt_merge > MERGE_ONE_THREAD_MAX_S:
                self._merge_threads = None
                logger.info("merges take %.0f ms on one thread: merging with the full CPU "
                            "thread budget from now on", 1e3 * dt_merge)
            self.policy.end_period(progress, acct.updates, acct.samples, res["busy_s"])
            loss_sum += sum(x for x in res["loss"] if math.isfinite(x))
            rows = self._tally(tot, acct, res, info["weights"], lrs)
            if self.log is not None:
                extra = {k: v for k, v in info.items() if k != "weights"}
                self.log.write("merge", epoch=epoch, period=acct.period, progress=progress,
                               lr=lr_t,
                               algorithm=self.policy.name, merge_s=dt_merge, devices=rows,
                               **extra)
            periods += 1
            self.period_global += 1
        if self.mode == "threads":
            train_s = time.perf_counter() - t_epoch
        samples = sum(tot["samples"])
        return {
            "epoch": epoch, "done": q.epoch_done, "samples": samples,
            "updates": sum(tot["updates"]), "periods": periods,
            "loss": loss_sum / max(samples, 1), "lr": lr_t, "train_seconds": train_s,
            "merge_seconds": merge_s,
            "devices": [{"device": i, "name": str(self.devices[i]),
                         "samples": tot["samples"][i], "updates": tot["updates"][i],
                         "busy_s": tot["busy_s"][i], "idle_s": tot["idle_s"][i],
                         "cpu_s": tot["cpu_s"][i], "batch_size": self.policy.batch_sizes()[i]}
                        for i in range(n)],
        }

    def close(self) -> None:
        """Stop the worker threads (idempotent). Threads stuck in a step are left as daemons."""
        self._abort.set()
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
    def _merge_budget(self):
        """The main thread's CPU thread budget for a merge: one thread while merges are short
        in threaded mode (:data:`MERGE_ONE_THREAD_MAX_S`), else the backend's default."""
        if self._merge_threads is None or self._merge_cpu is None:
            return contextlib.nullcontext()
        return self._merge_cpu.kernel_threads(self._merge_threads)

    def _trace(self, kind: str, device: int) -> None:
        if self.trace:
            with self._trace_lock:
                self.events.append((kind, self.period_global, device))

    def _tally(self, tot, acct, res, weights, lrs) -> list[dict]:
        """Add one period's per-device counts to ``tot``; returns the ``"merge"`` record's
        device rows."""
        rows = []
        for i in range(self.n_devices):
            tot["samples"][i] += acct.samples[i]
            tot["updates"][i] += acct.updates[i]
            tot["busy_s"][i] += res["busy_s"][i]
            tot["idle_s"][i] += res["idle_s"][i]
            tot["cpu_s"][i] += res["cpu_s"][i]
            rows.append({"device": i, "name": str(self.devices[i]),
                         "batch_size": acct.batch_sizes[i], "updates": acct.updates[i],
                         "samples": acct.samples[i], "weight": weights[i], "lr": lrs[i],
                         "busy_s": res["busy_s"][i], "idle_s": res["idle_s"][i],
                         "cpu_s": res["cpu_s"][i], "loss": res["loss"][i]})
        return rows

    def is_short(self, i: int, n_rows: int) -> bool:
        """Whether a batch of ``n_rows`` rows is shorter than device ``i``'s batch (the last
        rows of an epoch, a period's truncated batch), which :meth:`_step` rates by its rows."""
        return n_rows < self.queue.account.batch_sizes[i]

    def _step(self, i: int, rows, lr: float) -> tuple[float, float]:
        """One step of device ``i`` (the policy's ``step``) at rate ``lr``, the rate of the
        device's batch, or for a batch shorter than that (the last rows of an epoch, a
        period's truncated batch) the policy's :meth:`~xmc_engine.algorithms.base.Policy.batch_lr`
        of its rows; returns ``(loss, wall seconds)``."""
        rep = self.replicas[i]
        if self.is_short(i, len(rows)):
            lr = self.policy.batch_lr(lr, len(rows), self.queue.account.batch_sizes[i])
        t0 = time.perf_counter()
        if self.faults is not None:
            self.faults.before_step(i)
        loss = self.policy.step(i, rep, rows, lr)  # a float: the step's work is done
        if self.faults is not None:
            self.faults.after_step(i, rep)
        return float(loss), time.perf_counter() - t0

    def _run_on_devices(self, fn: Callable[[int], Any]) -> list:
        """``fn(i)`` on every live device's worker (:attr:`MergeContext.run_on_devices`)."""
        live = [i for i in range(self.n_devices) if self.alive[i]]
        if self.mode == "simulated":
            out = []
            for i in live:
                with self._budget(i):
                    out.append(fn(i))
            return out
        for i in live:
            self._inboxes[i].put(("call", fn))
        out: list = [None] * self.n_devices
        waiting = set(live)
        while waiting:
            i, res, err = self._next_report(waiting, "a merge")
            if err is not None:
                self._fail(err)
                raise DeviceFailure(f"device {i} ({self.devices[i]}) failed during a merge: "
                                    f"{err!r}") from err
            waiting.discard(i)
            out[i] = res
        return [out[i] for i in live]

    def _run_shards(self, n: int, fn: Callable[[int, int], Any]) -> list:
        """``fn(start, stop)`` over parts of ``range(n)`` on the live devices' workers, a part's
        size in proportion to its device's speed factor (:attr:`MergeContext.run_shards`). In
        threaded mode an emulated slow device idles after its part as after a step, ``(1/s -
        1)`` times its wall time, so that the parts take about equally long. Where the main
        thread merges with the CPU backend's full thread budget (merges longer than
        :data:`MERGE_ONE_THREAD_MAX_S`, or one device), ``fn(0, n)`` runs there instead: its
        threads already use the cores the workers would, and at the Amazon-670K shape on
        ``cpu,cpu@0.5`` the parts took 1.31x its time (``bench/RESULTS.md``, "The merge's rows
        split over the device workers")."""
        if self.mode == "threads" and self._merge_threads is None:
            return [fn(0, n)]
        live = [i for i in range(self.n_devices) if self.alive[i]]
        speeds = [self.devices[i].speed for i in live]
        total, acc, bounds = sum(speeds), 0.0, {}
        for i, s in zip(live, speeds, strict=True):
            start = round(n * acc / total)
            acc += s
            bounds[i] = (start, round(n * acc / total))

        def part(i: int):
            start, stop = bounds[i]
            if start == stop:
                return None
            t0 = time.perf_counter()
            out = fn(start, stop)
            if self.mode == "threads":
                self._idle_for_speed(i, time.perf_counter() - t0)
            return (out,)

        return [r[0] for r in self._run_on_devices(part) if r is not None]

    # simulated mode ---------------------------------------------------------------------------
    def _budget(self, i: int):
        """Device ``i``'s thread budget, entered around each of its steps on the main thread
        (a threaded worker enters it once): without it every simulated CPU device ran with all
        of numba's and OpenBLAS's threads, and tiny steps spent their time waking them (an
        adaptive fit on delicious took 42 s instead of 4 s on 2 cores)."""
        be = self.replicas[i].backend
        return be.thread_budget(be.threads or self.devices[i].threads)

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
        clock, busy, loss, cpu = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        failed: list[tuple[int, BaseException]] = []
        active = [i for i in range(n) if self._working[i]]
        while active:
            i = min(active, key=lambda j: (clock[j], j))
            rows = self.queue.take(i)
            if rows is None:
                active.remove(i)
                continue
            self._trace("take", i)
            c0 = time.thread_time()
            try:
                with self._budget(i):
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
            cpu[i] += time.thread_time() - c0
            dt = self._simulated_seconds(i, len(rows), wall)
            clock[i] += dt
            busy[i] += dt
            loss[i] += step_loss
        end = max(clock)
        self.virtual_time += end
        return {"seconds": end, "busy_s": busy, "idle_s": [end - c for c in clock],
                "loss": loss, "cpu_s": cpu, "failed": failed}

    # threaded mode ----------------------------------------------------------------------------
    def _start_workers(self) -> None:
        """Start a worker thread per device and wait until each has entered its thread budget
        (or failed to): entering it asks threadpoolctl for the BLAS libraries, milliseconds
        that belong to the set-up, not to the first period's training time (a first period on
        rcv1sub1 waited 16 ms for its workers; bench/RESULTS.md, "Zeros written at
        allocation")."""
        n = self.n_devices
        self._inboxes = [_queue.SimpleQueue() for _ in range(n)]
        self._outbox: _queue.SimpleQueue = _queue.SimpleQueue()
        self._ready = [threading.Event() for _ in range(n)]
        for i in range(n):
            t = threading.Thread(target=self._worker, args=(i,), daemon=True,
                                 name=f"xmc-device-{i}-{self.devices[i]}")
            t.start()
            self._threads.append(t)
        deadline = time.perf_counter() + self.timeout
        for ready in self._ready:  # a failed budget is reported at the first period, as before
            ready.wait(max(0.0, deadline - time.perf_counter()))

    def _worker(self, i: int) -> None:
        """Device ``i``'s thread: enters the device's thread budget once, then runs jobs, a
        ``("period", lr)`` (steps until the queue refuses) or a ``("call", fn)`` (a merge's
        per-device work), and reports ``(i, result, error)`` to the main thread."""
        be = self.replicas[i].backend
        try:
            with be.thread_budget(be.threads or self.devices[i].threads):
                self._ready[i].set()
                while True:
                    job = self._inboxes[i].get()
                    if job is None:
                        return
                    kind, arg = job
                    try:
                        if kind == "period":
                            result = self._run_period(i, arg)
                        else:
                            result = arg(i)
                        self._outbox.put((i, result, None))
                    except _Abort:
                        self._outbox.put((i, None, None))
                    except BaseException as e:  # noqa: BLE001 - reported to the main thread
                        self._outbox.put((i, None, e))
        except BaseException as e:  # noqa: BLE001 - e.g. the thread budget failed
            self._outbox.put((i, None, e))
        finally:
            self._ready[i].set()

    def _idle_for_speed(self, i: int, wall: float) -> float:
        """Device ``i``'s speed factor ``s`` after work of ``wall`` seconds in its worker: it
        idles ``(1/s - 1)`` times as long (DESIGN.md §3; nothing at full speed); returns the
        emulated duration, ``wall / s``."""
        speed = self.devices[i].speed
        if speed < 1.0:
            time.sleep(wall * (1.0 / speed - 1.0))
        return wall / speed

    def _run_period(self, i: int, lr: float) -> dict[str, Any]:
        busy = loss = 0.0
        cpu0 = time.thread_time()
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
            busy += self._idle_for_speed(i, wall)
            loss += step_loss
        return {"busy_s": busy, "loss": loss, "cpu_s": time.thread_time() - cpu0}

    def _next_report(self, waiting, what: str):
        """The next ``(device, result, error)`` from a worker; after ``timeout`` seconds of
        silence the workers are stopped and ``DeviceFailure`` names the devices in
        ``waiting`` that did not finish ``what``."""
        try:
            return self._outbox.get(timeout=self.timeout)
        except _queue.Empty:
            names = ", ".join(f"{j} ({self.devices[j]})" for j in sorted(waiting))
            self._fail(TimeoutError(f"no report for {self.timeout:g} s"))
            raise DeviceFailure(f"device(s) {names} did not finish {what} within "
                                f"{self.timeout:g} s") from None

    def _period_threads(self, lrs: Sequence[float]) -> dict[str, Any]:
        n = self.n_devices
        t0 = time.perf_counter()
        pending = {i for i in range(n) if self._working[i]}
        for i in pending:
            self._inboxes[i].put(("period", lrs[i]))
        idle = {"busy_s": 0.0, "loss": 0.0, "cpu_s": 0.0}
        results: list[dict] = [idle] * n
        failed: list[tuple[int, BaseException]] = []
        while pending:
            i, res, err = self._next_report(pending, "the merge period")
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
                "cpu_s": [r["cpu_s"] for r in results],
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
