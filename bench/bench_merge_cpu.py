"""The host side of a merge on the CPU: the NaN/inf check and the broadcast copy, each against the
plain NumPy way, in the same run.

* check: ``find_nonfinite`` with the CPU backend (``all_finite``: a vectorised pass over the
  float32 bits) against NumPy's ``isfinite`` pass (the scheduler's ``HostBackend``);
* broadcast: ``CPUBackend.copy_into`` (numba parallel copy for large arrays) against
  ``np.copyto``;
* the weighted sum of the replicas (``weighted_merge``), for scale;
* a whole merge of ``W1`` (check, weighted sum, norm, broadcast) dense, against the row-sparse
  merge (``merge_rows`` + ``copy_rows`` per replica, what ``merge_changed_rows`` runs) over a
  random ``--touched`` fraction of the rows (0.59: debian_debtags, 4,096 samples per period).

``--touched-in DATASET [DATASET ...]`` prints, for each dataset, the fraction of its features
(rows of ``W1``) that a period of ``--period`` random training rows touches (mean of 5 periods),
and records it: what the row-sparse merge saves on that data.

``--in-runs DATASET [DATASET ...]`` (a shared dataset, or a synthetic shape
``synthetic:N_TRAIN:N_FEATURES:N_LABELS`` as ``bench_tta_sweep.py`` takes it) measures merges
where they happen: ``adaptive`` with the
defaults but ``--loss`` (``softmax``, the default here; ``bce``; ``auto``, the engine's default,
probes before every run) on ``--devices`` (``cpu,cpu@0.5``) for ``--epochs`` (1), ``--rounds``
runs per dataset (seeds 0, 1, ...), and prints per dataset the median milliseconds of a merge
(the run log's ``merge_s``, the devices waiting), the merges' share of the training time, and
the training seconds; where the first device trained the first periods alone
(``solo_epochs``), also the median of those merges and of one device's barriers at the same
period and seed. With the softmax the per-row / per-label merge weights apply (below
200,000 labels), with the logistic loss the paper's. Copied into an older checkout and run
there and here in turn, it is the before / after of a change to the merge::

    python bench/bench_merge_cpu.py --in-runs debian_debtags debian_builddeps delicious \
        --loss bce --out bench/results/merge_in_runs.json

``--shard-alternate`` alternates the row-sparse merges of each run between splitting the changed
rows of ``W1`` over the device workers (the engine's way from ``SHARD_MIN_VALUES`` values on)
and one pass on the main thread, and prints the median wall time of each: the two under the
same conditions, which separate runs on this shared machine are not (their merges moved by 2x
from run to run)::

    python bench/bench_merge_cpu.py --in-runs debian_debtags debian_builddeps rcv1sub1 \
        --devices cpu,cpu --loss bce --epochs 3 --rounds 3 --shard-alternate \
        --out bench/results/merge_shards/alternate_cpu_cpu.json

Default shape: two replicas of the debian_debtags model at hidden 256 (29,261 features, 590
labels: a 30 MB ``W1``). Usage::

    python bench/bench_merge_cpu.py [--n-features 29261] [--hidden 256] [--n-labels 590]

Results: ``bench/results/merge_cpu.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import _tta  # noqa: E402


def _ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls (after one warm-up call)."""
    return 1e3 * float(np.median(_common.timings(fn, repeats)))


def touched_fraction(name: str, period: int, periods: int = 5) -> float:
    """Mean fraction of ``name``'s features present in ``period`` random training rows."""
    X = _common.load_dataset(name)[0]
    rng = np.random.default_rng(0)
    fracs = []
    for _ in range(periods):
        rows = np.sort(rng.choice(X.shape[0], min(period, X.shape[0]), replace=False))
        fracs.append(np.unique(X[rows].indices).size / X.shape[1])
    return float(np.mean(fracs))


def _median_ms(seconds) -> float | None:
    return 1e3 * float(np.median(seconds)) if seconds else None


def in_runs(names, devices: str, epochs: float, rounds: int, loss: str,
            alternate: bool = False) -> list[dict]:
    """Per dataset, ``rounds`` runs of ``adaptive`` with the defaults but ``loss`` on
    ``devices``: the median merge (ms), the merges' share of the training seconds, and the
    training seconds. Where the first device trained periods alone (``solo_epochs``), also
    the median of those periods' merges and of the others (every device's), and of one
    device's barriers (``single`` on the same rows with ``adaptive``'s merge period, the same
    seed): what a solo period costs beyond one device's. With ``alternate`` the row-sparse
    merges (:func:`~xmc_engine.scheduler.merge.merge_changed_rows`, every device's, after the
    solo phase) alternate, within each run, between the engine's split of ``W1``'s changed
    rows over the device workers (from :data:`~xmc_engine.scheduler.merge.SHARD_MIN_VALUES`
    values on) and one pass on the main thread (the seed's parity picks which comes first);
    the row then gives each one's wall milliseconds (``split_merge_ms``,
    ``one_pass_merge_ms``): the two measured under the same conditions, merge by merge."""
    from xmc_engine import XMCClassifier
    from xmc_engine.algorithms import base
    from xmc_engine.scheduler import merge

    engine_min, real = merge.SHARD_MIN_VALUES, base.merge_changed_rows
    turn = [0]
    timed: dict[bool, list] = {True: [], False: []}  # split?: ms of each row-sparse merge

    def alternating(*args, **kwargs):  # even calls split (the engine's line), odd ones do not
        split = turn[0] % 2 == 0
        merge.SHARD_MIN_VALUES = engine_min if split else 1 << 62
        turn[0] += 1
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            timed[split].append(1e3 * (time.perf_counter() - t0))
            merge.SHARD_MIN_VALUES = engine_min

    out = []
    print(f"{'data':<18} {'loss':<8} {'merge ms (median)':>17} {'merges':>7} "
          f"{'share':>6} {'train s':>8} {'solo merge ms':>13} {'others ms':>9} "
          f"{'one device ms':>13}")
    for name in names:
        X, Y = (_tta.load_data(name) if name.startswith("synthetic:")
                else _common.load_dataset(name))[:2]
        _common.warm_engine(X, Y, devices=devices, algorithm="adaptive",
                            loss="softmax" if loss == "auto" else loss)
        for seed in range(rounds):
            turn[0] = seed % 2
            if alternate:
                base.merge_changed_rows = alternating
            try:
                clf = XMCClassifier(epochs=epochs, seed=seed, eval_every=0, devices=devices,
                                    algorithm="adaptive", loss=loss).fit(X, Y)
            finally:
                base.merge_changed_rows = real
            records = [r for r in clf.history_ if r.get("event") == "merge"]
            merges = [r["merge_s"] for r in records]
            solo = [r["merge_s"] for r in records if r.get("solo") is not None]
            others = [r["merge_s"] for r in records if r.get("solo") is None]
            train = max(r["train_time"] for r in clf.history_ if "train_time" in r)
            single_ms = None
            if solo:
                start = next(r for r in clf.history_ if r.get("event") == "start")
                one = XMCClassifier(epochs=epochs, seed=seed, eval_every=0, devices="cpu",
                                    threads=1, algorithm="single", loss=clf.loss_,
                                    algorithm_params={"merge_period":
                                                      start["algorithm_params"]["merge_period"]})
                one.fit(X, Y)
                single_ms = _median_ms([r["merge_s"] for r in one.history_
                                        if r.get("event") == "merge"])
            row = {"dataset": name, "seed": seed, "loss": clf.loss_,
                   "shard_min_values": engine_min,
                   "merge_ms": [1e3 * m for m in merges],
                   "median_merge_ms": _median_ms(merges),
                   "median_solo_merge_ms": _median_ms(solo), "solo_merges": len(solo),
                   "median_other_merge_ms": _median_ms(others),
                   "median_single_barrier_ms": single_ms,
                   "merge_share": sum(merges) / train, "train_s": train}
            if alternate:  # the row-sparse merges themselves, by the way they ran
                row["split_merge_ms"], row["one_pass_merge_ms"] = timed[True], timed[False]
                timed[True], timed[False] = [], []
            out.append(row)
            extra = (f" {row['median_solo_merge_ms']:>13.2f} "
                     f"{row['median_other_merge_ms'] or float('nan'):>9.2f} {single_ms:>13.2f}"
                     if solo else "")
            print(f"{name:<18} {clf.loss_:<8} "
                  f"{row['median_merge_ms']:>17.2f} {len(merges):>7} "
                  f"{row['merge_share']:>6.1%} {train:>8.3f}{extra}", flush=True)
        if alternate:
            split = [m for r in out if r["dataset"] == name for m in r["split_merge_ms"]]
            one = [m for r in out if r["dataset"] == name for m in r["one_pass_merge_ms"]]
            print(f"{name}: W1's rows split over the workers: median {np.median(split):.2f} ms "
                  f"({len(split)} merges); in one pass: {np.median(one):.2f} ms ({len(one)}); "
                  f"ratio {np.median(split) / np.median(one):.2f}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-features", type=int, default=29261)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--n-labels", type=int, default=590)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--touched", type=float, default=0.59,
                   help="fraction of W1 rows changed in the period (row-sparse merge)")
    p.add_argument("--touched-in", nargs="*", default=[], metavar="DATASET",
                   help="measure the fraction of W1 rows a period touches on these datasets")
    p.add_argument("--period", type=int, default=4096, help="samples per merge period")
    p.add_argument("--in-runs", nargs="*", default=[], metavar="DATASET",
                   help="time the merges of adaptive runs on these datasets (and nothing else)")
    p.add_argument("--devices", default="cpu,cpu@0.5", help="with --in-runs")
    p.add_argument("--epochs", type=float, default=1.0, help="with --in-runs")
    p.add_argument("--rounds", type=int, default=3, help="with --in-runs: runs per dataset")
    p.add_argument("--loss", choices=("softmax", "bce", "auto"), default="softmax",
                   help="with --in-runs: the training loss")
    p.add_argument("--shard-alternate", action="store_true",
                   help="with --in-runs: alternate each run's merges between splitting W1's "
                        "changed rows over the device workers (the engine's) and one pass")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "merge_cpu.json"))
    args = p.parse_args(argv)
    meta = _common.result_metadata()
    if args.in_runs:
        rows = in_runs(args.in_runs, args.devices, args.epochs, args.rounds, args.loss,
                       args.shard_alternate)
        path = _common.write_result(args.out, {**meta, "benchmark": "merge_in_runs",
                                               "args": vars(args), "rows": rows})
        print(f"wrote {path}")
        return 0

    from xmc_engine.backends import get_backend
    from xmc_engine.scheduler.merge import find_nonfinite, sq_norms, weighted_merge
    from xmc_engine.scheduler.replica import HostBackend

    be = get_backend("cpu")
    shapes = [(args.n_features, args.hidden), (args.hidden,), (args.hidden, args.n_labels),
              (args.n_labels,)]
    rng = np.random.default_rng(0)
    reps = [[rng.standard_normal(s).astype(np.float32) for s in shapes]
            for _ in range(args.replicas)]
    central = [np.empty(s, np.float32) for s in shapes]
    w = np.full(args.replicas, 1.0 / args.replicas)
    r = {
        "check_ms": {"all_finite": _ms(lambda: find_nonfinite(reps, be), args.repeats),
                     "numpy isfinite": _ms(lambda: find_nonfinite(reps, HostBackend()),
                                           args.repeats)},
        "broadcast_ms": {
            "copy_into": _ms(lambda: [be.copy_into(d, c) for rp in reps
                                      for d, c in zip(rp, central, strict=True)], args.repeats),
            "np.copyto": _ms(lambda: [np.copyto(d, c) for rp in reps
                                      for d, c in zip(rp, central, strict=True)], args.repeats)},
        "weighted_merge_ms": _ms(lambda: weighted_merge(reps, w, central, be, check=False),
                                 args.repeats),
    }
    w1s = [rp[0] for rp in reps]
    rows = np.sort(rng.choice(args.n_features, int(round(args.touched * args.n_features)),
                              replace=False)).astype(np.int64)

    def dense():
        find_nonfinite([[a] for a in w1s], be)
        weighted_merge([[a] for a in w1s], w, central[:1], be, check=False)
        sq_norms(central[:1], be)
        for a in w1s:
            be.copy_into(a, central[0])

    def sparse():
        be.merge_rows(w1s, w, rows, central[0])
        for a in w1s:
            be.copy_rows(a, central[0], rows)

    r["w1_merge_ms"] = {"row-sparse": _ms(sparse, args.repeats), "dense": _ms(dense, args.repeats)}
    r["touched_fraction"] = {name: touched_fraction(name, args.period)
                             for name in args.touched_in}
    mb = sum(int(np.prod(s)) for s in shapes) * 4 / 2**20
    print(f"{args.replicas} replicas of {mb:.1f} MiB (W1 {args.n_features} x {args.hidden})")
    for what in ("check_ms", "broadcast_ms", "w1_merge_ms"):
        (a, ta), (b, tb) = r[what].items()
        print(f"  {what[:-3]:10s} {a:12s} {ta:7.2f} ms   {b:12s} {tb:7.2f} ms   x{tb / ta:.1f}")
    print(f"  weighted sum            {r['weighted_merge_ms']:7.2f} ms")
    print(f"  (w1_merge: {args.touched:.0%} of the rows changed in the period)")
    for name, frac in r["touched_fraction"].items():
        print(f"  {name}: a period of {args.period} rows touches {frac:.1%} of the W1 rows")
    path = _common.write_result(args.out, {
        **meta, "benchmark": "merge_cpu", "args": vars(args), "model_mib_per_replica": mb,
        **r})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
