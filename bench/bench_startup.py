"""The start of a run: the first merge period's seconds per sample against the later periods',
and the wall time of ``fit`` around them, so that set-up work that lands in the first steps
(page faults of lazily zeroed optimizer state, device workers still entering their thread
budgets) shows, and checkouts of the engine can be compared.

Per dataset, device set and seed, one after the other in one process (nothing else should run):
``XMCClassifier(epochs=E, devices=D, algorithm=A, loss=L, eval_every=0, seed=s).fit(X, Y)`` with
``algorithm="single", threads=1`` for a one-device set (the sweeps' "single") and ``adaptive``
otherwise. Recorded per fit, from the run log's ``merge`` records (one per merge period; one
device logs one per 1,024 samples): the first period's and the later periods' (median) wall
microseconds per sample, each device's busy and idle seconds in the first period, the training
seconds and the wall time of ``fit``. A throwaway fit per dataset first warms Numba's cache.
``--loss`` is fixed (default ``bce``, what ``loss="auto"`` picks on the four real sets below)
so that no loss probe runs.

Two checkouts, rounds interleaved (each ``--out`` a separate file), then the comparison::

    for r in 1 2 3; do for c in before after; do
        (cd $c && python bench/bench_startup.py --out /tmp/startup/${c}_$r.json); done; done
    python bench/bench_startup.py --compare before=/tmp/startup/before_*.json \\
        after=/tmp/startup/after_*.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import _tta  # noqa: E402

DATASETS = ("debian_debtags", "rcv1sub1", "delicious", "debian_builddeps")
DEVICE_SETS = ("cpu", "cpu,cpu@0.5", "cpu,cpu@0.5,cpu@0.25")


def run_one(data, devices: str, seed: int, epochs: float, loss: str) -> dict:
    """One fit; its timings (see the module docstring)."""
    from xmc_engine import XMCClassifier

    Xtr, Ytr = data[:2]
    one = "," not in devices
    clf = XMCClassifier(epochs=epochs, devices=devices, algorithm="single" if one else "adaptive",
                        threads=1 if one else None, loss=loss, eval_every=0, seed=seed)
    t0 = time.perf_counter()
    clf.fit(Xtr, Ytr)
    wall = time.perf_counter() - t0
    merges = [r for r in clf.history_ if r.get("event") == "merge"]
    if not merges:
        raise SystemExit(f"{devices}, {epochs} epochs: the run logged no merge period; "
                         "give more --epochs")
    # a period's wall seconds: any device's busy plus idle time in it
    us = [1e6 * (r["devices"][0]["busy_s"] + r["devices"][0]["idle_s"])
          / sum(d["samples"] for d in r["devices"]) for r in merges]
    final = _common.final_record(clf.history_)
    return {"devices": devices, "seed": seed, "wall_s": wall, "train_s": final["train_time"],
            "periods": len(merges), "first_period_us": us[0],
            "later_period_us": statistics.median(us[1:]) if len(us) > 1 else None,
            "first_period": [{"busy_s": d["busy_s"], "idle_s": d["idle_s"],
                              "updates": d["updates"]} for d in merges[0]["devices"]],
            "compile_s": _common.event_seconds(clf.history_, "compile")}


def measure(args) -> None:
    from xmc_engine import XMCClassifier

    out = {**_common.result_metadata(), "benchmark": "startup", "epochs": args.epochs,
           "loss": args.loss, "runs": {}}
    for name in args.data:
        data = _tta.load_data(name)
        XMCClassifier(epochs=0.05, loss=args.loss, eval_every=0, threads=1).fit(data[0], data[1])
        out["runs"][name] = [run_one(data, dev, seed, args.epochs, args.loss)
                             for dev in args.devices for seed in args.seeds]
        for dev in args.devices:
            rs = [r for r in out["runs"][name] if r["devices"] == dev]
            print(f"{name:18s} {dev:22s} first period {_med(rs, 'first_period_us'):.1f} "
                  f"us/sample, later {_med(rs, 'later_period_us'):.1f}, training "
                  f"{_med(rs, 'train_s'):.3f} s, fit {_med(rs, 'wall_s'):.3f} s", flush=True)
    _common.write_result(args.out, out)
    print(f"wrote {args.out}")


def _med(runs, key):
    vals = [r[key] for r in runs if r[key] is not None]
    return statistics.median(vals) if vals else float("nan")


def compare(specs: list[str]) -> None:
    """Median over every run of each label's files, per dataset and device set, side by side."""
    labels = {}
    for label, payloads in _common.compare_files(specs).items():
        runs: dict = {}
        for payload in payloads:
            for name, rs in payload["runs"].items():
                runs.setdefault(name, []).extend(rs)
        labels[label] = (runs, len(payloads))
    names = list(next(iter(labels.values()))[0])
    print("| data | devices | " + " | ".join(
        f"{lb} ({n} files): first / later period µs a sample, training s, fit s"
        for lb, (_, n) in labels.items()) + " |")
    print("|---|---|" + "---|" * len(labels))
    for name in names:
        devs = dict.fromkeys(r["devices"] for r in next(iter(labels.values()))[0][name])
        for dev in devs:
            cells = []
            for runs, _ in labels.values():
                rs = [r for r in runs.get(name, []) if r["devices"] == dev]
                cells.append(f"{_med(rs, 'first_period_us'):.1f} / "
                             f"{_med(rs, 'later_period_us'):.1f}, {_med(rs, 'train_s'):.3f}, "
                             f"{_med(rs, 'wall_s'):.3f}")
            print(f"| {name} | `{dev}` | " + " | ".join(cells) + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", default=list(DATASETS),
                    help="dataset names or paths, or synthetic:N_TRAIN:N_FEATURES:N_LABELS")
    ap.add_argument("--devices", nargs="+", default=list(DEVICE_SETS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--loss", choices=("softmax", "bce"), default="bce")
    ap.add_argument("--out", default="bench/results/startup.json")
    ap.add_argument("--compare", nargs="+", metavar="LABEL=GLOB",
                    help="run nothing: compare saved results, e.g. before=a_*.json after=b_*.json")
    args = ap.parse_args(argv)
    if args.compare:
        compare(args.compare)
    else:
        measure(args)


if __name__ == "__main__":
    main()
