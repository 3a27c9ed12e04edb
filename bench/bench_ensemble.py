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
against one network with its standard error, and the training seconds (of ``k`` members: the
first ``k`` members' seconds summed, their cost one after the other; where they train side by
side the run takes less, which ``--lanes`` measures)::

    python bench/bench_ensemble.py --datasets bibtex delicious debian_debtags debian_builddeps \\
        --seeds 0 1 2 --equal-samples --out bench/results/ensemble.json

With ``--lanes`` it measures instead what training the members side by side saves (where
the engine puts them there, ``training._member_lanes``): per dataset and
seed ``ensemble=K`` is fitted side by side (the engine's way) and one after the other (the
lanes forced to 1), in alternating order, checked to train the same model, and timed (the
wall time of ``fit`` and the run's training seconds), beside ``ensemble=1``::

    python bench/bench_ensemble.py --lanes --members 2 --seeds 0 1 2 \\
        --out bench/results/ensemble_lanes.json

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


def _timed_fit(data, lanes: bool, **kw):
    """``XMCClassifier(**kw).fit`` on ``data``'s training rows, its members side by side
    where the engine would put them there (``lanes``) or forced one after the other; returns
    the estimator and the wall seconds of ``fit``."""
    import time

    from xmc_engine import XMCClassifier, training

    real = training._member_lanes
    if not lanes:
        training._member_lanes = lambda *a, **k: 1
    try:
        t0 = time.perf_counter()
        clf = XMCClassifier(**kw).fit(data[0], data[1])
        return clf, time.perf_counter() - t0
    finally:
        training._member_lanes = real


def run_lanes(data, epochs: float, seed: int, members: int, **params) -> dict:
    """``ensemble=members`` side by side and one after the other (the order alternating with
    the seed), and ``ensemble=1``: wall seconds of ``fit``, training seconds, the lanes the
    engine used, and whether both ways trained the same model (they must)."""
    import numpy as np

    kw = dict(ensemble=members, epochs=epochs, seed=seed, eval_every=0, **params)
    out = {"seed": seed, "epochs": epochs, "members": members}
    for lanes in ((True, False) if seed % 2 == 0 else (False, True)):
        clf, wall = _timed_fit(data, lanes, **kw)
        rec = next(r for r in clf.history_ if r["event"] == "ensemble")
        out["side_by_side" if lanes else "in_turn"] = {
            "fit_s": wall, "train_time": _common.final_record(clf.history_)["train_time"],
            "lanes": rec["lanes"], "member_train_time": rec["member_train_time"],
            "threads": [r["threads"] for r in clf.history_ if r["event"] == "threads"],
            "params": clf.params_}
    a, b = out["side_by_side"].pop("params"), out["in_turn"].pop("params")
    # the same model where both ways trained on the same thread budgets (a timed calibration
    # can pick another, which sums in another order)
    out["same_model"] = (all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
                         if out["side_by_side"]["threads"] == out["in_turn"]["threads"]
                         else None)
    one, wall = _timed_fit(data, True, **{**kw, "ensemble": 1})
    out["one"] = {"fit_s": wall, "train_time": _common.final_record(one.history_)["train_time"]}
    return out


def summarise_lanes(rows: list[dict]) -> list[dict]:
    """Per dataset: mean wall seconds of ``fit`` and training seconds of each way, their
    ratios, the lanes used and whether every seed trained the same model both ways."""
    out = []
    for name in dict.fromkeys(r["dataset"] for r in rows):
        runs = [r for r in rows if r["dataset"] == name]
        line = {"dataset": name, "seeds": len(runs), "members": runs[0]["members"],
                "lanes": sorted({r["side_by_side"]["lanes"] for r in runs}),
                "same_model": all(r["same_model"] is not False for r in runs),
                "compared": sum(r["same_model"] is not None for r in runs)}
        for way in ("one", "in_turn", "side_by_side"):
            for key in ("fit_s", "train_time"):
                line[f"{way} {key}"] = sum(r[way][key] for r in runs) / len(runs)
        for key in ("fit_s", "train_time"):
            line[f"speed-up {key}"] = _common.mean_se(
                [r["in_turn"][key] / r["side_by_side"][key] for r in runs])
        out.append(line)
    return out


def print_lanes(summary: list[dict]) -> None:
    print("\nmean seconds over the seeds (fit: wall time of fit; train: the run's training "
          "seconds); speed-up: one after the other / side by side, mean +- standard error")
    for s in summary:
        print(f"{s['dataset']:<18} K={s['members']} lanes {s['lanes']} same model "
              f"{s['same_model']} ({s['compared']} of {s['seeds']} seeds on equal budgets):"
              f"  one network fit {s['one fit_s']:.2f} s train "
              f"{s['one train_time']:.2f} s | in turn fit {s['in_turn fit_s']:.2f} s train "
              f"{s['in_turn train_time']:.2f} s | side by side fit "
              f"{s['side_by_side fit_s']:.2f} s train {s['side_by_side train_time']:.2f} s | "
              f"speed-up fit {s['speed-up fit_s'][0]:.2f} +- {s['speed-up fit_s'][1]:.2f}, "
              f"train {s['speed-up train_time'][0]:.2f} +- {s['speed-up train_time'][1]:.2f}")


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
    p.add_argument("--lanes", action="store_true",
                   help="time the members side by side against one after the other instead")
    _common.add_study_args(p, "ensemble.json")
    args = p.parse_args(argv)
    if _common.print_saved(args.from_results, lambda r: (
            print_lanes(r["summary"]) if r.get("benchmark") == "ensemble_lanes"
            else print_summary(summarise(r["rows"])))):
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
            if args.lanes:
                r = {"dataset": name, **params,
                     **run_lanes(data, args.epochs, seed, args.members, **params)}
                rows.append(r)
                print(f"{name:<20} seed {seed} lanes {r['side_by_side']['lanes']} fit "
                      f"{r['in_turn']['fit_s']:.2f} s -> {r['side_by_side']['fit_s']:.2f} s "
                      f"(one network {r['one']['fit_s']:.2f} s), same model "
                      f"{r['same_model']}", flush=True)
                continue
            r = {"dataset": name, **params,
                 **run_one(data, args.epochs, seed, args.members, args.equal_samples, **params)}
            rows.append(r)
            print(f"{name:<20} seed {seed} {r['loss']:<8} " + "  ".join(
                f"k={k}: " + "/".join(f"{v[m]:.4f}" for m in METRICS)
                for k, v in r["k"].items()), flush=True)
    if args.lanes:
        summary = summarise_lanes(rows)
        print_lanes(summary)
        _common.write_result(args.out, {**meta, "benchmark": "ensemble_lanes",
                                        "epochs": args.epochs, "members": args.members,
                                        "seeds": args.seeds, "params": params, "rows": rows,
                                        "summary": summary})
        print(f"wrote {args.out}")
        return 0
    summary = summarise(rows)
    print_summary(summary)
    _common.write_result(args.out, {**meta, "benchmark": "ensemble", "epochs": args.epochs,
                                    "members": args.members, "seeds": args.seeds,
                                    "params": params, "rows": rows, "summary": summary})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
