"""End-to-end quality bands on small real data (fixed seeds, CI-sized budgets).

The bands come from the issue ("one-device trainer"): P@1 >= 0.60 on bibtex and >= 0.64 on
delicious. Plain SGD on this network plateaus below them (PyTorch, same network: 0.567 / 0.629,
bench/results/torch_*.json); Adagrad reaches them, so these runs use ``optimizer="adagrad"``.
One thread keeps the arithmetic, and so the figures, identical from run to run.
"""

from __future__ import annotations

import pytest

from tests.conftest import real_dataset
from xmc_engine import XMCClassifier

pytestmark = pytest.mark.slow


def _fit(data_dir, name, **kw):
    from xmc_engine.datasets import load_dataset

    real_dataset(data_dir, name)  # skips with a reason when absent
    X, Y, Xt, Yt = load_dataset(str(data_dir / name))
    return XMCClassifier(seed=0, **kw).fit(X, Y, eval_set=(Xt, Yt))


def test_bibtex_band(data_dir):
    m = _fit(data_dir, "bibtex", hidden=1024, batch_size=64, lr=0.02, optimizer="adagrad",
             epochs=7, threads=1, eval_every=0)
    assert m.metrics_["P@1"] >= 0.60, m.metrics_


def test_delicious_band(data_dir):
    m = _fit(data_dir, "delicious", hidden=128, batch_size=128, lr=0.05, optimizer="adagrad",
             epochs=4, threads=1, eval_every=0)
    assert m.metrics_["P@1"] >= 0.64, m.metrics_
    assert m.metrics_["P@5"] >= 0.50, m.metrics_


def test_adaptive_two_devices_reaches_the_band(data_dir):
    """Adaptive SGD on two CPU devices of different speed (issue "Adaptive SGD"): within 0.01
    of the one-device band. Threaded scheduling is not bit-reproducible, so the best of the
    per-epoch evaluations is checked."""
    m = _fit(data_dir, "delicious", hidden=128, batch_size=128, lr=0.05, optimizer="adagrad",
             epochs=6, devices="cpu,cpu@0.5", algorithm="adaptive",
             algorithm_params={"momentum": 0.0, "merge_period": 8192})
    p1 = [r["metrics"]["P@1"] for r in m.history_ if r["event"] == "eval"]
    assert max(p1) >= 0.63, p1
    merges = [r for r in m.history_ if r["event"] == "merge"]
    assert merges and len(merges[-1]["devices"]) == 2


def test_debian_debtags_band(data_dir):
    """tf-idf features (mean squared value 0.021): the band guards ``init_params_for_data``,
    which sizes ``W1`` by the non-zeros per row only. Scaled by the values too, the same run
    ended at P@1 0.759 (napkinXC PLT: 0.847, PECOS XR-Linear: 0.851)."""
    m = _fit(data_dir, "debian_debtags", hidden=256, batch_size=128, lr=0.1,
             optimizer="adagrad", epochs=4, threads=1, eval_every=0)
    assert m.metrics_["P@1"] >= 0.80, m.metrics_
