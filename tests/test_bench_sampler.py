"""bench/_sampler.py: the stack sampler the GPU check uses to say where a fit's time goes."""

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _sampler import StackSampler  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _outer(seconds: float) -> None:
    _spin(seconds)


def test_it_sees_a_busy_worker_thread_and_attributes_self_and_total():
    with StackSampler(interval_s=0.002) as s:
        t = threading.Thread(target=_outer, args=(0.3,))
        t.start()
        t.join()
    r = s.report(top=50)
    assert r["ticks"] > 20 and r["samples"] >= r["ticks"]
    self_ = {x["function"]: x for x in r["self"]}
    total = {x["function"]: x for x in r["total"]}
    spin = "tests/test_bench_sampler.py:_spin"
    outer = "tests/test_bench_sampler.py:_outer"
    # the worker spent its life in _spin (called from _outer): self there, total in both
    assert self_[spin]["samples"] > 10
    assert outer not in self_ or self_[outer]["samples"] < self_[spin]["samples"] / 5
    assert total[outer]["samples"] >= self_[spin]["samples"]
    assert 0.0 < total[outer]["share"] <= 1.0


def test_project_only_keeps_the_projects_frames():
    with StackSampler(interval_s=0.002) as s:
        _spin(0.05)  # the main thread is sampled too (only the sampler's own is skipped)
    spin = "tests/test_bench_sampler.py:_spin"  # tests/ is not one of the project's folders
    assert spin in {x["function"] for x in s.report()["self"]}
    kept = s.report(project_only=True)
    assert spin not in {x["function"] for x in kept["self"] + kept["total"]}
    assert all(x["function"].split("/")[0] in ("xmc_engine", "kernels", "bench")
               for x in kept["self"] + kept["total"])


def test_bad_interval_and_double_start_are_refused():
    with pytest.raises(ValueError, match="interval_s"):
        StackSampler(interval_s=0)
    s = StackSampler().start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            s.start()
    finally:
        s.stop()
    s.stop()  # a second stop is harmless
