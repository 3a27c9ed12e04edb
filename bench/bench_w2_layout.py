"""The sampled output layer's column kernels on ``W2`` in C order against label-major order.

``W2`` has the shape ``(n_hidden, n_labels)``. In C order (row-major) a label's column is one
float per ``4 * n_labels`` bytes, so gathering the ``m`` candidate columns of a sampled step,
applying Adagrad to them, or merging the columns a period changed touches ``n_hidden`` cache
lines per column, spread over the whole array. In Fortran order (label-major: what the engine's
CPU replicas of the sampled layer hold, :func:`xmc_engine.model.label_major_w2`) a column is
``n_hidden`` contiguous floats, ``n_hidden / 16`` cache lines. This times the engine's own
kernels (``kernels/sampled_output.py``: ``gather_columns_cpu``, ``adagrad_columns_cpu``;
``kernels/merge.py``: ``merge_columns_cpu`` with the broadcast to both replicas) on the same
values in both orders, on random sorted column sets drawn anew for each call, with a 64 MiB
buffer written between calls so that neither order starts in the caches. Median of ``--calls``
calls; one thread for the step kernels, two for the merge (the trainer merges on the full
budget once merges are slow). ``--merge-share``: the share of the labels a merge period
changes (about 6-11 % at the Amazon-670K shape).

Measured before the engine held ``W2`` label-major with label-major kernels written in this
script (``bench/results/w2_layout.json``, ``w2_layout_broadcast.json``); now both orders are the
engine's::

    python bench/bench_w2_layout.py --out bench/results/w2_layout_orders.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402


def measure(n_labels: int, n_hidden: int, m: int, calls: int, flush,
            merge_share: float) -> dict:
    from xmc_engine.kernels import sampled_output as so
    from xmc_engine.kernels.merge import merge_columns_cpu

    rng = np.random.default_rng(0)
    W2 = rng.standard_normal((n_hidden, n_labels)).astype(np.float32)
    acc = np.abs(rng.standard_normal((n_hidden, n_labels))).astype(np.float32)
    b2, acc_b2 = np.zeros(n_labels, np.float32), np.ones(n_labels, np.float32)
    g, gb = rng.standard_normal((n_hidden, m)).astype(np.float32), np.zeros(m, np.float32)
    W2s, b2s = np.empty((n_hidden, m), np.float32), np.empty(m, np.float32)
    n_merged = max(1, int(merge_share * n_labels))
    cases = {}
    for order, arrange in (("C order", np.ascontiguousarray),
                           ("label-major", np.asfortranarray)):
        W, A = arrange(W2), arrange(acc)  # the same values in either order
        central = arrange(np.zeros_like(W2))
        cases[f"gather, {order}"] = (m, lambda c, W=W: so.gather_columns_cpu(
            W, b2, c, W2s, b2s))
        cases[f"Adagrad, {order}"] = (m, lambda c, W=W, A=A: so.adagrad_columns_cpu(
            W, b2, A, acc_b2, c, g, gb, 0.01, 1e-10))
        cases[f"merge and broadcast, {order}"] = (n_merged, lambda c, W=W, A=A, central=central:
                                                  _threads(2, merge_columns_cpu, (W, A),
                                                           np.full((2, c.size), 0.5,
                                                                   np.float32),
                                                           c, central, True))
    times = {k: [] for k in cases}
    for _ in range(calls):
        for name, (k, fn) in cases.items():
            cols = np.sort(rng.choice(n_labels, k, replace=False)).astype(np.int64)
            fn(cols)  # compiles on the first call; warms nothing useful for the next draw
            cols = np.sort(rng.choice(n_labels, k, replace=False)).astype(np.int64)
            flush()
            t0 = time.perf_counter()
            fn(cols)
            times[name].append((time.perf_counter() - t0) * 1e3)
    ms = {k: statistics.median(v) for k, v in times.items()}
    print(f"{n_labels:8d} labels, {m} columns: "
          + "; ".join(f"{op} {ms[op + ', C order']:.3f} / {ms[op + ', label-major']:.3f} ms "
                      f"({ms[op + ', C order'] / ms[op + ', label-major']:.1f}x)"
                      for op in ("gather", "Adagrad"))
          + f"; merge and broadcast of {n_merged} columns "
            f"{ms['merge and broadcast, C order']:.2f} / "
            f"{ms['merge and broadcast, label-major']:.2f} ms "
            f"({ms['merge and broadcast, C order'] / ms['merge and broadcast, label-major']:.1f}x)"
            " (C order / label-major)", flush=True)
    return {"n_labels": n_labels, "n_hidden": n_hidden, "m": m, "merged_columns": n_merged,
            "ms": ms, "runs_ms": times}


def _threads(n: int, fn, *args):
    """``fn(*args)`` with ``n`` numba threads (at most numba's pool), then one again."""
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        return fn(*args)
    finally:
        numba.set_num_threads(1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--labels", type=int, nargs="+", default=[20837, 100000, 670091])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--m", type=int, default=1500, help="candidate columns per step")
    p.add_argument("--calls", type=int, default=15)
    p.add_argument("--merge-share", type=float, default=0.08,
                   help="share of the labels whose columns a merge merges")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "w2_layout_orders.json"))
    args = p.parse_args(argv)
    numba.set_num_threads(1)
    big = np.ones(64 * 1024 * 1024 // 4, np.float32)

    def flush():
        big[:] += 1.0

    rows = [measure(L, args.hidden, args.m, args.calls, flush, args.merge_share)
            for L in args.labels]
    path = _common.write_result(args.out, {**_common.result_metadata(), "benchmark": "w2_layout",
                                           "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
