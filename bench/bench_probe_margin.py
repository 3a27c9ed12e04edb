"""The loss probe's margin over seeds: what ``loss="auto"`` saw and picked, per seed.

For each seed, ``XMCClassifier`` with the defaults (and the seed) fits the data and stops
training half a second after its start (``max_train_seconds=0.5``), so what is measured is the
probe (:func:`xmc_engine.training.choose_loss`): the run log's ``loss_probe`` record gives the
held-out P@1 of both losses' fits, the softmax's paired margin ``z`` in standard errors, the
margin it had to exceed, the loss picked and the probe's seconds, and where the probe looked
twice (:func:`xmc_engine.training.second_look_samples`) what its first look saw.
``--probe-samples N`` sets :data:`xmc_engine.config.LOSS_PROBE_SAMPLES` for the run (a study of
the probe's length; the held-out rows and a batch must still remain); ``--second-look-share S``
sets :data:`xmc_engine.config.LOSS_PROBE_SECOND_LOOK_SHARE` (0: the probe looks once, as before
the second look).

The question it answers: does one margin (:data:`~xmc_engine.config.LOSS_PROBE_SOFTMAX_Z`,
:data:`~xmc_engine.config.LOSS_PROBE_SOFTMAX_Z_SAMPLED`) separate the sets where the softmax
is far ahead from those where the logistic loss is (``bench/bench_loss_rule.py`` measures
which loss is ahead after the whole run).

Usage::

    python bench/bench_probe_margin.py --data debian_builddeps --seeds 0-39
    python bench/bench_probe_margin.py --data synthetic-amazon670k --seeds 0-14
    python bench/bench_probe_margin.py --data synthetic-amazon670k --seeds 0-14 \\
        --probe-samples 81741

Results: ``bench/results/probe_margin/<data>[_samples<N>].json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

KEYS = ("loss", "z", "margin", "p1", "rows", "heldout", "seconds", "first_look")


def seeds_arg(text: str) -> list[int]:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]``."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def probe_record(X, Y, seed: int) -> dict:
    """The ``loss_probe`` record of a default fit with ``seed``, stopped after the probe."""
    from xmc_engine import XMCClassifier

    clf = XMCClassifier(seed=seed, eval_every=0, max_train_seconds=0.5).fit(X, Y)
    rec = next((r for r in clf.history_ if r.get("event") == "loss_probe"), None)
    if rec is None or not rec["rows"]:
        raise SystemExit(f"seed {seed}: the fit ran no loss probe (too few rows, or a loss "
                         f"was given)")
    return {k: rec.get(k) for k in KEYS}  # first_look: None where the probe looked once


def summary(rows: list[dict]) -> dict:
    z = np.array([r["z"] for r in rows], dtype=np.float64)
    return {"seeds": len(rows), "z_min": float(z.min()), "z_q25": float(np.quantile(z, 0.25)),
            "z_median": float(np.median(z)), "z_q75": float(np.quantile(z, 0.75)),
            "z_max": float(z.max()),
            "picked": {loss: sum(r["loss"] == loss for r in rows) for loss in ("softmax", "bce")},
            "second_looks": sum(bool(r.get("first_look")) for r in rows),
            "seconds_median": float(np.median([r["seconds"] for r in rows]))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True,
                   help="a shared dataset or a synthetic name (synthetic-amazon670k)")
    p.add_argument("--seeds", type=seeds_arg, default=seeds_arg("0-9"), help="e.g. 0-14 or 0,3,5")
    p.add_argument("--probe-samples", type=int, default=None,
                   help="LOSS_PROBE_SAMPLES for these runs (default: the engine's)")
    p.add_argument("--second-look-share", type=float, default=None,
                   help="LOSS_PROBE_SECOND_LOOK_SHARE for these runs (0: no second look)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from xmc_engine import config

    if args.probe_samples is not None:
        if args.probe_samples < 1:
            p.error("--probe-samples must be >= 1")
        config.LOSS_PROBE_SAMPLES = args.probe_samples
    if args.second_look_share is not None:
        if not 0 <= args.second_look_share <= 1:
            p.error("--second-look-share must be within [0, 1]")
        config.LOSS_PROBE_SECOND_LOOK_SHARE = args.second_look_share
    suffix = ("" if args.probe_samples is None else f"_samples{args.probe_samples}") + (
        "" if args.second_look_share is None else f"_look{args.second_look_share:g}")
    out = args.out or str(_common.RESULTS_DIR / "probe_margin" / f"{args.data}{suffix}.json")
    t0 = time.perf_counter()
    if args.data.startswith("synthetic"):
        from xmc_engine.datasets import load_dataset

        X, Y, _, _ = load_dataset(args.data)  # generated, seeded
    else:
        X, Y, _, _ = _common.load_dataset(args.data)
    print(f"{args.data}: {X.shape[0]:,} rows, {Y.shape[1]:,} labels (loaded in "
          f"{time.perf_counter() - t0:.0f} s); probe samples {config.LOSS_PROBE_SAMPLES:,}",
          flush=True)
    rows = []
    for seed in args.seeds:
        row = {"seed": seed, **probe_record(X, Y, seed)}
        rows.append(row)
        print(f"seed {seed:3d}: z {row['z']:+6.2f} (needs > {row['margin']:g}) -> "
              f"{row['loss']:7s} held-out P@1 softmax {row['p1']['softmax']:.4f} bce "
              f"{row['p1']['bce']:.4f}, {row['rows']:,} rows, {row['seconds']:.1f} s"
              + (f" (a second look: the first, after {row['first_look']['rows']:,} rows, "
                 f"{row['first_look']['z']:+.2f} -> {row['first_look']['loss']})"
                 if row["first_look"] else ""), flush=True)
    s = summary(rows)
    print(f"z over {s['seeds']} seeds: min {s['z_min']:+.2f}, quartiles {s['z_q25']:+.2f} / "
          f"{s['z_median']:+.2f} / {s['z_q75']:+.2f}, max {s['z_max']:+.2f}; picked "
          f"{s['picked']}; probe {s['seconds_median']:.1f} s (median)")
    path = _common.write_result(out, {**_common.result_metadata(), "data": args.data,
                                      "probe_samples": config.LOSS_PROBE_SAMPLES,
                                      "second_look_share": config.LOSS_PROBE_SECOND_LOOK_SHARE,
                                      "summary": s, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
