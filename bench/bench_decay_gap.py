"""How far a model is from its training rows after one epoch: the signal a data-derived
learning-rate decay would have to read.

The default decay (``lr / (1 + 0.5 e)``, ``DEFAULT_LR_DECAY``) was chosen on the shared sets,
which overfit without it; the synthetic shapes want none (``bench/RESULTS.md``, "The decay and
the merge weights at the Amazon-670K shape"). A rule that switches the decay on for data that
overfits needs a signal that separates the two. This prints one candidate, the gap between
P@1 on (up to) 5,000 training rows and on (up to) 5,000 test rows after the first epoch of a
run with the engine's defaults (the decay does not act in the first epoch), one seed:

    python bench/bench_decay_gap.py --datasets bibtex corel5k stackex_cooking delicious imdb \\
        debian_debtags debian_builddeps rcv1sub1 synth1k synth10k synthetic-amazon670k

Names: a shared dataset, ``synth1k`` / ``synth10k`` (the shapes of ``bench_defaults.py``), or
what the engine's registry resolves (``synthetic-amazon670k``: about 4 minutes an epoch here).
"""

from __future__ import annotations

import argparse
import sys
import time

import _common
import bench_defaults
import numpy as np

ROWS = 5_000


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "decay_scale" / "gap.json"))
    args = p.parse_args(argv)

    from xmc_engine import XMCClassifier
    from xmc_engine.errors import XMCError

    meta = _common.result_metadata()
    rows = []
    print(f"{'data':<22} {'rows':>7} {'loss':<8} {'train P@1':>9} {'test P@1':>8} {'gap':>6} "
          f"{'fit s':>6}")
    for name in args.datasets:
        try:
            X, Y, X_test, Y_test = bench_defaults.load_any(name)
        except (XMCError, _common.SkipBenchmark) as e:  # a dataset not on this machine
            print(f"{name:<22} skipped: {e}")
            continue
        if X_test is None:
            print(f"{name:<22} skipped: no test split")
            continue
        rng = np.random.default_rng(args.seed)
        seen = np.sort(rng.choice(X.shape[0], min(ROWS, X.shape[0]), replace=False))
        t0 = time.perf_counter()
        clf = XMCClassifier(epochs=1, seed=args.seed, eval_every=0).fit(X, Y)
        fit_s = time.perf_counter() - t0
        train_p1 = clf.score(X[seen], Y[seen])
        test_p1 = clf.score(X_test[:ROWS], Y_test[:ROWS])
        r = {"dataset": name, "n_train": int(X.shape[0]), "loss": clf.loss_,
             "train_P@1": train_p1, "test_P@1": test_p1, "gap": train_p1 - test_p1,
             "fit_s": fit_s}
        rows.append(r)
        print(f"{name:<22} {r['n_train']:>7} {r['loss']:<8} {train_p1:>9.4f} {test_p1:>8.4f} "
              f"{r['gap']:>6.3f} {fit_s:>6.1f}", flush=True)
    _common.write_result(args.out, {**meta, "benchmark": "decay gap", "seed": args.seed,
                                    "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
