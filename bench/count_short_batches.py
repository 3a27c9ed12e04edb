"""How many of a run's rows train in batches shorter than their device's batch.

A batch is short at the end of an epoch and where a merge period's quota cuts a device's batch;
since ``c284c58`` such a batch steps at the rate of its rows (``Policy.batch_lr``), before it at
the device's full rate. This counts, per device, the steps and rows of a run and how many of them
were short, by wrapping the trainer's step (``Trainer._step``), nothing else changed.

    python bench/count_short_batches.py --data synthetic:20000:20000:30000 \\
        --devices cpu,cpu@0.5,cpu@0.25 --epochs 3 --seed 0

Prints a table; ``--out`` also writes it as JSON with the command, commit and machine.
"""

from __future__ import annotations

import argparse
import collections
from unittest import mock

from _common import result_metadata, write_json
from _tta import load_data

#: What :func:`count` tallies per device.
KEYS = ("steps", "rows", "short_steps", "short_rows")


def count(data: str, devices: str, algorithm: str, epochs: float, seed: int,
          **params) -> list[dict]:
    """Per device: steps, rows, short steps, rows in short steps (a run of ``algorithm`` on
    ``devices`` with the engine's defaults otherwise, or ``params``, more
    :class:`~xmc_engine.XMCClassifier` options)."""
    from xmc_engine import XMCClassifier
    from xmc_engine.scheduler.runner import Trainer

    X, Y, _, _ = load_data(data)
    tally = collections.defaultdict(lambda: dict.fromkeys(KEYS, 0))
    step = Trainer._step

    def counting_step(self, i, rows, lr):
        t, short = tally[i], self.is_short(i, len(rows))  # the trainer's own rule
        t["steps"] += 1
        t["rows"] += len(rows)
        t["short_steps"] += short
        t["short_rows"] += len(rows) if short else 0
        return step(self, i, rows, lr)

    with mock.patch.object(Trainer, "_step", counting_step):
        XMCClassifier(algorithm=algorithm, devices=devices, epochs=epochs, seed=seed,
                      continue_probe=False, **params).fit(X, Y)
    return [{"device": i, **t} for i, t in sorted(tally.items())]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="synthetic:20000:20000:30000")
    p.add_argument("--devices", default="cpu,cpu@0.5,cpu@0.25")
    p.add_argument("--algorithm", default="adaptive")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the table as JSON here")
    args = p.parse_args(argv)
    per_device = count(args.data, args.devices, args.algorithm, args.epochs, args.seed)
    print(f"{args.algorithm} on {args.devices}, {args.data}, {args.epochs:g} epochs, "
          f"seed {args.seed}")
    print("| device | steps | rows | short steps | rows in short steps |")
    print("|---:|---:|---:|---:|---:|")
    total = {"device": "all", **{k: sum(r[k] for r in per_device) for k in KEYS}}
    for d in per_device + [total]:
        print(f"| {d['device']} | {d['steps']:,} | {d['rows']:,} | {d['short_steps']:,} "
              f"({d['short_steps'] / max(d['steps'], 1):.1%}) | {d['short_rows']:,} "
              f"({d['short_rows'] / max(d['rows'], 1):.1%}) |")
    if args.out:
        write_json(args.out, {**result_metadata(), "args": vars(args),
                              "per_device": per_device})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
