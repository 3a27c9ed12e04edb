"""The sampled output layer's logistic loss: weighted or unweighted negatives.

With ``loss="bce"`` and the sampled output layer, a step computes the loss on the batch's positive
labels and ``K`` drawn negatives. Each drawn negative can count once, or be weighted by the
inverse of its chance of being drawn, ``(n_labels - n_pos) / K`` for the uniform rule, which
makes the sampled loss an unbiased estimate of the exact one
(:data:`xmc_engine.output_layer.BCE_WEIGHTED_NEGATIVES` chooses; this benchmark chose it). Both
arms on each ``--runs`` entry (``DATASET:NEGATIVES``; the sampled layer forced, ``--loss bce
--lr 0.1`` otherwise at the defaults), ``--epochs`` epochs, each ``--seeds`` seed, one thread;
the exact layer too on the first entry with ``--exact``, or once on each entry's dataset with
``--exact-each``; ``--arms unweighted`` leaves the weighted arm out. Prints P@1 / P@3 / P@5 /
PSP@5 means over the seeds::

    python bench/bench_bce_negatives.py --exact
    python bench/bench_bce_negatives.py --runs bibtex:16 bibtex:64 --arms unweighted --exact-each
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

METRICS = ("P@1", "P@3", "P@5", "PSP@5")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+",
                   default=["debian_builddeps:1024", "debian_debtags:64", "delicious:128"],
                   help="DATASET:NEGATIVES entries (default: %(default)s)")
    p.add_argument("--epochs", type=float, default=5.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--exact", action="store_true",
                   help="also train the exact layer on the first entry's dataset")
    p.add_argument("--exact-each", action="store_true",
                   help="also train the exact layer once on each entry's dataset")
    p.add_argument("--arms", nargs="+", choices=("unweighted", "weighted"),
                   default=["unweighted", "weighted"],
                   help="the sampled layer's arms (default: %(default)s)")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "bce_negatives.json"))
    return p.parse_args(argv)


def run(data, seed: int, epochs: float, lr: float, weighted: bool, **params) -> dict:
    """One fit with ``BCE_WEIGHTED_NEGATIVES = weighted``; its metrics and training time."""
    import xmc_engine.output_layer as host_layer
    from xmc_engine import XMCClassifier

    X, Y, Xt, Yt = data
    saved = host_layer.BCE_WEIGHTED_NEGATIVES
    host_layer.BCE_WEIGHTED_NEGATIVES = weighted
    try:
        clf = XMCClassifier(loss="bce", lr=lr, epochs=epochs, seed=seed, threads=1,
                            eval_every=0, **params)
        t0 = time.perf_counter()
        clf.fit(X, Y)
        wall = time.perf_counter() - t0
    finally:
        host_layer.BCE_WEIGHTED_NEGATIVES = saved
    m = clf.evaluate(Xt, Yt)
    final = _common.final_record(clf.history_)
    return {**{k: float(m[k]) for k in METRICS}, "train_time": final["train_time"],
            "wall_s": wall}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = {**_common.result_metadata(), "benchmark": "bce_negatives", "args": vars(args),
           "rows": []}
    print("| data | K | negatives | " + " | ".join(METRICS) + " | train s |")
    print("|---|---:|---|" + "---:|" * (len(METRICS) + 1))
    exact_done: set[str] = set()
    for n, entry in enumerate(args.runs):
        name, k = entry.split(":")
        try:
            data = _common.load_dataset(name)
        except _common.SkipBenchmark as e:
            print(f"SKIP {name}: {e}")
            continue
        arms = [(label, label == "weighted", {"output": "sampled", "negatives": int(k)})
                for label in args.arms]
        if (args.exact and n == 0) or (args.exact_each and name not in exact_done):
            arms.append(("exact layer", False, {"output": "exact"}))
            exact_done.add(name)
        for label, weighted, params in arms:
            runs = [run(data, s, args.epochs, args.lr, weighted, **params) for s in args.seeds]
            mean = {key: float(np.mean([r[key] for r in runs])) for key in (*METRICS,
                                                                            "train_time")}
            out["rows"].append({"dataset": name, "negatives": int(k), "arm": label,
                                "seeds": args.seeds, "mean": mean, "runs": runs})
            print(f"| {name} | {k if label != 'exact layer' else '-'} | {label} | "
                  + " | ".join(f"{mean[key]:.4f}" for key in METRICS)
                  + f" | {mean['train_time']:.1f} |", flush=True)
        _common.write_result(args.out, out)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
