"""Batch assembly: ``RowGather`` (xmc_engine/batches.py) against SciPy's ``X[rows]``.

Two figures per dataset and batch size, both in the same run:

* the gather alone: one batch of features and labels, ``RowGather`` (numba, GIL released)
  against SciPy fancy row indexing (GIL held);
* a whole Adagrad training step of one CPU device (1 thread) on the same rows, with the batch
  gathered either way (``train_step`` / ``grad_step`` accept both).

Usage::

    python bench/bench_gather.py                 # delicious and debian_debtags, hidden 256
    python bench/bench_gather.py --data bibtex --hidden 512 --batch-sizes 32 128

Results: ``bench/results/gather.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402


def _per_call(fn, batches, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds per call of ``fn`` over ``batches``."""
    loops = _common.timings(lambda: [fn(b) for b in batches], repeats, warmup=0)
    return float(np.median(loops)) / len(batches)


def run(name: str, hidden: int, batch_sizes, n_batches: int, repeats: int) -> list[dict]:
    from xmc_engine.backends import get_backend
    from xmc_engine.batches import RowGather
    from xmc_engine.model import ModelShape, apply_adagrad, grad_step, init_params

    X, Y, _, _ = _common.load_dataset(name)
    gx, gy = RowGather(X), RowGather(Y)
    be = get_backend("cpu", threads=1)
    params = init_params(ModelShape(X.shape[1], Y.shape[1], (hidden,)), seed=0)
    acc = [np.zeros_like(p) for p in params]
    rng = np.random.default_rng(0)
    out = []
    with be.thread_budget(1):
        for B in batch_sizes:
            batches = [rng.choice(X.shape[0], B, replace=False) for _ in range(n_batches)]

            def step_with(take, b):
                xb, yb = take(b)
                _, grads = grad_step(be, params, xb, yb)
                apply_adagrad(be, params, grads, acc, 0.0)  # lr 0: the model stays put

            def ours(b):
                return gx(b), gy(b)

            def scipy_(b):
                return X[b], Y[b]

            for b in batches[:3]:  # compile / warm up both paths
                step_with(ours, b)
                step_with(scipy_, b)
            g_ours = _per_call(ours, batches, repeats)
            g_scipy = _per_call(scipy_, batches, repeats)
            s_ours = _per_call(lambda b: step_with(ours, b), batches, repeats)
            s_scipy = _per_call(lambda b: step_with(scipy_, b), batches, repeats)
            row = {"dataset": name, "hidden": hidden, "batch_size": B,
                   "gather_us": {"RowGather": 1e6 * g_ours, "scipy": 1e6 * g_scipy},
                   "step_ms": {"RowGather": 1e3 * s_ours, "scipy": 1e3 * s_scipy},
                   "gather_speedup": g_scipy / g_ours, "step_speedup": s_scipy / s_ours}
            print(f"{name:15s} B={B:<4d} gather {1e6 * g_ours:7.1f} us vs scipy "
                  f"{1e6 * g_scipy:7.1f} us (x{g_scipy / g_ours:5.1f})   step {1e3 * s_ours:6.2f} "
                  f"ms vs {1e3 * s_scipy:6.2f} ms (x{s_scipy / s_ours:4.2f})", flush=True)
            out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", action="append", default=None,
                   help="dataset (repeatable; default delicious debian_debtags)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--n-batches", type=int, default=60)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "gather.json"))
    args = p.parse_args(argv)
    meta = _common.result_metadata()
    rows = []
    for name in args.data or ["delicious", "debian_debtags"]:
        try:
            rows += run(name, args.hidden, args.batch_sizes, args.n_batches, args.repeats)
        except _common.SkipBenchmark as e:
            print(f"SKIP {name}: {e}")
    if rows:
        path = _common.write_result(args.out, {
            **meta, "benchmark": "gather", "rows": rows})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
