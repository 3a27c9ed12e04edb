"""The training driver behind ``XMCClassifier.fit`` and ``xmc-engine train``.

It owns what every algorithm shares: initialisation, the learning-rate schedule, evaluation on a
held-out set (its time excluded from ``train_time``, DESIGN.md §5), the run log, checkpoints and
resume, and the progress bar. The one-device loop lives here; several devices go through
:mod:`xmc_engine.scheduler`.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from pathlib import Path

import numpy as np

from xmc_engine import progress
from xmc_engine.config import TrainConfig
from xmc_engine.errors import ConfigError, DivergenceError, TrainingInterrupted
from xmc_engine.model import (
    MLPReplica,
    ModelShape,
    init_params_for_data,
    predict_topk,
)

logger = logging.getLogger(__name__)


def epoch_permutation(seed: int, epoch: int, n_samples: int) -> np.ndarray:
    """The shuffled order of epoch ``epoch``: a pure function of (seed, epoch) so that a resumed
    run sees the same batches as an uninterrupted one."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n_samples)


class Evaluator:
    """Top-k metrics of the current parameters on a held-out set (DESIGN.md §5)."""

    def __init__(self, cfg: TrainConfig, eval_set, label_counts, n_train: int, label_chunk):
        from xmc_engine.metrics import propensity_or_none

        self.X, self.Y = eval_set
        self.k = max(5, cfg.eval_k)
        self.label_chunk = label_chunk
        self.propensity = propensity_or_none(label_counts, n_train, A=cfg.propensity_a,
                                             B=cfg.propensity_b)

    def __call__(self, be, params) -> dict[str, float]:
        from xmc_engine.metrics import TopKMetrics

        m = TopKMetrics(ks=(1, 3, 5), propensity=self.propensity)
        labels, _ = predict_topk(be, params, self.X, self.k, label_chunk=self.label_chunk)
        m.update(labels, self.Y)
        return {k: float(v) for k, v in m.result().items()}


def _short(metrics: dict) -> str:
    return " ".join(f"{k}={metrics[k]:.4f}" for k in ("P@1", "P@3", "P@5") if k in metrics)


def fit_model(cfg: TrainConfig, X, Y, eval_set=None, *, log_dir=None, checkpoint_every=None,
              resume: bool = False) -> dict:
    """Train with ``cfg`` on validated host CSR ``X``, ``Y``; returns a dict with ``params``
    (host arrays), ``history`` (run-log records) and ``metrics`` (the last evaluation)."""
    from xmc_engine.checkpoint import CheckpointManager
    from xmc_engine.devices import parse_devices
    from xmc_engine.runlog import RunLog

    devices = parse_devices(cfg.devices)
    if cfg.algorithm == "single" and len(devices) != 1:
        raise ConfigError(f"algorithm='single' trains on one device but devices={cfg.devices!r} "
                          f"names {len(devices)}; use algorithm='adaptive' or one device")
    if checkpoint_every is not None and log_dir is None:
        raise ConfigError("checkpoint_every needs a log_dir (the run folder)")
    from xmc_engine.memory import check_memory

    check_memory(cfg, X, Y, eval_set)  # MemoryPlanError now rather than out of memory later
    n_samples = X.shape[0]
    shape = ModelShape(X.shape[1], Y.shape[1], tuple(cfg.hidden))
    params = init_params_for_data(shape, X, cfg.seed)
    label_counts = np.asarray(Y.sum(axis=0)).ravel()

    from xmc_engine.distributed import join_run, world

    comm = world()  # several nodes when the CLI set up MPI (DESIGN.md §6)
    if comm.size > 1:
        label_counts, n_samples = join_run(comm, cfg, params, label_counts, n_samples, resume)
        if not comm.is_root:  # rank 0 alone logs, checkpoints and evaluates
            log_dir, eval_set, checkpoint_every = None, None, None
    run_dir = Path(log_dir) if log_dir is not None else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    ckpts = CheckpointManager(run_dir) if run_dir is not None else None
    state = {"epoch": 0, "batch": 0, "samples": 0, "train_time": 0.0, "extra": {}}
    found = None
    if resume:
        if ckpts is None:
            raise ConfigError("resume needs the run folder (log_dir)")
        found = ckpts.latest_valid()
        if found is None and ckpts.paths():
            from xmc_engine.errors import CheckpointError

            raise CheckpointError(f"{run_dir}: no valid checkpoint to resume from (every "
                                  f"ckpt-*.npz there is truncated or corrupted)")
        if found is None:  # killed before its first checkpoint: start over
            logger.warning("%s holds no checkpoint yet: training from the start", run_dir)
    if found is not None:
        arrays, meta = found
        if meta["path"] != str(ckpts.paths()[0]):
            logger.warning("newest checkpoint %s is unreadable: resuming from %s instead",
                           ckpts.paths()[0], meta["path"])
        params = [np.asarray(arrays[n], dtype=np.float32) for n in shape.param_names]
        for key in ("epoch", "batch", "samples", "train_time"):
            state[key] = meta[key]
        state["extra"] = {k: v for k, v in arrays.items() if k not in shape.param_names}
        logger.info("resuming from epoch %s batch %s (%s samples)", state["epoch"],
                    state["batch"], state["samples"])

    log = RunLog(run_dir / "log.jsonl" if run_dir is not None else None)
    evaluator = (Evaluator(cfg, eval_set, label_counts, n_samples, cfg.label_chunk)
                 if eval_set is not None else None)
    log.write("start", config=cfg.to_dict(), n_samples=n_samples, n_features=shape.n_features,
              n_labels=shape.n_labels, devices=[d.__dict__ for d in devices],
              resumed=bool(resume), samples=state["samples"], epoch=state["epoch"])

    if cfg.algorithm == "single":
        from xmc_engine.backends import get_backend

        dev = devices[0]
        be = get_backend(dev.kind, dev.index, threads=cfg.threads or dev.threads)
        replica = MLPReplica(be, X, Y, params, label_chunk=cfg.label_chunk,
                             optimizer=cfg.optimizer)
        if cfg.threads is None and be.name == "cpu" and dev.threads > 1:
            replica.calibrate_threads(cfg.batch_size, dev.threads)
            log.write("threads", device=str(dev), threads=be.threads,
                      note="calibrated: the faster of 1 and all of the device's threads")
        extra = state.get("extra", {})
        replica.load_optimizer_state([extra[f"acc.{i}"] for i in range(len(params))
                                      if f"acc.{i}" in extra])
        runner = _SingleRunner(cfg, replica, n_samples, state)
    else:
        from xmc_engine.parallel import ParallelRunner

        runner = ParallelRunner(cfg, devices, X, Y, params, state, log, comm=comm)

    driver = _Driver(cfg, runner, n_samples, state, log, evaluator, ckpts, checkpoint_every,
                     shape)
    runner.should_stop = driver.stop_requested
    try:
        metrics = driver.run()
    finally:
        runner.close()
        log.close()
    return {"params": runner.host_params(), "history": list(log.records), "metrics": metrics,
            "label_counts": label_counts, "n_train": n_samples}


class _SingleRunner:
    """One device: batches of ``batch_size`` in a per-epoch shuffled order."""

    def __init__(self, cfg: TrainConfig, replica: MLPReplica, n_samples: int, state: dict):
        from xmc_engine.faults import FaultInjector

        self.cfg, self.replica, self.n_samples = cfg, replica, n_samples
        self.batch = int(state["batch"])
        self.faults = FaultInjector.from_spec(cfg.algorithm_params.get("fault"))
        self.should_stop = lambda: False  # set by the driver (SIGINT / SIGTERM)

    def batches_per_epoch(self) -> int:
        return -(-self.n_samples // self.cfg.batch_size)

    def run_until(self, epoch: int, stop_samples: int, state: dict) -> None:
        """Train epoch ``epoch`` from batch ``self.batch`` until ``state['samples']`` reaches
        ``stop_samples`` or the epoch ends."""
        cfg, B = self.cfg, self.cfg.batch_size
        perm = epoch_permutation(cfg.seed, epoch, self.n_samples)
        with self.replica.backend.thread_budget(cfg.threads or self.replica.backend.threads):
            while (self.batch * B < self.n_samples and state["samples"] < stop_samples
                   and not self.should_stop()):
                rows = perm[self.batch * B:(self.batch + 1) * B]
                lr = lr_at(cfg, epoch + self.batch * B / self.n_samples)
                t0 = time.perf_counter()
                if self.faults is not None:
                    self.faults.before_step(0)
                loss = self.replica.train_batch(rows, lr)
                self.replica.backend.synchronize()  # synchronize!
                if self.faults is not None:
                    self.faults.after_step(0, self.replica)  # NaN shows in the next loss
                if not math.isfinite(loss):
                    state["batch"] = self.batch
                    raise DivergenceError(f"the loss became non-finite ({loss}) at epoch {epoch} "
                                          f"batch {self.batch} (lr {lr:g}); lower the learning "
                                          "rate")
                state["train_time"] += time.perf_counter() - t0
                state["samples"] += len(rows)
                state["loss_sum"] = state.get("loss_sum", 0.0) + loss
                self.batch += 1
        state["batch"] = self.batch

    def end_epoch(self) -> None:
        self.batch = 0

    def epoch_done(self) -> bool:
        return self.batch * self.cfg.batch_size >= self.n_samples

    @staticmethod
    def can_checkpoint() -> bool:
        """A checkpoint may be taken between any two steps (it records the batch)."""
        return True

    def eval_params(self):
        return self.replica.backend, self.replica.params()

    def host_params(self) -> list[np.ndarray]:
        be = self.replica.backend
        return [np.array(be.to_host(p), dtype=np.float32) for p in self.replica.params()]

    def checkpoint_extra(self) -> dict:
        """Optimiser state beside the parameters (Adagrad accumulators as ``acc.<i>``)."""
        return {f"acc.{i}": a for i, a in enumerate(self.replica.optimizer_state())}

    def close(self) -> None:
        pass


def lr_at(cfg: TrainConfig, epoch: float) -> float:
    """Learning rate at fractional epoch ``epoch``: linear warm-up, then
    ``lr0 / (1 + lr_decay * (epoch - lr_warmup_epochs))`` (DESIGN.md §4.5)."""
    warm = cfg.lr_warmup_epochs or 0.0  # None: single's own default, no warm-up
    if warm > 0 and epoch < warm:
        return cfg.lr * max(epoch / warm, 0.02)
    return cfg.lr / (1.0 + cfg.lr_decay * max(epoch - warm, 0.0))


class _Driver:
    """Epoch loop shared by all runners: evaluation cadence, checkpoints, progress, log."""

    def __init__(self, cfg, runner, n_samples, state, log, evaluator, ckpts, checkpoint_every,
                 shape):
        self.cfg, self.runner, self.n = cfg, runner, n_samples
        self.state, self.log, self.evaluator = state, log, evaluator
        self.ckpts, self.every, self.shape = ckpts, checkpoint_every, shape
        self.metrics: dict | None = None
        self.last_eval_samples = -1
        eval_step = int(round(cfg.eval_every * n_samples)) if cfg.eval_every > 0 else 0
        self.eval_step = eval_step
        self.next_eval = (state["samples"] // eval_step + 1) * eval_step if eval_step else None
        self._reset_ckpt_clock()
        self._signal: int | None = None

    # -- SIGINT / SIGTERM: stop between steps, checkpoint, raise TrainingInterrupted ----------
    def stop_requested(self) -> bool:
        return self._signal is not None

    def _on_signal(self, signum, frame) -> None:
        if self._signal is not None:  # a second signal: stop at once
            raise KeyboardInterrupt
        self._signal = signum
        logger.warning("%s received: stopping after the current step (again to stop at once)",
                       signal.Signals(signum).name)

    def _install_signals(self) -> dict:
        """Handlers for SIGINT/SIGTERM, main thread only; returns the previous ones."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):  # not allowed here (embedded interpreter)
                pass
        return previous

    def _reset_ckpt_clock(self):
        self.last_ckpt_samples = self.state["samples"]
        self.last_ckpt_time = time.perf_counter()

    def _next_stop(self) -> int:
        stops = [10**18]
        if self.next_eval is not None:
            stops.append(self.next_eval)
        if self.every is not None and self.every[0] == "samples":
            stops.append(self.last_ckpt_samples + int(self.every[1]))
        if self.every is not None and self.every[0] == "seconds":
            # Check the clock every ~2% of an epoch.
            stops.append(self.state["samples"] + max(self.n // 50, 1))
        return min(stops)

    def evaluate(self, epoch_float: float) -> None:
        if self.evaluator is None:
            return
        be, params = self.runner.eval_params()
        t0 = time.perf_counter()
        self.metrics = self.evaluator(be, params)
        self.last_eval_samples = self.state["samples"]
        self.log.write("eval", epoch=round(epoch_float, 4), samples=self.state["samples"],
                       train_time=self.state["train_time"],
                       eval_time=time.perf_counter() - t0, metrics=self.metrics)
        logger.info("epoch %.2f  %s", epoch_float, _short(self.metrics))

    def checkpoint(self, epoch: int, *, force: bool = False) -> None:
        if self.ckpts is None or (self.every is None and not force):
            return
        arrays = dict(zip(self.shape.param_names, self.runner.host_params(), strict=True))
        arrays.update(self.runner.checkpoint_extra())
        meta = {k: self.state[k] for k in ("epoch", "batch", "samples", "train_time")}
        self._reset_ckpt_clock()  # a failed write is retried at the next checkpoint, not sooner
        try:
            path = self.ckpts.save(meta, arrays)
        except OSError as exc:  # disk full, quota: the run goes on; the old checkpoints stay
            last = self._last_checkpoint()
            self.log.write("checkpoint_failed", error=str(exc), last_checkpoint=last, **meta)
            logger.warning("checkpoint at %d samples failed (%s); training continues, the last "
                           "good checkpoint is %s", meta["samples"], exc.strerror or exc, last)
            return
        self.log.write("checkpoint", path=str(path), **meta)

    def _ckpt_due(self) -> bool:
        if self.every is None:
            return False
        unit, value = self.every
        if unit == "samples":
            return self.state["samples"] - self.last_ckpt_samples >= value
        return time.perf_counter() - self.last_ckpt_time >= value

    def _last_checkpoint(self) -> str | None:
        paths = self.ckpts.paths() if self.ckpts is not None else []
        return str(paths[0]) if paths else None

    def _diverged(self, exc: DivergenceError):
        last = self._last_checkpoint()
        self.log.write("diverged", samples=self.state["samples"], error=str(exc),
                       last_checkpoint=last)
        where = (f"the last good checkpoint is {last} (resume from it with a lower lr)"
                 if last else "no checkpoint was written (set checkpoint_every)")
        raise DivergenceError(f"training diverged: {exc}; {where}") from exc

    def _interrupted(self, epoch: int):
        """After SIGINT/SIGTERM: checkpoint (when there is a run folder), log, raise."""
        name = signal.Signals(self._signal).name
        self.checkpoint(epoch, force=True)
        last = self._last_checkpoint()
        self.log.write("interrupted", signal=name, epoch=epoch, samples=self.state["samples"],
                       train_time=self.state["train_time"], checkpoint=last)
        where = (f"checkpoint {last}; continue with --resume {self.ckpts.run_dir}"
                 if last else "no run folder, nothing saved")
        raise TrainingInterrupted(f"interrupted by {name} at {self.state['samples']} samples; "
                                  f"{where}", self._signal)

    def run(self) -> dict | None:
        cfg, st = self.cfg, self.state
        total = int(cfg.epochs * self.n)
        bar = progress.bar(total=total, desc="train", unit="sample", initial=st["samples"])
        previous = self._install_signals()
        try:
            epoch = int(st["epoch"])
            # A signal stops the loop where a checkpoint can be taken: after any step on one
            # device, at the end of the epoch on several.
            while st["samples"] < total and (self._signal is None
                                             or not self.runner.can_checkpoint()):
                st["epoch"] = epoch
                before, t0 = st["samples"], st["train_time"]
                try:
                    self.runner.run_until(epoch, min(self._next_stop(), total), st)
                except DivergenceError as exc:
                    self._diverged(exc)
                if self.runner.epoch_done():  # advance first, so that a checkpoint says so
                    epoch += 1
                    st["epoch"], st["batch"] = epoch, 0
                    self.runner.end_epoch()
                bar.update(st["samples"] - before)
                dt = st["train_time"] - t0
                postfix = {"samples/s": f"{(st['samples'] - before) / dt:.0f}"} if dt else {}
                if self.metrics:
                    postfix["P@1"] = f"{self.metrics['P@1']:.4f}"
                bar.set_postfix(postfix, refresh=False)
                if self.next_eval is not None and st["samples"] >= self.next_eval:
                    self.evaluate(st["samples"] / self.n)
                    while self.next_eval <= st["samples"]:
                        self.next_eval += self.eval_step
                if self._ckpt_due() and self.runner.can_checkpoint():
                    self.checkpoint(epoch)
            if self._signal is not None:
                self._interrupted(epoch)
            if self.evaluator is not None and self.last_eval_samples != st["samples"]:
                self.evaluate(st["samples"] / self.n)
            if self.ckpts is not None and self.every is not None:
                self.checkpoint(epoch)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            bar.close()
        self.log.write("final", epoch=round(st["samples"] / self.n, 4), samples=st["samples"],
                       train_time=st["train_time"], metrics=self.metrics,
                       mean_loss=st.get("loss_sum", 0.0) / max(st["samples"], 1))
        return self.metrics
