"""Helpers shared by the test modules that run ``python -m xmc_engine`` in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

from xmc_engine.datasets import save_xc

from tests.test_estimator import tiny_data


def cli_argv(*args) -> list[str]:
    """The command line of ``xmc-engine ARGS`` run by this interpreter."""
    return [sys.executable, "-m", "xmc_engine", *map(str, args)]


def cli_env(extra: dict | None = None) -> dict[str, str]:
    """The environment of a CLI subprocess: this one, no progress bars, plus ``extra``."""
    return {**os.environ, "XMC_PROGRESS": "0", **(extra or {})}


def run_cli(*args, cwd=None, env=None, check=True, timeout=600) -> subprocess.CompletedProcess:
    """Run ``xmc-engine ARGS`` to completion (text output captured; ``env`` adds variables).

    With ``check`` a non-zero exit raises ``AssertionError`` with the captured output.
    """
    proc = subprocess.run(cli_argv(*args), cwd=cwd, env=cli_env(env), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\n"
                             f"stderr:\n{proc.stderr}")
    return proc


def write_tiny_xc(d, n: int, n_train: int):
    """``train.txt`` (the first ``n_train`` rows) and ``test.txt`` (the rest) of
    ``tiny_data(n=n)`` in folder ``d``; returns ``d``."""
    X, Y = tiny_data(n=n)
    save_xc(d / "train.txt", X[:n_train], Y[:n_train])
    save_xc(d / "test.txt", X[n_train:], Y[n_train:])
    return d


def script_heldout(monkeypatch, values):
    """Replace what the plateau rule reads (``training.heldout_hits``) by scripted P@1s:
    ``values`` is one P@1 for every call or an iterable of them in turn; a call for P@1 ``p``
    on ``n`` held-out rows returns hits on the first ``round(p n)`` rows, so that two scripted
    models differ on the rows between their counts. Returns ``(calls, models)``: the rows of
    each call and the host copies of the model it saw."""
    import numpy as np

    from xmc_engine import training

    seen = None if isinstance(values, (int, float)) else iter(values)
    calls, models = [], []

    def scripted(be, params, Xh, Yh, **kw):
        calls.append(Xh.shape[0])
        models.append([np.array(be.to_host(p)) for p in params])
        p = values if seen is None else float(next(seen))
        hits = np.zeros(Xh.shape[0], dtype=bool)
        hits[:round(p * Xh.shape[0])] = True
        return hits

    monkeypatch.setattr(training, "heldout_hits", scripted)
    return calls, models


def final_record(history) -> dict:
    """The run's last ``final`` record (a ``neighbours`` record may come after it)."""
    return next(r for r in reversed(history) if r.get("event") == "final")
