"""Drawing a sampled step's candidates: ``output_layer.sample_candidates`` (uniform negatives
taken by a numba function without the GIL) against the same draws filtered with NumPy's set
operations (``np.isin``, ``np.unique``; the engine's way before, and the specification,
``kernels/reference.py: uniform_negatives``), on debian_builddeps' label rows, both in one process.

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


def by_numpy(y_indices, n_labels, k, rng):
    """The NumPy version: the positives, then ``reference.uniform_negatives``."""
    from xmc_engine.kernels import reference

    pos = np.unique(np.asarray(y_indices, dtype=np.int64))
    return np.concatenate([pos, reference.uniform_negatives(pos, n_labels, k, rng)])


def main(argv=None) -> int:
    from xmc_engine.datasets import load_dataset

    from xmc_engine.output_layer import sample_candidates

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="debian_builddeps")
    p.add_argument("--negatives", type=int, default=1024)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "candidates.json"))
    args = p.parse_args(argv)
    Y = load_dataset(args.data)[1]
    rng = np.random.default_rng(0)
    batches = [Y[rng.integers(0, Y.shape[0], 64)].indices for _ in range(args.calls)]
    rows = []
    for n_labels in (Y.shape[1], 670091):
        k = args.negatives
        same = all(np.array_equal(sample_candidates(b, n_labels, k, np.random.default_rng(i))[0],
                                  by_numpy(b, n_labels, k, np.random.default_rng(i)))
                   for i, b in enumerate(batches[:20]))
        times = {"engine": [], "numpy": []}
        for r in range(args.rounds):
            for name, fn in (("engine", sample_candidates), ("numpy", by_numpy)):
                g = np.random.default_rng(r)
                t0 = time.perf_counter()
                for b in batches:
                    fn(b, n_labels, k, g)
                times[name].append((time.perf_counter() - t0) / len(batches) * 1e6)
        row = {"n_labels": n_labels, "negatives": k, "same_candidates": same,
               "us_per_call": {n: statistics.median(v) for n, v in times.items()}, "runs": times}
        rows.append(row)
        print(f"{n_labels:8d} labels, K={k}: engine {row['us_per_call']['engine']:6.0f} us, "
              f"NumPy set operations {row['us_per_call']['numpy']:6.0f} us per call "
              f"({row['us_per_call']['numpy'] / row['us_per_call']['engine']:.1f}x); "
              f"same candidates: {same}", flush=True)
    path = _common.write_result(args.out, {**_common.result_metadata(), "benchmark": "candidates",
                                           "data": args.data, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
