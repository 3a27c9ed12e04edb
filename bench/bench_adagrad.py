"""The Adagrad kernels in IEEE float32 against the same kernels compiled with ``fastmath``.

The engine's CPU Adagrad kernels (``kernels/adagrad.py``, ``kernels/sampled_output.py``) are
compiled without ``fastmath``, so that every loop layout rounds each entry as the float32
formula does. This bench builds a ``fastmath`` twin of each from the same rule
(``kernels/adagrad.py: _adagrad_entry``) and times both in the same run, on the three
updates a default fit makes at a given label count:

* ``dense``: the whole ``W2`` (``hidden x labels``), the exact output layer's update;
* ``rows``: the ``W1`` rows of one batch's features (row-sparse);
* ``columns``: the sampled output layer's candidate columns of ``W2`` (column-sparse), in the
  C order and the label-major order of ``W2``.

It also counts, per variant, the entries that differ from the float32 formula evaluated by
NumPy (``w - lr * g / (sqrt(acc + g * g) + eps)``, in that order).

Usage::

    python bench/bench_adagrad.py                       # hidden 128, 670,091 labels
    python bench/bench_adagrad.py --labels 20837 --repeats 9

Results: ``bench/results/adagrad_ieee.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

F32 = np.float32


def fastmath_twins():
    """``fastmath=True`` builds of the engine's three CPU Adagrad kernels: their own Python
    functions (``py_func``) compiled again with that one flag changed. The rule they inline,
    ``adagrad_entry_cpu``, then compiles with the ``fastmath`` flags too, as it did before."""
    from numba import njit
    from xmc_engine.kernels import adagrad, sampled_output

    def fast(kernel):
        return njit(nogil=True, parallel=True, fastmath=True)(kernel.py_func)

    return {"dense": fast(adagrad.adagrad_dense_cpu), "rows": fast(adagrad.adagrad_rows_cpu),
            "columns": fast(sampled_output.adagrad_columns_cpu)}


def formula(w, acc, g, lr, eps):
    """The rule in float32 by NumPy, in the formula's order: the new ``w``."""
    return w - F32(lr) * g / (np.sqrt(acc + g * g) + F32(eps))


def run(hidden: int, n_labels: int, n_features: int, batch_rows: int, n_cols: int,
        repeats: int, lr: float = 0.05, eps: float = 1e-10) -> list[dict]:
    from xmc_engine.kernels import adagrad, sampled_output

    rng = np.random.default_rng(0)
    twins = fastmath_twins()
    W2 = rng.standard_normal((hidden, n_labels)).astype(F32)
    acc2 = rng.random((hidden, n_labels)).astype(F32)
    g2 = rng.standard_normal((hidden, n_labels)).astype(F32)
    W1 = rng.standard_normal((n_features, hidden)).astype(F32)
    acc1 = rng.random((n_features, hidden)).astype(F32)
    rows = np.unique(rng.integers(0, n_features, batch_rows)).astype(np.int64)
    g1 = rng.standard_normal((rows.size, hidden)).astype(F32)
    b2 = rng.standard_normal(n_labels).astype(F32)
    accb = rng.random(n_labels).astype(F32)
    cols = np.unique(rng.integers(0, n_labels, n_cols)).astype(np.int64)
    gs = rng.standard_normal((hidden, cols.size)).astype(F32)
    gb = rng.standard_normal(cols.size).astype(F32)

    cases = {  # name: (engine kernel, fastmath twin, fresh arguments, (updated array, formula))
        "dense": (adagrad.adagrad_dense_cpu, twins["dense"],
                  lambda: (W2.copy(), g2, acc2.copy(), lr, eps),
                  lambda a: (a[0], formula(W2, acc2, g2, lr, eps))),
        "rows": (adagrad.adagrad_rows_cpu, twins["rows"],
                 lambda: (W1.copy(), rows, g1, acc1.copy(), lr, eps),
                 lambda a: (a[0][rows], formula(W1[rows], acc1[rows], g1, lr, eps))),
    }
    for order in ("C", "F"):
        cases[f"columns ({'label-major' if order == 'F' else 'C order'})"] = (
            sampled_output.adagrad_columns_cpu, twins["columns"],
            lambda o=order: (np.array(W2, order=o), b2.copy(), np.array(acc2, order=o),
                             accb.copy(), cols, gs, gb, lr, eps),
            lambda a: (a[0][:, cols], formula(W2[:, cols], acc2[:, cols], gs, lr, eps)))
    out = []
    for name, (ieee, fast, fresh, check) in cases.items():
        row = {"update": name, "hidden": hidden, "labels": n_labels,
               "entries": int(check(fresh())[1].size)}
        for variant, fn in (("ieee", ieee), ("fastmath", fast)):
            args = fresh()
            fn(*args)  # compiles, and the entries to check
            got, want = check(args)
            row[f"{variant}_differ"] = int((got != want).sum())
            secs = []
            for _ in range(repeats):
                args = fresh()
                secs.extend(_common.timings(lambda a=args, f=fn: f(*a), 1, warmup=0))
            row[f"{variant}_ms"] = 1e3 * float(np.median(secs))
        row["fastmath_over_ieee"] = row["fastmath_ms"] / row["ieee_ms"]
        out.append(row)
        print(f"{name:26s} {row['entries']:>11,} entries  IEEE {row['ieee_ms']:8.3f} ms "
              f"(differ {row['ieee_differ']:,})  fastmath {row['fastmath_ms']:8.3f} ms (differ "
              f"{row['fastmath_differ']:,})  fastmath / IEEE {row['fastmath_over_ieee']:.2f}",
              flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--labels", type=int, default=670_091)
    p.add_argument("--features", type=int, default=135_909)
    p.add_argument("--batch-rows", type=int, default=8_000,
                   help="feature rows drawn for the row-sparse update (unique ones kept)")
    p.add_argument("--columns", type=int, default=2_048,
                   help="candidate columns drawn for the column-sparse update")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "adagrad_ieee.json"))
    args = p.parse_args(argv)
    rows = run(args.hidden, args.labels, args.features, args.batch_rows, args.columns,
               args.repeats)
    path = _common.write_result(args.out, {**_common.result_metadata(), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
