"""Issue 15: what does a merge do to the model's quality? P@1 of every replica just before each
merge of ``adaptive`` and of the merged model just after it, on the same held-out rows.

A merge averages replicas that each moved from the last centre on their own share of the
period's rows. Where the replicas stayed close, the average keeps (or beats) the best replica's
quality; where they moved apart (a large step, a non-convex hidden layer), the average can land
below every replica, and the progress of the period is partly lost. This measures that, per
merge: ``gap_best`` = P@1(merged) - max_i P@1(replica i), ``gap_fast`` = P@1(merged) - P@1(the
replica with the largest merge weight), ``gap_mean`` = P@1(merged) - sum_i p_i P@1(replica i).
Each run is repeated with every ``--lr-decay`` value given (the engine's ``lr_decay``; ``auto``:
the defaults), so that the effect of the learning-rate schedule on the merge shows side by side.

The evaluations happen inside the merge and are excluded from nothing: the run's times are not
the engine's (this is a diagnostic, not a timing). Command (results in
``bench/results/merge_gap/<data>.json``)::

    python bench/bench_merge_gap.py --data synthetic:20000:20000:100000 \\
        --devices cpu,cpu@0.5,cpu@0.25 --epochs 3 --seeds 0 1 2 --lr-decay auto 0.5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import _tta  # noqa: E402

from xmc_engine.algorithms import POLICIES, AdaptiveSGD  # noqa: E402
from xmc_engine.model import heldout_p1  # noqa: E402
from xmc_engine.validation import normalize_rows  # noqa: E402


def probed_policy(X, Y, log: list) -> type:
    """An :class:`AdaptiveSGD` whose merge appends one record to ``log``: the epoch, the merge
    weights, every replica's P@1 on ``X``, ``Y`` before the merge and the merged model's after."""

    class Probed(AdaptiveSGD):
        def merge(self, replicas, updates, ctx):
            be = replicas[0].backend
            before = [heldout_p1(be, r.params(), X, Y) for r in replicas]
            info = super().merge(replicas, updates, ctx)
            after = heldout_p1(be, self.central_params(), X, Y)
            log.append({"epoch": int(ctx.epoch), "weights": list(info["weights"]),
                        "replicas": before, "merged": after})
            return info

    return Probed


def gaps(rec: dict) -> dict:
    """The three gaps of one merge record (see the module docstring)."""
    p, w = np.asarray(rec["replicas"]), np.asarray(rec["weights"])
    return {"gap_best": rec["merged"] - float(p.max()),
            "gap_fast": rec["merged"] - float(p[int(np.argmax(w))]),
            "gap_mean": rec["merged"] - float(p @ w)}


def run(data, args, seed: int, decay) -> dict:
    from xmc_engine import XMCClassifier

    Xtr, Ytr, Xte, Yte = data
    n = min(args.probe_rows, Xte.shape[0])
    clf = XMCClassifier(epochs=args.epochs, devices=args.devices, algorithm="adaptive",
                        seed=seed, eval_every=0, continue_probe=False, lr_decay=decay)
    log: list = []
    saved = POLICIES["adaptive"]
    # the replicas compute on rows normalised as in training; so must the probe
    POLICIES["adaptive"] = probed_policy(normalize_rows(Xte[:n], clf.normalize), Yte[:n], log)
    try:
        clf.fit(Xtr, Ytr)
    finally:
        POLICIES["adaptive"] = saved
    start = next(r for r in clf.history_ if r.get("event") == "start")
    final = clf.score(Xte[:n], Yte[:n])
    return {"seed": seed, "lr_decay": decay, "loss": start.get("loss"),
            "lr_decay_used": start.get("lr_decay"), "final_P@1": final, "merges": log}


def summary(runs: list[dict], epochs: int) -> list[dict]:
    """Per epoch: the median over runs of each run's mean gap over that epoch's merges, and the
    median P@1 of the merged model at the epoch's last merge."""
    keys = ("gap_best", "gap_fast", "gap_mean")
    out = []
    for e in range(epochs):
        # each run's merges in epoch e (runs without any left out), with their gaps
        per_run = [ms for ms in ([m for m in r["merges"] if m["epoch"] == e] for r in runs) if ms]
        run_gaps = [[gaps(m) for m in ms] for ms in per_run]
        row = {"epoch": e}
        for k in keys:
            row[k] = (float(np.median([np.mean([g[k] for g in gs]) for gs in run_gaps]))
                      if run_gaps else float("nan"))
        row["merged_P@1"] = (float(np.median([ms[-1]["merged"] for ms in per_run]))
                             if per_run else float("nan"))
        out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--devices", default="cpu,cpu@0.5,cpu@0.25")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--lr-decay", nargs="+", default=["auto"],
                   help="the engine's lr_decay values to compare ('auto': the defaults)")
    p.add_argument("--probe-rows", type=int, default=1000,
                   help="held-out rows the P@1 before and after each merge is measured on")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    meta = _common.result_metadata()
    data = _tta.load_data(args.data)
    decays = [d if d == "auto" else float(d) for d in args.lr_decay]
    results = []
    for decay in decays:
        runs = [run(data, args, s, decay) for s in args.seeds]
        rows = summary(runs, args.epochs)
        results.append({"lr_decay": decay, "summary": rows, "runs": runs})
        used = sorted({str(r["lr_decay_used"]) for r in runs})
        print(f"{args.data}, {args.devices}, lr_decay={decay} (in effect: {', '.join(used)}), "
              f"{len(runs)} seeds, P@1 on {args.probe_rows} held-out rows; median over seeds "
              "of the mean over an epoch's merges:")
        print(f"{'epoch':>5s} {'merged-best':>11s} {'merged-fast':>11s} {'merged-mean':>11s} "
              f"{'merged P@1':>10s}")
        for r in rows:
            print(f"{r['epoch']:5d} {r['gap_best']:+11.4f} {r['gap_fast']:+11.4f} "
                  f"{r['gap_mean']:+11.4f} {r['merged_P@1']:10.4f}")
    tag = _tta.data_tag(args.data)
    out = Path(args.out or _common.RESULTS_DIR / "merge_gap" / f"{tag}.json")
    path = _common.write_result(out, {**meta, "benchmark": "merge_gap", "args": vars(args),
                                      "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
