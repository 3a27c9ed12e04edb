"""What a script that imports NumPy before the engine gets: OpenBLAS's spinning workers against
the engine's reset of them.

OpenBLAS's idle workers spin for about 2^28 cycles after each threaded call unless
``OPENBLAS_THREAD_TIMEOUT`` says otherwise, and it reads that variable when it is loaded.
``import xmc_engine`` sets it to 4, which used to act only where the engine came first (the
``xmc-engine`` command). Where NumPy came first (most scripts, and most of ``bench/``), the
workers kept spinning on the cores that numba's kernels needed next. Now the engine also makes
the OpenBLAS copies already loaded read the variable again and restart their pools
(``xmc_engine._env.reset_loaded_openblas``). Arms, each a child process that imports NumPy
first:

- ``spin``: ``OPENBLAS_THREAD_TIMEOUT=0``, OpenBLAS's own default (which the engine keeps,
  as any value the user sets): what such a script got before the reset;
- ``engine``: the variable unset: what such a script gets now.

Workloads: the chunked top-k prediction of ``bench_predict.py`` at the Amazon-670K shape
(512 rows, label chunks of 32,768, k = 1, two threads for BLAS and for numba's fold), and
two fits with every default but ``threads``: one device on two threads, and ``average`` on
``cpu,cpu`` (one thread each). Rounds interleave the arms; the table gives medians.

Usage::

    python bench/bench_blas_timeout.py --data delicious debian_builddeps --epochs 2 0.5 --rounds 3

Results: ``bench/results/blas_timeout.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np  # first, on purpose: the case this bench is about

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
from bench_contention import add_data_epochs, epochs_per_dataset  # noqa: E402

ARMS = {"spin": {"OPENBLAS_THREAD_TIMEOUT": "0"}, "engine": {}}


def child(datasets: list[str], epochs: list[float], predict_labels: int) -> dict:
    """The workloads in this process (``--child``); NumPy was imported before the engine."""
    import _tta
    import bench_predict
    from bench_contention import fit, us_per_sample

    from xmc_engine import _env

    out = {"openblas_timeouts": _env.openblas_timeouts(), "predict": None, "fits": {}}
    if predict_labels:
        (row,) = bench_predict.run(predict_labels, 128, 512, [32_768], [1], repeats=3)
        out["predict"] = {k: row[k] for k in ("folded_s", "merged_s", "sgemm_s")}
    for name, e in zip(datasets, epochs, strict=True):
        data = _tta.load_data(name)
        fit(data, "single", "cpu", 1, 0.05)  # compile (or load the cache) outside the timing
        one2 = fit(data, "single", "cpu", 2, e)
        two = fit(data, "average", "cpu,cpu", 1, e)
        out["fits"][name] = {"one_2threads_us": us_per_sample(one2)[0],
                             "two_devices_slower_us": max(us_per_sample(two))}
    return out


def run_arm(arm: str, datasets: list[str], epochs: list[float], predict_labels: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env.update(ARMS[arm])
    cmd = [sys.executable, __file__, "--child", "--predict-labels", str(predict_labels),
           "--data", *datasets, "--epochs", *map(str, epochs)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"arm {arm} exited with {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per workload: the median of each arm over the rounds, and spin / engine."""
    rows = []
    first = runs["engine"][0]
    keys = [("predict", k) for k in ("folded_s", "merged_s", "sgemm_s") if first["predict"]]
    keys += [(name, k) for name in first["fits"]
             for k in ("one_2threads_us", "two_devices_slower_us")]
    for where, k in keys:
        med = {}
        for arm, rs in runs.items():
            vals = [(r["predict"] if where == "predict" else r["fits"][where])[k] for r in rs]
            med[arm] = float(np.median(vals))
        rows.append({"workload": where, "measure": k, **med,
                     "spin_over_engine": med["spin"] / med["engine"]})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_epochs(p)
    p.add_argument("--predict-labels", type=int, default=670_091,
                   help="labels of the prediction workload (0: leave it out)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "blas_timeout.json"))
    args = p.parse_args(argv)
    epochs = epochs_per_dataset(p, args)
    if args.child:
        print(json.dumps(child(args.data, epochs, args.predict_labels)))
        return 0
    datasets, data_epochs = [], []
    for name, e in zip(args.data, epochs, strict=True):
        try:
            _common.dataset_paths(name)
            datasets.append(name)
            data_epochs.append(e)
        except _common.SkipBenchmark as err:
            print(f"SKIP {name}: {err}")
    runs = {arm: [] for arm in ARMS}
    for k in range(args.rounds):
        for arm in ARMS:
            r = run_arm(arm, datasets, data_epochs, args.predict_labels)
            runs[arm].append(r)
            pr = r["predict"] or {}
            fits = ", ".join(f"{n} {f['one_2threads_us']:.1f} / {f['two_devices_slower_us']:.1f}"
                             for n, f in r["fits"].items())
            print(f"round {k} {arm:6s} timeouts {r['openblas_timeouts']}: predict "
                  f"{pr.get('folded_s', float('nan')):.3f} s (merged "
                  f"{pr.get('merged_s', float('nan')):.3f}); us/sample one device 2 threads / "
                  f"two devices: {fits}", flush=True)
    rows = summarise(runs)
    _common.write_result(args.out, {**_common.result_metadata(), "benchmark": "blas_timeout",
                                    "arms": ARMS, "data": datasets, "epochs": data_epochs,
                                    "rows": rows,
                                    "runs": runs})
    print("\n| workload | measure | spin | engine | spin / engine |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['measure']} | {r['spin']:.3f} | {r['engine']:.3f} | "
              f"{r['spin_over_engine']:.2f} |")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
