"""The CUDA kernel tests under numba's CUDA simulator, from the plain ``python -m pytest``.

The simulator must be switched on before numba is imported (``NUMBA_ENABLE_CUDASIM=1``), which
this process has already done without it: so the kernel tests (``tests/test_kernels_cuda.py``,
marker ``cudasim``) run in a child process with the variable set. Under a run that has the
simulator on already (or a GPU) they run directly and this test steps aside.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from xmc_engine.kernels import _cuda

from xmc_engine.backends import cuda_available

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(_cuda.CUDASIM or cuda_available(),
                    reason="the kernel tests run directly in this process (simulator or GPU)")
@pytest.mark.skipif(not _cuda.HAVE_NUMBA_CUDA, reason="numba.cuda does not import here")
def test_cuda_kernels_pass_under_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cudasim", "-p", "no:randomly",
           "-p", "no:cacheprovider", "tests/test_kernels_cuda.py", "tests/test_sampled_output.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) > 0, tail
    assert not re.search(r"\d+ (failed|error)", proc.stdout), tail
