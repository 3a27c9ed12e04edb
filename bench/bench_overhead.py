"""What a run with the engine's defaults spends besides training: the wall time of
``XMCClassifier(epochs=E, seed=S).fit(X, Y)`` split into the loss probe (``loss="auto"``), the
kernels' compilation (or cache load), the training clock and the rest (thread calibration, data
preparation, evaluation at the end); and the test set's P@1 (computed after the timings), so that
two checkouts can be seen to train the same models.

    python bench/bench_overhead.py --datasets bibtex corel5k delicious synthetic \\
        --out bench/results/overhead.json

Names are those ``xmc-engine train --data`` takes (a shared dataset, ``synthetic``, a file).
Each dataset first trains one throwaway epoch on a few thousand rows so that Numba's cache and
the loader's are warm; the runs then go one after another (never two at once), so that their
seconds can be compared across checkouts of the engine run on the same machine.
"""

from __future__ import annotations

import argparse
import sys
import time

import _common


def run_one(X, Y, X_test, Y_test, epochs: int, seed: int) -> dict:
    from xmc_engine import XMCClassifier

    t0 = time.perf_counter()
    clf = XMCClassifier(epochs=epochs, seed=seed, eval_every=0).fit(X, Y)
    wall = time.perf_counter() - t0
    h = clf.history_
    train = max((r["train_time"] for r in h if "train_time" in r), default=0.0)
    probe = _common.probe_seconds(h)
    compile_s = _common.event_seconds(h, "compile")
    threads = [r["threads"] for r in h if r.get("event") == "threads"]
    together = [r.get("together") for r in h if r.get("event") == "loss_probe"]
    timed = [r.get("threads_timed") for r in h if r.get("event") == "loss_probe"]
    p1 = clf.score(X_test, Y_test) if X_test is not None else None  # outside the timings
    return {"seed": seed, "loss": clf.loss_, "P@1": p1, "probe_together": together,
            "wall_s": wall, "probe_s": probe,
            "compile_s": compile_s, "train_s": train,
            "other_s": wall - probe - compile_s - train, "threads": threads,
            "threads_timed": timed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=["bibtex", "corel5k", "delicious",
                                                     "synthetic"])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "overhead.json"))
    args = p.parse_args(argv)

    from xmc_engine.datasets.registry import load_dataset

    meta = _common.result_metadata()
    rows = []
    print(f"{'data':<18} {'seed':>4} {'loss':<8} {'wall s':>7} {'probe':>6} {'compile':>7} "
          f"{'train':>6} {'other':>6} {'P@1':>6} threads")
    for name in args.datasets:
        X, Y, X_test, Y_test = load_dataset(name)
        _common.warm_engine(X, Y)
        for seed in args.seeds:
            r = {"dataset": name, **run_one(X, Y, X_test, Y_test, args.epochs, seed)}
            rows.append(r)
            print(f"{name:<18} {seed:>4} {r['loss']:<8} {r['wall_s']:>7.2f} {r['probe_s']:>6.2f} "
                  f"{r['compile_s']:>7.2f} {r['train_s']:>6.2f} {r['other_s']:>6.2f} "
                  f"{r['P@1'] if r['P@1'] is not None else float('nan'):>6.4f} "
                  f"{r['threads']}{'' if r['threads_timed'] != [False] else ' (not timed)'}",
                  flush=True)
    _common.write_result(args.out, {**meta, "benchmark": "overhead", "epochs": args.epochs,
                                    "seeds": args.seeds, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
