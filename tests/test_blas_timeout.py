"""``import xmc_engine`` stops OpenBLAS's workers spinning after each call, also where NumPy
was imported first (``xmc_engine._env.apply_blas_defaults``).

Each check runs in a child process, whose import order and environment it controls: this
process imported the engine long ago.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from xmc_engine import _env

#: The child: NumPy and SciPy's BLAS first, one threaded sgemm through each (their OpenBLAS
#: copies start their worker pools), the CPU time the process burns while its main thread
#: sleeps; then ``import xmc_engine`` and the same again.
_CHILD = r"""
import json, time
import numpy as np
from scipy.linalg import blas

def idle_cpu():
    a = np.ones((700, 700), np.float32)
    a @ a
    blas.sgemm(1.0, a, a)
    t0 = time.process_time()
    time.sleep(0.4)
    return time.process_time() - t0

before = idle_cpu()
import xmc_engine
from xmc_engine import _env
after = idle_cpu()
print(json.dumps({"before": before, "after": after, "timeouts": _env.openblas_timeouts()}))
"""


def _child(env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    env.update({"OPENBLAS_NUM_THREADS": "2", **env_extra})
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.skipif(
    not _env.loaded_openblas() or (os.cpu_count() or 1) < 2,
    reason="needs NumPy on OpenBLAS, on Linux (/proc/self/maps), and two cores for its workers")


def test_numpy_first_gets_the_short_timeout():
    r = _child({})
    # NumPy's and SciPy's copies were both loaded before the engine, and both were reset
    assert len(r["timeouts"]) >= 2 and set(r["timeouts"]) == {4}, r
    # before: OpenBLAS's default, workers spin ~2^28 cycles (~0.1 s) after each of the two
    # calls; after: they sleep at once
    assert r["before"] > 0.05, r
    assert r["after"] < 0.02, r


def test_a_timeout_the_user_set_is_kept():
    # 0: OpenBLAS's own default (spin); the engine must not override what the user chose
    r = _child({"OPENBLAS_THREAD_TIMEOUT": "0"})
    assert len(r["timeouts"]) >= 2 and set(r["timeouts"]) == {0}, r
    assert r["after"] > 0.05, r
