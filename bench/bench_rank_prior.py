"""A label-frequency term at ranking time: does it move P@k of the default model?

The sampled output layer's logistic loss counts each candidate negative once
(:data:`xmc_engine.output_layer.BCE_WEIGHTED_NEGATIVES` is ``False``). A label is a candidate
negative of a row when another row of the batch has it (in-batch) or when it is drawn among the
``K`` uniform negatives, so a frequent label is pushed down at almost every step and a rare one at
about ``K / L`` of them: the trained logits favour rare labels. The standard correction (the
"log Q" of sampled losses) ranks by ``z_j + log q_j``, with ``q_j`` label ``j``'s chance of being
a candidate negative of a row::

    q_j = 1 - (1 - f_j) ** (B - 1) * (1 - K / L)        f_j: label j's share of training rows

This benchmark trains the defaults (``XMCClassifier(seed=s, epochs=E)``, nothing else set) on
each ``--data`` set and ranks its test rows by ``z + a log q`` for each ``--alphas`` value ``a``
(``a = 0``: the engine's ranking; ``a = 1``: the full correction), and by ``z + b log(1 + n_j)``
(``n_j`` the label's training count) for each ``--freq-betas`` value. Prints P@1 / P@3 / P@5 /
PSP@5 / nDCG@5, means over the seeds::

    python bench/bench_rank_prior.py --data debian_builddeps --seeds 0 1 2 \\
        --out bench/results/rank_prior.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

METRICS = ("P@1", "P@3", "P@5", "PSP@5", "nDCG@5")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="+", default=["debian_builddeps"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=float, default=5.0)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--freq-betas", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    return p.parse_args(argv)


def candidate_chance(Y, batch_size: int, negatives: int) -> np.ndarray:
    """``q_j`` of the module docstring, per label, from the training labels ``Y``."""
    n, L = Y.shape
    f = np.asarray(Y.sum(axis=0), dtype=np.float64).ravel() / n
    return 1.0 - (1.0 - f) ** (batch_size - 1) * (1.0 - min(1.0, negatives / L))


def main(argv=None) -> int:
    args = parse_args(argv)
    meta = _common.result_metadata(argv=argv)
    from xmc_engine import XMCClassifier
    from xmc_engine.backends import get_backend
    from xmc_engine.metrics import evaluate, jain_propensity
    from xmc_engine.model import predict_topk
    from xmc_engine.validation import normalize_rows

    be = get_backend("cpu")
    rows = []
    for name in args.data:
        X, Y, Xt, Yt = _common.load_dataset(name)
        prop = jain_propensity(Y)
        counts = np.asarray(Y.sum(axis=0), dtype=np.float64).ravel()
        for seed in args.seeds:
            clf = XMCClassifier(seed=seed, epochs=args.epochs).fit(X, Y)
            cfg = clf.get_config()
            W1, b1, W2, b2 = clf.params_
            Xn = normalize_rows(Xt, cfg.normalize)
            terms = [("log_q", a, np.log(candidate_chance(Y, cfg.batch_size, cfg.negatives)))
                     for a in args.alphas]
            terms += [("log_count", b, np.log1p(counts)) for b in args.freq_betas]
            for kind, coef, term in terms:
                shifted = (b2 + coef * term).astype(np.float32)
                top, _ = predict_topk(be, [W1, b1, W2, shifted], Xn, 5)
                m = evaluate(top, Yt, propensity=prop)
                rows.append({"data": name, "seed": seed, "loss": clf.loss_, "term": kind,
                             "coef": coef, **{k: float(m[k]) for k in METRICS}})
                print(name, seed, kind, coef, " ".join(f"{k} {m[k]:.4f}" for k in METRICS),
                      flush=True)
    print("\nmeans over the seeds")
    print("| data | term | coefficient | " + " | ".join(METRICS) + " |")
    print("|---|---|---:|" + "---:|" * len(METRICS))
    keys = dict.fromkeys((r["data"], r["term"], r["coef"]) for r in rows)
    for data, kind, coef in keys:
        sel = [r for r in rows if (r["data"], r["term"], r["coef"]) == (data, kind, coef)]
        means = [np.mean([r[k] for r in sel]) for k in METRICS]
        print(f"| {data} | {kind} | {coef:g} | " + " | ".join(f"{v:.4f}" for v in means) + " |")
    if args.out:
        _common.write_result(args.out, {**meta, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
