"""The short batch at the end of an epoch: at which rate should it step?

An epoch of ``n`` rows at batch ``b`` ends with a batch of ``n mod b`` rows (on several devices,
with the dynamic queue, whatever is left when a device takes its last batch: any count below
its batch). A step is its rows' mean gradient, so at the device's full rate each row of a batch
of 3 moves the model ``b / 3`` times as much as a row of a full batch; with Adagrad, whose
accumulators have seen gradients averaged over ``b`` rows, that step is close to ``lr`` on every
coordinate it touches (the dense output layer included). The engine steps a short batch at
:meth:`~xmc_engine.algorithms.base.Policy.batch_lr` (``lr x rows / b``); this script measures it
against the full rate (``batch_lr`` patched to return ``lr``) in two ways:

``--single``: one device at batch 160 and rate 0.1667 (the batch and rate the fast device of
``cpu,cpu@0.5`` adapts to on debian_builddeps), the training rows cut to leave a last batch of
``--last-rows`` rows each epoch (deterministic); prints the evaluations around each epoch's end.

``--devices SET``: ``adaptive`` with the engine's defaults on that device set, several seeds;
counts the epoch-end evaluations more than ``--drop`` P@1 below the evaluation before them (a
model that the next evaluation finds recovered), mid-epoch ones likewise, and the final and best
P@1.

    python bench/bench_short_batch.py --single --out bench/results/short_batch/single.json
    python bench/bench_short_batch.py --devices cpu,cpu@0.5 --seeds 0 1 2 3 4 5 6 7 \\
        --out bench/results/short_batch/adaptive_2.json
    python bench/bench_short_batch.py --from-results bench/results/short_batch/adaptive_2.json

``--sweep-drops JSON ...``: the same counts read from the saved curves of
``bench/bench_tta_sweep.py`` result files, per algorithm and device set, every file together.

    python bench/bench_short_batch.py \\
        --sweep-drops bench/results/ten_epochs_step3/*_short_batch_fix.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import _tta  # noqa: E402

from xmc_engine.algorithms import POLICIES  # noqa: E402
from xmc_engine.algorithms.base import Policy  # noqa: E402

RULES = ("rows", "full")  # the engine's rule; the full rate
#: ``--single``: the batch and rate ``cpu,cpu@0.5``'s fast device adapts to on debian_builddeps
SINGLE_BATCH, SINGLE_LR = 160, 0.1667


def full_rate(self, lr, n_rows, batch_size):
    """``Policy.batch_lr`` as it was: the device's full rate whatever the batch's rows."""
    return lr


def fit_curve(Xtr, Ytr, Xte, Yte, rule: str, **params) -> list[tuple[float, float]]:
    """``[(epoch, P@1), ...]`` of one run with the short batch's rate ``rule``."""
    from xmc_engine import XMCClassifier

    clf = XMCClassifier(continue_probe=False, **params)
    with contextlib.ExitStack() as stack:
        if rule == "full":  # the base rule and every policy's own
            for cls in {Policy, *POLICIES.values()}:
                if "batch_lr" in vars(cls):
                    stack.enter_context(mock.patch.object(cls, "batch_lr", full_rate))
        clf.fit(Xtr, Ytr, eval_set=(Xte, Yte))
    return [(float(r["epoch"]), float(r["metrics"]["P@1"])) for r in clf.history_
            if r.get("event") == "eval"]


def drops(curve, threshold: float) -> dict:
    """Evaluations more than ``threshold`` below the one before, at epoch ends and mid-epoch
    (counts and the evaluations each kind had), with the largest epoch-end drop."""
    out = {"end": 0, "end_n": 0, "mid": 0, "mid_n": 0, "largest_end": 0.0}
    for (_, p0), (e, p) in zip(curve, curve[1:], strict=False):
        kind = "end" if abs(e - round(e)) < 1e-9 else "mid"
        out[f"{kind}_n"] += 1
        if p0 - p > threshold:
            out[kind] += 1
        if kind == "end":
            out["largest_end"] = max(out["largest_end"], p0 - p)
    return out


def run_single(args, data) -> dict:
    Xtr, Ytr, Xte, Yte = data
    b = SINGLE_BATCH
    n = (Xtr.shape[0] - args.last_rows) // b * b + args.last_rows
    runs = {}
    for rule in RULES:
        curve = fit_curve(Xtr[:n], Ytr[:n], Xte, Yte, rule, epochs=args.epochs, devices="cpu",
                          algorithm="single", seed=0, batch_size=b, lr=SINGLE_LR, lr_decay=0.0,
                          loss="softmax", keep_best=False, eval_every=0.125)
        runs[rule] = {"curve": curve, "drops": drops(curve, args.drop)}
        print(f"  {rule}: done", flush=True)
    return {"rows": n, "batch_size": b, "lr": SINGLE_LR, "last_rows": args.last_rows,
            "runs": runs}


def run_devices(args, data) -> dict:
    Xtr, Ytr, Xte, Yte = data
    runs = {rule: [] for rule in RULES}
    for seed in args.seeds:  # seeds outside: a drift of the machine falls on both rules
        for rule in RULES:
            curve = fit_curve(Xtr, Ytr, Xte, Yte, rule, epochs=args.epochs,
                              devices=args.devices, algorithm="adaptive", seed=seed,
                              eval_every=args.eval_every)
            runs[rule].append({"seed": seed, "curve": curve, "drops": drops(curve, args.drop),
                               "final_P@1": curve[-1][1], "best_P@1": max(p for _, p in curve)})
        print(f"  seed {seed} done", flush=True)
    return {"devices": args.devices, "runs": runs}


def print_result(res: dict) -> None:
    print(f"# {res['data']}, drop = more than {res['drop']} P@1 below the evaluation before")
    if "rows" in res:
        print(f"one device, {res['rows']} rows at batch {res['batch_size']}: each epoch ends "
              f"with {res['last_rows']} rows; rate {res['lr']}\n")
        print("| short batch's rate | evaluations around each epoch's end (epoch: P@1) |")
        print("|---|---|")
        for rule, r in res["runs"].items():
            around = [f"{e:.3f}: {p:.4f}" for e, p in r["curve"]
                      if abs(e - round(e)) < 0.2 and e > 0.5]
            print(f"| {rule} | {', '.join(around)} |")
        return
    print(f"adaptive with defaults on {res['devices']}, {len(res['runs']['rows'])} seeds\n")
    print("| short batch's rate | epoch-end drops | mid-epoch drops | largest epoch-end drop "
          "| final P@1 median [min, max] | best P@1 median |")
    print("|---|---|---|---|---|---|")
    for rule, rs in res["runs"].items():
        t = total_drops([r["drops"] for r in rs])
        fin = [r["final_P@1"] for r in rs]
        print(f"| {rule} | {t['end']} of {t['end_n']} | {t['mid']} of {t['mid_n']} | "
              f"{t['largest_end']:.4f} | "
              f"{np.median(fin):.4f} [{min(fin):.4f}, {max(fin):.4f}] | "
              f"{np.median([r['best_P@1'] for r in rs]):.4f} |")


def total_drops(counts) -> dict:
    """Several runs' :func:`drops` together: the counts summed, the largest fall the largest."""
    counts = list(counts)
    out = {k: sum(c[k] for c in counts) for k in ("end", "end_n", "mid", "mid_n")}
    out["largest_end"] = max((c["largest_end"] for c in counts), default=0.0)
    return out


def sweep_drops(paths, threshold: float) -> dict:
    """:func:`drops` over the saved curves (``[seconds, epoch, P@1, ...]``) of
    ``bench_tta_sweep.py`` result files, summed per (algorithm, device set) across the files."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for path in paths:
        res = json.loads(Path(path).read_text(encoding="utf-8"))
        if res.get("benchmark") != "tta_sweep":
            raise SystemExit(f"--sweep-drops: {path} is not a bench_tta_sweep.py result "
                             f"(benchmark {res.get('benchmark')!r})")
        for row in res["rows"]:
            key = (row["config"]["algorithm"], row["config"]["devices"])
            runs.setdefault(key, []).extend(
                drops([(c[1], c[2]) for c in run["curve"]], threshold) for run in row["runs"])
    return {key: total_drops(counts) for key, counts in runs.items()}


def print_sweep_drops(paths, threshold: float) -> None:
    totals = sweep_drops(paths, threshold)
    print(f"# more than {threshold} P@1 below the evaluation before, from {len(paths)} file(s)\n")
    print("| algorithm | devices | epoch-end drops | mid-epoch drops | largest epoch-end drop |")
    print("|---|---|---|---|---|")
    for (algo, devices), t in totals.items():
        print(f"| {algo} | `{devices}` | {t['end']} of {t['end_n']} | {t['mid']} of "
              f"{t['mid_n']} | {t['largest_end']:.4f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="debian_builddeps")
    p.add_argument("--single", action="store_true",
                   help="one device, a fixed short batch at each epoch's end")
    p.add_argument("--last-rows", type=int, default=3, help="with --single")
    p.add_argument("--devices", default="cpu,cpu@0.5", help="without --single")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5, 6, 7])
    p.add_argument("--epochs", type=float, default=4)
    p.add_argument("--eval-every", type=float, default=0.125)
    p.add_argument("--test-rows", type=int, default=3000)
    p.add_argument("--drop", type=float, default=0.02)
    p.add_argument("--out", default=None)
    p.add_argument("--sweep-drops", nargs="+", metavar="JSON", default=None,
                   help="count the drops in bench_tta_sweep.py result files instead of training")
    _common.add_from_results_arg(p)
    args = p.parse_args(argv)
    if args.sweep_drops:
        print_sweep_drops(args.sweep_drops, args.drop)
        return 0
    if _common.print_saved(args.from_results, print_result):
        return 0
    meta = _common.result_metadata()
    Xtr, Ytr, Xte, Yte = _tta.load_data(args.data)
    data = (Xtr, Ytr, Xte[:args.test_rows], Yte[:args.test_rows])
    body = run_single(args, data) if args.single else run_devices(args, data)
    res = {**meta, "benchmark": "short_batch", "data": args.data, "drop": args.drop,
           "args": vars(args), **body}
    print_result(res)
    if args.out:
        print(f"wrote {_common.write_result(Path(args.out), res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
