"""Drawing a sampled step's candidates: ``output_layer.sample_candidates`` against the same draws
filtered with NumPy's set operations (``np.unique``, ``np.isin``; the engine's way before, and the
specification, ``kernels/reference.py``), on debian_builddeps' label rows, both in one process.

Two rules (``--rules``): ``uniform`` (the engine takes the first distinct draws with a numba
function without the GIL; reference ``uniform_negatives``) and ``frequency`` (the default rule:
the engine searches each sorted uniform inside a guide-table cell and merges sorted lists;
reference ``frequency_negatives``, a search over the whole cdf, computed once as the engine's).
Both sides find the batch's positives too (the engine by a sort, the reference by ``np.unique``).
The frequency rule's counts are the data's at its own label count and a Zipf(1.5) profile at
Amazon-670K's.

Batches of 64 training rows; ``K = 1024`` negatives (the default); label spaces of the data
(20,837) and of Amazon-670K (670,091, the same rows' labels). Median of ``--rounds`` rounds of
``--calls`` calls each, alternating. Results in ``bench/results/candidates.json``::

    python bench/bench_candidates.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402


def by_numpy(y_indices, n_labels, k, rng, proposal=None):
    """The NumPy version: the positives, then ``reference.uniform_negatives`` (or, with a
    ``proposal``, ``reference.frequency_negatives`` over its ``q``)."""
    from xmc_engine.kernels import reference

    pos = np.unique(np.asarray(y_indices, dtype=np.int64))
    if proposal is None:
        return np.concatenate([pos, reference.uniform_negatives(pos, n_labels, k, rng)])
    return np.concatenate([pos, reference.frequency_negatives(proposal.q, pos, k, rng,
                                                              proposal._cdf)[0]])


def main(argv=None) -> int:
    from xmc_engine.datasets import load_dataset

    from xmc_engine.output_layer import FrequencyProposal, sample_candidates

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="debian_builddeps")
    p.add_argument("--negatives", type=int, default=1024)
    p.add_argument("--rules", nargs="+", choices=("uniform", "frequency"),
                   default=["uniform", "frequency"])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "candidates.json"))
    args = p.parse_args(argv)
    Y = load_dataset(args.data)[1]
    rng = np.random.default_rng(0)
    batches = [Y[rng.integers(0, Y.shape[0], 64)].indices for _ in range(args.calls)]
    rows = []
    for rule in args.rules:
        for n_labels in (Y.shape[1], 670091):
            k = args.negatives
            prop = None
            if rule == "frequency":
                counts = (np.bincount(Y.indices, minlength=n_labels) if n_labels == Y.shape[1]
                          else np.random.default_rng(1).zipf(1.5, n_labels) - 1)
                prop = FrequencyProposal(counts)

            def engine(b, n, kk, g, prop=prop):
                return sample_candidates(b, n, kk, g, prop)

            def numpy_(b, n, kk, g, prop=prop):
                return by_numpy(b, n, kk, g, prop)

            same = all(np.array_equal(engine(b, n_labels, k, np.random.default_rng(i))[0],
                                      numpy_(b, n_labels, k, np.random.default_rng(i)))
                       for i, b in enumerate(batches[:20]))
            times = {"engine": [], "numpy": []}
            for r in range(args.rounds):
                for name, fn in (("engine", engine), ("numpy", numpy_)):
                    g = np.random.default_rng(r)
                    t0 = time.perf_counter()
                    for b in batches:
                        fn(b, n_labels, k, g)
                    times[name].append((time.perf_counter() - t0) / len(batches) * 1e6)
            row = {"rule": rule, "n_labels": n_labels, "negatives": k, "same_candidates": same,
                   "us_per_call": {n: statistics.median(v) for n, v in times.items()},
                   "runs": times}
            rows.append(row)
            us = row["us_per_call"]
            print(f"{rule:9s} {n_labels:8d} labels, K={k}: engine {us['engine']:6.0f} us, "
                  f"NumPy set operations {us['numpy']:6.0f} us per call "
                  f"({us['numpy'] / us['engine']:.1f}x); same candidates: {same}", flush=True)
    path = _common.write_result(args.out, {**_common.result_metadata(), "benchmark": "candidates",
                                           "data": args.data, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
