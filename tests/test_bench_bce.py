"""The logistic loss's benchmarks run end to end on a small shared set (bibtex) and write what
they print: ``bench/bench_bce_negatives.py`` (both arms restore the engine's rule after them)
and ``bench/bench_bce_settings.py``. Skipped, with the reason, where the shared data is absent."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import real_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

pytestmark = pytest.mark.slow


def test_bce_negatives_bench_runs_both_arms_and_restores_the_rule(data_dir, tmp_path, capsys):
    import bench_bce_negatives

    import xmc_engine.output_layer as host_layer

    real_dataset(data_dir, "bibtex")
    out = tmp_path / "negs.json"
    assert bench_bce_negatives.main(["--runs", "bibtex:16", "--epochs", "0.5", "--seeds", "0",
                                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["arm"] for r in rows] == ["unweighted", "weighted"]
    assert all(0 < r["mean"]["P@1"] <= 1 for r in rows)
    assert host_layer.BCE_WEIGHTED_NEGATIVES is False
    assert "| bibtex | 16 | weighted |" in capsys.readouterr().out


def test_bce_negatives_bench_exact_once_per_dataset_and_chosen_arms(data_dir, tmp_path):
    import bench_bce_negatives

    real_dataset(data_dir, "bibtex")
    out = tmp_path / "negs_each.json"
    assert bench_bce_negatives.main(["--runs", "bibtex:16", "bibtex:32", "--arms", "unweighted",
                                     "--exact-each", "--epochs", "0.25", "--seeds", "0",
                                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["negatives"], r["arm"]) for r in rows] == [
        (16, "unweighted"), (16, "exact layer"), (32, "unweighted")]


def test_bce_settings_bench_runs_every_arm_and_restores_the_start(data_dir, tmp_path):
    import bench_bce_settings

    import xmc_engine.model as model

    real_dataset(data_dir, "bibtex")
    out = tmp_path / "settings.json"
    assert bench_bce_settings.main(["--datasets", "bibtex", "--epochs", "1", "--seeds", "0",
                                    "--decays", "0.5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["arms"] == ["softmax", "bce bias=minus_log_labels decay=0.5",
                              "bce bias=zero decay=0.5"]
    p1 = {r["arm"]: r["mean"]["P@1"] for r in result["rows"]}
    assert len(set(p1.values())) == 3  # the bias start changes the model
    assert model.BCE_BIAS_INIT == "minus_log_labels"
