"""Time to a fixed P@1 for a few engine configurations, over several seeds, in one run: the quick
comparison behind a default (e.g. ``merge_period``), without the whole study of
``bench_time_to_accuracy.py`` (no learning-rate tuning, no baselines).

Each ``--config`` is a JSON object: ``algorithm``, ``devices``, ``lr``, and optionally ``params``
(the algorithm's options) and ``label``. Every run uses Adagrad by default, no warm-up, and
evaluates every ``--eval-every`` epochs (on several devices: at the next merge barrier); the time
to ``--target`` is interpolated between evaluations (``_tta.time_to_target``). Seeds run in the
outer loop, so that a drift of the machine's speed falls on every configuration alike. The table
gives, per configuration, the median and quartiles of the time over seeds, the median epoch of
the first evaluation at or above the target, and the final P@1.

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
    if not isinstance(cfg, dict) or any(k not in cfg for k in ("algorithm", "devices", "lr")):
        raise argparse.ArgumentTypeError(f"--config needs algorithm, devices and lr: {text!r}")
    cfg.setdefault("params", {})
    cfg.setdefault("label", f"{cfg['algorithm']} {cfg['devices']} lr {cfg['lr']} "
                   + " ".join(f"{k}={v}" for k, v in cfg["params"].items()))
    return cfg


def median_quartiles(times) -> tuple[float, float, float]:
    """Median and quartiles of times to target; ``inf`` (never reached) counts as the slowest.

    The quartiles take the nearest sample (no interpolation), so a quartile next to an ``inf``
    is ``inf`` rather than NaN (``inf - inf``)."""
    t = np.asarray(times, dtype=np.float64)
    q1, q3 = np.quantile(t, [0.25, 0.75], method="nearest")
    return float(np.median(t)), float(q1), float(q3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--target", type=float, required=True, help="P@1 to reach")
    p.add_argument("--config", type=parse_config, action="append", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--optimizer", default="adagrad")
    p.add_argument("--lr-decay", type=float, default=0.0)
    p.add_argument("--eval-every", type=float, default=0.125)
    p.add_argument("--out", default=None, help="results JSON (default: "
                   "bench/results/tta_sweep/<dataset>.json)")
    args = p.parse_args(argv)
    meta = _common.result_metadata()

    data = _tta.load_data(args.data)
    out = Path(args.out or _common.RESULTS_DIR / "tta_sweep" / f"{_tta.data_tag(args.data)}.json")
    methods = [_tta.Method(cfg["label"], cfg["algorithm"], cfg["devices"], dict(cfg["params"]),
                           lr=float(cfg["lr"])) for cfg in args.config]
    runs: list[list[dict]] = [[] for _ in methods]
    # Seeds outside, configurations inside: a drift of the machine's speed during the sweep
    # then falls on every configuration alike.
    for seed in args.seeds:
        for m, acc in zip(methods, runs, strict=True):
            r = _tta.run_method(m, data, epochs=args.epochs, lr=m.lr, batch_size=args.batch_size,
                                hidden=args.hidden, seed=seed, optimizer=args.optimizer,
                                lr_decay=args.lr_decay, warmup_epochs=0.0,
                                eval_every=args.eval_every)
            acc.append({"seed": seed,
                        "time_to_target_s": _tta.time_to_target(r["curve"], args.target),
                        "epoch_at_target": next((c[1] for c in r["curve"]
                                                 if c[2] >= args.target), None),
                        "final_P@1": r["final"]["P@1"],
                        "rows_single_share": r["rows_single_share"], "curve": r["curve"]})
        print(f"  seed {seed} done", flush=True)
    rows = []
    print(f"{'configuration':58s} {'median s':>9s} {'quartiles s':>13s} {'median epoch':>12s} "
          f"{'final P@1':>9s} {'1-replica rows':>14s}")
    for cfg, acc in zip(args.config, runs, strict=True):
        ep = np.array([np.inf if x["epoch_at_target"] is None else x["epoch_at_target"]
                       for x in acc])
        med, q1, q3 = median_quartiles([x["time_to_target_s"] for x in acc])
        final = float(np.mean([x["final_P@1"] for x in acc]))
        shares = [x["rows_single_share"] for x in acc if x["rows_single_share"] is not None]
        share = float(np.mean(shares)) if shares else None
        rows.append({"config": cfg, "median_time_to_target_s": med, "quartiles_s": [q1, q3],
                     "median_epoch_at_target": float(np.median(ep)), "final_P@1": final,
                     "final_P@1_runs": [x["final_P@1"] for x in acc],
                     "rows_single_share": share, "runs": acc})
        print(f"{cfg['label'][:58]:58s} {med:9.3f} {q1:6.2f}-{q3:<6.2f} {np.median(ep):12.2f} "
              f"{final:9.4f} {'' if share is None else f'{share:14.3f}'}", flush=True)
    path = _common.write_result(out, {
        **meta, "benchmark": "tta_sweep",
        "args": {k: v for k, v in vars(args).items() if k != "config"}, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
