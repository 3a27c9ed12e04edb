"""Time-to-accuracy helpers shared by bench_heterogeneous.py and bench_time_to_accuracy.py.

A *method* is an algorithm name plus options (e.g. ``adaptive`` with ``rule=proportional``);
each run trains an :class:`xmc_engine.XMCClassifier` with evaluation after every epoch and
returns its curve ``[(train_time, epoch, P@1, P@3, P@5), ...]`` (training time only: evaluation
excluded, DESIGN.md §5).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def load_data(name: str):
    """``(X_train, Y_train, X_test, Y_test)`` for a dataset name or path, or for a synthetic
    shape ``synthetic:N_TRAIN:N_FEATURES:N_LABELS[:PRESET]`` (``make_synthetic(PRESET, ...)``,
    PRESET ``default`` unless given, e.g. ``amazon670k`` for that shape's non-zeros and labels
    per row at other sizes; seed 0, a test set of N_TRAIN / 5 rows): the small real sets are
    dominated by per-step overheads, a wider output layer shows how the algorithms scale."""
    if name.startswith("synthetic:"):
        from xmc_engine.datasets import make_synthetic
        from xmc_engine.datasets.synthetic import PRESETS

        parts = name.split(":")[1:]
        if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] not in PRESETS):
            raise SystemExit(f"--data {name!r}: expected synthetic:N_TRAIN:N_FEATURES:N_LABELS"
                             f"[:PRESET], PRESET one of {', '.join(PRESETS)}")
        n_train, n_features, n_labels = (int(v) for v in parts[:3])
        preset = parts[3] if len(parts) == 4 else "default"
        return make_synthetic(preset, n_train=n_train, n_test=max(n_train // 5, 1),
                              n_features=n_features, n_labels=n_labels, seed=0)
    from xmc_engine.datasets import load_dataset

    return load_dataset(name)


def data_tag(name: str) -> str:
    """A file-name-safe tag for a dataset argument."""
    return name.replace(":", "_") if name.startswith("synthetic:") else Path(name).name


@dataclass
class Method:
    label: str
    algorithm: str
    devices: str
    params: dict = field(default_factory=dict)
    lr: float | None = None  # None: the script's --lr
    threads: int | None = None
    batch_size: int | None = None  # None: the script's --batch-size
    lr_decay: float | None = None  # None: the script's --lr-decay
    #: other ``XMCClassifier`` options of this configuration alone (e.g. ``optimizer``,
    #: ``loss``, ``output``), applied last
    train: dict = field(default_factory=dict)


def run_method(m: Method, data, *, epochs, lr, batch_size, hidden, seed, optimizer="sgd",
               lr_decay=0.0, warmup_epochs=None, eval_every=1.0, loss=None):
    """Train once; returns a dict with the curve and totals. ``lr_decay`` and ``warmup_epochs``
    are the engine's schedule (``lr_warmup_epochs``; ``None``: each algorithm's own warm-up);
    ``eval_every`` epochs between evaluations (on several devices: at the next merge barrier).
    ``hidden``, ``optimizer``, ``loss``, a batch size (``m.batch_size`` and ``batch_size``), a
    learning rate (``m.lr`` and ``lr``) or a decay (``m.lr_decay`` and ``lr_decay``) that is
    ``None`` is left to the engine's default; ``m.train``'s options come last. Every run starts
    from the initialisation (``continue_probe=False``): the curves start level, each with its
    first evaluation; a run
    that went on from the loss probe's fit (on one device) would start at that fit's samples,
    with no evaluation before them."""
    from xmc_engine import XMCClassifier

    Xtr, Ytr, Xte, Yte = data
    chosen = {"hidden": hidden, "optimizer": optimizer,
              "batch_size": m.batch_size if m.batch_size is not None else batch_size,
              "lr": m.lr if m.lr is not None else lr,
              "lr_decay": m.lr_decay if m.lr_decay is not None else lr_decay, "loss": loss}
    clf = XMCClassifier(epochs=epochs, lr_warmup_epochs=warmup_epochs, devices=m.devices,
                        algorithm=m.algorithm, algorithm_params=dict(m.params), seed=seed,
                        threads=m.threads, eval_every=eval_every, continue_probe=False,
                        **{**{k: v for k, v in chosen.items() if v is not None}, **m.train})
    t0 = time.perf_counter()
    clf.fit(Xtr, Ytr, eval_set=(Xte, Yte))
    wall = time.perf_counter() - t0
    curve = [(r["train_time"], r["epoch"], r["metrics"]["P@1"], r["metrics"]["P@3"],
              r["metrics"]["P@5"]) for r in clf.history_ if r.get("event") == "eval"]
    merges = [r for r in clf.history_ if r.get("event") == "merge"]
    last = merges[-1]["devices"] if merges else []
    return {"method": m.label, "algorithm": m.algorithm, "devices": m.devices,
            "params": m.params, "lr": clf.get_config().learning_rate, "seed": seed,
            "curve": curve, "wall_s": wall,
            "final": {"P@1": curve[-1][2], "P@3": curve[-1][3], "P@5": curve[-1][4]},
            "best_P@1": max(c[2] for c in curve),
            "rows_single_share": rows_single_share(merges),
            "last_period": [{k: d.get(k) for k in ("name", "batch_size", "updates", "samples",
                                                   "weight")} for d in last]}


def rows_single_share(merges) -> float | None:
    """The row-sparse merge's instrumentation over merge-log records: of the ``W1`` rows some
    replica changed in a period, the share exactly one replica changed (summed over the merges
    that report them; ``None`` when none does)."""
    touched = sum(r.get("rows_touched", 0) for r in merges)
    single = sum(r.get("rows_single", 0) for r in merges)
    return single / touched if touched else None


def time_to_target(curve, target: float) -> float:
    """Training seconds at which P@1 first reaches ``target``: linear interpolation between the
    two evaluations around the crossing; ``inf`` when never reached."""
    prev_t, prev_p = 0.0, 0.0
    for t, _, p1, *_ in curve:
        if p1 >= target:
            if p1 == prev_p:
                return t
            return prev_t + (target - prev_p) / (p1 - prev_p) * (t - prev_t)
        prev_t, prev_p = t, p1
    return math.inf


def summarise(runs, target_frac: float = 0.97, reference: str = "adaptive"):
    """Per method: median time to target over seeds, final/best P@1, ratio against reference.

    The target is ``target_frac`` x the best method's median (over seeds) best P@1 within the
    budget: the same statistic as the times. The best single run instead (one lucky seed) moved
    the target up and down from one repetition of a study to the next, and near a plateau the
    times with it (delicious: 0.6307 then 0.6350, adaptive's time 0.5 s then 1.0 s).
    """
    by_method: dict[str, list] = {}
    for r in runs:
        by_method.setdefault(r["method"], []).append(r)
    best = max(float(np.median([r["best_P@1"] for r in rs])) for rs in by_method.values())
    target = target_frac * best
    rows = []
    for name, rs in by_method.items():
        times = [time_to_target(r["curve"], target) for r in rs]
        rows.append({"method": name, "seeds": len(rs),
                     "time_to_target_s": float(np.median(times)),
                     "times": times,
                     "final_P@1": float(np.mean([r["final"]["P@1"] for r in rs])),
                     "final_P@5": float(np.mean([r["final"]["P@5"] for r in rs])),
                     "train_s": float(np.mean([r["curve"][-1][0] for r in rs]))})
    ref = next((row for row in rows if row["method"] == reference), None)
    for row in rows:
        if ref is not None and math.isfinite(ref["time_to_target_s"]):
            row["ratio_vs_" + reference] = row["time_to_target_s"] / ref["time_to_target_s"]
    return {"target_P@1": target, "best_P@1": best, "target_frac": target_frac,
            "best_P@1_any_run": max(r["best_P@1"] for r in runs), "rows": rows}


def print_table(summary, reference: str = "adaptive", title: str = "") -> None:
    frac = summary.get("target_frac", 0.97)
    print(f"\n{title}  target P@1 = {summary['target_P@1']:.4f} "
          f"({frac:.0%} of the best method's median best P@1 {summary['best_P@1']:.4f})")
    print(f"{'method':34s} {'seeds':>5s} {'t->target s':>12s} {'x ' + reference:>12s} "
          f"{'final P@1':>9s} {'final P@5':>9s} {'train s':>8s}")
    for row in summary["rows"]:
        ratio = row.get("ratio_vs_" + reference, math.nan)
        print(f"{row['method']:34s} {row['seeds']:5d} {row['time_to_target_s']:12.1f} "
              f"{ratio:12.2f} {row['final_P@1']:9.4f} {row['final_P@5']:9.4f} "
              f"{row['train_s']:8.1f}")


def plot_curves(runs, out_png, title: str = "", target: float | None = None) -> None:
    """P@1 against training time on a log axis (sub-second engine runs beside minute-long
    baselines), one line per run (seeds share a colour); with ``target`` a dashed line at the
    target P@1 and the y axis zoomed on the range around it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours: dict[str, str] = {}
    for r in runs:
        c = colours.setdefault(r["method"], f"C{len(colours)}")
        t = [p[0] for p in r["curve"]]
        p = [p[2] for p in r["curve"]]
        ax.plot(t, p, color=c, marker="o", ms=2, lw=1, alpha=0.6,
                label=r["method"] if r["seed"] == runs[0]["seed"] else None)
    ax.set_xscale("log")
    if target is not None:
        ax.axhline(target, color="k", ls="--", lw=1, label=f"target P@1 {target:.3f}")
        top = max(p[2] for r in runs for p in r["curve"])
        ax.set_ylim(0.8 * target, top + 0.1 * (top - 0.8 * target))
    ax.set_xlabel("training time (s, log scale, evaluation excluded)")
    ax.set_ylabel("P@1 (test)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
