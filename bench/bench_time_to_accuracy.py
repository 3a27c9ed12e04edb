"""Baselines and the time-to-accuracy study (issues "Baselines and the time-to-accuracy study" and
"One-device trainer"; DESIGN.md §4-5).

One command trains, on the same data, machine, network and budget (``--epochs`` epochs of base
batch ``--batch-size``, evaluation every ``--eval-every`` epochs, evaluation time excluded):

* every engine algorithm: ``single`` (one CPU device, 1 thread), ``sync``, ``average``,
  ``easgd``, ``crossbow`` and ``adaptive`` with both batch rules (``adaptive`` = the paper's
  step rule, the reference of the ratios; ``adaptive (proportional)``), on the devices of
  ``--setup`` (``2dev`` = ``cpu,cpu@0.5``, ``homog`` = ``cpu,cpu``, ``3dev`` =
  ``cpu,cpu@0.5,cpu@0.25``; slower devices are emulated by idling, DESIGN.md §3);
* the framework baselines (``bench/torch_baseline.py``): PyTorch in one process, and DDP with 2
  processes (gloo, dense ``W1`` gradient all-reduce). Both use the engine's batches (same
  permutation, same batch size, same epochs) and **one thread per process**: on this 2-core
  machine PyTorch's OpenMP pool with 2 threads measured up to 10x slower than 1 thread under
  load (spinning workers wait for a descheduled peer), and one thread per process is also what
  the engine's CPU devices get in a multi-device run. DDP splits each global batch of
  ``--batch-size`` rows over its 2 ranks. The PyTorch baselines always use plain SGD (their
  optimiser is fixed in ``torch_baseline.py``), also when ``--optimizer adagrad``;
* the XMC libraries users already pick (``bench/xmc_libraries.py``): napkinXC PLT, and PECOS
  XR-Linear when ``--pecos-python`` is given. They are not SGD methods (no curve): training time
  and P@1/3/5 only, in a separate table.

Learning rates are tuned by the script: for every method a small grid (``--lr-grid``; default
``0.5 1 2`` for SGD, ``0.02 0.05 0.1`` with ``--optimizer adagrad``) on seed ``--tune-seed``
with a short budget (``--tune-epochs``, default half of ``--epochs``). ``--tune-for time`` (the
default) picks the lr that first reaches 99 % of the best P@1 any lr of the grid reached (then the
higher P@1): where every lr ends on the same plateau, within noise, the fastest wins rather than
the luckiest; ``--tune-for quality`` picks the best P@1 (ties: the smaller lr). ``--no-tune``
uses ``--lr`` (and ``--torch-lr``) instead. The grid, every tuning result and the chosen lr go
into the results.

Per (dataset, setup) the script prints a table of the median (over ``--seeds``) time to a target
P@1 = 97 % of the best method's median (over seeds) best P@1 within the budget (linear
interpolation between evaluations, ``_tta.time_to_target``), the final P@1 / P@5 and the ratio
to ``adaptive`` ("x adaptive"); then the time each method takes to reach PyTorch's best P@1 (the
lowest over seeds of the single-process PyTorch run's best P@1) and the speed-up of the engine's
``single`` over PyTorch (issue "One-device trainer": target >= 2x on delicious). Results:
``bench/results/tta/<dataset>_<setup>.json`` (with command, git commit and machine) and ``.png``
(P@1 against training time, ``_tta.plot_curves``).

The committed results (``bench/results/tta/``; delicious and debian_debtags about 35 minutes on
2 cores, the machine otherwise idle; ``--pecos-python`` adds PECOS beside napkinXC)::

    COMMON="--epochs 4 --tune-epochs 2 --optimizer adagrad --warmup-epochs 0 --eval-every 0.125"
    python bench/bench_time_to_accuracy.py --data delicious --setup 2dev --setup homog \
        --setup 3dev --seeds 0 1 2 3 4 $COMMON --hidden 512 --lr-decay 1.0 \
        --lr-grid 0.025 0.05 0.1 0.2
    python bench/bench_time_to_accuracy.py --data debian_debtags --setup 2dev --setup homog \
        --seeds 0 1 2 3 4 $COMMON --hidden 256 --lr-decay 0 --lr-grid 0.025 0.05 0.1 0.2

and the synthetic shape (about 25 minutes; the default lr grid)::

    python bench/bench_time_to_accuracy.py --data synthetic:20000:20000:10000 --setup 2dev \
        --setup homog --seeds 0 1 2 $COMMON --hidden 128 --lr-decay 0 --no-libraries

Tables and plots again from the saved runs, without training::

    python bench/bench_time_to_accuracy.py --from-results

Quick smoke run::

    python bench/bench_time_to_accuracy.py --data delicious --epochs 2 --seeds 0 --no-tune
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
from _tta import (  # noqa: E402
    Method,
    data_tag,
    load_data,
    plot_curves,
    print_table,
    run_method,
    summarise,
    time_to_target,
)

SETUPS = {
    "2dev": "cpu,cpu@0.5",
    "homog": "cpu,cpu",
    "3dev": "cpu,cpu@0.5,cpu@0.25",
}
DEFAULT_DATA = ("delicious", "debian_debtags")
LR_GRIDS = {"sgd": (0.5, 1.0, 2.0), "adagrad": (0.02, 0.05, 0.1)}
TORCH_LR_GRID = (0.5, 1.0, 2.0)  # PyTorch baselines: plain SGD whatever --optimizer says
REFERENCE = "adaptive"
TARGET_FRAC = 0.97  # _tta.print_table prints "97%"
TORCH = "torch (1 process)"
DDP = "torch DDP (2 processes)"
#: methods whose runs do not depend on the device setup (run once per dataset, reused)
SETUP_FREE = ("single", TORCH, DDP)


def engine_methods(devices: str) -> list[Method]:
    """The engine's methods on ``devices`` (``single`` always on one full-speed CPU device)."""
    return [
        Method(REFERENCE, "adaptive", devices, {"rule": "step"}),
        Method("adaptive (proportional)", "adaptive", devices, {"rule": "proportional"}),
        Method("sync", "sync", devices),
        Method("average", "average", devices),
        Method("easgd", "easgd", devices),
        Method("crossbow", "crossbow", devices),
        Method("single", "single", "cpu", threads=1),
    ]


# -- one run --------------------------------------------------------------------------------------

def _result(label, algorithm, devices, params, lr, seed, curve, wall, extra=None) -> dict:
    """A run in the format of ``_tta.run_method`` (curve rows: train_time, epoch, P@1, P@3, P@5)."""
    res = {"method": label, "algorithm": algorithm, "devices": devices, "params": params,
           "lr": lr, "seed": seed, "curve": curve, "wall_s": wall,
           "final": {"P@1": curve[-1][2], "P@3": curve[-1][3], "P@5": curve[-1][4]},
           "best_P@1": max(c[2] for c in curve)}
    if extra:
        res.update(extra)
    return res


def run_engine(m: Method, data, *, epochs, lr, batch_size, hidden, seed, optimizer,
               lr_decay=0.0, warmup_epochs=None, eval_every=1.0) -> dict:
    """Train ``m`` with the engine (``_tta.run_method`` at learning rate ``lr``)."""
    r = run_method(dataclasses.replace(m, lr=lr), data, epochs=epochs, lr=lr,
                        batch_size=batch_size, hidden=hidden, seed=seed, optimizer=optimizer,
                   lr_decay=lr_decay, warmup_epochs=warmup_epochs, eval_every=eval_every)
    return _result(m.label, m.algorithm, m.devices, m.params, lr, seed, r["curve"], r["wall_s"],
                   {"optimizer": optimizer, "last_period": r["last_period"]})


def run_torch(label, data, *, epochs, lr, batch_size, hidden, seed, eval_every=1.0) -> dict:
    """PyTorch baseline ``label`` (single process or DDP with 2 ranks), one thread per process."""
    import torch_baseline as tb

    X, Y, Xte, Yte = data
    t0 = time.perf_counter()
    if label == TORCH:
        res = tb.train_torch(X, Y, Xte, Yte, hidden=hidden, batch_size=batch_size, lr=lr,
                             epochs=epochs, threads=1, seed=seed, eval_every=eval_every)
    else:  # threads is the total: 2 // world_size = 1 per rank
        res = tb.train_torch_ddp(X, Y, Xte, Yte, world_size=2, hidden=hidden,
                                 batch_size=batch_size, lr=lr, epochs=epochs, threads=2,
                                 seed=seed, eval_every=eval_every)
    wall = time.perf_counter() - t0
    curve = [(r["train_time"], r["epoch"], r["P@1"], r["P@3"], r["P@5"]) for r in res["curve"]]
    return _result(label, res["variant"], "cpu" if label == TORCH else "2 processes",
                   {}, lr, seed, curve, wall, {
                       "optimizer": "sgd", "config": res["config"],
                       "samples_per_s": res["samples_per_s"], "eval_time": res["eval_time"]})


def run_any(label, method, data, args, *, epochs, lr, seed) -> dict:
    """One run of an engine method or a PyTorch baseline; a failure is returned as a record."""
    common = dict(epochs=epochs, lr=lr, batch_size=args.batch_size, hidden=args.hidden,
                  seed=seed, eval_every=args.eval_every)
    try:
        if method is None:
            return run_torch(label, data, **common)
        return run_engine(method, data, optimizer=args.optimizer, lr_decay=args.lr_decay,
                          warmup_epochs=args.warmup_epochs, **common)
    except Exception as e:  # noqa: BLE001 - a diverging lr or a broken method must not stop the study
        traceback.print_exc(limit=3)
        return {"method": label, "lr": lr, "seed": seed, "error": f"{type(e).__name__}: {e}"}


def warm_up(data, args, devices) -> float:
    """Fit every engine algorithm once on a small slice (1 epoch): Numba compiles its kernels on
    first use, and that compile time must not land in the first measured run's training time."""
    Xtr, Ytr, Xte, Yte = data
    n, nt = min(Xtr.shape[0], 1024), min(Xte.shape[0], 256)
    small = (Xtr[:n], Ytr[:n], Xte[:nt], Yte[:nt])
    t0 = time.perf_counter()
    for m in engine_methods(devices):
        r = run_any(m.label, m, small, args, epochs=1, lr=args.lr_grid[0], seed=0)
        if "error" in r:
            print(f"  warm-up {m.label}: {r['error']}")
    return time.perf_counter() - t0


# -- tuning ---------------------------------------------------------------------------------------

TUNE_NEAR = 0.99  # --tune-for time: the lr that first reaches 99 % of the grid's best P@1


def pick_lr(results, tune_for: str) -> dict:
    """The winning entry of ``results`` (``lr``, ``best_P@1``, ``t_near``; failed runs have
    ``best_P@1`` None). ``quality``: the best P@1 (ties: the smaller lr). ``time``: the soonest
    to reach ``TUNE_NEAR`` x the best P@1 of the grid (``t_near``), then the best P@1: on a
    plateau where every lr ends within noise of the others, the fastest one wins, not the
    luckiest."""
    ok = [r for r in results if r["best_P@1"] is not None]
    if not ok:
        return min(results, key=lambda r: r["lr"])
    if tune_for == "quality":
        return max(ok, key=lambda r: (r["best_P@1"], -r["lr"]))
    return min(ok, key=lambda r: (r["t_near"], -r["best_P@1"], r["lr"]))


def tune(label, method, data, args, grid) -> dict:
    """Run ``grid`` on the tuning seed for ``args.tune_epochs``; pick the lr by
    ``args.tune_for`` (:func:`pick_lr`). Returns ``{"lr", "grid", "results", "runs"}`` (runs:
    the full tuning runs)."""
    results, runs = [], {}
    for lr in grid:
        r = run_any(label, method, data, args, epochs=args.tune_epochs, lr=lr,
                    seed=args.tune_seed)
        ok = "error" not in r and math.isfinite(r["best_P@1"])
        score = r["best_P@1"] if ok else -math.inf
        results.append({"lr": lr, "best_P@1": score if ok else None,
                        "train_s": r["curve"][-1][0] if ok else None,
                        "error": r.get("error")})
        print(f"    tune {label:26s} lr {lr:<6g} best P@1 "
              + (f"{score:.4f}  train {r['curve'][-1][0]:.1f} s" if ok else r.get("error")),
              flush=True)
        if ok:
            runs[lr] = r
    top = max((x["best_P@1"] for x in results if x["best_P@1"] is not None), default=None)
    for x in results:
        x["t_near"] = (time_to_target(runs[x["lr"]]["curve"], TUNE_NEAR * top)
                       if x["best_P@1"] is not None else None)
    best = pick_lr(results, args.tune_for)
    if top is not None:
        near = ", ".join(f"lr {x['lr']:g} {x['t_near']:.2f} s" for x in results
                         if x["t_near"] is not None)
        print(f"    tune {label}: time to {TUNE_NEAR:.0%} of the grid's best P@1 {top:.4f}: "
              f"{near}; chosen lr {best['lr']:g} ({args.tune_for})")
    edge = len(grid) > 1 and best["lr"] in (min(grid), max(grid))
    if edge:
        print(f"    tune {label}: lr {best['lr']:g} is at the edge of the grid {list(grid)}; "
              f"consider widening --lr-grid / --torch-lr-grid")
    return {"lr": best["lr"], "grid": list(grid), "results": results, "at_grid_edge": edge,
            "tune_for": args.tune_for, "tune_epochs": args.tune_epochs,
            "tune_seed": args.tune_seed, "runs": runs}


# -- one (dataset, setup) -------------------------------------------------------------------------

def run_setup(tag, data, setup, args, cache) -> dict:
    """Tune and run every method of ``setup`` over the seeds; returns the JSON payload."""
    devices = SETUPS[setup]
    plan = [(m.label, m) for m in engine_methods(devices)]
    if not args.no_torch:
        plan += [(TORCH, None), (DDP, None)]
    runs, tuning, failures = [], {}, []
    for label, m in plan:
        key = (tag, label) if label in SETUP_FREE else None
        if key is not None and key in cache:
            tuned, mruns = cache[key]
            print(f"  {label}: reusing the runs of an earlier setup (independent of devices)")
        else:
            torch_side = m is None
            if args.no_tune:
                tuned = {"lr": args.torch_lr if torch_side else args.lr, "tuned": False}
            else:
                grid = (args.torch_lr_grid if torch_side else args.lr_grid)
                tuned = tune(label, m, data, args, grid)
            mruns = []
            for seed in args.seeds:
                reuse = tuned.get("runs", {}).get(tuned["lr"])
                if reuse is not None and seed == args.tune_seed and \
                        args.tune_epochs == args.epochs:
                    r = reuse  # the tuning run already is this run
                else:
                    r = run_any(label, m, data, args, epochs=args.epochs, lr=tuned["lr"],
                                seed=seed)
                if "error" in r:
                    print(f"  {tag} {setup} {label:26s} seed {seed}: FAILED {r['error']}")
                else:
                    batches = [d["batch_size"] for d in r.get("last_period", [])]
                    print(f"  {tag} {setup} {label:26s} seed {seed} lr {tuned['lr']:<5g}: "
                          f"final P@1 {r['final']['P@1']:.4f} best {r['best_P@1']:.4f} "
                          f"train {r['curve'][-1][0]:6.1f} s"
                          + (f" batches {batches}" if batches else ""), flush=True)
                mruns.append(r)
            tuned = {k: v for k, v in tuned.items() if k != "runs"}
            if key is not None:
                cache[key] = (tuned, mruns)
        tuning[label] = tuned
        runs += [r for r in mruns if "error" not in r]
        failures += [r for r in mruns if "error" in r]
    if not runs:
        raise SystemExit(f"{tag} {setup}: every run failed")
    summary, vs_torch = report(tag, setup, runs, tuning, args)
    return {"dataset": tag, "setup": setup, "devices": devices, "summary": summary,
            "tuning": tuning, "vs_torch": vs_torch, "runs": runs, "failed_runs": failures}


def report(tag, setup, runs, tuning, args):
    """Summary table (printed) and the comparison with PyTorch, from the runs of one setup."""
    summary = summarise(runs, target_frac=TARGET_FRAC, reference=REFERENCE)
    for row in summary["rows"]:
        row["lr"] = tuning[row["method"]]["lr"]
    print_table(summary, reference=REFERENCE, title=f"{tag} {setup} ({SETUPS[setup]}), "
                f"{args.epochs} epochs, B={args.batch_size}, {args.optimizer}, "
                f"seeds {args.seeds}; t->target = median over seeds")
    print("  tuned lr: " + ", ".join(f"{k} {v['lr']:g}" for k, v in tuning.items()))
    vs_torch = torch_comparison(runs)
    if vs_torch:
        print_torch_comparison(vs_torch, tag)
    return summary, vs_torch


def torch_comparison(runs) -> dict | None:
    """Time each method takes to reach PyTorch's best P@1, and the speed-up of every method over
    PyTorch (torch time / method time; median over seeds).

    The target is the lowest of the single-process run's per-seed bests, so that every PyTorch
    seed reaches it (a median of the bests is above some seed's best, and PyTorch's own time
    then reads as "not reached")."""
    torch_runs = [r for r in runs if r["method"] == TORCH]
    if not torch_runs:
        return None
    target = min(r["best_P@1"] for r in torch_runs)
    by_method: dict[str, list] = {}
    for r in runs:
        by_method.setdefault(r["method"], []).append(time_to_target(r["curve"], target))
    times = {k: float(statistics.median(v)) for k, v in by_method.items()}
    t_torch = times[TORCH]
    speedup = {k: (t_torch / t if math.isfinite(t) and t > 0 else None)
               for k, t in times.items()}
    return {"target_P@1": target, "definition": "lowest over seeds of the best P@1 of "
            f"'{TORCH}'", "time_to_target_s": times, "speedup_vs_torch": speedup,
            "single_speedup_vs_torch": speedup.get("single"), "goal": ">= 2x (single)"}


def print_torch_comparison(c: dict, tag: str) -> None:
    print(f"\n{tag}: time to PyTorch's best P@1 = {c['target_P@1']:.4f} "
          f"(lowest over seeds of {TORCH}'s best)")
    print(f"{'method':34s} {'t->torch best s':>15s} {'speed-up vs torch':>18s}")
    for k, t in c["time_to_target_s"].items():
        s = c["speedup_vs_torch"][k]
        txt = "not reached" if not math.isfinite(t) else f"{t:.2f}"
        sp = f"{s:.2f}x" if s else "-"
        print(f"{k:34s} {txt:>15s} {sp:>18s}")
    s = c["single_speedup_vs_torch"]
    verdict = "n/a" if s is None else ("MET" if s >= 2.0 else "NOT met")
    sp = f"{s:.2f}x faster" if s else "did not reach it"
    print(f"engine single vs PyTorch (1 process): {sp} (goal >= 2x: {verdict})")


# -- XMC libraries --------------------------------------------------------------------------------

def run_libraries(tag, data, args) -> list[dict]:
    """napkinXC PLT (and PECOS XR-Linear with ``--pecos-python``): one run each, no curve."""
    import xmc_libraries as xl

    X, Y, Xte, Yte = data
    out = []
    jobs = [("napkinxc", lambda: xl.run_napkinxc_plt(X, Y, Xte, Yte, threads=args.lib_threads,
                                                     seed=args.tune_seed))]
    if args.pecos_python:
        jobs.append(("pecos", lambda: xl.run_pecos_xrlinear(
            X, Y, Xte, Yte, pecos_python=args.pecos_python, threads=args.lib_threads,
            seed=args.tune_seed)))
    for name, fn in jobs:
        try:
            r = fn()
        except _common.SkipBenchmark as e:
            print(f"  SKIP {name} on {tag}: {e}")
            out.append({"library": name, "skipped": str(e)})
            continue
        except Exception as e:  # noqa: BLE001 - a library failure must not stop the study
            print(f"  {name} on {tag} FAILED: {type(e).__name__}: {e}")
            out.append({"library": name, "error": f"{type(e).__name__}: {e}"})
            continue
        out.append(r)
    ok = [r for r in out if "train_time" in r]
    if ok:
        print(f"\n{tag}: XMC libraries (not SGD methods: no curve; {args.lib_threads} threads)")
        print(f"{'library':22s} {'train s':>8s} {'predict s':>9s} {'P@1':>7s} {'P@3':>7s} "
              f"{'P@5':>7s}")
        for r in ok:
            print(f"{r['library'] + ' ' + r['model']:22s} {r['train_time']:8.2f} "
                  f"{r['predict_time']:9.2f} {r['P@1']:7.4f} {r['P@3']:7.4f} {r['P@5']:7.4f}")
    return out


# -- CLI ------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", action="append", default=None,
                   help=f"dataset name or path (repeatable; default {' '.join(DEFAULT_DATA)})")
    p.add_argument("--setup", action="append", choices=sorted(SETUPS), default=None,
                   help="device setup (repeatable; default 2dev): "
                        + ", ".join(f"{k} = {v}" for k, v in SETUPS.items()))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=6, help="budget of every method (default 6)")
    p.add_argument("--batch-size", type=int, default=128,
                   help="base batch B (PyTorch: the same batch; DDP: the global batch)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--optimizer", choices=("sgd", "adagrad"), default="sgd",
                   help="the engine's optimiser (PyTorch baselines: always SGD)")
    p.add_argument("--lr-decay", type=float, default=0.0,
                   help="the engine's lr schedule lr0 / (1 + d * epoch), every engine method "
                        "(default 0: constant; the PyTorch baselines keep a constant lr)")
    p.add_argument("--eval-every", type=float, default=1.0,
                   help="epochs between evaluations of every method (default 1; on several "
                        "devices an evaluation waits for the next merge barrier)")
    p.add_argument("--warmup-epochs", type=float, default=None,
                   help="the engine's lr warm-up, every engine method (default: each "
                        "algorithm's own: none for single, 1 epoch for the multi-device ones; "
                        "0 puts every method on the same schedule)")
    p.add_argument("--lr", type=float, default=None,
                   help="engine lr with --no-tune (default 1.0 for sgd, 0.05 for adagrad)")
    p.add_argument("--torch-lr", type=float, default=0.5, help="PyTorch lr with --no-tune")
    p.add_argument("--lr-grid", type=float, nargs="+", default=None,
                   help="engine lr grid (default 0.5 1 2; 0.02 0.05 0.1 with adagrad)")
    p.add_argument("--torch-lr-grid", type=float, nargs="+", default=list(TORCH_LR_GRID))
    p.add_argument("--no-tune", action="store_true", help="use --lr / --torch-lr, no grid")
    p.add_argument("--tune-epochs", type=int, default=None,
                   help="budget of a tuning run (default half of --epochs, at least 1)")
    p.add_argument("--tune-seed", type=int, default=0)
    p.add_argument("--tune-for", choices=("time", "quality"), default="time",
                   help="lr choice: 'time' (default) the soonest to reach 99%% of the grid's best "
                        "P@1 within the tuning budget; 'quality' the best P@1")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baselines")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up fits that compile the Numba kernels before timing")
    p.add_argument("--no-libraries", action="store_true", help="skip napkinXC / PECOS")
    p.add_argument("--lib-threads", type=int, default=2, help="threads of napkinXC / PECOS")
    p.add_argument("--pecos-python", default=None,
                   help="python of a venv with libpecos: also run PECOS XR-Linear")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "tta"))
    p.add_argument("--from-results", action="store_true",
                   help="no training: recompute the tables of the result JSONs already in --out "
                        "from their saved curves, rewrite them and redraw the PNGs")
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = 1.0 if args.optimizer == "sgd" else 0.05
    if args.lr_grid is None:
        args.lr_grid = list(LR_GRIDS[args.optimizer])
    if args.tune_epochs is None:
        args.tune_epochs = max(1, args.epochs // 2)
    args.tune_epochs = min(args.tune_epochs, args.epochs)
    return args


def draw(res: dict, png: Path) -> None:
    """The curves of one (dataset, setup) result, with its target."""
    args = res["args"]
    plot_curves(res["runs"], png, title=f"{res['dataset']}: {res['devices']}, "
                f"{args['optimizer']}, B={args['batch_size']}",
                target=res["summary"]["target_P@1"])


def from_results(out: Path) -> int:
    """Recompute summary and PyTorch comparison of every result JSON in ``out`` from its saved
    runs (after a change of the target's definition, say), rewrite it and redraw its PNG."""
    n = 0
    for path in sorted(out.glob("*.json")):
        res = _common.read_json(path)
        if not res or res.get("benchmark") != "time_to_accuracy":
            continue
        args = argparse.Namespace(**res["args"])
        res["summary"], res["vs_torch"] = report(res["dataset"], res["setup"], res["runs"],
                                                 res["tuning"], args)
        res["target_frac"] = TARGET_FRAC
        _common.write_json(path, res)
        png = path.with_suffix(".png")
        draw(res, png)
        print(f"rewrote {path.name} and {png.name}")
        n += 1
    if not n:
        print(f"no time-to-accuracy results in {out}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.from_results:
        return from_results(out)
    out.mkdir(parents=True, exist_ok=True)
    warmed = False
    for name in args.data or list(DEFAULT_DATA):
        try:
            data = load_data(name)
        except Exception as e:  # noqa: BLE001 - a missing dataset skips, the others run
            print(f"SKIP {name}: {type(e).__name__}: {e}")
            continue
        if data[2] is None:
            print(f"SKIP {name}: needs a test split")
            continue
        tag = data_tag(str(name))
        for suffix in (".txt.xz", ".txt", ".npz"):
            tag = tag.removesuffix(suffix)
        print(f"== {tag}: {data[0].shape[0]} train, {data[2].shape[0]} test, "
              f"{data[0].shape[1]} features, {data[1].shape[1]} labels", flush=True)
        libraries = [] if args.no_libraries else run_libraries(tag, data, args)
        cache: dict = {}
        if not args.no_warmup and not warmed:
            t = warm_up(data, args, SETUPS[(args.setup or ["2dev"])[0]])
            print(f"  warm-up (Numba compile, every algorithm on a small slice): {t:.1f} s")
            warmed = True
        for setup in args.setup or ["2dev"]:
            print(f"-- {tag} {setup} ({SETUPS[setup]})", flush=True)
            meta = _common.result_metadata(machine_extra={"torch_threads_per_process": 1})
            res = run_setup(tag, data, setup, args, cache)
            png = out / f"{tag}_{setup}.png"
            payload = {
                **meta, "benchmark": "time_to_accuracy", "args": vars(args),
                "shape": {"n_train": data[0].shape[0], "n_test": data[2].shape[0],
                          "n_features": data[0].shape[1], "n_labels": data[1].shape[1]},
                "budget": {"epochs": args.epochs, "batch_size": args.batch_size,
                           "hidden": args.hidden, "tune_epochs": args.tune_epochs},
                "target_frac": TARGET_FRAC, "reference": REFERENCE, **res,
                "libraries": libraries, "plot": png.name,
            }
            draw(payload, png)
            path = _common.write_result(out / f"{tag}_{setup}.json", payload)
            print(f"wrote {path} and {png.name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
