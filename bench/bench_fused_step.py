"""The fused CPU training step (one ``nogil`` call, ``kernels/train_step.py``) against the
host-level step it replaces (some fifteen backend calls with Python between them).

Per dataset, in one process: two replicas of the engine's default network (hidden 128, Adagrad
lr 0.05, batch 64, rows scaled to unit norm, the output layer ``output="auto"`` picks: exact, or
sampled with ``K = 1024`` uniform negatives on large label spaces) from the same start, one
with the fused step and one without (``MLPReplica(fused=False)``), step in alternating blocks
of ``--steps`` random batches, ``--rounds`` times:

- **one thread**: one replica at a time on a fresh thread with a 1-thread budget (a device
  alone);
- **two threads**: two replicas of the same kind at once, each on its own thread with a
  1-thread budget (two CPU devices of one process, as the scheduler runs them), both fused or
  both host-level;
- **gradient alone**: one replica's ``grad_batch`` (the gradient without the update, what
  ``sync`` computes on each device), one thread.

Reported: median microseconds per step over the rounds, the host-level time over the fused time
(above 1: fused faster), and each kind's two-thread time over its one-thread time (the cost of
sharing the process; 1.0 on two idle cores would be no cost). The two kinds' parameters after
the first block are compared too (they must agree to float rounding). Results in
``bench/results/fused_step.json``::

    python bench/bench_fused_step.py --data delicious debian_debtags bibtex debian_builddeps
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import _tta  # noqa: E402


def replicas(name: str, n: int) -> dict[str, list]:
    """``{"fused": [...], "host": [...]}``: ``n`` replicas of each kind of the default network on
    ``name`` (the output layer the engine's ``output="auto"`` picks for the data), all from the
    same start; the data is loaded and normalised once for both."""
    from xmc_engine.backends import get_backend
    from xmc_engine.config import TrainConfig
    from xmc_engine.model import MLPReplica, ModelShape, init_params_for_data
    from xmc_engine.validation import normalize_rows

    X, Y = _tta.load_data(name)[:2]
    X = normalize_rows(X, "l2")
    params = init_params_for_data(ModelShape(X.shape[1], Y.shape[1], (128,)), X, 0)
    output = TrainConfig().output_for(Y.shape[1], Y.nnz / max(Y.shape[0], 1))
    return {kind: [MLPReplica(get_backend("cpu", threads=1), X, Y, params, optimizer="adagrad",
                              output=output, fused=kind == "fused") for _ in range(n)]
            for kind in ("fused", "host")}


def run_threads(reps, steps: int, seed: int, grad: bool = False) -> list[float]:
    """Each replica ``steps`` steps (``grad``: gradients without the update, as ``sync``
    computes them) on its own fresh thread (1-thread budget), all at once; microseconds per
    step of each."""
    out = [0.0] * len(reps)
    n_rows = reps[0].X.shape[0]

    def work(i):
        rng = np.random.default_rng(seed + i)
        batches = [rng.integers(0, n_rows, 64) for _ in range(steps)]
        with reps[i].backend.thread_budget(1):
            t0 = time.perf_counter()
            for rows in batches:
                if grad:
                    reps[i].grad_batch(rows)
                else:
                    reps[i].train_batch(rows, 0.05)
            out[i] = (time.perf_counter() - t0) / steps * 1e6

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(reps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def measure(name: str, steps: int, rounds: int) -> dict:
    kinds = replicas(name, 2)
    output = kinds["fused"][0].output
    # the same batches from the same start: the two steps must agree
    run_threads(kinds["fused"][:1], 20, 0)
    run_threads(kinds["host"][:1], 20, 0)
    diff = max(float(np.abs(a - b).max())
               for a, b in zip(kinds["fused"][0].params(), kinds["host"][0].params(), strict=True))
    one = {k: [] for k in kinds}
    two = {k: [] for k in kinds}
    grad = {k: [] for k in kinds}
    for r in range(rounds):
        for k, reps in kinds.items():
            one[k].append(run_threads(reps[:1], steps, 100 + r)[0])
            two[k].append(max(run_threads(reps, steps, 200 + r)))
            grad[k].append(run_threads(reps[:1], steps, 300 + r, grad=True)[0])
    row = {"data": name, "output": output, "steps": steps, "rounds": rounds,
           "max_param_diff": diff,
           "one_thread_us": {k: statistics.median(v) for k, v in one.items()},
           "two_threads_us": {k: statistics.median(v) for k, v in two.items()},
           "grad_one_thread_us": {k: statistics.median(v) for k, v in grad.items() if v},
           "runs": {"one": one, "two": two, "grad": grad}}
    row["speedup_one"] = row["one_thread_us"]["host"] / row["one_thread_us"]["fused"]
    row["speedup_two"] = row["two_threads_us"]["host"] / row["two_threads_us"]["fused"]
    row["sharing_cost"] = {k: row["two_threads_us"][k] / row["one_thread_us"][k] for k in kinds}
    g = row["grad_one_thread_us"]
    row["speedup_grad"] = g["host"] / g["fused"] if g else None
    grad_text = (f" | gradient alone: host {g['host']:7.0f} us, fused {g['fused']:7.0f} us "
                 f"({row['speedup_grad']:.2f}x)" if g else "")
    print(f"{name:16s} ({output}) one thread: host {row['one_thread_us']['host']:7.0f} us, fused "
          f"{row['one_thread_us']['fused']:7.0f} us ({row['speedup_one']:.2f}x) | two threads: "
          f"host {row['two_threads_us']['host']:7.0f} us, fused "
          f"{row['two_threads_us']['fused']:7.0f} us ({row['speedup_two']:.2f}x) | sharing "
          f"cost host {row['sharing_cost']['host']:.2f}x, fused {row['sharing_cost']['fused']:.2f}x"
          f"{grad_text} | max param diff {diff:.1e}", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="+", default=["delicious"])
    p.add_argument("--steps", type=int, default=300, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "fused_step.json"))
    args = p.parse_args(argv)
    meta = _common.result_metadata()
    rows = [measure(name, args.steps, args.rounds) for name in args.data]
    path = _common.write_result(args.out, {**meta, "benchmark": "fused_step", "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
