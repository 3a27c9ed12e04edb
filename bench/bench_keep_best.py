"""When should a plateau-schedule run end with its best held-out epoch's model rather than its
last one (``keep_best``, :data:`xmc_engine.config.KEEP_BEST_Z`)? Measured on what each rule
gives: per dataset, epochs and seed the engine trains once with its defaults and a margin of
minus infinity, so that the best epoch's model always replaces the last; the script copies the
last model just before the swap and evaluates both on the test set, and the run's
``keep_best`` record says how far the best epoch's held-out hits were ahead (``z``, in standard
errors of the paired difference). Every rule is then scored by the test metrics of the model it
would have ended with:

- ``last``: no swap (``keep_best=False``);
- ``z > t``: the best epoch's model where its margin is above ``t`` (``t = 0``: the higher
  held-out P@1; ``t = 2``: the engine's ``KEEP_BEST_Z``);
- ``best``: always the best epoch's.

    python bench/bench_keep_best.py --datasets imdb synth100k synthetic:60000:5000:1000 \\
        synthetic:50000:20000:10000 --epochs 5 10 --seeds 0 1 2 3 4 \\
        --out bench/results/keep_best_rule.json
    python bench/bench_keep_best.py --from-results bench/results/keep_best_rule.json

Only data of at least :data:`~xmc_engine.config.PLATEAU_MIN_ROWS` training rows has the plateau
rule (and its held-out rows) by default; with a fixed decay the run holds rows out for
``keep_best`` from :data:`~xmc_engine.config.KEEP_BEST_MIN_ROWS` rows. ``--every-row`` chooses
that threshold: each run holds rows out whatever its size (the threshold set to 0 for it), and
one more run per dataset, epochs and seed trains every row and ends with its last model (the
threshold set above the data's rows), scored as the rule ``every row``:

    python bench/bench_keep_best.py --every-row --datasets debian_builddeps delicious \
        --epochs 10 --seeds 0 1 2 --out bench/results/keep_best_small/big.json

Names: a shared dataset, a shape of ``bench_defaults.py`` (``synth100k``) or
``synthetic:N_TRAIN:N_FEATURES:N_LABELS``.
"""

from __future__ import annotations

import argparse
import math
import sys
from unittest import mock

import _common
import bench_defaults

METRICS = ("P@1", "P@3", "P@5")
THRESHOLDS = (0.0, 1.0, 2.0, 3.0)


def run_every_row(data, epochs: float, seed: int, **params) -> dict:
    """One default run that holds no rows out (:data:`~xmc_engine.config.KEEP_BEST_MIN_ROWS`
    above the data's rows; below :data:`~xmc_engine.config.PLATEAU_MIN_ROWS`, where the fixed
    decay applies): the test metrics of its last model."""
    import xmc_engine.config as config
    from xmc_engine import XMCClassifier

    X, Y, X_test, Y_test = data
    if X.shape[0] >= config.PLATEAU_MIN_ROWS:
        raise SystemExit(f"--every-row: {X.shape[0]} training rows have the plateau rule, "
                         f"which holds rows out whatever keep_best says")
    # read by TrainConfig.holds_out when the run starts
    with mock.patch.object(config, "KEEP_BEST_MIN_ROWS", X.shape[0] + 1):
        clf = XMCClassifier(epochs=epochs, seed=seed, eval_every=0, **params).fit(X, Y)
    if any(r["event"] == "keep_best" for r in clf.history_):
        raise SystemExit("--every-row: the run held rows out")
    m = clf.evaluate(X_test, Y_test, ks=(1, 3, 5))
    return {k: float(m[k]) for k in METRICS}


def run_one(data, epochs: float, seed: int, every_row: bool = False, **params) -> dict:
    """One default run whose best epoch's model always replaces its last: the test metrics of
    both (the last model copied just before the swap) and the ``keep_best`` record's margin.
    ``every_row``: the run holds rows out whatever its size (``KEEP_BEST_MIN_ROWS`` 0), and
    one more run trains every row (:func:`run_every_row`)."""
    import xmc_engine.config as config
    import xmc_engine.training as training
    from xmc_engine import XMCClassifier

    X, Y, X_test, Y_test = data
    real_finish, seen = training._PlateauWatch.finish, {}

    def finish(self, trainer, *args, **kw):
        seen["last"] = training.host_params(trainer)
        return real_finish(self, trainer, *args, **kw)

    threshold = 0 if every_row else config.KEEP_BEST_MIN_ROWS
    # KEEP_BEST_Z is read by the driver when the run ends, KEEP_BEST_MIN_ROWS when it starts
    with mock.patch.object(config, "KEEP_BEST_Z", -math.inf), \
            mock.patch.object(config, "KEEP_BEST_MIN_ROWS", threshold), \
            mock.patch.object(training._PlateauWatch, "finish", finish):
        clf = XMCClassifier(epochs=epochs, seed=seed, eval_every=0, **params).fit(X, Y)
    h = clf.history_
    kept = next((r for r in h if r["event"] == "keep_best"), None)
    if kept is None:
        raise SystemExit(f"seed {seed}: no keep_best record: the run had no plateau rule "
                         f"(fewer training rows than PLATEAU_MIN_ROWS?)")
    final = _common.final_record(h)
    best = clf.evaluate(X_test, Y_test, ks=(1, 3, 5))
    clf.params_ = seen["last"]
    last = clf.evaluate(X_test, Y_test, ks=(1, 3, 5))
    out = {"seed": seed, "epochs": epochs, "epochs_trained": final["epoch"],
           "status": final["status"], "loss": clf.loss_, "z": kept["z"],
           "best_epoch": kept["best_epoch"], "heldout_last": kept["heldout_p1"],
           "heldout_best": kept["best_p1"], "last": {k: float(last[k]) for k in METRICS},
           "best": {k: float(best[k]) for k in METRICS}}
    if every_row:
        out["every_row"] = run_every_row(data, epochs, seed, **params)
    return out


def rules() -> list[tuple[str, object]]:
    """``(name, picks)`` per rule: ``picks(z)`` says whether the best epoch's model is kept."""
    out = [("last", lambda z: False)]
    out += [(f"z > {t:g}", lambda z, t=t: z is not None and z > t) for t in THRESHOLDS]
    out.append(("best", lambda z: True))
    return out


def summarise(rows: list[dict]) -> list[dict]:
    """Per dataset and epochs, per rule: the mean test metrics of the models it ends with and
    how many runs it swapped."""
    out = []
    for name, epochs in dict.fromkeys((r["dataset"], r["epochs"]) for r in rows):
        runs = [r for r in rows if r["dataset"] == name and r["epochs"] == epochs]
        line = {"dataset": name, "epochs": epochs, "seeds": len(runs),
                "z": [r["z"] for r in runs], "rules": {}}
        names = [("every row", None)] if all("every_row" in r for r in runs) else []
        for rule, picks in names + rules():
            chosen = ([r["every_row"] for r in runs] if picks is None
                      else [r["best"] if picks(r["z"]) else r["last"] for r in runs])
            line["rules"][rule] = {
                "swapped": 0 if picks is None else sum(bool(picks(r["z"])) for r in runs),
                **{k: sum(c[k] for c in chosen) / len(chosen) for k in METRICS}}
        out.append(line)
    return out


def print_summary(summary: list[dict]) -> None:
    print("\nmean test P@1 / P@3 / P@5 of the model each rule ends with (runs swapped)")
    for i, line in enumerate(summary):
        names = list(line["rules"])
        if i == 0 or names != list(summary[i - 1]["rules"]):
            print(f"{'data':<30} {'ep':>3} " + " ".join(f"{n:>27}" for n in names))
        cells = []
        for n in names:
            c = line["rules"][n]
            cells.append(f"{c['P@1']:.4f}/{c['P@3']:.4f}/{c['P@5']:.4f} ({c['swapped']})")
        print(f"{line['dataset']:<30} {line['epochs']:>3g} " + " ".join(f"{x:>27}" for x in cells))
        print(f"{'':<30} {'':>3} z: " + ", ".join(f"{z:+.2f}" if z is not None else "-"
                                                    for z in line["z"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=["imdb"])
    p.add_argument("--epochs", type=float, nargs="+", default=[5, 10])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--every-row", action="store_true",
                   help="hold rows out whatever the data's size, and train every row once more "
                        "per run (the rule 'every row'): below PLATEAU_MIN_ROWS only")
    _common.add_study_args(p, "keep_best_rule.json")
    args = p.parse_args(argv)
    if _common.print_saved(args.from_results, lambda r: print_summary(summarise(r["rows"]))):
        return 0
    params = _common.device_params(args)
    meta = _common.result_metadata()
    rows = []
    print(f"{'data':<30} {'ep':>3} {'seed':>4} {'loss':<8} {'z':>6} {'best ep':>7} "
          f"{'last P@1':>8} {'best P@1':>8}" + (" every row" if args.every_row else ""))
    for name in args.datasets:
        data = bench_defaults.load_any(name)
        _common.warm_engine(data[0], data[1], **params)
        for epochs in args.epochs:
            for seed in args.seeds:
                r = {"dataset": name, **params,
                     **run_one(data, epochs, seed, every_row=args.every_row, **params)}
                rows.append(r)
                z = f"{r['z']:+.2f}" if r["z"] is not None else "-"
                every = f" {r['every_row']['P@1']:>9.4f}" if "every_row" in r else ""
                print(f"{name:<30} {epochs:>3g} {seed:>4} {r['loss']:<8} {z:>6} "
                      f"{r['best_epoch']!s:>7} {r['last']['P@1']:>8.4f} {r['best']['P@1']:>8.4f}"
                      f"{every}", flush=True)
    summary = summarise(rows)
    print_summary(summary)
    _common.write_result(args.out, {**meta, "benchmark": "keep_best_rule",
                                    "epochs": args.epochs, "seeds": args.seeds,
                                    "every_row": args.every_row,
                                    "params": params, "rows": rows,
                                    "summary": summary})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
