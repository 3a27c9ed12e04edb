"""Exact vs sampled output layer: time per epoch, peak memory, final P@1/3/5 and PSP@5, and the
time each sampled run needs to reach the exact model's final P@1 minus 0.01.

Each configuration trains in its own child process (so that its peak RSS is its own), with the
same data, seed, network, optimiser and schedule; only ``output`` / ``negatives`` differ. The
script first checks, on a small problem, that a sampled step over every label is the exact step.

    python bench/bench_sampled.py --data delicious --epochs 5 --negatives 256 1024
    python bench/bench_sampled.py --data synthetic:20000:5000:100000 --epochs 2
    python bench/bench_sampled.py --data debian_builddeps --epochs 5 --engine-defaults
    python bench/bench_sampled.py --data debian_builddeps --epochs 3 --engine-defaults \
        --negative-sampling uniform frequency --seeds 0 1 2

``--data`` takes a dataset name or folder (``delicious``, ``debian_builddeps``), or a synthetic
power-law shape ``synthetic:N_TRAIN:N_FEATURES:N_LABELS`` (:func:`bench._tta.load_data`).
``--exact-epochs`` trains the exact model for fewer epochs (its time per epoch is still
measured, its final P@1 is then that of the shorter run: the table says so).

``--steps N`` times ``N`` training steps of each configuration instead (no evaluation) and
projects the time per epoch of ``--project-rows`` training rows (default: the data's), for shapes
whose full epoch does not fit the time budget (the Amazon-670K shape); it also records the
memory planner's estimate of the host pool (:func:`xmc_engine.memory.plan_memory`) beside the
measured peak RSS.

``--negative-sampling`` runs each ``K`` with each rule that draws the negatives (uniform, or by
label frequency: ``TrainConfig.negative_sampling``); ``--seeds`` repeats every configuration
(the exact one too) with each seed, and the summary gives the mean over the seeds of each
configuration's final metrics and of its difference to the exact model of the same seed.

    python bench/bench_sampled.py --data synthetic:20000:135909:670091 --steps 20 \
        --project-rows 490449
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
from _tta import data_tag, load_data, time_to_target  # noqa: E402

METRICS = ("P@1", "P@3", "P@5", "PSP@5")


def check_against_exact() -> None:
    """A sampled step with every label as a candidate must be the exact step."""
    import scipy.sparse as sp

    from xmc_engine.backends.cpu import CPUBackend
    from xmc_engine.model import MLPReplica, ModelShape, init_params

    rng = np.random.default_rng(0)
    X = sp.random(64, 50, density=0.1, format="csr", dtype=np.float32, random_state=rng)
    Y = sp.random(64, 30, density=0.1, format="csr", dtype=np.float32, random_state=rng)
    params = init_params(ModelShape(50, 30, (8,)))
    a = MLPReplica(CPUBackend(1), X, Y, params)
    b = MLPReplica(CPUBackend(1), X, Y, params, output="sampled", negatives=30)
    rows = np.arange(64)
    a.train_batch(rows, 0.5)
    b.train_batch(rows, 0.5)
    for p, q in zip(a.params(), b.params(), strict=True):
        np.testing.assert_allclose(p, q, rtol=1e-4, atol=1e-5)


def time_steps(spec: dict, Xtr, Ytr) -> dict:
    """Seconds per training step of ``spec`` over ``spec["steps"]`` steps after two warm-up
    steps, projected to an epoch of ``spec["project_rows"]`` rows; with the planner's estimate.

    Holds what a training run holds on the host beside the replica (the initial parameters and,
    at the end, a host copy of the trained ones), so that the peak RSS compares with the plan.
    """
    from xmc_engine.backends.cpu import CPUBackend
    from xmc_engine.config import TrainConfig
    from xmc_engine.memory import plan_for_data
    from xmc_engine.model import MLPReplica, ModelShape, init_params_for_data

    B = spec["batch_size"]
    params = init_params_for_data(ModelShape(Xtr.shape[1], Ytr.shape[1], tuple(spec["hidden"])),
                                  Xtr, seed=spec["seed"])
    rep = MLPReplica(CPUBackend(spec["threads"]), Xtr, Ytr, params, optimizer=spec["optimizer"],
                     output=spec["output"], negatives=spec["negatives"], seed=spec["seed"])
    order = np.random.default_rng(spec["seed"]).permutation(Xtr.shape[0])
    batches = [order[i * B:(i + 1) * B] for i in range(spec["steps"] + 2)]
    with rep.backend.thread_budget():
        for rows in batches[:2]:
            rep.train_batch(rows, spec["lr"])
        t0 = time.perf_counter()
        for rows in batches[2:]:
            rep.train_batch(rows, spec["lr"])
        s_step = (time.perf_counter() - t0) / spec["steps"]
    result = [np.array(p) for p in rep.params()]
    assert all(np.isfinite(p).all() for p in result) and len(result) == len(params)
    n_rows = spec["project_rows"] or Xtr.shape[0]
    cfg = TrainConfig(hidden=spec["hidden"], batch_size=B, optimizer=spec["optimizer"],
                      output=spec["output"], negatives=spec["negatives"])
    plan = plan_for_data(cfg, Xtr, Ytr, budget="1TiB")
    return {"s_per_step": s_step, "s_per_epoch": s_step * math.ceil(n_rows / B),
            "projected_rows": n_rows, "planned_host_bytes": plan.pools[0].total}


def without_correction() -> None:
    """Ablation: the sampled steps of this process get no sampled-softmax weight on their
    negatives (``log_weight = 0``: a plain softmax over the candidates)."""
    from xmc_engine import model, output_layer

    def uncorrected(*args):
        cols, local_y, n_pos, _ = output_layer.sample_candidates(*args)
        return cols, local_y, n_pos, 0.0

    model.sample_candidates = uncorrected


def with_frequency_power(power: float) -> None:
    """Study: ``negative_sampling="frequency"`` draws from ``(count + 1) ** power`` in this
    process instead of the engine's exponent."""
    from xmc_engine import output_layer

    output_layer.FrequencyProposal.__init__.__defaults__ = (float(power),)


def run_one(spec: dict) -> dict:
    """Train one configuration (in this process); returns its record."""
    from xmc_engine import XMCClassifier
    from xmc_engine.memory import plan_for_data

    if not spec.get("correction", True):
        without_correction()
    if spec.get("frequency_power") is not None:
        with_frequency_power(spec["frequency_power"])

    Xtr, Ytr, Xte, Yte = load_data(spec["data"])
    shape = {"n_train": Xtr.shape[0], "n_features": Xtr.shape[1], "n_labels": Ytr.shape[1],
             "n_test": Xte.shape[0]}
    if spec.get("steps"):
        del Xte, Yte
        return {**spec, **time_steps(spec, Xtr, Ytr), "peak_rss_mib": _common.peak_rss_mib(),
                "data_shape": shape}
    chosen = {k: spec[k] for k in ("hidden", "batch_size", "optimizer", "lr", "threads")
              if spec[k] is not None}  # None: the engine's default (--engine-defaults)
    clf = XMCClassifier(epochs=spec["epochs"], seed=spec["seed"],
                        eval_every=spec["eval_every"], output=spec["output"],
                        negatives=spec["negatives"], label_chunk=spec.get("label_chunk"),
                        negative_sampling=spec.get("negative_sampling", "uniform"), **chosen)
    plan = plan_for_data(clf.get_config(), Xtr, Ytr, (Xte, Yte), budget="1TiB")
    t0 = time.perf_counter()
    clf.fit(Xtr, Ytr, eval_set=(Xte, Yte))
    wall = time.perf_counter() - t0
    evals = [r for r in clf.history_ if r.get("event") == "eval"]
    curve = [(r["train_time"], r["epoch"], r["metrics"]["P@1"]) for r in evals]
    last = evals[-1]
    return {**spec, "wall_s": wall, "train_s": last["train_time"],
            "s_per_epoch": last["train_time"] / last["epoch"], "curve": curve,
            "final": {k: last["metrics"][k] for k in METRICS},
            "peak_rss_mib": _common.peak_rss_mib(), "planned_host_bytes": plan.pools[0].total,
            "data_shape": shape, "config": clf.get_config().to_dict()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=float, default=5)
    p.add_argument("--exact-epochs", type=float, default=None,
                   help="epochs of the exact run (default: --epochs)")
    p.add_argument("--negatives", type=int, nargs="+", default=[1024])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--optimizer", default="adagrad")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--label-chunk", type=int, default=None,
                   help="label chunk of the exact output layer and of evaluation")
    p.add_argument("--eval-every", type=float, default=1.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[0],
                   help="seeds; every configuration runs with each")
    p.add_argument("--negative-sampling", nargs="+", default=["uniform"],
                   choices=["uniform", "frequency", "lsh"],
                   help="rules that draw the negatives; each K runs with each")
    p.add_argument("--frequency-powers", type=float, nargs="+", default=[None],
                   help="study: exponents of the frequency rule's (count + 1) ** power, each "
                        "run (default: the engine's)")
    p.add_argument("--steps", type=int, default=0,
                   help="time this many steps per configuration instead of training epochs")
    p.add_argument("--project-rows", type=int, default=0,
                   help="with --steps: training rows of the projected epoch (default: the data's)")
    p.add_argument("--ablate-correction", action="store_true",
                   help="also run each K without the sampled-softmax weight on the negatives")
    p.add_argument("--no-exact", action="store_true", help="sampled runs only")
    p.add_argument("--engine-defaults", action="store_true",
                   help="leave hidden, batch size, optimizer, lr and threads to the engine's "
                        "defaults (what a user who passes no flags gets)")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/"
                   "sampled_<data>.json)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one spec as JSON
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(json.loads(args.one))), flush=True)
        return
    if args.engine_defaults:
        if args.steps:
            raise SystemExit("--engine-defaults times whole runs, not --steps")
        args.hidden = args.batch_size = args.optimizer = args.lr = args.threads = None
    meta = _common.result_metadata({"threads": args.threads})
    check_against_exact()
    base = {"data": args.data, "hidden": None if args.hidden is None else [args.hidden],
            "batch_size": args.batch_size,
            "optimizer": args.optimizer, "lr": args.lr,
            "threads": args.threads, "eval_every": args.eval_every, "steps": args.steps,
            "label_chunk": args.label_chunk,
            "project_rows": args.project_rows}
    specs = []
    for seed in args.seeds:
        if not args.no_exact:
            specs.append({**base, "seed": seed, "output": "exact", "negatives": 0,
                          "epochs": args.exact_epochs or args.epochs})
        specs += [{**base, "seed": seed, "output": "sampled", "negatives": k,
                   "negative_sampling": rule, "epochs": args.epochs, "correction": corr,
                   "frequency_power": power if rule == "frequency" else None}
                  for k in args.negatives for rule in args.negative_sampling
                  for power in (args.frequency_powers if rule == "frequency" else [None])
                  for corr in ((True, False) if args.ablate_correction else (True,))]
    runs = []
    for spec in specs:
        proc = subprocess.run([sys.executable, __file__, "--data", args.data, "--one",
                               json.dumps(spec)], capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            raise SystemExit(f"run {label(spec)} seed {spec['seed']} failed:\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        r = json.loads(line[0][len("RESULT "):])
        runs.append(r)
        if args.steps:
            print(f"{args.data} {label(r)} seed={r['seed']} "
                  f"{r['s_per_step'] * 1e3:9.1f} ms/step -> {r['s_per_epoch']:8.1f} s/epoch of "
                  f"{r['projected_rows']} rows (projected)  peak {r['peak_rss_mib']:7.0f} MiB, "
                  f"planned {r['planned_host_bytes'] / 2**20:7.0f} MiB", flush=True)
            continue
        f = r["final"]
        print(f"{args.data} {label(r)} seed={r['seed']} epochs={r['epochs']:<4g} "
              f"{r['s_per_epoch']:8.2f} s/epoch  peak {r['peak_rss_mib']:7.0f} MiB  "
              f"P@1 {f['P@1']:.4f} P@3 {f['P@3']:.4f} P@5 {f['P@5']:.4f} "
              f"PSP@5 {f['PSP@5']:.4f}  planned {r['planned_host_bytes'] / 2**20:.0f} MiB",
              flush=True)
    summary = compare_to_exact(runs, steps=bool(args.steps))
    out = args.out or _common.RESULTS_DIR / f"sampled_{data_tag(args.data)}.json"
    _common.write_result(out, {**meta, "benchmark": "sampled output layer", "runs": runs,
                               "summary": summary})
    print(f"wrote {out}")


def label(r: dict) -> str:
    """``exact`` or ``sampled K=1024 uniform`` (``no-logQ`` for the uncorrected ablation)."""
    if r["output"] == "exact":
        return "exact"
    tag = "" if r.get("correction", True) else " no-logQ"
    if r.get("frequency_power") is not None:
        tag = f" power={r['frequency_power']:g}" + tag
    return f"sampled K={r['negatives']} {r.get('negative_sampling', 'uniform')}{tag}"


def compare_to_exact(runs: list[dict], steps: bool) -> list[dict]:
    """Each run against the exact run of its seed (speed-up per epoch or step; with epochs
    also the P@1 difference and the time to the exact model's final P@1 - 0.01), then one row
    per configuration: the means over its seeds, printed."""
    exact = {r["seed"]: r for r in runs if r["output"] == "exact"}
    for r in runs:
        ref = exact.get(r["seed"])
        if ref is None:
            continue
        r["speedup_per_epoch"] = ref["s_per_epoch"] / r["s_per_epoch"]
        if not steps:
            target = ref["final"]["P@1"] - 0.01
            r["s_to_target"] = time_to_target(r["curve"], target)
            r["dP@1"] = r["final"]["P@1"] - ref["final"]["P@1"]
    rows = []
    for name in dict.fromkeys(label(r) for r in runs):
        group = [r for r in runs if label(r) == name]
        row = {"config": name, "seeds": [r["seed"] for r in group],
               "s_per_epoch": float(np.mean([r["s_per_epoch"] for r in group]))}
        if not steps:
            row.update({k: float(np.mean([r["final"][k] for r in group])) for k in METRICS})
        for key in ("speedup_per_epoch", "dP@1", "s_to_target"):
            vals = [r[key] for r in group if r.get(key) is not None]
            if len(vals) == len(group) and np.isfinite(vals).all():
                row[key] = float(np.mean(vals))
            elif vals or key in group[0]:
                row[key] = None  # some seed has no exact run, or did not reach the target
        rows.append(row)
        metrics = ("" if steps else "  " + " ".join(f"{k} {row[k]:.4f}" for k in METRICS))
        extra = "".join(f"  {k} {row[k]:+.4f}" if k == "dP@1" else f"  {k} {row[k]:.2f}"
                        for k in ("speedup_per_epoch", "dP@1", "s_to_target")
                        if row.get(k) is not None)
        print(f"  mean of {len(group)} seed(s): {name:32s} {row['s_per_epoch']:7.2f} s/epoch"
              f"{metrics}{extra}")
    return rows



if __name__ == "__main__":
    main()
