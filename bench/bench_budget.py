"""P@1 at equal wall time: each algorithm trains for the same training-time budget
(``max_train_seconds``) on the same data and devices, with the engine's defaults otherwise.

The comparison of issue 15's step 4 at the Amazon-670K shape, where an epoch is too long for a
time-to-accuracy sweep over seeds: ``adaptive`` and ``sync`` on a heterogeneous device set and
``single`` on the set's fastest device alone with that device's thread share, each for the same
minutes. Each run is its own child process, so that its peak RSS is its own; beside it the memory
planner's estimate of the same run (:func:`xmc_engine.memory.plan_memory`, what ``xmc-engine
plan`` prints). Evaluation (exact top-k, on the first ``--test-rows`` test rows) happens every
``--eval-every`` epochs and at the end, outside the training clock. Every run starts from the
initialisation (``continue_probe=False``, as the committed runs did before that option
existed), so that the algorithms start from the same model; a configuration's ``params`` may
set it.

    python bench/bench_budget.py --data synthetic-amazon670k --devices cpu,cpu@0.5 \\
        --algorithms adaptive sync single --seconds 900 --output sampled --test-rows 5000 \\
        --eval-every 2 --label-chunk 8192

``--data`` takes what ``xmc-engine train --data`` takes (a registered name such as
``synthetic-amazon670k``, a dataset folder) or ``synthetic:N_TRAIN:N_FEATURES:N_LABELS``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

METRICS = ("P@1", "P@3", "P@5", "PSP@5")


def load(name: str):
    """``(X_train, Y_train, X_test, Y_test)``: a ``synthetic:N:F:L`` shape (:mod:`_tta`), else
    whatever the engine's registry resolves (``synthetic-amazon670k``, a dataset folder)."""
    if name.startswith("synthetic:"):
        from _tta import load_data

        return load_data(name)
    from xmc_engine.datasets import load_dataset

    Xtr, Ytr, Xte, Yte = load_dataset(name)
    if Xte is None:
        raise _common.SkipBenchmark(f"{name}: no test split to evaluate on")
    return Xtr, Ytr, Xte, Yte


def single_on_fastest(devices: str) -> dict:
    """``devices`` and ``threads`` of the set's ``single`` baseline: its fastest device alone,
    with the thread share that device has in the set (``cpu,cpu@0.5`` on 2 cores: ``cpu``, 1
    thread)."""
    from xmc_engine.devices import parse_devices

    fast = max(parse_devices(devices), key=lambda d: d.speed)
    return {"devices": fast.name, "threads": fast.threads if fast.kind == "cpu" else None}


def run_one(spec: dict) -> dict:
    """Train one configuration in this process; returns its record."""
    from xmc_engine import XMCClassifier
    from xmc_engine.devices import parse_devices
    from xmc_engine.memory import plan_for_data

    t_load = time.perf_counter()
    Xtr, Ytr, Xte, Yte = load(spec["data"])
    load_s = time.perf_counter() - t_load
    if spec["test_rows"]:
        Xte, Yte = Xte[:spec["test_rows"]], Yte[:spec["test_rows"]]
    options = {"continue_probe": False,
               **{k: spec[k] for k in ("output", "negatives", "label_chunk", "threads")
                  if spec.get(k) is not None}}
    options.update(spec.get("params") or {})
    clf = XMCClassifier(epochs=spec["max_epochs"], max_train_seconds=spec["seconds"],
                        devices=spec["devices"], algorithm=spec["algorithm"], seed=spec["seed"],
                        eval_every=spec["eval_every"], **options)
    cfg = clf.get_config()
    plan = plan_for_data(cfg, Xtr, Ytr, (Xte, Yte), budget="1TiB")
    t0 = time.perf_counter()
    clf.fit(Xtr, Ytr, eval_set=(Xte, Yte))
    wall = time.perf_counter() - t0
    hist = clf.history_
    start = next(r for r in hist if r.get("event") == "start")
    evals = [r for r in hist if r.get("event") == "eval"]
    merges = [r for r in hist if r.get("event") == "merge"]
    final = hist[-1]
    devs = parse_devices(spec["devices"])
    per_device = [{"device": str(d), "samples": sum(m["devices"][i]["samples"] for m in merges),
                   "busy_s": sum(m["devices"][i]["busy_s"] for m in merges),
                   "last_batch": merges[-1]["devices"][i]["batch_size"] if merges else None}
                  for i, d in enumerate(devs)]
    compile_s = _common.event_seconds(hist, "compile")
    timeline = _timeline(evals, merges, len(devs))
    stats = model_stats(clf.params_, Xtr, Xte) if spec.get("model_stats") else None
    return {**spec, "wall_s": wall, "load_s": load_s, "compile_s": compile_s,
            "train_s": final["train_time"], "samples": final["samples"],
            "epochs_done": final["epoch"], "merges": len(merges),
            "status": final.get("status"),  # completed / time_budget / plateau_stop
            "merge_s": sum(m.get("merge_s", 0.0) for m in merges),
            "per_device": per_device,
            "curve": [(r["train_time"], r["epoch"], *(r["metrics"][k] for k in METRICS))
                      for r in evals],
            "timeline": timeline,
            "model_stats": stats,
            "eval_s": sum(r["eval_time"] for r in evals),
            "final": {k: final["metrics"][k] for k in METRICS},
            "lr": cfg.learning_rate,
            "lr_decay": start["lr_decay"],
            "algorithm_params": start.get("algorithm_params"),  # "auto" ones resolved
            "plateau": [{k: v for k, v in r.items() if k != "event"}
                        for r in hist if r.get("event") == "plateau"],
            "normalize": cfg.normalize, "loss": clf.loss_, "batch_size": cfg.batch_size,
            "peak_rss_mib": _common.peak_rss_mib(),
            "planned_host_bytes": plan.pools[0].total,
            "planned": {k: int(v) for k, v in plan.pools[0].items.items()},
            "data_shape": {"n_train": Xtr.shape[0], "n_features": Xtr.shape[1],
                           "n_labels": Ytr.shape[1], "n_test": Xte.shape[0]}}


#: Feature-frequency bands of :func:`model_stats`: training rows holding the feature, [lo, hi).
FREQ_BANDS = ((1, 10), (10, 100), (100, 1000), (1000, math.inf))


def model_stats(params, Xtr, Xte) -> dict:
    """What training left in the model's first layer (``--model-stats``): the median L2 norm
    of ``W1``'s rows per band of feature frequency (training rows holding the feature;
    ``None`` for an empty band), the share of hidden units active (ReLU > 0) per test row and
    the units no test row activates, and the mean of ``b1``. The merge weights differ in how
    far a period moves a row one replica alone changed; this shows the result on the model."""
    import numpy as np

    W1, b1 = np.asarray(params[0]), np.asarray(params[1])
    freq = np.bincount(Xtr.indices, minlength=Xtr.shape[1])  # rows per feature, no CSC copy
    norms = np.linalg.norm(W1, axis=1)
    bands = {}
    for lo, hi in FREQ_BANDS:
        m = (freq >= lo) & (freq < hi)
        bands[f"{lo}-{hi}"] = ({"features": int(m.sum()), "median_norm": float(np.median(norms[m]))}
                               if m.any() else {"features": 0, "median_norm": None})
    H = np.asarray(Xte @ W1) + b1 > 0
    return {"w1_row_norm_by_frequency": bands, "hidden_active_share": float(H.mean()),
            "hidden_units_never_active": int((~H.any(axis=0)).sum()),
            "b1_mean": float(b1.mean())}


def _timeline(evals: list[dict], merges: list[dict], n_devices: int) -> list[dict]:
    """Per interval between evaluations: the merges, their seconds and, per device, the samples,
    busy / idle / CPU seconds and the last batch size (CPU seconds well below busy seconds: the
    worker was not on a core, e.g. a noisy neighbour on the VM). What tells a slowdown of the
    engine (batch sizes, merges) from one of the machine."""
    out, k = [], 0
    for ev in evals:
        group = []
        while k < len(merges) and merges[k]["progress"] <= ev["epoch"] + 1e-9:
            group.append(merges[k])
            k += 1
        per_dev = []
        for i in range(n_devices):
            rows = [m["devices"][i] for m in group]
            per_dev.append({key: round(sum(r[key] for r in rows), 3)
                            for key in ("samples", "busy_s", "idle_s", "cpu_s")}
                           | {"batch": rows[-1]["batch_size"] if rows else None})
        out.append({"train_s": round(ev["train_time"], 2), "epoch": ev["epoch"],
                    "merges": len(group),
                    "merge_s": round(sum(m.get("merge_s", 0.0) for m in group), 3),
                    "devices": per_dev})
    return out


def print_table(runs, seconds: float) -> None:
    """The Markdown table of ``bench/RESULTS.md``."""
    print(f"\n| algorithm | devices | training s | epochs | samples/s | merge s | P@1 | P@3 | P@5 "
          f"| PSP@5 | peak RSS | planned | planned / peak |  (budget {seconds:g} s)")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        f = r["final"]
        peak, planned = r["peak_rss_mib"], r["planned_host_bytes"] / 2**20
        print(f"| {r['algorithm']} | `{r['devices']}` | {r['train_s']:.0f} | "
              f"{r['epochs_done']:.2f} | {r['samples'] / r['train_s']:,.0f} | "
              f"{r['merge_s']:.1f} | {f['P@1']:.4f} | {f['P@3']:.4f} | {f['P@5']:.4f} | "
              f"{f['PSP@5']:.4f} | {peak:,.0f} MiB | {planned:,.0f} MiB | {planned / peak:.2f} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="synthetic-amazon670k")
    p.add_argument("--devices", default="cpu,cpu@0.5",
                   help="the device set of the multi-device algorithms")
    p.add_argument("--algorithms", nargs="+", default=["adaptive", "sync", "single"],
                   help="'single' runs on the set's fastest device with its thread share")
    p.add_argument("--seconds", type=float, default=900.0, help="training-time budget per run")
    p.add_argument("--max-epochs", type=float, default=1000.0,
                   help="epochs a run may take within its budget")
    p.add_argument("--output", default=None, help="exact | sampled (default: the engine's)")
    p.add_argument("--negatives", type=int, default=None)
    p.add_argument("--label-chunk", type=int, default=None,
                   help="label chunk of evaluation (and of the exact output layer)")
    p.add_argument("--test-rows", type=int, default=5000,
                   help="evaluate on the first N test rows (0: all)")
    p.add_argument("--eval-every", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--params", type=json.loads, default=None,
                   help="more XMCClassifier options for every run, as JSON "
                        "(e.g. '{\"lr_decay\": 0}')")
    p.add_argument("--model-stats", action="store_true",
                   help="record W1's row norms by feature frequency and the hidden units' "
                        "activity on the test rows after each run")
    p.add_argument("--out", default=None,
                   help="results JSON (default bench/results/budget_<data>.json)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one spec as JSON
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(json.loads(args.one))), flush=True)
        return
    meta = _common.result_metadata()
    base = {"data": args.data, "seconds": args.seconds, "max_epochs": args.max_epochs,
            "output": args.output, "negatives": args.negatives, "label_chunk": args.label_chunk,
            "test_rows": args.test_rows, "eval_every": args.eval_every, "seed": args.seed,
            "params": args.params, "model_stats": args.model_stats}
    specs = []
    for algo in args.algorithms:
        if algo == "single":
            specs.append({**base, "algorithm": "single", **single_on_fastest(args.devices),
                          "set": args.devices})
        else:
            specs.append({**base, "algorithm": algo, "devices": args.devices, "threads": None})
    tag = args.data.replace(":", "_")
    out = Path(args.out) if args.out else _common.RESULTS_DIR / f"budget_{tag}.json"
    runs = []
    for spec in specs:
        print(f"{spec['algorithm']} on {spec['devices']} for {args.seconds:g} s ...", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)],
                              capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            raise SystemExit(f"run {spec['algorithm']} failed:\n{proc.stdout[-2000:]}\n"
                             f"{proc.stderr[-3000:]}")
        r = json.loads(line[0][len("RESULT "):])
        runs.append(r)
        f = r["final"]
        why = {"plateau_stop": " (the plateau rule stopped it)",
               "completed": " (every epoch: --max-epochs)"}.get(r.get("status"), "")
        print(f"  {r['epochs_done']:.2f} epochs{why} in {r['train_s']:.0f} s, merges "
              f"{r['merge_s']:.1f}"
              f" s; P@1 {f['P@1']:.4f} P@3 {f['P@3']:.4f} P@5 {f['P@5']:.4f} PSP@5 "
              f"{f['PSP@5']:.4f}; peak {r['peak_rss_mib']:,.0f} MiB, planned "
              f"{r['planned_host_bytes'] / 2**20:,.0f} MiB", flush=True)
        if r.get("model_stats"):
            ms = r["model_stats"]
            norms = ", ".join(f"{k}: {v['median_norm']:.3f}"
                              for k, v in ms["w1_row_norm_by_frequency"].items() if v["features"])
            print(f"  W1 row norms by feature frequency (median) {norms}; hidden units active "
                  f"{ms['hidden_active_share']:.3f}, never {ms['hidden_units_never_active']}; "
                  f"b1 mean {ms['b1_mean']:+.4f}", flush=True)
        # written after every run: a crash later keeps what ran
        _common.write_result(out, {**meta, "benchmark": "equal training-time budget",
                                   "runs": runs})
    print_table(runs, args.seconds)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
