"""Training-step throughput: the engine against the same network in PyTorch, and against the
bare GEMM ceiling (issue "One-device trainer", DESIGN.md §2).

Each competitor runs in its own subprocess (so that peak RSS is its own), alternately, ``--repeat``
times; the best throughput of each is kept. Both time pure training steps on batches prepared
before timing (slicing the CSR batch is data loading; the engine's time *with* slicing is printed
too). The GEMM ceiling is the time of the three output-layer GEMMs of one step
(``H @ W2``, ``dZ @ W2.T``, ``H.T @ dZ``) measured in the engine's worker.

    python bench/bench_step.py                       # delicious + the 100k x 30k synthetic shape
    python bench/bench_step.py --shape delicious --threads 2 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, peak_rss_mib, result_metadata, write_result  # noqa: E402

SHAPES = {
    # name: (data source, batch size)
    "delicious": ("delicious", 256),
    "synthetic-100k-30k": ("synthetic:100000x30000", 256),
}


def load(source: str):
    if source.startswith("synthetic:"):
        from xmc_engine.datasets import make_synthetic

        n_features, n_labels = (int(v) for v in source.split(":")[1].split("x"))
        Xtr, Ytr, _, _ = make_synthetic("default", n_train=8192, n_test=16,
                                        n_features=n_features, n_labels=n_labels, seed=0)
        return Xtr, Ytr
    from xmc_engine.datasets import load_dataset

    Xtr, Ytr, _, _ = load_dataset(source)
    return Xtr, Ytr


def worker_engine(args) -> dict:
    import numpy as np

    from xmc_engine.backends import get_backend
    from xmc_engine.model import ModelShape, init_params, train_step

    X, Y = load(args.source)
    be = get_backend("cpu", threads=args.threads)
    shape = ModelShape(X.shape[1], Y.shape[1], (args.hidden,))
    params = [be.asarray(p) for p in init_params(shape, 0, avg_nnz=X.nnz / X.shape[0])]
    B = args.batch_size
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(args.warmup + args.steps):
        rows = rng.choice(X.shape[0], B, replace=False)
        batches.append((rows, X[rows], Y[rows]))
    with be.thread_budget(args.threads):
        for _, Xb, Yb in batches[:args.warmup]:
            train_step(be, params, Xb, Yb, 0.1, label_chunk=args.label_chunk)
        t0 = time.perf_counter()
        for _, Xb, Yb in batches[args.warmup:]:
            train_step(be, params, Xb, Yb, 0.1, label_chunk=args.label_chunk)
        step_s = (time.perf_counter() - t0) / args.steps
        t0 = time.perf_counter()
        for rows, _, _ in batches[args.warmup:]:
            train_step(be, params, X[rows], Y[rows], 0.1, label_chunk=args.label_chunk)
        step_slice_s = (time.perf_counter() - t0) / args.steps
        # The GEMM ceiling: the three output-layer GEMMs of one step, best of several.
        H = np.abs(np.random.default_rng(1).standard_normal((B, args.hidden))).astype(np.float32)
        W2 = params[-2]
        Z = np.empty((B, W2.shape[1]), np.float32)
        dH = np.empty((B, args.hidden), np.float32)
        dW = np.empty_like(W2)
        best = float("inf")
        for _ in range(max(5, args.steps // 4)):
            t0 = time.perf_counter()
            np.matmul(H, W2, out=Z)
            np.matmul(Z, W2.T, out=dH)
            np.matmul(H.T, Z, out=dW)
            best = min(best, time.perf_counter() - t0)
    return {"samples_per_s": B / step_s, "samples_per_s_with_slicing": B / step_slice_s,
            "step_ms": 1e3 * step_s, "gemm3_ms": 1e3 * best,
            "gemm_fraction": best / step_s, "peak_rss_mib": peak_rss_mib()}


def worker_torch(args) -> dict:
    import torch_baseline

    X, Y = load(args.source)
    sps = torch_baseline.step_throughput(X, Y, hidden=args.hidden, batch_size=args.batch_size,
                                         threads=args.threads, n_steps=args.steps,
                                         warmup=args.warmup)
    return {"samples_per_s": sps, "step_ms": 1e3 * args.batch_size / sps,
            "peak_rss_mib": peak_rss_mib()}


def run_worker(kind: str, source: str, batch: int, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--source", source,
           "--batch-size", str(batch), "--threads", str(args.threads), "--hidden",
           str(args.hidden), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.label_chunk:
        cmd += ["--label-chunk", str(args.label_chunk)]
    # Same environment for both competitors; OPENBLAS_THREAD_TIMEOUT as `import xmc_engine` sets
    # it (the workers import NumPy first, so it must come from the environment here).
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "OPENBLAS_THREAD_TIMEOUT": os.environ.get("OPENBLAS_THREAD_TIMEOUT", "4")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--label-chunk", type=int, default=None)
    ap.add_argument("--out", default=str(RESULTS_DIR / "step.json"))
    # worker mode (internal)
    ap.add_argument("--worker", choices=["engine", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, default=256, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        res = worker_engine(args) if args.worker == "engine" else worker_torch(args)
        print(json.dumps(res))
        return 0

    results = {**result_metadata(), "args": vars(args), "shapes": {}}
    for name in args.shape or list(SHAPES):
        source, batch = SHAPES[name]
        runs = {"engine": [], "torch": []}
        for _ in range(args.repeat):
            for kind in ("engine", "torch"):
                runs[kind].append(run_worker(kind, source, batch, args))
        best = {}
        for kind, rs in runs.items():
            ok = [r for r in rs if "error" not in r]
            best[kind] = max(ok, key=lambda r: r["samples_per_s"]) if ok else rs[-1]
        e, t = best["engine"], best["torch"]
        ratio = (e["samples_per_s"] / t["samples_per_s"]
                 if "error" not in e and "error" not in t else float("nan"))
        results["shapes"][name] = {"source": source, "batch_size": batch, "runs": runs,
                                   "best": best, "ratio_engine_over_torch": ratio}
        if "error" in e:
            print(f"{name}: engine failed: {e['error']}")
            continue
        print(f"{name:20s} B={batch} hidden={args.hidden} threads={args.threads}")
        print(f"  engine  {e['samples_per_s']:10.0f} samples/s  (with batch slicing "
              f"{e['samples_per_s_with_slicing']:.0f})  step {e['step_ms']:.2f} ms  "
              f"peak RSS {e['peak_rss_mib']:.0f} MiB")
        if "error" in t:
            print(f"  torch   failed: {t['error']}")
        else:
            print(f"  torch   {t['samples_per_s']:10.0f} samples/s  step {t['step_ms']:.2f} ms  "
                  f"peak RSS {t['peak_rss_mib']:.0f} MiB")
            print(f"  engine / torch throughput: {ratio:.2f}x")
        print(f"  3 bare GEMMs {e['gemm3_ms']:.2f} ms = {100 * e['gemm_fraction']:.0f}% of the "
              f"engine's step (ceiling fraction)")
        write_result(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
