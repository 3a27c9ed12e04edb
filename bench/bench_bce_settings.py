"""The logistic loss's settings on every set: where its output biases start and its decay.

``loss="bce"`` (``bench/RESULTS.md``, "The logistic loss") trails the softmax on the synthetic
shapes at the engine's settings for it (output biases from ``-log(n_labels)``,
:data:`xmc_engine.model.BCE_BIAS_INIT`; Adagrad lr 0.1 with the default decay 0.5). This trains
it with each combination of bias start (``minus_log_labels``, ``zero``) and decay (``--decays``)
beside the softmax default, ``--epochs`` epochs, each ``--seeds`` seed (``--heavy`` sets: the
first seed), one thread, and prints P@1 / P@3 / P@5 means per set and the mean P@1 over the
sets::

    python bench/bench_bce_settings.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import bench_defaults  # noqa: E402

METRICS = ("P@1", "P@3", "P@5")
INITS = ("minus_log_labels", "zero")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+",
                   default=[*bench_defaults.REAL, "synth1k", "synth10k"])
    p.add_argument("--heavy", nargs="*", default=["debian_builddeps", "synth10k"])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--decays", type=float, nargs="+", default=[0.5, 0.0])
    p.add_argument("--max-train", type=int, default=30_000)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "bce_settings.json"))
    return p.parse_args(argv)


def run(data, config: dict, init: str | None, seed: int, epochs: int) -> dict:
    """One fit (``bench_defaults.run_one``) with ``BCE_BIAS_INIT = init`` (None: unchanged)."""
    import xmc_engine.model as model

    saved = model.BCE_BIAS_INIT
    model.BCE_BIAS_INIT = init or saved
    try:
        return bench_defaults.run_one(data, config, seed, [epochs], 1)["at"][str(epochs)]
    finally:
        model.BCE_BIAS_INIT = saved


def main(argv=None) -> int:
    args = parse_args(argv)
    arms = [("softmax", {"loss": "softmax"}, None)] + [
        (f"bce bias={init} decay={d:g}", {"loss": "bce", "lr_decay": d}, init)
        for init in INITS for d in args.decays]
    out = {**_common.result_metadata(), "benchmark": "bce_settings", "args": vars(args),
           "arms": [a[0] for a in arms], "rows": []}
    means = {}
    print("| data | " + " | ".join(a[0] for a in arms) + " |")
    print("|---|" + "---|" * len(arms))
    for name, X, Y, Xt, Yt, _ in bench_defaults.datasets_present(args.datasets,
                                                                   args.max_train):
        seeds = args.seeds[:1] if name in args.heavy else args.seeds
        cells = []
        for label, config, init in arms:
            runs = [run((X, Y, Xt, Yt), config, init, s, args.epochs) for s in seeds]
            mean = {k: float(np.mean([r[k] for r in runs])) for k in METRICS}
            means.setdefault(label, []).append(mean["P@1"])
            out["rows"].append({"dataset": name, "arm": label, "seeds": seeds, "mean": mean,
                                "runs": runs})
            cells.append(" / ".join(f"{mean[k]:.4f}" for k in METRICS))
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        _common.write_result(args.out, out)
    print("\nmean P@1 over the sets: " + ", ".join(f"{k} {np.mean(v):.4f}"
                                                  for k, v in means.items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
