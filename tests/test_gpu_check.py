"""bench/gpu_check.py without a GPU: its argument parsing, the section runner (a failing section is
recorded and the next still runs, the JSON is valid after every section, the budget skips the
rest with a reason), the child processes (killed at the limit, crashed, reporting), the exit
without CUDA, an import without CuPy, and every section's own code on the CPU backend."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402
import gpu_check as gc  # noqa: E402

# -- arguments -------------------------------------------------------------------------------------


def test_defaults_follow_out_and_the_checkout(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.delenv("XMC_GPU_CHECK_DATA", raising=False)
    a = gc.parse_args([])
    assert a.out == tmp_path
    assert a.data == _common.REPO_DIR / "data" / "delicious"
    assert a.sections == list(gc.SECTION_ORDER)
    assert (a.device, a.budget, a.cpu_p1, a.child) == ("cuda:0", gc.DEFAULT_BUDGET_S, {}, None)
    monkeypatch.delenv("OUT")
    monkeypatch.setenv("XMC_GPU_CHECK_DATA", "/x/delicious")
    a = gc.parse_args([])
    assert a.out == _common.RESULTS_DIR / "gpu" and a.data == Path("/x/delicious")


def test_sections_and_cpu_p1_are_parsed():
    a = gc.parse_args(["--sections", "sync, kernels", "--cpu-p1", "fit_single=0.6",
                       "--cpu-p1", "adaptive=0.59", "--device", "cpu", "--budget", "60"])
    assert a.sections == ["sync", "kernels"]
    assert a.cpu_p1 == {"fit_single": 0.6, "adaptive": 0.59}
    assert (a.device, a.budget) == ("cpu", 60.0)


@pytest.mark.parametrize("argv, message", [
    (["--sections", "kernels,gemm"], "unknown section 'gemm'"),
    (["--sections", "sync,sync"], "names a section twice"),
    (["--sections", ","], "--sections is empty"),
    (["--cpu-p1", "kernels=0.5"], "expected SECTION=P@1"),
    (["--cpu-p1", "sync=high"], "'high' is not a number"),
    (["--cpu-p1", "sync=1.5"], "P@1 must be in [0, 1]"),
    (["--device", "gpu0"], "expected cuda:N or cpu"),
    (["--budget", "0"], "must be > 0"),
    (["--child", "kernels"], "--child needs --child-out"),
])
def test_bad_arguments_exit_2_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        gc.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# -- the runner ------------------------------------------------------------------------------------

def _args(tmp_path, *extra):
    return gc.parse_args(["--out", str(tmp_path), "--device", "cpu", *extra])


def _in_process(args):
    """An executor that runs the section here (what a child does)."""
    return lambda section, limit: gc.run_section_here(section, gc.Context(args, limit))


def test_a_failing_section_is_recorded_and_the_next_still_runs(tmp_path):
    def broken(ctx):
        ctx.put("before", 1)
        raise RuntimeError("kernel exploded")

    def wrong(ctx):
        ctx.check("agrees", False, diff=0.5)
        ctx.check("finite", True)

    def skipped(ctx):
        raise gc.SectionSkipped("no data here")

    def fine(ctx):
        ctx.put("x", np.float32(2.5))
        ctx.target("fast", False, ratio=0.5)

    sections = [gc.Section("kernels", broken, 10), gc.Section("fit_single", wrong, 10),
                gc.Section("sync", skipped, 10), gc.Section("adaptive", fine, 10)]
    args = _args(tmp_path, "--sections", "kernels,fit_single,sync,adaptive")
    report = gc.new_report(args, {"command": "python bench/gpu_check.py", "git_commit": None,
                                  "machine": {}})
    path = tmp_path / "r.json"
    seen = []

    def write(r):
        _common.write_json(path, r)
        seen.append(json.loads(path.read_text()))  # valid JSON after every write

    gc.run_sections(sections, _in_process(args), report, write, budget_s=100)
    s = report["sections"]
    assert s["kernels"]["status"] == "failed"
    assert s["kernels"]["reason"] == "RuntimeError: kernel exploded"
    assert "kernel exploded" in s["kernels"]["traceback"]
    assert s["kernels"]["figures"] == {"before": 1}
    assert s["fit_single"]["status"] == "failed"
    assert s["fit_single"]["reason"] == "checks failed: agrees"
    assert (s["sync"]["status"], s["sync"]["reason"]) == ("skipped", "no data here")
    assert s["adaptive"]["status"] == "passed"  # a missed target does not fail a section
    assert s["adaptive"]["figures"]["targets"]["fast"] == {"met": False, "ratio": 0.5}
    assert report["summary"] == {"passed": ["adaptive"], "failed": ["kernels", "fit_single"],
                                 "skipped": ["sync"], "pending": []}
    # one write when each section starts, one when it ends, one at the end
    assert len(seen) == 2 * len(sections) + 1
    assert seen[0]["sections"]["kernels"]["status"] == "running"
    assert seen[0]["sections"]["sync"]["status"] == "pending"
    assert seen[1]["sections"]["kernels"]["status"] == "failed"
    assert seen[1]["finished"] is False and seen[-1]["finished"] is True
    assert seen[-1]["sections"]["adaptive"]["figures"]["x"] == 2.5


def test_the_budget_caps_each_limit_and_skips_the_rest_with_a_reason(tmp_path):
    now = [0.0]
    limits = []

    def execute(section, limit):
        limits.append(limit)
        now[0] += 50.0  # every section takes 50 s
        return {"status": "passed", "figures": {}}

    sections = [gc.Section(n, None, 60) for n in ("kernels", "fit_single", "throughput", "sync")]
    args = _args(tmp_path, "--sections", "kernels,fit_single,throughput,sync")
    report = gc.new_report(args, {})
    writes = []
    gc.run_sections(sections, execute, report, writes.append, budget_s=120, min_start_s=25,
                    clock=lambda: now[0])
    assert limits == [60, 60]  # 120 and 70 s left; then 20 s
    s = report["sections"]
    assert [s[n]["status"] for n in ("kernels", "fit_single")] == ["passed", "passed"]
    for n in ("throughput", "sync"):
        assert s[n] == {"status": "skipped", "reason": "time budget spent: 20 s left of 120 s "
                                                       "(a section starts with >= 25 s)"}
    assert report["summary"]["skipped"] == ["throughput", "sync"]
    now[0] = 0.0
    limits.clear()
    gc.run_sections(sections[:1], execute, gc.new_report(args, {}), writes.append,
                    budget_s=40, clock=lambda: now[0])
    assert limits == [40]  # a section gets no more than what is left


# -- child processes -------------------------------------------------------------------------------

FAKE_CHILD = """
import json, sys, time
out = sys.argv[sys.argv.index("--child-out") + 1]
mode = sys.argv[sys.argv.index("--mode") + 1]
name = sys.argv[sys.argv.index("--child") + 1]
print("child", name, "limit", sys.argv[sys.argv.index("--child-limit") + 1], flush=True)
if mode == "crash":
    sys.exit(3)
json.dump({"status": "running", "figures": {"partial": 1}}, open(out, "w"))
if mode == "hang":
    time.sleep(60)
json.dump({"status": "passed", "figures": {"done": 1}}, open(out, "w"))
if mode == "stuck":
    time.sleep(60)
"""


@pytest.mark.parametrize("mode, status, reason, figures, exit_note", [
    ("ok", "passed", None, {"done": 1}, None),
    ("hang", "failed", "time limit: killed after 2 s", {"partial": 1}, None),
    ("crash", "failed", "the child process ended with exit status 3 before reporting", {}, None),
    ("stuck", "passed", None, {"done": 1}, "killed after 2 s after reporting"),
])
def test_a_child_reports_or_is_killed_or_crashes(tmp_path, mode, status, reason, figures,
                                                 exit_note):
    script = tmp_path / "child.py"
    script.write_text(FAKE_CHILD)
    lines = []
    execute = gc.make_child_executor(script, ["--mode", mode], tmp_path, lines.append,
                                     grace_s=0.5)
    t = time.monotonic()
    out = execute(gc.Section("kernels", None, 100), 1.5)
    assert time.monotonic() - t < 30
    assert out["status"] == status and out.get("reason") == reason
    assert out["figures"] == figures and out.get("exit") == exit_note
    assert lines[0] == "child kernels limit 1.5\n"


def test_child_command_forwards_the_arguments(tmp_path):
    cmd = gc.child_command(Path("gpu_check.py"), ["--device", "cpu"], "sync", 42.0,
                           tmp_path / "sync.json")
    assert cmd[1:] == ["gpu_check.py", "--device", "cpu", "--child", "sync", "--child-out",
                       str(tmp_path / "sync.json"), "--child-limit", "42.0"]
    a = gc.parse_args(cmd[2:])
    assert (a.child, a.child_out, a.child_limit, a.device) == ("sync", tmp_path / "sync.json",
                                                               42.0, "cpu")


# -- without CUDA ----------------------------------------------------------------------------------

def test_without_cuda_it_says_why_and_exits_0_with_a_skipped_report(tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)  # importing cupy now fails
    argv = ["--out", str(tmp_path), "--sections", "kernels,sync", "--commit", "abc123"]
    assert gc.main(argv) == 0
    assert "SKIPPED: no CUDA device" in capsys.readouterr().out
    r = json.loads((tmp_path / gc.REPORT_NAME).read_text())
    assert r["status"] == "skipped" and r["finished"] is True
    assert r["git_commit"] == "abc123"
    assert r["command"].startswith("python bench/gpu_check.py --out ")
    assert "numba-cuda" in r["machine"]["gpu_libraries"]
    assert set(r["sections"]) == {"kernels", "sync"}
    assert all(s["status"] == "skipped" and "no CUDA device" in s["reason"]
               for s in r["sections"].values())
    assert "SKIPPED" in (tmp_path / gc.LOG_NAME).read_text()


def test_the_script_imports_without_cupy_or_torch():
    code = textwrap.dedent(f"""
        import sys
        sys.modules["cupy"] = None
        sys.modules["torch"] = None
        sys.path.insert(0, {str(BENCH)!r})
        import gpu_check
        assert callable(gpu_check.main)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- pure helpers ----------------------------------------------------------------------------------

def test_history_troubles_names_the_bad_events():
    ok = [{"event": "start"}, {"event": "merge"}, {"event": "final"}]
    assert gc.history_troubles(ok) == []
    bad = [{"event": "start"}, {"event": "nonfinite"}, {"event": "device_dropped"}]
    assert gc.history_troubles(bad) == ["nonfinite", "device_dropped", "no final"]


def test_fit_specs_pair_the_device_with_its_cpu_reference():
    assert gc.fit_specs("fit_single", "cuda:0") == ("single", "cuda:0", "cpu", None)
    assert gc.fit_specs("sync", "cuda:0") == ("sync", "cuda:0,cuda:0", "cpu,cpu", None)
    assert gc.fit_specs("adaptive", "cuda:0") == ("adaptive", "cuda:0,cuda:0@0.5",
                                                  "cpu,cpu@0.5", gc.ADAPTIVE_PARAMS)
    with pytest.raises(ValueError, match="'kernels' is not a fit section"):
        gc.fit_specs("kernels", "cuda:0")


def test_throughput_figures():
    assert gc.throughput_shape(1.0) == {"n_features": 135_909, "n_labels": 670_091,
                                        "hidden": 128, "batch_size": 256}
    assert gc.throughput_shape(1e-9)["n_labels"] == 1
    assert gc.projected_epoch_s(49_044.9) == pytest.approx(10.0)
    assert gc.projected_epoch_s(0.0) == float("inf")
    assert gc.gemm_share({"a": 0.001, "b": 0.002}, 0.004) == pytest.approx(0.75)


# -- the sections' own code on the CPU backend -----------------------------------------------------

def test_kernel_section_passes_on_a_correct_backend_and_catches_a_wrong_one(tmp_path,
                                                                            monkeypatch):
    args = _args(tmp_path)
    out = gc.run_section_here(gc.SECTIONS["kernels"], gc.Context(args, 600))
    assert out["status"] == "passed", out.get("reason")
    checks = out["figures"]["checks"]
    for name in ("sparse_forward", "output_layer_step chunk=300 W2", "topk", "elastic diff",
                 "adagrad_dense w", "adagrad_rows acc", "predict_scores_topk chunk=300",
                 "gather_columns b2", "adagrad_columns acc_W2", "sampled_output_grad bce dH",
                 "sampled_output_grad softmax loss", "merge_rows norm change", "copy_columns",
                 "merge_rows reports a NaN"):
        assert checks[name]["ok"]

    real = gc.engine_backend

    def broken_backend(device):
        be = real(device)
        be.relu_backward = lambda dH, H: dH  # forgets to zero the inactive units

        def no_momentum(*a):
            raise RuntimeError("launch failed")
        be.momentum = no_momentum
        gather = be.gather_columns

        def gather_stale_bias(W2, b2, cols, W2s, b2s):  # leaves b2s as it was
            gather(W2, b2, cols, W2s, b2s.copy())
        be.gather_columns = gather_stale_bias
        return be

    monkeypatch.setattr(gc, "engine_backend", broken_backend)
    out = gc.run_section_here(gc.SECTIONS["kernels"], gc.Context(args, 600))
    assert out["status"] == "failed"
    checks = out["figures"]["checks"]
    assert not checks["relu_backward"]["ok"]
    assert not checks["merge_and_adagrad ran"]["ok"]
    assert "launch failed" in checks["merge_and_adagrad ran"]["error"]
    assert not checks["gather_columns b2"]["ok"] and checks["gather_columns W2"]["ok"]
    assert not checks["sampled_output_grad softmax loss"]["ok"]  # the gradient gathers too
    assert checks["weighted_sum"]["ok"] and checks["softmax_xent dZ"]["ok"]  # the rest ran
    assert checks["merge_columns"]["ok"]
    assert out["reason"].startswith("checks failed: relu_backward, merge_and_adagrad ran, "
                                    "gather_columns b2")


def test_kernel_section_runs_on_the_cuda_backend_stand_in(tmp_path, monkeypatch):
    """Every check of the kernels section calls the CUDA backend as it expects (host or device
    arrays, streams): over tests/fake_cupy.py (NumPy kernels) the section passes and the
    stand-in's ledger shows no unordered access, so a device run spends its time on the
    kernels, not on the check's own mistakes."""
    from tests import fake_cupy

    ledger = fake_cupy.install(monkeypatch, n_devices=1)
    from xmc_engine.backends.cuda import CUDABackend

    monkeypatch.setattr(gc, "engine_backend",
                        lambda device: CUDABackend(0, launch=fake_cupy.launch))
    out = gc.run_section_here(gc.SECTIONS["kernels"], gc.Context(_args(tmp_path), 600))
    assert out["status"] == "passed", out.get("reason")
    assert len(out["figures"]["checks"]) > 60
    assert ledger.hazards == [] and ledger.null_stream_ops == []


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from xmc_engine.datasets import make_synthetic, save_xc

    d = tmp_path_factory.mktemp("tiny")
    X, Y, Xt, Yt = make_synthetic("default", n_train=1500, n_test=400, n_features=300,
                                  n_labels=60, seed=0)
    save_xc(d / "train.txt", X, Y)
    save_xc(d / "test.txt", Xt, Yt)
    return d


def test_fit_section_compares_with_the_cpu_run(tmp_path, tiny_data):
    args = _args(tmp_path, "--data", str(tiny_data), "--epochs", "1")
    out = gc.run_section_here(gc.SECTIONS["fit_single"], gc.Context(args, 600))
    assert out["status"] == "passed", out.get("reason")
    f = out["figures"]
    assert f["device_run"]["P@1"] == f["cpu_run"]["P@1"]  # the same seed on the same device
    assert f["params"]["devices"] == "cpu" and f["data"]["n_train"] == 1500
    args = _args(tmp_path, "--data", str(tiny_data), "--epochs", "1", "--cpu-p1",
                 "fit_single=0.0")
    out = gc.run_section_here(gc.SECTIONS["fit_single"], gc.Context(args, 600))
    assert out["status"] == "failed" and "cpu_run" not in out["figures"]
    assert out["reason"] == "checks failed: |P@1 - CPU P@1| <= 0.01"


def test_fit_section_without_data_is_skipped_with_the_fix(tmp_path):
    args = _args(tmp_path, "--data", str(tmp_path / "missing"))
    out = gc.run_section_here(gc.SECTIONS["sync"], gc.Context(args, 600))
    assert out["status"] == "skipped"
    assert "copy ../shared/data/delicious there" in out["reason"]


def test_throughput_end_to_end_through_a_child(tmp_path):
    """The whole command on the CPU: argument forwarding, the child, the report and the log."""
    rc = gc.main(["--device", "cpu", "--sections", "throughput", "--scale", "0.001",
                  "--steps", "2", "--fit-steps", "2", "--out", str(tmp_path)])
    r = json.loads((tmp_path / gc.REPORT_NAME).read_text())
    t = r["sections"]["throughput"]
    assert rc == 0 and t["status"] == "passed", t.get("reason")
    f = t["figures"]
    assert f["shape"]["n_labels"] == 670 and f["engine_step"]["steps"] == 2
    assert set(f["gemms_ms"]) == {"forward H@W2", "backward dZ@W2.T", "update W2 += H.T@dZ"}
    assert f["single_fit"]["samples"] == 512 and f["projected_epoch_s"] > 0
    prof = f["single_fit_profile"]  # the same fit under the stack sampler
    assert prof["samples"] > 0 and prof["total"] and prof["project_self"]
    assert any("gpu_check.py:engine_fit" == r["function"].split("/")[-1]
               for r in prof["total"]), prof["total"][:5]
    # the epoch goal is for the full shape only (with PyTorch installed the step comparison
    # against it is a target too)
    assert not any(k.startswith("projected Amazon-670K epoch") for k in f.get("targets", {}))
    assert "torch_step" in f
    assert r["finished"] and r["summary"]["passed"] == ["throughput"]
    assert "[throughput] check engine loss finite" in (tmp_path / gc.LOG_NAME).read_text()
