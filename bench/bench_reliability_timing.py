"""The timing claims behind reliability behaviour, kept out of the test suite (a loaded CI machine
makes wall-clock thresholds flaky; the tests check the behaviour deterministically instead).

* ``fetch`` of an unreachable server fails within its ``--timeout`` (tested: it fails with
  instructions, tests/test_datasets_registry.py).
* a cached ``load_xc`` is at least 10x faster than the first, parsing load (tested: a cache hit
  does not parse, tests/test_datasets_io.py).
* ``fit`` refuses a model that does not fit its memory budget before anything is allocated
  (tested: no run log is started, tests/test_reliability.py).

Prints one line per check with the measured time, the threshold and PASS/FAIL; exits 1 if one
fails. Run: ``python bench/bench_reliability_timing.py [--rows 30000]`` (about 10 s).
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from _common import machine_info
from xmc_engine.datasets import fetch, load_xc, save_xc

from xmc_engine import XMCClassifier
from xmc_engine.errors import FetchError, MemoryPlanError


def time_unreachable_fetch(tmp: Path, timeout: float) -> float:
    with socket.socket() as s:  # a port on 127.0.0.1 that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    try:
        fetch("EURLex-4K", url=f"http://127.0.0.1:{port}/x.zip", dest=tmp / "dl", timeout=timeout)
    except FetchError:
        return time.perf_counter() - t0
    raise AssertionError("fetch from a closed port succeeded")


def time_cache(tmp: Path, rows: int) -> tuple[float, float]:
    """(first load: parse + cache write, best cached load) in seconds."""
    rng = np.random.default_rng(5)
    X = sp.random(rows, 2000, density=0.02, format="csr", dtype=np.float32, random_state=rng)
    Y = sp.random(rows, 300, density=0.01, format="csr", random_state=rng)
    Y.data[:] = 1
    path = save_xc(tmp / "big.txt", X, Y)
    os.environ["XMC_CACHE_DIR"] = str(tmp / "cache")
    load_xc(path, cache=False)  # warm the page cache and the JIT
    t0 = time.perf_counter()
    X1, _ = load_xc(path)
    first = time.perf_counter() - t0
    hits = []
    for _ in range(3):
        t0 = time.perf_counter()
        X2, _ = load_xc(path)
        hits.append(time.perf_counter() - t0)
    assert (X2 != X1).nnz == 0
    return first, min(hits)


def time_memory_refusal() -> float:
    X = sp.random(500, 60, density=0.1, format="csr", dtype=np.float32, random_state=0)
    Y = sp.random(500, 25, density=0.1, format="csr", random_state=0)
    Y.data[:] = 1
    os.environ["XMC_MEMORY_BUDGET"] = "300KiB"
    t0 = time.perf_counter()
    try:
        XMCClassifier(hidden=512, epochs=1).fit(X, Y)
    except MemoryPlanError:
        return time.perf_counter() - t0
    finally:
        del os.environ["XMC_MEMORY_BUDGET"]
    raise AssertionError("fit did not refuse")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=30000, help="rows of the cache benchmark file")
    ap.add_argument("--timeout", type=float, default=2.0, help="fetch timeout (s)")
    args = ap.parse_args()
    info = machine_info()
    print(f"machine: {info['cpu_model']} ({info['usable_cores']} usable cores), load "
          f"{info['loadavg_1_5_15']}")
    failed = 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        t = time_unreachable_fetch(tmp, args.timeout)
        ok = t < args.timeout + 3
        failed += not ok
        print(f"fetch unreachable       {t:7.3f} s   < {args.timeout + 3:.0f} s     "
              f"{'PASS' if ok else 'FAIL'}")
        first, hit = time_cache(tmp, args.rows)
        ok = first / hit >= 10
        failed += not ok
        print(f"cache hit vs first load {hit:7.3f} s vs {first:.3f} s = {first / hit:.1f}x   "
              f">= 10x   {'PASS' if ok else 'FAIL'}")
        t = time_memory_refusal()
        ok = t < 5
        failed += not ok
        print(f"memory-plan refusal     {t:7.3f} s   < 5 s     {'PASS' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
