"""The pure helpers of the benchmarks: the metadata every result JSON carries (bench/_common.py),
and the time-to-accuracy study's (bench/_tta.py, bench/bench_time_to_accuracy.py,
bench/bench_tta_sweep.py): interpolated time to a target, the summary table's ratios, the
learning-rate choice, and the sweep's configurations and statistics."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import _common  # noqa: E402
from _tta import Method, load_data, run_method, summarise, time_to_target  # noqa: E402
from bench_time_to_accuracy import pick_lr  # noqa: E402
from bench_tta_sweep import median_quartiles, parse_config, standard_configs  # noqa: E402


def test_time_to_target_interpolates_between_evaluations():
    curve = [(1.0, 0.25, 0.4, 0, 0), (2.0, 0.5, 0.6, 0, 0), (3.0, 0.75, 0.7, 0, 0)]
    assert time_to_target(curve, 0.5) == pytest.approx(1.5)
    assert time_to_target(curve, 0.2) == pytest.approx(0.5)  # from (0 s, P@1 0)
    assert time_to_target(curve, 0.7) == pytest.approx(3.0)
    assert time_to_target(curve, 0.71) == math.inf


def test_summary_is_median_over_seeds_with_ratios_to_the_reference():
    def run(method, seed, t_hit):
        return {"method": method, "seed": seed, "best_P@1": 1.0,
                "final": {"P@1": 1.0, "P@5": 0.5},
                "curve": [(t_hit, 1, 1.0, 0, 0)]}
    runs = [run("adaptive", s, t) for s, t in enumerate((1.0, 2.0, 3.0))]
    runs += [run("sync", s, t) for s, t in enumerate((4.0, 6.0, 100.0))]
    s = summarise(runs, target_frac=1.0, reference="adaptive")
    rows = {r["method"]: r for r in s["rows"]}
    assert rows["adaptive"]["time_to_target_s"] == 2.0
    assert rows["sync"]["time_to_target_s"] == 6.0
    assert rows["sync"]["ratio_vs_adaptive"] == pytest.approx(3.0)


def test_synthetic_shape_takes_a_preset_s_statistics_at_other_sizes():
    Xd, Yd, Xt, _ = load_data("synthetic:600:300:200")
    Xa, Ya, _, _ = load_data("synthetic:600:300:200:amazon670k")
    assert Xd.shape == Xa.shape == (600, 300) and Yd.shape == Ya.shape == (600, 200)
    assert Xt.shape[0] == 120
    # the Amazon-670K preset's rows are denser (75.7 non-zeros, 5.45 labels against 40 and 4)
    assert Xa.nnz > 1.3 * Xd.nnz and Ya.nnz > 1.1 * Yd.nnz
    with pytest.raises(SystemExit, match="PRESET one of default"):
        load_data("synthetic:600:300:200:nosuch")


def test_pick_lr_by_time_prefers_the_fastest_near_the_top():
    res = [{"lr": 0.05, "best_P@1": 0.8284, "t_near": 0.9},
           {"lr": 0.1, "best_P@1": 0.8257, "t_near": 0.5},
           {"lr": 0.2, "best_P@1": 0.8275, "t_near": 0.6},
           {"lr": 0.4, "best_P@1": None, "t_near": None}]  # diverged
    assert pick_lr(res, "time")["lr"] == 0.1
    assert pick_lr(res, "quality")["lr"] == 0.05
    never = [{"lr": 0.05, "best_P@1": 0.5, "t_near": math.inf},
             {"lr": 0.1, "best_P@1": 0.8, "t_near": 1.0}]
    assert pick_lr(never, "time")["lr"] == 0.1
    ties = [{"lr": 0.2, "best_P@1": 0.7, "t_near": 1.0},
            {"lr": 0.1, "best_P@1": 0.7, "t_near": 1.0}]
    assert pick_lr(ties, "time")["lr"] == 0.1 and pick_lr(ties, "quality")["lr"] == 0.1
    assert pick_lr([{"lr": 0.3, "best_P@1": None, "t_near": None}], "time")["lr"] == 0.3


def test_target_is_a_fraction_of_the_best_methods_median_best():
    """One lucky seed does not set the target: the best method by median over seeds does."""
    def run(method, seed, best):
        return {"method": method, "seed": seed, "best_P@1": best,
                "final": {"P@1": best, "P@5": 0.5}, "curve": [(1.0, 1, best, 0, 0)]}
    runs = [run("a", s, b) for s, b in enumerate((0.9, 0.8, 0.7))]
    runs += [run("b", s, 0.85) for s in range(3)]
    s = summarise(runs, target_frac=0.97, reference="a")
    assert s["best_P@1"] == pytest.approx(0.85)
    assert s["target_P@1"] == pytest.approx(0.97 * 0.85)
    assert s["best_P@1_any_run"] == pytest.approx(0.9)


def test_sweep_config_needs_algorithm_and_devices():
    cfg = parse_config('{"algorithm": "adaptive", "devices": "cpu,cpu", "lr": 0.1, '
                       '"params": {"merge_period": 4096}}')
    assert cfg["label"] == "adaptive cpu,cpu lr 0.1 merge_period=4096"
    assert cfg["setups"] == ["cpu,cpu"] and cfg["threads"] is None
    # without lr: the engine's default learning rate, and the label says nothing of it
    cfg = parse_config('{"algorithm": "sync", "devices": "cpu,cpu@0.5"}')
    assert cfg["lr"] is None and cfg["label"] == "sync cpu,cpu@0.5"
    assert cfg["batch_size"] is None  # the sweep's --batch-size (or the engine's default)
    cfg = parse_config('{"algorithm": "adaptive", "devices": "cpu,cpu", "batch_size": 32}')
    assert cfg["batch_size"] == 32 and cfg["label"] == "adaptive cpu,cpu B 32"
    import argparse

    for bad in ('0', '"32"', '2.5', 'true'):
        with pytest.raises(argparse.ArgumentTypeError, match="batch_size must be"):
            parse_config('{"algorithm": "adaptive", "devices": "cpu", "batch_size": ' + bad + "}")

    with pytest.raises(argparse.ArgumentTypeError, match="not JSON"):
        parse_config("{algorithm: adaptive}")
    with pytest.raises(argparse.ArgumentTypeError, match="needs algorithm and devices"):
        parse_config('{"algorithm": "adaptive"}')
    with pytest.raises(argparse.ArgumentTypeError, match="needs algorithm and devices"):
        parse_config("3")


def test_run_method_takes_the_methods_batch_and_rate_over_the_scripts(monkeypatch):
    """A method's own ``batch_size`` / ``lr`` win over the script's; ``None`` leaves the
    script's, and a script value of ``None`` is left out (the engine's default)."""
    import xmc_engine

    seen = []

    class Fake:
        def __init__(self, **kw):
            seen.append(kw)
            self.history_ = [{"event": "eval", "train_time": 1.0, "epoch": 1.0,
                              "metrics": {"P@1": 0.5, "P@3": 0.4, "P@5": 0.3}}]

        def fit(self, X, Y, eval_set=None):
            return self

        def get_config(self):
            return type("C", (), {"learning_rate": 0.05})()

    monkeypatch.setattr(xmc_engine, "XMCClassifier", Fake)
    common = {"epochs": 1, "hidden": None, "seed": 0}
    run_method(Method("a", "adaptive", "cpu,cpu", batch_size=32, lr=0.1, lr_decay=0.25),
               (None,) * 4, lr=0.2, batch_size=64, lr_decay=0.5, **common)
    run_method(Method("b", "adaptive", "cpu,cpu"), (None,) * 4, lr=0.2, batch_size=64,
               lr_decay=0.5, **common)
    run_method(Method("c", "adaptive", "cpu,cpu"), (None,) * 4, lr=None, batch_size=None,
               lr_decay=None, **common)
    assert [(kw.get("batch_size"), kw.get("lr"), kw.get("lr_decay")) for kw in seen] == [
        (32, 0.1, 0.25), (64, 0.2, 0.5), (None, None, None)]
    cfg = parse_config('{"algorithm": "adaptive", "devices": "cpu,cpu", "lr_decay": 0.25}')
    assert cfg["lr_decay"] == 0.25 and cfg["label"] == "adaptive cpu,cpu decay 0.25"
    # a configuration's own XMCClassifier options come last, over the script's
    cfg = parse_config('{"algorithm": "adaptive", "devices": "cpu,cpu", '
                       '"train": {"optimizer": "sgd", "loss": "softmax"}}')
    assert cfg["label"] == "adaptive cpu,cpu optimizer=sgd loss=softmax"
    run_method(Method("d", "adaptive", "cpu,cpu", train=cfg["train"]), (None,) * 4, lr=None,
               batch_size=None, lr_decay=None, optimizer="adagrad", loss="bce", **common)
    assert (seen[-1]["optimizer"], seen[-1]["loss"]) == ("sgd", "softmax")
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="train must be an object"):
        parse_config('{"algorithm": "adaptive", "devices": "cpu", "train": 3}')


def test_standard_configs_share_one_single_run_per_device_and_thread_share(monkeypatch):
    import xmc_engine.devices as devices

    monkeypatch.setattr(devices, "available_cores", lambda: 2)
    configs = standard_configs(["cpu,cpu@0.5", "cpu,cpu"])
    singles = [c for c in configs if c["algorithm"] == "single"]
    # both sets' fastest device is one CPU with one of the two cores: one run serves both tables
    assert len(singles) == 1
    assert singles[0]["devices"] == "cpu" and singles[0]["threads"] == 1
    assert singles[0]["setups"] == ["cpu,cpu@0.5", "cpu,cpu"]
    for spec in ("cpu,cpu@0.5", "cpu,cpu"):
        assert sorted(c["algorithm"] for c in configs if c["devices"] == spec) == sorted(
            ["adaptive", "sync", "average", "easgd", "crossbow"])
    assert all(c["lr"] is None and c["params"] == {} for c in configs)


def test_sweep_statistics_count_never_reached_as_slowest():
    assert median_quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (3.0, 2.0, 4.0)
    med, q1, q3 = median_quartiles([1.0, 2.0, math.inf, math.inf, math.inf])
    assert med == math.inf and q1 == 2.0 and q3 == math.inf
    assert median_quartiles([math.inf] * 3) == (math.inf, math.inf, math.inf)


def test_command_line_is_a_quoted_python_command_from_the_repo_root():
    script = str(_common.REPO_DIR / "bench" / "bench_x.py")
    cmd = _common.command_line([script, "--data", "a b", "--config", '{"lr": 0.1}'])
    assert cmd == "python bench/bench_x.py --data 'a b' --config '{\"lr\": 0.1}'"
    assert _common.command_line(["/elsewhere/x.py"]) == "python /elsewhere/x.py"


needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    *args], check=True, capture_output=True)


@needs_git
def test_git_commit_marks_code_changes_but_not_results_or_untracked_files(tmp_path):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "bench" / "results" / "r.json").write_text("{}\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "init")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    assert _common.git_commit(tmp_path) == head
    (tmp_path / "bench" / "results" / "r.json").write_text('{"a": 1}\n')
    (tmp_path / "new_untracked.py").write_text("y = 2\n")
    assert _common.git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert _common.git_commit(tmp_path) == head + "-dirty"


@needs_git
def test_git_commit_is_none_outside_the_root_of_a_work_tree(tmp_path):
    assert _common.git_commit(tmp_path) is None
    _git(tmp_path, "init", "-q")
    (tmp_path / "sub").mkdir()
    assert _common.git_commit(tmp_path / "sub") is None  # another project's repository
    assert _common.git_commit(tmp_path) is None  # no commit yet


def test_result_metadata_names_command_commit_and_machine():
    meta = _common.result_metadata(machine_extra={"threads": 3}, argv=["bench/b.py", "-q"])
    assert set(meta) == set(_common.RESULT_KEYS)
    assert meta["command"] == "python bench/b.py -q"
    assert meta["machine"]["threads"] == 3 and meta["machine"]["cpu_model"]
    commit = meta["git_commit"]  # None where the checkout is not a git work tree
    assert commit is None or re.fullmatch(r"[0-9a-f]{40}(-dirty)?", commit), commit


def test_engine_outside_names_packages_not_from_the_checkout(capsys, monkeypatch):
    """The engine imported here comes from this checkout; a package from elsewhere (here the
    standard library's ``json``, standing in for an installed checkout's kernels) is named,
    and ``result_metadata`` records it and warns that the commit does not name it."""
    assert _common.engine_outside() == {}
    out = _common.engine_outside(packages=("xmc_engine", "json", "no_such_package_xyz"))
    assert list(out) == ["json"] and Path(out["json"]).name == "json"
    assert "engine_outside_checkout" not in _common.result_metadata(argv=["bench/b.py"])
    monkeypatch.setattr(_common, "engine_outside", lambda: out)
    meta = _common.result_metadata(argv=["bench/b.py"])
    assert meta["engine_outside_checkout"] == out
    assert "does not name the code measured" in capsys.readouterr().err


def test_write_result_refuses_a_payload_without_its_metadata(tmp_path):
    with pytest.raises(ValueError, match=r"lacks \['git_commit'\]"):
        _common.write_result(tmp_path / "r.json", {"command": "c", "machine": {}, "rows": []})
    assert not (tmp_path / "r.json").exists()
    meta = {"command": "python bench/b.py", "git_commit": None, "machine": {"cpu_model": "x"}}
    path = _common.write_result(tmp_path / "r.json", {**meta, "rows": [float("inf")]})
    assert json.loads(path.read_text()) == {**meta, "rows": [None]}


def test_sweep_markdown_reads_never_reached_back_from_json(capsys):
    from bench_tta_sweep import print_markdown

    def row(algorithm, med, q, finals, epoch):
        return {"config": {"algorithm": algorithm, "devices": "cpu,cpu", "params": {},
                           "label": f"{algorithm} cpu,cpu", "setups": ["cpu,cpu"]},
                "median_time_to_target_s": med, "quartiles_s": q,
                "median_epoch_at_target": epoch, "final_P@1_runs": finals, "runs": [{}, {}]}

    # as written by write_result: inf became null
    result = {"args": {"data": "toy"}, "target_P@1": 0.5, "git_commit": "abcdef123",
              "rows": [row("adaptive", 2.0, [1.0, 3.0], [0.6, 0.62], 1.0),
                       row("sync", 4.0, [3.0, None], [0.55, 0.57], 2.0),
                       row("easgd", None, [None, None], [0.4, 0.45], None)]}
    print_markdown(result)
    out = capsys.readouterr().out
    assert "toy, target P@1 0.5000, 2 seeds, commit abcdef1" in out
    assert "| adaptive cpu,cpu | 2.00 | 1.00-3.00 | 1.00 | 1.00 | 0.6100 (0.6000-0.6200) |" in out
    assert "| sync cpu,cpu | 4.00 | 3.00-not reached | 2.00 | 2.00 |" in out
    assert "| easgd cpu,cpu | not reached | not reached-not reached |  |  | 0.4250" in out


def test_sweep_summary_gives_ratios_to_adaptive_and_the_best_final(capsys):
    from bench_tta_sweep import print_summary

    def row(algorithm, devices, med, finals, setups=None):
        return {"config": {"algorithm": algorithm, "devices": devices, "params": {},
                           "label": algorithm, "setups": setups or [devices]},
                "median_time_to_target_s": med, "final_P@1_runs": finals}

    result = {"args": {"data": "toy"},
              "rows": [row("single", "cpu", 1.0, [0.5, 0.7], ["cpu,cpu"]),
                       row("adaptive", "cpu,cpu", 2.0, [0.6, 0.6]),
                       row("sync", "cpu,cpu", None, [0.4, 0.4])]}
    print_summary([result])
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("| toy | `cpu,cpu` | 1.00 (0.50) | 2.00 (1.00) | not reached |  |  |  "
                       "| 0.6000 / 0.6000 (single) |")


def test_sweep_summary_peak_column_reads_each_run_s_highest_evaluation(capsys):
    from bench_tta_sweep import print_summary

    def row(algorithm, devices, finals, peaks, setups=None):
        return {"config": {"algorithm": algorithm, "devices": devices, "params": {},
                           "label": algorithm, "setups": setups or [devices]},
                "median_time_to_target_s": 1.0, "final_P@1_runs": finals,
                "runs": [{"best_P@1": b} for b in peaks]}

    # one device peaks highest and overfits; sync learns slowly and ends highest
    result = {"args": {"data": "toy"},
              "rows": [row("single", "cpu", [0.50, 0.52], [0.70, 0.72], ["cpu,cpu"]),
                       row("adaptive", "cpu,cpu", [0.55, 0.55], [0.69, 0.71]),
                       row("sync", "cpu,cpu", [0.60, 0.62], [0.62, 0.64])]}
    print_summary([result], peak=True)
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("| final P@1 adaptive / best | peak P@1 adaptive / best |")
    assert out[-1].endswith("| 0.5500 / 0.6100 (sync) | 0.7000 / 0.7100 (single) |")
    print_summary([result])  # without it, the table is as before
    assert capsys.readouterr().out.splitlines()[-1].endswith("| 0.5500 / 0.6100 (sync) |")


def test_sweep_summary_per_set_target_reads_each_set_s_times_again_from_its_curves(capsys):
    from bench_tta_sweep import print_summary

    def row(algorithm, devices, curves, setups):
        # the saved median says "not reached" against the file's target; the curves decide
        return {"config": {"algorithm": algorithm, "devices": devices, "params": {},
                           "label": algorithm, "setups": setups},
                "median_time_to_target_s": None, "final_P@1_runs": [c[-1][2] for c in curves],
                "runs": [{"best_P@1": max(p for _, _, p in c), "curve": c} for c in curves]}

    single = row("single", "cpu", [[(1.0, 1, 0.4), (2.0, 2, 0.5)]] * 2, ["a,b", "c,d"])
    result = {"args": {"data": "toy"}, "rows": [
        single,
        row("adaptive", "a,b", [[(1.0, 1, 0.5), (2.0, 2, 0.6)]] * 2, ["a,b"]),
        row("adaptive", "c,d", [[(1.0, 1, 0.9), (2.0, 2, 1.0)]] * 2, ["c,d"])]}
    print_summary([result], 0.9)
    out = capsys.readouterr().out.splitlines()
    # a,b: target 0.9 x 0.6 = 0.54, adaptive at 1.4 s (interpolated), one device never;
    # c,d: target 0.9, adaptive at 1.0 s, one device never
    assert out[2] == ("| toy | `a,b` | 0.5400 | not reached | 1.40 (1.00) |  |  |  |  "
                      "| 0.6000 / 0.6000 (adaptive) |")
    assert out[3].startswith("| toy | `c,d` | 0.9000 | not reached | 1.00 (1.00) |")


def test_sweep_decomposition_splits_the_time_ratio_into_epochs_and_seconds_per_epoch(capsys):
    from bench_tta_sweep import print_decomposition

    def row(algorithm, devices, curves):
        return {"config": {"algorithm": algorithm, "devices": devices, "params": {},
                           "label": algorithm, "setups": ["cpu,cpu"]},
                "median_time_to_target_s": None,  # the file's target: not what is read
                "runs": [{"best_P@1": max(c[2] for c in cv), "curve": cv} for cv in curves]}

    # target 0.5 (5/6 of the best, 0.6): one device needs 0.75 epochs at 2 s an epoch
    # (1.5 s), adaptive 0.5 epochs at 1 s an epoch (0.5 s): a third of the time
    result = {"args": {"data": "toy"}, "rows": [
        row("single", "cpu", [[(1.0, 0.5, 0.4), (2.0, 1.0, 0.6)]]),
        row("adaptive", "cpu,cpu", [[(0.5, 0.5, 0.5), (1.0, 1.0, 0.6)]])]}
    print_decomposition([result], 0.5 / 0.6)
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| toy | `cpu,cpu` | 0.5000 | 0.75 / 0.50 | 2.000 / 1.000 | 0.33 |"
    # against another method on the same device set: average needs 1.5 epochs at 0.5 s each
    result["rows"].append(row("average", "cpu,cpu", [[(0.5, 1.0, 0.4), (1.0, 2.0, 0.6)]]))
    print_decomposition([result], 0.5 / 0.6, against="average")
    out = capsys.readouterr().out.splitlines()
    assert "epochs: `average` / adaptive" in out[0]
    assert out[2] == "| toy | `cpu,cpu` | 0.5000 | 1.50 / 0.50 | 0.500 / 1.000 | 0.67 |"
    print_decomposition([result], 0.5 / 0.6, against="sync")  # not in the file: no row
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_sweep_ablation_compares_each_option_with_the_same_algorithm_s_defaults(capsys):
    from bench_tta_sweep import print_ablation

    def row(devices, params, med, finals):
        return {"config": {"algorithm": "adaptive", "devices": devices, "params": params},
                "median_time_to_target_s": med, "final_P@1_runs": finals}

    result = {"args": {"data": "toy"},
              "rows": [row("cpu,cpu", {}, 2.0, [0.60, 0.62]),
                       row("cpu,cpu", {"boost": False}, 1.0, [0.60, 0.60]),
                       row("cpu,cpu", {"merge_period": 8}, None, [0.50, 0.50]),
                       row("cpu,cpu@0.5", {}, 4.0, [0.5, 0.5])]}  # no option: no row
    print_ablation([result])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| data | devices | adaptive boost=False | adaptive merge_period=8 |"
    assert out[2:] == ["| toy | `cpu,cpu` | 0.50 / -0.010 | - / -0.110 |"]


def test_sweep_ablation_with_each_set_s_own_target(capsys):
    """``--per-set-target``: each device set's target from its own configurations' best P@1,
    the times read again from the curves (a set whose best is lower gets a lower target)."""
    from bench_tta_sweep import print_ablation

    def row(devices, params, best):  # P@1 0, best/2, best at 1, 2, 3 s
        curve = [[1.0, 0.5, 0.0], [2.0, 1.0, best / 2], [3.0, 1.5, best]]
        run = {"best_P@1": best, "final_P@1": best, "curve": curve}
        return {"config": {"algorithm": "adaptive", "devices": devices, "params": params},
                "median_time_to_target_s": None, "final_P@1_runs": [best], "runs": [run]}

    result = {"args": {"data": "toy"},
              "rows": [row("cpu,cpu", {}, 0.8), row("cpu,cpu", {"x": 1}, 0.4),
                       row("cpu,cpu@0.5", {}, 0.4), row("cpu,cpu@0.5", {"x": 1}, 0.4)]}
    print_ablation([result], 0.5)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| data | devices | target | adaptive x=1 |"
    # cpu,cpu: target 0.4, the default at 2 s, the option at 3 s; cpu,cpu@0.5: 0.2, both 2 s
    assert out[2:] == ["| toy | `cpu,cpu` | 0.4000 | 1.50 / -0.400 |",
                       "| toy | `cpu,cpu@0.5` | 0.2000 | 1.00 / +0.000 |"]


def test_sweep_levels_give_each_device_set_s_epochs_to_fractions_of_its_best(capsys):
    """``--decompose --levels``: per device set, the median epochs one device and each
    ``adaptive`` configuration needed to reach each fraction of the set's best median best P@1,
    interpolated between evaluations, with their ratio; a level never reached reads ``inf``."""
    from bench_tta_sweep import print_levels

    def row(algorithm, devices, setups, params, curve):
        best = max(c[2] for c in curve)
        return {"config": {"algorithm": algorithm, "devices": devices, "params": params,
                           "setups": setups},
                "median_time_to_target_s": None, "final_P@1_runs": [best],
                "runs": [{"best_P@1": best, "final_P@1": best, "curve": curve}]}

    # (seconds, epoch, P@1): one device 0.4 at epoch 0.5 and 0.8 at 1; adaptive half as fast
    one = [[1.0, 0.5, 0.4], [2.0, 1.0, 0.8]]
    slow = [[1.0, 0.5, 0.2], [2.0, 1.0, 0.4], [3.0, 2.0, 0.8]]
    result = {"args": {"data": "toy"},
              "rows": [row("single", "cpu", ["cpu,cpu"], {}, one),
                       row("adaptive", "cpu,cpu", ["cpu,cpu"], {}, slow),
                       row("adaptive", "cpu,cpu", ["cpu,cpu"], {"solo_epochs": 0.5}, one[:1])]}
    print_levels([result], [0.5, 1.0])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| data | devices | configuration | 0.5 of the best | 1 of the best |"
    assert out[2:] == ["| toy | `cpu,cpu` | adaptive | 0.50 / 1.00 (2.00x) | 1.00 / 2.00 (2.00x) |",
                       "| toy | `cpu,cpu` | adaptive solo_epochs=0.5 | 0.50 / 0.50 (1.00x) "
                       "| 1.00 / inf |"]


def test_sweep_at_equal_time_takes_the_last_evaluation_before_it(capsys):
    from bench_tta_sweep import p1_at, print_at_seconds

    curve = [[1.0, 0.5, 0.30], [2.0, 1.0, 0.50], [3.0, 1.5, 0.60]]
    assert p1_at(curve, 0.5) == 0.0
    assert p1_at(curve, 2.5) == 0.50
    assert p1_at(curve, 10.0) == 0.60  # a run that ended keeps its last P@1
    result = {"args": {"data": "toy"},
              "rows": [{"config": {"label": "single cpu"},
                        "runs": [{"curve": curve}, {"curve": [[1.5, 1.0, 0.40]]}]}]}
    print_at_seconds(result, [2.0])
    assert "| single cpu | 0.4500 | 2.2 |" in capsys.readouterr().out


def test_xmc_libraries_engine_params_are_json_objects_applied_on_top_of_the_defaults():
    import numpy as np
    import scipy.sparse as sp
    from xmc_libraries import parse_args, run_engine_defaults

    args = parse_args(["--engine-epochs", "1", "--engine-params", '{"hidden": [16]}',
                       "--engine-seeds", "0", "1"])
    assert args.engine_params == [{"hidden": [16]}] and args.engine_seeds == [0, 1]
    for bad in ("[16]", "{hidden: 16}"):
        with pytest.raises(SystemExit):
            parse_args(["--engine-params", bad])
    rng = np.random.default_rng(0)
    X = sp.random(60, 30, density=0.2, format="csr", random_state=0, dtype=np.float32)
    Y = sp.csr_matrix((np.ones(60, np.float32), rng.integers(0, 8, 60), np.arange(61)),
                      shape=(60, 8))
    r = run_engine_defaults(X, Y, X, Y, epochs=1, seed=1, params={"hidden": [16]})
    assert r["model"] == '{"hidden":[16]}' and r["seed"] == 1 and 0.0 <= r["P@1"] <= 1.0
    assert run_engine_defaults(X, Y, X, Y, epochs=1)["model"] == "defaults"


def test_the_defaults_grid_carries_each_loss_and_widens_the_winner():
    """bench_defaults.search: stage 1 runs every (optimizer, lr, loss) point at the base shape,
    stage 2 every other shape at the winner only (it is Adagrad here), then the defaults."""
    import bench_defaults

    runs = []

    class FakeGrid:
        epochs = [5]

        def run(self, config, stage):
            runs.append((stage, config))
            return [config]

        def score(self, out, epochs):  # the logistic loss at lr 0.1 wins
            c = out[0]
            return 1.0 if (c.get("loss"), c["lr"]) == ("bce", 0.1) else 0.5

    points = [("adagrad", lr, loss) for loss in ("softmax", "bce") for lr in (0.05, 0.1)]
    bench_defaults.search(FakeGrid(), points, [(64, 128), (256, 128), (64, 256)])
    stage1 = [c for s, c in runs if s == "opt x lr"]
    assert [(c["loss"], c["lr"], c["batch_size"]) for c in stage1] == [
        ("softmax", 0.05, 256), ("softmax", 0.1, 256), ("bce", 0.05, 256), ("bce", 0.1, 256)]
    stage2 = [c for s, c in runs if s == "b x h"]
    assert [(c["loss"], c["lr"], c["batch_size"], c["hidden"]) for c in stage2] == [
        ("bce", 0.1, 64, 128), ("bce", 0.1, 64, 256)]  # the base shape is not run twice
    assert runs[-1] == ("defaults", {})
    assert bench_defaults._label(stage2[0]) == "adagrad bce lr=0.1 b=64 h=128"
    assert "loss" not in bench_defaults._cfg("adagrad", 0.05, 64, 128)  # the engine's default


def test_the_defaults_grid_scores_the_last_epoch_as_the_models_predict():
    """bench_defaults.summarise(predicted=True): a run's blend with the votes where it kept
    its training rows, the network alone where it did not; the best chosen by that P@1."""
    import bench_defaults

    def row(config, seed, p1, votes=None):
        at = {"P@1": p1, "P@3": p1 / 2, "P@5": p1 / 3, "train_time": 1.0}
        if votes is not None:
            at["neighbours"] = {"P@1": votes, "P@3": votes / 2, "P@5": votes / 3}
        return {"dataset": "d", "config": config, "seed": seed, "at": {"5": at},
                "resolved": {"optimizer": "adagrad", "lr": 0.1, "batch_size": 64,
                             "hidden": [128], "loss": "bce"}}

    soft = bench_defaults._cfg("adagrad", 0.1, 256, 128, "softmax")
    bce = bench_defaults._cfg("adagrad", 0.05, 256, 128, "bce")
    rows = [row(soft, 0, 0.60), row(soft, 1, 0.62),          # no votes (a softmax given)
            row(bce, 0, 0.58, 0.60), row(bce, 1, 0.58, 0.64),
            row({}, 0, 0.57, 0.61), row({}, 1, 0.59, 0.63)]  # the defaults
    alone = bench_defaults.summarise(rows, "d", 5)
    assert alone["best"] == bench_defaults._label(soft)
    assert alone["gap_P@1"] == pytest.approx(0.61 - 0.58)
    blend = bench_defaults.summarise(rows, "d", 5, predicted=True)
    assert blend["best"] == bench_defaults._label(bce)
    assert blend["best_stats"]["P@3"] == pytest.approx(0.31)
    assert blend["defaults_stats"]["P@1"] == pytest.approx(0.62)
    assert blend["gap_P@1"] == pytest.approx(0.0)


def test_plateau_stop_replay_reads_the_stop_epoch_and_the_p1_there():
    """bench_plateau_stop.py: the first epoch whose multiplier is below the floor; P@1 of the last
    evaluation at or before it (conservative), training seconds after it interpolated."""
    from bench_plateau_stop import replay, stop_epoch

    scales = [1, 1, 0.5, 0.5, 0.25, 0.125, 0.0625]
    plateau = [{"epoch": e + 1, "lr_scale": s, "lowered": s < (scales[e - 1] if e else 1)}
               for e, s in enumerate(scales)]
    assert stop_epoch(plateau, 0.25) == 6 and stop_epoch(plateau, 0.5) == 5
    assert stop_epoch(plateau, 0.01) is None
    curve = [(10.0 * e, float(e), 0.5 + 0.01 * e, 0, 0) for e in (2, 4, 6, 8)]
    run = {"algorithm": "adaptive", "epochs_done": 8.0, "curve": curve, "plateau": plateau}
    out = replay(run, [0.25, 0.5, 0.01])
    assert out["lowered_at"] == [3, 5, 6, 7]
    at = out["floors"]["0.25"]  # stops after epoch 6: the evaluation at epoch 6
    assert at["stop_epoch"] == 6 and at["P@1"] == pytest.approx(0.56)
    assert at["loss"] == pytest.approx(0.02) and at["saved_s"] == pytest.approx(20.0)
    at = out["floors"]["0.5"]  # after epoch 5: the evaluation at epoch 4, 30 s saved
    assert at["P@1"] == pytest.approx(0.54) and at["saved_s"] == pytest.approx(30.0)
    assert out["floors"]["0.01"] == {"stop_epoch": None, "P@1": 0.58, "loss": 0.0, "saved_s": 0.0}


def test_startup_benchmark_times_first_and_later_periods_and_compares(tmp_path, capsys):
    import bench_startup

    out = tmp_path / "a.json"
    bench_startup.main(["--data", "synthetic:3000:500:50", "--devices", "cpu", "cpu,cpu@0.5",
                        "--seeds", "0", "--epochs", "3", "--out", str(out)])
    runs = json.loads(out.read_text())["runs"]["synthetic:3000:500:50"]
    assert [r["devices"] for r in runs] == ["cpu", "cpu,cpu@0.5"]
    one, two = runs
    assert one["periods"] >= 8 and len(one["first_period"]) == 1  # a record per 1,024 samples
    assert two["periods"] >= 3 and len(two["first_period"]) == 2  # a record per merge
    for r in runs:
        assert r["first_period_us"] > 0 and r["later_period_us"] > 0
        assert 0 < r["train_s"] < r["wall_s"]
    capsys.readouterr()
    bench_startup.main(["--compare", f"x={out}", f"y={tmp_path}/*.json"])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| data | devices | x (1 files)") and "y (1 files)" in table[0]
    assert [line.split(" | ")[1] for line in table[2:]] == ["`cpu`", "`cpu,cpu@0.5`"]
    with pytest.raises(SystemExit, match="LABEL=GLOB"):
        bench_startup.main(["--compare", f"x={tmp_path}/none*.json"])


def test_rank_prior_candidate_chance():
    """``q_j`` of bench_rank_prior: 1 where the drawn negatives cover every label, else rising
    with the label's frequency from ``K / L`` (a label no row has) to 1 (one every row has)."""
    import bench_rank_prior
    import numpy as np
    import scipy.sparse as sp

    Y = sp.csr_matrix(np.array([[1, 1, 0, 0], [1, 0, 0, 0], [1, 0, 1, 0]], dtype=np.float32))
    np.testing.assert_allclose(bench_rank_prior.candidate_chance(Y, 64, 8), 1.0)
    q = bench_rank_prior.candidate_chance(Y, 2, 1)  # one other row, one draw of four labels
    np.testing.assert_allclose(q, [1.0, 1 - (2 / 3) * 0.75, 1 - (2 / 3) * 0.75, 0.25])


def test_probe_seconds_leave_out_the_fit_the_run_went_on_from():
    history = [{"event": "compile", "seconds": 2.0},
               {"event": "loss_probe", "seconds": 1.5,
                "continued": {"samples": 20_000, "train_time": 0.5}},
               {"event": "final", "train_time": 3.0}]
    assert _common.probe_seconds(history) == pytest.approx(1.0)  # 0.5 s are in train_time
    history[1]["continued"] = None  # started over: the whole probe is outside train_time
    assert _common.probe_seconds(history) == pytest.approx(1.5)
    assert _common.probe_seconds([{"event": "final", "train_time": 3.0}]) == 0.0


def test_loss_rule_scores_each_rule_by_the_runs_it_picks():
    """bench_loss_rule.py: a rule is scored by the continued run of the loss it picks, seed by
    seed; the softmax needs z above a threshold, the P@1 rule takes it on a tie."""
    from bench_loss_rule import summarise as loss_rule_summary

    def row(z, soft_hits, bce_hits, p1_soft, p1_bce):
        return {"z": z, "hits": {"softmax": soft_hits, "bce": bce_hits},
                "softmax": {"P@1": p1_soft, "P@3": 0.0, "P@5": 0.0},
                "bce": {"P@1": p1_bce, "P@3": 0.0, "P@5": 0.0}}
    rows = [row(1.5, "1101", "1001", 0.4, 0.6),   # softmax ahead, not by 2 s.e.
            row(2.5, "1111", "0001", 0.9, 0.1),   # softmax clearly ahead
            row(0.0, "1100", "0110", 0.2, 0.8)]   # a tie
    out = loss_rule_summary([{"dataset": "d", "rows": rows}])
    rules = out["d"]["rules"]
    assert rules["z > 2"]["metrics"]["P@1"] == pytest.approx((0.6 + 0.9 + 0.8) / 3)
    assert rules["z > 2"]["bce_picked"] == 2
    assert rules["z > 1"]["metrics"]["P@1"] == pytest.approx((0.4 + 0.9 + 0.8) / 3)
    assert rules["P@1, ties softmax"]["metrics"]["P@1"] == pytest.approx((0.4 + 0.9 + 0.2) / 3)
    assert rules["always bce"]["bce_picked"] == 3 and rules["always softmax"]["bce_picked"] == 0
    assert out["d"]["z"] == [1.5, 2.5, 0.0]
    assert out["mean"]["z > 2"]["P@1"] == pytest.approx(rules["z > 2"]["metrics"]["P@1"])


def test_keep_best_rule_scores_each_margin_by_the_model_it_ends_with():
    """bench_keep_best.py: per dataset and epochs, a rule takes the best epoch's test metrics
    where the run's margin is above its threshold, the last model's otherwise."""
    from bench_keep_best import summarise as keep_best_summary

    def row(z, last, best, epochs=5):
        return {"dataset": "d", "epochs": epochs, "z": z,
                "last": {"P@1": last, "P@3": 0.0, "P@5": 0.0},
                "best": {"P@1": best, "P@3": 0.0, "P@5": 0.0}}
    rows = [row(0.5, 0.40, 0.30), row(1.5, 0.40, 0.50), row(2.5, 0.40, 0.60),
            row(None, 0.40, 0.40), row(3.0, 0.1, 0.2, epochs=10)]
    out = keep_best_summary(rows)
    assert [(x["dataset"], x["epochs"], x["seeds"]) for x in out] == [("d", 5, 4), ("d", 10, 1)]
    rules = out[0]["rules"]
    assert rules["last"]["P@1"] == pytest.approx(0.40) and rules["last"]["swapped"] == 0
    assert rules["z > 0"]["P@1"] == pytest.approx((0.30 + 0.50 + 0.60 + 0.40) / 4)
    assert rules["z > 2"]["P@1"] == pytest.approx((0.40 + 0.40 + 0.60 + 0.40) / 4)
    assert rules["z > 2"]["swapped"] == 1 and rules["z > 1"]["swapped"] == 2
    assert rules["best"]["swapped"] == 4  # a run without a margin too (its best is its last)
    assert out[1]["rules"]["z > 3"]["P@1"] == pytest.approx(0.1)  # not above 3
    assert out[0]["z"] == [0.5, 1.5, 2.5, None]


def test_device_params_default_to_adaptive_on_several_devices():
    import argparse

    import _common

    p = argparse.ArgumentParser()
    _common.add_device_args(p)
    assert _common.device_params(p.parse_args([])) == {}
    assert _common.device_params(p.parse_args(["--devices", "cpu,cpu@0.5"])) == {
        "devices": "cpu,cpu@0.5", "algorithm": "adaptive"}
    assert _common.device_params(p.parse_args(["--devices", "cpu,cpu", "--algorithm",
                                               "sync"]))["algorithm"] == "sync"
    assert _common.device_params(p.parse_args(["--devices", "cpu"])) == {"devices": "cpu"}


def test_ensemble_summary_pairs_each_combination_with_one_network():
    from bench_ensemble import summarise

    def row(seed, one, two, longer):
        return {"dataset": "d", "seed": seed, "epochs": 5, "member_train_time": [1.0, 2.0],
                "k": {"1": {"P@1": one, "P@3": one, "P@5": one},
                      "2": {"P@1": two, "P@3": two, "P@5": two}},
                "equal_samples": {"2": {"P@1": longer, "P@3": longer, "P@5": longer,
                                        "train_time": 2.5}}}
    line, = summarise([row(0, 0.5, 0.6, 0.5), row(1, 0.7, 0.7, 0.8)])
    cells = {c["label"]: c for c in line["cells"]}
    assert list(cells) == ["ensemble 1", "ensemble 2", "one network, 2x the epochs"]
    two = cells["ensemble 2"]
    assert two["P@1"] == pytest.approx(0.65) and two["train_time"] == pytest.approx(3.0)
    assert two["P@1 diff"][0] == pytest.approx(0.05)  # the paired differences 0.1 and 0
    assert two["P@1 diff"][1] == pytest.approx(0.05)  # their standard error
    longer = cells["one network, 2x the epochs"]
    assert longer["P@5 diff"][0] == pytest.approx(0.05) and longer["train_time"] == 2.5
    assert cells["ensemble 1"]["train_time"] == pytest.approx(1.0)


def test_the_defaults_grid_refuses_an_ensemble():
    """bench_defaults.run_one reads one eval record per epoch; an ensemble's belong to its
    members, so it refuses rather than report the last member as the ensemble."""
    import bench_defaults

    with pytest.raises(SystemExit, match="bench_ensemble"):
        bench_defaults.run_one((None, None, None, None), {"ensemble": 2}, 0, [1], 1)


def test_lanes_summary_takes_speed_ups_and_counts_the_seeds_it_could_compare():
    from bench_ensemble import summarise_lanes

    def row(seed, in_turn, side, same):
        way = lambda s, lanes: {"fit_s": s, "train_time": s - 0.5, "lanes": lanes}  # noqa: E731
        return {"dataset": "d", "seed": seed, "members": 2, "same_model": same,
                "one": {"fit_s": 1.0, "train_time": 0.5},
                "in_turn": way(in_turn, 1), "side_by_side": way(side, 2)}
    line, = summarise_lanes([row(0, 2.0, 1.0, True), row(1, 3.0, 2.0, None)])
    assert line["lanes"] == [2] and line["same_model"] and line["compared"] == 1
    assert line["in_turn fit_s"] == pytest.approx(2.5)
    assert line["speed-up fit_s"][0] == pytest.approx((2.0 + 1.5) / 2)
    assert line["speed-up train_time"][0] == pytest.approx((1.5 / 0.5 + 2.5 / 1.5) / 2)
    # one seed whose two ways differ on equal budgets makes the set's verdict False
    assert not summarise_lanes([row(0, 2.0, 1.0, True), row(1, 3.0, 2.0, False)])[0][
        "same_model"]


def test_the_torch_bench_keeps_an_ensembles_lanes_per_seed():
    from bench_torch_adam import mean_over_seeds

    runs = [{"P@1": p, "P@3": p, "P@5": p, "train_time": 1.0, "probe_s": 0.1, "ensemble": 2,
             "lanes": lanes} for p, lanes in ((0.5, 2), (0.7, 1))]
    out = mean_over_seeds(runs)
    assert out["P@1"] == pytest.approx(0.6) and out["lanes"] == [2, 1]
    assert "lanes" not in mean_over_seeds([{k: v for k, v in runs[0].items() if k != "lanes"}])


def test_the_torch_bench_keeps_each_optimizers_best():
    from bench_torch_adam import best_by_optimizer

    grid = [{"optimizer": o, "lr": lr, "P@1": p}
            for o, lr, p in (("sparse_adam", 0.001, 0.50), ("sparse_adam", 0.003, 0.55),
                             ("adagrad", 0.05, 0.52), ("adagrad", 0.1, 0.51))]
    best = best_by_optimizer(grid)
    assert {o: r["lr"] for o, r in best.items()} == {"sparse_adam": 0.003, "adagrad": 0.05}


def test_thread_pools_benchmark_gives_the_budget_to_the_pools_it_names(monkeypatch):
    """``bench_thread_pools.install``: a CPU budget of ``n`` threads goes to numba's kernels,
    to BLAS or to both as its arm says, the other pool on one thread."""
    import bench_thread_pools
    import numba
    from threadpoolctl import threadpool_info

    from xmc_engine.backends import cpu
    from xmc_engine.scheduler import runner

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here: no budget to share out")
    # put both back afterwards (install replaces them in the process)
    monkeypatch.setattr(cpu.CPUBackend, "thread_budget", cpu.CPUBackend.thread_budget)
    monkeypatch.setattr(runner.Trainer, "_period_threads", runner.Trainer._period_threads)
    state = {"pools": (1, 0), "free": False}
    bench_thread_pools.install(state)
    be = cpu.CPUBackend(threads=2)

    def blas():
        return {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}

    with be.thread_budget():
        assert numba.get_num_threads() == 2 and blas() == {1}
    state["pools"] = (0, 1)
    with be.thread_budget():
        assert numba.get_num_threads() == 1 and blas() == {2}
    state["pools"] = (1, 1)
    with be.thread_budget(2):
        assert numba.get_num_threads() == 2 and blas() == {2}


def test_threads_benchmark_compares_two_checkouts_calibrated_runs(tmp_path, capsys):
    """``bench_threads.py --compare``: per dataset, each label's median training and fit
    seconds over its files' calibrated runs, and the budgets chosen (with the pool where a
    run names one)."""
    import bench_threads

    def payload(train, wall, threads, pool=None):
        run = {"train_time": train, "wall_s": wall, "threads": threads, "pool": pool}
        return {"rows": [{"dataset": "d", "runs": {"calibrated": [run]}}]}

    for name, p in {"a_0": payload(1.0, 2.0, 1), "a_1": payload(3.0, 4.0, 2),
                    "b_0": payload(0.5, 0.7, 2, "kernels")}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(p))
    assert bench_threads.main(["--compare", f"a={tmp_path}/a_*.json",
                               f"b={tmp_path}/b_*.json"]) == 0
    assert capsys.readouterr().out.strip() == (
        "d: a train 2.00 s, fit 3.00 s (2 runs; [1, 2]); "
        "b train 0.50 s, fit 0.70 s (1 runs; ['2 kernels'])")
    with pytest.raises(SystemExit, match="LABEL=GLOB"):
        bench_threads.main(["--compare", f"a={tmp_path}/none*.json"])


def test_continue_probe_bench_pairs_two_commits_runs_by_dataset_setting_and_seed(capsys):
    """bench_continue_probe.py --compare: the runs of two results files are paired by dataset,
    epochs, setting and seed (a seed only one file has is left out), and the differences are
    after - before, ``fit_s`` without the compile seconds."""
    import bench_continue_probe as bench

    def row(seed, on, p1, loss="bce", wall=1.0):
        return {"dataset": "d", "epochs": 5, "continue_probe": on, "seed": seed, "loss": loss,
                "P@1": p1, "P@3": 0.3, "P@5": 0.2, "wall_s": wall, "compile_s": 0.25}

    before = {"git_commit": "a", "rows": [row(0, True, 0.50), row(1, True, 0.60),
                                          row(0, False, 0.52), row(2, True, 0.9)]}
    after = {"git_commit": "b", "rows": [row(0, True, 0.53, wall=0.5),
                                         row(1, True, 0.61, "softmax", wall=0.75),
                                         row(0, False, 0.52)]}
    on, off = bench.compare(before, after, "continue_probe")
    assert (on["continue_probe"], on["seeds"], off["seeds"]) == (True, 2, 1)
    assert on["P@1"]["before"] == pytest.approx(0.55) and on["P@1"]["after"] == pytest.approx(0.57)
    assert on["P@1"]["diff"][0] == pytest.approx(0.02)  # +0.03 and +0.01
    assert on["fit_s"]["diff"][0] == pytest.approx(-0.375)  # 0.25 and 0.5 less, compile out
    assert (on["loss_before"], on["loss_after"], on["loss_changed"]) == (["bce"],
                                                                          ["bce", "softmax"], 1)
    assert off["P@1"]["diff"][0] == 0.0
    bench.print_compare([on, off], "continue_probe", before, after)
    out = capsys.readouterr().out
    assert "before: a, after: b" in out and "(1 changed)" in out


def test_merge_prototype_gives_every_replica_one_models_accumulators():
    import argparse

    import numpy as np
    from proto_merge_state import _acc_sum, parse_variant

    class Replica:
        def __init__(self, acc):
            self.acc = [np.asarray(acc, dtype=np.float32)]

        def accumulators(self):
            return self.acc

    class Policy:
        pass

    policy, reps = Policy(), [Replica([1.0, 2.0]), Replica([3.0, 0.0])]
    _acc_sum(policy, reps)  # from zeros: the sum of both
    assert all(r.acc[0].tolist() == [4.0, 2.0] for r in reps)
    reps[0].acc[0] += [1.0, 0.0]  # increments since that merge: 1, 0 and 0, 5
    reps[1].acc[0] += [0.0, 5.0]
    _acc_sum(policy, reps)
    assert all(r.acc[0].tolist() == [5.0, 7.0] for r in reps)
    assert parse_variant("x:cpu,cpu:sum_all:keep:0.5") == {
        "label": "x", "devices": "cpu,cpu", "params": "sum_all", "acc": "keep",
        "engine": {"row_weights": "sum_sqrt"}}
    assert parse_variant("x:cpu,cpu:default:sum")["engine"] == {}
    with pytest.raises(argparse.ArgumentTypeError, match="LABEL:DEVICES"):
        parse_variant("x:cpu,cpu:mean:keep")
    with pytest.raises(argparse.ArgumentTypeError, match="POW must be"):
        parse_variant("x:cpu,cpu:default:keep:1")


def test_merges_in_runs_time_the_solo_periods_beside_one_device_s_barriers(monkeypatch, capsys):
    """``bench_merge_cpu.py --in-runs`` with the logistic loss: the first periods go to one
    device alone (``solo_epochs``), and the row gives their median merge beside the median
    barrier of ``single`` at the same period."""
    import bench_merge_cpu

    from tests.test_estimator import tiny_data

    X, Y = tiny_data(n=600, n_features=300)
    monkeypatch.setattr(_common, "load_dataset", lambda name: (X, Y, X, Y))
    monkeypatch.setattr(_common, "warm_engine", lambda *a, **k: None)
    (row,) = bench_merge_cpu.in_runs(["tiny"], "cpu,cpu@0.5", 2.0, 1, "bce")
    assert row["loss"] == "bce" and row["solo_merges"] >= 1
    assert row["median_solo_merge_ms"] > 0 and row["median_single_barrier_ms"] >= 0
    assert row["median_other_merge_ms"] > 0  # the merges of every device after the phase
    assert len(capsys.readouterr().out.splitlines()[-1].split()) == 9
    (row,) = bench_merge_cpu.in_runs(["tiny"], "cpu,cpu@0.5", 1.0, 1, "softmax")
    assert row["solo_merges"] == 0 and row["median_single_barrier_ms"] is None


def test_merges_in_runs_alternate_the_split_of_w1_s_rows(monkeypatch):
    """``--shard-alternate``: within each run the merges alternate between the engine's split
    of the changed rows (from ``SHARD_MIN_VALUES`` values on) and one pass, the seed's parity
    choosing the first; the row lists each one's merges, and the engine's value and merge
    function are back in place afterwards."""
    import bench_merge_cpu

    from tests.test_estimator import tiny_data
    from xmc_engine.algorithms import base
    from xmc_engine.scheduler import merge

    X, Y = tiny_data(n=2000, n_features=300)  # two merge periods of 1,024 rows an epoch
    monkeypatch.setattr(_common, "load_dataset", lambda name: (X, Y, X, Y))
    monkeypatch.setattr(_common, "warm_engine", lambda *a, **k: None)
    seen = []
    real = merge.merge_changed_rows

    def spy(*args, **kwargs):
        seen.append(merge.SHARD_MIN_VALUES)
        return real(*args, **kwargs)

    monkeypatch.setattr(base, "merge_changed_rows", spy)
    engine = merge.SHARD_MIN_VALUES
    rows = bench_merge_cpu.in_runs(["tiny"], "cpu,cpu", 3.0, 2, "softmax", alternate=True)
    per_run = len(seen) // 2
    assert per_run >= 4 and len(seen) == 2 * per_run
    assert seen[:per_run:2] == [engine] * len(seen[:per_run:2])  # seed 0: split first
    assert seen[1:per_run:2] == [1 << 62] * len(seen[1:per_run:2])
    assert seen[per_run] == 1 << 62  # seed 1: one pass first
    for r in rows:  # each row-sparse merge timed once, under the way it ran
        assert len(r["split_merge_ms"]) + len(r["one_pass_merge_ms"]) == per_run
        assert abs(len(r["split_merge_ms"]) - len(r["one_pass_merge_ms"])) <= 1
        assert min(r["split_merge_ms"] + r["one_pass_merge_ms"]) > 0
    assert merge.SHARD_MIN_VALUES == engine and base.merge_changed_rows is spy


def test_a_sweep_writes_each_seed_as_it_ends_so_a_stopped_sweep_keeps_them(tmp_path, monkeypatch):
    """After every seed the sweep's file holds the runs so far (``complete`` false until the
    last seed): a sweep stopped in seed 2 leaves seeds 0 and 1 of every configuration, their
    times read against the target of what is there; a whole sweep ends ``complete``."""
    import bench_tta_sweep

    def fake_run(m, data, *, seed, **kw):
        if seed == 2 and stop["at"]:
            raise KeyboardInterrupt
        t = 1.0 + seed if m.algorithm == "adaptive" else 4.0 + seed
        return {"lr": 0.05, "best_P@1": 0.5, "final": {"P@1": 0.5}, "rows_single_share": None,
                "curve": [(t, 1.0, 0.5, 0, 0)]}

    monkeypatch.setattr(bench_tta_sweep._tta, "load_data", lambda name: (None, None, None, None))
    monkeypatch.setattr(bench_tta_sweep._tta, "run_method", fake_run)
    out = tmp_path / "sweep.json"
    argv = ["--data", "x", "--seeds", "0", "1", "2", "--out", str(out),
            "--config", '{"algorithm": "adaptive", "devices": "cpu,cpu"}',
            "--config", '{"algorithm": "single", "devices": "cpu"}']
    stop = {"at": True}
    with pytest.raises(KeyboardInterrupt):
        bench_tta_sweep.main(argv)
    saved = json.loads(out.read_text())
    assert saved["complete"] is False and saved["target_P@1"] == pytest.approx(0.97 * 0.5)
    assert [[r["seed"] for r in row["runs"]] for row in saved["rows"]] == [[0, 1], [0, 1]]
    assert [row["median_time_to_target_s"] for row in saved["rows"]] == [
        pytest.approx(1.5 * 0.97), pytest.approx(4.5 * 0.97)]
    stop["at"] = False
    assert bench_tta_sweep.main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["complete"] is True
    assert [len(row["runs"]) for row in saved["rows"]] == [3, 3]


def test_short_batch_drops_count_epoch_ends_and_mid_epoch_apart():
    """``bench_short_batch.drops``: a fall of more than the threshold from the evaluation
    before, counted at whole epochs and between them, with the largest fall at an epoch end."""
    from bench_short_batch import drops

    curve = [(0.5, 0.80), (1.0, 0.70), (1.5, 0.79), (1.75, 0.75), (2.0, 0.745), (2.5, 0.76)]
    out = drops(curve, 0.02)
    assert out == {"end": 1, "end_n": 2, "mid": 1, "mid_n": 3,
                   "largest_end": pytest.approx(0.10)}
    assert drops(curve, 0.2) == {**out, "end": 0, "mid": 0}


def test_sweep_drops_sums_each_algorithm_and_device_set_over_files(tmp_path):
    """``bench_short_batch.sweep_drops``: the drops of every run of a ``bench_tta_sweep.py``
    result, from its curves' (epoch, P@1) columns, summed per algorithm and device set across
    files; a file of another benchmark is refused by name."""
    from bench_short_batch import sweep_drops

    def row(algo, devices, curves):
        return {"config": {"algorithm": algo, "devices": devices},
                "runs": [{"curve": [[0.1 * i, e, p, 0.0] for i, (e, p) in enumerate(c)]}
                         for c in curves]}

    fall_at_end = [(0.5, 0.80), (1.0, 0.70), (1.5, 0.79)]
    level = [(0.5, 0.80), (1.0, 0.79), (1.5, 0.75)]
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(json.dumps({"benchmark": "tta_sweep", "rows": [
        row("adaptive", "cpu,cpu", [fall_at_end, level]), row("sync", "cpu,cpu", [level])]}))
    b.write_text(json.dumps({"benchmark": "tta_sweep", "rows": [
        row("adaptive", "cpu,cpu", [fall_at_end])]}))
    out = sweep_drops([a, b], 0.02)
    assert out[("adaptive", "cpu,cpu")] == {"end": 2, "end_n": 3, "mid": 1, "mid_n": 3,
                                            "largest_end": pytest.approx(0.10)}
    assert out[("sync", "cpu,cpu")] == {"end": 0, "end_n": 1, "mid": 1, "mid_n": 1,
                                        "largest_end": pytest.approx(0.01)}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "short_batch", "runs": {}}))
    with pytest.raises(SystemExit, match="other.json is not a bench_tta_sweep.py result"):
        sweep_drops([a, other], 0.02)


def test_count_short_batches_counts_the_epochs_last_batch():
    """One device, 1,000 rows at the default batch of 64, two epochs, no loss probe: 15 full
    batches and one of 40 rows an epoch."""
    from count_short_batches import count

    (dev,) = count("synthetic:1000:200:50", "cpu", "single", 2, 0, loss="softmax", threads=1)
    assert dev == {"device": 0, "steps": 32, "rows": 2000, "short_steps": 2, "short_rows": 80}


def test_tail_average_folds_each_evaluated_model_into_its_averages():
    """A half-life of almost nothing is the model itself; one of almost forever stays the first
    evaluated model while the model moves on; the run's own curve is the model's."""
    from bench_tail_average import averaged_evaluations

    Xtr, Ytr, Xte, Yte = load_data("synthetic:2000:300:60")
    rows: list[dict] = []
    with averaged_evaluations({"now": 1e-9, "frozen": 1e12}, rows):
        r = run_method(Method("single", "single", "cpu", threads=1), (Xtr, Ytr, Xte, Yte),
                       epochs=2, lr=None, batch_size=None, hidden=None, seed=0, optimizer=None,
                       lr_decay=None, loss="softmax", eval_every=0.25)
    assert len(rows) == len(r["curve"]) >= 4
    assert [row["model"] for row in rows] == [c[2] for c in r["curve"]]
    assert all(row["now"] == row["model"] for row in rows)
    assert all(row["frozen"] == rows[0]["model"] for row in rows)
    assert rows[-1]["model"] > rows[0]["model"] + 0.05  # the model moved; the frozen one not
