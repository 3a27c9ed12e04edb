"""Which rule should ``loss="auto"``'s probe use to pick the loss? Measured on what each choice
gives: per dataset and seed, the run with the defaults is trained twice, once with the probe's
softmax fit as the winner and once with its logistic (``bce``) fit, each continued as the
engine continues a winner (``continue_probe``); the held-out rows' hits of both probe fits are
recorded (a string of 0 / 1 per loss, a held-out row each). Every rule is then scored by the
test metrics of the runs it would have picked.

    python bench/bench_loss_rule.py --datasets bibtex corel5k stackex_cooking stackex_cs \\
        delicious rcv1sub1 debian_debtags debian_builddeps imdb synth1k synth10k \\
        --seeds 0 1 2 3 4 5 6 7 8 9 --out bench/results/loss_rule.json
    python bench/bench_loss_rule.py --from-results bench/results/loss_rule.json

The winner is forced through :func:`xmc_engine.training.pick_loss`, the probe's rule, which the
script wraps: the probe trains and scores both fits as it always does, the wrapper records each
fit's :func:`~xmc_engine.training.row_hits` and returns the loss asked for. Rules scored
(``z``: the softmax's paired margin in standard errors, :func:`~xmc_engine.training.pick_loss`):

- ``P@1, ties softmax``: the higher held-out P@1 (the rule before ``LOSS_PROBE_SOFTMAX_Z``);
- ``z > t``: the softmax where ``z > t``, else the logistic loss (``t = 2``: the engine's);
- ``always softmax`` / ``always bce``: no probe decision (the continued runs all the same).

Names are those of ``bench_defaults.py`` (a shared dataset, ``synth1k``, ``synth10k``), the
training rows as given (no subsampling).
"""

from __future__ import annotations

import argparse
import sys

import _common
import bench_defaults
import numpy as np

LOSSES = ("softmax", "bce")
METRICS = ("P@1", "P@3", "P@5")
THRESHOLDS = (0.0, 1.0, 2.0, 3.0)


def run_pair(data, seed: int, epochs: float) -> dict:
    """Both continued runs of one dataset and seed, and the probe's held-out hits."""
    import xmc_engine.training as training
    from xmc_engine import XMCClassifier

    X, Y, X_test, Y_test = data
    real_rule, row = training.pick_loss, {"seed": seed}

    for forced in LOSSES:
        def forcing(hits, output="exact", forced=forced):
            row["hits"] = {k: "".join("1" if h else "0" for h in v) for k, v in hits.items()}
            row["z"] = real_rule(hits, output)[1]
            row["output"] = output
            return forced, row["z"]

        training.pick_loss = forcing
        try:
            clf = XMCClassifier(epochs=epochs, seed=seed, eval_every=0).fit(X, Y)
        finally:
            training.pick_loss = real_rule
        if clf.loss_ != forced:
            raise RuntimeError(f"asked for {forced}, trained {clf.loss_} (no probe?)")
        scores = clf.evaluate(X_test, Y_test, ks=(1, 3, 5))
        row[forced] = {k: float(scores[k]) for k in METRICS}
    return row


def _rules() -> dict:
    def higher_p1(h):  # h: each loss's held-out hits as a string of 0 / 1, a row each
        return "softmax" if h["softmax"].count("1") >= h["bce"].count("1") else "bce"

    rules = {"P@1, ties softmax": lambda h, z: higher_p1(h)}
    for t in THRESHOLDS:
        rules[f"z > {t:g}"] = lambda h, z, t=t: "softmax" if z > t else "bce"
    rules["always softmax"] = lambda h, z: "softmax"
    rules["always bce"] = lambda h, z: "bce"
    return rules


def summarise(results: list[dict]) -> dict:
    """Per dataset and rule: the mean test metrics of the runs the rule picks, and how many
    seeds it picked the logistic loss; the mean over the datasets per rule."""
    out = {}
    for res in results:
        cells = {}
        for name, rule in _rules().items():
            picks = [rule(r["hits"], r["z"]) for r in res["rows"]]
            vals = np.array([[r[p][k] for k in METRICS] for r, p in zip(res["rows"], picks,
                                                                         strict=True)])
            cells[name] = {"metrics": dict(zip(METRICS, vals.mean(axis=0).tolist(),
                                               strict=True)),
                           "bce_picked": picks.count("bce")}
        out[res["dataset"]] = {"seeds": len(res["rows"]), "z": [r["z"] for r in res["rows"]],
                               "rules": cells}
    names = list(_rules())
    out["mean"] = {name: dict(zip(METRICS, np.mean(
        [[d["rules"][name]["metrics"][k] for k in METRICS] for key, d in out.items()
         if key != "mean"], axis=0).tolist(), strict=True)) for name in names}
    return out


def print_summary(summary: dict) -> None:
    names = list(_rules())
    print("\nmean test P@1 / P@3 / P@5 of the runs each rule picks (bce: seeds it picked the "
          "logistic loss)")
    print("| data | seeds | z of the softmax (min..max) | " + " | ".join(names) + " |")
    print("|---|---:|---|" + "---|" * len(names))
    for key, d in summary.items():
        if key == "mean":
            continue
        cells = [" / ".join(f"{c['metrics'][k]:.4f}" for k in METRICS) + f" (bce {c['bce_picked']})"
                 for c in (d["rules"][n] for n in names)]
        print(f"| {key} | {d['seeds']} | {min(d['z']):+.1f}..{max(d['z']):+.1f} | "
              + " | ".join(cells) + " |")
    print("| **mean** | | | " + " | ".join(
        " / ".join(f"{summary['mean'][n][k]:.4f}" for k in METRICS) for n in names) + " |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=["bibtex", "corel5k", "stackex_cooking"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=float, default=5)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "loss_rule.json"))
    _common.add_from_results_arg(p)
    args = p.parse_args(argv)
    if _common.print_saved(args.from_results, lambda r: print_summary(r["summary"])):
        return 0
    meta = _common.result_metadata()
    results = []
    for name, X, Y, Xt, Yt, note in bench_defaults.datasets_present(args.datasets, 10**12):
        rows = []
        for seed in args.seeds:
            r = run_pair((X, Y, Xt, Yt), seed, args.epochs)
            rows.append(r)
            print(f"{name} seed {seed}: z {r['z']:+.2f}  " + "  ".join(
                f"{loss} " + " / ".join(f"{r[loss][k]:.4f}" for k in METRICS)
                for loss in LOSSES), flush=True)
        results.append({"dataset": name, "note": note, "rows": rows})
    summary = summarise(results)
    print_summary(summary)
    _common.write_result(args.out, {**meta, "benchmark": "loss_rule", "epochs": args.epochs,
                                    "seeds": args.seeds, "results": results,
                                    "summary": summary})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
