"""Neighbour votes at prediction (``TrainConfig.neighbours``): P@k of the same fitted model
with and without them.

For every ``--data`` set and seed the defaults are trained once (``XMCClassifier(seed=s,
epochs=E)``, nothing else set), and the test rows are ranked twice: by the network alone and by
its blend with the votes of the training rows nearest each test row
(:mod:`xmc_engine.neighbours`, :data:`xmc_engine.config.NEIGHBOURS_K` neighbours). Where the
defaults left the votes off (``neighbours="auto"``: the softmax, or more training rows than
:data:`xmc_engine.config.NEIGHBOURS_MAX_ROWS`) they are built for this comparison all the same,
so that every set says what they would do. Prints P@1 / P@3 / P@5 / PSP@5 / nDCG@5 and the
seconds of each ranking, and the means over the seeds::

    python bench/bench_neighbours.py --data bibtex delicious corel5k stackex_cooking \\
        stackex_cs rcv1sub1 debian_debtags debian_builddeps imdb synth1k synth10k \\
        --seeds 0 1 2 --out bench/results/neighbours.json

``--grid`` instead scores every setting of ``--ks`` (neighbours of each vote) x ``--weights``
(the network's share of the score) on each fitted model, P@k only: what chose
:data:`xmc_engine.config.NEIGHBOURS_K` and :data:`xmc_engine.config.NEIGHBOURS_NETWORK_WEIGHT`::

    python bench/bench_neighbours.py --grid --data bibtex delicious corel5k stackex_cooking \
        stackex_cs rcv1sub1 debian_debtags debian_builddeps imdb --seeds 0 1 2 \
        --out bench/results/neighbours_grid.json

``--variants`` scores other forms of the vote beside the default's on each fitted model
(:data:`VARIANTS`: the two spaces' shares, the power of the similarity, each space's number
of neighbours, one vote over the mean of the two similarities), the network's weight fixed at
the default's::

    python bench/bench_neighbours.py --variants --data bibtex delicious corel5k \
        stackex_cooking stackex_cs rcv1sub1 debian_debtags debian_builddeps imdb \
        --seeds 0 1 2 --out bench/results/neighbours_variants.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

METRICS = ("P@1", "P@3", "P@5", "PSP@5", "nDCG@5")

#: ``--variants``: each form of the vote as its terms ``(share, space, neighbours, power)``,
#: ``space`` "hidden" (the last hidden layer), "input" (the features) or "joint" (the mean of
#: the two cosine similarities). The first is the engine's default.
VARIANTS = {
    "default": ((0.5, "hidden", 25, 3.0), (0.5, "input", 25, 3.0)),
    "hidden 0.7 input 0.3": ((0.7, "hidden", 25, 3.0), (0.3, "input", 25, 3.0)),
    "hidden 0.3 input 0.7": ((0.3, "hidden", 25, 3.0), (0.7, "input", 25, 3.0)),
    "hidden alone": ((1.0, "hidden", 25, 3.0),),
    "power 1": ((0.5, "hidden", 25, 1.0), (0.5, "input", 25, 1.0)),
    "power 5": ((0.5, "hidden", 25, 5.0), (0.5, "input", 25, 5.0)),
    "k hidden 10 input 25": ((0.5, "hidden", 10, 3.0), (0.5, "input", 25, 3.0)),
    "k hidden 25 input 10": ((0.5, "hidden", 25, 3.0), (0.5, "input", 10, 3.0)),
    "k hidden 25 input 50": ((0.5, "hidden", 25, 3.0), (0.5, "input", 50, 3.0)),
    "k 10 and 50": ((0.25, "hidden", 10, 3.0), (0.25, "hidden", 50, 3.0),
                    (0.25, "input", 10, 3.0), (0.25, "input", 50, 3.0)),
    "joint similarity": ((1.0, "joint", 25, 3.0),),
    "joint, hidden, input": ((1 / 3, "joint", 25, 3.0), (1 / 3, "hidden", 25, 3.0),
                             (1 / 3, "input", 25, 3.0)),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="+", default=["bibtex", "debian_builddeps"],
                   help="shared datasets or synthetic shapes (bench_defaults.py's names)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=float, default=5.0)
    p.add_argument("--params", type=json.loads, default={},
                   help="XMCClassifier options on top of the defaults, a JSON object (e.g. "
                        "'{\"loss\": \"softmax\"}')")
    p.add_argument("--grid", action="store_true",
                   help="score every --ks x --weights setting of the votes on each fitted "
                        "model (P@k only, no timings) instead of the default's comparison")
    p.add_argument("--variants", action="store_true",
                   help="score the forms of the vote in VARIANTS on each fitted model (P@k "
                        "only) instead of the default's comparison")
    p.add_argument("--ks", type=int, nargs="+", default=[10, 25, 50],
                   help="with --grid: neighbours of each vote")
    p.add_argument("--weights", type=float, nargs="+", default=[0.3, 0.5, 0.7],
                   help="with --grid: the network's share of a label's score")
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    return p.parse_args(argv)


def grid_scores(model, X, Y, Xt, Yt, ks, weights) -> dict:
    """P@k of the blend of ``model``'s network with the votes of ``k`` neighbours at network
    weight ``w``, for every ``(k, w)``: ``{"k,w": {metric: value}}`` (``w = 1``: the network
    alone). Computed a chunk of test rows at a time from one set of network probabilities and
    one pair of votes per ``k``."""
    from xmc_engine.kernels import topk

    from xmc_engine.metrics import TopKMetrics, jain_propensity
    from xmc_engine.neighbours import NeighbourIndex, host_hidden, network_probabilities

    Xn, Xq = model._features(X), model._features(Xt)
    index = NeighbourIndex(Xn, host_hidden(model.params_, Xn), Y, max(ks))
    prop = jain_propensity(model.label_frequency_, n_samples=model.n_train_)
    settings = [(k, w) for k in ks for w in weights] + [(0, 1.0)]
    metrics = {s: TopKMetrics(ks=(1, 3, 5), propensity=prop) for s in settings}
    L = index.n_labels
    rows = max(1, (1 << 24) // max(L, index.n_rows))
    for start in range(0, Xq.shape[0], rows):
        Xc = Xq[start:start + rows]
        H = host_hidden(model.params_, Xc)
        P = network_probabilities(model.params_, H, model.loss_, index.labels_per_row)
        votes = {}
        for k in ks:
            index.k = k
            votes[k] = index.votes(Xc, H)
        for k, w in settings:
            S = np.ascontiguousarray(P if k == 0 else w * P + (1.0 - w) * votes[k],
                                     dtype=np.float32)
            idx = np.empty((S.shape[0], 5), dtype=np.int64)
            val = np.empty((S.shape[0], 5), dtype=np.float32)
            topk.topk_cpu(S, min(5, L), idx, val)
            metrics[(k, w)].update(idx, Yt[start:start + rows])
    return {f"{k},{w:g}": {m: float(v) for m, v in metrics[(k, w)].result().items()
                           if m in METRICS} for k, w in settings}


def variant_scores(model, X, Y, Xt, Yt) -> dict:
    """P@k of the network blended with each form of the vote in :data:`VARIANTS` (and
    ``"network"``: the network alone), at the default network weight: ``{name: {metric:
    value}}``. Every vote is :func:`kernels.neighbours.vote_cpu` over its space's nearest
    rows, as the engine's."""
    from xmc_engine.kernels import neighbours as nk
    from xmc_engine.kernels import topk

    from xmc_engine.config import NEIGHBOURS_NETWORK_WEIGHT
    from xmc_engine.metrics import TopKMetrics, jain_propensity
    from xmc_engine.neighbours import NeighbourIndex, host_hidden, network_probabilities

    Xn, Xq = model._features(X), model._features(Xt)
    index = NeighbourIndex(Xn, host_hidden(model.params_, Xn), Y, 1)
    prop = jain_propensity(model.label_frequency_, n_samples=model.n_train_)
    names = ["network", *VARIANTS]
    metrics = {v: TopKMetrics(ks=(1, 3, 5), propensity=prop) for v in names}
    kmax = min(max(t[2] for terms in VARIANTS.values() for t in terms), index.n_rows)
    w = NEIGHBOURS_NETWORK_WEIGHT
    rows = max(1, (1 << 24) // max(index.n_labels, index.n_rows))
    for start in range(0, Xq.shape[0], rows):
        Xc = Xq[start:start + rows]
        H = host_hidden(model.params_, Xc)
        P = network_probabilities(model.params_, H, model.loss_, index.labels_per_row)
        sims = {"hidden": index.hidden_similarities(H)}
        sims["input"] = index.input_similarities(Xc, out=np.empty_like(sims["hidden"]))
        sims["joint"] = 0.5 * (sims["hidden"] + sims["input"])
        near = {}
        for space, S in sims.items():
            idx = np.empty((S.shape[0], kmax), dtype=np.int64)
            val = np.empty((S.shape[0], kmax), dtype=np.float32)
            topk.topk_cpu(S, kmax, idx, val)
            near[space] = (idx, val)
        for name in names:
            S = np.ascontiguousarray(P, dtype=np.float32) if name == "network" else w * P
            for share, space, k, power in VARIANTS.get(name, ()):
                idx, val = near[space]
                nk.vote_cpu(np.ascontiguousarray(idx[:, :k]), np.ascontiguousarray(val[:, :k]),
                            power, index.Y.indptr, index.Y.indices, (1.0 - w) * share, S)
            top = np.empty((S.shape[0], 5), dtype=np.int64)
            topk.topk_cpu(np.ascontiguousarray(S, dtype=np.float32), min(5, index.n_labels),
                          top, np.empty((S.shape[0], 5), dtype=np.float32))
            metrics[name].update(top, Yt[start:start + rows])
    return {v: {m: float(x) for m, x in metrics[v].result().items() if m in METRICS}
            for v in names}


def run_grid(args, meta) -> int:
    """``--grid`` / ``--variants``: the defaults fitted once per set and seed (votes off),
    every setting scored on the same model."""
    import bench_defaults

    from xmc_engine import XMCClassifier

    rows = []
    for name in args.data:
        X, Y, Xt, Yt = bench_defaults.load_any(name)
        for seed in args.seeds:
            model = XMCClassifier(seed=seed, epochs=args.epochs, eval_every=0,
                                  neighbours=0).fit(X, Y)
            if args.variants:
                scores = variant_scores(model, X, Y, Xt, Yt)
            else:
                scores = grid_scores(model, X, Y, Xt, Yt, args.ks, args.weights)
            rows.append({"data": name, "seed": seed, "loss": model.loss_, "scores": scores})
            print(name, seed, model.loss_, " ".join(
                f"[{s}] {v['P@1']:.4f}/{v['P@5']:.4f}" for s, v in scores.items()), flush=True)
    print("\nmeans over the seeds, P@1 / P@3 / P@5 ("
          + ("the forms of the vote" if args.variants else "k,w; 0,1: the network alone") + ")")
    settings = list(rows[0]["scores"])
    print("| data | loss | " + " | ".join(settings) + " |")
    print("|---|---|" + "---|" * len(settings))
    names = list(dict.fromkeys(r["data"] for r in rows))
    for name in names:
        sel = [r for r in rows if r["data"] == name]
        cells = [" / ".join(f"{np.mean([r['scores'][s][m] for r in sel]):.4f}"
                            for m in ("P@1", "P@3", "P@5")) for s in settings]
        losses = ",".join(sorted({r["loss"] for r in sel}))
        print(f"| {name} | {losses} | " + " | ".join(cells) + " |")
    bce = [n for n in names if all(r["loss"] == "bce" for r in rows if r["data"] == n)]
    print(f"\nmean over the sets whose every seed trained the logistic loss ({', '.join(bce)}):")
    for s in settings:
        means = [np.mean([np.mean([r["scores"][s][m] for r in rows if r["data"] == n])
                          for n in bce]) for m in ("P@1", "P@3", "P@5")]
        print(f"  {s}: P@1 {means[0]:.4f}  P@3 {means[1]:.4f}  P@5 {means[2]:.4f}")
    if args.out:
        _common.write_result(args.out, {**meta, "args": vars(args), "rows": rows})
    return 0


def _scored(model, Xt, Yt) -> tuple[dict, float]:
    t0 = time.perf_counter()
    m = model.evaluate(Xt, Yt)
    return {k: float(m[k]) for k in METRICS}, time.perf_counter() - t0


def main(argv=None) -> int:
    args = parse_args(argv)
    meta = _common.result_metadata(argv=argv)
    if args.grid or args.variants:
        return run_grid(args, meta)
    import bench_defaults

    from xmc_engine import XMCClassifier
    from xmc_engine.config import NEIGHBOURS_K
    from xmc_engine.neighbours import NeighbourIndex, host_hidden

    rows = []
    for name in args.data:
        X, Y, Xt, Yt = bench_defaults.load_any(name)
        for seed in args.seeds:
            t0 = time.perf_counter()
            model = XMCClassifier(**{"seed": seed, "epochs": args.epochs, "eval_every": 0,
                                     **args.params}).fit(X, Y)
            fit_s = time.perf_counter() - t0
            auto = model.neighbours_ is not None
            if not auto:
                t0 = time.perf_counter()
                Xn = model._features(X)
                model.neighbours_ = NeighbourIndex(Xn, host_hidden(model.params_, Xn), Y,
                                                   NEIGHBOURS_K)
                build_s = time.perf_counter() - t0
            else:
                build_s = next(r["seconds"] for r in model.history_
                               if r["event"] == "neighbours")
            blend, blend_s = _scored(model, Xt, Yt)
            index, model.neighbours_ = model.neighbours_, None
            network, network_s = _scored(model, Xt, Yt)
            model.neighbours_ = index
            row = {"data": name, "seed": seed, "loss": model.loss_, "auto": auto,
                   "n_train": X.shape[0], "n_test": Xt.shape[0], "fit_s": fit_s,
                   "build_s": build_s, "network_s": network_s, "blend_s": blend_s,
                   "network": network, "blend": blend}
            rows.append(row)
            print(name, seed, model.loss_, "auto" if auto else "off by default",
                  "network", " ".join(f"{k} {network[k]:.4f}" for k in METRICS),
                  "| blend", " ".join(f"{k} {blend[k]:.4f}" for k in METRICS),
                  f"| rank s {network_s:.2f} / {blend_s:.2f}", flush=True)
    print("\nmeans over the seeds: network alone -> with the votes (difference)")
    print("| data | training rows | loss | votes by default | " + " | ".join(METRICS)
          + " | ranking s: network / blend |")
    print("|---|---:|---|---|" + "---|" * len(METRICS) + "---|")
    for name in dict.fromkeys(r["data"] for r in rows):
        sel = [r for r in rows if r["data"] == name]
        cells = []
        for k in METRICS:
            a = np.mean([r["network"][k] for r in sel])
            b = np.mean([r["blend"][k] for r in sel])
            cells.append(f"{a:.4f} -> {b:.4f} ({b - a:+.4f})")
        losses = ",".join(sorted({r["loss"] for r in sel}))
        on = "yes" if all(r["auto"] for r in sel) else ("no" if not any(r["auto"] for r in sel)
                                                        else "some seeds")
        print(f"| {name} | {sel[0]['n_train']} | {losses} | {on} | " + " | ".join(cells)
              + f" | {np.mean([r['network_s'] for r in sel]):.2f} / "
              f"{np.mean([r['blend_s'] for r in sel]):.2f} |")
    if args.out:
        _common.write_result(args.out, {**meta, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
