"""The decay-at-scale benchmarks run end to end on small data: ``bench/bench_decay_gap.py``
(the generalization gap after one epoch; on bibtex, skipped with the reason where the shared
data is absent, and on a generated shape) and ``bench/bench_budget.py --params`` (the options
reach the engine and the record says what trained)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import real_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

pytestmark = pytest.mark.slow


def test_decay_gap_bench_measures_train_and_test_p1(data_dir, tmp_path, capsys):
    import bench_decay_gap

    real_dataset(data_dir, "bibtex")
    out = tmp_path / "gap.json"
    assert bench_decay_gap.main(["--datasets", "bibtex", "synth1k", "--out", str(out)]) == 0
    rows = {r["dataset"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"bibtex", "synth1k"}
    for r in rows.values():
        assert 0 < r["test_P@1"] <= 1 and 0 < r["train_P@1"] <= 1
        assert r["gap"] == pytest.approx(r["train_P@1"] - r["test_P@1"])
    # bibtex's 4,880 rows are memorised faster than a generated shape's: the gap the study reads
    assert rows["bibtex"]["gap"] > rows["synth1k"]["gap"]
    assert "bibtex" in capsys.readouterr().out


def budget_spec(**changes) -> dict:
    """One ``bench_budget.run_one`` spec: a small generated shape, one epoch, two evaluations."""
    spec = {"data": "synthetic:600:300:40", "seconds": 30.0, "max_epochs": 1.0,
            "output": None, "negatives": None, "label_chunk": None, "test_rows": 0,
            "eval_every": 0.5, "seed": 0, "algorithm": "single", "devices": "cpu",
            "threads": 1, "params": None}
    return {**spec, **changes}


def test_budget_bench_passes_params_to_the_engine():
    import bench_budget

    spec = budget_spec(params={"lr_decay": 0.0, "lr": 0.02})
    r = bench_budget.run_one(spec)
    assert r["lr_decay"] == 0.0 and r["lr"] == 0.02
    assert r["epochs_done"] == pytest.approx(1.0)
    spec["params"] = None  # the engine's defaults
    r = bench_budget.run_one(spec)
    assert r["lr_decay"] == 0.5 and r["plateau"] == []
    spec.update(params={"lr_decay": "plateau"}, max_epochs=3.0)  # what it keeps of the rule
    r = bench_budget.run_one(spec)
    assert r["lr_decay"] == "plateau"
    assert [p["epoch"] for p in r["plateau"]] == [1, 2]
    assert all(0 <= p["heldout_p1"] <= 1 and p["lr_scale"] in (1.0, 0.5, 0.25)
               for p in r["plateau"])


def test_budget_bench_timeline_accounts_for_every_merge():
    import bench_budget

    spec = budget_spec(algorithm="adaptive", devices="cpu,cpu@0.5", threads=None,
                       params={"algorithm_params": {"merge_period": 128}})
    r = bench_budget.run_one(spec)
    tl = r["timeline"]
    assert len(tl) == len(r["curve"]) == 2  # evaluations at 0.5 and 1.0 epochs
    assert sum(t["merges"] for t in tl) == r["merges"]
    assert all(t["merges"] > 0 for t in tl)
    for i, dev in enumerate(r["per_device"]):
        assert sum(t["devices"][i]["samples"] for t in tl) == dev["samples"]
        assert tl[-1]["devices"][i]["batch"] == dev["last_batch"]
    assert sum(sum(d["samples"] for d in t["devices"]) for t in tl) == r["samples"]
    # the options in effect, "auto" ones resolved (40 labels: the per-row / per-label weights)
    ap = r["algorithm_params"]
    assert ap["merge_period"] == 128
    assert (ap["row_weights"], ap["label_weights"], ap["weights_from_epoch"]) == (
        "sum_sqrt_unequal", "positives", 0)


def test_budget_bench_model_stats_describe_the_first_layer():
    import bench_budget
    import numpy as np

    spec = budget_spec(algorithm="adaptive", devices="cpu,cpu@0.5", threads=None,
                       model_stats=True)
    r = bench_budget.run_one(spec)
    ms = r["model_stats"]
    Xtr, _, _, _ = bench_budget.load(spec["data"])
    bands = ms["w1_row_norm_by_frequency"]
    # every feature that occurs falls in exactly one band
    occurring = np.count_nonzero(np.diff(Xtr.tocsc().indptr))
    assert sum(b["features"] for b in bands.values()) == occurring
    assert all((b["median_norm"] is None) == (b["features"] == 0) for b in bands.values())
    assert all(b["median_norm"] > 0 for b in bands.values() if b["features"])
    assert 0 < ms["hidden_active_share"] < 1
    assert 0 <= ms["hidden_units_never_active"] <= 128
    assert bench_budget.run_one(budget_spec())["model_stats"] is None  # only when asked
