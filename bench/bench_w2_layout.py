"""The sampled output layer's column kernels in ``W2``'s layout against a label-major layout.

The engine stores ``W2`` as ``(n_hidden, n_labels)``, row-major: a label's column is one float
per 4 * n_labels bytes, so gathering the ``m`` candidate columns of a sampled step, or applying
Adagrad to them, touches ``n_hidden * m`` cache lines spread over the whole array. Stored
label-major, ``(n_labels, n_hidden)``, a column is ``n_hidden`` contiguous floats. This times
the engine's kernels (``kernels/sampled_output.py``: ``gather_columns_cpu``,
``adagrad_columns_cpu``) against label-major versions written here (same arithmetic: the
candidate's row of the label-major array instead of a strided column), one thread, on random
sorted candidate sets of ``--m`` labels drawn anew for each call, with a 64 MiB buffer written
between calls so that neither layout starts in the caches. Median of ``--calls`` calls.

Also the column-sparse merge of two replicas' ``W2`` on ``--merge-share`` of the labels (the
share a merge period of the Amazon-670K shape changes, about 11 %): the engine's
``merge_columns_cpu`` (``kernels/merge.py``) on one and on two threads (the trainer's
``MERGE_ONE_THREAD_MAX_S`` cites them), against a label-major version written here, one thread.

And the merge with its broadcast to both replicas, on two threads: the merge and then a copy
per replica (the engine's sparse merge before ``336cde2``), against the merge that writes the
merged columns back in the same pass (``broadcast=True``, the engine's since).

Not an engine feature: the measurement behind issue 18's open "label-major W2"::

    python bench/bench_w2_layout.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402


def label_major_kernels():
    from xmc_engine.kernels.adagrad import adagrad_entry_cpu

    @njit(nogil=True, parallel=True)
    def gather_rows(W2T, b2, cols, W2s, b2s):
        """``W2s[:, j] = W2T[cols[j]]``, ``b2s[j] = b2[cols[j]]``."""
        for j in prange(cols.shape[0]):
            src = W2T[cols[j]]
            for h in range(src.shape[0]):
                W2s[h, j] = src[h]
            b2s[j] = b2[cols[j]]

    @njit(nogil=True, parallel=True, fastmath=True)
    def adagrad_rows_t(W2T, b2, acc_W2T, acc_b2, cols, dW2s, db2s, lr, eps):
        """Adagrad on rows ``cols`` of ``W2T`` / ``acc_W2T`` with the gradient columns of
        ``dW2s`` (n_hidden, m)."""
        lr32, eps32 = np.float32(lr), np.float32(eps)
        for j in prange(cols.shape[0]):
            c = cols[j]
            w, a = W2T[c], acc_W2T[c]
            for h in range(w.shape[0]):
                w[h], a[h] = adagrad_entry_cpu(w[h], a[h], dW2s[h, j], lr32, eps32)
            b2[c], acc_b2[c] = adagrad_entry_cpu(b2[c], acc_b2[c], db2s[j], lr32, eps32)

    @njit(nogil=True, parallel=True)
    def merge_rows_t(A, B, weights, cols, central):
        """``central[c] = weights[0, j] A[c] + weights[1, j] B[c]`` for ``c = cols[j]``."""
        for j in prange(cols.shape[0]):
            c = cols[j]
            out, a, b = central[c], A[c], B[c]
            for h in range(out.shape[0]):
                out[h] = weights[0, j] * a[h] + weights[1, j] * b[h]

    return gather_rows, adagrad_rows_t, merge_rows_t


def measure(n_labels: int, n_hidden: int, m: int, calls: int, flush,
            merge_share: float) -> dict:
    from xmc_engine.kernels import sampled_output as so
    from xmc_engine.kernels.merge import copy_columns_cpu, merge_columns_cpu

    gather_rows, adagrad_rows_t, merge_rows_t = label_major_kernels()
    rng = np.random.default_rng(0)
    W2 = rng.standard_normal((n_hidden, n_labels)).astype(np.float32)
    acc = np.abs(rng.standard_normal((n_hidden, n_labels))).astype(np.float32)
    W2T, accT = np.ascontiguousarray(W2.T), np.ascontiguousarray(acc.T)
    b2, acc_b2 = np.zeros(n_labels, np.float32), np.ones(n_labels, np.float32)
    g, gb = rng.standard_normal((n_hidden, m)).astype(np.float32), np.zeros(m, np.float32)
    W2s, b2s = np.empty((n_hidden, m), np.float32), np.empty(m, np.float32)
    cases = {
        "gather, (hidden, labels)": lambda c: so.gather_columns_cpu(W2, b2, c, W2s, b2s),
        "gather, label-major": lambda c: gather_rows(W2T, b2, c, W2s, b2s),
        "Adagrad, (hidden, labels)": lambda c: so.adagrad_columns_cpu(W2, b2, acc, acc_b2, c, g,
                                                                      gb, 0.01, 1e-10),
        "Adagrad, label-major": lambda c: adagrad_rows_t(W2T, b2, accT, acc_b2, c, g, gb, 0.01,
                                                         1e-10),
    }
    n_merged = max(1, int(merge_share * n_labels))
    central, centralT = np.zeros_like(W2), np.zeros_like(W2T)
    def half(c):
        return np.full((2, c.size), 0.5, np.float32)

    def merge_then_copy(c):  # the merge, then the broadcast as a copy per replica
        merge_columns_cpu((W2, acc), half(c), c, central, False)
        copy_columns_cpu(W2, central, c)
        copy_columns_cpu(acc, central, c)

    cases.update({
        "merge, (hidden, labels), 1 thread": lambda c: merge_columns_cpu(
            (W2, acc), half(c), c, central, False),
        "merge, (hidden, labels), 2 threads": lambda c: _threads(
            2, merge_columns_cpu, (W2, acc), half(c), c, central, False),
        "merge, label-major, 1 thread": lambda c: merge_rows_t(W2T, accT, half(c), c, centralT),
        "merge then two copies, 2 threads": lambda c: _threads(2, merge_then_copy, c),
        "merge and broadcast in one pass, 2 threads": lambda c: _threads(
            2, merge_columns_cpu, (W2, acc), half(c), c, central, True),
    })
    times = {k: [] for k in cases}
    for _ in range(calls):
        for name, fn in cases.items():
            k = n_merged if name.startswith("merge") else m
            cols = np.sort(rng.choice(n_labels, k, replace=False)).astype(np.int64)
            fn(cols)  # compiles on the first call; warms nothing useful for the next draw
            cols = np.sort(rng.choice(n_labels, k, replace=False)).astype(np.int64)
            flush()
            t0 = time.perf_counter()
            fn(cols)
            times[name].append((time.perf_counter() - t0) * 1e3)
    ms = {k: statistics.median(v) for k, v in times.items()}
    print(f"{n_labels:8d} labels, {m} columns: gather {ms['gather, (hidden, labels)']:.3f} / "
          f"{ms['gather, label-major']:.3f} ms, Adagrad {ms['Adagrad, (hidden, labels)']:.3f} / "
          f"{ms['Adagrad, label-major']:.3f} ms ((hidden, labels) / label-major); merge of "
          f"{n_merged} columns {ms['merge, (hidden, labels), 1 thread']:.2f} ms (2 threads "
          f"{ms['merge, (hidden, labels), 2 threads']:.2f}) / "
          f"{ms['merge, label-major, 1 thread']:.2f} ms; merge + broadcast to both replicas, "
          f"2 threads: {ms['merge then two copies, 2 threads']:.2f} ms in turn, "
          f"{ms['merge and broadcast in one pass, 2 threads']:.2f} ms in one pass", flush=True)
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
    p.add_argument("--merge-share", type=float, default=0.11,
                   help="share of the labels whose columns a merge merges")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "w2_layout.json"))
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
