"""When should the plateau rule stop training? A replay over committed fixed-budget runs.

``lr_decay="plateau"`` halves the rate after every epoch whose held-out P@1 is not above the best
so far. Once a model has converged, every epoch is such an epoch, and the rate keeps halving: in
the 15-minute Amazon-670K-shape runs (``bench/bench_budget.py``) it fell to 1e-6 and below, and
the last third of the budget changed nothing. The engine stops training once the rule's
multiplier is below :data:`xmc_engine.config.PLATEAU_STOP_SCALE`; this script chooses that floor.

It reads the run logs that ``bench_budget.py`` committed (each run's ``plateau`` records, one per
epoch, and its test ``curve``: ``[train_s, epoch, P@1, P@3, P@5, ...]``) and replays the stop for
each candidate floor: the first epoch after which the multiplier is below the floor; the test P@1
there (the last evaluation at or before that epoch: the curve is sampled every few epochs, so
this is the conservative reading), the training seconds the run spent after it (interpolated on
the curve), against the same run's final P@1. It trains nothing itself: the runs are the
measurements, each with its own command and commit in its file::

    python bench/bench_plateau_stop.py
    python bench/bench_plateau_stop.py --floors 0.125 0.0625 0.03125 --out /tmp/stop.json

Runs without ``plateau`` records (the fixed decay), without a curve, or with the records of an
earlier loss-based rule (``plateau_scale/loss_rule/``: lists, not the held-out P@1 records) are
skipped.
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, read_json, result_metadata, write_result  # noqa: E402

#: The committed runs read by default: bench_budget.py's fixed-budget runs with the plateau rule.
DEFAULT_GLOBS = ("plateau_scale/*.json", "label_major/*.json")
DEFAULT_FLOORS = (0.25, 0.125, 0.0625, 0.03125, 0.015625)


def stop_epoch(plateau: list[dict], floor: float) -> int | None:
    """The first epoch after which the rule's multiplier is below ``floor`` (None: never)."""
    for rec in plateau:
        if rec["lr_scale"] < floor:
            return int(rec["epoch"])
    return None


def replay(run: dict, floors) -> dict:
    """One run's outcome under each floor: the epoch it stops at, P@1 there and time saved."""
    curve = run["curve"]
    epochs = [float(c[1]) for c in curve]
    secs = [float(c[0]) for c in curve]
    final_p1 = float(curve[-1][2])
    out = {"algorithm": run["algorithm"], "devices": run.get("devices"), "seed": run.get("seed"),
           "seconds": run.get("seconds"), "epochs_done": run["epochs_done"],
           "final_P@1": final_p1, "train_s": secs[-1],
           "lowered_at": [int(p["epoch"]) for p in run["plateau"] if p["lowered"]],
           "floors": {}}
    for floor in floors:
        e = stop_epoch(run["plateau"], floor)
        if e is None or e >= epochs[-1]:
            out["floors"][str(floor)] = {"stop_epoch": None, "P@1": final_p1, "loss": 0.0,
                                         "saved_s": 0.0}
            continue
        seen = [c for c in curve if float(c[1]) <= e + 1e-9]
        p1 = float(seen[-1][2]) if seen else float("nan")
        saved = secs[-1] - float(np.interp(e, epochs, secs))
        out["floors"][str(floor)] = {"stop_epoch": e, "P@1": p1, "loss": final_p1 - p1,
                                     "saved_s": saved}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", nargs="*", default=None,
                    help="result files of bench_budget.py (default: the committed plateau runs)")
    ap.add_argument("--floors", nargs="+", type=float, default=list(DEFAULT_FLOORS))
    ap.add_argument("--out", default=str(RESULTS_DIR / "plateau_stop.json"))
    args = ap.parse_args(argv)
    files = args.files
    if files is None:
        files = sorted({f for g in DEFAULT_GLOBS for f in glob.glob(str(RESULTS_DIR / g))})
    rows = []
    for f in files:
        payload = read_json(f)
        for run in (payload or {}).get("runs", []):
            if (not isinstance(run, dict) or not run.get("curve") or not run.get("plateau")
                    or not isinstance(run["plateau"][0], dict)):  # an older loss-based rule
                continue
            row = replay(run, args.floors)
            row["file"] = str(Path(f).resolve().relative_to(RESULTS_DIR.resolve()))
            row["run_commit"] = payload.get("git_commit")
            rows.append(row)
    if not rows:
        print("no committed run with plateau records found in", files, file=sys.stderr)
        return 1
    head = " | ".join(f"< {fl:g}: stop / P@1 lost / s saved" for fl in args.floors)
    print(f"| run | algorithm | epochs | final P@1 | {head} |")
    for r in rows:
        cells = []
        for fl in args.floors:
            c = r["floors"][str(fl)]
            cells.append("never" if c["stop_epoch"] is None else
                         f"{c['stop_epoch']} / {c['loss']:+.4f} / {c['saved_s']:.0f}")
        print(f"| {r['file']} | {r['algorithm']} | {r['epochs_done']:.1f} | "
              f"{r['final_P@1']:.4f} | " + " | ".join(cells) + " |")
    print("\nper floor: worst P@1 lost, total training seconds saved of the runs' total")
    total = sum(r["train_s"] for r in rows)
    summary = {}
    for fl in args.floors:
        cs = [r["floors"][str(fl)] for r in rows]
        worst = max(c["loss"] for c in cs)
        saved = sum(c["saved_s"] for c in cs)
        stopped = sum(c["stop_epoch"] is not None for c in cs)
        summary[str(fl)] = {"worst_loss": worst, "saved_s": saved, "total_s": total,
                            "runs_stopped": stopped, "runs": len(cs)}
        print(f"  < {fl:g}: {stopped}/{len(cs)} runs stop, worst P@1 lost {worst:+.4f}, "
              f"saved {saved:.0f} of {total:.0f} s ({saved / total:.0%})")
    write_result(args.out, {**result_metadata(), "benchmark": "plateau_stop",
                            "floors": args.floors, "rows": rows, "summary": summary})
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
