"""Run log: JSON lines, NaN as null, crash tolerance; plots drawn from synthetic logs."""

from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np
import pytest

from xmc_engine.runlog import RunLog, read_log


def test_records_and_file(tmp_path):
    t0 = time.perf_counter() - 100.0
    with RunLog(tmp_path / "run", t0=t0) as log:
        log.write("start", config={"lr": 0.1, "ks": (1, 3)}, algorithm="adaptive")
        log.write("eval", epoch=np.float32(1.0), samples=np.int64(500), train_time=1.5,
                  metrics={"P@1": np.float64(0.25), "P@3": float("nan"), "P@5": np.inf},
                  weights=np.array([0.5, 0.5]))
    text = (tmp_path / "run" / "log.jsonl").read_text()
    lines = text.splitlines()
    assert len(lines) == 2 and text.endswith("\n")
    assert "NaN" not in text and "Infinity" not in text
    recs = [json.loads(line) for line in lines]
    assert recs == log.records == read_log(tmp_path / "run")
    assert recs[0]["event"] == "start" and recs[0]["config"]["ks"] == [1, 3]
    assert recs[1]["metrics"] == {"P@1": 0.25, "P@3": None, "P@5": None}
    assert recs[1]["samples"] == 500 and recs[1]["weights"] == [0.5, 0.5]
    assert recs[0]["wall_time"] >= 100.0 and recs[1]["wall_time"] >= recs[0]["wall_time"]
    with pytest.raises(ValueError, match="closed"):
        log.write("eval")


def test_flushed_after_every_record(tmp_path):
    log = RunLog(tmp_path / "a.jsonl")
    log.write("eval", epoch=1)
    assert read_log(tmp_path / "a.jsonl")[0]["epoch"] == 1  # visible before close
    log.close()
    log.close()


def test_memory_only():
    log = RunLog(None)
    log.write("eval", x=1)
    assert log.path is None and log.records[0]["x"] == 1
    with pytest.raises(ValueError, match="wall_time"):
        log.write("eval", wall_time=3)


def test_truncated_last_line(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    with RunLog(tmp_path) as log:
        for e in range(3):
            log.write("eval", epoch=e)
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])  # the process died while writing the last record
    with caplog.at_level(logging.WARNING, logger="xmc_engine.runlog"):
        recs = read_log(tmp_path)
    assert [r["epoch"] for r in recs] == [0, 1]
    assert "truncated" in caplog.text
    # resuming appends after the last complete record
    with RunLog(tmp_path) as log:
        log.write("resume", epoch=2)
    assert [r["event"] for r in read_log(path)] == ["eval", "eval", "resume"]


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"event": "start"}\n{"event": \n{"event": "final"}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_log(path)


def test_concurrent_writers(tmp_path):
    log = RunLog(tmp_path)

    def work(i):
        for j in range(200):
            log.write("merge", device=i, j=j)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    assert len(read_log(tmp_path)) == 800


def _synthetic_run(run_dir, algorithm, devices, speed):
    with RunLog(run_dir) as log:
        log.write("start", algorithm=algorithm, devices=devices, config={"lr": 0.1})
        for e in range(1, 6):
            log.write("eval", epoch=e, samples=1000 * e, train_time=e / speed,
                      metrics={"P@1": 0.5 - 0.4 / e, "P@3": 0.4 - 0.3 / e})
        log.write("final", epoch=5, samples=5000, train_time=5 / speed,
                  metrics={"P@1": 0.42, "P@3": 0.34})


def test_plot_runs_png(tmp_path):
    from xmc_engine.plots import plot_runs

    _synthetic_run(tmp_path / "adaptive", "adaptive", "cpu*2,cpu*1:speed=0.5", 2.0)
    _synthetic_run(tmp_path / "sync", "sync", "cpu*2", 1.0)
    from xmc_engine.plots import _run_label

    assert _run_label(tmp_path / "sync", read_log(tmp_path / "sync")) == "sync (sync, cpu*2)"
    start = {"event": "start", "devices": [{"kind": "cpu"}], "config": {"devices": "cpu*2"}}
    assert _run_label(tmp_path / "r", [start]) == "r (cpu*2)"
    out = plot_runs([tmp_path / "adaptive", tmp_path / "sync" / "log.jsonl"],
                    tmp_path / "plots" / "p.png", metrics=("P@1", "P@3"))
    assert out == tmp_path / "plots" / "p.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert [p.name for p in out.parent.iterdir()] == ["p.png"]  # no temp file left
    from matplotlib.image import imread
    assert imread(out).shape[2] in (3, 4)


def test_plot_runs_without_data(tmp_path):
    from xmc_engine.plots import plot_runs

    with RunLog(tmp_path / "r") as log:
        log.write("start")
    with pytest.raises(ValueError, match="P@1"):
        plot_runs(tmp_path / "r", tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()


def test_plot_curve_of_a_resumed_run():
    from xmc_engine.plots import _curve

    def ev(t, p):
        return {"event": "eval", "train_time": t, "metrics": {"P@1": p}}

    records = [ev(1, 0.1), ev(2, 0.2), ev(3, 0.3), {"event": "start"}, ev(2.5, 0.25), ev(3.5, 0.35),
               {"event": "final", "train_time": 3.5, "metrics": {"P@1": 0.35}}]
    assert _curve(records, "P@1", "train_time") == ([1, 2, 2.5, 3.5], [0.1, 0.2, 0.25, 0.35])


class _FillingDisk:
    """A raw file whose writes stop with ENOSPC after ``room`` more bytes, until ``room`` is
    raised again (space freed); writes the bytes that fit to ``real`` first, as write(2) does."""

    def __init__(self, real, room: int):
        self.real, self.room = real, room

    def write(self, data) -> int:
        import errno

        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = self.real.write(bytes(data[:self.room]))
        self.room -= n
        return n

    def close(self):
        self.real.close()


def test_a_full_disk_loses_no_record_and_tears_none(tmp_path, caplog):
    log = RunLog(tmp_path)
    log.write("start", n=1)
    disk = _FillingDisk(log._file, room=10)  # the next record is cut after 10 bytes
    log._file = disk
    log.write("eval", samples=100)
    log.write("checkpoint_failed", samples=200)
    assert caplog.text.count("cannot write the run log") == 1  # warned once, not per record
    assert read_log(tmp_path)[-1]["event"] == "start"  # the torn line is not a record yet
    disk.room = 10**6  # space is back: the next write catches up, in order
    log.write("final", samples=300)
    log.close()
    assert [r["event"] for r in read_log(tmp_path)] == [
        "start", "eval", "checkpoint_failed", "final"]
    assert [r["event"] for r in log.records] == ["start", "eval", "checkpoint_failed", "final"]


def _documented_fields() -> dict[str, str]:
    """The run log's docstring cut into one text per event (``name`` at the start of a line)."""
    import re

    import xmc_engine.runlog as runlog

    parts = re.split(r"^``(\w+)``\n", runlog.__doc__, flags=re.M)
    return {parts[k]: parts[k + 1] for k in range(1, len(parts) - 1, 2)}


def test_every_field_a_training_run_writes_is_documented(tmp_path, monkeypatch):
    """The events and fields of real runs (one device with a loss probe, the plateau rule, an
    evaluation and checkpoints; every multi-device algorithm on two devices, ``adaptive`` with
    ``delta_stats``, each stopped by a time budget) against ``xmc_engine.runlog``'s
    docstring: a field the engine writes and the docstring does not name fails here."""
    from xmc_engine.datasets import make_synthetic

    from tests._helpers import script_heldout
    from xmc_engine import XMCClassifier

    X, Y, Xt, Yt = make_synthetic(n_train=2400, n_test=100, n_features=200, n_labels=30, seed=1)
    script_heldout(monkeypatch, 0.4)  # the rule stops early
    # (from the initialisation: continuing the probe's 20,000 samples would leave the rule
    # too few epochs to stop)
    runs = [XMCClassifier(epochs=12, threads=1, hidden=8, lr_decay="plateau", eval_every=4,
                          continue_probe=False, log_dir=tmp_path / "a",
                          checkpoint_every=2400).fit(X, Y, (Xt, Yt))]
    runs += [XMCClassifier(epochs=1, threads=1, hidden=8, algorithm=algorithm,
                           devices="cpu,cpu", loss="softmax", max_train_seconds=1e-4,
                           algorithm_params={"delta_stats": True} if algorithm == "adaptive"
                           else None).fit(X, Y, (Xt, Yt))
             for algorithm in ("adaptive", "average", "sync", "easgd", "crossbow")]
    docs = _documented_fields()
    seen = set()
    for m in runs:
        for rec in m.history_:
            event = rec["event"]
            seen.add(event)
            assert event in docs, f"event {event!r} is not documented in xmc_engine.runlog"
            for key in set(rec) - {"event", "wall_time"}:
                assert f"``{key}``" in docs[event], f"{event}: field {key!r} is not documented"
            for dev in rec.get("devices", []) if event == "merge" else []:
                for key in dev:
                    assert f"``{key}``" in docs[event], f"merge devices: {key!r} undocumented"
    assert {"start", "loss_probe", "compile", "eval", "plateau", "plateau_stop", "checkpoint",
            "merge", "time_budget", "final"} <= seen
