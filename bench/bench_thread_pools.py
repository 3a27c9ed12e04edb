"""Which of the CPU's two thread pools should a device's threads go to? One device, the defaults
with a fixed thread budget, trained with one thread, and with all cores given to numba's
kernels and OpenBLAS both (the engine's only budget of several threads), to numba's kernels
only (BLAS on one thread) or to BLAS only (numba on one thread); each with the trainer's main
thread keeping its OpenMP pool (as the engine does) and with it freed before every period
(:func:`xmc_engine.backends.cpu.release_thread_pool`). One process, the arms one after the
other, alternating over ``--repeats``.

A study: the pools are set here by replacing ``CPUBackend.thread_budget`` and the trainer's
period in this process. A calibration among one thread and the two single pools, built on it
(``7cde9cc``), was not kept (``bench/RESULTS.md``, "One pool at a time"). Printed per dataset:
each arm's median training seconds and its speed-up over one thread. Results in ``--out``::

    python bench/bench_thread_pools.py --out bench/results/thread_pools.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import bench_defaults  # noqa: E402
import bench_threads  # noqa: E402

#: arm -> (numba's threads, BLAS's threads) as a share of the cores: 1 = all of them
POOLS = {"1 thread": (0, 0), "both": (1, 1), "kernels only": (1, 0), "BLAS only": (0, 1)}


def install(state: dict) -> None:
    """Make every CPU thread budget follow ``state["pools"]`` and, where ``state["free"]``,
    free the main thread's OpenMP pool before each period of the trainer."""
    from threadpoolctl import threadpool_limits

    from xmc_engine.backends import cpu
    from xmc_engine.scheduler import runner

    @contextlib.contextmanager
    def thread_budget(self, n=None):
        n = int(n or self.threads)
        kernels, blas = (n if share else 1 for share in state["pools"])
        with self.kernel_threads(kernels), threadpool_limits(limits=blas, user_api="blas"):
            yield

    period = runner.Trainer._period_threads

    def period_threads(self, lrs):
        if state["free"]:
            cpu.release_thread_pool()
        return period(self, lrs)

    cpu.CPUBackend.thread_budget = thread_budget
    runner.Trainer._period_threads = period_threads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_threads.add_run_args(p, 2, "thread_pools.json")
    args = p.parse_args(argv)
    cores = os.cpu_count() or 1
    if cores < 2:
        raise SystemExit("bench_thread_pools.py: one core here, nothing to share out")
    state = {"pools": (0, 0), "free": False}
    install(state)
    arms = [(f"{pool}{', main pool freed' if free else ''}", pools, free)
            for pool, pools in POOLS.items() for free in (False, True)
            if pool != "1 thread" or not free]
    payload = {**_common.result_metadata(), "benchmark": "thread_pools", "epochs": args.epochs,
               "cores": cores, "rows": []}
    for name, X, Y, Xt, Yt, note in bench_defaults.datasets_present(args.datasets,
                                                                      args.max_train):
        data = (X, Y, Xt, Yt)
        bench_defaults.run_one(data, {}, 0, [1], 1)  # compile / load the cache first
        runs: dict[str, list[float]] = {label: [] for label, _, _ in arms}
        for rep in range(args.repeats):
            for label, pools, free in arms:
                state.update(pools=pools, free=free)
                threads = 1 if pools == (0, 0) else cores
                r = bench_defaults.run_one(data, {}, rep, [args.epochs], threads)
                runs[label].append(r["at"][str(args.epochs)]["train_time"])
        med = {k: float(np.median(v)) for k, v in runs.items()}
        one = med["1 thread"]
        payload["rows"].append({"dataset": name, "note": note, "runs": runs,
                                "median_train_s": med,
                                "speedup": {k: one / v for k, v in med.items()}})
        print(f"{name}: " + ", ".join(f"{k} {v:.2f} s ({one / v:.2f}x)" for k, v in med.items()),
              flush=True)
        _common.write_json(args.out, payload)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
