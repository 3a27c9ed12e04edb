"""GPU check: every CUDA kernel against the reference on a real GPU, then timed at a size that
fills a big GPU (CuPy arrays, one non-blocking stream, CUDA events).

    python bench/gpu_check.py                    # full size (H200-class GPU, < 5 minutes)
    python bench/gpu_check.py --scale 0.1        # smaller GPU / quicker
    python bench/gpu_check.py --out result.json  # default: $OUT/gpu_check.json or bench/results/

Without CUDA it prints ``SKIPPED: no CUDA device`` and exits 0. Structure: ``main()`` runs
``check_kernels()`` (correctness + timing table) and then any further sections (a multi-device
section can be appended to ``SECTIONS``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies the timed sizes (1.0 fills tens of GiB)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def _has_cuda() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:  # noqa: BLE001 - any failure means no GPU
        return False


class Timer:
    """CUDA-event timing on the backend's stream (best of ``repeat`` after one warm-up)."""

    def __init__(self, be, repeat):
        self.be, self.repeat = be, repeat

    def __call__(self, fn):
        import cupy

        fn()
        best = float("inf")
        for _ in range(self.repeat):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(self.be.stream)
            fn()
            stop.record(self.be.stream)
            stop.synchronize()  # synchronize!
            best = min(best, cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        return best


def peaks(device_id):
    """Theoretical peaks from the device attributes (bandwidth; fp32 FLOP/s is not exposed by
    CUDA, so the measured sgemm of a large square GEMM stands in as the FLOP ceiling)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    try:
        bus = props["memoryBusWidth"]
        clk = props["memoryClockRate"]  # kHz
        bw = 2 * clk * 1e3 * bus / 8 / 1e9
    except KeyError:  # removed from cudaDeviceProp in CUDA 13: fall back to a measured copy
        bw = None
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {"name": name, "sm_count": props["multiProcessorCount"],
            "total_mem_GiB": props["totalGlobalMem"] / 2**30, "peak_GBps": bw}


def check_kernels(args, report):
    """Correctness on small random inputs (incl. empty rows), then the timing table."""
    import cupy
    import scipy.sparse as sps
    from xmc_engine.kernels import reference

    from xmc_engine.backends.cuda import CUDABackend

    be = CUDABackend(args.device)
    rng = np.random.default_rng(0)
    f32 = np.float32
    checks = {}

    # ---------------------------------------------------------------- correctness
    B, F, nh, L = 37, 500, 70, 1001
    X = sps.random(B, F, density=0.05, format="csr", dtype=f32, random_state=1)
    X = X.tolil()
    X[3, :] = 0
    X = X.tocsr()
    Y = sps.random(B, L, density=0.004, format="csr", dtype=f32, random_state=2)
    W1 = rng.standard_normal((F, nh)).astype(f32)
    b1 = rng.standard_normal(nh).astype(f32)
    W2 = (rng.standard_normal((nh, L)) * 0.1).astype(f32)
    b2 = (rng.standard_normal(L) * 0.1).astype(f32)
    ip, ix, d = be.csr_parts(X)
    yp, yi = be.asarray(Y.indptr), be.asarray(Y.indices)

    def close(name, got, want, atol=1e-4):
        ok = bool(np.allclose(be.to_host(got), want, atol=atol, rtol=1e-4))
        checks[name] = ok
        return ok

    H = be.zeros((B, nh))
    be.sparse_forward(ip, ix, d, be.asarray(W1), be.asarray(b1), H)
    Hr = reference.sparse_forward(X.indptr, X.indices, X.data, W1, b1)
    close("sparse_forward", H, Hr)
    dZ1 = rng.standard_normal((B, nh)).astype(f32)
    Wd, bd = be.asarray(W1.copy()), be.asarray(b1.copy())
    be.sparse_backward_update(ip, ix, d, be.asarray(dZ1), Wd, bd, 0.1)
    Wr, br = reference.sparse_backward_update(X.indptr, X.indices, X.data, dZ1, W1, b1, 0.1)
    close("sparse_backward_update", Wd, Wr) and close("sparse_backward_update b1", bd, br)
    rows, g, gb = be.sparse_grad(ip, ix, d, be.asarray(dZ1))
    r_rows, r_g, r_gb = reference.sparse_grad(X.indptr, X.indices, X.data, dZ1)
    checks["sparse_grad rows"] = bool(np.array_equal(be.to_host(rows), r_rows))
    close("sparse_grad", g, r_g)
    Wd = be.asarray(W1.copy())
    be.sparse_rows_update(Wd, rows, g, 0.1)
    close("sparse_rows_update", Wd, reference.sparse_rows_update(W1, r_rows, r_g, 0.1))
    dH = rng.standard_normal((B, nh)).astype(f32)
    dHd = be.asarray(dH.copy())
    be.relu_backward(dHd, be.asarray(Hr.astype(f32)))
    close("relu_backward", dHd, reference.relu_backward(dH, Hr))
    Z = (Hr @ W2 + b2).astype(f32)
    Zd = be.asarray(Z.copy())
    loss = be.softmax_xent(Zd, yp, yi, 0.5)
    dZr, loss_r = reference.softmax_xent(Z.astype(np.float64), Y.indptr, Y.indices, 0.5)
    close("softmax_xent", Zd, dZr, 1e-6)
    checks["softmax_xent loss"] = bool(abs(float(loss) - loss_r) <= 1e-4 * abs(loss_r))
    Hd = be.asarray(Hr.astype(f32))
    step_r = reference.output_layer_step(Hr.astype(np.float64), W2.astype(np.float64),
                                         b2.astype(np.float64), Y.indptr, Y.indices, 0.5)
    for chunk in (None, 300):
        W2d, b2d, dHo = be.asarray(W2.copy()), be.asarray(b2.copy()), be.zeros((B, nh))
        loss = be.output_layer_step(Hd, W2d, b2d, yp, yi, 0.5, dHo, label_chunk=chunk)
        tag = f"output_layer_step chunk={chunk}"
        checks[tag + " loss"] = bool(abs(float(loss) - step_r[0]) <= 1e-4 * abs(step_r[0]))
        close(tag + " W2", W2d, step_r[1], 1e-5)
        close(tag + " b2", b2d, step_r[2], 1e-5)
        close(tag + " dH", dHo, step_r[3], 1e-5)
        lg, dW2, db2, dHg = be.output_layer_grad(Hd, be.asarray(W2), be.asarray(b2), yp, yi,
                                                 label_chunk=chunk)
        gr = reference.output_layer_grad(Hr.astype(np.float64), W2.astype(np.float64),
                                         b2.astype(np.float64), Y.indptr, Y.indices)
        close(f"output_layer_grad chunk={chunk} dW2", dW2, gr[1], 1e-5)
        idx, val = be.predict_scores_topk(Hd, be.asarray(W2), be.asarray(b2), 5,
                                          label_chunk=chunk)
        ir, vr = reference.predict_scores_topk(Hr.astype(f32), W2, b2, 5)
        checks[f"predict_scores_topk chunk={chunk}"] = bool(
            np.array_equal(be.to_host(idx), ir))
    a1, a2 = (be.asarray(rng.standard_normal(1000).astype(f32)) for _ in range(2))
    o = be.empty(1000)
    be.weighted_sum([a1, a2], [0.3, 0.7], o)
    close("weighted_sum", o, 0.3 * be.to_host(a1) + 0.7 * be.to_host(a2), 1e-6)
    report["checks"] = checks
    bad = [k for k, v in checks.items() if not v]
    print(f"correctness: {len(checks) - len(bad)}/{len(checks)} ok" +
          (f"; FAILED: {bad}" if bad else ""))

    # ---------------------------------------------------------------- timing
    s = args.scale
    timer = Timer(be, args.repeat)
    pk = peaks(args.device)
    n = int(2**28 * s)  # 1 GiB float32
    src, dst = cupy.ones(n, f32), cupy.empty(n, f32)
    with be.stream:
        t = timer(lambda: dst.__setitem__(Ellipsis, src))
    copy_bw = 2 * src.nbytes / t / 1e9
    pk["copy_GBps"] = copy_bw
    peak_bw = pk["peak_GBps"] or copy_bw
    m_ = int(8192 * max(s, 0.25))
    A = cupy.ones((m_, m_), f32)
    with be.stream:
        t = timer(lambda: cupy.matmul(A, A))
    sgemm_tf = 2 * m_**3 / t / 1e12
    pk["sgemm_TFLOPs"] = sgemm_tf
    A = src = dst = None  # noqa: F841 - free the memory
    report["peaks"] = pk
    rows = []

    def line(name, t, nbytes=None, flops=None):
        r = {"kernel": name, "ms": t * 1e3}
        txt = f"{name:<42s} {t * 1e3:9.3f} ms"
        if nbytes is not None:
            r["GBps"] = nbytes / t / 1e9
            txt += f"   {r['GBps']:8.1f} GB/s ({r['GBps'] / peak_bw:5.1%} of peak)"
        if flops is not None:
            r["TFLOPs"] = flops / t / 1e12
            txt += f"   {r['TFLOPs']:7.2f} TFLOP/s ({r['TFLOPs'] / sgemm_tf:5.1%} of sgemm)"
        rows.append(r)
        print(txt)

    print(f"# {pk['name']}: {pk['sm_count']} SMs, {pk['total_mem_GiB']:.0f} GiB, peak "
          f"{peak_bw:.0f} GB/s, copy {copy_bw:.0f} GB/s, sgemm {sgemm_tf:.1f} TFLOP/s")
    # sparse layer: Amazon-670K-like batch
    B, F, nh, nnz_row = int(65536 * s) or 1, 1_000_000, 256, 80
    nnz = B * nnz_row
    indptr = cupy.arange(0, nnz + 1, nnz_row, dtype=cupy.int64)
    indices = cupy.asarray(rng.integers(0, F, nnz, dtype=np.int64).astype(np.int32))
    data = cupy.ones(nnz, f32)
    W1 = cupy.ones((F, nh), f32) * 0.01
    b1 = cupy.zeros(nh, f32)
    H = cupy.empty((B, nh), f32)
    dZ1 = cupy.ones((B, nh), f32)
    gathered = nnz * nh * 4 + B * nh * 4
    line(f"sparse_forward B={B} F={F} h={nh}",
         timer(lambda: be.sparse_forward(indptr, indices, data, W1, b1, H)), gathered)
    line("sparse_backward_update (atomics)",
         timer(lambda: be.sparse_backward_update(indptr, indices, data, dZ1, W1, b1, 1e-9)),
         2 * gathered)
    line("relu_backward", timer(lambda: be.relu_backward(dZ1, H)), 3 * H.nbytes)
    W1 = dZ1 = None  # noqa: F841
    # output layer: a large label space
    B2, L = int(2048 * max(s, 0.05)), int(1_000_000 * max(s, 0.05))
    Ho = cupy.ones((B2, nh), f32)
    W2 = cupy.ones((nh, L), f32) * 1e-3
    b2 = cupy.zeros(L, f32)
    yp = cupy.arange(0, B2 * 5 + 1, 5, dtype=cupy.int64)
    yi = cupy.asarray(rng.integers(0, L, B2 * 5).astype(np.int32))
    dHo = cupy.empty((B2, nh), f32)
    Zb = cupy.empty((B2, L), f32)
    gemm_flops = 2.0 * B2 * nh * L
    with be.stream:
        t_g = timer(lambda: cupy.matmul(Ho, W2, out=Zb))
    line(f"sgemm H@W2 B={B2} h={nh} L={L}", t_g, flops=gemm_flops)
    line("softmax_xent", timer(lambda: be.softmax_xent(Zb, yp, yi, 1.0 / B2)), 2 * Zb.nbytes)
    line("topk k=5", timer(lambda: be.topk(Zb, 5)), Zb.nbytes)
    Zb = None  # noqa: F841
    line("output_layer_step (plain)",
         timer(lambda: be.output_layer_step(Ho, W2, b2, yp, yi, 1e-9, dHo)),
         flops=3 * gemm_flops)
    line("output_layer_step (label_chunk=131072)",
         timer(lambda: be.output_layer_step(Ho, W2, b2, yp, yi, 1e-9, dHo,
                                            label_chunk=131072)), flops=4 * gemm_flops)
    line("predict_scores_topk k=5 (chunk 131072)",
         timer(lambda: be.predict_scores_topk(Ho, W2, b2, 5, label_chunk=131072)),
         flops=gemm_flops)
    P = [cupy.ones(W2.size, f32) for _ in range(4)]
    out = cupy.empty_like(P[0])
    line("weighted_sum of 4 replicas", timer(lambda: be.weighted_sum(P, [0.25] * 4, out)),
         (4 * 2 + 4) * out.nbytes / 2)  # 4 read+rmw passes (pairwise)
    line("momentum", timer(lambda: be.momentum(P[0], P[1], P[2], 0.9, out)), 4 * out.nbytes)
    line("elastic", timer(lambda: be.elastic(P[0], P[1], 0.1, P[2])), 4 * out.nbytes)
    report["timings"] = rows
    be.synchronize()
    return not bad


#: further sections appended by later work (e.g. an adaptive multi-device section)
SECTIONS = []


def main(argv=None):
    args = parse_args(argv)
    if not _has_cuda():
        print("bench/gpu_check.py needs a CUDA GPU with CuPy (cupy.is_available() is False).")
        print("SKIPPED: no CUDA device")
        return 0
    t0 = time.perf_counter()
    report = {"argv": sys.argv[1:]}
    ok = check_kernels(args, report)
    for section in SECTIONS:
        ok = section(args, report) and ok
    report["seconds"] = time.perf_counter() - t0
    out = args.out
    if out is None:
        base = os.environ.get("OUT")
        out = (Path(base) if base else Path(__file__).resolve().parent / "results") / \
            "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"# wrote {out} ({report['seconds']:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
