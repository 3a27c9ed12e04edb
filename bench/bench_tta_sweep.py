"""Time to a fixed P@1 for a few engine configurations, over several seeds, in one run: the quick
comparison behind a default (e.g. ``merge_period``), without the whole study of
``bench_time_to_accuracy.py`` (no learning-rate tuning, no baselines).

Each ``--config`` is a JSON object: ``algorithm``, ``devices``, ``lr``, and optionally ``params``
(the algorithm's options), ``batch_size`` (the base batch ``B`` of that configuration alone) and
``label``. Every run uses Adagrad by default, no warm-up, and
evaluates every ``--eval-every`` epochs (on several devices: at the next merge barrier); the time
to ``--target`` is interpolated between evaluations (``_tta.time_to_target``). Seeds run in the
outer loop, so that a drift of the machine's speed falls on every configuration alike. The table
gives, per configuration, the median and quartiles of the time over seeds, the median epoch of
the first evaluation at or above the target, and the final P@1. The results file is written
after every seed (``"complete": false`` until the last one), so a sweep stopped early keeps the
seeds it finished.

The committed runs (``bench/results/tta_sweep/``; the targets and learning rates are the
committed study's, ``bench/results/tta/*_2dev.json``)::

    A='"algorithm": "adaptive", "devices": "cpu,cpu@0.5", "lr": 0.1'
    python bench/bench_tta_sweep.py --data debian_debtags --hidden 256 --target 0.8059 \
        --lr-decay 0 --epochs 1.5 --seeds $(seq 0 14) \
        --config '{"algorithm": "single", "devices": "cpu", "lr": 0.1}' \
        --config "{$A, \"params\": {\"merge_period\": 4096}}" \
        --config "{$A, \"params\": {\"merge_period\": 8192}}" \
        --config "{$A, \"params\": {\"merge_period\": 2048}}" \
        --config "{$A, \"params\": {\"merge_period\": 4096, \"sparse_merge\": false}}"
    A='"algorithm": "adaptive", "devices": "cpu,cpu@0.5", "lr": 0.05'
    python bench/bench_tta_sweep.py --data delicious --hidden 512 --target 0.6243 \
        --lr-decay 1 --epochs 2.5 --seeds $(seq 0 11) \
        --config '{"algorithm": "single", "devices": "cpu", "lr": 0.05}' \
        --config "{$A, \"params\": {\"merge_period\": 4096}}" \
        --config "{$A, \"params\": {\"merge_period\": 8192}}" \
        --config '{"algorithm": "adaptive", "devices": "cpu,cpu", "lr": 0.05}' \
        --config '{"algorithm": "average", "devices": "cpu,cpu", "lr": 0.05}'

The central momentum (``*_momentum.json``): the same two commands with ``--seeds $(seq 0 9)``,
``--out bench/results/tta_sweep/<dataset>_momentum.json`` and the configurations
``{$A, "params": {"momentum": M}}`` for M = 0.0, 0.5, 0.9.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import _tta  # noqa: E402


def parse_config(text: str) -> dict:
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--config is not JSON ({e}): {text!r}") from None
    if not isinstance(cfg, dict) or any(k not in cfg for k in ("algorithm", "devices")):
        raise argparse.ArgumentTypeError(f"--config needs algorithm and devices: {text!r}")
    if not isinstance(cfg.get("train", {}), dict):
        raise argparse.ArgumentTypeError(f"--config train must be an object of XMCClassifier "
                                         f"options: {text!r}")
    b = cfg.get("batch_size")
    if b is not None and (type(b) is not int or b < 1):
        raise argparse.ArgumentTypeError(f"--config batch_size must be a positive integer, got "
                                         f"{b!r}: {text!r}")
    return _complete(cfg)


def _complete(cfg: dict) -> dict:
    """Fill a configuration's optional keys: ``lr`` (``None``: the engine's default),
    ``lr_decay`` (``None``: ``--lr-decay``), ``batch_size`` (``None``: ``--batch-size``),
    ``params``, ``train`` (other ``XMCClassifier`` options of this configuration alone, e.g.
    ``optimizer``, ``loss``, ``output``), ``threads`` (``None``: the device set's share of the
    cores), ``setups`` (the
    device sets whose table lists it; default its own) and ``label``."""
    cfg.setdefault("lr", None)
    cfg.setdefault("lr_decay", None)
    cfg.setdefault("batch_size", None)
    cfg.setdefault("params", {})
    cfg.setdefault("threads", None)
    cfg.setdefault("train", {})
    cfg.setdefault("setups", [cfg["devices"]])
    cfg.setdefault("label", " ".join(
        [cfg["algorithm"], cfg["devices"]]
        + ([f"lr {cfg['lr']}"] if cfg["lr"] is not None else [])
        + ([f"decay {cfg['lr_decay']}"] if cfg["lr_decay"] is not None else [])
        + ([f"B {cfg['batch_size']}"] if cfg["batch_size"] is not None else [])
        + ([f"threads {cfg['threads']}"] if cfg["threads"] is not None else [])
        + [f"{k}={v}" for k, v in cfg["train"].items()]
        + [f"{k}={v}" for k, v in cfg["params"].items()]))
    return cfg


#: The algorithms ``--methods`` compares on a device set, besides one device alone.
MULTI_DEVICE = ("adaptive", "sync", "average", "easgd", "crossbow")


def standard_configs(device_sets) -> list[dict]:
    """Issue 15's comparison, engine defaults only: on each device set every multi-device
    algorithm, and ``single`` on the set's fastest device alone with that device's thread share.
    A ``single`` that several sets share (same device, same threads) is run once."""
    from xmc_engine.devices import parse_devices

    configs: list[dict] = []
    singles: dict[tuple, dict] = {}
    for spec in device_sets:
        devs = parse_devices(spec)
        fast = max(devs, key=lambda d: d.speed)
        name = fast.kind if fast.kind == "cpu" else f"{fast.kind}:{fast.idx}"
        key = (name, fast.threads)
        if key in singles:
            singles[key]["setups"].append(spec)
        else:
            singles[key] = _complete({"algorithm": "single", "devices": name,
                                      "threads": fast.threads, "setups": [spec]})
            configs.append(singles[key])
        configs += [_complete({"algorithm": a, "devices": spec}) for a in MULTI_DEVICE]
    return configs


def median_quartiles(times) -> tuple[float, float, float]:
    """Median and quartiles of times to target; ``inf`` (never reached) counts as the slowest.

    The quartiles take the nearest sample (no interpolation), so a quartile next to an ``inf``
    is ``inf`` rather than NaN (``inf - inf``)."""
    t = np.asarray(times, dtype=np.float64)
    q1, q3 = np.quantile(t, [0.25, 0.75], method="nearest")
    return float(np.median(t)), float(q1), float(q3)


def subset_test(data, n_rows: int | None):
    """``data`` with only the first ``n_rows`` test rows (``None``: all): evaluation dominates a
    sweep's wall time on the larger sets, and every configuration sees the same rows."""
    if n_rows is None:
        return data
    Xtr, Ytr, Xte, Yte = data
    return Xtr, Ytr, Xte[:n_rows], Yte[:n_rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="dataset name or path, or synthetic:N:FEATURES:LABELS")
    p.add_argument("--from-results", nargs="+", metavar="JSON", default=None,
                   help="run nothing: print the saved sweeps' tables as Markdown")
    p.add_argument("--summary", action="store_true",
                   help="with --from-results: one table, a row per dataset and device set")
    p.add_argument("--at-seconds", type=float, nargs="+", default=None, metavar="T",
                   help="with --from-results: each configuration's median P@1 after T training "
                        "seconds (equal time rather than equal epochs)")
    p.add_argument("--peak", action="store_true",
                   help="with --from-results --summary: one more column, adaptive's median "
                        "peak P@1 (each run's highest evaluation) against the best algorithm's")
    p.add_argument("--per-set-target", action="store_true",
                   help="with --from-results --summary or --ablation: each device set's own "
                        "target, --target-frac x the best median best P@1 of that set's "
                        "configurations (one device alone included), the times read again "
                        "from the saved curves")
    p.add_argument("--decompose", action="store_true",
                   help="with --from-results: per dataset and device set, adaptive's time to "
                        "the set's own target over one device's, split into the epochs each "
                        "needed and the seconds each took per epoch")
    p.add_argument("--against", default="single", metavar="ALGORITHM",
                   help="with --decompose: the method adaptive is set against (default: single, "
                        "one device alone; e.g. average, on the same device set)")
    p.add_argument("--levels", type=float, nargs="+", default=None, metavar="F",
                   help="with --decompose: the median epochs one device and adaptive needed to "
                        "reach each fraction F of the set's best P@1, and their ratio")
    p.add_argument("--ablation", action="store_true",
                   help="with --from-results: one table, a row per option, a column per "
                        "dataset and device set: the option's time and final P@1 against the "
                        "same algorithm's defaults")
    p.add_argument("--config", type=parse_config, action="append", default=[])
    p.add_argument("--methods", action="append", default=[], metavar="DEVICES",
                   help="add the standard comparison on this device set: every multi-device "
                        "algorithm and the set's fastest device alone (repeatable)")
    p.add_argument("--target", type=float, default=None,
                   help="P@1 to reach (default: --target-frac x the best configuration's "
                        "median best P@1)")
    p.add_argument("--target-frac", type=float, default=0.97)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--hidden", type=int, default=None, help="default: the engine's")
    p.add_argument("--batch-size", type=int, default=None, help="default: the engine's")
    p.add_argument("--optimizer", default=None, help="default: the engine's")
    p.add_argument("--loss", default=None, choices=("softmax", "bce"),
                   help="training loss of every configuration (default: the engine's)")
    p.add_argument("--lr-decay", type=float, default=None, help="default: the engine's")
    p.add_argument("--warmup-epochs", type=float, default=None,
                   help="default: each algorithm's own (the engine's)")
    p.add_argument("--eval-every", type=float, default=0.125)
    p.add_argument("--test-rows", type=int, default=None,
                   help="evaluate on the first N test rows only (default: all)")
    p.add_argument("--out", default=None, help="results JSON (default: "
                   "bench/results/tta_sweep/<dataset>.json)")
    args = p.parse_args(argv)
    if args.from_results:
        results = [json.loads(Path(f).read_text(encoding="utf-8")) for f in args.from_results]
        if args.at_seconds:
            for result in results:
                print_at_seconds(result, args.at_seconds)
        elif args.decompose and args.levels:
            print_levels(results, args.levels)
        elif args.decompose:
            print_decomposition(results, args.target_frac, args.against)
        elif args.summary:
            print_summary(results, args.target_frac if args.per_set_target else None,
                          peak=args.peak)
        elif args.ablation:
            print_ablation(results, args.target_frac if args.per_set_target else None)
        else:
            for path, result in zip(args.from_results, results, strict=True):
                print_markdown(result, path)
        return 0
    if not args.data:
        p.error("--data is required (or --from-results)")
    configs = args.config + standard_configs(args.methods)
    if not configs:
        p.error("give at least one --config or --methods")
    meta = _common.result_metadata()

    data = subset_test(_tta.load_data(args.data), args.test_rows)
    out = Path(args.out or _common.RESULTS_DIR / "tta_sweep" / f"{_tta.data_tag(args.data)}.json")
    methods = [_tta.Method(cfg["label"], cfg["algorithm"], cfg["devices"], dict(cfg["params"]),
                           lr=cfg["lr"], threads=cfg["threads"], batch_size=cfg["batch_size"],
                           lr_decay=cfg["lr_decay"], train=dict(cfg["train"]))
               for cfg in configs]
    runs: list[list[dict]] = [[] for _ in methods]
    # Seeds outside, configurations inside: a drift of the machine's speed during the sweep
    # then falls on every configuration alike.
    for seed in args.seeds:
        for m, acc in zip(methods, runs, strict=True):
            r = _tta.run_method(m, data, epochs=args.epochs, lr=m.lr, batch_size=args.batch_size,
                                hidden=args.hidden, seed=seed, optimizer=args.optimizer,
                                loss=args.loss,
                                lr_decay=args.lr_decay, warmup_epochs=args.warmup_epochs,
                                eval_every=args.eval_every)
            acc.append({"seed": seed, "lr": r["lr"], "best_P@1": r["best_P@1"],
                        "final_P@1": r["final"]["P@1"],
                        "rows_single_share": r["rows_single_share"], "curve": r["curve"]})
        # the seeds done so far on disk (complete: false until the last), so that a sweep
        # stopped early keeps them
        last = seed == args.seeds[-1]
        target, rows = sweep_rows(configs, runs, args.target, args.target_frac)
        path = _common.write_result(out, {
            **meta, "benchmark": "tta_sweep", "target_P@1": target, "complete": last,
            "args": {k: v for k, v in vars(args).items() if k not in ("config", "methods")},
            "device_sets": args.methods, "rows": rows})
        print(f"  seed {seed} done", flush=True)
    print_tables(rows, target)
    print(f"wrote {path}")
    return 0


def sweep_rows(configs, runs, target, target_frac):
    """``(target, rows)`` of a sweep's runs so far: ``target`` (``None``: ``target_frac`` x the
    best configuration's median best P@1) and per configuration its time to it (median and
    quartiles over seeds), the median epoch at it, the final P@1s and the runs themselves."""
    if target is None:
        target = target_frac * max(float(np.median([x["best_P@1"] for x in acc]))
                                   for acc in runs)
    rows = []
    for cfg, acc in zip(configs, runs, strict=True):
        for x in acc:
            x["time_to_target_s"] = _tta.time_to_target(x["curve"], target)
            x["epoch_at_target"] = next((c[1] for c in x["curve"] if c[2] >= target), None)
        ep = np.array([np.inf if x["epoch_at_target"] is None else x["epoch_at_target"]
                       for x in acc])
        med, q1, q3 = median_quartiles([x["time_to_target_s"] for x in acc])
        finals = [x["final_P@1"] for x in acc]
        shares = [x["rows_single_share"] for x in acc if x["rows_single_share"] is not None]
        rows.append({"config": cfg, "median_time_to_target_s": med, "quartiles_s": [q1, q3],
                     "median_epoch_at_target": float(np.median(ep)),
                     "final_P@1": float(np.median(finals)), "final_P@1_runs": finals,
                     "rows_single_share": float(np.mean(shares)) if shares else None,
                     "runs": acc})
    return target, rows


def by_setup(rows):
    """``(setup, rows, reference)`` per device set in order of first appearance: the rows whose
    table lists the set, and the median time to the target of ``adaptive`` with its defaults (no
    ``params``) on that set (``inf`` for never reached, also as read back from JSON; ``None``
    where the set has no such row)."""
    for setup in dict.fromkeys(s for r in rows for s in r["config"]["setups"]):
        mine = [r for r in rows if setup in r["config"]["setups"]]
        ref = next((_time(r["median_time_to_target_s"]) for r in mine
                    if r["config"]["algorithm"] == "adaptive"
                    and r["config"]["devices"] == setup and not r["config"]["params"]), None)
        yield setup, mine, ref


def print_tables(rows, target: float) -> None:
    """One table per device set: median and quartiles of the time to ``target``, the ratio to
    ``adaptive`` with its defaults on that set (above 1: slower than adaptive), median epoch at
    the target, median final P@1 and the share of changed W1 rows that one replica alone
    changed."""
    print(f"target P@1 {target:.4f}")
    for setup, mine, ref in by_setup(rows):
        print(f"\n{setup}")
        print(f"{'configuration':46s} {'median s':>9s} {'quartiles s':>13s} {'x adaptive':>10s} "
              f"{'epoch':>6s} {'final P@1':>9s} {'1-replica rows':>14s}")
        for r in mine:
            med, (q1, q3) = r["median_time_to_target_s"], r["quartiles_s"]
            ratio = med / ref if ref and np.isfinite(ref) else float("nan")
            share = r["rows_single_share"]
            print(f"{r['config']['label'][:46]:46s} {med:9.3f} {q1:6.2f}-{q3:<6.2f} "
                  f"{ratio:10.2f} {r['median_epoch_at_target']:6.2f} {r['final_P@1']:9.4f} "
                  f"{'' if share is None else f'{share:14.3f}'}", flush=True)


def _time(t) -> float:
    """A time read back from JSON, where ``inf`` (never reached) was written as ``null``."""
    return np.inf if t is None else float(t)


def _fmt_s(t: float) -> str:
    return "not reached" if not np.isfinite(t) else f"{t:.2f}"


def print_markdown(result: dict, path: str = "") -> None:
    """A saved sweep as Markdown: one table per device set, the columns of
    :func:`print_tables` plus the per-seed final P@1 range."""
    rows = result["rows"]
    print(f"\n{path}: {result['args']['data']}, target P@1 {result['target_P@1']:.4f}, "
          f"{len(rows[0]['runs'])} seeds, commit {str(result.get('git_commit'))[:7]}")
    for setup, mine, ref in by_setup(rows):
        print(f"\n`{setup}`\n")
        print("| configuration | median s to target | quartiles | x adaptive | epoch at target "
              "| final P@1 (median, range) |")
        print("|---|---:|---|---:|---:|---|")
        for r in mine:
            med, q1, q3 = (_time(t) for t in (r["median_time_to_target_s"],
                                              *r["quartiles_s"]))
            ratio = (f"{med / ref:.2f}" if ref and np.isfinite(ref) and np.isfinite(med)
                     else "")
            ep = _time(r["median_epoch_at_target"])
            finals = r["final_P@1_runs"]
            print(f"| {r['config']['label']} | {_fmt_s(med)} | {_fmt_s(q1)}-{_fmt_s(q3)} | "
                  f"{ratio} | {'' if not np.isfinite(ep) else f'{ep:.2f}'} | "
                  f"{np.median(finals):.4f} ({min(finals):.4f}-{max(finals):.4f}) |")


def _median_peak(row) -> float:
    """A configuration's median over seeds of each run's highest evaluated P@1."""
    return float(np.median([x["best_P@1"] for x in row["runs"]]))


def set_target(listed, frac: float) -> tuple[float, dict[int, float]]:
    """A device set's own target, ``frac`` x the best median (over seeds) best P@1 of its
    configurations ``listed``, and each configuration's median time to it (by ``id``), read
    again from the saved curves (``inf``: never reached)."""
    best = max(_median_peak(r) for r in listed)
    target = frac * best
    return target, {id(r): median_quartiles([_tta.time_to_target(x["curve"], target)
                                             for x in r["runs"]])[0] for r in listed}


def _best_of(medians: dict[str, float]) -> str:
    """``adaptive``'s median against the highest algorithm's, as a summary cell."""
    best = max(medians, key=medians.get)
    return f"{medians['adaptive']:.4f} / {medians[best]:.4f} ({best})"


def print_summary(results, per_set_frac: float | None = None, peak: bool = False) -> None:
    """Saved sweeps of ``--methods`` as one Markdown table: per dataset and device set, each
    algorithm's median time to the target (its ratio to ``adaptive`` in brackets), then
    ``adaptive``'s median final P@1 against the best algorithm's. ``per_set_frac``: each
    device set's own target (:func:`set_target`) instead of the file's, in its own column.
    ``peak``: one more column, the same for each run's highest evaluated P@1 along the run
    (where a set overfits, the final P@1 favours the algorithm that learns slowest)."""
    algos = ("single", "adaptive", "sync", "average", "easgd", "crossbow")
    target_col = " target |" if per_set_frac else ""
    print("| data | devices |" + target_col + " " + " | ".join(algos)
          + " | final P@1 adaptive / best |" + (" peak P@1 adaptive / best |" if peak else ""))
    print("|---|---|" + ("---:|" if per_set_frac else "") + "---:|" * len(algos) + "---|"
          + ("---|" if peak else ""))
    for result in results:
        rows = [r for r in result["rows"] if not r["config"]["params"]]
        for setup, listed, ref in by_setup(rows):
            mine = {r["config"]["algorithm"]: r for r in listed}
            times = {a: _time(r["median_time_to_target_s"]) for a, r in mine.items()}
            target = ""
            if per_set_frac:
                t_set, by_id = set_target(listed, per_set_frac)
                times = {a: by_id[id(r)] for a, r in mine.items()}
                ref = times.get("adaptive")
                target = f" {t_set:.4f} |"
            if "adaptive" not in mine:  # a set of one device's rows alone
                continue
            cells = []
            for a in algos:
                t = times[a] if a in mine else np.nan
                ratio = (f" ({t / ref:.2f})" if np.isfinite(t) and ref is not None
                         and np.isfinite(ref) else "")
                cells.append(_fmt_s(t) + ratio if a in mine else "")
            finals = {a: float(np.median(r["final_P@1_runs"])) for a, r in mine.items()}
            peaks = ""
            if peak:
                peaks = " " + _best_of({a: _median_peak(r) for a, r in mine.items()}) + " |"
            print(f"| {result['args']['data']} | `{setup}` |{target} " + " | ".join(cells)
                  + f" | {_best_of(finals)} |" + peaks)


def _at_target(run, target: float) -> tuple[float, float]:
    """``(epoch, seconds)`` where a saved run first reached ``target``, both interpolated
    between the evaluations around the crossing as :func:`_tta.time_to_target` interpolates
    the seconds (``inf`` for never)."""
    t = _tta.time_to_target(run["curve"], target)
    seconds = [0.0] + [c[0] for c in run["curve"]]
    epochs = [0.0] + [c[1] for c in run["curve"]]
    return float(np.interp(t, seconds, epochs)) if np.isfinite(t) else np.inf, t


def print_decomposition(results, frac: float, against: str = "single") -> None:
    """Why ``against`` (one device alone by default, or another method on the same device set)
    is sooner (or later) than ``adaptive`` on a device set: at the set's own target
    (:func:`set_target`), the median epochs each needed and the median of each run's training
    seconds per epoch up to the target; the time ratio is about their product."""
    name = "one device" if against == "single" else f"`{against}`"
    print(f"| data | devices | target | epochs: {name} / adaptive | s per epoch: {name} "
          f"/ adaptive | adaptive's time over {name}'s |")
    print("|---|---|---:|---|---|---:|")
    for result in results:
        rows = [r for r in result["rows"] if not r["config"]["params"]]
        for setup, listed, _ in by_setup(rows):
            mine = {r["config"]["algorithm"]: r for r in listed}
            if against not in mine or "adaptive" not in mine:
                continue
            target, times = set_target(listed, frac)
            stats = {}
            for a in (against, "adaptive"):
                at = [_at_target(x, target) for x in mine[a]["runs"]]
                rate = [t / e for e, t in at if np.isfinite(t) and e > 0]
                stats[a] = (float(np.median([e for e, _ in at])),
                            float(np.median(rate)) if rate else np.nan)
            (e1, r1), (e2, r2) = stats[against], stats["adaptive"]
            t1, t2 = times[id(mine[against])], times[id(mine["adaptive"])]
            ratio = f"{t2 / t1:.2f}" if np.isfinite(t1) and np.isfinite(t2) else ""
            print(f"| {result['args']['data']} | `{setup}` | {target:.4f} | {e1:.2f} / {e2:.2f} "
                  f"| {r1:.3f} / {r2:.3f} | {ratio} |")


def print_levels(results, levels) -> None:
    """Where averaging costs samples: per dataset and device set, the median epochs one device
    and ``adaptive`` (with its defaults, or with the options of each configuration that has
    some) needed to reach each fraction in ``levels`` of the set's best median best P@1, and
    their ratio (``inf``: the median run never reached it)."""
    print("| data | devices | configuration | " + " | ".join(f"{f:g} of the best" for f in levels)
          + " |")
    print("|---|---|---|" + "---|" * len(levels))
    for result in results:
        for setup, listed, _ in by_setup(result["rows"]):
            single = next((r for r in listed if r["config"]["algorithm"] == "single"), None)
            if single is None:
                continue
            best = max(_median_peak(r) for r in listed)
            ones = {f: float(np.median([_at_target(x, f * best)[0] for x in single["runs"]]))
                    for f in levels}
            for r in listed:
                if r["config"]["algorithm"] != "adaptive" or r["config"]["devices"] != setup:
                    continue
                cells = []
                for f in levels:
                    e = float(np.median([_at_target(x, f * best)[0] for x in r["runs"]]))
                    ratio = (f" ({e / ones[f]:.2f}x)" if np.isfinite(e) and np.isfinite(ones[f])
                             else "")
                    cells.append(f"{ones[f]:.2f} / {e:.2f}{ratio}")
                name = " ".join(["adaptive", *(f"{k}={v}" for k, v in
                                              r["config"]["params"].items())])
                print(f"| {result['args']['data']} | `{setup}` | {name} | "
                      + " | ".join(cells) + " |")


def p1_at(curve, seconds: float) -> float:
    """P@1 of the last evaluation at or before ``seconds`` of training (0 before the first)."""
    return next((c[2] for c in reversed(curve) if c[0] <= seconds), 0.0)


def print_at_seconds(result, seconds) -> None:
    """A saved sweep at equal training time: per configuration the median over seeds of the P@1
    reached after each of ``seconds`` (a run that ended sooner keeps its last P@1), and the
    median training time of the whole run."""
    print(f"\n{result['args']['data']}: median P@1 after T training seconds\n")
    print("| configuration | " + " | ".join(f"T = {t:g} s" for t in seconds)
          + " | run's training s |")
    print("|---|" + "---:|" * (len(seconds) + 1))
    for r in result["rows"]:
        cells = [f"{np.median([p1_at(x['curve'], t) for x in r['runs']]):.4f}" for t in seconds]
        end = np.median([x["curve"][-1][0] for x in r["runs"]])
        print(f"| {r['config']['label']} | " + " | ".join(cells) + f" | {end:.1f} |")


def print_ablation(results, per_set_frac: float | None = None) -> None:
    """Saved sweeps of one algorithm's options as one Markdown table: per dataset and device set
    (a row) and per option (a column), the ratio of its median time to the target to that of
    the same algorithm with no options on the same devices (below 1: sooner), and the
    difference of the median final P@1. ``per_set_frac``: each device set's own target
    (:func:`set_target` over that set's configurations, options included), in its own column,
    instead of the file's."""
    columns, cells, targets = [], {}, {}
    for result in results:
        times = {id(r): _time(r["median_time_to_target_s"]) for r in result["rows"]}
        if per_set_frac:
            for devices in dict.fromkeys(r["config"]["devices"] for r in result["rows"]):
                listed = [r for r in result["rows"] if r["config"]["devices"] == devices]
                t_set, by_id = set_target(listed, per_set_frac)
                targets[(result["args"]["data"], devices)] = t_set
                times.update(by_id)
        for r in result["rows"]:
            c = r["config"]
            if c["params"]:
                continue
            col = (result["args"]["data"], c["devices"])
            ref_t = times[id(r)]
            ref_p = float(np.median(r["final_P@1_runs"]))
            for o in result["rows"]:
                oc = o["config"]
                if oc["algorithm"] != c["algorithm"] or oc["devices"] != c["devices"] \
                        or not oc["params"]:
                    continue
                t = times[id(o)]
                ratio = f"{t / ref_t:.2f}" if np.isfinite(t) and np.isfinite(ref_t) else "-"
                dp = float(np.median(o["final_P@1_runs"])) - ref_p
                option = ", ".join(f"{k}={v}" for k, v in oc["params"].items())
                cells[(oc["algorithm"] + " " + option, col)] = f"{ratio} / {dp:+.3f}"
                columns.append(col)
    columns = list(dict.fromkeys(columns))
    options = list(dict.fromkeys(k[0] for k in cells))
    target_col = " target |" if per_set_frac else ""
    print("| data | devices |" + target_col + " " + " | ".join(options) + " |")
    print("|---|---|" + ("---:|" if per_set_frac else "") + "---|" * len(options))
    for col in columns:
        target = f" {targets[col]:.4f} |" if per_set_frac else ""
        print(f"| {col[0]} | `{col[1]}` |{target} "
              + " | ".join(cells.get((option, col), "") for option in options) + " |")


if __name__ == "__main__":
    sys.exit(main())
