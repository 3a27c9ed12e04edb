"""``xmc-engine train | evaluate | predict | plot``: argument parsing only; the work is done by
:mod:`xmc_engine.training`, :class:`xmc_engine.XMCClassifier` and :mod:`xmc_engine.plots`."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

from xmc_engine.cli.argtypes import (
    finite_float,
    int_list,
    lr_decay,
    neighbours,
    positive_int,
    user_path,
)
from xmc_engine.config import ALGORITHMS, LOSS_PROBE_SOFTMAX_Z, TrainConfig
from xmc_engine.errors import ConfigError, DataMismatchError, SaveError, XMCError
from xmc_engine.runlog import LOG_NAME

RUN_FILE = "run.json"  # in a run folder: the config and the data it was trained on

# CLI option -> TrainConfig field, with the type argparse converts to.
_CONFIG_OPTIONS = {
    "hidden": ("--hidden", int_list, "hidden widths, comma-separated (default 128)"),
    "normalize": ("--normalize", str, "feature rows: l2 (default: unit norm) or none"),
    "epochs": ("--epochs", finite_float, "training epochs (default 10)"),
    "max_train_seconds": ("--max-train-seconds", finite_float,
                          "stop after this much training time (evaluation excluded)"),
    "ensemble": ("--ensemble", int, "networks trained (side by side, a core each, where "
                 "that is faster) and combined into one (the mean of their logits): higher "
                 "P@3 / P@5 for that many times the training samples (default 1)"),
    "batch_size": ("--batch-size", int, "base batch size B (default 64)"),
    "lr": ("--lr", finite_float, "base learning rate (default: the optimizer's, 0.05 for "
           "adagrad, 0.1 for adagrad with --loss bce, 2.0 for sgd)"),
    "lr_warmup_epochs": ("--lr-warmup-epochs", finite_float,
                         "linear learning-rate warm-up, every algorithm (default 0)"),
    "lr_decay": ("--lr-decay", lr_decay, "decay lambda: lr0/(1+lambda(e-e_warm)); plateau: "
                 "halve the rate after an epoch whose P@1 on 2,000 held-out training rows "
                 "does not improve, stop below 1/32 of it; auto (default): plateau with "
                 "adagrad from 40,000 training rows, else the optimizer's fixed decay (0.5 "
                 "for adagrad, 0 for sgd), none where --loss auto's probe found the softmax "
                 "clearly ahead"),
    "keep_best": ("--keep-best", bool, "with the plateau schedule: end with the model of the "
                  "epoch with the best held-out P@1 where the last one is clearly (2 standard "
                  "errors) behind it (default), or always with the last (--no-keep-best)"),
    "back_to_best": ("--back-to-best", bool, "with the plateau schedule: where an epoch "
                     "that lowers the rate left the model clearly behind the best epoch's (2 "
                     "standard errors; 1 once the best is two epochs old), go on from the best "
                     "epoch's model (default), or from the last (--no-back-to-best)"),
    "label_chunk": ("--label-chunk", int, "output-layer label chunk (default: whole)"),
    "optimizer": ("--optimizer", str, "adagrad (default) or sgd (the paper's)"),
    "loss": ("--loss", str, "training loss: auto (default: a short probe of both on part of "
             "the training rows picks one), softmax or bce (one-vs-all logistic)"),
    "continue_probe": ("--continue-probe", bool, "with --loss auto: training goes on from "
                       "the probe's winning fit (default), or starts over "
                       "(--no-continue-probe)"),
    "output": ("--output", str, "training output layer: auto (default: sampled for large "
               "label spaces, else exact), exact or sampled"),
    "negatives": ("--negatives", int, "negatives per batch of --output sampled"),
    "negative_sampling": ("--negative-sampling", str, "how --output sampled draws negatives: "
                          "frequency (default), uniform or lsh"),
    "devices": ("--devices", str, "device spec, e.g. cpu | cpu,cpu@0.5 | cuda:0,cuda:0 | auto"),
    "algorithm": ("--algorithm", str, f"one of {', '.join(ALGORITHMS)}"),
    "seed": ("--seed", int, "random seed (default 0)"),
    "threads": ("--threads", int, "CPU threads (default: all cores)"),
    "eval_every": ("--eval-every", finite_float, "evaluate every N epochs (0: at the end)"),
    "neighbours": ("--neighbours", neighbours, "predictions blend the network with the labels "
                   "of the N training rows nearest each row (in its hidden layer and in the "
                   "features); 0: the network alone; auto (default): 25 with the logistic "
                   "loss, or a softmax the loss probe found less than 6 standard errors "
                   "ahead, on up to 100,000 training rows, else 0"),
}


def _rate_line(start: dict) -> str:
    """The learning-rate schedule a run trained with, from its ``start`` record: the base rate
    and the decay in effect (``lr_decay="auto"`` resolved), and why where the default chose no
    decay."""
    lr, decay = start["lr"], start["lr_decay"]
    if decay == "plateau":
        return (f"lr {lr:g}, halved after each epoch whose P@1 on the held-out rows does not "
                f"improve (lr_decay plateau)")
    if decay:
        return f"lr {lr:g}, decay {decay:g} (lr / (1 + {decay:g} e) in epoch e)"
    cfg = start.get("config", {})
    why = (" (auto: the loss probe found the softmax clearly ahead; --lr-decay 0.5 decays it)"
           if cfg.get("lr_decay") == "auto" and cfg.get("optimizer") == "adagrad" else "")
    return f"lr {lr:g}, no decay{why}"


def _solo_line(history) -> str:
    """``"solo:  ..."``: the merge periods one device trained alone at the start of an
    ``adaptive`` run (``solo_epochs``), from the merge records; empty where none did."""
    alone = [r for r in history if r.get("event") == "merge" and r.get("solo") is not None]
    if not alone:
        return ""
    rows = sum(r["devices"][r["solo"]]["samples"] for r in alone)
    name = alone[0]["devices"][alone[0]["solo"]]["name"]
    return (f"solo:  {name} trained the first {len(alone)} merge periods ({rows:,} samples) "
            f"alone, then every device from its model (--algo-param solo_epochs=0 trains every "
            f"device from the start)")


def _ended_early(model, final: dict) -> str:
    """``", 23 of 40 epochs (...)"``: why a run ended before its epochs (the ``final`` record's
    ``status``), for the line after training; empty when it trained them all."""
    status = final.get("status")
    if status not in ("plateau_stop", "time_budget"):
        return ""
    done = f", {final.get('epoch', float('nan')):g} of {model.epochs:g} epochs"
    if status == "time_budget":
        return f"{done} (stopped: --max-train-seconds {model.max_train_seconds:g})"
    stop = next((r for r in model.history_ if r.get("event") == "plateau_stop"), {})
    return (f"{done} (stopped: held-out P@1 no longer improved and the plateau rule had "
            f"lowered the learning rate to x{stop.get('lr_scale', float('nan')):g}; "
            f"--lr-decay 0.5 trains every epoch)")


def _algo_param(s: str):
    """``KEY=VALUE`` -> ``(KEY, VALUE as JSON, else the string)``; NaN and infinities refused."""
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    key, value = s.split("=", 1)
    try:
        return key, json.loads(value, parse_float=finite_float, parse_constant=finite_float)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{s!r}: {exc}") from None
    except json.JSONDecodeError:
        return key, value


def add_config_arguments(p, fields, algo_param_example: str) -> None:
    """Add the :data:`_CONFIG_OPTIONS` flags ``fields`` and ``--algo-param`` to parser ``p``
    (what :func:`config_from_args` reads)."""
    for field in fields:
        flag, typ, helptext = _CONFIG_OPTIONS[field]
        if typ is bool:  # --flag / --no-flag
            p.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction,
                           default=None, help=helptext)
        else:
            p.add_argument(flag, dest=field, type=typ, default=None, help=helptext)
    p.add_argument("--algo-param", action="append", type=_algo_param, default=[],
                   metavar="KEY=VALUE",
                   help=f"algorithm option, repeatable (e.g. {algo_param_example})")


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model (no arguments: the built-in synthetic default)",
                       description="Train an XMC model. With no arguments: the built-in "
                       "synthetic dataset on the CPU, about 10 s on 2 cores.")
    p.add_argument("--data", type=user_path, default=None,
                   help="training data: a file, a dataset folder or a registered name "
                   "(default: synthetic)")
    p.add_argument("--test", type=user_path, default=None,
                   help="test file (default: the dataset's test split)")
    add_config_arguments(p, _CONFIG_OPTIONS, "merge_period=4096, rule=proportional")
    p.add_argument("--out", default=None, help="run folder (default runs/<time>)")
    p.add_argument("--config", type=user_path, default=None,
                   help="read the config from this JSON file")
    p.add_argument("--print-config", action="store_true", help="print the full config and exit")
    p.add_argument("--checkpoint-every", default=None,
                   help="checkpoint every N samples (20000) or seconds (60s)")
    p.add_argument("--distributed", action=argparse.BooleanOptionalAction, default=None,
                   help="one process per node over MPI (default: on when started by mpiexec "
                   "with more than one process: PMI_SIZE / OMPI_COMM_WORLD_SIZE > 1)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its last checkpoint")
    p.set_defaults(func=cmd_train)

    e = sub.add_parser("evaluate", help="metrics of a saved model on a dataset")
    e.add_argument("model_dir", type=user_path)
    e.add_argument("--data", type=user_path, required=True,
                   help="file, folder or name (its test split)")
    e.set_defaults(func=cmd_evaluate)

    r = sub.add_parser("predict", help="top-k labels and scores per row")
    r.add_argument("model_dir", type=user_path)
    r.add_argument("--data", type=user_path, required=True)
    r.add_argument("--top-k", type=positive_int, default=5,
                   help="labels per row (default 5; above the model's label count: all labels)")
    r.add_argument("--out", required=True, help="output file: one line per row, "
                   "'label:score label:score ...'")
    r.set_defaults(func=cmd_predict)

    g = sub.add_parser("plot", help="P@k against training time and epochs for run folders")
    g.add_argument("run_dirs", nargs="+")
    g.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curves.png)")
    g.add_argument("--metric", action="append", default=None, help="metric(s), default P@1")
    g.set_defaults(func=cmd_plot)


def config_from_args(args) -> TrainConfig:
    """Defaults < ``--config`` file < explicit options (the main job, on the built-in synthetic
    dataset, runs on the defaults alone)."""
    base = read_config_file(args.config) if args.config else {}
    for field in _CONFIG_OPTIONS:
        value = getattr(args, field, None)
        if value is not None:
            base[field] = value
    if args.algo_param:
        params = dict(base.get("algorithm_params", {}))
        params.update(dict(args.algo_param))
        base["algorithm_params"] = params
    if base.get("epochs") is not None and float(base["epochs"]).is_integer():
        base["epochs"] = int(base["epochs"])
    return TrainConfig.from_dict(base, source="command line")


def read_config_file(path) -> dict:
    """The JSON object in config file ``path``, checked by :class:`TrainConfig`; refuses NaN,
    infinities and numbers too large for a float, which JSON readers otherwise let through.

    Raises
    ------
    ConfigError
        Missing or unreadable file, invalid JSON, a non-finite number, or a config
        :class:`TrainConfig` refuses; the message names the file.
    """
    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"{text} is not a finite number")
        return value

    def no_constant(name: str):
        raise ValueError(f"{name} is not a number JSON allows; use a finite number")

    path = Path(path)
    try:
        d = json.loads(path.read_text(), parse_float=finite, parse_constant=no_constant)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config {path} line {exc.lineno}: invalid JSON ({exc.msg})") from None
    except (ValueError, OSError) as exc:  # non-finite number, a folder, unreadable, not UTF-8
        raise ConfigError(f"--config {path}: {exc}") from None
    return TrainConfig.from_dict(d, source=str(path)).to_dict()


def _load_data(data, test):
    from xmc_engine.datasets import load_dataset, load_xc

    Xtr, Ytr, Xte, Yte = load_dataset(data)
    if test is not None:
        Xte, Yte = load_xc(test)
    return Xtr, Ytr, Xte, Yte


def check_training_data(data, test, Xtr, Ytr, Xte, Yte) -> None:
    """Refuse data that cannot train a model, or a test set of another shape, naming the files.

    Zero rows, features or labels are refused; a training set in which no row has a label
    trains (the model can learn nothing) with a warning. Tiny sets (1 or 2 rows) train; the
    metrics they cannot support are left out at evaluation.

    Raises
    ------
    ConfigError
        ``--data`` has no rows, no features or no labels.
    DataMismatchError
        The test set has another number of features or labels than the training data.
    """
    n, d = Xtr.shape
    if n == 0 or d == 0 or Ytr.shape[1] == 0:
        raise ConfigError(f"--data {data}: {n} rows, {d} features, {Ytr.shape[1]} labels; "
                          "training needs at least one of each")
    if Ytr.nnz == 0:
        print(f"warning: --data {data}: no training row has a label; the model learns nothing",
              file=sys.stderr)
    if Xte is None:
        return
    if Xte.shape[1] != d or Yte.shape[1] != Ytr.shape[1]:
        where = f"--test {test}" if test else f"the test split of {data}"
        raise DataMismatchError(
            f"{where} has {Xte.shape[1]} features and {Yte.shape[1]} labels, --data {data} has "
            f"{d} features and {Ytr.shape[1]} labels; give a test set of the same data set")


def _read_run_file(run_dir: Path):
    """``(config, data, test, checkpoint_every)`` of the run in ``run_dir``."""
    path = run_dir / RUN_FILE
    try:
        run = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc.msg}); this run cannot be resumed") from None
    if not isinstance(run, dict) or not isinstance(run.get("data"), str):
        raise ConfigError(f"{path}: not a run file (no 'data' entry); this run cannot be resumed")
    cfg = TrainConfig.from_saved(run.get("config"), source=str(path))
    return cfg, run["data"], run.get("test"), run.get("checkpoint_every")


def _stopped_before_training(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` stopped before it recorded any training: no log, or a log
    with nothing but its set-up records (``start``, the loss probe, compiling, thread
    calibration)."""
    from xmc_engine.runlog import read_log

    if not (run_dir / LOG_NAME).exists():
        return True
    return all(r.get("event") in ("start", "loss_probe", "compile", "threads")
               for r in read_log(run_dir))


def cmd_train(args) -> int:
    from xmc_engine import distributed

    # Under mpiexec (launcher environment detected, or --distributed) one process per node.
    comm = distributed.init(args.distributed)
    if comm.size == 1:
        return _cmd_train(args, comm)
    try:
        return _cmd_train(args, comm)
    except (Exception, KeyboardInterrupt) as exc:  # one rank failing stops all, with a message
        comm.fail(exc)


def _cmd_train(args, comm) -> int:
    from xmc_engine.runlock import RunLock

    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / RUN_FILE).is_file():
            raise ConfigError(f"--resume {run_dir}: not a run folder (no {RUN_FILE}); give the "
                              "--out folder of an earlier 'xmc-engine train'")
        cfg = None
    else:
        cfg = config_from_args(args)
        if args.print_config:
            print(cfg.to_json())
            return 0
        run_dir = Path(args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        if comm.size > 1:  # rank 0's folder for every rank
            run_dir = Path(comm.broadcast_bytes(str(run_dir).encode()).decode())
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"--out {run_dir}: exists and is not a folder; choose a folder")
    # One run per folder: rank 0 holds the lock from before the first byte is written.
    with RunLock(run_dir) if comm.is_root else contextlib.nullcontext():
        return _train_in(run_dir, cfg, args, comm)


def _train_in(run_dir: Path, cfg, args, comm) -> int:
    from xmc_engine.checkpoint import CheckpointManager
    from xmc_engine.estimator import XMCClassifier
    from xmc_engine.validation import parse_every

    say = print if comm.is_root else (lambda *a, **k: None)  # rank 0 alone reports
    run_file = run_dir / RUN_FILE
    if args.resume:
        cfg, data, test, every = _read_run_file(run_dir)
    else:
        data, test, every = args.data or "synthetic", args.test, args.checkpoint_every
        if comm.is_root and (run_file.exists() or (run_dir / LOG_NAME).exists()):
            raise ConfigError(f"--out {run_dir} already holds a run; continue it with --resume "
                              f"{run_dir}, or choose another --out")
    parse_every(every)  # a bad --checkpoint-every stops here, before any data is read
    say(f"data: {data}" + (f"  test: {test}" if test else ""), file=sys.stderr)
    t0 = time.perf_counter()
    Xtr, Ytr, Xte, Yte = (_load_data(data, test) if comm.size == 1
                          else _load_shard(data, test, comm))
    say(f"loaded {Xtr.shape[0]} x {Xtr.shape[1]} features, {Ytr.shape[1]} labels "
        f"in {time.perf_counter() - t0:.1f} s"
        + (f" (rank 0's share of {comm.size})" if comm.size > 1 else ""), file=sys.stderr)
    if comm.is_root:
        check_training_data(data, test, Xtr, Ytr, Xte, Yte)
    if comm.is_root and not args.resume:
        _write_json(run_file, {"config": cfg.to_dict(), "data": data, "test": test,
                               "checkpoint_every": every})
    model = XMCClassifier.from_config(cfg, log_dir=str(run_dir), checkpoint_every=every)
    try:
        model.fit(Xtr, Ytr, eval_set=(Xte, Yte) if Xte is not None else None,
                  resume=bool(args.resume))
    except XMCError:
        if not args.resume and comm.is_root and _stopped_before_training(run_dir):
            from xmc_engine.training import MEMBER_DIR

            for name in (RUN_FILE, LOG_NAME):  # refused (a bad option): leave no run behind
                (run_dir / name).unlink(missing_ok=True)
            member = run_dir / MEMBER_DIR.format(0)  # an ensemble's first member's folder
            if member.is_dir() and _stopped_before_training(member):
                (member / LOG_NAME).unlink(missing_ok=True)
                if not any(member.iterdir()):
                    member.rmdir()
        raise
    if not comm.is_root:
        return 0
    try:
        model_dir = model.save(run_dir / "model")
    except OSError as exc:
        paths = CheckpointManager(run_dir).paths()
        where = (f"the last good checkpoint is {paths[0]}; free some space, then run "
                 f"'xmc-engine train --resume {run_dir}'" if paths
                 else "no checkpoint was written (--checkpoint-every keeps one)")
        raise SaveError(f"could not write the model to {run_dir / 'model'} "
                        f"({exc.strerror or exc}); {where}") from None
    plot = None
    try:
        from xmc_engine.plots import plot_runs
        from xmc_engine.training import MEMBER_DIR

        # an ensemble's curves are its members', and its own log the combination's point (at
        # the members' summed training time)
        runs = ([run_dir / MEMBER_DIR.format(j) for j in range(model.ensemble)] + [run_dir]
                if model.ensemble > 1 else [run_dir])
        plot = plot_runs(runs, run_dir / "curves.png")
    except Exception as exc:  # noqa: BLE001 - a missing plot must not lose a trained model
        print(f"warning: could not draw the plot: {exc}", file=sys.stderr)
    m = model.metrics_ or {}
    final = next((r for r in reversed(model.history_) if r.get("event") == "final"), {})
    if m:
        print("  ".join(f"{k} {m[k]:.4f}" for k in ("P@1", "P@3", "P@5", "nDCG@5", "PSP@5")
                        if k in m))
    print(f"train time {final.get('train_time', float('nan')):.1f} s" + _ended_early(model, final))
    line = _compile_line(model.history_)
    if line:
        print(line)
    probe = next((r for r in model.history_ if r.get("event") == "loss_probe"), None)
    if probe is not None:
        print(_probe_line(model.loss_, probe))
    start = next((r for r in model.history_ if r.get("event") == "start"), None)
    if start is not None:
        print("rate:  " + _rate_line(start))
    line = _solo_line(model.history_)
    if line:
        print(line)
    ens = next((r for r in model.history_ if r.get("event") == "ensemble"), None)
    if ens is not None:
        each = ", ".join(f"{m['P@1']:.4f}" for m in ens["member_metrics"] if m)
        lanes = ens.get("lanes", 1)
        print(f"ensemble: {ens['members']} networks combined into one of hidden "
              f"{','.join(map(str, ens['hidden']))}"
              + (f", trained {lanes} at a time" if lanes > 1 else "")
              + (f"; each alone P@1 {each}" if each else ""))
    back = [r for r in model.history_
            if r.get("event") == "plateau" and r.get("back_to") is not None]
    if back:
        print("back:  " + "; ".join(f"after epoch {r['epoch']} training went on from epoch "
                                    f"{r['back_to']}'s model ({r['z']:.1f} standard errors "
                                    f"ahead)" for r in back)
              + " (--no-back-to-best goes on from the last)")
    print(_neighbours_line(cfg, model, probe))
    kept = next((r for r in model.history_ if r.get("event") == "keep_best"), None)
    if kept is not None and kept["restored"]:
        print(f"kept:  epoch {kept['best_epoch']}'s model (held-out P@1 {kept['best_p1']:.4f}; the "
              f"last epoch's {kept['heldout_p1']:.4f}, {kept['z']:.1f} standard errors behind; "
              f"--no-keep-best keeps the last)")
    print(f"log:   {run_dir / LOG_NAME}")
    print(f"model: {model_dir}")
    if plot:
        print(f"plot:  {plot}")
    return 0


def _neighbours_line(cfg, model, probe: dict | None) -> str:
    """The summary's ``votes:`` line: what the neighbour votes did (the run log's
    ``neighbours`` record), or why there were none."""
    from xmc_engine.config import NEIGHBOURS_K

    record = next((r for r in model.history_ if r.get("event") == "neighbours"), None)
    if record is None:
        k, why = cfg.neighbours_decision(model.n_train_, model.loss_,
                                         None if probe is None else probe.get("z"))
        if k > 0:  # neighbours_for said yes, but the fit kept no rows: several processes
            return ("votes: off (each of the run's processes held only its own training rows); "
                    "predictions are the network's")
        return (f"votes: off ({'auto: ' + why + '; ' if cfg.neighbours == 'auto' else ''}"
                f"--neighbours {NEIGHBOURS_K} has the training rows vote with the network)")
    line = (f"votes: the {record['k']} nearest of {record['rows']:,} training rows vote with "
            f"the network" + (f" (auto: {record['why']})" if cfg.neighbours == "auto" else ""))
    network, blend = record.get("network") or {}, record.get("metrics") or {}
    if "P@1" in network and "P@1" in blend:
        line += (f": P@1 / P@5 {blend['P@1']:.4f} / {blend.get('P@5', float('nan')):.4f}, "
                 f"the network alone {network['P@1']:.4f} / "
                 f"{network.get('P@5', float('nan')):.4f}")
    return line + "; --neighbours 0 predicts with the network alone"


def _probe_line(loss: str, probe: dict) -> str:
    """The summary's ``loss:`` line: the ``loss`` trained and what ``loss="auto"``'s probe (its
    run-log record) saw."""
    seen = ", ".join(f"{k} {v:.4f}" for k, v in probe["p1"].items())
    went_on = probe.get("continued")
    needs = probe.get("margin")
    if needs is None:  # a log written before the record had its margin
        needs = LOSS_PROBE_SOFTMAX_Z
    margin = (f", the softmax {probe['z']:+.1f} standard errors (it needs "
              f"+{needs:g})" if probe.get("z") is not None else "")
    first = probe.get("first_look")
    again = (f" after a second look (the first, after {first['rows']:,} rows: the softmax "
             f"{first['z']:+.1f})" if first else "")
    return (f"loss:  {loss} (auto: " + (f"held-out P@1: {seen}{margin}{again} after "
            f"{probe['seconds']:.1f} s of probing" if seen else "too few rows to probe")
            + (f"; training went on from the {loss} fit's {went_on['samples']:,} "
               f"samples" if went_on else "")
            + "; --loss softmax|bce skips the probe)")


def _compile_line(history) -> str | None:
    """The summary's line on compiling, where the run compiled kernels (a first run after an
    install, or after an edit of the kernels); ``None`` where every kernel came from Numba's
    cache."""
    compiles = [r for r in history if r.get("event") == "compile"]
    compiled = sum(r.get("compiled", 0) for r in compiles)
    if not compiled:
        return None
    return (f"compile: {sum(r['seconds'] for r in compiles):.1f} s ({compiled} Numba "
            f"compilations, outside the train time; later runs load them from Numba's cache)")


def _load_shard(data, test, comm):
    """This rank's rows of the training data (XC files: only those rows are read) and, on rank 0
    only, the test set (DESIGN.md §6)."""
    import logging

    from xmc_engine.datasets import load_dataset, load_file, load_xc, resolve, shard_range
    from xmc_engine.datasets.registry import header_counts
    from xmc_engine.datasets.shard import load_xc_shard

    try:
        train, test_path = resolve(data)
    except XMCError:  # generated (synthetic): every rank makes it and keeps its own rows
        Xtr, Ytr, Xte, Yte = load_dataset(data)
        a, b = shard_range(Xtr.shape[0], comm.rank, comm.size)
        return Xtr[a:b], Ytr[a:b], *((Xte, Yte) if comm.is_root else (None, None))
    if header_counts(train) is not None:
        Xtr, Ytr, _, _ = load_xc_shard(train, comm.rank, comm.size)
    else:  # LIBSVM / npz have no row count up front: read the file, keep this rank's rows
        logging.getLogger(__name__).warning("%s is not XC text: every rank reads all of it",
                                            train)
        Xtr, Ytr = load_file(train)
        a, b = shard_range(Xtr.shape[0], comm.rank, comm.size)
        Xtr, Ytr = Xtr[a:b], Ytr[a:b]
    Xte = Yte = None
    if comm.is_root and (test or test_path):
        Xte, Yte = load_xc(test) if test else load_file(test_path)
    return Xtr, Ytr, Xte, Yte


def _load_for_model(model, data: str, rows: str):
    """``(X, Y)`` of ``data`` for a saved ``model``: its test split, or the file itself when it
    has none; refused when empty or of another shape than the model."""
    from xmc_engine.datasets import load_dataset

    Xtr, Ytr, Xte, Yte = load_dataset(data)
    X, Y = (Xte, Yte) if Xte is not None else (Xtr, Ytr)
    if X.shape[1] != model.n_features_ or Y.shape[1] > model.n_labels_:
        raise DataMismatchError(
            f"--data {data}: {rows} has {X.shape[1]} features and {Y.shape[1]} labels, the model "
            f"was trained on {model.n_features_} features and {model.n_labels_} labels; give "
            "data of the data set the model was trained on")
    if X.shape[0] == 0:
        raise ConfigError(f"--data {data}: {rows} has no rows")
    if Y.shape[1] < model.n_labels_:  # LIBSVM: the width comes from the largest label seen
        Y = Y.tocsr(copy=True)
        Y.resize((Y.shape[0], model.n_labels_))
    return X, Y


def cmd_evaluate(args) -> int:
    from xmc_engine.estimator import XMCClassifier

    model = XMCClassifier.load(args.model_dir)
    X, Y = _load_for_model(model, args.data, "the evaluation set")
    for k, v in model.evaluate(X, Y).items():
        print(f"{k:10s} {v:.4f}")
    return 0


def cmd_predict(args) -> int:
    from xmc_engine.estimator import XMCClassifier

    out = Path(args.out)
    if not out.parent.is_dir() or out.is_dir():
        raise ConfigError(f"--out {out}: " + ("is a folder; give a file name" if out.is_dir()
                                              else f"folder {out.parent} does not exist"))
    model = XMCClassifier.load(args.model_dir)
    X, _ = _load_for_model(model, args.data, "the data")
    k = args.top_k
    if k > model.n_labels_:
        print(f"note: --top-k {k} is more than the model's {model.n_labels_} labels; writing all "
              f"{model.n_labels_} per row", file=sys.stderr)
        k = model.n_labels_
    labels, scores = model.predict_topk(X, k)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            for lab, sc in zip(labels, scores, strict=True):
                f.write(" ".join(f"{a}:{b:.6g}" for a, b in zip(lab, sc, strict=True)) + "\n")
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SaveError(f"could not write {out} ({exc.strerror or exc}); nothing was written") \
            from None
    print(f"wrote top-{k} for {len(labels)} rows to {out}")
    return 0


def cmd_plot(args) -> int:
    from xmc_engine.plots import plot_runs
    from xmc_engine.runlog import log_path, read_log

    for run in args.run_dirs:
        if not log_path(run).is_file():
            raise ConfigError(f"{run}: no {log_path(run).name} here; give a run folder")
        try:
            read_log(run)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    out = args.out or str(Path(args.run_dirs[0]) / "curves.png")
    if Path(out).is_dir():
        raise ConfigError(f"--out {out}: is a folder; give a .png file name")
    metrics = tuple(args.metric or ["P@1"])
    try:
        path = plot_runs(args.run_dirs, out, metrics=metrics)
    except ValueError as exc:  # documented: no run has a point of these metrics
        raise ConfigError(f"{exc}; check --metric (names as in log.jsonl: P@1, nDCG@5, ...)") \
            from None
    print(f"plot: {path}")
    return 0


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)
