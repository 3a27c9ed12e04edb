"""A prototype of merge variants that ``adaptive`` does not have (issue 15, step 2), patched
into the engine for the run only: one Adagrad state and the sum of every change lost and are
no option; the shared rows' sum over ``sqrt(k)`` became one (``row_weights="sum_sqrt"``), which
``POW`` now selects.

- ``--variant LABEL:DEVICES:PARAMS:ACC[:POW]`` trains ``adaptive`` (``single`` where
  ``DEVICES`` has one device) with every engine default but:

  ``PARAMS`` ``default``: the engine's merge; ``sum_all``: every parameter becomes the centre
  plus the *sum* of the replicas' changes in the period (dense, ``W2`` and the biases
  included: what one model would make of all their steps to first order).

  ``ACC`` ``keep``: each replica keeps its own Adagrad accumulators (the engine's
  ``optimizer_state="keep"``); ``sum``: at each merge every replica's accumulators become the
  previous merge's plus the sum of every replica's increments since (the squared gradients of
  all the period's rows: one model's Adagrad state).

  ``POW`` (absent: the engine's ``row_weights``): 0 gives ``row_weights="sum"`` (a ``W1``
  row that ``k > 1`` replicas changed gets the centre plus the sum of their changes), 0.5
  ``"sum_sqrt"`` (that sum over ``sqrt(k)``). The committed files were measured while the
  engine's default was ``"sum"`` and ``POW`` was patched in; the engine's ``"sum_sqrt"`` is
  the same merge.

- Reports each variant's median seconds to ``--target`` over the seeds (quartiles), the median
  epoch at which it was first seen and the median final P@1.

The accumulator and ``sum_all`` merges are dense numpy passes (a CPU device set), so their
seconds include a cost the row-sparse merge does not pay; compare their epochs. Example::

    python bench/proto_merge_state.py --data debian_debtags --epochs 2 --test-rows 3000 \\
        --seeds 0 1 2 --target 0.8407 --variant single:cpu:default:keep \\
        --variant adaptive:cpu,cpu:default:keep --variant sum_all+acc_sum:cpu,cpu:sum_all:sum \\
        --out bench/results/merge_prototypes/debian_debtags.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import _tta  # noqa: E402
from bench_tta_sweep import median_quartiles, subset_test  # noqa: E402

#: What the patched merge does in the run under way (set before each run).
VARIANT = {"params": "default", "acc": "keep"}
#: ``POW`` -> the engine's ``row_weights``
ROW_WEIGHTS_BY_POW = {0.0: "sum", 0.5: "sum_sqrt"}


def _centre_plus_changes(arrays, centre) -> np.ndarray:
    """``centre + sum_i (arrays[i] - centre)`` in float64."""
    s = arrays[0].astype(np.float64)
    for a in arrays[1:]:
        s += a
    s -= (len(arrays) - 1) * centre
    return s


def _acc_sum(policy, replicas) -> None:
    """Every replica's accumulators := base + sum_i (acc_i - base); base: the last merge's
    (zeros before the first: the bench's runs start from the initialisation)."""
    accs = [r.accumulators() for r in replicas]
    if not all(accs):
        return
    base = getattr(policy, "_proto_acc_base", None)
    if base is None:
        base = policy._proto_acc_base = [np.zeros_like(a) for a in accs[0]]
    for j, b in enumerate(base):
        s = _centre_plus_changes([a[j] for a in accs], b)
        np.maximum(s, 0.0, out=s)
        np.copyto(b, s, casting="same_kind")
        for a in accs:
            np.copyto(a[j], b)


def patch_engine() -> None:
    from xmc_engine.algorithms.adaptive import AdaptiveSGD

    merge, opt_state = AdaptiveSGD.merge, AdaptiveSGD._merge_optimizer_state

    def patched_opt_state(self, replicas, p):
        if VARIANT["acc"] == "sum":
            return _acc_sum(self, replicas)
        return opt_state(self, replicas, p)

    def patched_merge(self, replicas, updates, ctx):
        if VARIANT["params"] != "sum_all":
            return merge(self, replicas, updates, ctx)
        params = [r.params() for r in replicas]
        n = len(params)
        for j, c in enumerate(self.central):
            np.copyto(self._wbar[j], _centre_plus_changes([q[j] for q in params], c),
                      casting="same_kind")
        self.central, self._wbar = self._wbar, self.central
        self.broadcast(replicas, self.central)
        patched_opt_state(self, replicas, None)
        return {"weights": [1.0 / n] * n, "flag": 0, "norm": None, "nonfinite": []}

    AdaptiveSGD.merge = patched_merge
    AdaptiveSGD._merge_optimizer_state = patched_opt_state


def parse_variant(text: str) -> dict:
    parts = text.split(":")
    if len(parts) not in (4, 5) or parts[2] not in ("default", "sum_all") \
            or parts[3] not in ("keep", "sum"):
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: expected LABEL:DEVICES:default|sum_all:keep|sum[:POW]")
    engine = {}
    if len(parts) == 5:
        try:
            engine["row_weights"] = ROW_WEIGHTS_BY_POW[float(parts[4])]
        except (ValueError, KeyError):
            raise argparse.ArgumentTypeError(
                f"--variant {text!r}: POW must be one of 0, 0.5") from None
    return {"label": parts[0], "devices": parts[1], "params": parts[2], "acc": parts[3],
            "engine": engine}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=float, required=True)
    p.add_argument("--eval-every", type=float, default=0.125)
    p.add_argument("--test-rows", type=int, default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--target", type=float, required=True)
    p.add_argument("--variant", type=parse_variant, action="append", required=True)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    meta = _common.result_metadata()
    patch_engine()
    data = subset_test(_tta.load_data(args.data), args.test_rows)
    runs: dict[str, list] = {v["label"]: [] for v in args.variant}
    for seed in args.seeds:
        for v in args.variant:
            VARIANT.update(params=v["params"], acc=v["acc"])
            one = "," not in v["devices"]
            m = _tta.Method(v["label"], "single" if one else "adaptive", v["devices"],
                            {} if one else dict(v["engine"]), threads=1 if one else None)
            r = _tta.run_method(m, data, epochs=args.epochs, lr=None, batch_size=None,
                                hidden=None, seed=seed, optimizer=None,
                                lr_decay=None, eval_every=args.eval_every)
            t = _tta.time_to_target(r["curve"], args.target)
            ep = next((c[1] for c in r["curve"] if c[2] >= args.target), None)
            runs[v["label"]].append({"seed": seed, "time_to_target_s": t, "epoch_at_target": ep,
                                     "final_P@1": r["final"]["P@1"], "curve": r["curve"]})
            print(f"seed {seed} {v['label']:24s} {t:.3f} s, epoch {ep}, "
                  f"final P@1 {r['final']['P@1']:.4f}", flush=True)
    rows = []
    print(f"\n| variant | s to {args.target} (quartiles) | epoch | final P@1 |\n|---|---|---|---|")
    for v in args.variant:
        rs = runs[v["label"]]
        med, q1, q3 = median_quartiles([x["time_to_target_s"] for x in rs])
        ep = float(np.median([np.inf if x["epoch_at_target"] is None else x["epoch_at_target"]
                              for x in rs]))
        final = float(np.median([x["final_P@1"] for x in rs]))
        rows.append({**v, "median_time_to_target_s": med, "quartiles_s": [q1, q3],
                     "median_epoch_at_target": ep, "final_P@1": final, "runs": rs})
        print(f"| {v['label']} | {med:.3f} ({q1:.3f}-{q3:.3f}) | {ep:.3f} | {final:.4f} |")
    if args.out:
        path = _common.write_result(args.out, {**meta, "benchmark": "proto_merge_state",
                                               "target_P@1": args.target, "rows": rows})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
