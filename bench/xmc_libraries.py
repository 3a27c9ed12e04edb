"""XMC libraries users already pick (napkinXC PLT, PECOS XR-Linear), timed and scored on the same
data, machine and metrics as the engine (DESIGN.md §4 "Baselines", §5).

For every (library, dataset) the script measures training time (``fit``, including tree
building), prediction time (top-5 for the full test set) and P@1/3/5, nDCG@1/3/5 with the project's
:class:`xmc_engine.metrics.TopKMetrics`, prints one line each and writes
``bench/results/xmc_libraries.json`` with the command, git commit and machine. With
``--engine-epochs E`` the engine trains beside them with its defaults (``XMCClassifier(epochs=E)``,
nothing else set) and each line is followed by its P@k over each library's, e.g.::

    python bench/xmc_libraries.py --library napkinxc --data bibtex --data delicious \
        --data debian_debtags --data debian_builddeps --engine-epochs 5 \
        --out bench/results/xmc_libraries_engine_defaults.json

``--engine-params JSON`` (repeatable) adds an engine run per JSON object of
:class:`xmc_engine.XMCClassifier` parameters set on top of the defaults (e.g. ``'{"hidden":
[256]}'``), and ``--engine-seeds`` repeats every engine run with more seeds.

PECOS (``libpecos``) pins NumPy < 2, so it lives in its own virtualenv (``--pecos-python``,
default ``/work/pecos-venv/bin/python`` when it exists). This file doubles as the PECOS worker:
the main process writes the split as SciPy ``.npz`` files (read back with ``allow_pickle=False``)
into a temporary folder and runs ``<pecos-python> xmc_libraries.py --pecos-worker DIR``, which
writes the top-k ids (``.npy``) and its timings (JSON) there. Nothing read from disk is unpickled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

DEFAULT_DATA = ("delicious", "bibtex", "debian_debtags")
DEFAULT_PECOS_PYTHON = "/work/pecos-venv/bin/python"
TOP_K = 5


def _score(top: np.ndarray, Y_test) -> dict:
    from xmc_engine.metrics import TopKMetrics

    m = TopKMetrics(ks=(1, 3, 5))
    m.update(top, Y_test)
    return {k: float(v) for k, v in m.result().items() if k.startswith(("P@", "nDCG@"))}


def _pad_topk(pred, k: int) -> np.ndarray:
    """Lists of label ids (or of ``(id, score)`` pairs) -> (n, k) int64, ``-1`` padding."""
    out = np.full((len(pred), k), -1, dtype=np.int64)
    for i, row in enumerate(pred):
        ids = [int(r[0]) if isinstance(r, (tuple, list)) else int(r) for r in row[:k]]
        out[i, :len(ids)] = ids
    return out


# -- napkinXC -------------------------------------------------------------------------------------

def run_napkinxc_plt(X, Y, X_test, Y_test, *, threads: int = 2, seed: int = 0) -> dict:
    """napkinXC PLT with its defaults (hierarchical k-means tree, arity 2, liblinear, log loss).

    ``napkinxc.models.PLT(output=dir)`` writes its model to ``dir`` (a temporary folder here).
    Returns ``{"train_time", "predict_time", "P@1", ..., "config"}``.
    """
    try:
        import napkinxc
        from napkinxc.models import PLT
    except ImportError as e:
        raise _common.SkipBenchmark(f"napkinXC is not installed ({e}); pip install napkinxc") from e
    X = X.astype(np.float32).tocsr()
    X_test = X_test.astype(np.float32).tocsr()
    with tempfile.TemporaryDirectory(prefix="napkinxc_plt_") as out:
        cfg = {"threads": threads, "seed": seed}
        model = PLT(out, **cfg)
        t0, c0 = time.perf_counter(), time.process_time()
        model.fit(X, Y.tocsr())
        train_time, train_cpu = time.perf_counter() - t0, time.process_time() - c0
        t0 = time.perf_counter()
        pred = model.predict(X_test, top_k=TOP_K)
        predict_time = time.perf_counter() - t0
    res = {"library": "napkinxc", "model": "PLT",
           "version": getattr(napkinxc, "__version__", None) or _common.library_versions(
               ["napkinxc"])["napkinxc"],
           "config": dict(cfg, defaults="tree_type=hierarchicalKmeans, arity=2, "
                                        "optimizer=liblinear, loss=log, norm=True, bias=1.0"),
           "train_time": train_time, "train_cpu_time": train_cpu, "predict_time": predict_time}
    res.update(_score(_pad_topk(pred, TOP_K), Y_test))
    return res


# -- PECOS ----------------------------------------------------------------------------------------

def run_pecos_xrlinear(X, Y, X_test, Y_test, *, pecos_python: str, threads: int = 2,
                       seed: int = 0, timeout: float = 1800) -> dict:
    """PECOS XR-Linear (PIFA label embedding, hierarchical k-means indexer, default solver),
    run in ``pecos_python`` (its own venv) through :func:`pecos_worker`."""
    import scipy.sparse as sp

    py = Path(pecos_python) if pecos_python else None
    if py is None or not py.exists():
        raise _common.SkipBenchmark(
            f"PECOS python {pecos_python!r} not found; create it with `python3 -m venv "
            f"/work/pecos-venv && /work/pecos-venv/bin/pip install torch==2.13.0 libpecos` "
            f"and pass --pecos-python /work/pecos-venv/bin/python")
    with tempfile.TemporaryDirectory(prefix="pecos_xrl_") as d:
        for name, M in (("X_train", X), ("Y_train", Y), ("X_test", X_test)):
            sp.save_npz(Path(d) / f"{name}.npz", sp.csr_matrix(M, dtype=np.float32),
                        compressed=False)
        cmd = [str(py), str(Path(__file__).resolve()), "--pecos-worker", d,
               "--threads", str(threads), "--seed", str(seed)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        res_path = Path(d) / "result.json"
        if proc.returncode != 0 or not res_path.exists():
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            raise _common.SkipBenchmark(
                f"PECOS worker failed (exit {proc.returncode}): " + " | ".join(tail))
        res = _common.read_json(res_path)
        top = np.load(Path(d) / "top.npy", allow_pickle=False)
    res.update(_score(top, Y_test))
    return res


def pecos_worker(folder: str, threads: int, seed: int) -> int:
    """Run inside the PECOS venv: train XR-Linear on ``folder``'s split, write its top-k ids."""
    from importlib import metadata

    import scipy.sparse as sp
    from pecos.xmc import Indexer, LabelEmbeddingFactory
    from pecos.xmc.xlinear.model import XLinearModel

    d = Path(folder)
    X = sp.load_npz(d / "X_train.npz").tocsr().astype(np.float32)
    Y = sp.load_npz(d / "Y_train.npz").tocsr().astype(np.float32)
    X_test = sp.load_npz(d / "X_test.npz").tocsr().astype(np.float32)
    # XR-Linear expects L2-normalised (tf-idf-like) rows, as in its published pipelines.
    X, X_test = _l2_rows(X), _l2_rows(X_test)
    X.sort_indices()  # column order; NOT pecos smat_util.sorted_csr, which orders by value
    X_test.sort_indices()
    t0, c0 = time.perf_counter(), time.process_time()
    label_feat = LabelEmbeddingFactory.create(Y, X, method="pifa")
    chain = Indexer.gen(label_feat, indexer_type="hierarchicalkmeans", seed=seed,
                        threads=threads)
    model = XLinearModel.train(X, Y, C=chain, threads=threads)
    train_time, train_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    P = model.predict(X_test, only_topk=TOP_K, threads=threads).tocsr()
    predict_time = time.perf_counter() - t0
    top = np.full((P.shape[0], TOP_K), -1, dtype=np.int64)
    for i in range(P.shape[0]):
        a, b = P.indptr[i], P.indptr[i + 1]
        order = np.argsort(-P.data[a:b], kind="stable")[:TOP_K]
        top[i, :len(order)] = P.indices[a:b][order]
    np.save(d / "top.npy", top, allow_pickle=False)
    res = {"library": "pecos", "model": "XR-Linear", "version": metadata.version("libpecos"),
           "config": {"threads": threads, "seed": seed, "label_embedding": "pifa",
                      "indexer": "hierarchicalkmeans (defaults)", "solver": "defaults",
                      "beam_size": "default", "features": "L2-normalised rows",
                      "numpy": np.__version__, "python": sys.executable},
           "train_time": train_time, "train_cpu_time": train_cpu, "predict_time": predict_time}
    with open(d / "result.json", "w", encoding="utf-8") as f:
        json.dump(res, f)
    return 0


def _l2_rows(X):
    norms = np.sqrt(np.asarray(X.multiply(X).sum(axis=1)).ravel())
    norms[norms == 0] = 1.0
    X = X.copy()
    X.data /= np.repeat(norms, np.diff(X.indptr)).astype(X.dtype)
    return X


# -- CLI ------------------------------------------------------------------------------------------

def run_engine_defaults(X, Y, X_test, Y_test, *, epochs: float, seed: int = 0,
                        params: dict | None = None) -> dict:
    """The engine as a user gets it (``XMCClassifier(epochs=, seed=)``, nothing else set, or
    ``params`` set on top, ``epochs`` included), in the libraries' record format; kernels are
    compiled (or loaded) outside ``train_time``, and so is ``loss="auto"``'s probe but the
    fit the run went on from (``loss_probe_s``, :func:`_common.probe_seconds`; ``wall_s`` holds
    all)."""
    from xmc_engine import XMCClassifier

    kwargs = {"epochs": epochs, "seed": seed, "eval_every": 0, **(params or {})}
    clf = XMCClassifier(**kwargs)
    t0, c0 = time.perf_counter(), time.process_time()
    clf.fit(X, Y)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    final = _common.final_record(clf.history_)
    compile_s = _common.event_seconds(clf.history_, "compile")
    probe_s = _common.probe_seconds(clf.history_)
    t0 = time.perf_counter()
    top = clf.predict_topk(X_test, TOP_K)[0]
    predict = time.perf_counter() - t0
    model = json.dumps(params, separators=(",", ":")) if params else "defaults"
    return {"library": "xmc-engine", "model": model, "seed": seed,
            "train_time": final["train_time"],
            "wall_s": wall, "train_cpu_time": cpu, "predict_time": predict,
            "compile_s": compile_s, "loss": clf.loss_, "loss_probe_s": probe_s,
            "epochs": kwargs["epochs"], **_score(top, Y_test)}


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (separate from the work they trigger)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", action="append", default=None,
                   help=f"dataset name (repeatable; default {', '.join(DEFAULT_DATA)})")
    p.add_argument("--library", action="append", choices=("napkinxc", "pecos"), default=None,
                   help="libraries to run (repeatable; default both)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pecos-python", default=DEFAULT_PECOS_PYTHON,
                   help="python of a venv with libpecos (NumPy < 2), run as a subprocess")
    p.add_argument("--engine-epochs", type=float, default=None, metavar="E",
                   help="also train the engine with its defaults for E epochs on each dataset "
                   "(XMCClassifier(epochs=E, seed=--seed), nothing else set) and print its "
                   "P@k over each library's")
    p.add_argument("--engine-params", action="append", type=_json_object, default=None,
                   metavar="JSON", help="with --engine-epochs: also train the engine with these "
                   "XMCClassifier parameters set (a JSON object; repeatable)")
    p.add_argument("--engine-seeds", type=int, nargs="+", default=None, metavar="S",
                   help="with --engine-epochs: seeds of every engine run (default: --seed)")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "xmc_libraries.json"))
    p.add_argument("--pecos-worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _line(r: dict) -> str:
    return (f"{r['library']:9s} {r['model']:9s} {r['dataset']:15s} train {r['train_time']:8.2f}s"
            f" (cpu {r['train_cpu_time']:7.2f}s)  predict {r['predict_time']:6.2f}s"
            f"  P@1 {r['P@1']:.4f}  P@3 {r['P@3']:.4f}  P@5 {r['P@5']:.4f}")


def main(argv=None) -> int:
    """Run every (library, dataset) pair, print one line each, write the JSON results."""
    args = parse_args(argv)
    if args.pecos_worker:
        return pecos_worker(args.pecos_worker, args.threads, args.seed)
    meta = _common.result_metadata(machine_extra={"threads": args.threads})
    libs = args.library or ["napkinxc", "pecos"]
    results, skipped = [], []
    for name in args.data or list(DEFAULT_DATA):
        try:
            X, Y, X_test, Y_test = _common.load_dataset(name)
        except _common.SkipBenchmark as e:
            print(f"SKIP {name}: {e}")
            skipped.append({"dataset": name, "reason": str(e)})
            continue
        for lib in libs:
            try:
                if lib == "napkinxc":
                    r = run_napkinxc_plt(X, Y, X_test, Y_test, threads=args.threads,
                                         seed=args.seed)
                else:
                    r = run_pecos_xrlinear(X, Y, X_test, Y_test, threads=args.threads,
                                           seed=args.seed, pecos_python=args.pecos_python)
            except _common.SkipBenchmark as e:
                print(f"SKIP {lib} on {name}: {e}")
                skipped.append({"dataset": name, "library": lib, "reason": str(e)})
                continue
            r = {"dataset": name, **r, "n_train": X.shape[0], "n_test": X_test.shape[0]}
            print(_line(r), flush=True)
            results.append(r)
        if args.engine_epochs:
            libraries = [x for x in results if x["dataset"] == name]
            for params in [None, *(args.engine_params or [])]:
                for seed in args.engine_seeds or [args.seed]:
                    e = run_engine_defaults(X, Y, X_test, Y_test, epochs=args.engine_epochs,
                                            seed=seed, params=params)
                    e = {"dataset": name, **e, "n_train": X.shape[0],
                         "n_test": X_test.shape[0]}
                    print(_line(e) + f"  seed {seed}", flush=True)
                    for r in libraries:
                        print(f"  engine / {r['library']}: " + ", ".join(
                            f"P@{k} {e[f'P@{k}'] / r[f'P@{k}']:.3f}" for k in (1, 3, 5)),
                            flush=True)
                    results.append(e)
    payload = {**meta, "benchmark": "xmc_libraries",
               "peak_rss_mib": _common.peak_rss_mib(),
               "peak_rss_mib_children": _common.peak_rss_mib(children=True),
               "results": results, "skipped": skipped}
    _common.write_result(args.out, payload)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
