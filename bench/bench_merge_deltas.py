"""Issue 15's step-1 instrumentation: how large is each replica's change in a merge period where
the merge can shrink it, on ``W1`` rows one replica changed alone against shared rows, and on
``W2``'s tail label columns against the head?

Trains ``adaptive`` (engine defaults plus ``delta_stats=True``) and reports, per device, its
median batch and merge weight and the median over merges of the root mean square of
``w_i - centre`` on each part
(:func:`xmc_engine.scheduler.merge.delta_stats`; tail = at most
``TAIL_MAX_POSITIVES`` = 5 positive training rows), with the share of changed rows that one
replica changed alone and each device's merge weight. The paper's merge multiplies a replica's
change on a row only it changed by its weight ``p_i``. Command (results in
``bench/results/merge_deltas/<data>.json``)::

    python bench/bench_merge_deltas.py --data debian_builddeps --devices cpu,cpu@0.5 \\
        --epochs 1 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import _tta  # noqa: E402

KEYS = ("delta_w1_single", "delta_w1_shared", "delta_w2_head", "delta_w2_tail")


def ratio(a: float, b: float) -> float:
    """``a / b``, NaN where a part is empty (an RMS of 0: no tail labels, no shared rows)."""
    return a / b if a > 0 and b > 0 else float("nan")


def run(data, devices: str, epochs: float, seed: int) -> dict:
    from xmc_engine import XMCClassifier

    clf = XMCClassifier(epochs=epochs, devices=devices, algorithm="adaptive",
                        algorithm_params={"delta_stats": True}, eval_every=0, seed=seed)
    clf.fit(data[0], data[1])
    merges = [r for r in clf.history_ if r.get("event") == "merge" and KEYS[0] in r]
    if not merges:
        raise RuntimeError("no merge logged delta_stats (too few samples for a merge period?)")
    n_dev = len(merges[0][KEYS[0]])
    out = {k: [float(np.median([m[k][i] for m in merges])) for i in range(n_dev)] for k in KEYS}
    for key in ("weight", "batch_size"):
        out[key] = [float(np.median([m["devices"][i][key] for m in merges]))
                    for i in range(n_dev)]
    out["rows_single_share"] = _tta.rows_single_share(merges) or 0.0
    out["merges"] = len(merges)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--devices", default="cpu,cpu@0.5")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    meta = _common.result_metadata()
    data = _tta.load_data(args.data)
    runs = [{"seed": s, **run(data, args.devices, args.epochs, s)} for s in args.seeds]
    n_dev = len(runs[0]["weight"])
    print(f"{args.data}, {args.devices}: median over merges, then over {len(runs)} seeds; "
          f"{np.median([r['rows_single_share'] for r in runs]):.1%} of the changed W1 rows "
          "changed by one replica alone")
    print(f"{'device':>6s} {'batch':>6s} {'weight':>7s} " + " ".join(f"{k:>16s}" for k in KEYS)
          + f" {'single/shared':>13s} {'tail/head':>9s}")
    summary = []
    for i in range(n_dev):
        med = {k: float(np.median([r[k][i] for r in runs]))
               for k in (*KEYS, "weight", "batch_size")}
        med["single_over_shared"] = ratio(med["delta_w1_single"], med["delta_w1_shared"])
        med["tail_over_head"] = ratio(med["delta_w2_tail"], med["delta_w2_head"])
        summary.append(med)
        print(f"{i:6d} {med['batch_size']:6.0f} {med['weight']:7.3f} "
              + " ".join(f"{med[k]:16.3e}" for k in KEYS)
              + f" {med['single_over_shared']:13.2f} {med['tail_over_head']:9.2f}")
    tag = _tta.data_tag(args.data)
    out = Path(args.out or _common.RESULTS_DIR / "merge_deltas" / f"{tag}.json")
    path = _common.write_result(out, {**meta, "benchmark": "merge_deltas",
                                      "args": vars(args), "devices": summary, "runs": runs})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
