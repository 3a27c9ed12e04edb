"""Does a run lose anything by going on from the loss probe's winning fit
(``continue_probe=True``, the default) rather than training the chosen loss again from the
start (``continue_probe=False``)? And what does it save?

    python bench/bench_continue_probe.py --datasets bibtex corel5k delicious stackex_cooking \\
        stackex_cs rcv1sub1 debian_debtags debian_builddeps --seeds 0 1 2 3 4 5 6 7 8 9 \\
        --out bench/results/continue_probe.json

Each run is ``XMCClassifier(epochs=E, seed=s, continue_probe=c).fit(X, Y)``, nothing else
set: the engine as a user gets it, with and without the continuation (``--devices`` and
``--algorithm`` set those two for every run; several devices: ``adaptive`` unless given).
Per dataset and seed both runs train one after the other (which goes first alternates with
the seed, so that a warmer machine favours neither), after one throwaway epoch on a few
thousand rows that loads Numba's cache. Printed per run: the loss, the wall time of ``fit``,
the probe's seconds outside ``train_time`` (:func:`_common.probe_seconds`), ``train_time``
and the test set's P@1 / P@3 / P@5 (computed after the timings); per dataset the means and
the mean paired difference (on - off) with its standard error over the seeds, of the metrics
and of ``fit_s``, the wall time of ``fit`` less its compiling.

Names are those ``xmc-engine train --data`` takes (a shared dataset, ``synthetic``, a file).
"""

from __future__ import annotations

import argparse
import sys
import time

import _common

METRICS = ("P@1", "P@3", "P@5")


def run_one(X, Y, X_test, Y_test, epochs: float, seed: int, on: bool,
            **params) -> dict:
    from xmc_engine import XMCClassifier

    t0 = time.perf_counter()
    clf = XMCClassifier(epochs=epochs, seed=seed, eval_every=0, continue_probe=on,
                        **params).fit(X, Y)
    wall = time.perf_counter() - t0
    h = clf.history_
    final = next(r for r in h if r["event"] == "final")
    probe = next((r for r in h if r["event"] == "loss_probe"), {})
    scores = clf.evaluate(X_test, Y_test, ks=(1, 3, 5))  # outside the timings
    return {"seed": seed, "continue_probe": on, "loss": clf.loss_, "wall_s": wall,
            "compile_s": _common.event_seconds(h, "compile"),
            "probe_s": _common.probe_seconds(h), "train_time": final["train_time"],
            "continued": probe.get("continued"), **{k: float(scores[k]) for k in METRICS}}


def _value(row: dict, key: str) -> float:
    """A run's figure: a metric, or ``fit_s``, the wall time of ``fit`` less its compiling
    (a dataset's first run with a loss or an algorithm the warm-up epoch did not compile)."""
    return row["wall_s"] - row["compile_s"] if key == "fit_s" else row[key]


def summarise(rows: list[dict]) -> list[dict]:
    """Per dataset: the mean of each figure with the continuation on and off, and the mean
    paired difference (on - off) over the seeds with its standard error."""
    out = []
    for name in dict.fromkeys(r["dataset"] for r in rows):
        pairs = {}
        for r in rows:
            if r["dataset"] == name:
                pairs.setdefault(r["seed"], {})[r["continue_probe"]] = r
        pairs = [p for p in pairs.values() if len(p) == 2]
        line = {"dataset": name, "seeds": len(pairs)}
        for key in (*METRICS, "fit_s"):
            on = [_value(p[True], key) for p in pairs]
            off = [_value(p[False], key) for p in pairs]
            line[key] = {"on": sum(on) / len(on), "off": sum(off) / len(off),
                         "diff": _common.mean_se([a - b for a, b in zip(on, off, strict=True)])}
        out.append(line)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=["bibtex", "corel5k", "delicious"])
    p.add_argument("--epochs", type=float, default=5)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--devices", default=None,
                   help="device spec of every run (default: the engine's, one CPU device)")
    p.add_argument("--algorithm", default=None,
                   help="algorithm of every run (default: the engine's for --devices)")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "continue_probe.json"))
    args = p.parse_args(argv)
    params = {k: v for k, v in (("devices", args.devices), ("algorithm", args.algorithm))
              if v is not None}
    if args.devices and "," in args.devices and "algorithm" not in params:
        params["algorithm"] = "adaptive"

    from xmc_engine.datasets.registry import load_dataset

    meta = _common.result_metadata()
    rows = []
    print(f"{'data':<18} {'seed':>4} {'cont':<5} {'loss':<8} {'wall s':>7} {'probe':>6} "
          f"{'train':>6} {'P@1':>7} {'P@3':>7} {'P@5':>7}")
    for name in args.datasets:
        X, Y, X_test, Y_test = load_dataset(name)
        _common.warm_engine(X, Y, **params)
        for seed in args.seeds:
            for on in ((True, False) if seed % 2 == 0 else (False, True)):
                r = {"dataset": name, **params,
                     **run_one(X, Y, X_test, Y_test, args.epochs, seed, on, **params)}
                rows.append(r)
                print(f"{name:<18} {seed:>4} {'on' if on else 'off':<5} {r['loss']:<8} "
                      f"{r['wall_s']:>7.2f} {r['probe_s']:>6.2f} {r['train_time']:>6.2f} "
                      + " ".join(f"{r[k]:>7.4f}" for k in METRICS), flush=True)
    summary = summarise(rows)
    print("\nmeans over seeds, continue_probe on / off, and the mean paired difference "
          "(on - off) +- its standard error")
    print(f"{'data':<18} {'seeds':>5} " + " ".join(f"{k:>30}" for k in (*METRICS, "fit_s")))
    for line in summary:
        cells = []
        for key in (*METRICS, "fit_s"):
            c = line[key]
            m, se = c["diff"]
            cells.append(f"{c['on']:.4f} / {c['off']:.4f} {m:+.4f}+-{se:.4f}")
        print(f"{line['dataset']:<18} {line['seeds']:>5} " + " ".join(f"{x:>30}" for x in cells))
    _common.write_result(args.out, {**meta, "benchmark": "continue_probe",
                                    "epochs": args.epochs, "seeds": args.seeds,
                                    "params": params, "rows": rows,
                                    "summary": summary})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
