"""Cross-node merge cost (weighted all-reduce + central momentum) against model size, over MPI.

DESIGN.md §6. For models of ``--labels`` (default 10k, 100k, 1M) labels, hidden 128 and
``--features`` inputs, and for ``--ranks`` (default 2 and 4) MPI processes on this machine, times

- ``combine``: :meth:`xmc_engine.distributed.MPIComm.combine` (weights exchange + scaled
  ``Iallreduce`` polled against the deadline: what every merge of a multi-node run pays),
- ``momentum``: :func:`~xmc_engine.scheduler.merge.central_momentum` on the merged model,
- ``Allreduce``: a plain blocking ``MPI_Allreduce`` of the same buffers (the competitor: what
  the polling and the weight exchange cost on top),

each the slowest rank's time, median of ``--repeat`` runs after a warm-up, and compares the merge
with one training step of the same model (batch 128, one thread: a rank's share of this machine
when two ranks run on two cores), measured in the launching process. Before timing, every
configuration checks ``combine`` against the exact weighted mean.

Usage::

    python bench/bench_merge_mpi.py                 # launches mpiexec itself; table + JSON
    python bench/bench_merge_mpi.py --labels 10000 --ranks 2 --repeat 3   # quick check

Results: ``bench/results/merge_mpi.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

HIDDEN = 128


def _model(n_features: int, n_labels: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n_features, HIDDEN), dtype=np.float32),
            rng.standard_normal(HIDDEN, dtype=np.float32),
            rng.standard_normal((HIDDEN, n_labels), dtype=np.float32),
            rng.standard_normal(n_labels, dtype=np.float32)]


# ---------------------------------------------------------------------------------- worker
def worker(args) -> None:
    """One rank (under mpiexec): check, warm up, time; rank 0 writes the JSON lines."""
    from mpi4py import MPI

    from xmc_engine.backends import get_backend
    from xmc_engine.distributed import MPIComm
    from xmc_engine.scheduler.merge import central_momentum

    comm = MPIComm(timeout=600)
    be = get_backend("cpu")
    mpi = comm.comm
    rows = []
    for n_labels in args.labels:
        # Correctness: arrays of (rank + 1) with weight (rank + 1) merge to Σ(r+1)²/Σ(r+1).
        chk = [np.full(1000, comm.rank + 1, np.float32)]
        comm.combine(chk, float(comm.rank + 1))
        r = np.arange(1, comm.size + 1, dtype=np.float64)
        want = float((r * r).sum() / r.sum())
        if not np.allclose(chk[0], want, rtol=1e-6):
            raise SystemExit(f"rank {comm.rank}: combine gave {chk[0][0]}, want {want}")

        w = _model(args.features, n_labels, comm.rank)
        z1 = [a.copy() for a in w]
        z2 = [a.copy() for a in w]
        out = [np.empty_like(a) for a in w]
        n_params = sum(a.size for a in w)
        t_comb, t_mom, t_block = [], [], []
        for it in range(args.repeat + 1):  # the first is the warm-up
            mpi.Barrier()
            t0 = time.perf_counter()
            comm.combine(w, float(10 + comm.rank))
            t1 = time.perf_counter()
            central_momentum(w, z1, z2, 0.5, out, be)
            t2 = time.perf_counter()
            mpi.Barrier()
            t3 = time.perf_counter()
            for a in w:
                mpi.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
            t4 = time.perf_counter()
            for a in w:  # keep the values bounded
                a *= np.float32(1.0 / comm.size)
            if it:
                t_comb.append(t1 - t0)
                t_mom.append(t2 - t1)
                t_block.append(t4 - t3)
        slow = np.array([np.median(t_comb), np.median(t_mom), np.median(t_block)])
        mpi.Allreduce(MPI.IN_PLACE, slow, op=MPI.MAX)
        del w, z1, z2, out
        if comm.is_root:
            rows.append({"ranks": comm.size, "n_labels": n_labels, "n_features": args.features,
                         "hidden": HIDDEN, "n_params": int(n_params),
                         "model_mib": n_params * 4 / 2**20, "repeat": args.repeat,
                         "combine_s": float(slow[0]), "momentum_s": float(slow[1]),
                         "blocking_allreduce_s": float(slow[2])})
    if comm.is_root:
        Path(args.worker_out).write_text(json.dumps(rows))


# ---------------------------------------------------------------------------------- driver
def step_time(n_features: int, n_labels: int, repeat: int, label_chunk) -> float:
    """Median seconds of one training step (batch 128, one CPU thread) of the model."""
    import scipy.sparse as sp

    from xmc_engine.backends import get_backend
    from xmc_engine.model import MLPReplica, ModelShape, init_params

    n, nnz, labels_per_row = 1024, 40, 5
    rng = np.random.default_rng(0)
    X = sp.random(n, n_features, density=nnz / n_features, format="csr", dtype=np.float32,
                  random_state=1)
    cols = rng.integers(0, n_labels, size=(n, labels_per_row))
    Y = sp.csr_matrix((np.ones(cols.size, np.float32), cols.ravel(),
                       np.arange(0, cols.size + 1, labels_per_row)), shape=(n, n_labels))
    Y.sum_duplicates()
    Y.data[:] = 1.0
    be = get_backend("cpu", threads=1)
    params = init_params(ModelShape(n_features, n_labels, (HIDDEN,)), 0)
    rep = MLPReplica(be, X, Y, params, label_chunk=label_chunk)
    times = []
    with be.thread_budget(1):
        for it in range(repeat + 1):
            rows = rng.choice(n, 128, replace=False).astype(np.int64)
            t0 = time.perf_counter()
            rep.train_batch(rows, 0.1)
            be.synchronize()  # synchronize!
            if it:
                times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", type=lambda s: [int(v) for v in s.split(",")],
                    default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--features", type=int, default=5000)
    ap.add_argument("--ranks", type=lambda s: [int(v) for v in s.split(",")], default=[2, 4])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(_common.RESULTS_DIR / "merge_mpi.json"))
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        try:
            worker(args)
        except BaseException as exc:  # never leave the other ranks hanging
            from xmc_engine.distributed import MPIComm

            MPIComm().fail(exc)
        return
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    if not Path(mpiexec).exists():
        raise SystemExit("mpiexec not found: pip install 'xmc-engine[mpi]'")
    meta = _common.result_metadata(machine_extra={"mpi": _mpi_version()})
    rows = []
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            res = Path(tmp) / "rows.json"
            cmd = [mpiexec, "-n", str(ranks), sys.executable, __file__,
                   "--labels", ",".join(map(str, args.labels)), "--features", str(args.features),
                   "--repeat", str(args.repeat), "--worker-out", str(res)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
            subprocess.run(cmd, check=True, env=env)
            rows += json.loads(res.read_text())
    steps = {}
    for n_labels in args.labels:
        chunk = 65536 if n_labels >= 1_000_000 else None
        steps[n_labels] = (step_time(args.features, n_labels, max(2, args.repeat // 2), chunk),
                           chunk)
    print(f"{'labels':>9} {'params':>8} {'MiB':>7} {'ranks':>5} {'combine':>9} {'momentum':>9} "
          f"{'merge':>9} {'Allreduce':>9} {'step':>9} {'merge/step':>10}")
    for r in rows:
        st, chunk = steps[r["n_labels"]]
        r["merge_s"] = r["combine_s"] + r["momentum_s"]
        r["step_s"], r["step_label_chunk"] = st, chunk
        r["merge_over_step"] = r["merge_s"] / st
        print(f"{r['n_labels']:>9} {r['n_params'] / 1e6:>7.2f}M {r['model_mib']:>7.1f} "
              f"{r['ranks']:>5} {r['combine_s'] * 1e3:>8.1f}m {r['momentum_s'] * 1e3:>8.1f}m "
              f"{r['merge_s'] * 1e3:>8.1f}m {r['blocking_allreduce_s'] * 1e3:>8.1f}m "
              f"{st * 1e3:>8.1f}m {r['merge_over_step']:>10.2f}")
    payload = {**meta, "benchmark": "merge_mpi",
               "settings": {"hidden": HIDDEN, "features": args.features, "repeat": args.repeat,
                            "batch": 128, "step_threads": 1, "times": "median, slowest rank"},
               "results": rows}
    print(f"wrote {_common.write_result(args.out, payload)}")


def _mpi_version() -> str | None:
    try:
        from mpi4py import MPI

        return MPI.Get_library_version().strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - recorded as unknown
        return None


if __name__ == "__main__":
    main()
