"""Chunked top-k prediction on the CPU: the chunk folded into the running lists against bias,
top-k and merge per chunk, and the fold's blocks of rows on Python threads against one numba
parallel region.

:func:`xmc_engine.output_layer.predict_scores_topk` computes the logits one label chunk at a
time (one sgemm) and keeps each row's top ``k``. The CPU backend folds each chunk, its bias
added in the same pass, into the running lists (``kernels/topk.py: topk_fold_cpu``), one block
of rows per thread, the blocks run from Python threads (``folded``). Arms, in the same run:

- ``region``: the same fold in one numba parallel region per chunk (a ``prange`` over the rows
  calling the engine's kernel; the CPU backend's fold before ``topk_fold`` took threads);
- ``merged``: what every other backend does: add the bias, take the chunk's top-k, merge it
  with the running lists (three parallel regions);
- ``sgemm``: the bare sgemm of the same chunks, the floor.

At the shape where it matters: the loss probe's held-out scoring and the evaluation at the
Amazon-670K shape (hidden 128, 670,091 labels, blocks of 512 rows, label chunks of 32,768:
``HELDOUT_LOGITS`` // 512; the Amazon-670K benches evaluate with chunks of 8,192).

Usage::

    python bench/bench_predict.py
    python bench/bench_predict.py --labels 100000 --chunks 8192 --k 1 5 --repeats 5

Results: ``bench/results/predict_fold.json``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402


class _Backend:
    """The CPU backend as the engine sees it, but for what a subclass changes."""

    def __init__(self, backend):
        self._be = backend

    def __getattr__(self, name):
        return getattr(self._be, name)


class RegionFold(_Backend):
    """The CPU backend with the fold in one numba parallel region per chunk."""

    @staticmethod
    def topk_fold(scores, bias, offset, idx, val, filled):
        _fold_region()(scores, bias, int(offset), idx, val, filled)


@functools.cache
def _fold_region():
    """A ``prange`` over the rows, each the engine's serial fold of one row (compiled once)."""
    from numba import njit, prange
    from xmc_engine.kernels.topk import topk_fold_cpu

    @njit(nogil=True, parallel=True)
    def fold(scores, bias, offset, idx, val, filled):
        for i in prange(scores.shape[0]):
            topk_fold_cpu(scores[i:i + 1], bias, offset, idx[i:i + 1], val[i:i + 1],
                          filled[i:i + 1])

    return fold


class Unfolded(_Backend):
    """The CPU backend without ``topk_fold``: bias, top-k and merge per chunk."""

    def __getattr__(self, name):
        if name == "topk_fold":
            raise AttributeError(name)
        return super().__getattr__(name)


def run(n_labels: int, hidden: int, rows: int, chunks, ks, repeats: int) -> list[dict]:
    from xmc_engine.backends import get_backend
    from xmc_engine.output_layer import predict_scores_topk

    rng = np.random.default_rng(0)
    H = np.maximum(rng.standard_normal((rows, hidden)), 0).astype(np.float32)
    # label-major, as the CPU replicas of the sampled layer hold it
    W2 = np.asfortranarray((rng.standard_normal((hidden, n_labels)) * 0.1).astype(np.float32))
    b2 = (rng.standard_normal(n_labels) * 0.1).astype(np.float32)
    be = get_backend("cpu")
    unfolded = Unfolded(be)
    region = RegionFold(be)
    out = []
    for C in chunks:
        Z = np.empty((rows, min(C, n_labels)), np.float32)

        def sgemm(C=C, Z=Z):
            for c0 in range(0, n_labels, C):
                c1 = min(n_labels, c0 + C)
                be.matmul(H, W2[:, c0:c1], Z[:, : c1 - c0])

        for k in ks:
            row = {"labels": n_labels, "hidden": hidden, "rows": rows, "label_chunk": C, "k": k}
            results = {}
            for name, fn in (("folded", lambda k=k, C=C: predict_scores_topk(
                                 be, H, W2, b2, k, label_chunk=C)),
                             ("region", lambda k=k, C=C: predict_scores_topk(
                                 region, H, W2, b2, k, label_chunk=C)),
                             ("merged", lambda k=k, C=C: predict_scores_topk(
                                 unfolded, H, W2, b2, k, label_chunk=C)),
                             ("sgemm", sgemm)):
                results[name] = fn()  # warm-up, and the answer to compare
                row[f"{name}_s"] = float(np.median(_common.timings(fn, repeats, warmup=0)))
            row["same_labels"] = all(np.array_equal(results["folded"][0], results[a][0])
                                     for a in ("region", "merged"))
            row["same_scores"] = all(np.array_equal(results["folded"][1], results[a][1])
                                     for a in ("region", "merged"))
            row["region_over_folded"] = row["region_s"] / row["folded_s"]
            row["merged_over_folded"] = row["merged_s"] / row["folded_s"]
            row["folded_over_sgemm"] = row["folded_s"] / row["sgemm_s"]
            out.append(row)
            print(f"chunk {C:>7,} k {k}: folded {row['folded_s']:.3f} s, region "
                  f"{row['region_s']:.3f} s ({row['region_over_folded']:.2f}x), merged "
                  f"{row['merged_s']:.3f} s ({row['merged_over_folded']:.2f}x), bare sgemm "
                  f"{row['sgemm_s']:.3f} s (folded {row['folded_over_sgemm']:.2f}x of it); "
                  f"same labels {row['same_labels']}, scores {row['same_scores']}", flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--labels", type=int, default=670_091)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--rows", type=int, default=512, help="rows scored per call")
    p.add_argument("--chunks", type=int, nargs="+", default=[32_768, 8_192])
    p.add_argument("--k", type=int, nargs="+", default=[1, 5])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "predict_fold.json"))
    args = p.parse_args(argv)
    rows = run(args.labels, args.hidden, args.rows, args.chunks, args.k, args.repeats)
    path = _common.write_result(args.out, {**_common.result_metadata(), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
