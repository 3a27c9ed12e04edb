"""Bad input and hostile conditions at the command line: one line on stderr and exit 2 (bad input)
or 1 (a result that could not be written), never a traceback, never a half-written run folder.

Runs ``xmc_engine.cli.main(argv)`` in this process (fast); the lock tests that need a second,
dying process start one.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp
from xmc_engine.datasets import save_xc

from tests._helpers import write_tiny_xc
from xmc_engine.checkpoint import CheckpointManager
from xmc_engine.cli import main
from xmc_engine.runlock import LOCK_NAME, RunLock
from xmc_engine.runlog import read_log

TRAIN = ("--hidden", 16, "--epochs", 2, "--batch-size", 32, "--optimizer", "sgd", "--lr", 0.5,
         "--eval-every", 0)


def cli(capsys, *argv):
    """``(exit status, stdout, stderr)`` of ``xmc-engine ARGV`` run in this process."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse: usage errors exit 2
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def bad(capsys, *argv, needle: str, rc: int = 2) -> str:
    """Run ``argv``, assert it fails with ``rc`` and one clear line holding ``needle``."""
    code, _, err = cli(capsys, *argv)
    assert code == rc, (argv, code, err)
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert needle in line, (needle, line)
    return line


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("XMC_PROGRESS", "0")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_tiny_xc(tmp_path_factory.mktemp("data"), n=400, n_train=300)


def random_xc(path, n, n_features, n_labels, with_labels=True, seed=0):
    rng = np.random.default_rng(seed)
    X = sp.random(n, n_features, density=0.3, format="csr", dtype=np.float32, random_state=rng)
    Y = sp.random(n, n_labels, density=0.3 if with_labels else 0.0, format="csr",
                  random_state=rng)
    Y.data[:] = 1
    return save_xc(path, X, Y)


@pytest.fixture(scope="module")
def model(files, tmp_path_factory):
    """A trained run folder on ``files`` (60 features, 25 labels)."""
    run = tmp_path_factory.mktemp("run") / "run"
    assert main(["train", "--data", str(files), *map(str, TRAIN), "--out", str(run)]) == 0
    return run / "model"


# -- the seven rows of issue 17 -------------------------------------------------------------------
def test_train_with_a_test_file_of_another_feature_count(files, tmp_path, capsys):
    other = random_xc(tmp_path / "other.txt", 20, 33, 25)
    run = tmp_path / "run"
    line = bad(capsys, "train", "--data", files / "train.txt", "--test", other, *TRAIN,
               "--out", run, needle="33 features")
    assert "60 features" in line and "other.txt" in line
    assert not run.exists()  # nothing half-written


def test_evaluate_with_a_file_of_another_feature_count(model, tmp_path, capsys):
    other = random_xc(tmp_path / "other.txt", 20, 33, 25)
    line = bad(capsys, "evaluate", model, "--data", other, needle="33 features")
    assert "trained on 60 features" in line


def test_predict_top_k_zero_is_refused(model, files, tmp_path, capsys):
    out = tmp_path / "pred.txt"
    code, _, err = cli(capsys, "predict", model, "--data", files, "--top-k", 0, "--out", out)
    assert code == 2 and "--top-k: '0' must be >= 1" in err and "Traceback" not in err
    assert not out.exists()


def test_predict_top_k_above_the_label_count_is_clamped_with_a_note(model, files, tmp_path,
                                                                    capsys):
    out = tmp_path / "pred.txt"
    code, stdout, err = cli(capsys, "predict", model, "--data", files, "--top-k", 100000,
                            "--out", out)
    assert code == 0 and "--top-k 100000 is more than the model's 25 labels" in err
    assert "wrote top-25 for 100 rows" in stdout
    lines = out.read_text().splitlines()
    assert len(lines) == 100 and all(len(x.split()) == 25 for x in lines)
    assert all(len({t.split(":")[0] for t in x.split()}) == 25 for x in lines)  # each label once


def test_train_on_a_two_row_file_leaves_propensity_metrics_out(files, tmp_path, capsys,
                                                               caplog):
    tiny = random_xc(tmp_path / "two.txt", 2, 60, 25)
    run = tmp_path / "run"
    code, out, err = cli(capsys, "train", "--data", tiny, "--test", files / "test.txt", *TRAIN,
                         "--out", run)
    assert code == 0, err
    assert "P@1" in out and "PSP" not in out
    assert "PSP@k and PSnDCG@k left out" in caplog.text and "trained on 2" in caplog.text
    final = read_log(run)[-1]
    assert final["event"] == "final" and "P@1" in final["metrics"]
    assert not any(k.startswith("PS") for k in final["metrics"])
    code, out, _ = cli(capsys, "evaluate", run / "model", "--data", files / "test.txt")
    assert code == 0 and "P@1" in out and "PSP" not in out


@pytest.mark.parametrize("case", ["0 rows", "1 row", "one label", "no row with a label"])
def test_tiny_datasets_train_or_are_refused_with_a_message(case, tmp_path, capsys):
    n, n_labels, with_labels = {"0 rows": (0, 5, True), "1 row": (1, 5, True),
                                "one label": (30, 1, True),
                                "no row with a label": (30, 5, False)}[case]
    data = random_xc(tmp_path / "d.txt", n, 20, n_labels, with_labels)
    test = random_xc(tmp_path / "t.txt", 10, 20, n_labels, seed=1)
    run = tmp_path / "run"
    argv = ("train", "--data", data, "--test", test, *TRAIN, "--out", run)
    if case == "0 rows":
        bad(capsys, *argv, needle="0 rows")
        assert not run.exists()
        return
    code, out, err = cli(capsys, *argv)
    assert code == 0 and "Traceback" not in err and (run / "model" / "params.npz").exists()
    assert "P@1" in out
    if case == "no row with a label":
        assert "no training row has a label" in err


def test_disk_full_during_checkpoints_is_reported_and_retried(files, tmp_path, capsys, caplog,
                                                              monkeypatch):
    """ENOSPC from the 2nd and 3rd checkpoint writes: each is logged as ``checkpoint_failed``
    naming the last good one, training goes on, the 4th write succeeds."""
    failing = full_disk(monkeypatch, lambda path, calls: path.name.startswith(".ckpt-")
                        and calls in (2, 3))
    run = tmp_path / "run"
    code, _, err = cli(capsys, "train", "--data", files, *TRAIN[:2], "--epochs", 5, *TRAIN[4:],
                       "--checkpoint-every", 100, "--out", run)  # one checkpoint per epoch
    assert code == 0 and "Traceback" not in err
    assert failing.failed == 2
    log = read_log(run)
    kinds = [r["event"] for r in log if r["event"].startswith("checkpoint")]
    assert kinds[:4] == ["checkpoint", "checkpoint_failed", "checkpoint_failed", "checkpoint"]
    first = next(r for r in log if r["event"] == "checkpoint")
    failed = [r for r in log if r["event"] == "checkpoint_failed"]
    assert all(r["last_checkpoint"] == first["path"] and "No space left" in r["error"]
               for r in failed)
    assert "training continues" in caplog.text and first["path"] in caplog.text
    assert log[-1]["event"] == "final" and log[-1]["samples"] == 5 * 300
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_disk_full_for_the_final_model_names_the_last_good_checkpoint(files, tmp_path, capsys,
                                                                       monkeypatch):
    full_disk(monkeypatch, lambda path, calls: path.parent.name.startswith("model.tmp-"))
    run = tmp_path / "run"
    line = bad(capsys, "train", "--data", files, *TRAIN, "--checkpoint-every", 100, "--out", run,
               needle="could not write the model", rc=1)
    newest = CheckpointManager(run).paths()[0]
    assert "No space left" in line and f"last good checkpoint is {newest}" in line
    assert f"--resume {run}" in line
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith("ckpt-")) == [
        "log.jsonl", "run.json"]  # no model folder, no temporary folder, no lock


class _FullDisk:
    """``numpy.savez`` that writes part of the file and then fails with ENOSPC when ``when(path,
    call_number)`` says so (the path is the temporary file being written)."""

    def __init__(self, when, savez):
        self.when, self.savez = when, savez
        self.calls = self.failed = 0

    def __call__(self, file, *args, **kwargs):
        from pathlib import Path

        path = Path(os.readlink(f"/proc/self/fd/{file.fileno()}"))
        if path.name.startswith(".ckpt-"):
            self.calls += 1
        if self.when(path, self.calls):
            self.failed += 1
            file.write(b"PK\x03\x04 partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.savez(file, *args, **kwargs)


def full_disk(monkeypatch, when) -> _FullDisk:
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to see which file is written")
    fake = _FullDisk(when, np.savez)
    monkeypatch.setattr(np, "savez", fake)
    return fake


# -- a run folder belongs to one run --------------------------------------------------------------
def test_second_train_on_a_busy_folder_stops_at_once(files, tmp_path, capsys):
    run = tmp_path / "run"
    with RunLock(run):  # a live run in this process holds the folder
        line = bad(capsys, "train", "--data", files, *TRAIN, "--out", run, needle="in use by")
        assert f"pid {os.getpid()}" in line and "choose another --out" in line
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # nothing else written
    assert not run.exists()


def test_a_finished_run_folder_is_not_reused_by_a_new_run(files, tmp_path, capsys):
    run = tmp_path / "run"
    assert cli(capsys, "train", "--data", files, *TRAIN, "--out", run)[0] == 0
    before = (run / "log.jsonl").read_bytes()
    bad(capsys, "train", "--data", files, *TRAIN, "--out", run, needle=f"--resume {run}")
    assert (run / "log.jsonl").read_bytes() == before  # not one record of another run added


def _hold_lock(run):
    """A child process that holds ``run``'s lock until it is killed."""
    code = ("import sys; from xmc_engine.runlock import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_two_runs_on_one_folder_and_a_stale_lock_taken_over(files, tmp_path, capsys, caplog):
    run = tmp_path / "run"
    holder = _hold_lock(run)
    try:
        bad(capsys, "train", "--data", files, *TRAIN, "--out", run, needle=f"pid {holder.pid}")
        (run / "run.json").write_text(json.dumps({"config": {}, "data": str(files)}))
        bad(capsys, "train", "--resume", run, needle="in use by")
    finally:
        holder.kill()  # SIGKILL: the lock file stays, naming a dead pid
        holder.wait()
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == holder.pid
    (run / "run.json").unlink()
    code, _, err = cli(capsys, "train", "--data", files, *TRAIN, "--out", run)
    assert code == 0, err
    assert f"taking over the lock of pid {holder.pid}" in caplog.text
    assert not (run / LOCK_NAME).exists()
    starts = [r for r in read_log(run) if r["event"] == "start"]
    assert len(starts) == 1


def test_lock_from_another_host_is_not_taken_over(tmp_path):
    from xmc_engine.errors import RunFolderBusy

    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere.example"}))
    with pytest.raises(RunFolderBusy, match=f"delete {run / LOCK_NAME}"):
        RunLock(run).acquire()
    assert (run / LOCK_NAME).exists()


# -- other doors ---------------------------------------------------------------------------------
def test_other_bad_outputs_and_inputs(model, files, tmp_path, capsys):
    bad(capsys, "predict", model, "--data", files, "--out", tmp_path / "no" / "p.txt",
        needle="does not exist")
    bad(capsys, "predict", model, "--data", files, "--out", tmp_path, needle="is a folder")
    (tmp_path / "afile").write_text("x")
    bad(capsys, "train", "--data", files, *TRAIN, "--out", tmp_path / "afile",
        needle="not a folder")
    bad(capsys, "train", "--data", files, "--epochs", "inf", needle="not a finite number")
    bad(capsys, "train", "--data", files, "--hidden", "8,x", needle="comma-separated")
    bad(capsys, "plot", tmp_path, needle="no log.jsonl")
    bad(capsys, "plot", model.parent, "--metric", "P@9", needle="check --metric")
    bad(capsys, "train", "--resume", model, needle="not a run folder")


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, all but ``free`` pages taken by a filler file (needs root); skipped where
    it cannot be mounted."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode})")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def fill(mnt, leave: int):
    """Fill ``mnt`` with ``mnt/filler`` but ``leave`` bytes; returns the filler."""
    st = os.statvfs(mnt)
    filler = mnt / "filler"
    filler.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - leave))
    return filler


def test_a_real_full_disk_keeps_the_last_good_checkpoint_and_resume_finishes(files, small_disk,
                                                                             capsys):
    """On a tmpfs with room for about one checkpoint: the run ends with exit 1 naming the last
    good checkpoint; once space is freed, --resume finishes the run from it."""
    run = small_disk / "run"
    filler = fill(small_disk, leave=24 * 1024)
    code, _, err = cli(capsys, "train", "--data", files, *TRAIN, "--checkpoint-every", 100,
                       "--out", run)
    assert code == 1 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    newest = CheckpointManager(run).paths()[0]
    assert "No space left" in line and f"last good checkpoint is {newest}" in line
    assert not (run / "model").exists()
    filler.unlink()
    code, out, err = cli(capsys, "train", "--resume", run)
    assert code == 0, err
    log = read_log(run)
    (resumed,) = [r for r in log if r["event"] == "start" and r["resumed"]]
    before = log[:log.index(resumed)]
    assert [r["event"] for r in before].count("checkpoint_failed") >= 1
    assert resumed["samples"] == [r for r in before if r["event"] == "checkpoint"][-1]["samples"]
    assert log[-1]["event"] == "final" and (run / "model" / "params.npz").exists()
