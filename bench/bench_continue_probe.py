"""A default switched on against off, paired by seed: ``continue_probe``, ``keep_best`` or
``back_to_best``.

Does a run lose anything by going on from the loss probe's winning fit
(``continue_probe=True``, the default) rather than training the chosen loss again from the
start (``continue_probe=False``)? And what does it save? (Since ``887ff5b`` the fit is the
start of the run itself, so on one device with one thread both give the same model and the
bench measures the time saved; on several devices the replicas start from the fit.)

    python bench/bench_continue_probe.py --datasets bibtex corel5k delicious stackex_cooking \\
        stackex_cs rcv1sub1 debian_debtags debian_builddeps --seeds 0 1 2 3 4 5 6 7 8 9 \\
        --out bench/results/continue_probe.json

Does ending a plateau-schedule run with the model of its best held-out epoch
(``keep_best=True``, the default) beat ending it with the last one? (``--option keep_best``;
only data of at least ``PLATEAU_MIN_ROWS`` training rows has the plateau rule's held-out rows.)

    python bench/bench_continue_probe.py --option keep_best --datasets imdb synth100k \\
        --epochs 5 10 --out bench/results/keep_best.json

Does going on from the best epoch's model where a halving follows a clear dip
(``back_to_best=True``, the default) beat going on from the last one? (``--option
back_to_best``; it acts only with the plateau rule, as ``keep_best`` does; ``--back-to-best-z``
sets the margin of the runs with it on.)

    python bench/bench_continue_probe.py --option back_to_best --datasets imdb \\
        synthetic:60000:5000:1000 synthetic:50000:20000:10000 synth100k --epochs 10 \\
        --seeds 0 1 2 3 4 --out bench/results/back_to_best.json

Each run is ``XMCClassifier(epochs=E, seed=s, <option>=on).fit(X, Y)``, nothing else
set: the engine as a user gets it, with and without the option (``--devices`` and
``--algorithm`` set those two for every run; several devices: ``adaptive`` unless given).
Per dataset and seed both runs train one after the other (which goes first alternates with
the seed, so that a warmer machine favours neither), after one throwaway epoch on a few
thousand rows that loads Numba's cache. Printed per run: the loss, the wall time of ``fit``,
the probe's seconds outside ``train_time`` (:func:`_common.probe_seconds`), ``train_time``
and the test set's P@1 / P@3 / P@5 (computed after the timings); per dataset the means and
the mean paired difference (on - off) with its standard error over the seeds, of the metrics
and of ``fit_s``, the wall time of ``fit`` less its compiling.

Two engines (two commits, each run with the same command in its own checkout) are
compared run by run with ``--compare BEFORE.json AFTER.json``: per dataset and setting the
mean paired difference (after - before) over the seeds.

    python bench/bench_continue_probe.py --compare bench/results/probe_start/before_5049d04.json \
        bench/results/probe_start/after.json

Names are those ``xmc-engine train --data`` takes (a shared dataset, ``synthetic``, a file),
or a synthetic shape of ``bench_defaults.py`` (``synth1k``, ``synth10k``, ``synth100k``).
"""

from __future__ import annotations

import argparse
import sys
import time

import _common

METRICS = ("P@1", "P@3", "P@5")


OPTIONS = ("continue_probe", "keep_best", "back_to_best")


def run_one(X, Y, X_test, Y_test, epochs: float, seed: int, on: bool,
            option: str = "continue_probe", **params) -> dict:
    from xmc_engine import XMCClassifier

    t0 = time.perf_counter()
    clf = XMCClassifier(epochs=epochs, seed=seed, eval_every=0, **{option: on},
                        **params).fit(X, Y)
    wall = time.perf_counter() - t0
    h = clf.history_
    final = _common.final_record(h)
    probe = next((r for r in h if r["event"] == "loss_probe"), {})
    scores = clf.evaluate(X_test, Y_test, ks=(1, 3, 5))  # outside the timings
    kept = next((r for r in h if r["event"] == "keep_best"), {})
    back = [[r["epoch"], r["back_to"], r["z"]] for r in h
            if r["event"] == "plateau" and r.get("back_to") is not None]
    return {"seed": seed, "epochs": epochs, option: on, "loss": clf.loss_, "wall_s": wall,
            "kept_epoch": kept.get("best_epoch") if kept.get("restored") else None,
            "went_back": back,  # [epoch, back to epoch, margin] at each halving that did
            "epochs_trained": final["epoch"],
            "compile_s": _common.event_seconds(h, "compile"),
            "probe_s": _common.probe_seconds(h), "train_time": final["train_time"],
            "continued": probe.get("continued"), **{k: float(scores[k]) for k in METRICS}}


def _value(row: dict, key: str) -> float:
    """A run's figure: a metric, or ``fit_s``, the wall time of ``fit`` less its compiling
    (a dataset's first run with a loss or an algorithm the warm-up epoch did not compile)."""
    return row["wall_s"] - row["compile_s"] if key == "fit_s" else row[key]


def summarise(rows: list[dict], option: str = "continue_probe") -> list[dict]:
    """Per dataset (and number of epochs): the mean of each figure with ``option`` on and off,
    and the mean paired difference (on - off) over the seeds with its standard error."""
    out = []
    for name, epochs in dict.fromkeys((r["dataset"], r.get("epochs")) for r in rows):
        pairs = {}
        for r in rows:
            if r["dataset"] == name and r.get("epochs") == epochs:
                pairs.setdefault(r["seed"], {})[r[option]] = r
        pairs = [p for p in pairs.values() if len(p) == 2]
        line = {"dataset": name, "epochs": epochs, "seeds": len(pairs)}
        for key in (*METRICS, "fit_s"):
            on = [_value(p[True], key) for p in pairs]
            off = [_value(p[False], key) for p in pairs]
            line[key] = {"on": sum(on) / len(on), "off": sum(off) / len(off),
                         "diff": _common.mean_se([a - b for a, b in zip(on, off, strict=True)])}
        out.append(line)
    return out


def compare(before: dict, after: dict, option: str) -> list[dict]:
    """Two results files of this benchmark (two commits' engines, the same command), paired run
    by run: per dataset, epochs and setting of ``option`` (on / off), the means before and
    after and the mean paired difference (after - before) over the seeds both files have."""
    def key(r):
        return r["dataset"], r.get("epochs"), r[option], r["seed"]

    old = {key(r): r for r in before["rows"]}
    out = []
    groups = dict.fromkeys(k[:3] for k in map(key, after["rows"]) if k in old)
    for name, epochs, on in groups:
        new = [r for r in after["rows"] if key(r)[:3] == (name, epochs, on) and key(r) in old]
        line = {"dataset": name, "epochs": epochs, option: on, "seeds": len(new),
                "loss_before": sorted({old[key(r)]["loss"] for r in new}),
                "loss_after": sorted({r["loss"] for r in new}),
                "loss_changed": sum(r["loss"] != old[key(r)]["loss"] for r in new)}
        for k in (*METRICS, "fit_s"):
            a = [_value(r, k) for r in new]
            b = [_value(old[key(r)], k) for r in new]
            line[k] = {"before": sum(b) / len(b), "after": sum(a) / len(a),
                       "diff": _common.mean_se([x - y for x, y in zip(a, b, strict=True)])}
        out.append(line)
    return out


def print_compare(lines: list[dict], option: str, before: dict, after: dict) -> None:
    print(f"before: {before.get('git_commit')}, after: {after.get('git_commit')}; means over "
          "the seeds, before / after, and the mean paired difference (after - before) +- its "
          "standard error")
    print(f"{'data':<18} {'ep':>4} {option[:5]:<5} {'seeds':>5} "
          + " ".join(f"{k:>30}" for k in (*METRICS, "fit_s")))
    for line in lines:
        cells = [f"{line[k]['before']:.4f} / {line[k]['after']:.4f} "
                 f"{line[k]['diff'][0]:+.4f}+-{line[k]['diff'][1]:.4f}"
                 for k in (*METRICS, "fit_s")]
        print(f"{line['dataset']:<18} {line['epochs']:>4g} "
              f"{'on' if line[option] else 'off':<5} {line['seeds']:>5} "
              + " ".join(f"{x:>30}" for x in cells)
              + f"  loss {'/'.join(line['loss_before'])} -> {'/'.join(line['loss_after'])}"
              + f" ({line['loss_changed']} changed)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=["bibtex", "corel5k", "delicious"])
    p.add_argument("--option", choices=OPTIONS, default="continue_probe",
                   help="the default compared on and off (default: continue_probe)")
    p.add_argument("--epochs", type=float, nargs="+", default=[5])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--back-to-best-z", type=float, default=None,
                   help="with --option back_to_best: the margin of the runs with it on "
                        "(default: the engine's, xmc_engine.config.BACK_TO_BEST_Z)")
    p.add_argument("--back-to-best-stale-z", type=float, default=None,
                   help="with --option back_to_best: the margin where the best epoch is two or "
                        "more epochs old (default: xmc_engine.config.BACK_TO_BEST_STALE_Z)")
    _common.add_device_args(p)
    p.add_argument("--out", default=None,
                   help="results file (default: bench/results/<option>.json)")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                   help="train nothing: pair the runs of two results files of this benchmark "
                        "(two commits, the same command) by dataset, epochs, setting and seed")
    args = p.parse_args(argv)
    opt = args.option
    if args.compare:
        before, after = (_common.read_json(f) for f in args.compare)
        if before is None or after is None:
            p.error(f"--compare: cannot read {args.compare}")
        print_compare(compare(before, after, opt), opt, before, after)
        return 0
    out = args.out or str(_common.RESULTS_DIR / f"{opt}.json")
    params = _common.device_params(args)
    from xmc_engine import config

    for name in ("back_to_best_z", "back_to_best_stale_z"):
        value = getattr(args, name)
        if value is not None:
            if opt != "back_to_best":
                p.error(f"--{name.replace('_', '-')} goes with --option back_to_best")
            setattr(config, name.upper(), value)  # read at each halving

    import bench_defaults

    meta = _common.result_metadata()
    rows = []
    print(f"{'data':<18} {'ep':>4} {'seed':>4} {opt[:5]:<5} {'loss':<8} {'wall s':>7} "
          f"{'probe':>6} {'train':>6} {'P@1':>7} {'P@3':>7} {'P@5':>7}")
    for name in args.datasets:
        X, Y, X_test, Y_test = bench_defaults.load_any(name)
        _common.warm_engine(X, Y, **params)
        for epochs in args.epochs:
            for seed in args.seeds:
                for on in ((True, False) if seed % 2 == 0 else (False, True)):
                    r = {"dataset": name, **params,
                         **run_one(X, Y, X_test, Y_test, epochs, seed, on, opt, **params)}
                    rows.append(r)
                    print(f"{name:<18} {epochs:>4g} {seed:>4} {'on' if on else 'off':<5} "
                          f"{r['loss']:<8} {r['wall_s']:>7.2f} {r['probe_s']:>6.2f} "
                          f"{r['train_time']:>6.2f} "
                          + " ".join(f"{r[k]:>7.4f}" for k in METRICS)
                          + (f"  (epoch {r['kept_epoch']}'s model)" if r["kept_epoch"] else "")
                          + "".join(f"  (after epoch {e}: back to {b}, z {z:.2f})"
                                    for e, b, z in r["went_back"]),
                          flush=True)
    summary = summarise(rows, opt)
    print(f"\nmeans over seeds, {opt} on / off, and the mean paired difference "
          "(on - off) +- its standard error")
    print(f"{'data':<18} {'ep':>4} {'seeds':>5} "
          + " ".join(f"{k:>30}" for k in (*METRICS, "fit_s")))
    for line in summary:
        cells = []
        for key in (*METRICS, "fit_s"):
            c = line[key]
            m, se = c["diff"]
            cells.append(f"{c['on']:.4f} / {c['off']:.4f} {m:+.4f}+-{se:.4f}")
        print(f"{line['dataset']:<18} {line['epochs']:>4g} {line['seeds']:>5} "
              + " ".join(f"{x:>30}" for x in cells))
    margin = ({"back_to_best_z": config.BACK_TO_BEST_Z,
               "back_to_best_stale_z": config.BACK_TO_BEST_STALE_Z}
              if opt == "back_to_best" else {})
    _common.write_result(out, {**meta, "benchmark": opt, **margin, "epochs": args.epochs,
                               "seeds": args.seeds, "params": params, "rows": rows,
                               "summary": summary})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
