"""``xmc-engine plan``: the memory plan of a run (argument parsing only; the estimate is
:func:`xmc_engine.memory.plan_memory`). Registered names are planned from their published shape,
without generating or loading the data; files and folders are loaded to count their non-zeros.

Exit status: 0 when the run fits (or a capacity is unknown), 1 when it does not, 2 on bad input.
"""

from __future__ import annotations

import sys

from xmc_engine.cli.argtypes import user_path
from xmc_engine.errors import ConfigError


def register(sub) -> None:
    from xmc_engine.cli.train import add_config_arguments

    p = sub.add_parser("plan", help="estimate the memory a run needs on each device",
                       description="Estimate the memory a training run needs on each device "
                       "and whether it fits; suggests a setting that fits when it does not.")
    p.add_argument("--data", type=user_path, required=True,
                   help="a file, a dataset folder or a registered name (e.g. "
                   "synthetic-amazon670k: planned from its shape, nothing is generated)")
    add_config_arguments(p, ("hidden", "ensemble", "batch_size", "label_chunk", "devices",
                             "algorithm", "eval_every", "optimizer", "output", "negatives"),
                         "b_max=512")
    p.add_argument("--config", type=user_path, default=None,
                   help="read the config from this JSON file")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="memory each pool (host, each GPU) may use, e.g. 8GiB (default: what "
                   "the machine reports, or XMC_MEMORY_BUDGET)")
    p.add_argument("--no-eval", action="store_true", help="plan without a held-out set")
    p.set_defaults(func=cmd_plan)


def _shape(data: str) -> dict:
    """Shape keywords of :func:`plan_memory` for a registered name, a file or a folder."""
    from pathlib import Path

    from xmc_engine.datasets.registry import find_dataset_info, load_dataset

    info = None if Path(data).expanduser().exists() else find_dataset_info(data)
    if info is not None and None not in (info.n_train, info.n_features, info.n_labels,
                                         info.avg_nnz, info.avg_labels):
        n, t = info.n_train, info.n_test or 0
        return {"n_samples": n, "n_features": info.n_features, "n_labels": info.n_labels,
                "nnz": info.avg_nnz * n, "label_nnz": info.avg_labels * n, "n_test": t,
                "test_nnz": info.avg_nnz * t, "test_label_nnz": info.avg_labels * t}
    Xtr, Ytr, Xte, Yte = load_dataset(data)
    kw = {"n_samples": Xtr.shape[0], "n_features": Xtr.shape[1], "n_labels": Ytr.shape[1],
          "nnz": Xtr.nnz, "label_nnz": Ytr.nnz}
    if Xte is not None:
        kw.update(n_test=Xte.shape[0], test_nnz=Xte.nnz, test_label_nnz=Yte.nnz)
    return kw


def cmd_plan(args) -> int:
    from xmc_engine.cli.train import config_from_args
    from xmc_engine.memory import parse_size, plan_memory

    cfg = config_from_args(args)
    budget = None
    if args.memory_budget is not None:
        budget = parse_size(args.memory_budget, source="--memory-budget")
    kw = _shape(args.data)
    if args.no_eval:
        kw.update(n_test=0, test_nnz=0, test_label_nnz=0)
    if kw["n_samples"] < 1 or kw["n_labels"] < 1:
        raise ConfigError(f"--data {args.data!r}: empty data set")
    plan = plan_memory(cfg, budget=budget, **kw)
    print(plan.summary())
    if plan.fits is False:
        print(f"xmc-engine plan: does not fit; try {plan.suggestion_text}", file=sys.stderr)
        return 1
    return 0
