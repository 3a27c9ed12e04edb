"""The engine with its defaults against the same network in PyTorch with Adam at its best
learning rate, at equal epochs, in one run (issue "Defaults that win out of the box").

Per dataset and seed, one process, every run after the other (nothing else on the CPU):

* **engine**: ``XMCClassifier(epochs=E, seed=s)``, nothing else set: what a user gets (thread
  budget calibrated, output layer, optimizer and learning rate resolved by the engine); and the
  same with each learning rate of ``--engine-lrs`` (the default optimizer's), so that the table
  separates the engine from its default learning rate;
* **PyTorch**: :func:`torch_baseline.train_torch` (same network, initialisation and batch
  order, and the same inputs: the feature rows as the engine's default ``normalize`` makes
  them), Adam on a dense ``W1`` gradient (``adam``) and lazy Adam (``sparse_adam``: SparseAdam
  on ``W1``), each at every learning rate of ``--lrs``, batch ``--torch-batch``,
  ``--torch-threads`` threads; the best of them by final P@1 is the competitor.

Both evaluate on the whole test set after ``E`` epochs only (evaluation is not training time).
With several ``--seeds`` (initialisation and batch order) every run is repeated per seed and
each configuration is scored by its mean over the seeds: PyTorch's best is the configuration
with the best mean P@1 (not the best run of each seed). Printed per dataset: P@1 / P@3 / P@5
and training seconds of the defaults, of the engine's best learning rate and of PyTorch's best,
the P@1 differences (per seed too) and the time ratio (PyTorch's best / the engine's defaults:
above 1 means the engine is faster). Results (every run) in ``--out``. The committed runs::

    python bench/bench_torch_adam.py --out bench/results/torch_adam.json
    python bench/bench_torch_adam.py --seeds 0 1 2 --datasets stackex_cooking stackex_cs \
        rcv1sub1 imdb --out bench/results/torch_adam_seeds.json

With ``--loss bce`` both sides train the logistic loss: the engine ``XMCClassifier(loss="bce",
epochs=E, seed=s)`` (its learning rate then the loss's default) and PyTorch the same loss
(:func:`torch_baseline.batch_loss`)::

    python bench/bench_torch_adam.py --loss bce --out bench/results/torch_adam_bce.json

``--engine-ensembles 2 3`` adds the engine with ``ensemble=2`` and ``3`` (its other settings
the defaults), each scored against PyTorch's best in P@k and in time.

With ``--loss auto`` the engine trains its default ``loss="auto"`` (the probe picks a loss; its
seconds count in the engine's time) and PyTorch's grid covers both losses::

    python bench/bench_torch_adam.py --loss auto --engine-lrs \
        --out bench/results/torch_adam_auto.json

With ``--optimizers sparse_adam adagrad`` PyTorch's Adagrad (the engine's update without its
decay, grid ``--adagrad-lrs``) trains beside lazy Adam, and each optimizer's best is printed:
whether Adam would be worth adding to the engine::

    python bench/bench_torch_adam.py --loss bce --optimizers sparse_adam adagrad \
        --lrs 0.001 0.003 0.01 0.03 --adagrad-lrs 0.02 0.05 0.1 0.2 --torch-batch 64 \
        --engine-lrs 0.05 0.1 0.2 --seeds 0 1 --out bench/results/torch_adam_vs_adagrad_b64.json

Needs ``pip install torch==2.13.0`` (the CPU build); without it the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import bench_defaults  # noqa: E402
import torch_baseline  # noqa: E402

from xmc_engine.config import TRAIN_LOSSES, TrainConfig  # noqa: E402
from xmc_engine.validation import normalize_rows  # noqa: E402

DATASETS = ("bibtex", "delicious", "corel5k", "stackex_cooking", "stackex_cs", "rcv1sub1",
            "imdb", "debian_debtags", "debian_builddeps")
ADAM_LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
#: PyTorch Adagrad's grid: the engine's Adagrad learning rates (``ENGINE_LRS``) and one more
#: step each side.
ADAGRAD_LRS = (0.01, 0.02, 0.05, 0.1, 0.2)
ENGINE_LRS = (0.02, 0.05, 0.1)
METRICS = ("P@1", "P@3", "P@5")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=list(DATASETS))
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--lrs", type=float, nargs="+", default=list(ADAM_LRS),
                   help="Adam learning rates of the PyTorch grid")
    p.add_argument("--engine-lrs", type=float, nargs="*", default=list(ENGINE_LRS),
                   help="learning rates of the engine's default optimizer tried beside its "
                   "defaults (none: defaults only)")
    p.add_argument("--engine-ensembles", type=int, nargs="*", default=[],
                   help="ensemble sizes (TrainConfig.ensemble) tried beside the defaults, "
                   "each with the default learning rate (none by default)")
    p.add_argument("--optimizers", nargs="+", default=["adam", "sparse_adam"],
                   choices=torch_baseline.TORCH_OPTIMIZERS)
    p.add_argument("--adagrad-lrs", type=float, nargs="+", default=list(ADAGRAD_LRS),
                   help="learning rates of PyTorch's Adagrad (with --optimizers ... adagrad)")
    p.add_argument("--loss", choices=("softmax", "bce", "auto"), default="softmax",
                   help="the training loss of both sides; auto: the engine's default (its "
                   "probe picks one) against PyTorch's best of both losses")
    p.add_argument("--torch-batch", type=int, default=256)
    p.add_argument("--torch-threads", type=int, default=1,
                   help="PyTorch intra-op threads (1: on this 2-core VM two spin-waiting "
                   "OpenMP threads were slower, torch_baseline.py)")
    p.add_argument("--max-train", type=int, default=30_000,
                   help="subsample larger training sets to this many rows (imdb), as "
                   "bench_defaults.py does")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "torch_adam.json"))
    return p.parse_args(argv)


def run_engine(data, epochs: int, seed: int, lr: float | None = None,
               loss: str = "softmax") -> dict:
    """The engine's defaults with ``loss`` (the loss PyTorch trains; with ``lr``: that learning
    rate), thread budget calibrated: P@1/3/5 and training seconds after ``epochs`` epochs
    (:func:`bench_defaults.run_one`)."""
    config = ({} if lr is None else {"lr": lr}) | {"loss": loss}  # the loss PyTorch trains
    r = bench_defaults.run_one(data, config, seed, [epochs], None)
    at = r["at"][str(epochs)]
    # what the fitted model predicts: with the neighbour votes, the blend (the network alone's
    # P@k kept as "network")
    scored = at.get("neighbours") or at
    return {**{k: scored[k] for k in METRICS}, "network": {k: at[k] for k in METRICS},
            "train_time": at["train_time"], "probe_s": at["probe_s"], "wall_s": r["wall_s"],
            "resolved": r["resolved"]}


def run_engine_ensemble(data, epochs: int, seed: int, members: int, loss: str) -> dict:
    """``XMCClassifier(ensemble=members, epochs=epochs, seed=seed)`` with ``loss``: the
    combined network's P@1/3/5, its training seconds (its last ``final`` record: the members'
    summed, or the longest lane's where they trained side by side), the probe's seconds
    outside them and ``lanes`` (how many members trained at once)."""
    from xmc_engine import XMCClassifier

    X, Y, Xt, Yt = data
    t0 = time.perf_counter()
    clf = XMCClassifier(ensemble=members, epochs=epochs, seed=seed, loss=loss,
                        eval_every=0).fit(X, Y, eval_set=(Xt, Yt))
    final = _common.final_record(clf.history_)
    return {**{k: final["metrics"][k] for k in METRICS}, "train_time": final["train_time"],
            "probe_s": _common.probe_seconds(clf.history_),
            "wall_s": time.perf_counter() - t0, "ensemble": members,
            "lanes": next(r["lanes"] for r in clf.history_ if r["event"] == "ensemble")}


def run_torch(data, args, optimizer: str, lr: float, seed: int, loss: str) -> dict:
    X, Y, Xt, Yt = data
    res = torch_baseline.train_torch(X, Y, Xt, Yt, lr=lr, epochs=args.epochs,
                                     batch_size=args.torch_batch, threads=args.torch_threads,
                                     seed=seed, eval_every=float(args.epochs),
                                     optimizer=optimizer, loss=loss)
    last = res["curve"][-1]
    return {"optimizer": optimizer, "lr": lr, "loss": loss, **{k: last[k] for k in METRICS},
            "train_time": res["train_time"]}


def mean_over_seeds(runs: list[dict]) -> dict:
    """One configuration's runs (one per seed) as one record: the mean of the metrics and of
    the training time, the first run's other fields, the per-seed P@1 under ``per_seed`` (and
    an ensemble's lanes per seed under ``lanes``)."""
    keys = (*METRICS, "train_time", *(["probe_s"] if "probe_s" in runs[0] else []))
    lanes = {"lanes": [r["lanes"] for r in runs]} if "lanes" in runs[0] else {}
    network = ({"network": {k: sum(r["network"][k] for r in runs) / len(runs) for k in METRICS}}
               if "network" in runs[0] else {})  # the engine's network alone, before the votes
    return {**runs[0], **{k: sum(r[k] for r in runs) / len(runs) for k in keys},
            "per_seed": [r["P@1"] for r in runs], **lanes, **network}


def best_by_optimizer(grid: list[dict]) -> dict:
    """PyTorch's best configuration (by mean P@1) of each optimizer in ``grid``."""
    best: dict = {}
    for r in grid:
        if r["optimizer"] not in best or r["P@1"] > best[r["optimizer"]]["P@1"]:
            best[r["optimizer"]] = r
    return best


def _fmt(r: dict) -> str:
    return " / ".join(f"{r[k]:.4f}" for k in METRICS) + f" ({r['train_time']:.1f} s)"


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch_baseline.torch is None:
        print(f"SKIP: {torch_baseline.TORCH_HINT}")
        return 0
    torch_losses = TRAIN_LOSSES if args.loss == "auto" else (args.loss,)
    payload = {**_common.result_metadata(), "benchmark": "torch_adam", "loss": args.loss,
               "epochs": args.epochs,
               "seeds": args.seeds, "torch_batch": args.torch_batch,
               "torch_threads": args.torch_threads, "rows": []}
    for name, X, Y, Xt, Yt, note in bench_defaults.datasets_present(args.datasets,
                                                                      args.max_train):
        data = (X, Y, Xt, Yt)
        how = TrainConfig().normalize  # what the engine does to the rows by default
        torch_data = (normalize_rows(X, how), Y, normalize_rows(Xt, how), Yt)
        run_engine(data, 1, args.seeds[0], loss=args.loss)  # compile (or load the cache) first
        engines, engine_grids, grids, ensembles = [], [], [], []
        for seed in args.seeds:
            engine = run_engine(data, args.epochs, seed, loss=args.loss)
            print(f"{name} seed {seed}: engine defaults {_fmt(engine)} {engine['resolved']}",
                  flush=True)
            engine_grid = []
            for lr in args.engine_lrs:  # the default lr's run is the defaults' run
                same = lr == engine["resolved"]["lr"]
                engine_grid.append(engine if same else run_engine(data, args.epochs, seed, lr,
                                                                  args.loss))
                print(f"{name} seed {seed}: engine lr={lr:g} {_fmt(engine_grid[-1])}",
                      flush=True)
            ensembles.append([run_engine_ensemble(data, args.epochs, seed, k, args.loss)
                              for k in args.engine_ensembles])
            for r in ensembles[-1]:
                print(f"{name} seed {seed}: engine ensemble={r['ensemble']} {_fmt(r)}",
                      flush=True)
            grid = []
            for loss in torch_losses:
                for opt in args.optimizers:
                    for lr in args.adagrad_lrs if opt == "adagrad" else args.lrs:
                        grid.append(run_torch(torch_data, args, opt, lr, seed, loss))
                        print(f"{name} seed {seed}: torch {loss} {opt} lr={lr:g} "
                              f"{_fmt(grid[-1])}", flush=True)
            engines.append(engine)
            engine_grids.append(engine_grid)
            grids.append(grid)
        engine = mean_over_seeds(engines)
        engine_grid = [mean_over_seeds(list(runs)) for runs in zip(*engine_grids, strict=True)]
        grid = [mean_over_seeds(list(runs)) for runs in zip(*grids, strict=True)]
        engine_best = max([engine, *engine_grid], key=lambda r: r["P@1"])
        best = max(grid, key=lambda r: r["P@1"])
        by_optimizer = best_by_optimizer(grid)
        for opt, r in by_optimizer.items():
            print(f"{name}: torch best {opt}: {r['loss']} lr={r['lr']:g} {_fmt(r)}", flush=True)
        ens = [mean_over_seeds(list(runs)) for runs in zip(*ensembles, strict=True)]
        for r in ens:  # against PyTorch's best, and its time over the ensemble's
            r["P@1_diff"] = r["P@1"] - best["P@1"]
            r["time_ratio"] = best["train_time"] / (r["train_time"] + r["probe_s"])
            print(f"{name}: engine ensemble={r['ensemble']} - torch best P@1 "
                  f"{r['P@1_diff']:+.4f} (P@3 {r['P@3'] - best['P@3']:+.4f}, P@5 "
                  f"{r['P@5'] - best['P@5']:+.4f}); torch / engine training time "
                  f"{r['time_ratio']:.2f}x", flush=True)
        row = {"dataset": name, "note": note, "seeds": args.seeds, "engine": engine,
               "engine_ensembles": ens,
               "engine_grid": engine_grid, "engine_best": engine_best, "torch": grid,
               "torch_best": best, "torch_best_by_optimizer": by_optimizer,
               "P@1_diff": engine["P@1"] - best["P@1"],
               "best_P@1_diff": engine_best["P@1"] - best["P@1"],
               "P@1_diff_per_seed": [e - t for e, t in zip(engine["per_seed"],
                                                            best["per_seed"], strict=True)],
               # the engine's time counts loss="auto"'s probe (its part outside train_time)
               "time_ratio": best["train_time"] / (engine["train_time"]
                                                   + engine.get("probe_s", 0.0))}
        payload["rows"].append(row)
        print(f"{name}: engine defaults - torch best ({best['loss']} {best['optimizer']} "
              f"lr={best['lr']:g}) "
              f"P@1 {row['P@1_diff']:+.4f} (per seed "
              + ", ".join(f"{d:+.4f}" for d in row["P@1_diff_per_seed"])
              + "), the network alone (no neighbour votes) "
              + f"{engine['network']['P@1'] - best['P@1']:+.4f}"
              + f", engine best lr ({engine_best['resolved']['lr']:g}) "
              f"- torch best {row['best_P@1_diff']:+.4f}; torch / engine training time "
              f"{row['time_ratio']:.2f}x", flush=True)
        _common.write_result(args.out, payload)
    print_table(payload["rows"])
    if len(args.optimizers) > 1:
        print_optimizer_table(payload["rows"], args.optimizers)
    print(f"wrote {args.out}")
    return 0


def print_table(rows: list[dict]) -> None:
    print("\n| dataset | engine defaults P@1 / P@3 / P@5 (train s) | PyTorch best "
          "P@1 / P@3 / P@5 (train s) | its optimizer, lr | defaults - PyTorch P@1 | "
          "PyTorch / engine time | engine's best lr: P@1 - PyTorch |")
    print("|---|---|---|---|---:|---:|---|")
    for r in rows:
        b, e = r["torch_best"], r["engine_best"]
        print(f"| {r['dataset']} | {_fmt(r['engine'])} | {_fmt(b)} | "
              f"{b.get('loss', '')} {b['optimizer']} "
              f"{b['lr']:g} | {r['P@1_diff']:+.4f} | {r['time_ratio']:.2f}x | "
              f"{e['resolved']['lr']:g}: {e['P@1'] - b['P@1']:+.4f} |")


def print_optimizer_table(rows: list[dict], optimizers: list[str]) -> None:
    """PyTorch's best P@1 / P@3 / P@5 of each optimizer, and its loss and learning rate."""
    print("\n| dataset | " + " | ".join(f"PyTorch {o}: P@1 / P@3 / P@5 (train s), loss lr"
                                          for o in optimizers) + " |")
    print("|---|" + "---|" * len(optimizers))
    for r in rows:
        cells = [r["torch_best_by_optimizer"][o] for o in optimizers]
        print(f"| {r['dataset']} | " + " | ".join(f"{_fmt(c)}, {c['loss']} {c['lr']:g}"
                                                 for c in cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
