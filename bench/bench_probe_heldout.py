"""How many rows should ``loss="auto"``'s probe hold out? The held-out rows score the two
losses; fewer of them make the probe's score noisier, and on a set of under
``LOSS_PROBE_SAMPLES`` rows leave its fits more of the first epoch to train. (Measured at
``901da37``, when the fits trained a sample of their own and the continued run trained the
held-out rows first; since ``887ff5b`` the fits train the start of the run's first epoch and
the held-out rows are the ones it trains next.)

    python bench/bench_probe_heldout.py --datasets bibtex corel5k stackex_cooking stackex_cs \\
        delicious rcv1sub1 debian_debtags debian_builddeps synth1k --shares 0.1 0.05 \\
        --seeds 0 1 2 3 4 5 6 7 8 9 --out bench/results/probe_heldout.json

Each run is ``XMCClassifier(epochs=E, seed=s).fit(X, Y)`` with the defaults, with
``config.LOSS_PROBE_HELDOUT_SHARE`` set to each of ``--shares`` (the probe holds out that share
of the rows, at most ``LOSS_PROBE_HELDOUT``). Per dataset and seed the shares train one after
the other (their order turns with the seed). Printed per run: the held-out rows, the loss the
probe picked, the softmax's margin ``z``, the wall time of ``fit`` and the test P@1 / P@3 /
P@5; per dataset and share the means, and the mean paired difference against the first share
with its standard error. Names are those of ``bench_defaults.py``.
"""

from __future__ import annotations

import argparse
import sys
import time

import _common
import bench_defaults

METRICS = ("P@1", "P@3", "P@5")


def run_one(data, share: float, seed: int, epochs: float) -> dict:
    import xmc_engine.config as config
    from xmc_engine import XMCClassifier

    X, Y, X_test, Y_test = data
    default = config.LOSS_PROBE_HELDOUT_SHARE
    config.LOSS_PROBE_HELDOUT_SHARE = share
    try:
        t0 = time.perf_counter()
        clf = XMCClassifier(epochs=epochs, seed=seed, eval_every=0).fit(X, Y)
        wall = time.perf_counter() - t0
    finally:
        config.LOSS_PROBE_HELDOUT_SHARE = default
    probe = next(r for r in clf.history_ if r["event"] == "loss_probe")
    scores = clf.evaluate(X_test, Y_test, ks=(1, 3, 5))
    return {"share": share, "seed": seed, "heldout": probe["heldout"], "loss": clf.loss_,
            "z": probe["z"], "wall_s": wall, **{k: float(scores[k]) for k in METRICS}}


def summarise(rows: list[dict], shares: list[float]) -> list[dict]:
    """Per dataset and share: mean metrics and wall time, the seeds that trained the logistic
    loss, and the mean paired difference of each metric against ``shares[0]``."""
    out = []
    for name in dict.fromkeys(r["dataset"] for r in rows):
        by = {(r["share"], r["seed"]): r for r in rows if r["dataset"] == name}
        seeds = sorted({s for _, s in by if all((sh, s) in by for sh in shares)})
        for share in shares:
            runs = [by[share, s] for s in seeds]
            line = {"dataset": name, "share": share, "seeds": len(seeds),
                    "heldout": runs[0]["heldout"],
                    "bce": sum(r["loss"] == "bce" for r in runs),
                    "wall_s": sum(r["wall_s"] for r in runs) / len(runs)}
            for k in METRICS:
                line[k] = sum(r[k] for r in runs) / len(runs)
                line[f"{k}_diff"] = _common.mean_se([by[share, s][k] - by[shares[0], s][k]
                                                     for s in seeds])
            out.append(line)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=["bibtex", "corel5k", "stackex_cooking"])
    p.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.05])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=float, default=5)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "probe_heldout.json"))
    args = p.parse_args(argv)
    meta = _common.result_metadata()
    rows = []
    print(f"{'data':<18} {'share':>5} {'seed':>4} {'held':>5} {'loss':<8} {'z':>6} {'wall s':>7} "
          + " ".join(f"{k:>7}" for k in METRICS))
    for name, X, Y, Xt, Yt, _ in bench_defaults.datasets_present(args.datasets, 10**12):
        for seed in args.seeds:
            turn = seed % len(args.shares)
            for share in args.shares[turn:] + args.shares[:turn]:
                r = {"dataset": name, **run_one((X, Y, Xt, Yt), share, seed, args.epochs)}
                rows.append(r)
                z = f"{r['z']:+6.1f}" if r["z"] is not None else f"{'-':>6}"
                print(f"{name:<18} {share:>5g} {seed:>4} {r['heldout']:>5} {r['loss']:<8} {z} "
                      f"{r['wall_s']:>7.2f} " + " ".join(f"{r[k]:>7.4f}" for k in METRICS),
                      flush=True)
    summary = summarise(rows, args.shares)
    print(f"\nmeans over seeds; in brackets the mean paired difference against share "
          f"{args.shares[0]:g} +- its standard error")
    print("| data | share | held-out rows | seeds on bce | wall s | "
          + " | ".join(METRICS) + " |")
    print("|---|---:|---:|---:|---:|" + "---|" * len(METRICS))
    for line in summary:
        cells = [f"{line[k]:.4f} ({line[f'{k}_diff'][0]:+.4f} +- {line[f'{k}_diff'][1]:.4f})"
                 for k in METRICS]
        print(f"| {line['dataset']} | {line['share']:g} | {line['heldout']} | {line['bce']} | "
              f"{line['wall_s']:.2f} | " + " | ".join(cells) + " |")
    _common.write_result(args.out, {**meta, "benchmark": "probe_heldout",
                                    "epochs": args.epochs, "seeds": args.seeds,
                                    "shares": args.shares, "rows": rows, "summary": summary})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
