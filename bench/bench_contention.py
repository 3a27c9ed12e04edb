"""How much of a CPU device's speed survives when two devices train at once.

The per-sample step time (busy seconds / samples, from the merge log, the first periods left
out) of:

1. one CPU device alone (``single``, 1 thread);
2. each of two CPU devices in one process (``average`` on ``cpu,cpu``: a static partition, no
   idling), the engine's way of running several devices on one host;
3. each of two single-device processes started at once (each 1 thread).

(2) against (1) is what a multi-device run on this host really gets per device; (3) against
(1) is the hardware's share of that loss (memory bandwidth, caches), so (2) against (3) is the
share of running both devices in one process. Issue 15's time-to-accuracy study cites it.

Each per-sample time comes with the CPU time of the thread that ran the steps (``cpu_s`` of the
merge records): busy time above CPU time is time the thread waited inside its steps (the GIL
in the Python between the kernels, preemption), CPU time above another device's is the same work
done slower by its core. ``--seeds N`` repeats (2) with N seeds: which of two "equal" devices is
the slower one, and by how much, changes from run to run. Command (results in
``bench/results/contention.json``)::

    python bench/bench_contention.py --data delicious debian_debtags debian_builddeps \
        --epochs 2 1 0.5 --seeds 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import _tta  # noqa: E402


def us_per_sample(clf, key: str = "busy_s") -> list[float]:
    """Per device: microseconds of busy time (or ``key``: ``cpu_s``) per sample over the merges
    after the second."""
    merges = [r for r in clf.history_ if r.get("event") == "merge"][2:]
    if not merges:
        raise RuntimeError("too few merge periods to measure: raise --epochs")
    out = []
    for d in range(len(merges[0]["devices"])):
        busy = sum(r["devices"][d][key] for r in merges)
        samples = sum(r["devices"][d]["samples"] for r in merges)
        out.append(1e6 * busy / samples)
    return out


def fit(data, algorithm: str, devices: str, threads, epochs: float, seed: int = 0):
    from xmc_engine import XMCClassifier

    clf = XMCClassifier(epochs=epochs, devices=devices, algorithm=algorithm, threads=threads,
                        eval_every=0, seed=seed)
    clf.fit(data[0], data[1])
    return clf


def measure(name: str, epochs: float, seeds: int = 1) -> dict:
    data = _tta.load_data(name)
    fit(data, "single", "cpu", 1, 0.05)  # compile (or load the cache) outside the timing
    clf = fit(data, "single", "cpu", 1, epochs)
    alone, alone_cpu = us_per_sample(clf)[0], us_per_sample(clf, "cpu_s")[0]
    runs = []
    for seed in range(seeds):
        clf = fit(data, "average", "cpu,cpu", 1, epochs, seed)
        busy, cpu = us_per_sample(clf), us_per_sample(clf, "cpu_s")
        runs.append({"seed": seed, "busy_us": busy, "cpu_us": cpu,
                     "slower_over_faster_busy": max(busy) / min(busy),
                     "slower_over_faster_cpu": max(cpu) / min(cpu)})
        print(f"{name:18s} two devices in one process, seed {seed}: busy {busy[0]:7.1f} / "
              f"{busy[1]:7.1f} us/sample, CPU {cpu[0]:7.1f} / {cpu[1]:7.1f}", flush=True)
    in_process = runs[0]["busy_us"]
    child = [sys.executable, __file__, "--child", "--data", name, "--epochs", str(epochs)]
    procs = [subprocess.Popen(child, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    two_procs = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"child process for {name} exited with {p.returncode}")
        two_procs.append(json.loads(out.strip().splitlines()[-1]))
    row = {"data": name, "epochs": epochs, "alone_us": alone, "alone_cpu_us": alone_cpu,
           "in_process_us": in_process, "in_process_runs": runs,
           "two_processes_us": two_procs,
           "in_process_slowdown": max(in_process) / alone,
           "two_processes_slowdown": max(two_procs) / alone}
    print(f"{name:18s} alone {alone:7.1f} us/sample | two devices in one process "
          f"{in_process[0]:7.1f} / {in_process[1]:7.1f} ({row['in_process_slowdown']:.2f}x) | "
          f"two processes {two_procs[0]:7.1f} / {two_procs[1]:7.1f} "
          f"({row['two_processes_slowdown']:.2f}x)", flush=True)
    return row


def add_data_epochs(p: argparse.ArgumentParser) -> None:
    """``--data`` (datasets) and ``--epochs`` (one per dataset, or one for all)."""
    p.add_argument("--data", nargs="+", default=["delicious"])
    p.add_argument("--epochs", type=float, nargs="+", default=[1.0],
                   help="one per dataset, or one for all")


def epochs_per_dataset(p: argparse.ArgumentParser, args) -> list[float]:
    """``--epochs`` with one entry per ``--data`` (a parser error when the counts differ)."""
    epochs = args.epochs * len(args.data) if len(args.epochs) == 1 else args.epochs
    if len(epochs) != len(args.data):
        p.error(f"{len(args.epochs)} --epochs for {len(args.data)} --data")
    return epochs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_epochs(p)
    p.add_argument("--seeds", type=int, default=1,
                   help="runs of the two devices in one process, seeds 0..N-1 (default 1)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "contention.json"))
    args = p.parse_args(argv)
    epochs = epochs_per_dataset(p, args)
    if args.child:  # one single-device fit; its per-sample time on stdout
        data = _tta.load_data(args.data[0])
        print(json.dumps(us_per_sample(fit(data, "single", "cpu", 1, epochs[0]))[0]))
        return 0
    meta = _common.result_metadata()
    rows = [measure(name, e, args.seeds) for name, e in zip(args.data, epochs, strict=True)]
    path = _common.write_result(args.out, {**meta, "benchmark": "contention", "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
