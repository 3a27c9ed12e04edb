"""Benchmark the CPU kernels against the obvious NumPy/SciPy expressions and the machine's ceilings.

Self-contained: measures sgemm GFLOP/s at the sizes used and memory bandwidth (a large copy),
checks every kernel against kernels/reference.py, warms up, then times each kernel (best of
``--repeat``) against its baseline and prints one line per configuration with the ratio.
Writes ``bench/results/kernels.json`` (with the command, git commit and machine).

    python bench/bench_kernels.py                # 2 threads, the sizes of the targets
    python bench/bench_kernels.py --quick        # small sizes, a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=15,
                   help="timed repetitions, competitors interleaved (best and median kept)")
    p.add_argument("--batch", type=int, default=4096, help="sparse layer batch")
    p.add_argument("--features", type=int, default=100_000)
    p.add_argument("--nnz-per-row", type=int, default=80)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--out-batch", type=int, default=256, help="output layer batch")
    p.add_argument("--labels", type=int, default=30_000)
    p.add_argument("--label-chunk", type=int, default=4096)
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "kernels.json")
    a = p.parse_args(argv)
    if a.quick:
        a.batch, a.features, a.labels, a.out_batch, a.repeat = 512, 10_000, 3000, 64, 3
        a.label_chunk = 700
    return a


def best_time(fn, repeat, warmup=2):
    return min(_common.timings(fn, repeat, warmup))


def interleaved(fns, repeat, warmup=2, before=None):
    """Best and median time of each of ``fns`` (name -> callable), timed round-robin in the
    same loop: on a shared, loaded machine competitors see the same load. ``before`` (name ->
    callable) runs untimed before that competitor (e.g. to restore its input)."""
    before = before or {}
    for _ in range(warmup):
        for k, fn in fns.items():
            before.get(k, lambda: None)()
            fn()
    ts = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            before.get(k, lambda: None)()
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    return {k: (min(v), sorted(v)[len(v) // 2]) for k, v in ts.items()}


def main(argv=None):
    a = parse_args(argv)
    import numba
    import numpy as np
    import scipy.sparse as sps
    from threadpoolctl import threadpool_limits
    from xmc_engine.kernels import output_layer, reference, sparse_backward, sparse_forward

    from xmc_engine.backends.cpu import CPUBackend

    numba.set_num_threads(a.threads)
    limits = threadpool_limits(a.threads, user_api="blas")  # noqa: F841 - kept for the run
    be = CPUBackend(threads=a.threads)
    rng = np.random.default_rng(0)
    f32 = np.float32
    results = {"config": vars(a) | {"out": str(a.out)}, "rows": []}

    def row(name, t, base_t, base_name, extra="", med=None):
        """``t``/``base_t``: best of the interleaved runs; ``med``: (median, baseline median)."""
        load = os.getloadavg()[0]
        r = {"kernel": name, "ms": t * 1e3, "baseline": base_name, "baseline_ms": base_t * 1e3,
             "speedup": base_t / t, "loadavg": load}
        if med is not None:
            r["median_ms"], r["baseline_median_ms"] = med[0] * 1e3, med[1] * 1e3
            r["median_speedup"] = med[1] / med[0]
        results["rows"].append(r)
        print(f"{name:<36s} {t * 1e3:8.2f} ms   {base_name:<30s} {base_t * 1e3:8.2f} ms"
              f"   x{base_t / t:5.2f}" + (f" (median x{med[1] / med[0]:5.2f})" if med else "")
              + f"  load {load:.1f}  {extra}")
        return r

    # ---------------------------------------------------------------- ceilings
    B2, nh, L = a.out_batch, a.hidden, a.labels
    Hs = rng.standard_normal((B2, nh), dtype=f32)
    W2s = rng.standard_normal((nh, L), dtype=f32)
    Zs = np.empty((B2, L), f32)
    dHs = np.empty((B2, nh), f32)
    dWs = np.empty((nh, L), f32)
    g1 = best_time(lambda: np.matmul(Hs, W2s, out=Zs), a.repeat)
    g2 = best_time(lambda: np.matmul(Zs, W2s.T, out=dHs), a.repeat)
    g3 = best_time(lambda: np.matmul(Hs.T, Zs, out=dWs), a.repeat)
    gemm_flops = 2.0 * B2 * nh * L
    big = np.ones(64 * 2**20 // 4 * 4, f32)  # 256 MiB
    big2 = np.empty_like(big)
    tcopy = best_time(lambda: np.copyto(big2, big), 3, warmup=1)
    bw = 2 * big.nbytes / tcopy / 1e9
    big = big2 = None  # free 512 MiB
    results["ceilings"] = {
        "sgemm_gflops": {"H@W2": gemm_flops / g1 / 1e9, "Z@W2.T": gemm_flops / g2 / 1e9,
                         "H.T@Z": gemm_flops / g3 / 1e9},
        "copy_GBps": bw, "three_gemms_ms": (g1 + g2 + g3) * 1e3,
    }
    results.update(_common.result_metadata(
        machine_extra={"numba_threading_layer": numba.threading_layer()}))
    m, v = results["machine"], results["machine"]["libraries"]
    print(f"# {m['cpu_model']}, {m['usable_cores']} cores, numpy {v['numpy']}, "
          f"scipy {v['scipy']}, numba {v['numba']} ({m['numba_threading_layer']}), "
          f"threads={a.threads}, load average {m['loadavg_1_5_15'][0]:.1f} "
          "(other processes share the cores)")
    for b in m["blas"]:
        print(f"# BLAS: {b['internal_api']} {b['version']} kernel={b['architecture']} "
              f"threads={b['num_threads']}")
    print(f"# OPENBLAS env: {m['env'] or 'none'}")
    print(f"# ceilings: sgemm {gemm_flops / g1 / 1e9:.0f}/{gemm_flops / g2 / 1e9:.0f}/"
          f"{gemm_flops / g3 / 1e9:.0f} GFLOP/s (H@W2, Z@W2.T, H.T@Z at B={B2}, "
          f"n_hidden={nh}, L={L}); copy {bw:.1f} GB/s (read+write)")

    # ---------------------------------------------------------------- sparse layer data
    B, F = a.batch, a.features
    nnz_row = rng.poisson(a.nnz_per_row, B).clip(1)
    # power-law-ish feature popularity (Zipf), as in bag-of-words data
    ranks = np.arange(1, F + 1)
    pfeat = 1.0 / ranks**0.8
    pfeat /= pfeat.sum()
    perm = rng.permutation(F)
    indptr = np.concatenate([[0], np.cumsum(nnz_row)]).astype(np.int64)
    indices = np.empty(indptr[-1], np.int32)
    for i in range(B):
        indices[indptr[i]:indptr[i + 1]] = np.sort(
            perm[rng.choice(F, nnz_row[i], replace=False, p=pfeat)])
    data = rng.uniform(0.1, 1, indptr[-1]).astype(f32)
    X = sps.csr_matrix((data, indices, indptr), shape=(B, F))
    W1 = (rng.standard_normal((F, nh)) * 0.01).astype(f32)
    b1 = (rng.standard_normal(nh) * 0.01).astype(f32)
    out = np.empty((B, nh), f32)
    dZ1 = rng.standard_normal((B, nh)).astype(f32)
    print(f"# sparse layer: B={B}, n_features={F}, nnz={indptr[-1]} "
          f"({indptr[-1] / B:.1f}/row, {len(np.unique(indices))} distinct features), "
          f"n_hidden={nh}")

    # correctness first (a row slice keeps the dense reference small)
    sl = slice(0, 64)
    Xs = X[sl]
    sparse_forward.sparse_forward_cpu(indptr, indices, data, W1, b1, out)
    ref = reference.sparse_forward(Xs.indptr, Xs.indices, Xs.data, W1, b1)
    assert np.allclose(out[sl], ref, atol=1e-5), "sparse_forward disagrees with the reference"
    Wt, bt = W1.copy(), b1.copy()
    sparse_backward.sparse_backward_update_cpu(indptr, indices, data, dZ1, Wt, bt, 0.1)
    Wr = W1 - 0.1 * np.asarray(X.T @ dZ1)
    assert np.allclose(Wt, Wr, atol=1e-4), "sparse_backward_update disagrees"

    # forward and backward, on the Zipf features above and on uniform features (same nnz/row):
    # with Zipf the popular W1 rows stay in cache for both scipy and the kernel
    idx_uniform = np.empty_like(indices)
    for i in range(B):
        idx_uniform[indptr[i]:indptr[i + 1]] = np.sort(rng.choice(F, nnz_row[i], replace=False))
    Wa = W1.copy()
    Wb = W1.copy()
    ba = b1.copy()
    fwd_bytes = indptr[-1] * nh * 4 + B * nh * 4
    for dist, idx in (("zipf", indices), ("uniform", idx_uniform)):
        Xd = sps.csr_matrix((data, idx, indptr), shape=(B, F))
        tag = "" if dist == "zipf" else " [uniform]"

        def fwd_kernel(idx=idx):
            sparse_forward.sparse_forward_cpu(indptr, idx, data, W1, b1, out)

        def fwd_scipy(Xd=Xd):
            return np.maximum(Xd @ W1 + b1, 0)

        def bwd_kernel(idx=idx):
            sparse_backward.sparse_backward_update_cpu(indptr, idx, data, dZ1, Wa, ba, 1e-6)

        def bwd_scipy(Xd=Xd):
            G = np.asarray(Xd.T @ dZ1)
            Wb[...] -= 1e-6 * G
            return G

        def grad_kernel(idx=idx):
            sparse_backward.sparse_grad_cpu(indptr, idx, data, dZ1)

        def csc(idx=idx):
            sparse_backward.batch_to_csc_cpu(indptr, idx, data, F)

        T = interleaved({"fwd": fwd_kernel, "fwd0": fwd_scipy}, a.repeat)
        r = row(f"sparse_forward (fused bias+ReLU){tag}", T["fwd"][0], T["fwd0"][0],
                "scipy X@W1 + b1, ReLU",
                f"{fwd_bytes / T['fwd'][0] / 1e9:.1f} GB/s gathered; target x3",
                med=(T["fwd"][1], T["fwd0"][1]))
        r["features"], r["target"], r["met"] = dist, 3.0, r["speedup"] >= 3.0
        T = interleaved({"bwd": bwd_kernel, "bwd0": bwd_scipy, "grad": grad_kernel, "csc": csc},
                        a.repeat)
        r = row(f"sparse_backward_update (CSC){tag}", T["bwd"][0], T["bwd0"][0],
                "scipy X.T@G + dense W1 update",
                f"{2 * fwd_bytes / T['bwd'][0] / 1e9:.1f} GB/s touched; batch_to_csc "
                f"{T['csc'][0] * 1e3:.1f} ms of it; target x3", med=(T["bwd"][1], T["bwd0"][1]))
        r["features"], r["target"], r["met"] = dist, 3.0, r["speedup"] >= 3.0
        r["batch_to_csc_ms"] = T["csc"][0] * 1e3
        r = row(f"sparse_grad (row-sparse){tag}", T["grad"][0], T["bwd0"][0],
                "scipy X.T@G + dense W1 update", "", med=(T["grad"][1], T["bwd0"][1]))
        r["features"] = dist

    # ---------------------------------------------------------------- output layer
    H = np.maximum(rng.standard_normal((B2, nh)), 0).astype(f32)
    W2 = (rng.standard_normal((nh, L)) * 0.01).astype(f32)
    b2 = np.zeros(L, f32)
    ny = rng.integers(0, 8, B2)
    y_indptr = np.concatenate([[0], np.cumsum(ny)]).astype(np.int64)
    y_indices = np.concatenate([np.sort(rng.choice(L, n, replace=False)) for n in ny]).astype(
        np.int32)
    dH = np.empty((B2, nh), f32)
    # correctness (float64 reference on a few rows)
    Wc, bc = W2.copy(), b2.copy()
    loss = be.output_layer_step(H, Wc, bc, y_indptr, y_indices, 0.5, dH)
    lr_, W2r, b2r, dHr = reference.output_layer_step(H.astype(np.float64), W2.astype(np.float64),
                                                     b2.astype(np.float64), y_indptr, y_indices,
                                                     0.5)
    assert abs(loss - lr_) < 1e-4 * abs(lr_) and np.allclose(Wc, W2r, atol=1e-5) \
        and np.allclose(dH, dHr, atol=1e-5), "output_layer_step disagrees with the reference"
    Wc, bc = W2.copy(), b2.copy()
    loss_c = be.output_layer_step(H, Wc, bc, y_indptr, y_indices, 0.5, dH,
                                  label_chunk=a.label_chunk)
    assert abs(loss_c - lr_) < 1e-4 * abs(lr_) and np.allclose(Wc, W2r, atol=1e-5), \
        "chunked output_layer_step disagrees with the reference"

    # the step and its bare GEMMs (same shapes, NumPy matmul) timed in the same loop
    Wc = W2.copy()
    Zg = np.empty((B2, L), f32)
    dWg = np.empty((nh, L), f32)
    C = min(a.label_chunk, L)
    Zcg = np.empty((B2, C), f32)
    dWcg = np.empty((nh, C), f32)

    def gemms3():
        np.matmul(H, Wc, out=Zg)
        np.matmul(Zg, Wc.T, out=dH)
        np.matmul(H.T, Zg, out=dWg)

    def gemms4_chunked():  # the chunked path's floor: 4 GEMMs, chunk by chunk
        for c0 in range(0, L, C):
            c1 = min(L, c0 + C)
            Zc, Wcc = Zcg[:, : c1 - c0], Wc[:, c0:c1]
            np.matmul(H, Wcc, out=Zc)
            np.matmul(H, Wcc, out=Zc)
            np.matmul(Zc, Wcc.T, out=dH)
            np.matmul(H.T, Zc, out=dWcg[:, : c1 - c0])

    def step():
        be.output_layer_step(H, Wc, b2, y_indptr, y_indices, 1e-6, dH)

    def step_chunked():
        be.output_layer_step(H, Wc, b2, y_indptr, y_indices, 1e-6, dH, label_chunk=a.label_chunk)

    Zt = np.empty((B2, L), f32)
    loss_rows = np.empty(B2, np.float64)
    parts = np.empty((a.threads, L), f32)

    def xent_only():  # the plain step's softmax pass alone (bias, loss, dZ, db2 column sums)
        output_layer.softmax_xent_fused_cpu(Zt, b2, True, y_indptr, y_indices, 1.0 / B2,
                                            loss_rows, parts)

    T = interleaved({"gemms3": gemms3, "step": step, "xent": xent_only}, a.repeat,
                    before={"xent": lambda: np.matmul(H, W2, out=Zt)})
    t3 = T["gemms3"][0]
    t_step = T["step"][0]
    r = row("output_layer_step (plain)", t_step, t3, "3 bare sgemm (same loop)",
            f"x{t_step / t3:.2f} of the GEMMs (median x{T['step'][1] / T['gemms3'][1]:.2f});"
            " target <= 1.30", med=(T["step"][1], T["gemms3"][1]))
    r["ratio_to_gemms"], r["target"], r["met"] = t_step / t3, 1.3, t_step / t3 <= 1.3
    r["median_ratio_to_gemms"] = T["step"][1] / T["gemms3"][1]
    t_x = T["xent"][0]
    r = row("softmax_xent fused (alone)", t_x, t3, "3 bare sgemm (same loop)",
            f"x{t_x / t3:.2f} of the GEMMs; {B2 * L / t_x / 1e9:.2f} Gelem/s; one read+write "
            f"of Z at copy bw = {2 * Zt.nbytes / (bw * 1e9) * 1e3:.1f} ms",
            med=(T["xent"][1], T["gemms3"][1]))
    r["ratio_to_gemms"] = t_x / t3
    r["bytes_min"] = 2 * Zt.nbytes  # one read + one write of Z
    T = interleaved({"gemms3": gemms3, "gemms4": gemms4_chunked, "chunk": step_chunked},
                    max(5, a.repeat // 2))
    t_chunk = T["chunk"][0]
    n_chunks = -(-L // C)
    r = row(f"output_layer_step (chunk {a.label_chunk})", t_chunk, T["gemms3"][0],
            "3 bare sgemm (same loop)",
            f"x{t_chunk / T['gemms3'][0]:.2f} of the 3 GEMMs, x{t_chunk / T['gemms4'][0]:.2f} of "
            f"its 4 chunked GEMMs ({T['gemms4'][0] * 1e3:.1f} ms); floor ~1.33; {n_chunks} "
            "chunks x 6 parallel regions", med=(T["chunk"][1], T["gemms3"][1]))
    r["ratio_to_gemms"], r["target"] = t_chunk / T["gemms3"][0], 1.3
    r["met"] = r["ratio_to_gemms"] <= 1.3
    r["ratio_to_4_gemms"] = t_chunk / T["gemms4"][0]
    r["four_chunked_gemms_ms"] = T["gemms4"][0] * 1e3

    def numpy_step():
        Z = H @ Wc + b2
        Z -= Z.max(1, keepdims=True)
        np.exp(Z, out=Z)
        Z /= Z.sum(1, keepdims=True)
        for i in range(B2):
            if ny[i]:
                Z[i, y_indices[y_indptr[i]:y_indptr[i + 1]]] -= 1.0 / ny[i]
            else:
                Z[i] = 0
        Z /= B2
        dH[...] = Z @ Wc.T
        Wc[...] -= 1e-6 * (H.T @ Z)
        b2[...] -= 1e-6 * Z.sum(0)

    T = interleaved({"step": step, "np": numpy_step}, max(3, a.repeat // 3))
    row("output_layer_step (plain)", T["step"][0], T["np"][0], "NumPy expression step", "",
        med=(T["step"][1], T["np"][1]))
    T = interleaved({"k": lambda: be.topk(Zs, 5),
                     "np": lambda: np.argpartition(-Zs, 5, axis=1)[:, :5]}, max(3, a.repeat // 3))
    row("topk (k=5)", T["k"][0], T["np"][0], "np.argpartition (unsorted)", "",
        med=(T["k"][1], T["np"][1]))
    results["loadavg_at_end"] = os.getloadavg()

    _common.write_result(a.out, results)
    print(f"# wrote {a.out}")
    return results


if __name__ == "__main__":
    main()
