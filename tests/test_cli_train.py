"""``xmc-engine train | evaluate | predict | plot`` through a subprocess, on tiny data."""

from __future__ import annotations

import json

import pytest

from tests._helpers import run_cli, script_heldout, write_tiny_xc


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_tiny_xc(tmp_path_factory.mktemp("data"), n=400, n_train=300)


def test_print_config_and_config_file(tmp_path):
    out = run_cli("train", "--print-config", "--hidden", "64,32", "--lr", "0.25").stdout
    cfg = json.loads(out)
    assert cfg["hidden"] == [64, 32] and cfg["lr"] == 0.25
    cfg["epochs"] = 3
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    again = json.loads(run_cli("train", "--config", tmp_path / "c.json", "--print-config").stdout)
    assert again == cfg
    (tmp_path / "bad.json").write_text(json.dumps({**cfg, "hidden_size": 3}))
    bad = run_cli("train", "--config", tmp_path / "bad.json", "--print-config", check=False)
    assert bad.returncode == 2 and "unknown key" in bad.stderr and "Traceback" not in bad.stderr


def test_lr_decay_takes_a_number_or_a_rule_name():
    for given, want in (("0.25", 0.25), ("plateau", "plateau"), ("auto", "auto")):
        cfg = json.loads(run_cli("train", "--print-config", "--lr-decay", given).stdout)
        assert cfg["lr_decay"] == want
    assert json.loads(run_cli("train", "--print-config").stdout)["lr_decay"] == "auto"
    bad = run_cli("train", "--print-config", "--lr-decay", "slow", check=False)
    assert bad.returncode == 2 and "'slow' is not a number, 'plateau' or 'auto'" in bad.stderr


def test_continue_probe_is_on_unless_switched_off():
    assert json.loads(run_cli("train", "--print-config").stdout)["continue_probe"] is True
    cfg = json.loads(run_cli("train", "--print-config", "--no-continue-probe").stdout)
    assert cfg["continue_probe"] is False


def test_a_probed_run_says_it_went_on_from_the_winning_fit(tmp_path):
    data = write_tiny_xc(tmp_path / "data", n=2600, n_train=2400)
    out = run_cli("train", "--data", data, "--hidden", 8, "--epochs", 10, "--threads", 1,
                  "--eval-every", 0, "--out", tmp_path / "run").stdout
    line = next(x for x in out.splitlines() if x.startswith("loss:"))
    assert "held-out P@1: softmax " in line and "; training went on from the " in line, line
    assert "(it needs +2)" in line, line  # the exact layer's margin, from the probe's record
    start = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["samples"] > 0
    rate = next(x for x in out.splitlines() if x.startswith("rate:"))
    assert rate.startswith(f"rate:  lr {start['lr']:g}, "), rate
    assert ("no decay (auto: the loss probe found the softmax" in rate) == (
        start["loss"] == "softmax"), (rate, start["loss"])  # the probe compared the losses


@pytest.mark.parametrize("start, says", [
    ({"lr": 0.1, "lr_decay": 0.5, "config": {"lr_decay": "auto", "optimizer": "adagrad"}},
     "lr 0.1, decay 0.5 (lr / (1 + 0.5 e) in epoch e)"),
    ({"lr": 0.05, "lr_decay": 0.0, "config": {"lr_decay": "auto", "optimizer": "adagrad"}},
     "lr 0.05, no decay (auto: the loss probe found the softmax clearly ahead; --lr-decay 0.5 "
     "decays it)"),
    ({"lr": 0.05, "lr_decay": 0.0, "config": {"lr_decay": 0.0, "optimizer": "adagrad"}},
     "lr 0.05, no decay"),
    ({"lr": 2.0, "lr_decay": 0.0, "config": {"lr_decay": "auto", "optimizer": "sgd"}},
     "lr 2, no decay"),
    ({"lr": 0.1, "lr_decay": "plateau", "config": {"lr_decay": "auto"}},
     "lr 0.1, halved after each epoch whose P@1 on the held-out rows does not improve "
     "(lr_decay plateau)"),
], ids=["fixed", "probed-softmax", "given", "sgd", "plateau"])
def test_the_rate_line_names_the_schedule_in_effect(start, says):
    from xmc_engine.cli.train import _rate_line

    assert _rate_line(start) == says


def test_the_solo_line_names_the_periods_one_device_trained_alone():
    """``solo:``: the merge periods the first device trained alone (``solo_epochs``), their
    samples and the flag that turns it off; nothing where every device trained from the
    start."""
    from xmc_engine.cli.train import _solo_line

    def merge(solo, samples):
        return {"event": "merge", **({"solo": solo} if solo is not None else {}),
                "devices": [{"name": "cpu", "samples": samples[0]},
                            {"name": "cpu@0.5", "samples": samples[1]}]}

    history = [{"event": "start"}, merge(0, (4096, 0)), merge(0, (4096, 0)),
               merge(None, (3000, 1096))]
    assert _solo_line(history) == (
        "solo:  cpu trained the first 2 merge periods (8,192 samples) alone, then every device "
        "from its model (--algo-param solo_epochs=0 trains every device from the start)")
    assert _solo_line(history[:1] + history[-1:]) == ""


@pytest.mark.parametrize("values, says, not_says", [
    # 0.4 after epoch 2 is 1.8 standard errors behind epoch 1's 0.5 on 30 rows: training goes
    # on from the last model; the last model's 0.3 is 2.7 behind: the run ends with epoch 1's
    ([0.5, 0.4, 0.3], "kept:  epoch 1's model (held-out P@1 0.5000; the last epoch's 0.3000, "
                      "2.7 standard errors behind; --no-keep-best keeps the last)", "back:"),
    # 0.2 after epoch 2 is 3.5 behind: the rate halves and training goes on from epoch 1's
    # model; the last model is level with it
    ([0.5, 0.2, 0.5], "back:  after epoch 2 training went on from epoch 1's model (3.5 "
                      "standard errors ahead) (--no-back-to-best goes on from the last)",
     "kept:"),
])
def test_a_run_that_used_an_earlier_epochs_model_says_so(tmp_path, monkeypatch, capsys, values,
                                                         says, not_says):
    """With the plateau schedule and scripted held-out P@1s (after epochs 1, 2, and for the last
    model), the CLI names the earlier epoch whose model the run ended with (``keep_best``) or
    went on from (``back_to_best``), and the flag that turns it off."""
    from xmc_engine.cli import main

    script_heldout(monkeypatch, values)
    data = write_tiny_xc(tmp_path / "data", n=400, n_train=300)
    assert main(["train", "--data", str(data), "--hidden", "8", "--epochs", "3", "--threads",
                 "1", "--loss", "softmax", "--lr-decay", "plateau", "--eval-every", "0",
                 "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert says in out and not_says not in out, out


def test_train_evaluate_predict_plot(files, tmp_path):
    run = tmp_path / "run"
    out = run_cli("train", "--data", files, "--hidden", 16, "--epochs", 4, "--batch-size", 32,
                  "--lr", 0.5, "--out", run, "--checkpoint-every", 300).stdout
    assert "P@1" in out and "model:" in out and "log:" in out
    # the default loss="auto" says what it trained (300 rows: no probe, the softmax)
    assert "loss:  softmax (auto: too few rows to probe; --loss softmax|bce" in out
    assert "rate:  lr 0.5, decay 0.5 (lr / (1 + 0.5 e) in epoch e)" in out  # no probe: the decay
    assert (run / "model" / "config.json").exists() and (run / "log.jsonl").exists()
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ev = run_cli("evaluate", run / "model", "--data", files).stdout
    assert "P@1" in ev and "nDCG@5" in ev
    pred = tmp_path / "pred.txt"
    run_cli("predict", run / "model", "--data", files, "--top-k", 3, "--out", pred)
    lines = pred.read_text().splitlines()
    assert len(lines) == 100 and all(len(line.split()) == 3 for line in lines)
    png = tmp_path / "p.png"
    run_cli("plot", run, run, "--out", png)
    assert png.exists()


def test_a_run_that_ends_before_its_epochs_says_why(files, tmp_path):
    """A rate too small to move the model: held-out P@1 ties every epoch, the plateau rule
    halves after epochs 2-7 and stops below 1/32 after epoch 7. A time budget likewise."""
    out = run_cli("train", "--data", files, "--hidden", 16, "--epochs", 20, "--batch-size", 32,
                  "--lr", "1e-12", "--lr-decay", "plateau", "--loss", "softmax",
                  "--out", tmp_path / "run").stdout
    assert ", 7 of 20 epochs (stopped: held-out P@1 no longer improved and the plateau rule " \
           "had lowered the learning rate to x0.015625; --lr-decay 0.5 trains every epoch)" in out
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["event"] == "final" and log[-1]["status"] == "plateau_stop"
    out = run_cli("train", "--data", files, "--hidden", 16, "--epochs", 50, "--batch-size", 32,
                  "--max-train-seconds", "0.001", "--loss", "softmax",
                  "--out", tmp_path / "run2").stdout
    assert " of 50 epochs (stopped: --max-train-seconds 0.001)" in out
    out = run_cli("train", "--data", files, "--hidden", 16, "--epochs", 1, "--loss", "softmax",
                  "--out", tmp_path / "run3").stdout
    assert "stopped" not in out and "train time" in out


def test_the_summary_names_compiling_only_where_the_run_compiled():
    from xmc_engine.cli.train import _compile_line

    cached = [{"event": "compile", "seconds": 0.4, "compiled": 0},
              {"event": "compile", "seconds": 0.01, "compiled": 0}]
    assert _compile_line(cached) is None
    assert _compile_line([{"event": "compile", "seconds": 0.4}]) is None  # logs before the count
    first = [{"event": "compile", "seconds": 19.25, "compiled": 61},
             {"event": "start"}, {"event": "compile", "seconds": 0.05, "compiled": 0}]
    assert _compile_line(first) == ("compile: 19.3 s (61 Numba compilations, outside the train "
                                    "time; later runs load them from Numba's cache)")


def test_resume_continues_the_run(files, tmp_path):
    run = tmp_path / "run"
    run_cli("train", "--data", files, "--hidden", 16, "--epochs", 2, "--batch-size", 32,
            "--out", run, "--checkpoint-every", 100)
    # Pretend the run was meant to be longer: resume continues from its last checkpoint.
    run_json = json.loads((run / "run.json").read_text())
    run_json["config"]["epochs"] = 3
    (run / "run.json").write_text(json.dumps(run_json))
    out = run_cli("train", "--resume", run).stdout
    assert "P@1" in out
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    starts = [r for r in log if r["event"] == "start"]
    assert len(starts) == 2 and starts[1]["resumed"] and starts[1]["samples"] == 600
    assert log[-1]["event"] == "final" and log[-1]["samples"] == 900


def test_bad_arguments_are_clear(files, tmp_path):
    p = run_cli("train", "--data", files, "--devices", "gpu:0", "--out", tmp_path / "r",
                check=False)
    assert p.returncode == 2 and "gpu:0" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("train", "--data", tmp_path / "nope.txt", "--out", tmp_path / "r2", check=False)
    assert p.returncode == 2 and "nope.txt" in p.stderr
    p = run_cli("train", "--resume", tmp_path, check=False)
    assert p.returncode == 2 and "run folder" in p.stderr
    p = run_cli("evaluate", tmp_path / "missing-model", "--data", files, check=False)
    assert p.returncode == 2 and "missing-model" in p.stderr


def test_the_loss_line_says_what_the_probe_saw_and_when_it_looked_twice():
    from xmc_engine.cli.train import _probe_line

    once = {"p1": {"softmax": 0.4575, "bce": 0.3605}, "z": 13.81, "margin": 1.0,
            "seconds": 18.8, "continued": {"samples": 19456}, "first_look": None}
    line = _probe_line("softmax", once)
    assert line.startswith("loss:  softmax (auto: held-out P@1: softmax 0.4575, bce 0.3605, the "
                           "softmax +13.8 standard errors (it needs +1) after 18.8 s of probing")
    assert "training went on from the softmax fit's 19,456 samples" in line
    assert "second look" not in line
    twice = {**once, "z": 4.66, "first_look": {"rows": 19456, "z": 0.63, "loss": "bce",
                                                "p1": {}}}
    assert ("the softmax +4.7 standard errors (it needs +1) after a second look (the first, "
            "after 19,456 rows: the softmax +0.6) after 18.8 s") in _probe_line("softmax", twice)
    # a log written before the record had its margin: the exact layer's
    old = {"p1": {"softmax": 0.5, "bce": 0.4}, "z": 2.5, "seconds": 1.0}
    assert "(it needs +2)" in _probe_line("softmax", old)


def test_neighbours_takes_a_count_or_auto():
    assert json.loads(run_cli("train", "--print-config").stdout)["neighbours"] == "auto"
    assert json.loads(run_cli("train", "--print-config", "--neighbours", "7").stdout)[
        "neighbours"] == 7
    bad = run_cli("train", "--print-config", "--neighbours", "-1", check=False)
    assert bad.returncode == 2 and "'-1' must be >= 0" in bad.stderr


def test_a_run_with_neighbour_votes_says_what_they_did_and_its_model_keeps_them(files, tmp_path):
    run = tmp_path / "run"
    out = run_cli("train", "--data", files, "--hidden", 16, "--epochs", 2, "--loss", "bce",
                  "--threads", 1, "--out", run).stdout
    line = next(x for x in out.splitlines() if x.startswith("votes:"))
    assert line.startswith("votes: the 25 nearest of 300 training rows vote with the network "
                           "(auto: the logistic loss): P@1 / P@5 "), line
    assert line.endswith("; --neighbours 0 predicts with the network alone"), line
    record = json.loads((run / "log.jsonl").read_text().splitlines()[-1])
    assert record["event"] == "neighbours" and record["rows"] == 300
    p1 = float(out.split("P@1 ")[1].split()[0])  # the summary line: the blend's
    assert p1 == pytest.approx(record["metrics"]["P@1"], abs=1e-4)
    ev = run_cli("evaluate", run / "model", "--data", files).stdout
    assert float(ev.split("P@1")[1].split()[0].strip(":=")) == pytest.approx(p1, abs=1e-4)
    off = run_cli("train", "--data", files, "--hidden", 16, "--epochs", 2, "--loss", "bce",
                  "--threads", 1, "--neighbours", "0", "--out", tmp_path / "off").stdout
    assert "votes: off (--neighbours 25 has the training rows vote with the network)" in off


def test_the_summary_says_why_auto_left_the_votes_off():
    from xmc_engine.config import NEIGHBOURS_MAX_ROWS, TrainConfig

    auto = TrainConfig()
    assert auto.neighbours_decision(100, "bce") == (25, "the logistic loss")
    k, why = auto.neighbours_decision(NEIGHBOURS_MAX_ROWS + 1, "bce")
    assert k == 0 and why.startswith(f"{NEIGHBOURS_MAX_ROWS + 1:,} training rows, above"), why
    k, why = auto.neighbours_decision(100, "softmax", 22.0)
    assert k == 0 and "by +22.0 standard errors, +6 or more" in why, why
    k, why = auto.neighbours_decision(100, "softmax", 3.5)
    assert k == 25 and "+3.5 standard errors, under +6" in why, why
    k, why = auto.neighbours_decision(100, "softmax", None)
    assert k == 0 and "no loss probe" in why, why
    assert TrainConfig(neighbours=7).neighbours_decision(10**6, "softmax") == (7, "given")


def test_a_softmax_run_says_why_it_has_no_votes(files, tmp_path):
    out = run_cli("train", "--data", files, "--hidden", 16, "--epochs", 1, "--loss", "softmax",
                  "--threads", 1, "--out", tmp_path / "run").stdout
    line = next(x for x in out.splitlines() if x.startswith("votes:"))
    assert line == ("votes: off (auto: the softmax with no loss probe to compare it with the "
                    "logistic loss; --neighbours 25 has the training rows vote with the "
                    "network)"), line
