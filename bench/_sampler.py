"""A small in-process sampling profiler for the benchmarks: where a run's threads spend wall time.

Every ``interval_s`` a daemon thread reads the stack of every other thread
(``sys._current_frames``) and counts, per function:

- ``self``: samples in which the function is the innermost frame of a thread (where that thread
  is right now: in Python code, or in a C call made from it such as a CuPy launch or a stream
  synchronisation, which the innermost Python frame stands for);
- ``total``: samples in which the function is anywhere on a thread's stack (once per sample and
  thread, so recursion does not count twice);
- ``project_self``: the innermost frame of the project's own code, with its line
  (``folder/file.py:function:line``): which engine line each thread was on, whatever it called.

It sees every thread (``cProfile`` sees only the one that enabled it, and the engine trains in
worker threads), needs no tool on the machine (``py-spy`` needs ptrace and a download) and costs
one stack walk per thread per interval. Idle threads count too: a worker waiting on its queue
shows up as ``wait`` in ``threading.py``; read the engine's own functions (``project_only``).

    with StackSampler() as s:
        clf.fit(X, Y)
    s.report(top=20)   # {"samples": ..., "interval_s": ..., "self": [...], "total": [...]}
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

_ROOTS = {Path(os.path.abspath(__file__)).parents[1], Path(__file__).resolve().parents[1]}
#: the folders of this checkout that hold the project's own code (the engine, its kernels, the
#: benches), as written and with links resolved; a folder of the same name elsewhere (numba's
#: ``cuda/kernels``) is not the project's
PROJECT_DIRS = tuple(str(r / d) + os.sep for r in _ROOTS
                     for d in ("xmc_engine", "kernels", "bench"))


def _name(code) -> str:
    """``file.py:function`` with the file's parent folder (``model.py`` alone is ambiguous)."""
    p = Path(code.co_filename)
    return f"{p.parent.name}/{p.name}:{code.co_name}"


@functools.cache
def _is_project_file(filename: str) -> bool:
    return filename.startswith(PROJECT_DIRS)


class StackSampler:
    """Sample every other thread's stack each ``interval_s`` seconds while in use (a context
    manager, or :meth:`start` / :meth:`stop`)."""

    def __init__(self, interval_s: float = 1e-3):
        if interval_s <= 0:
            raise ValueError(f"StackSampler: interval_s must be > 0, got {interval_s}")
        self.interval_s = float(interval_s)
        self.samples = 0           # thread stacks read
        self.ticks = 0             # sampling rounds
        self.self_counts: Counter = Counter()
        self.total_counts: Counter = Counter()
        self.project_self: Counter = Counter()  # innermost project frame of each stack
        self._project_names: set[str] = set()   # the names of the project's functions seen
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.seconds = 0.0

    def _run(self) -> None:
        me = threading.get_ident()
        t0 = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            self.ticks += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                self.samples += 1
                self.self_counts[_name(frame.f_code)] += 1
                seen, inner_project = set(), None
                f = frame
                while f is not None:
                    code = f.f_code
                    name = _name(code)
                    if _is_project_file(code.co_filename):
                        self._project_names.add(name)
                        if inner_project is None:
                            inner_project = f"{name}:{f.f_lineno}"
                    seen.add(name)
                    f = f.f_back
                self.total_counts.update(seen)
                if inner_project is not None:
                    self.project_self[inner_project] += 1
        self.seconds = time.perf_counter() - t0

    def start(self) -> StackSampler:
        if self._thread is not None:
            raise RuntimeError("StackSampler: already started")
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None

    def __enter__(self) -> StackSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def report(self, top: int = 20, *, project_only: bool = False) -> dict:
        """The ``top`` functions by ``self`` and by ``total`` samples (each with its share of
        the sampling rounds, i.e. of wall time for one busy thread), and by innermost project
        frame and line (``project_self``: which engine line each stack was on, whatever it
        called; a worker blocked on its queue counts at the line of the ``get``)."""
        def rows(counter: Counter, only: bool) -> list[dict]:
            items = [(k, v) for k, v in counter.items()
                     if not only or k in self._project_names]
            items.sort(key=lambda kv: -kv[1])
            return [{"function": k, "samples": v, "share": v / max(self.ticks, 1)}
                    for k, v in items[:top]]

        return {"interval_s": self.interval_s, "seconds": round(self.seconds, 3),
                "ticks": self.ticks, "samples": self.samples,
                "self": rows(self.self_counts, project_only),
                "total": rows(self.total_counts, project_only),
                "project_self": rows(self.project_self, False)}
