"""What ``ensemble`` (``TrainConfig.ensemble``: networks trained one after the other and
combined into one whose logits are the mean of theirs) buys against one network.

Per dataset and seed the engine trains ``XMCClassifier(ensemble=K, epochs=E, seed=s)`` once
with every other setting at its default; the script keeps the members as the engine combines
them and scores on the test set:

- ``1``: the first member alone, which is exactly the run of ``ensemble=1`` (the same seed);
- ``k`` for ``k = 2 .. K``: the engine's combination of the first ``k`` members, which is
  exactly what ``ensemble=k`` trains (each member's run depends on its own seed alone);
- with ``--equal-samples``: one network trained ``k x E`` epochs (``ensemble=1``), the same
  training samples as ``k`` members.

It prints per dataset the mean P@1 / P@3 / P@5 over the seeds, the mean paired difference
against one network with its standard error, and the training seconds::

    python bench/bench_ensemble.py --datasets bibtex delicious debian_debtags debian_builddeps \\
        --seeds 0 1 2 --equal-samples --out bench/results/ensemble.json

Names: a shared dataset, a shape of ``bench_defaults.py`` (``synth1k``) or
``synthetic:N_TRAIN:N_FEATURES:N_LABELS``.
"""

from __future__ import annotations

import argparse
import sys

import _common
import bench_defaults

METRICS = ("P@1", "P@3", "P@5")


def _scores(clf, params, X_test, Y_test) -> dict:
    clf.params_ = params
    return {k: float(v) for k, v in clf.evaluate(X_test, Y_test, ks=(1, 3, 5)).items()
            if k in METRICS}


def run_one(data, epochs: float, seed: int, members: int, equal: bool, **params) -> dict:
    """One ``ensemble=members`` run; the test metrics of its first ``k`` members combined
    for every ``k``, each member's training seconds and, with ``equal``, those of one
    network trained ``k x epochs``."""
    import xmc_engine.model as model
    from xmc_engine import XMCClassifier

    X, Y, X_test, Y_test = data
    real, seen = model.combine_members, {}

    def capture(ms):
        seen["members"] = [[p.copy() for p in m] for m in ms]
        return real(ms)

    model.combine_members = capture  # training._fit_ensemble imports it when it combines
    try:
        clf = XMCClassifier(ensemble=members, epochs=epochs, seed=seed, eval_every=0,
                            **params).fit(X, Y)
    finally:
        model.combine_members = real
    rec = next(r for r in clf.history_ if r["event"] == "ensemble")
    out = {"seed": seed, "epochs": epochs, "loss": clf.loss_,
           "member_train_time": rec["member_train_time"], "k": {}}
    for k in range(1, members + 1):
        out["k"][str(k)] = _scores(clf, real(seen["members"][:k]), X_test, Y_test)
    if equal:
        out["equal_samples"] = {}
        for k in range(2, members + 1):
            one = XMCClassifier(epochs=k * epochs, seed=seed, eval_every=0, **params).fit(X, Y)
            final = _common.final_record(one.history_)
            out["equal_samples"][str(k)] = {**_scores(one, one.params_, X_test, Y_test),
                                       "train_time": final["train_time"]}
    return out


def _cell(label: str, got: list[dict], one: list[dict], seconds: list[float]) -> dict:
    """Mean metrics of ``got`` (one per seed), their paired difference against ``one`` (mean,
    standard error) and the mean training seconds."""
    c = {"label": label, "train_time": sum(seconds) / len(seconds)}
    for m in METRICS:
        c[m] = sum(g[m] for g in got) / len(got)
        c[f"{m} diff"] = _common.mean_se([g[m] - o[m] for g, o in zip(got, one, strict=True)])
    return c


def summarise(rows: list[dict]) -> list[dict]:
    """Per dataset: mean metrics of each ``k`` (and of the equal-sample single networks), the
    paired difference against one network (mean, standard error), the training seconds."""
    out = []
    for name in dict.fromkeys(r["dataset"] for r in rows):
        runs = [r for r in rows if r["dataset"] == name]
        one = [r["k"]["1"] for r in runs]
        line = {"dataset": name, "seeds": len(runs), "epochs": runs[0]["epochs"], "cells": []}

        for k in sorted({int(k) for r in runs for k in r["k"]}):
            got = [r["k"][str(k)] for r in runs]
            line["cells"].append(_cell(f"ensemble {k}", got, one,
                                       [sum(r["member_train_time"][:k]) for r in runs]))
            eq = [r.get("equal_samples", {}).get(str(k)) for r in runs]
            if k > 1 and all(e is not None for e in eq):
                line["cells"].append(_cell(f"one network, {k}x the epochs", eq, one,
                                           [e["train_time"] for e in eq]))
        out.append(line)
    return out


def print_summary(summary: list[dict]) -> None:
    print("\nmean over the seeds; (diff) = mean paired difference against one network "
          "+- its standard error")
    for line in summary:
        print(f"\n{line['dataset']}: {line['seeds']} seeds, {line['epochs']:g} epochs a member")
        for c in line["cells"]:
            diffs = "  ".join(f"{m} {c[m]:.4f} ({c[f'{m} diff'][0]:+.4f} +- "
                              f"{c[f'{m} diff'][1]:.4f})" for m in METRICS)
            print(f"  {c['label']:<30} {diffs}  train {c['train_time']:.2f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+",
                   default=["bibtex", "delicious", "debian_debtags", "debian_builddeps"])
    p.add_argument("--epochs", type=float, default=5)
    p.add_argument("--members", type=int, default=3, help="the largest ensemble (default 3)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--equal-samples", action="store_true",
                   help="also train one network k x the epochs (the members' samples)")
    _common.add_study_args(p, "ensemble.json")
    args = p.parse_args(argv)
    if _common.print_saved(args.from_results, lambda r: print_summary(summarise(r["rows"]))):
        return 0
    if args.members < 2:
        p.error("--members must be at least 2")
    params = _common.device_params(args)
    meta = _common.result_metadata()
    rows = []
    for name in args.datasets:
        data = bench_defaults.load_any(name)
        _common.warm_engine(data[0], data[1], **params)
        for seed in args.seeds:
            r = {"dataset": name, **params,
                 **run_one(data, args.epochs, seed, args.members, args.equal_samples, **params)}
            rows.append(r)
            print(f"{name:<20} seed {seed} {r['loss']:<8} " + "  ".join(
                f"k={k}: " + "/".join(f"{v[m]:.4f}" for m in METRICS)
                for k, v in r["k"].items()), flush=True)
    summary = summarise(rows)
    print_summary(summary)
    _common.write_result(args.out, {**meta, "benchmark": "ensemble", "epochs": args.epochs,
                                    "members": args.members, "seeds": args.seeds,
                                    "params": params, "rows": rows, "summary": summary})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
