"""Fuzzing the command line from the parser's own option table (issue 17).

Every leaf command of :func:`xmc_engine.cli.build_parser` (``train``, ``evaluate``, ``predict``,
``plot``, ``plan``, ``datasets list|info|fetch|convert``) starts from a valid argument list on
tiny files; hypothesis then applies one mutation drawn from the options the parser declares:

* a value its ``type`` refuses, or one outside its ``choices``;
* a number that parses but is out of range (negative, zero, tiny);
* an unknown option, an extra positional, a required argument left out;
* an input path replaced by a missing path, an empty file, a garbage file or a folder;
* data of another shape than the model or the training set;
* a ``--config`` file mutated (a wrong JSON type, a non-finite number, an unknown key, cut short,
  not an object).

Each case runs ``main(argv)`` in this process and must end with exit status 2, an ``error:``
line on stderr and no traceback, and must leave nothing half-written where its outputs would go.
Out-of-range numbers may also be legitimate (``--seed -1``): those must then succeed (exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import typing
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xmc_engine.datasets import save_xc

from tests._helpers import write_tiny_xc
from xmc_engine.cli import build_parser, main
from xmc_engine.config import TrainConfig, _type_ok

# Generated cases per test (XMC_FUZZ_CASES=5000 for a longer local run).
N_CASES = int(os.environ.get("XMC_FUZZ_CASES", 300))

# What the runs below produced, by test and outcome (printed at the end with -s).
OUTCOMES: Counter = Counter()


def leaf_parsers(parser: argparse.ArgumentParser, prefix=()):
    """``(command words, parser)`` of every leaf command, walking the sub-parsers."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix, parser
        return
    for name, sub in subs[0].choices.items():
        yield from leaf_parsers(sub, (*prefix, name))


LEAVES = dict(leaf_parsers(build_parser()))


def options(command) -> list[argparse.Action]:
    """The arguments ``command`` declares, help excluded."""
    return [a for a in LEAVES[command]._actions if not isinstance(a, argparse._HelpAction)]


def flag(action) -> str:
    return max(action.option_strings, key=len)


def type_refuses(action, value: str) -> bool:
    """Whether argparse itself refuses ``value`` for ``action`` (its type or its choices)."""
    if action.type is not None:
        try:
            converted = action.type(value)
        except (argparse.ArgumentTypeError, TypeError, ValueError):
            return True
    else:
        converted = value
    return action.choices is not None and converted not in action.choices


WRONG_VALUES = ["abc", "", "1.5", "1,,2", "nan", "inf", "-inf", "1e999", "0x10", "3 ", "=", "k=",
                "=v", "٣", "1e", "None", "[1]", "{}", "true", "~nosuchuser/x"]
RANGE_VALUES = ["-1", "0", "-7", "-1e9", "1e-9", "-0.5"]
# Text a command line holds: no NUL (it ends a C string in execve's argv), and no lone surrogates
# (undecodable argv bytes; messages echoing them need stderr's backslashreplace, which the
# captured stream here does not have).
ARGV_TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
                    max_size=12)


# -- the files the cases start from ----------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "data").mkdir()
    data = write_tiny_xc(root / "data", n=80, n_train=64)
    rng = np.random.default_rng(0)
    other = rng.random((20, 33)) < 0.3
    save_xc(root / "other.txt", sp.csr_matrix(other.astype(np.float32)),
            sp.csr_matrix((rng.random((20, 7)) < 0.3).astype(np.float32)))
    (root / "empty.txt").write_bytes(b"")
    (root / "garbage.txt").write_bytes(b"\x00\xffnot data\n3 4\n::: ::\n")
    (root / "folder").mkdir()
    run = root / "run"
    assert main(["train", "--data", str(data), "--hidden", "8", "--epochs", "1", "--batch-size",
                 "32", "--out", str(run)]) == 0
    (root / "config.json").write_text(TrainConfig(hidden=[8], epochs=1).to_json())
    return {"root": root, "train": data / "train.txt", "test": data / "test.txt",
            "data": data, "other": root / "other.txt", "empty": root / "empty.txt",
            "garbage": root / "garbage.txt", "folder": root / "folder", "run": run,
            "model": run / "model", "config": root / "config.json"}


def base_argv(command, w, out: Path) -> list[str]:
    """A valid, quick invocation of ``command`` whose outputs go under ``out``."""
    train = ["--hidden", "8", "--epochs", "1", "--batch-size", "32", "--eval-every", "0"]
    argv = {
        ("train",): ["--data", w["train"], "--test", w["test"], *train, "--out", out / "run"],
        ("evaluate",): [w["model"], "--data", w["test"]],
        ("predict",): [w["model"], "--data", w["test"], "--top-k", "3", "--out", out / "p.txt"],
        ("plot",): [w["run"], "--out", out / "p.png"],
        ("plan",): ["--data", w["train"], "--memory-budget", "1GiB"],
        ("datasets", "list"): [],
        ("datasets", "info"): [w["train"], "--no-cache"],
        # unreachable: the fuzz never touches the network; every fetch case fails fast
        ("datasets", "fetch"): ["toy", "--url", "http://127.0.0.1:9/toy.zip", "--dest",
                                out / "dl", "--timeout", "1"],
        ("datasets", "convert"): [w["train"], out / "c.txt"],
    }[command]
    return [*command, *map(str, argv)]


# -- checks ---------------------------------------------------------------------------------------
def run(argv, capsys):
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    _, err = capsys.readouterr()
    return rc, err


def nothing_half_written(out: Path, strict: bool) -> None:
    """No temporary file, lock or partial model under ``out``; with ``strict`` (the input was
    bad) no output at all."""
    found = [p for p in out.rglob("*")] if out.exists() else []
    assert not [p for p in found if ".tmp" in p.name or p.name == "run.lock"], found
    for model in (p for p in found if p.name == "model"):
        assert sorted(q.name for q in model.iterdir()) == ["config.json", "params.npz"]
    if strict:
        assert found == [], found


def check(argv, out: Path, capsys, *, may_succeed=False, label=""):
    rc, err = run(argv, capsys)
    OUTCOMES[(label, rc)] += 1
    assert "Traceback" not in err, (argv, err)
    # plan's own verdict: exit 1 when the run does not fit (e.g. --memory-budget 1.5 bytes)
    verdict = rc == 1 and argv[0] == "plan" and "does not fit" in err
    if may_succeed and (rc == 0 or verdict):
        nothing_half_written(out, strict=False)
        return
    assert rc == 2, (argv, rc, err)
    assert any("error:" in line for line in err.splitlines()), (argv, err)
    nothing_half_written(out, strict=True)


_case = iter(range(10**9))


def fresh_out(w) -> Path:
    out = w["root"] / "cases" / str(next(_case))
    out.mkdir(parents=True)
    return out


COMMANDS = sorted(LEAVES)
FUZZ = settings(max_examples=N_CASES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def _in_tmp(world, monkeypatch):
    monkeypatch.chdir(world["root"])  # a relative --out lands here
    monkeypatch.setenv("XMC_PROGRESS", "0")
    monkeypatch.setenv("XMC_CACHE_DIR", str(world["root"] / "cache"))


def _replace_value(argv, action, value):
    """``argv`` with the value of option ``action`` set to ``value`` (appended if absent)."""
    argv = list(argv)
    for i, a in enumerate(argv[:-1]):
        if a in action.option_strings:
            argv[i + 1] = value
            return argv
    return [*argv, flag(action), value]


# -- the fuzz tests -------------------------------------------------------------------------------
@FUZZ
@given(st.data())
def test_values_argparse_or_the_engine_must_refuse(world, capsys, data):
    command = data.draw(st.sampled_from(COMMANDS), label="command")
    valued = [a for a in options(command) if a.option_strings and a.nargs != 0]
    if not valued:
        return
    action = data.draw(st.sampled_from(valued), label="option")
    out = fresh_out(world)
    argv = base_argv(command, world, out)
    pool = [v for v in WRONG_VALUES if type_refuses(action, v)]
    if action.type is None and action.choices is None:  # strings: any text, the engine decides
        value = data.draw(st.sampled_from(WRONG_VALUES + RANGE_VALUES) | ARGV_TEXT)
        check(_replace_value(argv, action, value), out, capsys, may_succeed=True,
              label="free text")
    elif pool and data.draw(st.booleans(), label="wrong type"):
        value = data.draw(st.sampled_from(pool), label="value")
        check(_replace_value(argv, action, value), out, capsys, label="wrong type")
    else:
        value = data.draw(st.sampled_from(RANGE_VALUES), label="value")
        check(_replace_value(argv, action, value), out, capsys,
              may_succeed=not type_refuses(action, value), label="out of range")


def _path_slots(argv, w):
    return [i for i, a in enumerate(argv) if a in {str(v) for k, v in w.items() if k != "root"}]


@FUZZ
@given(st.data())
def test_missing_wrong_and_mismatched_files(world, capsys, data):
    command = data.draw(st.sampled_from([c for c in COMMANDS if c != ("datasets", "list")]),
                        label="command")
    out = fresh_out(world)
    argv = base_argv(command, world, out)
    slots = _path_slots(argv, world)
    if not slots:
        return
    i = data.draw(st.sampled_from(slots), label="slot")
    kinds = ["missing", "empty", "garbage", "folder"]
    if command in (("train",), ("evaluate",), ("predict",)) and argv[i] == str(world["test"]):
        kinds.append("other")  # another feature and label count than the model / training set
    kind = data.draw(st.sampled_from(kinds), label="replacement")
    argv[i] = str(world["root"] / "no" / "such.txt") if kind == "missing" else str(world[kind])
    # An empty file is an empty LIBSVM data set: describing or converting it is fine.
    check(argv, out, capsys, may_succeed=kind == "empty" and command[0] == "datasets",
          label=f"file {kind}")


@FUZZ
@given(st.data())
def test_unknown_extra_and_left_out_arguments(world, capsys, data):
    command = data.draw(st.sampled_from(COMMANDS), label="command")
    out = fresh_out(world)
    argv = base_argv(command, world, out)
    required = [a for a in options(command) if a.required or not a.option_strings]
    kinds = ["unknown option", "extra positional"] + (["left out"] if required else [])
    kind = data.draw(st.sampled_from(kinds), label="mutation")
    if kind == "unknown option":
        argv.append(data.draw(st.sampled_from(["--bogus", "--out-dir", "-z", "--hidden-size"])))
    elif kind == "extra positional":
        argv.append("extra")  # plot takes it as one more RUN_DIR: a missing one
    else:
        action = data.draw(st.sampled_from(required), label="left out")
        if action.option_strings:
            j = next(j for j, a in enumerate(argv) if a in action.option_strings)
            del argv[j:j + 2]
        else:
            positional = [j for j in _path_slots(argv, world) if argv[j - 1][:2] != "--"]
            if not positional:
                return
            del argv[positional[0]]
    check(argv, out, capsys, label=kind)


def _algorithm_fields() -> dict[str, list[str]]:
    """The option names of every algorithm, from its config dataclass."""
    import dataclasses

    from xmc_engine.config import ALGORITHMS

    return {name: [f.name for f in dataclasses.fields(cfg_cls)]
            for name, cfg_cls in ALGORITHMS.items()}


@FUZZ
@given(st.data())
def test_algorithm_options(world, capsys, data):
    """``--algo-param KEY=VALUE`` of every algorithm: an unknown key, or a known key with a
    value of the wrong type or a non-finite number."""
    fields = _algorithm_fields()
    algorithm = data.draw(st.sampled_from(sorted(fields)), label="algorithm")
    key = data.draw(st.sampled_from([*fields[algorithm], "bogus", "merge-period"]), label="key")
    if key in fields[algorithm]:
        value = data.draw(st.sampled_from(['"x"', "[1]", "{}", "NaN", "Infinity"]), label="value")
    else:
        value = "1"
    out = fresh_out(world)
    devices = "cpu" if algorithm == "single" else "cpu,cpu"
    argv = [*base_argv(("train",), world, out), "--algorithm", algorithm, "--devices", devices,
            "--algo-param", f"{key}={value}"]
    check(argv, out, capsys, label="algorithm option")


CONFIG_FIELDS = TrainConfig().to_dict()


@st.composite
def mutated_config(draw):
    """Config text that :class:`TrainConfig` must refuse, and what was done to it."""
    cfg = json.loads(TrainConfig(hidden=[8], epochs=1).to_json())
    kind = draw(st.sampled_from(["wrong type", "non-finite", "unknown key", "cut short",
                                 "not an object"]))
    if kind == "wrong type":  # a value the field's annotation does not admit
        field = draw(st.sampled_from(sorted(CONFIG_FIELDS)))
        hint = typing.get_type_hints(TrainConfig)[field]
        cfg[field] = draw(st.sampled_from([v for v in (3, [], {}, True, "x", [[1]], "1e3x")
                                           if not _type_ok(v, hint)]))
        return json.dumps(cfg), f"{kind} {field}"
    if kind == "non-finite":
        numeric = [k for k, v in CONFIG_FIELDS.items() if isinstance(v, (int, float))
                   and not isinstance(v, bool)] + ["lr_warmup_epochs"]
        field = draw(st.sampled_from(sorted(numeric)))
        token = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"]))
        return json.dumps(cfg).replace(f'"{field}": {json.dumps(cfg[field])}',
                                       f'"{field}": {token}'), f"{kind} {field}"
    if kind == "unknown key":
        cfg[draw(st.sampled_from(["hidden_size", "epoch", "", "lr "]))] = 1
        return json.dumps(cfg), kind
    if kind == "cut short":
        text = json.dumps(cfg)
        return text[:draw(st.integers(0, len(text) - 1))], kind
    return draw(st.sampled_from(["[]", '"cfg"', "42", "null", "[{}]"])), kind


@FUZZ
@given(st.data())
def test_mutated_config_files(world, capsys, data):
    command = data.draw(st.sampled_from([("train",), ("plan",)]), label="command")
    text, kind = data.draw(mutated_config(), label="config")
    out = fresh_out(world)
    path = out / "config.json"
    path.write_text(text)
    argv = [*base_argv(command, world, out), "--config", str(path)]
    check(argv, out / "run", capsys, label=f"config {kind.split()[0]}")
    path.unlink()
    shutil.rmtree(out, ignore_errors=True)


def test_report_outcomes():
    """Prints the outcome counts (``pytest -s``): the table in bench/RELIABILITY.md."""
    for (label, rc), n in sorted(OUTCOMES.items()):
        print(f"{label:20s} exit {rc}: {n}")
    print(f"total {sum(OUTCOMES.values())} generated cases")

