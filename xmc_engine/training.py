"""The training driver behind ``XMCClassifier.fit`` and ``xmc-engine train``.

It owns what every algorithm shares: initialisation, the learning-rate schedule, evaluation on a
held-out set (its time excluded from ``train_time``, DESIGN.md §5), the run log, checkpoints and
resume, and the progress bar. The one-device loop lives here; several devices go through
:mod:`xmc_engine.scheduler`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from xmc_engine import progress
from xmc_engine.config import PLATEAU_HOLDOUT_ROWS, TRAIN_LOSSES, TrainConfig
from xmc_engine.errors import ConfigError, DivergenceError, TrainingInterrupted
from xmc_engine.model import (
    MLPReplica,
    ModelShape,
    heldout_hits,
    init_params_for_data,
    predict_topk,
)
from xmc_engine.scheduler.controller import Plateau
from xmc_engine.scheduler.queue import epoch_permutation
from xmc_engine.validation import normalize_rows

logger = logging.getLogger(__name__)


class Evaluator:
    """Top-k metrics of the current parameters on a held-out set (DESIGN.md §5). ``top1``
    holds each row's top label at the last call (host int64), which the loss probe compares
    row by row (:func:`pick_loss`)."""

    def __init__(self, cfg: TrainConfig, eval_set, label_counts, n_train: int, label_chunk):
        from xmc_engine.metrics import propensity_or_none

        self.X, self.Y = eval_set
        self.k = max(5, cfg.eval_k)
        self.label_chunk = label_chunk
        self.propensity = propensity_or_none(label_counts, n_train, A=cfg.propensity_a,
                                             B=cfg.propensity_b)
        self.top1: np.ndarray | None = None

    def __call__(self, be, params) -> dict[str, float]:
        from xmc_engine.metrics import TopKMetrics

        m = TopKMetrics(ks=(1, 3, 5), propensity=self.propensity)
        labels, _ = predict_topk(be, params, self.X, self.k, label_chunk=self.label_chunk)
        self.top1 = labels[:, 0].copy()
        m.update(labels, self.Y)
        return {k: float(v) for k, v in m.result().items()}


def _short(metrics: dict) -> str:
    return " ".join(f"{k}={metrics[k]:.4f}" for k in ("P@1", "P@3", "P@5") if k in metrics)


def fit_model(cfg: TrainConfig, X, Y, eval_set=None, *, log_dir=None, checkpoint_every=None,
              resume: bool = False, simulate=None, progress_desc: str = "train",
              one_node: bool = False, keep_optimizer_state: bool = False,
              calibrated: dict[int, int] | None = None, on_start=None, stop=None) -> dict:
    """Train with ``cfg`` on validated host CSR ``X``, ``Y``; returns a dict with ``params``
    (host arrays), ``history`` (run-log records) and ``metrics`` (the last evaluation). The
    feature rows of ``X`` and of ``eval_set`` are normalised first (``cfg.normalize``).

    ``simulate``, a function ``(device index, rows) -> seconds``, runs the devices one after
    another on a virtual clock instead of in threads (the trainer's ``"simulated"`` mode): device
    ``i``'s step on ``n`` rows lasts ``simulate(i, n) / speed`` virtual seconds, so which device
    takes which batch, the adaptive batch sizes and the merge weights depend on that function
    and the devices' speed factors alone. Two runs with the same ``simulate`` follow the same
    schedule on any backends (a GPU run can then be checked against a CPU run).

    ``one_node``: train in this process alone even where the CLI set up MPI (the probe of
    ``loss="auto"``, :func:`choose_loss`); ``progress_desc`` names the progress bar.
    ``keep_optimizer_state``: the result's ``optimizer_state`` holds host copies of the first
    replica's Adagrad state (the probe's fits, which a run may continue); else ``None``, so
    that a run does not copy its optimizer state off the device for nothing. The result's
    ``samples`` and ``train_time`` are where training ended; its ``eval_top1`` is each
    ``eval_set`` row's top label at the last evaluation (``None`` without one).
    ``calibrated``: CPU thread budgets by device index calibrated by an earlier run of the
    same devices and data (an ensemble's first member), used instead of calibrating again;
    the result's ``calibrated`` holds this run's. ``on_start``, a function ``(loss,
    lr_decay, calibrated, speedups, train_time)``, is called once the loss (with the decay it
    gave, ``lr_decay="auto"``) and the budgets are known,
    before the trainer's device workers start (an ensemble starts its other members then), with
    the calibrations' measured speed-ups (:func:`build_trainer`'s ``on_budgets``) and the
    training seconds the run starts from (a continued probe fit's, a checkpoint's); it may
    return a dict with other ``threads`` budgets for the run (an ensemble's members side by
    side: one thread) and another ``max_train_seconds`` (their share of the time). ``stop``
    (a :class:`threading.Event`): once set, the run stops at the next barrier as on SIGINT (a
    checkpoint where it has a run folder, then
    :class:`~xmc_engine.errors.TrainingInterrupted`); for runs in threads other than the main
    one, which hears no signals."""
    if cfg.ensemble > 1:
        return _fit_ensemble(cfg, X, Y, eval_set, log_dir=log_dir,
                             checkpoint_every=checkpoint_every, resume=resume, simulate=simulate,
                             progress_desc=progress_desc, one_node=one_node, stop=stop)
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
    X = normalize_rows(X, cfg.normalize)  # the rows the model computes on (its inputs)
    if eval_set is not None:
        eval_set = (normalize_rows(eval_set[0], cfg.normalize), eval_set[1])
    n_samples = X.shape[0]
    shape = ModelShape(X.shape[1], Y.shape[1], tuple(cfg.hidden))
    run_dir = Path(log_dir) if log_dir is not None else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    ckpts = CheckpointManager(run_dir) if run_dir is not None else None
    found = _checkpoint_to_resume(ckpts, run_dir) if resume else None

    from xmc_engine.distributed import LocalComm, join_run, world

    comm = LocalComm() if one_node else world()  # several nodes: MPI (DESIGN.md §6)
    given = cfg
    # lr_decay: "auto" resolved by the whole training set's rows (every node the same); the
    # plateau rule's rows are held out of training before anything else sees them (rank 0's)
    n_all = (n_samples if comm.size == 1
             else int(comm.allreduce_sum(np.array([n_samples], dtype=np.int64))[0]))
    decay = cfg.lr_decay_for(n_all)
    cfg = dataclasses.replace(cfg, lr_decay=decay)
    watch = None
    if given.holds_out(n_all, decay):  # the plateau rule, or keep_best with a fixed decay
        X, Y, held = hold_out(X, Y, cfg.seed) if comm.is_root else (X, Y, None)
        n_samples = X.shape[0]
        # with a fixed decay the rule only reads: its factor 1 never changes the rate
        watch = _PlateauWatch(Plateau() if decay == "plateau" else Plateau(factor=1.0), held,
                              comm, keep_best=cfg.keep_best, back_to_best=cfg.back_to_best)
    probe = probe_fit = None
    if cfg.loss == "auto":  # one choice for every node: rank 0's
        if found is not None and found[1].get("loss") in TRAIN_LOSSES:  # resumed: its loss
            loss = found[1]["loss"]
            if (given.lr_decay == "auto" and decay != "plateau"
                    and isinstance(found[1].get("lr_decay"), (int, float))):
                decay = float(found[1]["lr_decay"])  # the decay the probe's choice gave
        else:  # rank 0 probes (one process: it is rank 0 and the broadcast is the identity)
            if comm.is_root:
                probe = choose_loss(cfg, X, Y, devices[0])
                probe_compile = {"seconds": probe.pop("compile_seconds"),
                                 "compiled": probe.pop("compiled")}
                probe_fit = probe.pop("fit")
            choice = ({"loss": probe["loss"], "compared": probe.get("z") is not None}
                      if probe else None)
            chosen = json.loads(comm.broadcast_bytes(
                json.dumps(choice).encode() if choice else None).decode())
            loss = chosen["loss"]
            # lr_decay="auto": no decay where the probe found the softmax clearly ahead (the
            # plateau rule, decided above by the rows, comes first and stays)
            decay = given.lr_decay_for(n_all, probed=loss if chosen["compared"] else None)
        cfg = dataclasses.replace(cfg, loss=loss, lr_decay=decay)
    params = init_params_for_data(shape, X, cfg.seed, loss=cfg.loss)
    label_counts = np.asarray(Y.sum(axis=0)).ravel()
    if comm.size > 1:
        label_counts, n_samples = join_run(comm, cfg, params, label_counts, n_samples, resume)
        if not comm.is_root:  # rank 0 alone logs, checkpoints and evaluates
            run_dir, ckpts, eval_set, checkpoint_every = None, None, None, None
    # output="auto": one choice for every node, from the whole training set's label counts
    labels_per_row = float(label_counts.sum()) / max(n_samples, 1)
    output = cfg.output_for(Y.shape[1], labels_per_row)
    cfg = dataclasses.replace(cfg, output=output)
    # AdaptiveConfig's "auto" merge weights and period: by the label count, the loss and
    # whether the devices' backends track changed rows (the CPU's), written to the start record
    algo = cfg.algorithm_params
    if hasattr(algo, "resolved"):
        cfg = dataclasses.replace(cfg, algorithm_params=algo.resolved(
            Y.shape[1], cfg.loss, cfg.batch_size,
            tracks_rows=all(d.kind == "cpu" for d in devices), n_rows=n_all))
    state = {"epoch": 0, "samples": 0, "train_time": 0.0}
    extra: dict = {}
    if probe is not None:
        probe["continued"] = None
        if (probe_fit is not None and found is None and cfg.continue_probe
                and comm.size == 1 and probe_fit["samples"] <= cfg.epochs * n_samples):
            params, state, extra = _continue_fit(probe_fit, len(devices))
            probe["continued"] = {"samples": state["samples"], "train_time": state["train_time"]}
            logger.info("loss='auto': the run continues the probe's %s fit (%d samples)",
                        cfg.loss, state["samples"])
    if found is not None:
        arrays, meta = found
        if meta["path"] != str(ckpts.paths()[0]):
            logger.warning("newest checkpoint %s is unreadable: resuming from %s instead",
                           ckpts.paths()[0], meta["path"])
        params = [np.asarray(arrays[n], dtype=np.float32) for n in shape.param_names]
        for key in ("epoch", "samples", "train_time"):
            state[key] = meta[key]
        if watch is not None and "lr_scale" in meta:  # where the plateau rule had got to
            watch.restore(meta, arrays, shape.param_names)
        extra = {k: v for k, v in arrays.items()
                 if k not in shape.param_names and not k.startswith(_BEST_PREFIX)}
        logger.info("resuming from epoch %s (%s samples)", state["epoch"], state["samples"])

    told: dict = {}  # what on_start returns
    log = RunLog(run_dir / "log.jsonl" if run_dir is not None else None)
    evaluator = (Evaluator(cfg, eval_set, label_counts, n_samples, cfg.label_chunk)
                 if eval_set is not None else None)
    if given.output != output:
        logger.info("output='%s': training the %s output layer (%d labels, %.2f per row; "
                    "batch %d, negatives %d)", given.output, output, Y.shape[1],
                    labels_per_row, cfg.batch_size, cfg.negatives)
    log.write("start", config=given.to_dict(), output=output, loss=cfg.loss,
              algorithm_params=cfg.algorithm_params.to_dict(),
              lr=cfg.learning_rate, lr_decay=decay, warmup_epochs=cfg.warmup_epochs,
              heldout_rows=0 if watch is None or watch.heldout is None
              else int(watch.heldout[0].shape[0]),
              n_samples=n_samples, n_features=shape.n_features, n_labels=shape.n_labels,
              devices=[d.__dict__ for d in devices], resumed=bool(resume),
              samples=state["samples"], epoch=state["epoch"])
    if probe is not None:  # what loss="auto" did and saw (before the start)
        if probe["rows"]:
            log.write("compile", **probe_compile, devices=[str(devices[0])],
                      losses=list(TRAIN_LOSSES), note="before the loss probe")
        log.write("loss_probe", **probe)
    compile_kernels(cfg, devices, X, Y, log)
    trainer = build_trainer(cfg, devices, X, Y, params, log, comm=comm,
                            mode="threads" if simulate is None else "simulated", cost=simulate,
                            calibrated={0: probe["threads"]} if probe and probe.get("threads")
                            and _probe_device(devices[0]).threads == devices[0].threads
                            else calibrated,
                            speedups={0: probe.get("threads_speedup")} if probe else None,
                            calibrated_by="the loss probe" if probe and probe.get("threads")
                            else "the ensemble's first member",
                            run_samples=max(0.0, cfg.epochs * n_samples - state["samples"]),
                            on_budgets=None if on_start is None
                            else (lambda budgets, speedups: _started(
                                on_start, told, cfg, budgets, speedups,
                                state["train_time"])))
    if "max_train_seconds" in told:  # what on_start gave this run
        cfg = dataclasses.replace(cfg, max_train_seconds=told["max_train_seconds"])
    try:
        if extra:
            restore_trainer(trainer, extra)
        params = extra = probe_fit = None  # the replicas hold their own copies
        if watch is not None:
            watch.apply(trainer)
        driver = _Driver(cfg, trainer, n_samples, state, log, evaluator, ckpts,
                         checkpoint_every, shape, progress_desc, watch, stop)
        metrics = driver.run()
    finally:
        trainer.close()
        log.close()
    return {"params": host_params(trainer), "history": list(log.records), "metrics": metrics,
            "label_counts": label_counts, "n_train": n_samples, "loss": cfg.loss,
            "processes": comm.size,
            "optimizer_state": trainer.replicas[0].optimizer_state()
            if keep_optimizer_state else None,
            "samples": int(state["samples"]), "train_time": float(state["train_time"]),
            "eval_top1": evaluator.top1 if evaluator is not None else None,
            "calibrated": _thread_budgets(trainer)}


def _started(on_start, told: dict, cfg: TrainConfig, budgets: dict, speedups: dict,
             train_time: float) -> dict | None:
    """:func:`fit_model`'s call of its ``on_start`` with the run's loss and decay (``cfg``'s,
    resolved): what it returns kept in ``told``, its ``threads`` handed back to
    :func:`build_trainer` as the run's budgets."""
    told.update(on_start(cfg.loss, cfg.lr_decay, budgets, speedups, train_time) or {})
    return told.get("threads")


def _thread_budgets(trainer) -> dict[int, int]:
    """The CPU thread budget of each CPU replica of ``trainer``, by device index."""
    return {i: r.backend.threads for i, r in enumerate(trainer.replicas)
            if r.backend.name == "cpu"}


def member_seed(seed: int, member: int) -> int:
    """The seed of member ``member`` of an ensemble (``TrainConfig.ensemble``) whose run seed
    is ``seed``: ``seed`` itself for the first, so that its first member is the plain run of
    ``seed``; the others' drawn from both numbers, so that runs of different seeds share no
    member."""
    if member == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed), int(member)]).generate_state(1)[0] >> 1)


#: The run folder's sub-folder of ensemble member ``j`` (its own log and checkpoints).
MEMBER_DIR = "member-{}"


def _fit_ensemble(cfg: TrainConfig, X, Y, eval_set, *, log_dir, progress_desc: str,
                  stop=None, **fit_kw) -> dict:
    """``cfg.ensemble`` networks (each a :func:`fit_model` with its own seed, :func:`member_seed`;
    the first's ``loss="auto"`` choice, the decay it gave and CPU thread budgets for the rest;
    an equal share of ``max_train_seconds``: ``1 / K`` of it one after the other, side by side
    ``1 /`` the members the busiest lane trains), combined into one network
    (:func:`~xmc_engine.model.combine_members`), which is evaluated on ``eval_set``. On a CPU
    device of several cores whose calibration did not find all its threads
    :data:`~xmc_engine.config.LANES_MAX_SPEEDUP` times as fast as one (:func:`_member_lanes`),
    the other members train beside the first, every member on one thread, a core each; else one
    after the other on the calibrated budget. A member's run is decided by its seed, its loss
    and its budget, whichever way it trains. Each member keeps its run log and checkpoints in
    the sub-folder :data:`MEMBER_DIR` of ``log_dir`` (a resumed run resumes each: a finished
    member's last checkpoint is its end); ``log_dir/log.jsonl`` gets an ``ensemble`` record and
    a ``final`` one. The result is :func:`fit_model`'s, for the combined network: ``history``
    holds the members' records one after the other, then those two; ``samples`` is the members'
    summed, ``train_time`` the first member's seconds before the others could start (its probe
    fit's) plus the longest lane's after (a lane: the members one thread trained in turn), the
    members' sum where they train one after the other. The combined network is evaluated on the
    first device, as the members were."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from xmc_engine.backends import get_backend
    from xmc_engine.backends.cpu import numba_threads
    from xmc_engine.memory import check_memory
    from xmc_engine.model import combine_members, fitted_hidden
    from xmc_engine.runlog import RunLog

    check_memory(cfg, X, Y, eval_set)  # the members' copies too, before the first trains
    k = cfg.ensemble
    run_dir = Path(log_dir) if log_dir is not None else None
    # max_train_seconds shared out: one after the other each member gets 1 / k of it, side by
    # side 1 / (the members a lane trains) (set in started)
    side_budget = {"each": None if cfg.max_train_seconds is None else cfg.max_train_seconds / k}
    results: list = [None] * k
    lane_of: list = [None] * k  # the thread that trained each member
    # set when a member fails (or by the caller): the members training stop at a barrier
    stop = threading.Event() if stop is None else stop
    first: dict = {"loss": cfg.loss, "lr_decay": cfg.lr_decay, "calibrated": None}
    pool, futures, side = None, {}, {"lanes": 1, "before": 0.0}

    def train(j: int) -> dict:
        member = dataclasses.replace(cfg, ensemble=1, seed=member_seed(cfg.seed, j),
                                     loss=first["loss"], max_train_seconds=side_budget["each"])
        if j > 0 and cfg.lr_decay == "auto" and not isinstance(first["lr_decay"], str):
            member = dataclasses.replace(member, lr_decay=first["lr_decay"])
        logger.info("ensemble: member %d of %d (seed %d)", j + 1, k, member.seed)
        lane_of[j] = threading.get_ident()
        # beside other members: this thread's own numba work (compiling, evaluating) on one
        # core too, as its steps are
        with numba_threads(1) if pool is not None else contextlib.nullcontext():
            return fit_model(member, X, Y, eval_set,
                             log_dir=None if run_dir is None else run_dir / MEMBER_DIR.format(j),
                             progress_desc=f"{progress_desc} {j + 1}/{k}",
                             calibrated=first["calibrated"], stop=stop,
                             on_start=started if j == 0 else None, **fit_kw)

    def failed(fut) -> None:
        """A member beside the first has failed: the others stop at their next barrier, and
        the ensemble raises its error."""
        if not fut.cancelled() and fut.exception() is not None and "failed" not in side:
            side["failed"] = fut.exception()
            stop.set()

    def started(loss: str, lr_decay, calibrated: dict, speedups: dict, train_time: float):
        """The first member's loss, decay and budgets are known: the others may start beside it
        (then every member trains on one thread: the budgets returned)."""
        nonlocal pool
        first.update(loss=loss, lr_decay=lr_decay, calibrated=calibrated)
        side["before"] = train_time  # trained before any other member could start
        lanes = side["lanes"] = _member_lanes(cfg, calibrated, speedups, X, Y, eval_set,
                                              fit_kw)
        if lanes > 1:
            first["calibrated"] = {0: 1}
            if cfg.max_train_seconds is not None:
                side_budget["each"] = cfg.max_train_seconds / math.ceil(k / lanes)
            logger.info("ensemble: %d members train side by side, one thread each", lanes)
            # BLAS's thread limit is process-wide, and threadpoolctl (3.8) lets one thread
            # at a time set it: a device worker takes it on entry, puts back on exit what it
            # found and lets go. Held here at 1 by this thread before any member's worker
            # starts, the workers' calls leave it at 1. Without the hold, the first member's
            # worker, having found 2, left 2 under the member still training beside it
            # (measured: the last 345 steps of a debian_debtags member, whose sums then
            # differed in the last bits from the same run trained alone).
            hold.enter_context(_blas_threads(1))
            pool = ThreadPoolExecutor(lanes - 1, thread_name_prefix="xmc-member")
            futures.update({j: pool.submit(train, j) for j in range(1, k)})
            for fut in futures.values():
                fut.add_done_callback(failed)
            return {"threads": first["calibrated"], "max_train_seconds": side_budget["each"]}
        return None

    with contextlib.ExitStack() as hold:  # BLAS's limit while members train side by side
        try:
            results[0] = train(0)
            first["calibrated"] = results[0]["calibrated"]
            for j in range(1, k):  # the members no lane has started train here, in turn
                if j not in futures or futures[j].cancel():
                    results[j] = train(j)
            for j, fut in futures.items():
                if results[j] is None:
                    results[j] = fut.result()
        except BaseException as exc:
            stop.set()  # the members still training stop at their next barrier
            if isinstance(exc, TrainingInterrupted) and "failed" in side:
                raise side["failed"] from exc  # stopped because a member beside it failed
            raise
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
    loss = results[0]["loss"]
    params = combine_members([r["params"] for r in results])
    for r in results:  # the members' arrays are in the combined ones
        r["params"] = None
    metrics, eval_time = None, 0.0
    if eval_set is not None:
        t0 = time.perf_counter()
        from xmc_engine.devices import parse_devices

        dev = parse_devices(cfg.devices)[0]  # where the members were evaluated
        be = get_backend(dev.kind, dev.index, threads=cfg.threads or dev.threads)
        first = results[0]
        evaluator = Evaluator(cfg, (normalize_rows(eval_set[0], cfg.normalize), eval_set[1]),
                              first["label_counts"], first["n_train"], cfg.label_chunk)
        metrics = evaluator(be, [be.asarray(p) for p in params])
        eval_time = time.perf_counter() - t0
    # the training seconds of the longest lane, the first member's seconds before the others
    # could start counted once, before every lane
    lanes = {lane: 0.0 for lane in lane_of}
    for lane, r in zip(lane_of, results, strict=True):
        lanes[lane] += r["train_time"]
    lanes[lane_of[0]] -= side["before"]
    train_time = side["before"] + max(lanes.values())
    samples = sum(r["samples"] for r in results)
    from xmc_engine.distributed import world

    if not fit_kw.get("one_node") and not world().is_root:  # rank 0 alone logs (fit_model)
        run_dir = None
    log = RunLog(run_dir / "log.jsonl" if run_dir is not None else None)
    try:
        log.write("ensemble", members=k, seeds=[member_seed(cfg.seed, j) for j in range(k)],
                  loss=loss, hidden=list(fitted_hidden(params)),
                  member_metrics=[r["metrics"] for r in results],
                  member_train_time=[r["train_time"] for r in results],
                  lanes=side["lanes"], member_max_train_seconds=side_budget["each"],
                  member_dirs=[MEMBER_DIR.format(j) for j in range(k)] if run_dir else None,
                  metrics=metrics, eval_time=eval_time)
        statuses = [next((h.get("status") for h in reversed(r["history"])
                          if h.get("event") == "final"), None) for r in results]
        log.write("final", status="ensemble", member_status=statuses, samples=samples,
                  train_time=train_time, metrics=metrics)
    finally:
        log.close()
    history = [h for r in results for h in r["history"]] + list(log.records)
    if metrics is not None:
        logger.info("ensemble of %d: %s", k, _short(metrics))
    return {**results[0], "params": params, "history": history, "metrics": metrics,
            "loss": loss, "samples": samples, "train_time": train_time,
            "optimizer_state": None,
            "eval_top1": evaluator.top1 if eval_set is not None else None}


def _lanes_possible(cfg: TrainConfig, fit_kw: dict) -> bool:
    """Could ``cfg.ensemble``'s members train side by side (:func:`_member_lanes`, before the
    first member's budget is known)? Several members on one CPU device of several cores, its
    threads calibrated, in one process and in threads (``fit_kw`` without ``simulate``)."""
    from xmc_engine.devices import parse_devices
    from xmc_engine.distributed import world

    devices = parse_devices(cfg.devices)
    return (cfg.ensemble > 1 and cfg.threads is None and len(devices) == 1
            and devices[0].kind == "cpu" and devices[0].threads > 1
            and fit_kw.get("simulate") is None
            and (bool(fit_kw.get("one_node")) or world().size == 1))


def _blas_threads(n: int):
    """BLAS's threads limited to ``n`` (process-wide) inside the block."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=n, user_api="blas")


def _member_lanes(cfg: TrainConfig, calibrated: dict, speedups: dict, X, Y, eval_set,
                  fit_kw: dict) -> int:
    """How many of ``cfg.ensemble``'s members train at once (:func:`_fit_ensemble`): one per
    core of the device, each on one thread, where they could (:func:`_lanes_possible`), the
    first member's calibration (``calibrated``, ``speedups``: its budget and the measured
    speed-up of all the device's threads over one) kept one thread or found all of them less
    than :data:`~xmc_engine.config.LANES_MAX_SPEEDUP` times as fast, and the memory planner
    says the host holds that many runs at once; else 1 (one after the other, on the calibrated
    budget)."""
    from xmc_engine.config import LANES_MAX_SPEEDUP
    from xmc_engine.devices import parse_devices

    speedup = (speedups or {}).get(0)
    if not _lanes_possible(cfg, fit_kw) or not (
            calibrated == {0: 1} or (speedup is not None and speedup < LANES_MAX_SPEEDUP)):
        return 1
    lanes = min(cfg.ensemble, parse_devices(cfg.devices)[0].threads)
    while lanes > 1 and not _host_holds(lanes, dataclasses.replace(cfg, ensemble=1), X, Y,
                                        eval_set):
        lanes -= 1
    return lanes


def _continue_fit(fit: dict, n_replicas: int) -> tuple[list, dict, dict]:
    """``(params, state, extra)`` that start a run where the probe's winning ``fit``
    (:func:`choose_loss`'s) stopped, as a resumed checkpoint would: its model and Adagrad state
    (each of ``n_replicas`` replicas starts with both), its samples and its training time. The
    fit trained the first ``samples`` rows of the run's own first epoch (the order of
    :func:`~xmc_engine.scheduler.queue.epoch_permutation` with the run's seed), so the queue
    goes on at that row of that epoch: on one device the continued run is the run of the
    chosen loss from the initialisation."""
    samples = int(fit["samples"])
    state = {"epoch": 0, "samples": samples, "train_time": float(fit["train_time"])}
    extra = {f"opt.{r}.{i}": a for r in range(n_replicas)
             for i, a in enumerate(fit["optimizer_state"] or [])}
    extra[_STATE_KEY] = _json_bytes({"queue": {"epoch": 0, "cursor": samples, "period": -1}})
    return fit["params"], state, extra


def _checkpoint_to_resume(ckpts, run_dir):
    """``(arrays, meta)`` of the newest valid checkpoint in ``run_dir``, or None (with a
    warning) where the run was stopped before its first one."""
    if ckpts is None:
        raise ConfigError("resume needs the run folder (log_dir)")
    found = ckpts.latest_valid()
    if found is None and ckpts.paths():
        from xmc_engine.errors import CheckpointError

        raise CheckpointError(f"{run_dir}: no valid checkpoint to resume from (every "
                              f"ckpt-*.npz there is truncated or corrupted)")
    if found is None:  # killed before its first checkpoint: start over
        logger.warning("%s holds no checkpoint yet: training from the start", run_dir)
    return found


def choose_loss(cfg: TrainConfig, X, Y, device) -> dict:
    """``loss="auto"``: which loss this data wants, by a short probe. Below
    :data:`~xmc_engine.config.LOSS_PROBE_MIN_ROWS` training rows, or where the held-out rows
    and a batch leave less than a batch to train on, the softmax (the held-out rows would be
    too few to tell the losses apart). Otherwise each loss of
    :data:`~xmc_engine.config.TRAIN_LOSSES` trains, on ``device`` alone with every other
    setting of ``cfg``, the start of the run's own first epoch (the run's seed, initialisation
    and row order): :data:`~xmc_engine.config.LOSS_PROBE_SAMPLES` rows, fewer on a small set,
    where the :data:`~xmc_engine.config.LOSS_PROBE_HELDOUT` rows that come next in that epoch
    (at most :data:`~xmc_engine.config.LOSS_PROBE_HELDOUT_SHARE` of the set) must remain; the
    fits are scored on those next rows, which neither has seen. The logistic loss wins unless
    the softmax's held-out P@1 is ahead by more
    than :data:`~xmc_engine.config.LOSS_PROBE_SOFTMAX_Z` standard errors
    (:data:`~xmc_engine.config.LOSS_PROBE_SOFTMAX_Z_SAMPLED` where the run trains the sampled
    output layer; :func:`pick_loss`). Where the sampled layer's first look is thin (the
    softmax ahead, not clearly, after a small part of a long epoch;
    :func:`second_look_samples`) both losses train again, from the initialisation, on a longer
    start of the epoch, and that second look decides.
    The losing fit is thrown away; the winner's (:func:`fit_model`'s result) is returned as
    ``fit``, which :func:`fit_model` continues where ``cfg.continue_probe`` allows (the
    ``continued`` of the record). The device's CPU threads (``cfg.threads=None``) are
    calibrated once (:func:`calibrate_device`) for both fits and the run (:func:`build_trainer`'s
    ``calibrated``): on a small set each calibration costs more than the training, and the loss
    does not change which budget is faster. Where the device has a core per loss and the memory
    planner says the host holds a fit per loss, the fits run side by side, each on one thread
    where one thread won the calibration, else on its share of the device's threads. Returns
    the run log's ``loss_probe`` record: ``loss``, ``p1`` per loss, ``z`` (:func:`pick_loss`'s
    margin of the softmax), ``margin`` (what it had to exceed), ``rows`` (the samples each
    fit trained), ``first_look`` (``None``, or after a second look the first one's ``z``,
    ``p1``, ``rows`` and ``loss``), ``heldout``, ``epochs``
    (``rows`` over the set's), ``seconds``, ``threads`` (the calibrated budget, the run's;
    ``None`` where none was calibrated), ``threads_timed`` (False: the run was too short to
    repay timing the budgets, or its steps too short to gain from threads, and keeps one
    thread),
    ``threads_speedup`` (the speed-up of all the device's threads over one that the timing
    measured; ``None`` where not timed) and ``together``
    (the fits ran side by side), plus
    ``compile_seconds`` and ``compiled`` (both losses' kernels, compiled or loaded before the
    probe and outside its ``seconds``, and the number of Numba compilations that took;
    :func:`fit_model` logs them as a ``compile`` record) and ``fit`` (the winning fit, None
    without a probe; neither is logged). ``X`` holds normalised rows."""
    from xmc_engine.config import (
        LOSS_PROBE_HELDOUT,
        LOSS_PROBE_HELDOUT_SHARE,
        LOSS_PROBE_MIN_ROWS,
        LOSS_PROBE_SAMPLES,
        LOSS_PROBE_SOFTMAX_Z,
        TRAIN_LOSSES,
        SingleConfig,
    )

    n = X.shape[0]
    # The fits train the first `samples` rows of the run's own first epoch and are scored on
    # the `n_held` rows that come next, which they have not seen. A fit stops at a barrier of
    # one device's period (the run's own `merge_period` where the run is of one device), so
    # `samples` is a whole number of periods that leaves the held-out rows and a batch; on a
    # small set with a large batch the probe's one period is its samples, whole batches.
    n_held = min(LOSS_PROBE_HELDOUT, int(n * LOSS_PROBE_HELDOUT_SHARE))
    room = min(LOSS_PROBE_SAMPLES, n - n_held - cfg.batch_size)
    if n < LOSS_PROBE_MIN_ROWS or room < cfg.batch_size:
        logger.info("loss='auto': %d training rows, too few for the probe (%d, and a batch of "
                    "%d to train on besides %d held out): softmax", n, LOSS_PROBE_MIN_ROWS,
                    cfg.batch_size, n_held)
        return {"loss": "softmax", "p1": {}, "z": None, "margin": None, "rows": 0, "heldout": 0,
                "epochs": 0.0,
                "seconds": 0.0, "threads": None, "threads_timed": None, "together": False,
                "compile_seconds": 0.0, "compiled": 0, "fit": None}
    # both losses' kernels first, outside the probe's seconds
    compile_s, compiled = 0.0, 0
    for loss in TRAIN_LOSSES:
        report: dict = {}
        compile_s += compile_kernels(dataclasses.replace(cfg, loss=loss), [device], X, Y,
                                     report=report)
        compiled += report["compiled"]
    t0 = time.perf_counter()
    period = (cfg.algorithm_params.merge_period if cfg.algorithm == "single"
              else SingleConfig().merge_period)  # a run of one device: its own period
    samples = room // period * period
    if samples == 0:
        samples = period = room // cfg.batch_size * cfg.batch_size
    per_row = float(Y.nnz) / n  # the output layer the run itself will train
    base = dataclasses.replace(cfg, eval_every=0, max_train_seconds=None,
                               ensemble=1, normalize="none",  # X's rows are the run's already
                               # the run's schedule: a number as given; "plateau" (and
                               # "auto", unresolved where a caller passes it) none, since a fit
                               # stays in epoch 0, where every decay gives lr, and must not hold
                               # rows out for a plateau rule of its own
                               lr_decay=0.0 if isinstance(cfg.lr_decay, str) else cfg.lr_decay,
                               devices=str(device), algorithm="single",
                               algorithm_params={"merge_period": period},
                               output=cfg.output_for(Y.shape[1], per_row))
    threads, calibration = cfg.threads, {"timed": None}
    if threads is None:  # calibrated once, here: both fits and the run reuse the budget
        # the samples the budget serves: a probe fit's and the run's (a short run keeps one
        # thread untimed: the timing would cost more than it could save)
        threads = calibrate_device(dataclasses.replace(base, loss=TRAIN_LOSSES[0],
                                                       epochs=samples / n), X, Y,
                                   run_samples=samples + cfg.epochs * n, report=calibration)
    # a core per loss: the fits run side by side, each on one thread where one thread won the
    # calibration, else on its share of the device's threads (1.2-2x sooner than in turn, the
    # same models: bench/RESULTS.md, "The loss probe's cost")
    cores = _probe_device(device).threads

    def look(samples):
        """Both losses trained on the first ``samples`` rows of the first epoch and scored on
        the ``n_held`` rows that come next: (the fits, held-out P@1 per loss, the pick, z,
        the held-out rows, whether the fits ran side by side)."""
        held = np.sort(epoch_permutation(n, cfg.seed, 0)[samples:samples + n_held])
        fit_cfg = dataclasses.replace(base, epochs=samples / n)
        logger.info("loss='auto': training each loss on the first %d rows of the first epoch, "
                    "%d next ones held out ...", samples, len(held))
        heldout = (X[held], Y[held])
        together = (cfg.threads is None and threads is not None and cores >= len(TRAIN_LOSSES)
                    and _host_holds(len(TRAIN_LOSSES), fit_cfg, X, Y, heldout))
        fit_threads = (1 if threads == 1 else cores // len(TRAIN_LOSSES)) if together else threads

        def fit(loss):
            return fit_model(dataclasses.replace(fit_cfg, loss=loss, threads=fit_threads), X, Y,
                             heldout, progress_desc=f"probe {loss}", one_node=True,
                             keep_optimizer_state=True)

        if together:
            from concurrent.futures import ThreadPoolExecutor

            from threadpoolctl import threadpool_limits

            # the fits' workers enter and leave BLAS limits in any order: held at theirs around
            # them, the process's own limit is what it was once both are done
            with threadpool_limits(limits=fit_threads, user_api="blas"), \
                    ThreadPoolExecutor(len(TRAIN_LOSSES) - 1,
                                       thread_name_prefix="xmc-probe") as ex:
                others = [ex.submit(fit, loss) for loss in TRAIN_LOSSES[1:]]
                results = [fit(TRAIN_LOSSES[0])] + [f.result() for f in others]
        else:
            results = [fit(loss) for loss in TRAIN_LOSSES]
        p1 = {loss: float(res["metrics"]["P@1"]) for loss, res in zip(TRAIN_LOSSES, results,
                                                                      strict=True)}
        hits = {loss: row_hits(res["eval_top1"], heldout[1])
                for loss, res in zip(TRAIN_LOSSES, results, strict=True)}
        best, z = pick_loss(hits, base.output)
        logger.info("loss='auto': held-out P@1 %s after %d rows, the softmax %+.1f standard "
                    "errors", ", ".join(f"{k} {v:.4f}" for k, v in p1.items()), samples, z)
        return results, p1, best, z, held, together

    results, p1, best, z, held, together = look(samples)
    first = None
    longer = second_look_samples(base.output, z, samples, n, n_held, cfg.batch_size, period)
    if longer:  # the softmax ahead, not clearly, after a small part of a long epoch: look again
        first = {"z": z, "p1": p1, "rows": samples, "loss": best}
        logger.info("loss='auto': the softmax %+.1f standard errors ahead after %.1f %% of an "
                    "epoch, under %g: a second look after %d rows", z, 100 * samples / n,
                    LOSS_PROBE_SOFTMAX_Z, longer)
        results = None  # the first fits' memory back before the second ones
        samples = longer
        results, p1, best, z, held, together = look(samples)
    seconds = time.perf_counter() - t0
    logger.info("loss='auto': held-out P@1 %s, the softmax %+.1f standard errors (%.1f s): "
                "training with %s", ", ".join(f"{k} {v:.4f}" for k, v in p1.items()), z,
                seconds, best)
    winner = results[TRAIN_LOSSES.index(best)]
    return {"loss": best, "p1": p1, "z": z, "margin": probe_margin(base.output),
            "rows": samples, "heldout": int(len(held)),
            "epochs": round(samples / n, 4), "seconds": seconds, "fit": winner,
            "first_look": first,
            "threads": None if cfg.threads is not None else threads,
            "threads_speedup": calibration.get("speedup"),  # None where not timed
            "threads_timed": calibration["timed"], "together": together,
            "compile_seconds": compile_s, "compiled": compiled}


def second_look_samples(output: str, z: float, samples: int, n: int, n_held: int,
                        batch_size: int, period: int) -> int:
    """The rows of the loss probe's second look, or 0 for none. Where the run trains the
    sampled output layer, the first look saw less than
    :data:`~xmc_engine.config.LOSS_PROBE_SECOND_LOOK_SHARE` of the epoch, and the softmax's
    margin ``z`` is above 0 but not above the exact layer's
    :data:`~xmc_engine.config.LOSS_PROBE_SOFTMAX_Z` (ahead, not clearly), both losses train
    again on that share of the epoch (whole periods, leaving the held-out rows and a batch) and
    that look decides, with the sampled layer's margin."""
    from xmc_engine import config

    if output != "sampled" or not 0.0 < z <= config.LOSS_PROBE_SOFTMAX_Z:
        return 0
    want = int(n * config.LOSS_PROBE_SECOND_LOOK_SHARE)
    longer = min(want, n - n_held - batch_size) // period * period
    return longer if longer > samples else 0


def row_hits(top1, Y) -> np.ndarray:
    """Per row of host CSR ``Y``: is the predicted ``top1[i]`` one of row ``i``'s labels
    (bool; a row without labels: False, as P@1 counts it), by
    :func:`~xmc_engine.metrics.label_hits`."""
    from xmc_engine.metrics import label_hits

    return label_hits(np.asarray(top1, dtype=np.int64)[:, None], Y)[:, 0]


def pick_loss(hits: dict, output: str = "exact") -> tuple[str, float]:
    """The loss probe's rule: ``(loss, z)`` from ``hits``, each loss's :func:`row_hits` on the
    same held-out rows. ``z`` is the softmax's paired margin: the mean of ``hit_softmax -
    hit_bce`` over the rows divided by its standard error (at least ``1 / rows``, so that
    identical rows give a finite figure). The softmax wins where ``z`` is above
    :data:`~xmc_engine.config.LOSS_PROBE_SOFTMAX_Z` (with the sampled ``output`` layer
    :data:`~xmc_engine.config.LOSS_PROBE_SOFTMAX_Z_SAMPLED`), the logistic loss otherwise (a
    tie included): the softmax has to win by more than chance would on the held-out rows."""
    z = paired_z(hits["softmax"], hits["bce"])
    return ("softmax" if z > probe_margin(output) else "bce"), round(z, 2)


def probe_margin(output: str) -> float:
    """The standard errors the softmax must be ahead by in the loss probe of a run that
    trains the ``output`` layer (:func:`pick_loss`)."""
    from xmc_engine import config

    return (config.LOSS_PROBE_SOFTMAX_Z_SAMPLED if output == "sampled"
            else config.LOSS_PROBE_SOFTMAX_Z)


def paired_z(a, b) -> float:
    """How far model ``a``'s per-row hits are ahead of model ``b``'s on the same rows, in
    standard errors: the mean of ``a - b`` over the rows divided by its standard error (at least
    ``1 / rows``, so that identical hits give a finite 0)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    m = len(d)
    se = max(float(d.std(ddof=1)) / np.sqrt(m) if m > 1 else 0.0, 1.0 / m)
    return float(d.mean()) / se


def _probe_device(device):
    """The device the loss probe trains on: ``device`` alone, so with every core its kind gets
    alone (a CPU device of a several-device run has a share of them; its calibrated budget is
    then not the probe's)."""
    from xmc_engine.devices import parse_devices

    return parse_devices(str(device))[0]


def calibrate_device(cfg: TrainConfig, X, Y, run_samples: float | None = None,
                     report: dict | None = None) -> int | None:
    """The CPU thread budget :func:`build_trainer` would calibrate for the first device of
    ``cfg.devices`` (its :meth:`~xmc_engine.model.MLPReplica.calibrate_threads`, on a replica of
    ``cfg`` built for the purpose and thrown away, for a run of ``run_samples`` samples);
    ``None`` where it calibrates nothing (a given ``threads``, a GPU, a one-thread device).
    ``report`` (a dict), if given, receives ``timed``: whether the budgets were timed (False:
    the run was too short to repay it and keeps one thread). ``X`` holds normalised rows."""
    from xmc_engine.devices import parse_devices

    device = parse_devices(cfg.devices)[0]
    if cfg.threads is not None or device.kind != "cpu" or device.threads <= 1:
        return None
    shape = ModelShape(X.shape[1], Y.shape[1], tuple(cfg.hidden))
    rep = make_replica(cfg, device, X, Y, init_params_for_data(shape, X, cfg.seed,
                                                               loss=cfg.loss), 0)
    threads = rep.calibrate_threads(cfg.batch_size, device.threads, run_samples)
    if report is not None:
        report["timed"] = rep.threads_timed
        report["speedup"] = rep.threads_speedup
    return threads


def _host_holds(copies: int, cfg: TrainConfig, X, Y, eval_set) -> bool:
    """Does the memory planner say the host holds ``copies`` runs of ``cfg`` at once (in one
    process: the process itself counted once)?"""
    from xmc_engine.memory import RUNTIME_ITEM, plan_for_data

    plan = plan_for_data(cfg, X, Y, eval_set)
    return all(p.available is not None
               and copies * p.total - (copies - 1) * p.items.get(RUNTIME_ITEM, 0) <= p.available
               for p in plan.pools)


#: Seconds of compiling after which :func:`compile_kernels` says what it is doing.
COMPILE_NOTICE_S = 2.0
#: Largest hidden width of :func:`compile_kernels`' throwaway replicas.
COMPILE_WIDTH = 8


class _CompileWatch:
    """What :func:`compile_kernels` tells the user: once it has lasted :data:`COMPILE_NOTICE_S`
    seconds and a Numba compilation has started, a warning that kernels are being compiled,
    then a progress bar of the compilations. A slow setup that compiles nothing (every kernel
    from Numba's cache or already loaded in this process, e.g. a benchmark's later runs) says
    nothing. Counts the Numba compilations made while it is entered, in any thread of the
    process (its listener hears numba's ``numba:compile`` events, which a function loaded from
    Numba's cache does not raise: ``count`` 0 means everything came from the cache). CUDA
    kernels are not counted: numba-cuda raises its events on an event module of its own, not
    listened to (not measured on a GPU). Use it as a context manager around the compiling
    code."""

    def __init__(self):
        from numba.core import event

        class Listener(event.Listener):
            def on_start(_, ev):
                self._started()

            def on_end(_, ev):
                self._compiled()

        self._event, self._listener = event, Listener()
        self.count, self.started, self._bar = 0, 0, None
        self._lock = threading.Lock()
        self._due = threading.Event()  # COMPILE_NOTICE_S has passed
        self._noticed = threading.Event()  # the warning was given
        self._timer = threading.Timer(COMPILE_NOTICE_S, self._time_up)
        self._timer.daemon = True

    def _notice(self):
        """The warning, once, when the time is up and a compilation has started (under the
        lock)."""
        if self._due.is_set() and self.started and not self._noticed.is_set():
            logger.warning("compiling kernels (first run after install; later runs load "
                           "Numba's cache) ...")
            self._noticed.set()

    def _time_up(self):
        with self._lock:
            self._due.set()
            self._notice()

    def _started(self):
        with self._lock:
            self.started += 1
            self._notice()

    def _compiled(self):
        with self._lock:
            self.count += 1
            if not self._noticed.is_set():
                return
            if self._bar is None:
                self._bar = progress.bar(desc="compiling kernels", unit=" functions")
                self._bar.update(self.count)
            else:
                self._bar.update(1)

    def __enter__(self):
        self._event.register("numba:compile", self._listener)
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()
        self._event.unregister("numba:compile", self._listener)
        with self._lock:
            if self._bar is not None:
                self._bar.close()
        return False


def make_replica(cfg: TrainConfig, device, X, Y, params, index: int) -> MLPReplica:
    """The replica of ``cfg`` on ``device`` (a DeviceSpec), the ``index``-th of the run, from the
    host arrays ``params``: its backend, optimizer, loss, output layer and negative-sampling
    seed. ``cfg.loss`` must be a training loss: ``"auto"`` is :func:`fit_model`'s probe."""
    from xmc_engine.backends import get_backend

    if cfg.loss not in TRAIN_LOSSES:
        raise ConfigError(f"loss={cfg.loss!r} is chosen by fit_model's probe (choose_loss); a "
                          f"trainer built directly needs one of {', '.join(TRAIN_LOSSES)}")
    be = get_backend(device.kind, device.index, threads=cfg.threads or device.threads)
    return MLPReplica(be, X, Y, params, label_chunk=cfg.label_chunk, optimizer=cfg.optimizer,
                      loss=cfg.loss, output=cfg.output_for(Y.shape[1], Y.nnz / max(Y.shape[0], 1)),
                      negatives=cfg.negatives, negative_sampling=cfg.negative_sampling,
                      seed=cfg.seed + index)


def compile_kernels(cfg: TrainConfig, devices, X, Y, log=None,
                    report: dict | None = None) -> float:
    """Compile the run's Numba kernels, or load them from Numba's on-disk cache, before the
    training clock starts, so that ``train_time`` and the first epoch hold no compilation.

    One throwaway replica per device, of the run's depth but with at most :data:`COMPILE_WIDTH`
    units per hidden layer (memory ``O(n_features + n_labels)``), built like the run's
    (:func:`make_replica`: optimizer, output layer, label chunk), takes one step on the first rows
    of ``X`` at learning rate 0 (one gradient and its update where the run's algorithm steps by
    gradient, :attr:`~xmc_engine.algorithms.Policy.steps_by_gradient`: ``sync``); the first device
    predicts their top-k, and several devices merge the throwaway replicas (weighted and
    row-sparse). Numba compiles per argument type (dtype, dimensions, layout), not size, so the
    run's own calls find every kernel compiled; the run's model is not touched. When this lasts
    longer than :data:`COMPILE_NOTICE_S` and compiles, a warning says what is happening (the
    first run after an install compiles, later runs load the cache) and a progress bar counts the
    compilations; a slow setup that compiles nothing says nothing.

    Returns the seconds spent, also written to ``log`` as a ``compile`` record with
    ``compiled``, the number of Numba compilations (0: every kernel came from the cache);
    ``report`` (a dict), if given, receives that number as ``compiled``.
    """
    from xmc_engine.algorithms import POLICIES
    from xmc_engine.backends.base import empty_like
    from xmc_engine.scheduler.merge import merge_changed_rows, weighted_merge

    t0 = time.perf_counter()
    with _CompileWatch() as watch:
        rows = np.arange(min(4, X.shape[0]), dtype=np.int64)
        hidden = tuple(min(h, COMPILE_WIDTH) for h in cfg.hidden)
        params = init_params_for_data(ModelShape(X.shape[1], Y.shape[1], hidden), X, cfg.seed,
                                      loss=cfg.loss)
        # the merge weights of the run's algorithm (Adaptive SGD's per-row / per-label ones
        # run kernels of their own, e.g. the column merge with the exact output layer)
        per_row = cfg.algorithm_params.per_row_weights
        row_sum = cfg.algorithm_params.row_sum
        per_label = cfg.algorithm_params.per_label_weights

        def step(rep) -> None:  # one step of the run's kind, at learning rate 0
            if POLICIES[cfg.algorithm].steps_by_gradient:
                rep.apply_grads(rep.grad_batch(rows)[1], 0.0)
            else:
                rep.train_batch(rows, 0.0)

        replicas = []
        for d in devices:
            rep = make_replica(cfg, d, X, Y, params, len(replicas))
            if per_label:
                rep.track_labels()
            step(rep)
            replicas.append(rep)
        be = replicas[0].backend
        predict_topk(be, replicas[0].params(), X[rows], max(5, cfg.eval_k),
                     label_chunk=cfg.label_chunk)
        if len(replicas) > 1:
            weights = [1.0 / len(replicas)] * len(replicas)
            central = [empty_like(be, p) for p in replicas[0].params()]
            weighted_merge([r.params() for r in replicas], weights, central, be)
            merge_changed_rows(replicas, weights, central, be, per_row=per_row,
                               row_sum=row_sum, per_label=per_label)
            if row_sum:
                # The sum merges a row several replicas changed with the central rows as one
                # more operand (n + 1 arrays), a row one replica changed as the weighted merge
                # does (n arrays). Every row here is changed by every replica, so the second
                # kernel is warmed by a merge without the sum, after another step.
                for rep in replicas:
                    step(rep)
                merge_changed_rows(replicas, weights, central, be, per_row=per_row,
                                   per_label=per_label)
        for rep in replicas:
            rep.backend.synchronize()
    seconds = time.perf_counter() - t0
    if report is not None:
        report["compiled"] = watch.count
    if log is not None:
        log.write("compile", seconds=seconds, compiled=watch.count,
                  devices=[str(d) for d in devices])
    return seconds


#: The ``threads`` record's note where the budgets were not timed, by why
#: (:attr:`~xmc_engine.model.MLPReplica.threads_skipped`).
_UNTIMED = {"run": "not timed: the run is too short to repay timing the budgets",
            "step": "not timed: its steps are too short to gain from threads "
                    "(model.CALIBRATE_MIN_STEP_S)"}


def build_trainer(cfg: TrainConfig, devices, X, Y, params, log, *, comm=None,
                  assignment: str = "shared", mode: str = "threads", cost=None,
                  calibrated: dict[int, int] | None = None, calibrated_by: str = "the loss probe",
                  run_samples: float | None = None, speedups: dict | None = None,
                  on_budgets=None):
    """The :class:`~xmc_engine.scheduler.Trainer` of ``cfg``: one
    :class:`~xmc_engine.model.MLPReplica` per device of ``devices`` (a list of DeviceSpec),
    starting from the host arrays ``params``, and the algorithm's policy. ``log`` (a
    :class:`~xmc_engine.runlog.RunLog` or ``None``) receives its records; ``comm`` and
    ``assignment`` make it one node of a multi-node run; ``mode`` and ``cost`` are the
    trainer's (``"simulated"``: a virtual clock, see :func:`fit_model`'s ``simulate``).
    ``calibrated`` maps a device's index to a CPU thread budget already calibrated for it (by
    ``calibrated_by``: the loss probe, :func:`choose_loss`, or an ensemble's first member),
    which is used instead of calibrating again.
    ``run_samples`` (the samples the run has left to train, if known) lets a run too short to
    repay the calibration keep one thread untimed. ``speedups`` maps a device's index to the
    speed-up of all its threads over one that ``calibrated`` budget's calibration measured
    (``None``: not timed). ``on_budgets``, if given, is called with the CPU replicas' thread
    budgets and those speed-ups by device index once they are set, before the trainer starts
    its device workers; the budgets it returns, if any, replace them (logged as set by it)."""
    from xmc_engine.algorithms import get_algorithm
    from xmc_engine.scheduler import Schedule, Trainer

    opts = cfg.algorithm_params
    replicas, notes, measured = [], {}, {}
    for d in devices:
        rep = make_replica(cfg, d, X, Y, params, len(replicas))
        be = rep.backend
        if cfg.threads is None and be.name == "cpu" and d.threads > 1:
            i = len(replicas)
            known = (calibrated or {}).get(i)
            if known is None:
                rep.calibrate_threads(cfg.batch_size, d.threads, run_samples)
                measured[i] = rep.threads_speedup  # None where not timed
            else:
                be.threads = known
                measured[i] = (speedups or {}).get(i)
            notes[i] = (_UNTIMED[rep.threads_skipped]
                        if known is None and rep.threads_timed is False else
                        "calibrated: the faster of 1 and all of the device's threads"
                        if known is None else f"by {calibrated_by} (its record says how)")
        replicas.append(rep)
    if on_budgets is not None:
        given = on_budgets({i: r.backend.threads for i, r in enumerate(replicas)
                            if r.backend.name == "cpu"}, dict(measured)) or {}
        for i, n in given.items():
            if replicas[i].backend.threads != n:
                replicas[i].backend.threads = n
                notes[i] = ("one thread: an ensemble's members train side by side, a core "
                            "each (training.LANES_MAX_SPEEDUP)")
    for i, note in notes.items():
        if log is not None:
            log.write("threads", device=str(devices[i]), threads=replicas[i].backend.threads,
                      note=note, speedup=None if measured.get(i) is None
                      else round(float(measured[i]), 3))
    # fit_model resolves "auto" and runs the plateau rule between epochs (its _PlateauWatch
    # rescales this schedule). A trainer built without it has no held-out rows: "auto" is the
    # optimizer's fixed decay here, and "plateau" no decay by the epoch (its scale stays 1).
    given = None if cfg.lr_decay == "auto" else cfg.lr_decay
    decay = dataclasses.replace(cfg, lr_decay=given).lr_decay_for(X.shape[0])
    schedule = Schedule(cfg.learning_rate, cfg.warmup_epochs,
                        0.0 if decay == "plateau" else decay)
    return Trainer(replicas, devices, get_algorithm(cfg.algorithm, opts), X.shape[0],
                   batch_size=cfg.batch_size, schedule=schedule, seed=cfg.seed, log=log,
                   rejoin_after=opts.rejoin_after, faults=opts.fault, comm=comm,
                   assignment=assignment, mode=mode, cost=cost)


_STATE_KEY = "trainer_state"  # the trainer's JSON state in a checkpoint, as uint8


def _json_bytes(obj) -> np.ndarray:
    return np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy()


def _from_json_bytes(a) -> Any:
    return json.loads(bytes(np.asarray(a, np.uint8)))


def checkpoint_extra(trainer) -> dict[str, np.ndarray]:
    """What a checkpoint holds beside the central model: the trainer's JSON state, every
    replica's optimizer state (``opt.<replica>.<param>``) and the state of its negative
    sampler (``rng.<replica>``, JSON)."""
    out = {_STATE_KEY: _json_bytes(trainer.state_dict())}
    for r, rep in enumerate(trainer.replicas):
        for i, a in enumerate(rep.optimizer_state()):
            out[f"opt.{r}.{i}"] = a
        if hasattr(rep, "rng_state"):
            out[f"rng.{r}"] = _json_bytes(rep.rng_state())
    return out


def restore_trainer(trainer, extra: dict) -> None:
    """Give ``trainer`` back the state :func:`checkpoint_extra` saved (after the replicas got
    the checkpoint's model)."""
    saved = extra.get(_STATE_KEY)
    if saved is not None:
        trainer.load_state_dict(_from_json_bytes(saved))
    for r, rep in enumerate(trainer.replicas):
        state = [extra[f"opt.{r}.{i}"] for i in range(len(rep.params()))
                 if f"opt.{r}.{i}" in extra]
        rep.load_optimizer_state(state)
        if f"rng.{r}" in extra and hasattr(rep, "load_rng_state"):
            rep.load_rng_state(_from_json_bytes(extra[f"rng.{r}"]))


def host_params(trainer) -> list[np.ndarray]:
    """The central model as host float32 arrays."""
    be = trainer.replicas[0].backend
    return [np.array(be.to_host(p), dtype=np.float32) for p in trainer.central_params()]


def hold_out(X, Y, seed: int):
    """``(X_train, Y_train, (X_held, Y_held))``: :data:`~xmc_engine.config.PLATEAU_HOLDOUT_ROWS`
    rows (a tenth of the rows at most) drawn with ``seed`` and taken out of training, for
    ``lr_decay="plateau"`` and ``keep_best`` (:meth:`TrainConfig.holds_out`). The same rows on
    every call with the same seed (a resumed run)."""
    n = X.shape[0]
    k = min(PLATEAU_HOLDOUT_ROWS, n // 10)
    if k < 1:
        raise ConfigError(f"lr_decay='plateau' holds a tenth of the training rows out of "
                          f"training (at most {PLATEAU_HOLDOUT_ROWS}); {n} rows are too few: "
                          f"pass a number (e.g. lr_decay=0.5)")
    order = np.random.default_rng([seed, 0x91A7]).permutation(n)
    held = np.sort(order[:k])
    keep = np.sort(order[k:])
    return X[keep], Y[keep], (X[held], Y[held])


#: Checkpoint arrays of ``keep_best``'s model (``best.W1``, ...), apart from the run's own.
_BEST_PREFIX = "best."


class _PlateauWatch:
    """``lr_decay="plateau"`` in the driver: after each whole epoch the central model's P@1 on
    the held-out rows (rank 0's; ``heldout`` is None on the other nodes), the
    :class:`~xmc_engine.scheduler.controller.Plateau` rule on its top-1 error (``1 - P@1``:
    lower is better), the rule's multiplier sent from rank 0 to every node, and the trainer's
    schedule rescaled by it; a ``plateau`` record each time (with a fixed decay and
    ``keep_best``, :meth:`TrainConfig.holds_out`, the rule's factor is 1: the rate is never
    lowered, the readings only choose the best epoch's model). With ``keep_best``
    (``TrainConfig.keep_best``) every node keeps a host copy of the central model of the best
    epoch so far, and :meth:`finish` puts it back where the last model is clearly worse; with
    ``back_to_best`` (``TrainConfig.back_to_best``) it keeps that copy too, and training goes
    on from it at the halved rate where the model of an epoch that lowered the rate is
    clearly worse."""

    def __init__(self, rule: Plateau, heldout, comm, keep_best: bool = False,
                 back_to_best: bool = False):
        self.rule, self.heldout, self.comm = rule, heldout, comm
        self.keep_best, self.back_to_best = keep_best, back_to_best
        self.best_params: list[np.ndarray] | None = None  # the best epoch's central model
        self.best_epoch: int | None = None
        self.best_hits: np.ndarray | None = None  # its held-out hits (rank 0's)
        self.last_hits: np.ndarray | None = None  # the last held-out hits read (rank 0's)

    def apply(self, trainer) -> None:
        trainer.schedule = dataclasses.replace(trainer.schedule, scale=self.rule.scale)

    def _root_says(self, value: float) -> float:
        """Rank 0's ``value`` on every node (itself in one process)."""
        if self.comm is None or self.comm.size == 1:
            return value
        mine = value if self.comm.is_root else 0.0
        return float(self.comm.allreduce_sum(np.array([mine]))[0])

    def _read_p1(self, trainer, cfg: TrainConfig) -> float | None:
        """The central model's held-out P@1 (rank 0; None elsewhere), its hits kept."""
        if self.heldout is None:
            return None
        self.last_hits = np.asarray(
            heldout_hits(trainer.replicas[0].backend, trainer.central_params(), *self.heldout,
                         label_chunk=cfg.label_chunk), dtype=bool)
        return float(self.last_hits.mean())

    def after_epoch(self, trainer, epoch: int, log, cfg: TrainConfig) -> float:
        """Read the held-out P@1, update the rule and the schedule (and with ``keep_best``
        copy a new best epoch's model); returns the seconds."""
        t0 = time.perf_counter()
        p1, lowered, scale = self._read_p1(trainer, cfg), False, self.rule.scale
        improved = False
        if p1 is not None:
            improved = not self.rule.update(1.0 - p1)
            lowered = not improved and self.rule.factor < 1.0
        self.rule.scale = self._root_says(self.rule.scale)  # rank 0 decides for every node
        self.apply(trainer)
        improved = bool(self._root_says(float(improved)))  # a new best on every node
        if (self.keep_best or self.back_to_best) and improved:
            self._copy_best(trainer)
            self.best_epoch, self.best_hits = epoch, self.last_hits
        z = self._margin() if self.back_to_best else None  # logged with back_to_best only
        back = False
        if self.back_to_best and self.rule.scale < scale and self.best_params is not None:
            from xmc_engine import config  # read at the call: a bench may set the margin

            stale = self.best_epoch is not None and epoch - self.best_epoch >= 2
            margin = config.BACK_TO_BEST_STALE_Z if stale else config.BACK_TO_BEST_Z
            back = bool(self._root_says(float(z is not None and z > margin)))
            if back:
                trainer.load_model(self.best_params)
                self.last_hits = self.best_hits  # what the model now trained has on them
        seconds = time.perf_counter() - t0
        log.write("plateau", epoch=epoch, heldout_p1=p1, best_p1=self.state()["plateau_best_p1"],
                  lowered=lowered, lr_scale=self.rule.scale, seconds=seconds,
                  **({"z": z, "back_to": self.best_epoch if back else None}
                     if self.back_to_best else {}))
        if back:
            logger.info("epoch %d: held-out P@1 %.4f, %.1f standard errors below epoch %d's "
                        "%.4f: training goes on from epoch %d's model at x%g of the rate", epoch,
                        p1, z, self.best_epoch, 1.0 - self.rule.best, self.best_epoch,
                        self.rule.scale)
        elif lowered:
            logger.info("epoch %d: held-out P@1 %.4f not above %.4f: learning rate x%g", epoch,
                        p1, 1.0 - self.rule.best, self.rule.scale)
        return seconds

    def _margin(self) -> float | None:
        """How far the best epoch's held-out hits are ahead of the last ones read, in standard
        errors of the paired difference (:func:`paired_z`; rank 0's, None elsewhere)."""
        if self.best_hits is None or self.last_hits is None:
            return None
        return round(paired_z(self.best_hits, self.last_hits), 2)

    def _copy_best(self, trainer) -> None:
        """The central model into ``best_params``, into the arrays of the last copy where
        there is one (a fresh copy of a large model each epoch costs its page faults too)."""
        if self.best_params is None:
            self.best_params = host_params(trainer)
            return
        be = trainer.replicas[0].backend
        for dst, src in zip(self.best_params, trainer.central_params(), strict=True):
            np.copyto(dst, be.to_host(src))

    def finish(self, trainer, epoch: float, log, cfg: TrainConfig,
               read: bool) -> tuple[float, bool]:
        """``keep_best`` at the end of the run: the held-out hits of the last model (read again
        unless ``read`` is False: :meth:`after_epoch` has just read them), and where the best
        epoch's are ahead of them by more than :data:`~xmc_engine.config.KEEP_BEST_Z` standard
        errors (:func:`paired_z`), that epoch's model copied into the central model; a
        ``keep_best`` record. Returns the seconds (training time, as the rule's evaluations
        are) and whether the model was put back."""
        from xmc_engine.config import KEEP_BEST_Z

        t0 = time.perf_counter()
        if read and self.best_params is not None:  # else there is nothing to compare with
            self._read_p1(trainer, cfg)
        hits = self.last_hits if self.best_params is not None else None
        p1 = float(hits.mean()) if hits is not None else None
        best = self.state()["plateau_best_p1"]
        z = self._margin() if hits is not None else None
        restored = (bool(self._root_says(float(z is not None and z > KEEP_BEST_Z)))
                    and self.best_params is not None)
        if restored:
            be = trainer.replicas[0].backend  # the central model's (device 0's)
            for dst, src in zip(trainer.central_params(), self.best_params, strict=True):
                be.copy_into(dst, src)  # on its stream, after the pending work
        seconds = time.perf_counter() - t0
        log.write("keep_best", epoch=round(epoch, 4), heldout_p1=p1, best_p1=best,
                  best_epoch=self.best_epoch, z=z, restored=restored, seconds=seconds)
        if restored:
            logger.info("keep_best: the model of epoch %d (held-out P@1 %.4f) replaces the last "
                        "one (%.4f)", self.best_epoch, best, p1)
        return seconds, restored

    def state(self) -> dict:
        """What a checkpoint keeps of the rule (the best P@1 None before the first epoch)."""
        best = self.rule.best
        return {"lr_scale": self.rule.scale,
                "plateau_best_p1": 1.0 - best if np.isfinite(best) else None,
                "best_epoch": self.best_epoch}

    def arrays(self, names) -> dict:
        """The best epoch's model for a checkpoint (``best.<name>``; none without one)."""
        if self.best_params is None:
            return {}
        out = {_BEST_PREFIX + n: a for n, a in zip(names, self.best_params, strict=True)}
        if self.best_hits is not None:  # rank 0's
            out[_BEST_PREFIX + "heldout_hits"] = self.best_hits.astype(np.uint8)
        return out

    def restore(self, meta: dict, arrays: dict | None = None, names=()) -> None:
        self.rule.scale = float(meta["lr_scale"])
        best = meta.get("plateau_best_p1")
        self.rule.best = 1.0 - float(best) if best is not None else float("inf")
        if arrays is not None and all(_BEST_PREFIX + n in arrays for n in names):
            self.best_params = [np.array(arrays[_BEST_PREFIX + n], dtype=np.float32)
                                for n in names]  # writable: later bests are copied into it
            self.best_epoch = meta.get("best_epoch")
            hits = arrays.get(_BEST_PREFIX + "heldout_hits")
            self.best_hits = None if hits is None else np.asarray(hits, dtype=bool)


class _Driver:
    """The epoch loop around the trainer: evaluation cadence, checkpoints, signals, progress
    bar and run log. It stops the trainer at a barrier (``stop_after``) for each evaluation or
    checkpoint; several nodes always run whole epochs (their periods are aligned)."""

    def __init__(self, cfg, trainer, n_samples, state, log, evaluator, ckpts, checkpoint_every,
                 shape, desc="train", watch=None, stop=None):
        self.cfg, self.trainer, self.n, self.desc = cfg, trainer, n_samples, desc
        self.stop = stop  # a threading.Event another thread sets to stop this run (fit_model)
        self.watch = watch  # lr_decay="plateau": a _PlateauWatch
        self.multi_node = trainer.comm is not None and trainer.comm.size > 1
        # Samples of the open epoch done by earlier calls (a resumed checkpoint may be mid-epoch).
        self.epoch_samples = state["samples"] - int(state["epoch"]) * n_samples
        self.state, self.log, self.evaluator = state, log, evaluator
        self.ckpts, self.every, self.shape = ckpts, checkpoint_every, shape
        self.metrics: dict | None = None
        self.last_eval_samples = -1
        eval_step = int(round(cfg.eval_every * n_samples)) if cfg.eval_every > 0 else 0
        self.eval_step = eval_step
        self.next_eval = (state["samples"] // eval_step + 1) * eval_step if eval_step else None
        self._reset_ckpt_clock()
        self._signal: int | None = None
        self._call_t0: float | None = None  # start of the trainer call in progress

    # -- SIGINT / SIGTERM: stop between steps, checkpoint, raise TrainingInterrupted ----------
    def stop_requested(self) -> bool:
        """Asked by the trainer at every barrier: a signal (or the ``stop`` event, taken for
        SIGINT), or the training-time budget."""
        if self._signal is None and self.stop is not None and self.stop.is_set():
            self._signal = signal.SIGINT
        return self._signal is not None or self.out_of_time()

    def stop_requested_by_signal(self) -> bool:
        """A signal (or the ``stop`` event) has asked the run to stop."""
        self.stop_requested()
        return self._signal is not None

    def out_of_time(self) -> bool:
        """``max_train_seconds`` has passed: the finished trainer calls' training time plus,
        with worker threads, the wall time of the call in progress (a simulated run's virtual
        time is known at the end of a call only; :meth:`_next_stop` keeps its calls short)."""
        budget = self.cfg.max_train_seconds
        if budget is None:
            return False
        running = 0.0
        if self._call_t0 is not None and getattr(self.trainer, "mode", "threads") == "threads":
            running = time.perf_counter() - self._call_t0
        return self.state["train_time"] + running >= budget

    def _budget_spent(self) -> bool:
        """Between trainer calls: is the time budget spent? Several nodes decide together
        (any node over its budget stops all of them at the same epoch boundary)."""
        spent = self.out_of_time()
        if self.multi_node:
            spent = float(self.trainer.comm.allreduce_sum(np.array([float(spent)]))[0]) > 0
        return spent

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

    def _plateau_done(self) -> bool:
        """Has the plateau rule lowered the rate below its stop (the same on every node: its
        multiplier is rank 0's)?"""
        return self.watch is not None and self.watch.rule.done

    def _reset_ckpt_clock(self):
        self.last_ckpt_samples = self.state["samples"]
        self.last_ckpt_time = time.perf_counter()

    def _next_stop(self) -> int:
        stops = [10**18]
        if self.next_eval is not None:
            stops.append(self.next_eval)
        if self.every is not None and self.every[0] == "samples":
            stops.append(self.last_ckpt_samples + int(self.every[1]))
        if ((self.every is not None and self.every[0] == "seconds")
                or self.cfg.max_train_seconds is not None):
            # Check the clock every ~2% of an epoch.
            stops.append(self.state["samples"] + max(self.n // 50, 1))
        return min(stops)

    def evaluate(self, epoch_float: float) -> None:
        if self.evaluator is None:
            return
        t0 = time.perf_counter()
        self.metrics = self.evaluator(self.trainer.replicas[0].backend,
                                      self.trainer.central_params())
        self.last_eval_samples = self.state["samples"]
        self.log.write("eval", epoch=round(epoch_float, 4), samples=self.state["samples"],
                       train_time=self.state["train_time"],
                       eval_time=time.perf_counter() - t0, metrics=self.metrics)
        logger.info("epoch %.2f  %s", epoch_float, _short(self.metrics))

    def checkpoint(self, epoch: int, *, force: bool = False) -> None:
        if self.ckpts is None or (self.every is None and not force):
            return
        arrays = dict(zip(self.shape.param_names, host_params(self.trainer), strict=True))
        arrays.update(checkpoint_extra(self.trainer))
        meta = {k: self.state[k] for k in ("epoch", "samples", "train_time")}
        meta["loss"] = self.cfg.loss  # what loss="auto" chose: a resumed run keeps it
        meta["lr_decay"] = self.cfg.lr_decay  # and the decay it gave (lr_decay="auto")
        if self.watch is not None:
            meta.update(self.watch.state())
            arrays.update(self.watch.arrays(self.shape.param_names))
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
        cfg, st, tr = self.cfg, self.state, self.trainer
        total = int(cfg.epochs * self.n)
        bar = progress.bar(total=total, desc=self.desc, unit="sample", initial=st["samples"])
        previous = self._install_signals()
        watched_at = None  # the samples at the plateau rule's last held-out reading
        try:
            epoch = int(st["epoch"])
            # A signal stops the loop at the next barrier, where a checkpoint can be taken.
            while (st["samples"] < total and not self._budget_spent()
                   and not self.stop_requested_by_signal() and not self._plateau_done()):
                st["epoch"] = epoch
                before, t0 = st["samples"], st["train_time"]
                stop_after = None
                if not self.multi_node:
                    stop = min(self._next_stop(), total)
                    stop_after = self.epoch_samples + max(stop - st["samples"], 1)
                self._call_t0 = time.perf_counter()
                try:
                    # several nodes stop together, at the end of an epoch (collectives)
                    res = tr.run_epoch(epoch, stop_after=stop_after, should_stop=(
                        None if self.multi_node else self.stop_requested))
                except DivergenceError as exc:
                    self._diverged(exc)
                finally:
                    self._call_t0 = None
                n = self.n if self.multi_node else res["samples"]  # every node did an epoch
                st["train_time"] += res["train_seconds"]
                st["samples"] += n
                st["loss_sum"] = st.get("loss_sum", 0.0) + res["loss"] * n
                self.epoch_samples += res["samples"]
                if res["done"]:  # advance first, so that a checkpoint says so
                    epoch += 1
                    st["epoch"], self.epoch_samples = epoch, 0
                    if self.watch is not None and st["samples"] < total:
                        # part of training: its seconds count (and are logged apart)
                        st["train_time"] += self.watch.after_epoch(tr, epoch, self.log, cfg)
                        watched_at = st["samples"]
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
                if self._ckpt_due() and tr.can_checkpoint():
                    self.checkpoint(epoch)
            if self._signal is not None:
                self._interrupted(epoch)
            status = "completed"
            if st["samples"] < total and self._plateau_done():  # the plateau rule ended it
                status = "plateau_stop"
                rule = self.watch.rule
                self.log.write("plateau_stop", epoch=epoch, samples=st["samples"],
                               train_time=st["train_time"], lr_scale=rule.scale,
                               stop_scale=rule.stop_scale,
                               best_p1=self.watch.state()["plateau_best_p1"])
                logger.info("epoch %d: the plateau rule has lowered the learning rate to x%g "
                            "(below x%g) without a better held-out P@1: training stops (a "
                            "number for lr_decay trains every epoch)", epoch, rule.scale,
                            rule.stop_scale)
            elif st["samples"] < total:  # the time budget ended the run
                status = "time_budget"
                self.log.write("time_budget", max_train_seconds=cfg.max_train_seconds,
                               train_time=st["train_time"], samples=st["samples"],
                               epoch=round(st["samples"] / self.n, 4))
                logger.info("max_train_seconds=%g reached after %.1f s of training, %.3f "
                            "epochs", cfg.max_train_seconds, st["train_time"],
                            st["samples"] / self.n)
            if self.watch is not None and self.watch.keep_best:  # the best epoch's model
                seconds, restored = self.watch.finish(tr, st["samples"] / self.n, self.log, cfg,
                                                      read=watched_at != st["samples"])
                st["train_time"] += seconds
                if restored:  # the last evaluation was of the model it replaced
                    self.last_eval_samples = -1
            if self.evaluator is not None and self.last_eval_samples != st["samples"]:
                self.evaluate(st["samples"] / self.n)
            if (self.ckpts is not None and self.every is not None
                    and self.last_ckpt_samples != st["samples"]):
                self.checkpoint(epoch)
            if self._signal is not None:  # it came during the final evaluation or checkpoint
                self._interrupted(epoch)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            bar.close()
        self.log.write("final", status=status, epoch=round(st["samples"] / self.n, 4),
                       samples=st["samples"], train_time=st["train_time"], metrics=self.metrics,
                       mean_loss=st.get("loss_sum", 0.0) / max(st["samples"], 1))
        return self.metrics
