"""Adaptive SGD on heterogeneous devices: time to a target P@1 against model averaging and one
device (issue "Adaptive SGD across heterogeneous devices"; DESIGN.md §3-4).

Heterogeneity is emulated: a device ``cpu@0.5`` idles for as long as it computed after each
step (DESIGN.md §3). Each CPU device gets one thread, so the run fits on two cores.

    python bench/bench_heterogeneous.py --data delicious --epochs 8 --seeds 0 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, result_metadata, write_result  # noqa: E402
from _tta import (  # noqa: E402
    Method,
    data_tag,
    load_data,
    plot_curves,
    print_table,
    run_method,
    summarise,
)

SETUPS = {
    "2dev": "cpu,cpu@0.5",
    "3dev": "cpu,cpu@0.5,cpu@0.25",
}


def methods_for(devices: str, boost_ablation: bool, ablation: bool) -> list[Method]:
    ms = [
        Method("adaptive (step rule)", "adaptive", devices, {"rule": "step"}),
        Method("adaptive (proportional rule)", "adaptive", devices, {"rule": "proportional"}),
        Method("average", "average", devices),
        Method("single (fastest device)", "single", "cpu", threads=1),
    ]
    if boost_ablation:
        ms.insert(2, Method("adaptive (step, no boost)", "adaptive", devices,
                            {"rule": "step", "boost": False}))
    if ablation:  # the values the paper did not publish: momentum mu and merge period S
        for mu in (0.0, 0.9):
            ms.append(Method(f"adaptive (step, mu={mu})", "adaptive", devices,
                             {"rule": "step", "momentum": mu}))
        for S in (2048, 32768):
            ms.append(Method(f"adaptive (step, S={S})", "adaptive", devices,
                             {"rule": "step", "merge_period": S}))
    return ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", action="append", help="dataset name or path (repeatable; "
                    "default delicious)")
    ap.add_argument("--setup", action="append", choices=sorted(SETUPS),
                    help="device setups (default both)")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--lr", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--merge-period", type=int, default=None)
    ap.add_argument("--boost-ablation", action="store_true",
                    help="also run adaptive without adaptive normalization")
    ap.add_argument("--ablation", action="store_true",
                    help="also run adaptive with momentum 0 / 0.9 and merge period 2048 / 32768")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adagrad"])
    ap.add_argument("--out", default=str(RESULTS_DIR / "heterogeneous"))
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {**result_metadata(), "args": vars(args), "datasets": {}}
    for name in args.data or ["delicious"]:
        data = load_data(name)
        if data[2] is None:
            raise SystemExit(f"{name}: needs a test split")
        tag = data_tag(name)
        results["datasets"][tag] = {}
        for setup in args.setup or sorted(SETUPS):
            runs = []
            for m in methods_for(SETUPS[setup], args.boost_ablation, args.ablation):
                if args.merge_period and m.algorithm != "single" and "merge_period" not in m.params:
                    m.params = {**m.params, "merge_period": args.merge_period}
                for seed in args.seeds:
                    r = run_method(m, data, epochs=args.epochs, lr=args.lr,
                                   batch_size=args.batch_size, hidden=args.hidden, seed=seed,
                                   optimizer=args.optimizer)
                    print(f"{tag} {setup} {m.label:30s} seed {seed}: final P@1 "
                          f"{r['final']['P@1']:.4f} train {r['curve'][-1][0]:.1f} s "
                          f"batches {[d['batch_size'] for d in r['last_period']]}", flush=True)
                    runs.append(r)
            summary = summarise(runs, reference="adaptive (step rule)")
            print_table(summary, reference="adaptive (step rule)",
                        title=f"{tag} {setup} ({SETUPS[setup]})")
            png = out / f"{tag}_{setup}.png"
            plot_curves(runs, png, title=f"{tag}: {SETUPS[setup]}")
            results["datasets"][tag][setup] = {"devices": SETUPS[setup], "summary": summary,
                                               "runs": runs, "plot": png.name}
            write_result(out / "heterogeneous.json", results)
    print(f"\nwrote {out / 'heterogeneous.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
