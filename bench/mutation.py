"""Mutation testing of ``xmc_engine/algorithms/`` and ``xmc_engine/scheduler/`` (a dev tool).

Why a driver of its own: ``mutmut`` 3 copies the mutated package into a ``mutants/`` folder and
imports it from there, but this package is installed through a ``package-dir`` mapping
(``kernels/`` and ``datasets/`` become ``xmc_engine.kernels`` / ``xmc_engine.datasets``), which
such a copy does not reproduce. This driver mutates the worktree's file in place instead, one
mutant at a time, runs the tests that cover the mutated line, and restores the file.

Subcommands (run from the repository root with the worktree's interpreter)::

    python bench/mutation.py map [--tests FILE ...] [--merge]
        Run the tests once under coverage with one context per test: which test executes
        which line of the target files, and how long each test takes
        (``bench/results/mutation_map.json``). ``--merge`` adds to the existing map.
    python bench/mutation.py list
        Count the mutants per file and kind.
    python bench/mutation.py run --sample N --seed S --out FILE [--only-ids FILE]
        Run a uniform sample of ``N`` mutants (fixed ``seed``), or the ids listed (one per line
        or a previous result JSON's survivors); writes one record per mutant to ``FILE``.
    python bench/mutation.py show ID
        The mutated source line(s) of one mutant.

A mutant is *killed* when a covering test fails, *timeout* when the tests run past
``3 * (their measured time) + 30 s``, *survived* when every covering test passes, and
*uncovered* when no selected test executes its line (a survivor with no test at all). Lines run
only at import time (class attributes, default arguments) are covered by every test.

Mutation operators (one change per mutant): comparison flips (``<``/``<=``, ``==``/``!=``,
``is``/``is not``, ``in``/``not in``), arithmetic swaps (``+``/``-``, ``*``/``/``,
``//``→``/``, ``%``→``//``, ``**``→``*``, ``|``/``&``), dropping the right factor of ``*`` and
``/`` (``lr * b / B`` → ``lr * b``), constants (``n`` → ``n + 1``, ``x`` → ``x + 1.0``,
``True``/``False``), ``and``/``or``, dropping ``not`` and unary minus, and dropping statements
(calls for their effect, augmented assignments, assignments to attributes or items,
``break``/``continue``). Annotations, docstrings, f-strings, ``raise`` statements and logging
calls are not mutated: changing them changes no behaviour a test could pin.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = sorted([*(ROOT / "xmc_engine" / "algorithms").glob("*.py"),
                  *(ROOT / "xmc_engine" / "scheduler").glob("*.py")])
TESTS = ["tests/test_algorithms.py", "tests/test_scheduler_controller.py",
         "tests/test_scheduler_queue.py", "tests/test_scheduler_runner.py",
         "tests/test_trainer.py", "tests/test_baselines.py", "tests/test_sparse_merge.py",
         "tests/test_merge.py"]
MAP = ROOT / "bench" / "results" / "mutation_map.json"
PYTEST = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", "-p",
          "no:cacheprovider", "-m", "not slow and not mpi"]

COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
           ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn,
           ast.NotIn: ast.In}
BINOP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
         ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.BitOr: ast.BitAnd,
         ast.BitAnd: ast.BitOr}
LOGGERS = {"logger", "logging", "log", "warnings"}


def _skipped_subtrees(tree: ast.AST) -> set[int]:
    """ids of the nodes never mutated: annotations, docstrings, f-strings, raise statements and
    logging calls (and everything below them)."""
    roots = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            roots.append(node.returns)
            args = node.args
            roots += [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                             args.vararg, args.kwarg) if a is not None]
        if isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
        if isinstance(node, (ast.JoinedStr, ast.Raise)):
            roots.append(node)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                roots.append(body[0])
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in LOGGERS):
            roots.append(node)
    return {id(n) for r in roots if r is not None for n in ast.walk(r)}


def _candidates(tree: ast.AST) -> list[tuple[int, str, str]]:
    """``(walk index, kind, description)`` of every mutation of ``tree``."""
    skip = _skipped_subtrees(tree)
    out = []
    for i, node in enumerate(ast.walk(tree)):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare):
            for j, op in enumerate(node.ops):
                if type(op) in COMPARE:
                    out.append((i, f"compare:{j}", f"{type(op).__name__} -> "
                                f"{COMPARE[type(op)].__name__}"))
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in BINOP:
            out.append((i, "binop", f"{type(node.op).__name__} -> "
                        f"{BINOP[type(node.op)].__name__}"))
            if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
                out.append((i, "drop_right", f"drop the right operand of "
                            f"{type(node.op).__name__}"))
        elif isinstance(node, ast.BoolOp):
            out.append((i, "boolop", f"{type(node.op).__name__} -> "
                        f"{'Or' if isinstance(node.op, ast.And) else 'And'}"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            out.append((i, "drop_unary", f"drop {type(node.op).__name__}"))
        elif isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
            out.append((i, "constant", f"{node.value!r} -> {_new_constant(node.value)!r}"))
        if isinstance(node, ast.stmt) and _droppable(node):
            out.append((i, "drop_stmt", f"drop {type(node).__name__}"))
    return out


def _droppable(node: ast.stmt) -> bool:
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Call)
    if isinstance(node, ast.Assign):
        return all(isinstance(t, (ast.Attribute, ast.Subscript)) for t in node.targets)
    return isinstance(node, (ast.AugAssign, ast.Break, ast.Continue))


def _new_constant(value):
    if isinstance(value, bool):
        return not value
    return value + 1 if isinstance(value, int) else value + 1.0


def _apply(tree: ast.AST, index: int, kind: str) -> ast.AST:
    """``tree`` (a copy) with mutation ``kind`` applied to its ``index``-th walked node."""
    tree = copy.deepcopy(tree)
    nodes = list(ast.walk(tree))
    node = nodes[index]
    if kind.startswith("compare:"):
        j = int(kind.split(":")[1])
        node.ops[j] = COMPARE[type(node.ops[j])]()
    elif kind == "binop":
        node.op = BINOP[type(node.op)]()
    elif kind == "boolop":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind == "constant":
        node.value = _new_constant(node.value)
    else:
        replacement = {"drop_right": lambda n: n.left, "drop_unary": lambda n: n.operand,
                       "drop_stmt": lambda n: ast.Pass()}[kind](node)
        for parent in nodes:
            for field, value in ast.iter_fields(parent):
                if value is node:
                    setattr(parent, field, replacement)
                    return ast.fix_missing_locations(tree)
                if isinstance(value, list) and any(v is node for v in value):
                    value[[v is node for v in value].index(True)] = replacement
                    return ast.fix_missing_locations(tree)
        raise RuntimeError(f"node {index} of kind {kind} has no parent")
    return tree


def mutants() -> list[dict]:
    """Every mutant of the target files, in a fixed order, with a stable id
    ``path:line:col:walk-index:kind``."""
    out = []
    for path in TARGETS:
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        nodes = list(ast.walk(tree))
        for index, kind, desc in _candidates(tree):
            n = nodes[index]
            out.append({"id": f"{rel}:{n.lineno}:{n.col_offset}:{index}:{kind}", "file": rel,
                        "line": n.lineno, "end_line": n.end_lineno, "index": index,
                        "kind": kind, "description": desc})
    return out


def mutated_source(m: dict) -> str:
    tree = ast.parse((ROOT / m["file"]).read_text())
    return ast.unparse(_apply(tree, m["index"], m["kind"])) + "\n"


# -- coverage map --------------------------------------------------------------------------------
def build_map(tests: list[str], merge: bool) -> None:
    """Run ``tests`` in this process under coverage, one dynamic context per test."""
    import coverage
    import pytest

    durations: dict[str, float] = {}
    cov = coverage.Coverage(data_file=None, include=[str(p) for p in TARGETS])
    cov.start()

    class ContextPerTest:
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            cov.switch_context(item.nodeid)
            t0 = time.perf_counter()
            yield
            durations[item.nodeid] = time.perf_counter() - t0
            cov.switch_context("")

    rc = pytest.main([*PYTEST[4:], *tests], plugins=[ContextPerTest()])
    cov.stop()
    data = cov.get_data()
    lines: dict[str, dict[str, list[str]]] = {}
    for f in data.measured_files():
        rel = Path(f).resolve().relative_to(ROOT).as_posix()
        by_line = data.contexts_by_lineno(f)
        lines[rel] = {str(ln): sorted(c for c in ctxs if c) for ln, ctxs in by_line.items()}
    if merge and MAP.exists():
        old = json.loads(MAP.read_text())
        durations = {**old["durations"], **durations}
        for rel, by_line in old["lines"].items():
            new = lines.setdefault(rel, {})
            for ln, ctxs in by_line.items():
                new[ln] = sorted(set(new.get(ln, [])) | set(ctxs))
    MAP.parent.mkdir(parents=True, exist_ok=True)
    MAP.write_text(json.dumps({"durations": durations, "lines": lines}, indent=0))
    print(f"pytest exit {rc}; {len(durations)} tests mapped -> {MAP}")


def covering_tests(m: dict, cmap: dict) -> list[str] | None:
    """The tests that execute the mutant's lines, fastest first; every test when the lines run
    only at import; ``None`` when no test executes them."""
    by_line = cmap["lines"].get(m["file"], {})
    executed = [by_line[str(ln)] for ln in range(m["line"], m["end_line"] + 1)
                if str(ln) in by_line]
    if not executed:
        return None
    tests = set().union(*executed)
    if not tests:
        tests = set(cmap["durations"])
    return sorted(tests, key=lambda t: (cmap["durations"].get(t, 0.0), t))


def run_one(m: dict, cmap: dict) -> dict:
    tests = covering_tests(m, cmap)
    rec = {**m, "tests": 0 if tests is None else len(tests)}
    if tests is None:
        return {**rec, "status": "uncovered", "seconds": 0.0}
    path = ROOT / m["file"]
    original = path.read_text()
    budget = 3 * sum(cmap["durations"].get(t, 1.0) for t in tests) + 30
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "XMC_PROGRESS": "0"}
    t0 = time.perf_counter()
    try:
        path.write_text(mutated_source(m))
        proc = subprocess.run([*PYTEST, *tests], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=budget)
        status = "survived" if proc.returncode == 0 else "killed"
        if proc.returncode not in (0, 1):
            rec["pytest_rc"] = proc.returncode
        if status == "killed":
            failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")
                      or ln.startswith("ERROR")]
            rec["killed_by"] = failed[:1]
    except subprocess.TimeoutExpired:
        status = "timeout"
    finally:
        path.write_text(original)
    return {**rec, "status": status, "seconds": round(time.perf_counter() - t0, 1)}


def run(args) -> None:
    cmap = json.loads(MAP.read_text())
    every = mutants()
    if args.only_ids:
        text = Path(args.only_ids).read_text()
        if args.only_ids.endswith(".json"):
            ids = {r["id"] for r in json.loads(text)["mutants"]
                   if r["status"] in ("survived", "uncovered")}
        else:
            ids = {ln.strip() for ln in text.splitlines() if ln.strip()}
        chosen = [m for m in every if m["id"] in ids]
        missing = ids - {m["id"] for m in chosen}
        if missing:
            raise SystemExit(f"mutant ids not found (the source changed?): {sorted(missing)}")
    else:
        chosen = sorted(random.Random(args.seed).sample(every, min(args.sample, len(every))),
                        key=lambda m: every.index(m))
    results = []
    out = Path(args.out)
    for k, m in enumerate(chosen, 1):
        rec = run_one(m, cmap)
        results.append(rec)
        print(f"[{k}/{len(chosen)}] {rec['status']:9s} {rec['seconds']:6.1f}s {m['id']} "
              f"({m['description']})", flush=True)
        counts = Counter(r["status"] for r in results)
        out.write_text(json.dumps({"command": " ".join(sys.argv), "total_mutants": len(every),
                                   "sampled": len(chosen), "seed": args.seed,
                                   "counts": dict(counts), "mutants": results}, indent=1))
    print(dict(Counter(r["status"] for r in results)))


def show(mid: str) -> None:
    m = next((m for m in mutants() if m["id"] == mid), None)
    if m is None:
        raise SystemExit(f"no mutant {mid!r}")
    tree = ast.parse((ROOT / m["file"]).read_text())
    node = list(ast.walk(tree))[m["index"]]
    mutated = _apply(tree, m["index"], m["kind"])
    print(f"{m['id']}: {m['description']}")
    print("-", ast.unparse(_enclosing_stmt(tree, node)))
    print("+", ast.unparse(_enclosing_stmt(mutated, list(ast.walk(mutated))[m["index"]])))


def _enclosing_stmt(tree: ast.AST, node: ast.AST) -> ast.AST:
    """The innermost simple statement (or compound statement's header test) holding ``node``."""
    best = node
    for n in ast.walk(tree):
        if (isinstance(n, ast.stmt) and not hasattr(n, "body")
                and any(c is node for c in ast.walk(n))):
            best = n
        if isinstance(n, (ast.If, ast.While)) and any(c is node for c in ast.walk(n.test)):
            return n.test
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("map")
    p.add_argument("--tests", nargs="+", default=TESTS)
    p.add_argument("--merge", action="store_true")
    sub.add_parser("list")
    p = sub.add_parser("run")
    p.add_argument("--sample", type=int, default=10**9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only-ids")
    p.add_argument("--out", required=True)
    p = sub.add_parser("show")
    p.add_argument("id")
    args = ap.parse_args(argv)
    if args.cmd == "map":
        build_map(args.tests, args.merge)
    elif args.cmd == "list":
        every = mutants()
        print(Counter(m["file"] for m in every))
        print(Counter(m["kind"].split(":")[0] for m in every))
        print(f"{len(every)} mutants")
    elif args.cmd == "run":
        run(args)
    else:
        show(args.id)


if __name__ == "__main__":
    main()
