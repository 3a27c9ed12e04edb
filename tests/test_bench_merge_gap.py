"""``bench/bench_merge_gap.py`` (issue 15's merge diagnostic) end to end on a generated shape:
one record per merge of ``adaptive``, the merged model's P@1 is that of the model the run
returns after the last merge, the engine's policy registry is left as it was, and each
``--lr-decay`` value reaches the engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

pytestmark = pytest.mark.slow


def test_merge_gap_records_every_merge(tmp_path, capsys):
    import bench_merge_gap

    from xmc_engine.algorithms import POLICIES, AdaptiveSGD

    out = tmp_path / "gap.json"
    argv = ["--data", "synthetic:1500:400:60", "--devices", "cpu,cpu@0.5", "--epochs", "2",
            "--seeds", "0", "--lr-decay", "auto", "0.5", "--probe-rows", "200",
            "--out", str(out)]
    assert bench_merge_gap.main(argv) == 0
    assert POLICIES["adaptive"] is AdaptiveSGD
    results = json.loads(out.read_text())["results"]
    assert [r["lr_decay"] for r in results] == ["auto", 0.5]
    assert results[1]["runs"][0]["lr_decay_used"] == 0.5
    for res in results:
        run = res["runs"][0]
        merges = run["merges"]
        assert {m["epoch"] for m in merges} == {0, 1}
        for m in merges:
            assert len(m["replicas"]) == 2 and sum(m["weights"]) == pytest.approx(1.0)
            assert all(0.0 <= v <= 1.0 for v in (*m["replicas"], m["merged"]))
        # the run's final model is the centre of its last merge
        assert run["final_P@1"] == pytest.approx(merges[-1]["merged"])
        assert [row["epoch"] for row in res["summary"]] == [0, 1]
    assert "merged-fast" in capsys.readouterr().out


def test_gaps_arithmetic():
    from bench_merge_gap import gaps

    g = gaps({"replicas": [0.5, 0.6], "weights": [0.75, 0.25], "merged": 0.55})
    assert g["gap_best"] == pytest.approx(-0.05)
    assert g["gap_fast"] == pytest.approx(0.05)  # the replica with weight 0.75 is the first
    assert g["gap_mean"] == pytest.approx(0.55 - (0.375 + 0.15))


def test_probe_rows_are_normalised_as_in_training():
    """On rows that are not unit length the probe sees them as the replicas do (normalised as
    in training): the last merge's P@1 is the fitted model's ``score`` on the same rows."""
    from types import SimpleNamespace

    import _tta
    import bench_merge_gap
    import numpy as np
    import scipy.sparse as sp

    Xtr, Ytr, Xte, Yte = _tta.load_data("synthetic:1500:400:60")
    scale = sp.diags(np.geomspace(0.05, 20.0, Xte.shape[0]).astype(np.float32))
    data = (Xtr, Ytr, (scale @ Xte).tocsr(), Yte)
    args = SimpleNamespace(epochs=1, devices="cpu,cpu@0.5", probe_rows=300)
    r = bench_merge_gap.run(data, args, 0, "auto")
    assert r["final_P@1"] == pytest.approx(r["merges"][-1]["merged"])
