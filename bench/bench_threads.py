"""Does the thread calibration pick the faster budget? One device, the defaults, trained with one
thread, with every core (a given ``threads``: numba's kernels and BLAS both), and with the
budget left to the engine (``threads=None``: the replica times its own step on one thread and
on all of them, :func:`xmc_engine.model.calibrate_threads`), in one process, one run after the
other, alternating over ``--repeats``.

Printed per dataset: the training seconds of each (median over the repeats), the budget the
calibration chose in each repeat, the calibrated run's time over the faster fixed budget's
(1.00: it found the faster one; above 1: it lost time), and each fit's wall seconds (the loss
probe, the calibration and the evaluations in them). Results in ``--out``::

    python bench/bench_threads.py --out bench/results/threads.json

Two checkouts' calibrated runs, rounds interleaved (``--calibrated-only``; ``--seed`` per
round), then the per-dataset medians side by side::

    for r in 0 1 2 3; do for c in before after; do
        (cd $c && python bench/bench_threads.py --calibrated-only --repeats 1 --seed $r \
            --epochs 5 --out /tmp/threads_ab/${c}_$r.json); done; done
    python bench/bench_threads.py --compare before=/tmp/threads_ab/before_*.json \
        after=/tmp/threads_ab/after_*.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import bench_defaults  # noqa: E402

DATASETS = ("bibtex", "delicious", "rcv1sub1", "imdb", "debian_debtags", "debian_builddeps",
            "synth10k")


def add_run_args(p, repeats: int, out_name: str) -> None:
    """The arguments of a study that trains the defaults on one device under several thread
    budgets (this one and ``bench_thread_pools.py``): ``--datasets`` (default
    :data:`DATASETS`), ``--epochs``, ``--repeats``, ``--max-train`` and ``--out`` (default
    ``bench/results/<out_name>``)."""
    p.add_argument("--datasets", nargs="+", default=list(DATASETS))
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--max-train", type=int, default=30_000)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / out_name))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p, 3, "threads.json")
    p.add_argument("--calibrated-only", action="store_true",
                   help="only the run whose budget the engine calibrates")
    p.add_argument("--seed", type=int, default=0, help="the first repeat's seed")
    p.add_argument("--compare", nargs="+", metavar="NAME=GLOB",
                   help="print the calibrated runs of result files side by side, and exit")
    args = p.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    cores = os.cpu_count() or 1
    budgets = {"1 thread": 1, f"{cores} threads": cores, "calibrated": None}
    if args.calibrated_only:
        budgets = {"calibrated": None}
    payload = {**_common.result_metadata(), "benchmark": "threads", "epochs": args.epochs,
               "cores": cores, "rows": []}
    for name, X, Y, Xt, Yt, note in bench_defaults.datasets_present(args.datasets,
                                                                      args.max_train):
        data = (X, Y, Xt, Yt)
        bench_defaults.run_one(data, {}, 0, [1], 1)  # compile / load the cache first
        runs = {k: [] for k in budgets}
        for rep in range(args.repeats):
            for label, threads in budgets.items():
                r = bench_defaults.run_one(data, {}, args.seed + rep, [args.epochs], threads)
                at = r["at"][str(args.epochs)]
                runs[label].append({"train_time": at["train_time"],
                                    "threads": r["resolved"]["threads"], "P@1": at["P@1"],
                                    "probe_s": at["probe_s"], "wall_s": r["wall_s"]})
        med = {k: float(np.median([r["train_time"] for r in v])) for k, v in runs.items()}
        wall = {k: float(np.median([r["wall_s"] for r in v])) for k, v in runs.items()}
        fixed = min((med[k] for k in budgets if budgets[k] is not None), default=float("nan"))
        row = {"dataset": name, "note": note, "runs": runs, "median_train_s": med,
               "median_wall_s": wall,
               "chosen": [_budget(r) for r in runs["calibrated"]],
               "calibrated_over_best": med["calibrated"] / fixed}
        payload["rows"].append(row)
        print(f"{name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in med.items())
              + f"; calibration chose {row['chosen']}; calibrated / faster fixed "
              f"{row['calibrated_over_best']:.2f}; fit wall (probe, calibration, evaluation "
              "in): " + ", ".join(f"{k} {v:.2f} s" for k, v in wall.items()), flush=True)
        _common.write_result(args.out, payload)
    print(f"wrote {args.out}")
    return 0


def _budget(run: dict):
    """A calibrated run's budget as printed: its threads, and its pool where the run names one
    (only results of the one-pool engine, ``7cde9cc``-``e55e0fd``, as in
    ``bench/results/threads_ab/after_*.json``)."""
    pool = run.get("pool")
    return run["threads"] if run["threads"] == 1 or pool is None else f"{run['threads']} {pool}"


def compare(specs: list[str]) -> int:
    """Per dataset, each ``NAME=GLOB``'s calibrated runs (every file the glob matches): the
    median training and ``fit`` wall seconds, and the budgets chosen."""
    sides = {}
    for name, payloads in _common.compare_files(specs).items():
        runs: dict[str, list] = {}
        for payload in payloads:
            for row in payload["rows"]:
                runs.setdefault(row["dataset"], []).extend(row["runs"]["calibrated"])
        sides[name] = runs
    names = list(sides)
    datasets = [d for d in sides[names[0]] if all(d in sides[n] for n in names)]
    for d in datasets:
        parts = []
        for n in names:
            rs = sides[n][d]
            chosen = [_budget(r) for r in rs]
            parts.append(f"{n} train {np.median([r['train_time'] for r in rs]):.2f} s, "
                         f"fit {np.median([r['wall_s'] for r in rs]):.2f} s ({len(rs)} runs; "
                         f"{chosen})")
        print(f"{d}: " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
