"""The benchmark that chooses :class:`~xmc_engine.config.TrainConfig`'s defaults: a staged grid
over optimizer, learning rate, batch size and hidden width on every shared dataset and on
synthetic power-law shapes, and the defaults themselves beside the grid's best.

Stages, per dataset (one process, one thread per run, so that runs do not compete):

1. **optimizer x lr** at batch 256 and hidden 128: plain SGD at :data:`SGD_LRS`, Adagrad at
   :data:`ADAGRAD_LRS`.
2. **batch x hidden** (:data:`BATCHES` x :data:`HIDDENS`) at the stage-1 winner's optimizer and
   learning rate, and the same shapes at the best Adagrad learning rate when the winner is SGD.
3. **defaults**: ``XMCClassifier(epochs=E, seed=s, threads=1)``, nothing else set, i.e. exactly
   what a user gets.

Every run trains ``max(--epochs)`` epochs with an evaluation every ``min(--epochs)`` epochs;
the learning-rate schedule depends on the epochs reached, not on the run's length (the decay
``lr / (1 + λ e)`` over whole epochs; no warm-up on one device), so the run up to epoch 5 is the
5-epoch run, the evaluation at epoch 5 of a 15-epoch run is the 5-epoch figure, and its
``train_time`` the 5-epoch training time. The grid runs take the optimizer's default decay
(committed grid runs: before the default decay, i.e. without one); ``--decay-study`` grids it.
Datasets in ``--heavy`` run the lowest epoch count only, with the first seed, and a reduced
stage 2 (``--heavy-shapes``).

Results (every run, its curve and the tables) go to ``--out`` (``bench/results/defaults.json``)
through :func:`_common.write_result`, rewritten after every dataset; ``--resume`` reuses the
grid runs already in it and in ``--previous`` files (same dataset, configuration, seed and
epochs) and trains the defaults and napkinXC PLT (``--napkinxc`` datasets) afresh. The committed
runs (each then repeated with ``--resume`` once the defaults were fixed)::

    python bench/bench_defaults.py --datasets bibtex delicious
    python bench/bench_defaults.py --datasets debian_debtags corel5k stackex_cooking \
        stackex_cs rcv1sub1 synth1k imdb --epochs 5 --out bench/results/defaults_5ep.json
    python bench/bench_defaults.py --datasets debian_builddeps synth10k \
        --out bench/results/defaults_heavy.json
    python bench/bench_defaults.py --warmup-study --out bench/results/defaults_warmup.json

and the grid again with the defaults of ``loss="auto"``, both losses in stage 1, Adagrad only
(SGD's best lost to Adagrad's on every set of the first grid), the small shared sets::

    python bench/bench_defaults.py --grid-optimizers adagrad --grid-losses softmax bce \
        --datasets bibtex delicious corel5k stackex_cooking stackex_cs rcv1sub1 imdb \
        debian_debtags --out bench/results/defaults_grid_auto.json

again with the neighbour votes (``--out bench/results/defaults_grid_votes.json``, and with
``--epochs 5``: ``defaults_grid_votes_5ep.json``). After the network-alone table at each epoch
count a second one scores the last epoch as the models predict, the votes included where a
run kept its training rows (every run of the logistic loss, the defaults among them).
``--tables`` prints the tables of an ``--out`` file again without training::

    python bench/bench_defaults.py --tables --out bench/results/defaults_grid_votes.json

    python bench/bench_defaults.py --normalize-study --datasets bibtex delicious corel5k \
        stackex_cooking stackex_cs rcv1sub1 imdb debian_debtags debian_builddeps synth1k \
        --out bench/results/defaults_normalize.json
    python bench/bench_defaults.py --width-study --datasets bibtex delicious corel5k \
        stackex_cooking stackex_cs rcv1sub1 imdb debian_debtags synth1k \
        --out bench/results/defaults_width.json
    python bench/bench_defaults.py --lr-probe-study --epochs 5 --datasets bibtex delicious \
        corel5k stackex_cooking stackex_cs rcv1sub1 imdb debian_debtags debian_builddeps \
        synth1k --out bench/results/defaults_lr_probe.json
    python bench/bench_defaults.py --loss-study --epochs 5 10 --datasets bibtex delicious \
        corel5k stackex_cooking stackex_cs rcv1sub1 imdb debian_debtags debian_builddeps \
        synth1k synth10k --out bench/results/defaults_loss.json
    python bench/bench_defaults.py --loss-auto-study --epochs 5 10 --datasets bibtex \
        delicious corel5k stackex_cooking stackex_cs rcv1sub1 imdb debian_debtags \
        debian_builddeps synth1k synth10k --out bench/results/defaults_loss_auto.json
    python bench/bench_defaults.py --schedule-study --schedules 0.5 plateau --held-rows 0.5 \
        --epochs 5 --datasets corel5k bibtex stackex_cooking stackex_cs rcv1sub1 delicious \
        imdb debian_debtags synth1k debian_builddeps synth10k --heavy synth10k \
        --out bench/results/defaults_schedule_held.json

The synthetic shapes come from :func:`xmc_engine.datasets.make_synthetic` (power-law label
popularity, exponent 0.9): ``synth1k`` 10,000 train / 2,500 test rows, 5,000 features, 1,000
labels; ``synth10k`` 30,000 / 5,000 rows, 20,000 features, 10,000 labels; ``synth100k``
(not in the default list) 60,000 / 5,000 rows, 50,000 features, 100,000 labels.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

REAL = ("bibtex", "delicious", "corel5k", "stackex_cooking", "stackex_cs", "rcv1sub1", "imdb",
        "debian_debtags", "debian_builddeps")
#: name -> make_synthetic sizes (n_train, n_test, n_features, n_labels).
SYNTHETIC = {"synth1k": (10_000, 2_500, 5_000, 1_000),
             "synth10k": (30_000, 5_000, 20_000, 10_000),
             "synth100k": (60_000, 5_000, 50_000, 100_000)}
SGD_LRS = (0.25, 0.5, 1.0, 2.0, 4.0)
ADAGRAD_LRS = (0.01, 0.02, 0.05, 0.1, 0.2)
BASE_BATCH, BASE_HIDDEN = 256, 128
BATCHES = (64, 128, 256)
HIDDENS = (128, 256, 512)


def parse_args(argv=None) -> argparse.Namespace:
    from xmc_engine.cli.argtypes import lr_decay as lr_decay_arg  # the CLI's --lr-decay values

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=[*REAL, "synth1k", "synth10k"],
                   help="shared datasets and synthetic shapes (synth1k, synth10k, synth100k)")
    p.add_argument("--epochs", type=int, nargs="+", default=[5, 15],
                   help="epoch counts reported (one run per configuration evaluated at each)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--heavy", nargs="*", default=["debian_builddeps", "synth10k", "synth100k"],
                   help="datasets run at the lowest epoch count, first seed, fewer shapes")
    p.add_argument("--heavy-shapes", default="128x128,128x256",
                   help="stage-2 BATCHxHIDDEN shapes of a heavy dataset")
    p.add_argument("--heavy-lrs", default="sgd:1,adagrad:0.02,adagrad:0.05,adagrad:0.1",
                   help="stage-1 OPTIMIZER:LR points of a heavy dataset")
    p.add_argument("--max-train", type=int, default=30_000,
                   help="subsample larger training sets to this many rows (imdb: 96,735)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--grid-optimizers", nargs="+", choices=("sgd", "adagrad"),
                   default=["sgd", "adagrad"], help="stage 1's optimizers")
    p.add_argument("--grid-losses", nargs="*", choices=("softmax", "bce"), default=[],
                   help="stage 1 at each of these losses (none: the engine's default loss, "
                        "in the committed grids before loss='auto' the softmax)")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "defaults.json"))
    p.add_argument("--resume", action="store_true",
                   help="reuse the grid runs (not the defaults' runs) already in --out and "
                   "--previous instead of training them again")
    p.add_argument("--tables", action="store_true",
                   help="print the tables of the results already in --out, training nothing")
    p.add_argument("--previous", nargs="*", default=[],
                   help="more result files of this script whose runs --resume reuses")
    p.add_argument("--napkinxc", nargs="*",
                   default=["bibtex", "delicious", "debian_debtags", "debian_builddeps"],
                   help="datasets on which napkinXC PLT (library defaults) runs beside the grid")
    d = p.add_argument_group("decay study (--decay-study: instead of the grid)")
    d.add_argument("--decay-study", action="store_true",
                   help="the default optimizer at each --decay-lrs x --decays (the defaults "
                   "otherwise) on --datasets, evaluated at each --epochs")
    d.add_argument("--decay-lrs", type=float, nargs="+", default=[0.02, 0.05, 0.1])
    d.add_argument("--decays", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0])
    d.add_argument("--decay-loss", choices=("softmax", "bce", "auto"),
                   help="the training loss of every configuration (default: the engine's)")
    t = p.add_argument_group("schedule study (--schedule-study: instead of the grid)")
    t.add_argument("--schedule-study", action="store_true",
                   help="the defaults with each --schedules learning-rate decay (a number, "
                   "plateau or auto) on --datasets, evaluated at each --epochs")
    t.add_argument("--schedules", nargs="+", type=lr_decay_arg, default=[0.5, "plateau"],
                   help="lr_decay values (default: the fixed decay 0.5 and plateau)")
    t.add_argument("--held-rows", type=lr_decay_arg, nargs="*", default=[],
                   help="also train each of these fixed decays on the rows the plateau rule "
                   "keeps (its held-out rows left out, nothing evaluated on them): what holding "
                   "rows out costs, apart from the schedule")
    p.add_argument("--normalize-study", action="store_true",
                   help="instead of the grid: the defaults with each feature-row normalisation "
                   "on --datasets, evaluated at each --epochs")
    h = p.add_argument_group("width study (--width-study: instead of the grid)")
    h.add_argument("--width-study", action="store_true",
                   help="the defaults at each --widths hidden width on --datasets, evaluated "
                   "at each --epochs")
    h.add_argument("--widths", type=int, nargs="+", default=list(HIDDENS))
    b = p.add_argument_group("batch study (--batch-study: instead of the grid)")
    b.add_argument("--batch-study", action="store_true",
                   help="the defaults at each --batches batch size on --datasets, evaluated "
                   "at each --epochs")
    b.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    q = p.add_argument_group("learning-rate probe study (--lr-probe-study: instead of the grid)")
    q.add_argument("--lr-probe-study", action="store_true",
                   help="would a short probe pick the learning rate better than the default? "
                   "(issue 14's lr='auto'; see lr_probe_study)")
    q.add_argument("--probe-lrs", type=float, nargs="+", default=[0.02, 0.05, 0.1])
    q.add_argument("--probe-epochs", type=int, nargs="+", default=[1, 2],
                   help="probe lengths in epochs (the full length is always reported too)")
    q.add_argument("--validation", type=float, default=0.1,
                   help="share of the training rows held out for the probe's choice")
    s = p.add_argument_group("loss study (--loss-study: instead of the grid)")
    s.add_argument("--loss-study", action="store_true",
                   help="the defaults with each training loss (TrainConfig.loss) at each of "
                   "--loss-lrs")
    s.add_argument("--loss-lrs", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    s.add_argument("--loss-auto-study", action="store_true",
                   help="the defaults with loss softmax, bce and auto (the probe), each loss "
                   "at its own default learning rate")
    w = p.add_argument_group("warm-up study (--warmup-study: instead of the grid)")
    w.add_argument("--warmup-study", action="store_true")
    w.add_argument("--warmups", type=float, nargs="+", default=[0.0, 0.05, 0.25, 1.0])
    w.add_argument("--warmup-datasets", nargs="+", default=["delicious", "debian_debtags"])
    w.add_argument("--warmup-devices", default="cpu,cpu@0.5")
    w.add_argument("--warmup-seeds", type=int, nargs="+", default=[0, 1, 2])
    w.add_argument("--warmup-epochs", type=float, default=3.0)
    w.add_argument("--warmup-eval-every", type=float, default=0.125)
    return p.parse_args(argv)


def load(name: str, max_train: int):
    """``(X, Y, X_test, Y_test, note)``: a shared dataset or a synthetic shape, the training
    rows subsampled (seeded, without replacement) to ``max_train``."""
    if name in SYNTHETIC:
        from xmc_engine.datasets import make_synthetic

        n_train, n_test, n_features, n_labels = SYNTHETIC[name]
        X, Y, Xt, Yt = make_synthetic(n_train=n_train, n_test=n_test, n_features=n_features,
                                      n_labels=n_labels, seed=0)
    elif name in REAL:
        X, Y, Xt, Yt = _common.load_dataset(name)
    else:
        raise SystemExit(f"unknown dataset {name!r}; choose from {', '.join(REAL)}, "
                         f"{', '.join(SYNTHETIC)}")
    note = ""
    if X.shape[0] > max_train:
        keep = np.sort(np.random.default_rng(0).choice(X.shape[0], max_train, replace=False))
        note = f"training rows subsampled {X.shape[0]} -> {max_train} (seed 0)"
        X, Y = X[keep], Y[keep]
    return X, Y, Xt, Yt, note


def load_any(name: str):
    """``(X, Y, X_test, Y_test)`` of any dataset name a benchmark takes, every training row:
    the shapes and shared sets of this module through :func:`load`, anything else (a
    ``synthetic:N_TRAIN:N_FEATURES:N_LABELS`` shape, a registered name, a path) through
    :func:`_tta.load_data`."""
    if name in SYNTHETIC or name in REAL:
        return load(name, max_train=sys.maxsize)[:4]
    import _tta

    return _tta.load_data(name)


def datasets_present(names, max_train: int):
    """``(name, X, Y, X_test, Y_test, note)`` of each of ``names`` (:func:`load`), a line saying
    so in place of each that is not here (a shared dataset absent from this machine)."""
    for name in names:
        try:
            yield (name, *load(name, max_train))
        except _common.SkipBenchmark as e:
            print(f"SKIP {name}: {e}")


def run_one(data, config: dict, seed: int, epochs: list[int], threads: int | None) -> dict:
    """Train ``config`` (``XMCClassifier`` keywords; empty: the defaults) once for
    ``max(epochs)`` epochs; returns the metrics and training time at each of ``epochs`` (the
    network's; at the last, ``"neighbours"``: the P@k of the model's predictions where the
    training rows vote, ``TrainConfig.neighbours``), and what the engine resolved (optimizer,
    lr, batch, hidden, output layer, threads: ``threads`` ``None`` lets it calibrate them)."""
    from xmc_engine import XMCClassifier

    X, Y, Xt, Yt = data
    given, config = config, dict(config)
    if config.get("ensemble", 1) > 1:  # its eval records are its members', one after another
        raise SystemExit("bench_defaults.run_one reads the eval record of each epoch, and an "
                         "ensemble's are its members': score ensembles with "
                         "bench/bench_ensemble.py")
    if config.pop("rows", None) == "plateau":  # the rows lr_decay="plateau" trains on
        from xmc_engine.training import hold_out

        X, Y, _ = hold_out(X, Y, seed)
    clf = XMCClassifier(**config, epochs=max(epochs), eval_every=min(epochs), seed=seed,
                        threads=threads)
    t0 = time.perf_counter()
    clf.fit(X, Y, eval_set=(Xt, Yt))
    wall = time.perf_counter() - t0
    start = next(r for r in clf.history_ if r["event"] == "start")
    resolved = {k: start["config"][k] for k in ("optimizer", "batch_size", "hidden")}
    calibrated = [r["threads"] for r in clf.history_ if r["event"] == "threads"]
    resolved.update(output=start["output"], threads=calibrated[0] if calibrated else threads)
    # loss="auto"'s probe, its seconds outside train_time (the fit the run went on from is
    # inside): they go with each entry
    probe_s = _common.probe_seconds(clf.history_)
    at = {}
    for r in clf.history_:
        if r["event"] == "eval" and round(r["epoch"]) in epochs:
            at[str(round(r["epoch"]))] = {**{k: r["metrics"][k] for k in ("P@1", "P@3", "P@5")},
                                          "train_time": r["train_time"], "probe_s": probe_s}
    compile_s = _common.event_seconds(clf.history_, "compile")
    # with the neighbour votes (TrainConfig.neighbours) the fitted model predicts the blend,
    # scored once after training; the eval records above are the network's alone
    votes = next((r for r in clf.history_ if r["event"] == "neighbours"), None)
    if votes is not None and votes.get("metrics"):
        at[str(max(epochs))]["neighbours"] = {k: votes["metrics"][k]
                                              for k in ("P@1", "P@3", "P@5")}
    resolved["loss"] = start.get("loss", config.get("loss"))
    resolved["n_train"] = X.shape[0]
    resolved["lr_decay"] = start.get("lr_decay")
    return {"config": given, "seed": seed, "resolved": {**resolved, "lr": start["lr"]},
            "at": at, "wall_s": wall, "compile_s": compile_s}


def _key(dataset, config, seed, epochs) -> tuple:
    return (dataset, tuple(sorted((k, str(v)) for k, v in config.items())), seed,
            tuple(epochs))


class Grid:
    """The runs of one dataset, trained on demand or taken from a previous result file."""

    def __init__(self, name, data, epochs, seeds, threads, previous, rows):
        self.name, self.data, self.epochs, self.seeds = name, data, epochs, seeds
        self.threads, self.previous, self.rows = threads, previous, rows

    def run(self, config: dict, stage: str) -> list[dict]:
        out = []
        for seed in self.seeds:
            key = _key(self.name, config, seed, self.epochs)
            row = self.previous.get(key) if config else self._same_as_defaults(seed)
            if row is None:
                row = run_one(self.data, config, seed, self.epochs, self.threads)
                row.update(dataset=self.name, epochs=self.epochs)
            row["stage"] = stage
            self.rows.append(row)
            out.append(row)
            e = str(min(self.epochs))
            print(f"  {stage:9s} {_label(config):28s} seed {seed}: P@1@{e} "
                  f"{row['at'][e]['P@1']:.4f} ({row['at'][e]['train_time']:.1f} s)", flush=True)
        return out

    def _same_as_defaults(self, seed: int) -> dict | None:
        """A copy of this grid's run of the defaults' configuration with ``seed``, if there is
        one: with one thread a run repeats exactly, so training it again would only cost."""
        from xmc_engine.config import TrainConfig

        d = TrainConfig()
        if len(d.hidden) != 1:
            return None
        same = _cfg(d.optimizer, d.learning_rate, d.batch_size, d.hidden[0])
        for r in self.rows:
            if r["dataset"] == self.name and r["config"] == same and r["seed"] == seed:
                return {**r, "config": {}, "same_as": _label(same)}
        return None

    def score(self, runs, epochs: int) -> float:
        return float(np.mean([r["at"][str(epochs)]["P@1"] for r in runs]))


def _label(config: dict) -> str:
    if not config:
        return "defaults"
    loss = f" {config['loss']}" if "loss" in config else ""
    return (f"{config['optimizer']}{loss} lr={config['lr']:g} b={config['batch_size']} "
            f"h={config['hidden']}")


def _cfg(optimizer, lr, batch, hidden, loss=None) -> dict:
    """A grid configuration; ``loss`` None leaves the engine's default loss."""
    return {"optimizer": optimizer, "lr": lr, "batch_size": batch, "hidden": hidden,
            **({} if loss is None else {"loss": loss})}


def search(grid: Grid, points, shapes) -> None:
    """Stages 1-3 of the module docstring on ``grid``: ``points`` are the stage-1
    ``(optimizer, lr)`` or ``(optimizer, lr, loss)`` tuples, ``shapes`` the stage-2
    ``(batch, hidden)`` pairs (at the stage-1 winner, and at the best Adagrad point where the
    winner is another optimizer)."""
    e = min(grid.epochs)
    stage1 = {}
    for point in points:
        c = _cfg(point[0], point[1], BASE_BATCH, BASE_HIDDEN, *point[2:])
        stage1[tuple(point)] = grid.score(grid.run(c, "opt x lr"), e)
    best = max(stage1, key=stage1.get)
    centres = [best]
    if best[0] != "adagrad" and any(k[0] == "adagrad" for k in stage1):
        centres.append(max((k for k in stage1 if k[0] == "adagrad"), key=stage1.get))
    for point in centres:
        for batch, hidden in shapes:
            if (batch, hidden) != (BASE_BATCH, BASE_HIDDEN):
                grid.run(_cfg(point[0], point[1], batch, hidden, *point[2:]), "b x h")
    grid.run({}, "defaults")


def summarise(rows, dataset: str, epochs: int, predicted: bool = False) -> dict | None:
    """Best configuration (mean P@1 over seeds at ``epochs``) and the defaults' figures.
    ``predicted``: each run scored as its model predicts, the neighbour votes included where
    it kept its training rows (:func:`run_one`'s ``"neighbours"``, at a run's last epoch
    only; the network alone elsewhere)."""
    groups: dict[str, list] = {}
    for r in rows:
        if r["dataset"] == dataset and str(epochs) in r["at"]:
            groups.setdefault(_label(r["config"]), []).append(r)
    if "defaults" not in groups:
        return None

    def mean(runs, k):
        at = [r["at"][str(epochs)] for r in runs]
        return float(np.mean([(a.get("neighbours") or a)[k] if predicted and k != "train_time"
                              else a[k] for a in at]))

    stats = {lab: {k: mean(runs, k) for k in ("P@1", "P@3", "P@5", "train_time")}
             | {"seeds": len(runs)} for lab, runs in groups.items()}
    best = max((lab for lab in stats if lab != "defaults"), key=lambda lab: stats[lab]["P@1"])
    d = groups["defaults"][0]["resolved"]
    # what the defaults resolved to, per seed where it differs (loss="auto" picks per seed)
    per_seed = list(dict.fromkeys(
        (f"{r['resolved']['loss']} " if r["resolved"].get("loss") else "")
        + f"lr={r['resolved']['lr']:g}" for r in groups["defaults"]))
    return {"dataset": dataset, "epochs": epochs, "best": best, "best_stats": stats[best],
            "defaults": (f"{d['optimizer']} {' / '.join(per_seed)} b={d['batch_size']} "
                         f"h={d['hidden'][0]}"),
            "defaults_stats": stats["defaults"],
            "gap_P@1": stats[best]["P@1"] - stats["defaults"]["P@1"],
            "configs": len(stats) - 1}


def print_tables(rows, datasets, epochs: list, napkin: dict) -> None:
    """:func:`print_table` of the network alone at every epoch count, then at the last as the
    models predict (the neighbour votes included where a run kept its training rows)."""
    print_table([s for n in datasets for e in sorted(epochs)
                 if (s := summarise(rows, n, e)) is not None], napkin)
    last = [s for n in datasets if (s := summarise(rows, n, max(epochs), True)) is not None]
    print(f"\nat {max(epochs)} epochs as the models predict (the neighbour votes where a run "
          f"kept its training rows; the grid's best chosen by that P@1):")
    print_table(last, napkin)


def print_table(summary: list[dict], napkin: dict) -> None:
    """The Markdown table of ``bench/RESULTS.md``: per dataset and epoch count the grid's best
    configuration and the defaults (means over seeds), and napkinXC PLT where it ran."""
    print("\n| dataset | epochs | grid's best (configs) | P@1 / P@3 / P@5 | time s | defaults "
          "| P@1 / P@3 / P@5 | time s | best - defaults P@1 | napkinXC PLT P@1 / P@3 / P@5 "
          "(time s) | defaults / napkinXC P@1 |")
    print("|---|---:|---|---|---:|---|---|---:|---:|---|---:|")
    for s in summary:
        b, d = s["best_stats"], s["defaults_stats"]
        n = napkin.get(s["dataset"])
        nx = (f"{n['P@1']:.4f} / {n['P@3']:.4f} / {n['P@5']:.4f} ({n['train_time']:.1f}) "
              f"| {d['P@1'] / n['P@1']:.3f}" if n else "| ")
        print(f"| {s['dataset']} | {s['epochs']} | {s['best']} ({s['configs']}) "
              f"| {b['P@1']:.4f} / {b['P@3']:.4f} / {b['P@5']:.4f} | {b['train_time']:.1f} "
              f"| {s['defaults']} (seeds {d['seeds']}) "
              f"| {d['P@1']:.4f} / {d['P@3']:.4f} / {d['P@5']:.4f} "
              f"| {d['train_time']:.1f} | {s['gap_P@1']:+.4f} | {nx} |")


def decay_study(args, meta) -> int:
    """P@1 of the defaults' optimizer at each learning rate x learning-rate decay
    (``lr / (1 + decay x epoch)``), with ``--decay-loss`` if given, everything else at the
    defaults (:func:`config_study`)."""
    from xmc_engine.config import TrainConfig

    loss = {"loss": args.decay_loss} if args.decay_loss else {}
    d = TrainConfig(**loss)
    configs = [{**loss, "lr": lr, "lr_decay": dec} for lr in args.decay_lrs
               for dec in args.decays]
    return config_study(args, meta, configs, _decay_label,
                        _decay_label({"lr": d.learning_rate, "lr_decay": d.lr_decay_for(0)}),
                        "defaults_decay")


def schedule_study(args, meta) -> int:
    """The defaults with only ``lr_decay`` set, to each of ``--schedules``: the fixed decay
    against the held-out plateau rule (``lr_decay="plateau"``, which trains on the rows it does
    not hold out), :func:`config_study`. ``--held-rows``: fixed decays trained on the plateau
    rule's rows alone, which splits the rule's difference into the rows it holds out and the
    schedule itself."""
    configs = ([{"lr_decay": s} for s in args.schedules]
               + [{"lr_decay": s, "rows": "plateau"} for s in args.held_rows])
    return config_study(args, meta, configs, _schedule_label, "lr_decay=auto",
                        "defaults_schedule")


def _schedule_label(c: dict) -> str:
    return f"lr_decay={c['lr_decay']}" + (" (plateau's rows)" if c.get("rows") else "")


def normalize_study(args, meta) -> int:
    """The defaults with each feature-row normalisation (:func:`config_study`)."""
    from xmc_engine.config import NORMALIZE, TrainConfig

    configs = [{"normalize": how} for how in NORMALIZE]
    return config_study(args, meta, configs, _normalize_label,
                        _normalize_label({"normalize": TrainConfig().normalize}),
                        "defaults_normalize")


def loss_study(args, meta) -> int:
    """The defaults with each training loss at each learning rate of ``--loss-lrs``
    (:func:`config_study`)."""
    from xmc_engine.config import TRAIN_LOSSES, TrainConfig

    d = TrainConfig()
    configs = [{"loss": loss, "lr": lr} for loss in TRAIN_LOSSES for lr in args.loss_lrs]
    return config_study(args, meta, configs, _loss_label,
                        _loss_label({"loss": d.loss, "lr": d.learning_rate}), "defaults_loss")


def loss_auto_study(args, meta) -> int:
    """Each ``loss`` value (``softmax``, ``bce``, ``auto``: the probe of
    :func:`xmc_engine.training.choose_loss`) with everything else at the defaults, the
    learning rate included (each loss's own; :func:`config_study`). Prints which loss the
    probe chose per dataset and seed."""
    from xmc_engine.config import LOSSES, TrainConfig

    configs = [{"loss": loss} for loss in LOSSES]
    return config_study(args, meta, configs, _loss_auto_label,
                        _loss_auto_label({"loss": TrainConfig().loss}), "defaults_loss_auto")


def _loss_auto_label(c: dict) -> str:
    return f"loss={c['loss']}"


def _loss_label(c: dict) -> str:
    return f"loss={c['loss']} lr={c['lr']:g}"


def _normalize_label(c: dict) -> str:
    return f"normalize={c['normalize']}"


def width_study(args, meta) -> int:
    """The defaults at each hidden width of ``--widths`` (:func:`config_study`)."""
    from xmc_engine.config import TrainConfig

    configs = [{"hidden": [h]} for h in args.widths]
    return config_study(args, meta, configs, _width_label,
                        _width_label({"hidden": TrainConfig().hidden}), "defaults_width")


def _batch_label(c: dict) -> str:
    return f"batch={c['batch_size']}"


def batch_study(args, meta) -> int:
    """The defaults at each batch size of ``--batches`` (:func:`config_study`)."""
    from xmc_engine.config import TrainConfig

    configs = [{"batch_size": b} for b in args.batches]
    return config_study(args, meta, configs, _batch_label,
                        _batch_label({"batch_size": TrainConfig().batch_size}), "defaults_batch")


def config_study(args, meta, configs: list[dict], label, default: str, benchmark: str) -> int:
    """Each of ``configs`` (``XMCClassifier`` keywords; the defaults otherwise) on every dataset
    at each of ``--epochs`` (one run of ``max(--epochs)`` epochs per configuration and seed,
    evaluated every ``min(--epochs)``: the schedule depends on the epoch reached, not on the
    run's length). Prints per dataset and epoch count the mean P@1 over seeds of every
    configuration, then each configuration's mean P@1 / P@5 / training time over datasets and
    its largest P@1 shortfall against a dataset's best configuration."""
    rows, table = [], {}
    for name, X, Y, Xt, Yt, note in datasets_present(args.datasets, args.max_train):
        heavy = name in args.heavy
        epochs = sorted(args.epochs)[:1] if heavy else sorted(args.epochs)
        seeds = args.seeds[:1] if heavy else args.seeds
        print(f"{name}: epochs {epochs}, seeds {seeds} {note}", flush=True)
        for c in configs:
            for seed in seeds:
                r = run_one((X, Y, Xt, Yt), c, seed, epochs, args.threads)
                r.update(dataset=name, epochs=epochs)
                rows.append(r)
                for e in epochs:
                    table.setdefault((name, e), {}).setdefault(label(c), []).append(
                        r["at"][str(e)])
                chose = f" [{r['resolved']['loss']}]" if c.get("loss") == "auto" else ""
                print(f"  {label(c):22s} seed {seed}{chose}: " + ", ".join(
                    f"P@1/3/5@{e} {r['at'][str(e)]['P@1']:.4f} / {r['at'][str(e)]['P@3']:.4f} "
                    f"/ {r['at'][str(e)]['P@5']:.4f} ({r['at'][str(e)]['train_time']:.1f} s)"
                    for e in epochs), flush=True)
        summary = print_study_table(table, [label(c) for c in configs], default)
        _common.write_result(args.out, {**meta, "benchmark": benchmark,
                                        "configs": configs, "summary": summary, "rows": rows})
    print(f"\nwrote {args.out}")
    return 0


def lr_probe_study(args, meta) -> int:
    """Would a short probe pick the learning rate better than the fixed default (issue 14's
    ``lr="auto"``)? Per dataset, ``--validation`` of the training rows (seeded) are held out;
    for each ``--probe-lrs`` rate and seed the defaults otherwise train ``max(--epochs)`` epochs
    on the rest, evaluated on the held-out rows after every epoch and on the test set at the
    end. A probe of ``p`` epochs picks, per seed, the rate with the best held-out P@1 at epoch
    ``p`` (the schedule depends on the epoch reached, so the first ``p`` epochs of a run are
    the ``p``-epoch run); the full length is the same choice at the last epoch. Prints per
    dataset the test P@1 (mean over seeds) of the default rate, of each probe's pick and of the
    best rate in hindsight, and each probe's cost in training time over one default run."""
    from xmc_libraries import _score

    from xmc_engine import XMCClassifier
    from xmc_engine.config import TrainConfig

    default_lr = TrainConfig().learning_rate
    lrs = sorted(set(args.probe_lrs) | {default_lr})
    epochs = max(args.epochs)
    probes = sorted({p for p in args.probe_epochs if p < epochs} | {epochs})
    rows, table = [], []
    for name, X, Y, Xt, Yt, note in datasets_present(args.datasets, args.max_train):
        perm = np.random.default_rng(0).permutation(X.shape[0])
        n_val = max(1, int(round(args.validation * X.shape[0])))
        val, fit_rows = np.sort(perm[:n_val]), np.sort(perm[n_val:])
        print(f"{name}: {fit_rows.size} training rows, {val.size} held out {note}", flush=True)
        runs = {}
        for seed in args.seeds:
            for lr in lrs:
                clf = XMCClassifier(lr=lr, epochs=epochs, eval_every=1, seed=seed,
                                    threads=args.threads)
                clf.fit(X[fit_rows], Y[fit_rows], eval_set=(X[val], Y[val]))
                curve = [(round(r["epoch"]), r["metrics"]["P@1"], r["train_time"])
                         for r in clf.history_ if r["event"] == "eval"]
                test = _score(clf.predict_topk(Xt, 5)[0], Yt)
                runs[seed, lr] = r = {"dataset": name, "seed": seed, "lr": lr,
                                      "validation": curve, "test": test}
                rows.append(r)
                print(f"  lr {lr:g} seed {seed}: held-out P@1 by epoch "
                      + " ".join(f"{p1:.4f}" for _, p1, _ in curve)
                      + f"; test P@1 {test['P@1']:.4f}", flush=True)
        line = {"dataset": name, "default": float(np.mean(
            [runs[s, default_lr]["test"]["P@1"] for s in args.seeds]))}
        line["best_in_hindsight"] = max(float(np.mean([runs[s, lr]["test"]["P@1"]
                                                       for s in args.seeds])) for lr in lrs)
        for p in probes:
            picks = {s: max(lrs, key=lambda lr, s=s: runs[s, lr]["validation"][p - 1][1])
                     for s in args.seeds}
            line[f"probe_{p}"] = float(np.mean([runs[s, picks[s]]["test"]["P@1"]
                                                for s in args.seeds]))
            line[f"picks_{p}"] = [picks[s] for s in args.seeds]
            line[f"cost_{p}"] = float(np.mean([
                sum(runs[s, lr]["validation"][p - 1][2] for lr in lrs)
                / runs[s, default_lr]["validation"][-1][2] for s in args.seeds]))
        table.append(line)
        _common.write_result(args.out, {**meta, "benchmark": "defaults_lr_probe",
                                        "lrs": lrs, "epochs": epochs, "probes": probes,
                                        "validation": args.validation, "table": table,
                                        "rows": rows})
    print(f"\ntest P@1 after {epochs} epochs (mean over seeds {args.seeds}); a probe of p "
          f"epochs trains every rate of {lrs} for p epochs (cost: over one run at the default)")
    print("| data | default lr " + f"{default_lr:g} | "
          + " | ".join(f"probe {p} ep: pick, P@1, cost" for p in probes) + " | best rate |")
    print("|---|---:|" + "---|" * len(probes) + "---:|")
    for t in table:
        cells = [f"{'/'.join(f'{x:g}' for x in t[f'picks_{p}'])}, {t[f'probe_{p}']:.4f} "
                 f"({t[f'probe_{p}'] - t['default']:+.4f}), {t[f'cost_{p}']:.1f}x"
                 for p in probes]
        print(f"| {t['dataset']} | {t['default']:.4f} | " + " | ".join(cells)
              + f" | {t['best_in_hindsight']:.4f} |")
    if table:
        print("| mean | " + f"{np.mean([t['default'] for t in table]):.4f} | " + " | ".join(
            f"{np.mean([t[f'probe_{p}'] for t in table]):.4f}" for p in probes)
            + f" | {np.mean([t['best_in_hindsight'] for t in table]):.4f} |")
    print(f"\nwrote {args.out}")
    return 0


def _width_label(c: dict) -> str:
    return "hidden=" + "x".join(str(h) for h in c["hidden"])


def _decay_label(c: dict) -> str:
    return f"lr={c['lr']:g} decay={c['lr_decay']:g}"


def print_study_table(table: dict, labels: list[str], default: str) -> list[dict]:
    """Markdown: a row per (dataset, epochs), a column per configuration (mean P@1 over seeds,
    the row's best in bold); then per epoch count each configuration's mean P@1 over the
    datasets, its worst shortfall against the row's best, its mean P@5 and its total training
    time. ``table[(dataset, epochs)][label]`` holds each seed's metrics at those epochs (the
    ``at`` entries of :func:`run_one`). Returns the per-configuration figures."""
    def mean(k, lab, metric):
        return float(np.mean([at[metric] for at in table[k][lab]]))

    print("\n| data | epochs | " + " | ".join(labels) + " |")
    print("|---|---:|" + "---:|" * len(labels))
    means = {(k, lab): mean(k, lab, "P@1") for k, runs in table.items() for lab in runs}
    for (name, e), runs in table.items():
        best = max(means[(name, e), lab] for lab in runs)
        cells = [f"**{means[(name, e), lab]:.4f}**" if means[(name, e), lab] == best
                 else f"{means[(name, e), lab]:.4f}" if lab in runs else "" for lab in labels]
        print(f"| {name} | {e} | " + " | ".join(cells) + " |")
    summary = []
    for e in sorted({e for _, e in table}):
        keys = [k for k in table if k[1] == e and all(lab in table[k] for lab in labels)]
        for lab in labels:
            vals = [means[k, lab] for k in keys]
            gaps = [max(means[k, other] for other in labels) - means[k, lab] for k in keys]
            summary.append({"epochs": e, "config": lab, "datasets": len(keys),
                            "mean_P@1": float(np.mean(vals)) if vals else None,
                            "worst_gap": float(max(gaps)) if gaps else None})
            if keys:
                summary[-1]["mean_P@3"] = float(np.mean([mean(k, lab, "P@3") for k in keys]))
                summary[-1]["mean_P@5"] = float(np.mean([mean(k, lab, "P@5") for k in keys]))
                summary[-1]["train_s"] = float(np.sum([mean(k, lab, "train_time")
                                                       for k in keys]))
                summary[-1]["probe_s"] = float(np.sum([
                    np.mean([at.get("probe_s", 0.0) for at in table[k][lab]]) for k in keys]))
        print(f"\n{e} epochs, {len(keys)} datasets (default: {default}):")
        for s in (x for x in summary if x["epochs"] == e and x["mean_P@1"] is not None):
            print(f"  {s['config']:22s} mean P@1 {s['mean_P@1']:.4f}, worst shortfall "
                  f"{s['worst_gap']:.4f}, mean P@3 {s['mean_P@3']:.4f}, mean P@5 "
                  f"{s['mean_P@5']:.4f}, training "
                  f"{s['train_s']:.1f} s in all"
                  + (f" (+ {s['probe_s']:.1f} s of loss probe)" if s["probe_s"] else ""))
    return summary


def warmup_study(args, meta) -> int:
    """Time to 97 % of the best P@1 of ``adaptive`` on ``--warmup-devices`` for each
    ``--warmups`` learning-rate warm-up, at the defaults' optimizer, lr, batch and hidden
    (``bench/_tta.py``'s interpolated time to target); also the first evaluation's P@1 beside
    the popularity baseline's (a stall there is what the warm-up must not cause)."""
    import _tta

    from xmc_engine.config import TrainConfig

    d = TrainConfig()
    out = Path(args.out)
    results = {}
    for name in args.warmup_datasets:
        data = _tta.load_data(name)
        counts = np.asarray(data[1].sum(axis=0)).ravel()
        top = int(np.argmax(counts))
        popular = float(np.mean(data[3][:, top].toarray() > 0))  # P@1 of the popular label
        runs = []
        for seed in args.warmup_seeds:
            for w in args.warmups:
                m = _tta.Method(f"warm-up {w:g}", "adaptive", args.warmup_devices)
                r = _tta.run_method(m, data, epochs=args.warmup_epochs, lr=d.learning_rate,
                                    batch_size=d.batch_size, hidden=d.hidden,
                                    seed=seed, optimizer=d.optimizer, warmup_epochs=w,
                                    eval_every=args.warmup_eval_every)
                r["first_eval"] = {"epoch": r["curve"][0][1], "P@1": r["curve"][0][2]}
                runs.append(r)
                print(f"  {name} warm-up {w:g} seed {seed}: first eval P@1 "
                      f"{r['first_eval']['P@1']:.4f} at epoch {r['first_eval']['epoch']:.3f}, "
                      f"best {r['best_P@1']:.4f}", flush=True)
        summary = _tta.summarise(runs, reference=f"warm-up {args.warmups[0]:g}")
        for row in summary["rows"]:
            rs = [r for r in runs if r["method"] == row["method"]]
            row["first_eval_P@1"] = float(np.mean([r["first_eval"]["P@1"] for r in rs]))
        _tta.print_table(summary, reference=f"warm-up {args.warmups[0]:g}",
                         title=f"{name}, adaptive on {args.warmup_devices}, popular P@1 "
                               f"{popular:.4f};")
        results[name] = {"popular_P@1": popular, "summary": summary, "runs": runs}
        _common.write_result(out, {**meta, "benchmark": "defaults_warmup",
                                   "defaults": {"optimizer": d.optimizer,
                                                "lr": d.learning_rate,
                                                "batch_size": d.batch_size,
                                                "hidden": d.hidden},
                                   "args": {k: v for k, v in vars(args).items()
                                            if k.startswith("warmup")},
                                   "results": results})
    print(f"\nwrote {out}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    meta = _common.result_metadata(machine_extra={"threads_per_run": args.threads})
    if args.warmup_study:
        return warmup_study(args, meta)
    if args.decay_study:
        return decay_study(args, meta)
    if args.width_study:
        return width_study(args, meta)
    if args.batch_study:
        return batch_study(args, meta)
    if args.schedule_study:
        return schedule_study(args, meta)
    if args.normalize_study:
        return normalize_study(args, meta)
    if args.lr_probe_study:
        return lr_probe_study(args, meta)
    if args.loss_study:
        return loss_study(args, meta)
    if args.loss_auto_study:
        return loss_auto_study(args, meta)
    out = Path(args.out)
    if args.tables:
        done = _common.read_json(out)
        if not done:
            raise SystemExit(f"--tables: no results in {out}")
        print_tables(done["rows"], list(done["datasets"]), sorted({int(e) for r in done["rows"]
                                                                 for e in r["at"]}),
                     done.get("napkinxc", {}))
        return 0
    previous, napkin = {}, {}
    for path in [out, *args.previous] if args.resume else []:
        old = _common.read_json(path) or {}
        previous.update({_key(r["dataset"], r["config"], r["seed"], r["epochs"]): r
                         for r in old.get("rows", []) if r["config"]})
        napkin.update(old.get("napkinxc", {}))
    heavy_shapes = [tuple(int(v) for v in s.split("x")) for s in args.heavy_shapes.split(",")]
    heavy_points = [(s.split(":")[0], float(s.split(":")[1])) for s in args.heavy_lrs.split(",")]
    rows, notes, summary = [], {}, []
    for name, X, Y, Xt, Yt, note in datasets_present(args.datasets, args.max_train):
        t0 = time.perf_counter()
        notes[name] = {"n_train": X.shape[0], "n_test": Xt.shape[0], "n_features": X.shape[1],
                       "n_labels": Y.shape[1], "nnz_per_row": X.nnz / max(X.shape[0], 1),
                       "note": note}
        heavy = name in args.heavy
        epochs = sorted(args.epochs)[:1] if heavy else sorted(args.epochs)
        seeds = args.seeds[:1] if heavy else args.seeds
        print(f"{name}: {X.shape[0]} x {X.shape[1]} -> {Y.shape[1]} labels, epochs {epochs}, "
              f"seeds {seeds} {note}", flush=True)
        grid = Grid(name, (X, Y, Xt, Yt), epochs, seeds, args.threads, previous, rows)
        if heavy:
            search(grid, heavy_points, heavy_shapes)
        else:
            lrs = {"sgd": SGD_LRS, "adagrad": ADAGRAD_LRS}
            search(grid, [(opt, lr, *loss) for loss in ([(x,) for x in args.grid_losses] or [()])
                          for opt in args.grid_optimizers for lr in lrs[opt]],
                   [(b, h) for b in BATCHES for h in HIDDENS])
        if name in args.napkinxc and name not in napkin:
            from xmc_libraries import run_napkinxc_plt

            napkin[name] = run_napkinxc_plt(X, Y, Xt, Yt, threads=args.threads, seed=0)
            print(f"  napkinXC PLT: P@1 {napkin[name]['P@1']:.4f} ({napkin[name]['train_time']:.1f}"
                  " s)", flush=True)
        notes[name]["seconds"] = time.perf_counter() - t0
        summary = [s for n in notes for e in sorted(args.epochs)
                   if (s := summarise(rows, n, e)) is not None]
        _common.write_result(out, {**meta, "benchmark": "defaults", "datasets": notes,
                                   "grid": {"sgd_lrs": SGD_LRS, "adagrad_lrs": ADAGRAD_LRS,
                                            "optimizers": args.grid_optimizers,
                                            "losses": args.grid_losses,
                                            "batches": BATCHES, "hiddens": HIDDENS,
                                            "heavy_shapes": heavy_shapes,
                                            "heavy_points": heavy_points,
                                            "heavy": args.heavy},
                                   "summary": summary, "napkinxc": napkin, "rows": rows})
    print_tables(rows, list(notes), args.epochs, napkin)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
