"""Would a moving average of the model end higher than the model itself? (issue 15)

Where `adaptive` ends below `sync` or one device at a larger batch (the synthetic 10,000-label
shape), and where it ends below `easgd` (debian_builddeps), one explanation is the noise of the
last steps: an average of the recent models (Polyak / exponential moving averaging, as
`easgd`'s centre variable does in its way) would then end higher than the last model. This
measures it without changing the engine: each evaluation (every ``--eval-every`` epochs, the
engine's own cadence; on several devices at the next merge barrier) also folds the evaluated
parameters into exponential moving averages with half-lives of ``--half-lives`` epochs and
evaluates each average on the same test rows (``Evaluator.__call__`` patched for the run; the
run's own curve and training are untouched, the averages' evaluations count as evaluation
time, not training time).

    python bench/bench_tail_average.py --data synthetic:20000:20000:10000 --epochs 10 \\
        --runs single:cpu adaptive:cpu,cpu@0.5,cpu@0.25 sync:cpu,cpu@0.5,cpu@0.25 \\
        --seeds 0 1 2 --out bench/results/tail_average/synthetic_10000.json

Each run prints the model's P@1 and each average's at the end and at their best; the summary
gives the medians over the seeds. ``--runs`` entries are ``ALGORITHM:DEVICES`` (``single`` runs
one thread, the fastest device alone as in ``bench_tta_sweep.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _tta  # noqa: E402
from _common import result_metadata, write_result  # noqa: E402
from _tta import Method  # noqa: E402


@contextmanager
def averaged_evaluations(half_lives_evals: dict[str, float], rows: list):
    """Patch the engine's evaluator: after each evaluation, fold the parameters into one
    exponential moving average per half-life (in evaluations) and append ``{"model": P@1,
    label: P@1, ...}`` to ``rows``. The first evaluation starts every average."""
    from xmc_engine.training import Evaluator

    original = Evaluator.__call__
    averages: dict[str, list[np.ndarray]] = {}

    def evaluate(self, be, params):
        metrics = original(self, be, params)
        top1 = self.top1  # the loss probe reads the model's own top labels
        host = [np.array(p, dtype=np.float32, copy=True) for p in params]
        row = {"model": metrics["P@1"]}
        for label, h in half_lives_evals.items():
            if label not in averages:
                averages[label] = [p.copy() for p in host]
            else:
                a = 1.0 - 0.5 ** (1.0 / h)
                for avg, p in zip(averages[label], host, strict=True):
                    avg += a * (p - avg)
            row[label] = original(self, be, [be.asarray(p) for p in averages[label]])["P@1"]
        self.top1 = top1
        rows.append(row)
        return metrics

    with mock.patch.object(Evaluator, "__call__", evaluate):
        yield


def parse_run(text: str) -> Method:
    algorithm, _, devices = text.partition(":")
    if not devices:
        raise SystemExit(f"--runs {text!r}: expected ALGORITHM:DEVICES, e.g. adaptive:cpu,cpu@0.5")
    return Method(text, algorithm, devices, threads=1 if algorithm == "single" else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a dataset name or path, or synthetic:N:F:L")
    p.add_argument("--runs", nargs="+", required=True, help="ALGORITHM:DEVICES entries")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--epochs", type=float, default=10)
    p.add_argument("--eval-every", type=float, default=1 / 32)
    p.add_argument("--half-lives", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0],
                   help="epochs")
    p.add_argument("--test-rows", type=int, default=3000)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    Xtr, Ytr, Xte, Yte = _tta.load_data(args.data)
    data = (Xtr, Ytr, Xte[: args.test_rows], Yte[: args.test_rows])
    half = {f"ema {h:g} ep": h / args.eval_every for h in args.half_lives}
    out = {**result_metadata(argv=None if argv is None else [sys.argv[0], *argv]),
           "data": args.data, "epochs": args.epochs,
           "eval_every": args.eval_every, "half_lives_epochs": args.half_lives, "runs": []}
    for seed in args.seeds:
        for text in args.runs:
            m = parse_run(text)
            rows: list[dict] = []
            t0 = time.perf_counter()
            with averaged_evaluations(half, rows):
                r = _tta.run_method(m, data, epochs=args.epochs, lr=None, batch_size=None,
                                    hidden=None, seed=seed, optimizer=None, lr_decay=None,
                                    eval_every=args.eval_every)
            final = rows[-1]
            best = {k: max(row[k] for row in rows) for k in final}
            out["runs"].append({"run": text, "seed": seed, "evaluations": rows,
                                "epochs": [c[1] for c in r["curve"]], "final": final,
                                "best": best, "wall_s": time.perf_counter() - t0})
            print(f"seed {seed} {text}: final " + ", ".join(f"{k} {v:.4f}" for k, v in
                                                         final.items()), flush=True)
            write_result(args.out, out)
    print("\nmedian over seeds: final P@1 (best over the curve)")
    summary = {}
    for text in args.runs:
        runs = [r for r in out["runs"] if r["run"] == text]
        summary[text] = {k: {"final": statistics.median(r["final"][k] for r in runs),
                             "best": statistics.median(r["best"][k] for r in runs)}
                         for k in runs[0]["final"]}
        print(f"{text}: " + ", ".join(f"{k} {v['final']:.4f} ({v['best']:.4f})"
                                       for k, v in summary[text].items()))
    out["summary"] = summary
    write_result(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
