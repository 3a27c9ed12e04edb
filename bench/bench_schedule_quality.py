"""Final P@1/3/5 of fixed one-device runs on real data: what the one-loop rework (one learning-rate
schedule for every algorithm) changed for ``single``.

The first three runs are the settings the quality bands used before the defaults changed (Adagrad,
one thread, no warm-up or decay: the schedule is a constant, so only the loop differs); the fourth
adds a warm-up and a decay, where the old one-device schedule (continuous decay, a warm-up floored
at 0.02x, per step) and the shared one (whole-epoch decay, per period) differ. Run it in two
checkouts and compare::

    python bench/bench_schedule_quality.py --out bench/results/schedule_quality.json

Every run is deterministic (``threads=1``, ``seed=0``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

RUNS = [
    ("bibtex", dict(hidden=1024, batch_size=64, lr=0.02, epochs=7)),
    ("delicious", dict(hidden=128, batch_size=128, lr=0.05, epochs=4)),
    ("debian_debtags", dict(hidden=256, batch_size=128, lr=0.1, epochs=4)),
    ("delicious", dict(hidden=128, batch_size=128, lr=0.05, epochs=4, lr_warmup_epochs=0.5,
                       lr_decay=0.5)),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=_common.RESULTS_DIR / "schedule_quality.json")
    args = p.parse_args(argv)
    meta = _common.result_metadata()
    from xmc_engine.datasets import load_dataset

    from xmc_engine import XMCClassifier

    rows = []
    for name, kw in RUNS:
        train, _ = _common.dataset_paths(name)
        X, Y, Xt, Yt = load_dataset(str(train.parent))
        m = XMCClassifier(seed=0, threads=1, eval_every=0, optimizer="adagrad", **kw)
        m.fit(X, Y, eval_set=(Xt, Yt))
        row = {"dataset": name, "settings": kw,
               **{k: round(float(m.metrics_[k]), 4) for k in ("P@1", "P@3", "P@5")}}
        rows.append(row)
        print(name, kw, {k: row[k] for k in ("P@1", "P@3", "P@5")}, flush=True)
    _common.write_result(args.out, {**meta, "runs": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
