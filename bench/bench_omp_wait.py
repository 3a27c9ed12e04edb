"""Where the waits inside two devices' steps come from, and what removes them, measured.

numba's ``omp`` threading layer runs the engine's ``parallel=True`` kernels on GNU libgomp,
whose idle workers spin for ``GOMP_SPINCOUNT`` iterations (300,000 when ``OMP_WAIT_POLICY`` is
unset: about a millisecond) before they sleep. The trainer's main thread merges between
periods; merging on two numba threads left a helper spinning on a core that a device's worker
needs as the next period starts, so with two one-thread devices in one process the workers lost
about a millisecond now and then inside their steps (``busy_s`` above ``cpu_s`` in the merge
records). The engine now merges on one thread while merges are short
(:data:`xmc_engine.scheduler.runner.MERGE_ONE_THREAD_MAX_S`). Arms, each a child process with
its environment set before libgomp loads:

- ``before``: ``GOMP_SPINCOUNT=300000`` (libgomp's default) and merges on all threads
  (``MERGE_ONE_THREAD_MAX_S = 0``), the engine before this rule;
- ``engine``: neither variable set and the engine's rule, i.e. what a user gets;
- ``spin10k``: ``GOMP_SPINCOUNT=10000`` and merges on all threads (the other remedy: shorter
  spinning everywhere, which also touches one device's two-thread steps);
- ``passive``: ``OMP_WAIT_POLICY=passive`` (no spinning) and merges on all threads.

Workloads per dataset, each the per-sample busy (and CPU) time of :mod:`bench_contention`:
two devices of one process (``average`` on ``cpu,cpu``, one thread each), one device with two
threads, one device with one thread. Rounds interleave the arms; the table gives medians over
the rounds and the ratio to ``before``. Command (results in ``bench/results/omp_wait.json``)::

    python bench/bench_omp_wait.py --data delicious debian_debtags debian_builddeps \\
        --epochs 2 1 0.5 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
from bench_contention import add_data_epochs, epochs_per_dataset  # noqa: E402

#: arm -> (environment, whether the engine's merge-thread rule is on)
ARMS = {"before": ({"GOMP_SPINCOUNT": "300000"}, False),
        "engine": ({}, True),
        "spin10k": ({"GOMP_SPINCOUNT": "10000"}, False),
        "passive": ({"OMP_WAIT_POLICY": "passive"}, False)}
_CLEARED = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def child(name: str, epochs: float, merge_rule: bool) -> dict:
    """The three workloads on ``name`` in this process (``--child``)."""
    import _tta
    from bench_contention import fit, us_per_sample

    from xmc_engine.scheduler import runner

    if not merge_rule:
        runner.MERGE_ONE_THREAD_MAX_S = 0.0

    data = _tta.load_data(name)
    fit(data, "single", "cpu", 1, 0.05)  # compile (or load the cache) outside the timing
    two = fit(data, "average", "cpu,cpu", 1, epochs)
    one2 = fit(data, "single", "cpu", 2, epochs)
    one1 = fit(data, "single", "cpu", 1, epochs)
    return {"two_busy_us": us_per_sample(two), "two_cpu_us": us_per_sample(two, "cpu_s"),
            "one_2threads_us": us_per_sample(one2)[0], "one_1thread_us": us_per_sample(one1)[0],
            "env": {k: os.environ.get(k) for k in _CLEARED}}


def run_arm(arm: str, name: str, epochs: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    variables, merge_rule = ARMS[arm]
    env.update(variables)
    cmd = [sys.executable, __file__, "--child", "--data", name, "--epochs", str(epochs)]
    out = subprocess.run(cmd + ([] if merge_rule else ["--no-merge-rule"]), env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{arm} on {name} exited with {out.returncode}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(name: str, runs: dict[str, list[dict]]) -> list[dict]:
    """Per arm: medians over the rounds of each workload (two devices: the slower device's busy
    time and the mean of the two; their waits, busy over CPU time)."""
    rows = []
    for arm, rs in runs.items():
        slower = [max(r["two_busy_us"]) for r in rs]
        mean = [float(np.mean(r["two_busy_us"])) for r in rs]
        wait = [sum(r["two_busy_us"]) / sum(r["two_cpu_us"]) - 1.0 for r in rs]
        rows.append({"data": name, "arm": arm, "two_slower_us": float(np.median(slower)),
                     "two_mean_us": float(np.median(mean)), "two_wait": float(np.median(wait)),
                     "one_2threads_us": float(np.median([r["one_2threads_us"] for r in rs])),
                     "one_1thread_us": float(np.median([r["one_1thread_us"] for r in rs]))})
    base = next(r for r in rows if r["arm"] == "before")
    for r in rows:
        for k in ("two_slower_us", "two_mean_us", "one_2threads_us", "one_1thread_us"):
            r[k.replace("_us", "_ratio")] = r[k] / base[k]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_epochs(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-merge-rule", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "omp_wait.json"))
    args = p.parse_args(argv)
    epochs = epochs_per_dataset(p, args)
    if args.child:
        print(json.dumps(child(args.data[0], epochs[0], not args.no_merge_rule)))
        return 0
    if "before" not in args.arms:
        p.error("--arms needs before (the reference of the ratios)")
    meta = _common.result_metadata()
    rows, raw = [], {}
    for name, e in zip(args.data, epochs, strict=True):
        try:
            _common.dataset_paths(name)
        except _common.SkipBenchmark as err:
            print(f"SKIP {name}: {err}")
            continue
        runs = {arm: [] for arm in args.arms}
        for k in range(args.rounds):
            for arm in args.arms:
                runs[arm].append(run_arm(arm, name, e))
                r = runs[arm][-1]
                print(f"{name:17s} round {k} {arm:8s} two devices {r['two_busy_us'][0]:6.1f} / "
                      f"{r['two_busy_us'][1]:6.1f} us/sample (CPU {r['two_cpu_us'][0]:6.1f} / "
                      f"{r['two_cpu_us'][1]:6.1f}), one device 2 threads "
                      f"{r['one_2threads_us']:6.1f}, 1 thread {r['one_1thread_us']:6.1f}",
                      flush=True)
        raw[name] = runs
        rows += summarise(name, runs)
        arms = {a: {"env": v, "merge_rule": m} for a, (v, m) in ARMS.items()}
        _common.write_result(args.out, {**meta, "benchmark": "omp_wait", "arms": arms,
                                        "rows": rows, "runs": raw})
    print("\n| data | arm | two devices: slower / mean us per sample (x before), wait | "
          "one device, 2 threads | 1 thread |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['data']} | {r['arm']} | {r['two_slower_us']:.1f} / {r['two_mean_us']:.1f} "
              f"({r['two_slower_ratio']:.2f}x / {r['two_mean_ratio']:.2f}x), "
              f"{r['two_wait']:.0%} | {r['one_2threads_us']:.1f} ({r['one_2threads_ratio']:.2f}x) "
              f"| {r['one_1thread_us']:.1f} ({r['one_1thread_ratio']:.2f}x) |")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
