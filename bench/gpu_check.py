"""GPU check: one prepared command that proves the CUDA path on one GPU and writes its results as
it goes.

    python bench/gpu_check.py --out $OUT                  # every section, about 5 minutes
    python bench/gpu_check.py --sections kernels,sync     # a subset, in this order
    python bench/gpu_check.py --device cpu --scale 0.002  # dry run of this script on the CPU

Sections (``--sections``, default all, in this order):

``kernels``     every backend launcher against :mod:`xmc_engine.kernels.reference` on small
                random inputs (an empty row, a row without labels, sizes that are not multiples of
                the block size), Adagrad, the label-chunked output layer, the logistic
                loss, the sampled output layer's column kernels and gradient (both losses) and
                the row- and column-sparse merge included.
``fit_single``  ``XMCClassifier(devices="cuda:0")`` with the default algorithm on delicious; P@1
                within ``FIT_TOLERANCE`` of the CPU run with the same seed.
``throughput``  the Amazon-670K shape (135,909 features, 670,091 labels, hidden 128, batch 256)
                on synthetic rows: the engine's step (samples/s, the share of the three GEMMs
                timed alone, peak GPU memory), a one-epoch ``single`` fit projected to 490,449
                samples, the same fit again under a stack sampler (``single_fit_profile``:
                which functions of which thread its wall time went to, ``bench/_sampler.py``),
                and the same network in PyTorch on the same GPU (and the ratio).
``sync``        ``algorithm="sync"`` with two workers on the GPU against the CPU run.
``adaptive``    ``algorithm="adaptive"`` on ``cuda:0,cuda:0@0.5`` with the boost, central
                momentum 0.5 and the first device alone to the end of epoch 1
                (``ADAPTIVE_PARAMS``) against the CPU run on ``cpu,cpu@0.5``.

Each section runs in a child process with a time limit (``SECTION_LIMITS_S``, capped by what is
left of ``--budget``; a section that cannot start with ``MIN_START_S`` left is skipped with the
reason), so a hang, a crash or a sticky CUDA error ends that section only. After every section
(and when one starts) the whole report is rewritten atomically to ``OUT/gpu_check.json``; the log
(this process and every child) goes to ``OUT/gpu_check.log`` and to stdout. A section records
``status`` (``passed`` / ``failed`` / ``skipped``), ``reason``, ``traceback`` on failure,
``seconds`` and its ``figures``: ``checks`` (correctness: any false check fails the section),
``targets`` (the issue's speed goals: recorded, never failing) and the measurements.

Without CUDA (``cupy.is_available()`` False) the script prints why, writes a report whose
sections are all skipped, and exits 0. Exit status otherwise: 1 if a section failed, else 0.
The exact device command is in ``bench/GPU.md``. Every call into the engine goes through one of
the small ``engine_*`` functions below (public APIs only).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
from _sampler import StackSampler  # noqa: E402

logger = logging.getLogger("gpu_check")

REPORT_NAME = "gpu_check.json"
LOG_NAME = "gpu_check.log"
#: GPU libraries whose versions are recorded beside the machine's (distribution names)
GPU_LIBRARIES = ("cupy-cuda13x", "cupy-cuda12x", "numba-cuda")
SECTION_ORDER = ("kernels", "fit_single", "throughput", "sync", "adaptive")
#: hard time limit of each section's child process, seconds (capped by what is left of --budget)
SECTION_LIMITS_S = {"kernels": 100, "fit_single": 120, "throughput": 110, "sync": 80,
                    "adaptive": 120}  # adaptive: 73 s on a fresh H200 (four fits, compiling)
#: a section starts only with at least this many seconds of the budget left
MIN_START_S = 15.0
#: seconds a child may run past its limit (interpreter start) before it is killed
CHILD_GRACE_S = 5.0
DEFAULT_BUDGET_S = 320.0
#: |P@1(GPU) - P@1(CPU)| allowed per fit section. single and sync see the same batches on both
#: devices (rounding differs only). adaptive is compared on a virtual clock (``SIM_COST_S``),
#: where both runs follow the same schedule: its threaded schedule follows the devices' measured
#: speeds, which differ between a GPU and a CPU (on the first H200 run the GPU worker took
#: 1024-row batches and 75 % of the merge weight, the CPU worker 576 rows and 50 %).
FIT_TOLERANCE = {"fit_single": 0.01, "sync": 0.01, "adaptive": 0.01}
#: virtual seconds of one step on n rows in the adaptive comparison: (fixed, per row)
SIM_COST_S = (2e-4, 2e-6)
#: adaptive's non-default options that put more of its code on the device: the boost, central
#: momentum, and the first device alone up to the end of epoch 1 (``solo_epochs``: the run goes
#: on from the loss probe's fit, most of an epoch, so the default half epoch would be over):
#: the solo periods, the central model caught up with the solo device by a whole copy (no row
#: tracking on a GPU) and the hand-over of its Adagrad accumulators.
ADAPTIVE_PARAMS = {"boost": True, "momentum": 0.5, "solo_epochs": 1.0}
#: what ``last_merge`` keeps of each device in the run log's last ``merge`` record
MERGE_FIELDS = ("device", "batch_size", "updates", "samples", "weight")
#: Amazon-670K (XC repository): training rows, features, labels
AMAZON_670K = {"n_train": 490_449, "n_features": 135_909, "n_labels": 670_091}
THROUGHPUT_HIDDEN = 128
THROUGHPUT_BATCH = 256
TARGET_EPOCH_S = 10.0
#: run-log events that mean a fit did not train cleanly (xmc_engine.runlog)
TROUBLE_EVENTS = ("nonfinite", "device_dropped", "diverged", "interrupted")


# ------------------------------------------------------------------------------- arguments

def _default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) if out else _common.RESULTS_DIR / "gpu"


def _default_data() -> Path:
    env = os.environ.get("XMC_GPU_CHECK_DATA")
    return Path(env) if env else _common.REPO_DIR / "data" / "delicious"


def parse_sections(text: str) -> list[str]:
    """``"kernels,sync"`` -> ``["kernels", "sync"]``; unknown or repeated names are errors."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError("--sections is empty; choose from "
                                         + ",".join(SECTION_ORDER))
    for n in names:
        if n not in SECTION_ORDER:
            raise argparse.ArgumentTypeError(
                f"unknown section {n!r} in --sections {text!r}; choose from "
                + ",".join(SECTION_ORDER))
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--sections {text!r} names a section twice")
    return names


def parse_cpu_p1(text: str) -> tuple[str, float]:
    """``"fit_single=0.604"`` -> ``("fit_single", 0.604)``: a CPU P@1 given instead of run."""
    name, sep, value = text.partition("=")
    if not sep or name not in FIT_TOLERANCE:
        raise argparse.ArgumentTypeError(
            f"--cpu-p1 {text!r}: expected SECTION=P@1 with SECTION one of "
            + ",".join(FIT_TOLERANCE))
    try:
        p1 = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cpu-p1 {text!r}: {value!r} is not a number") from None
    if not 0.0 <= p1 <= 1.0:
        raise argparse.ArgumentTypeError(f"--cpu-p1 {text!r}: P@1 must be in [0, 1]")
    return name, p1


def _positive(kind):
    def conv(text):
        v = kind(text)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return v
    return conv


def _device(text: str) -> str:
    if text == "cpu" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"--device {text!r}: expected cuda:N or cpu")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring); ``--child*`` options are internal."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None,
                   help=f"folder for {REPORT_NAME} and {LOG_NAME} (default: $OUT, else "
                        "bench/results/gpu)")
    p.add_argument("--data", type=Path, default=None,
                   help="delicious folder (train.txt[.xz], test.txt[.xz]); default: "
                        "$XMC_GPU_CHECK_DATA, else data/delicious in the checkout")
    p.add_argument("--sections", type=parse_sections, default=list(SECTION_ORDER),
                   help="comma-separated sections to run, in order (default: all)")
    p.add_argument("--budget", type=_positive(float), default=DEFAULT_BUDGET_S,
                   help="seconds for all sections together (default %(default)s)")
    p.add_argument("--device", type=_device, default="cuda:0",
                   help="the device under test; 'cpu' runs every section on the CPU backend "
                        "(a dry run of this script, used by its tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=_positive(int), default=None,
                   help="epochs of the delicious fits (default: the estimator's default)")
    p.add_argument("--cpu-p1", type=parse_cpu_p1, action="append", default=[],
                   metavar="SECTION=P@1",
                   help="take the CPU reference P@1 of a fit section instead of running it")
    p.add_argument("--scale", type=_positive(float), default=1.0,
                   help="multiplies the throughput shape's features and labels (1.0: "
                        "Amazon-670K)")
    p.add_argument("--steps", type=_positive(int), default=40,
                   help="timed steps of the engine and of PyTorch in 'throughput'")
    p.add_argument("--fit-steps", type=_positive(int), default=100,
                   help="steps of the one-epoch 'single' fit in 'throughput'")
    p.add_argument("--commit", default=None,
                   help="git commit of the code under test, for a copied checkout without git "
                        "(default: git rev-parse HEAD, with -dirty for uncommitted changes)")
    p.add_argument("--child", choices=SECTION_ORDER, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-limit", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = _default_out()
    if args.data is None:
        args.data = _default_data()
    args.cpu_p1 = dict(args.cpu_p1)
    if args.child is not None and args.child_out is None:
        p.error("--child needs --child-out")
    return args


# ------------------------------------------------------------------------------- the runner

class SectionSkipped(Exception):
    """A section cannot run here (missing data, say); the message says why and what to do."""


@dataclass(frozen=True)
class Section:
    """One section: ``func(ctx)`` records into ``ctx``; ``limit_s`` is its hard time limit."""

    name: str
    func: Callable[[Context], None]
    limit_s: float


class Context:
    """What a section function sees: the arguments, its deadline and its figures.

    ``put`` / ``check`` / ``target`` record into :attr:`figures` and call ``flush(figures)``
    at once, so what a section measured survives a crash or a kill later in it.
    """

    def __init__(self, args, limit_s: float, flush=None, clock=time.monotonic):
        self.args = args
        self.figures: dict = {}
        self._flush = flush
        self._clock = clock
        self.deadline = clock() + limit_s

    def left(self) -> float:
        """Seconds left before this section's time limit."""
        return self.deadline - self._clock()

    def put(self, key: str, value) -> None:
        self.figures[key] = value
        self._emit()

    def check(self, name: str, ok: bool, **detail) -> bool:
        """A correctness check: a false one fails the section (the others still run)."""
        self.figures.setdefault("checks", {})[name] = {"ok": bool(ok), **detail}
        logger.info("check %-40s %s %s", name, "ok" if ok else "FAILED",
                    " ".join(f"{k}={_short(v)}" for k, v in detail.items()))
        self._emit()
        return bool(ok)

    def target(self, name: str, met: bool, **detail) -> None:
        """A speed goal of the issue: recorded (met or not), never failing the section."""
        self.figures.setdefault("targets", {})[name] = {"met": bool(met), **detail}
        logger.info("target %-39s %s %s", name, "met" if met else "MISSED",
                    " ".join(f"{k}={_short(v)}" for k, v in detail.items()))
        self._emit()

    def _emit(self) -> None:
        if self._flush is not None:
            self._flush(self.figures)


def _short(v):
    return f"{v:.4g}" if isinstance(v, float) else v


def failed_checks(figures: dict) -> list[str]:
    """Names of the false checks in a section's figures."""
    return [k for k, c in figures.get("checks", {}).items() if not c.get("ok")]


def run_section_here(section: Section, ctx: Context) -> dict:
    """Run one section in this process; return its outcome (``status``, ``reason``,
    ``traceback``, ``figures``). Exceptions are caught and recorded."""
    try:
        section.func(ctx)
    except SectionSkipped as e:
        return {"status": "skipped", "reason": str(e), "figures": ctx.figures}
    except Exception as e:  # noqa: BLE001 - a section's failure is a result, not a crash
        return {"status": "failed", "reason": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(), "figures": ctx.figures}
    bad = failed_checks(ctx.figures)
    if bad:
        return {"status": "failed", "reason": "checks failed: " + ", ".join(bad),
                "figures": ctx.figures}
    return {"status": "passed", "figures": ctx.figures}


def new_report(args, metadata: dict) -> dict:
    """The report skeleton: ``metadata`` (:func:`_common.result_metadata`: command, git commit,
    machine; ``--commit`` replaces the commit), the device and budget, and every section of
    ``args.sections`` ``pending``."""
    report = {**metadata,
              "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "device": args.device, "budget_s": args.budget, "finished": False,
              "sections": {s: {"status": "pending"} for s in args.sections}}
    if args.commit is not None:
        report["git_commit"] = args.commit
    return report


def summarise(report: dict) -> dict:
    """``{"passed": [...], "failed": [...], "skipped": [...], "pending": [...]}`` by section."""
    out: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": [], "pending": []}
    for name, rec in report["sections"].items():
        out.setdefault(rec["status"], []).append(name)
    return out


def run_sections(sections, execute, report: dict, write, *, budget_s: float,
                 min_start_s: float = MIN_START_S, clock=time.monotonic) -> dict:
    """Run ``sections`` in order under one time budget, rewriting the report after each.

    Parameters
    ----------
    sections : list of :class:`Section`
    execute : callable ``(section, limit_s) -> outcome`` (see :func:`run_section_here`)
    report : dict from :func:`new_report`; updated in place and returned
    write : callable ``(report)``, called when a section starts and after it ends
    budget_s : seconds for all sections; each gets ``min(limit_s, what is left)``, and one that
        would start with less than ``min_start_s`` left is skipped with the reason
    """
    t0 = clock()
    for s in sections:
        rec = report["sections"][s.name]
        left = budget_s - (clock() - t0)
        if left < min_start_s:
            rec.clear()
            rec.update(status="skipped",
                       reason=f"time budget spent: {max(left, 0.0):.0f} s left of "
                              f"{budget_s:.0f} s (a section starts with >= {min_start_s:.0f} s)")
            logger.info("section %s skipped: %s", s.name, rec["reason"])
            write(report)
            continue
        limit = min(s.limit_s, left)
        rec.clear()
        rec.update(status="running", limit_s=round(limit, 1))
        write(report)
        logger.info("section %s: start (limit %.0f s, %.0f s of the budget left)", s.name,
                    limit, left)
        t = clock()
        outcome = execute(s, limit)
        rec.update(outcome, seconds=round(clock() - t, 2))
        logger.info("section %s: %s in %.1f s%s", s.name, rec["status"], rec["seconds"],
                    f" ({rec['reason']})" if rec.get("reason") else "")
        write(report)
    report["summary"] = summarise(report)
    report["finished"] = True
    write(report)
    return report


# ------------------------------------------------------------------------------- child processes

def child_command(script: Path, argv: list[str], name: str, limit_s: float,
                  result: Path) -> list[str]:
    """The command line of the child that runs section ``name``."""
    return [sys.executable, str(script), *argv, "--child", name, "--child-out", str(result),
            "--child-limit", f"{limit_s:.1f}"]


def _pump(stream, sink) -> None:
    for line in stream:
        sink(line)


def make_child_executor(script: Path, argv: list[str], tmpdir: Path, sink,
                        grace_s: float = CHILD_GRACE_S):
    """``execute(section, limit_s)`` that runs the section in a child process.

    The child's stdout and stderr go line by line to ``sink``; it is killed ``grace_s`` after
    ``limit_s``. Its outcome is read from the file it rewrites after every figure, so a killed
    or crashed child still returns what it measured, with the reason it ended.
    """
    def execute(section: Section, limit_s: float) -> dict:
        result = tmpdir / f"{section.name}.json"
        with contextlib.suppress(FileNotFoundError):
            result.unlink()
        cmd = child_command(script, argv, section.name, limit_s, result)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", env=env)
        pump = threading.Thread(target=_pump, args=(proc.stdout, sink), daemon=True)
        pump.start()
        killed = False
        try:
            rc = proc.wait(timeout=limit_s + grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            killed = True
        pump.join(timeout=10)
        out = _common.read_json(result) or {}  # the last flush if the child did not finish
        if out.get("status") in ("passed", "failed", "skipped"):
            if killed or rc != 0:
                out["exit"] = (f"killed after {limit_s + grace_s:.0f} s" if killed
                               else f"exit status {rc}") + " after reporting"
            return out
        figures = out.get("figures", {})
        if killed:
            return {"status": "failed", "figures": figures,
                    "reason": f"time limit: killed after {limit_s + grace_s:.0f} s"}
        return {"status": "failed", "figures": figures,
                "reason": f"the child process ended with exit status {rc} before reporting"}
    return execute


def child_main(args) -> int:
    """Run the section ``args.child`` here and write its outcome to ``args.child_out``."""
    def flush(figures):
        _common.write_json(args.child_out, {"status": "running", "figures": figures})

    section = SECTIONS[args.child]
    limit = args.child_limit if args.child_limit is not None else section.limit_s
    ctx = Context(args, limit, flush)
    flush(ctx.figures)
    outcome = run_section_here(section, ctx)
    if outcome.get("traceback"):
        logger.info("%s", outcome["traceback"].rstrip())
    # Worker threads the engine left running would hold the interpreter at exit: record them
    # (the process then ends through os._exit in __main__).
    lingering = [t.name for t in threading.enumerate()
                 if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if lingering:
        outcome["lingering_threads"] = lingering
        logger.info("threads still running after the section: %s", lingering)
    _common.write_json(args.child_out, outcome)
    return 0


class Tee:
    """A text sink that writes to stdout and to a log file, flushing both."""

    def __init__(self, path: Path):
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            sys.stdout.write(text)
            sys.stdout.flush()
            self._file.write(text)
            self._file.flush()

    def flush(self) -> None:
        """Nothing to do: every write is flushed (logging's handler calls this)."""

    def close(self) -> None:
        self._file.close()


# ------------------------------------------------------------------------------- engine calls
# Every call into xmc_engine is one of these small functions: the internals are being
# refactored, and a changed public signature is then fixed in one place.

def engine_cuda_available() -> bool:
    from xmc_engine.backends import cuda_available

    return cuda_available()


def engine_backend(device: str):
    """A fresh backend object for ``"cpu"`` or ``"cuda:N"``."""
    from xmc_engine.backends import get_backend

    if device == "cpu":
        return get_backend("cpu")
    return get_backend("cuda", int(device.split(":", 1)[1]))


def engine_reference():
    from xmc_engine.kernels import reference

    return reference


def engine_fit(X, Y, **params):
    """``XMCClassifier(**params).fit(X, Y)``; returns the fitted estimator."""
    from xmc_engine import XMCClassifier

    return XMCClassifier(**params).fit(X, Y)


def engine_evaluate(clf, X, Y, *, on_gpu: bool = False) -> dict:
    """P@1 and P@5 of a fitted estimator (inference on the CPU, or on GPU 0)."""
    if on_gpu:
        clf.to_gpu()
    try:
        met = clf.evaluate(X, Y, ks=(1, 5))
    finally:
        if on_gpu:
            clf.to_cpu()
    return {"P@1": float(met["P@1"]), "P@5": float(met["P@5"])}


def engine_init_params(X, n_labels: int, hidden: int, seed: int) -> list[np.ndarray]:
    """The engine's seeded initialisation ``[W1, b1, W2, b2]`` (host float32)."""
    from xmc_engine.model import ModelShape, init_params_for_data

    return init_params_for_data(ModelShape(X.shape[1], n_labels, (hidden,)), X, seed)


def engine_train_step(be, params, Xb, Yb, lr: float):
    """One SGD step of the engine's model on a host CSR batch; returns its loss sum."""
    from xmc_engine.model import train_step

    return train_step(be, params, Xb, Yb, lr)


def load_data(path: Path):
    """``(X, Y, X_test, Y_test)`` of the delicious folder ``path``."""
    from xmc_engine.datasets import load_dataset

    if not path.is_dir():
        raise SectionSkipped(
            f"no data at {path}: copy ../shared/data/delicious there (bench/GPU.md) or pass "
            "--data")
    X, Y, Xt, Yt = load_dataset(path)
    if Xt is None:
        raise SectionSkipped(f"{path} holds no test.txt[.xz]: the fit sections need one")
    return X, Y, Xt, Yt


def synthetic_rows(n_rows: int, n_features: int, n_labels: int, seed: int):
    """``n_rows`` synthetic training rows with Amazon-670K's statistics (about 75.7 non-zeros
    and 5.45 labels per row; power-law label frequencies) at the given sizes."""
    from xmc_engine.datasets import make_synthetic

    X, Y, _, _ = make_synthetic("amazon670k", n_train=n_rows, n_test=0,
                                n_features=n_features, n_labels=n_labels, seed=seed)
    return X, Y


def history_troubles(history: list[dict]) -> list[str]:
    """The run-log events of a fit that mean it did not train cleanly, plus ``"no final"``
    when the log has no ``final`` record."""
    bad = [r["event"] for r in history if r.get("event") in TROUBLE_EVENTS]
    if not any(r.get("event") == "final" for r in history):
        bad.append("no final")
    return bad


def final_record(history: list[dict]) -> dict:
    return next((r for r in reversed(history) if r.get("event") == "final"), {})


# ------------------------------------------------------------------------------- device helpers

@contextlib.contextmanager
def on_device(be):
    """``be``'s device and stream current for CuPy calls (nothing to do on the CPU)."""
    if be.name == "cuda":
        with be.xp.cuda.Device(be.device_id), be.stream:
            yield
    else:
        yield


def time_calls(be, fn, repeat: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``fn()`` after ``warmup`` untimed ones: CUDA events
    on ``be``'s stream on a GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    if be.name != "cuda":
        return _common.timings(fn, repeat, warmup=0)
    cp = be.xp
    out = []
    for _ in range(repeat):
        with on_device(be):
            start = be.stream.record()
        fn()
        with on_device(be):
            stop = be.stream.record()
        stop.synchronize()  # synchronize!
        out.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return out


def device_memory(be) -> dict:
    """GPU memory in use: CuPy's pool (``pool_total_bytes`` is what the pool holds, its
    high-water mark while no block is freed back) and ``cudaMemGetInfo``; on the CPU the peak
    RSS."""
    if be.name != "cuda":
        return {"peak_rss_mib": _common.peak_rss_mib()}
    cp = be.xp
    pool = cp.get_default_memory_pool()
    with cp.cuda.Device(be.device_id):
        free, total = cp.cuda.runtime.memGetInfo()
    return {"pool_total_bytes": int(pool.total_bytes()), "pool_used_bytes": int(pool.used_bytes()),
            "device_used_bytes": int(total - free), "device_total_bytes": int(total)}


def gpu_info(device: str) -> dict | None:
    """Name, SMs, memory and versions of the GPU under test (``None`` on the CPU)."""
    if device == "cpu":
        return None
    try:
        import cupy

        rt = cupy.cuda.runtime
        props = rt.getDeviceProperties(int(device.split(":", 1)[1]))
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return {"name": name, "sm_count": props["multiProcessorCount"],
                "total_mem_GiB": round(props["totalGlobalMem"] / 2**30, 1),
                "compute_capability": f"{props['major']}.{props['minor']}",
                "n_devices": rt.getDeviceCount(), "driver": rt.driverGetVersion(),
                "runtime": rt.runtimeGetVersion(), "cupy": cupy.__version__,
                "CUPY_TF32": os.environ.get("CUPY_TF32")}
    except Exception as e:  # noqa: BLE001 - the record must not stop the check
        return {"error": f"{type(e).__name__}: {e}"}


# ------------------------------------------------------------------------------- kernels

def _close(ctx, name, got, want, atol, rtol=1e-4):
    # a wrong kernel may leave memory as it was allocated: its bits can be a signalling NaN,
    # whose cast warns (the check fails either way)
    with np.errstate(invalid="ignore", over="ignore"):
        got = np.asarray(got, dtype=np.float64)
        want = np.asarray(want, dtype=np.float64)
        err = float(np.max(np.abs(got - want))) if got.size else 0.0
        ok = got.shape == want.shape and bool(np.allclose(got, want, atol=atol, rtol=rtol))
    return ctx.check(name, ok, max_abs_err=err, atol=atol)


def _loss_close(ctx, name, be, loss, want):
    be.synchronize()  # synchronize! (the loss is read only once the stream is done)
    got = float(loss)
    return ctx.check(name, abs(got - want) <= 1e-4 * max(abs(want), 1.0), got=got, want=want)


def kernel_problem(seed: int = 0) -> dict:
    """Small random inputs (host): B=37 rows (row 3 without features, row 5 without labels),
    500 features, hidden 70, 1001 labels; sizes that are not multiples of any block size."""
    import scipy.sparse as sps

    rng = np.random.default_rng(seed)
    f32 = np.float32
    B, F, nh, L = 37, 500, 70, 1001
    X = sps.random(B, F, density=0.05, format="lil", dtype=f32, random_state=seed + 1)
    X[3, :] = 0
    Y = sps.random(B, L, density=0.004, format="lil", dtype=f32, random_state=seed + 2)
    Y[5, :] = 0
    Y[0, 7] = 1.0  # at least one label in the batch
    X, Y = X.tocsr(), Y.tocsr()
    Y.data[:] = 1.0
    return {
        "B": B, "F": F, "nh": nh, "L": L, "X": X, "Y": Y, "rng": rng,
        "W1": rng.standard_normal((F, nh)).astype(f32),
        "b1": rng.standard_normal(nh).astype(f32),
        "W2": (rng.standard_normal((nh, L)) * 0.1).astype(f32),
        "b2": (rng.standard_normal(L) * 0.1).astype(f32),
        "dZ1": rng.standard_normal((B, nh)).astype(f32),
    }


def check_sparse_layer(ctx, be, ref, pb):
    X, W1, b1, dZ1 = pb["X"], pb["W1"], pb["b1"], pb["dZ1"]
    ip, ix, d = be.csr_parts(X)
    H = be.zeros((pb["B"], pb["nh"]))
    be.sparse_forward(ip, ix, d, be.asarray(W1), be.asarray(b1), H)
    _close(ctx, "sparse_forward", be.to_host(H),
           ref.sparse_forward(X.indptr, X.indices, X.data, W1, b1), 1e-4)
    Wd, bd = be.asarray(W1.copy()), be.asarray(b1.copy())
    be.sparse_backward_update(ip, ix, d, be.asarray(dZ1), Wd, bd, 0.1)
    Wr, br = ref.sparse_backward_update(X.indptr, X.indices, X.data, dZ1, W1, b1, 0.1)
    _close(ctx, "sparse_backward_update W1", be.to_host(Wd), Wr, 1e-4)
    _close(ctx, "sparse_backward_update b1", be.to_host(bd), br, 1e-4)
    rows, g, gb = be.sparse_grad(ip, ix, d, be.asarray(dZ1))
    r_rows, r_g, r_gb = ref.sparse_grad(X.indptr, X.indices, X.data, dZ1)
    ctx.check("sparse_grad rows", np.array_equal(be.to_host(rows), r_rows))
    _close(ctx, "sparse_grad grad_rows", be.to_host(g), r_g, 1e-4)
    _close(ctx, "sparse_grad grad_b1", be.to_host(gb), r_gb, 1e-4)
    Wd = be.asarray(W1.copy())
    be.sparse_rows_update(Wd, be.asarray(r_rows), be.asarray(r_g), 0.1)
    _close(ctx, "sparse_rows_update", be.to_host(Wd),
           ref.sparse_rows_update(W1, r_rows, r_g, 0.1), 1e-5)
    Hr = ref.sparse_forward(X.indptr, X.indices, X.data, W1, b1).astype(np.float32)
    dHd = be.asarray(dZ1.copy())
    be.relu_backward(dHd, be.asarray(Hr))
    _close(ctx, "relu_backward", be.to_host(dHd), ref.relu_backward(dZ1, Hr), 0.0, 0.0)


def check_output_layer(ctx, be, ref, pb):
    X, Y, W1, b1, W2, b2 = pb["X"], pb["Y"], pb["W1"], pb["b1"], pb["W2"], pb["b2"]
    f64 = np.float64
    Hr = ref.sparse_forward(X.indptr, X.indices, X.data, W1, b1).astype(np.float32)
    yp, yi = be.asarray(Y.indptr), be.asarray(Y.indices)
    Z = (Hr @ W2 + b2).astype(np.float32)
    Zd = be.asarray(Z.copy())
    loss = be.softmax_xent(Zd, yp, yi, 0.5)
    dZr, loss_r = ref.softmax_xent(Z.astype(f64), Y.indptr, Y.indices, 0.5)
    _loss_close(ctx, "softmax_xent loss", be, loss, loss_r)
    _close(ctx, "softmax_xent dZ", be.to_host(Zd), dZr, 1e-6)
    Hd = be.asarray(Hr)
    step_r = ref.output_layer_step(Hr.astype(f64), W2.astype(f64), b2.astype(f64), Y.indptr,
                                   Y.indices, 0.5)
    grad_r = ref.output_layer_grad(Hr.astype(f64), W2.astype(f64), b2.astype(f64), Y.indptr,
                                   Y.indices)
    for chunk in (None, 300):
        tag = f"chunk={chunk}"
        W2d, b2d, dHo = be.asarray(W2.copy()), be.asarray(b2.copy()), be.zeros(Hr.shape)
        loss = be.output_layer_step(Hd, W2d, b2d, yp, yi, 0.5, dHo, label_chunk=chunk)
        _loss_close(ctx, f"output_layer_step {tag} loss", be, loss, step_r[0])
        _close(ctx, f"output_layer_step {tag} W2", be.to_host(W2d), step_r[1], 1e-5)
        _close(ctx, f"output_layer_step {tag} b2", be.to_host(b2d), step_r[2], 1e-5)
        _close(ctx, f"output_layer_step {tag} dH", be.to_host(dHo), step_r[3], 1e-5)
        lg, dW2, db2, dHg = be.output_layer_grad(Hd, be.asarray(W2), be.asarray(b2), yp, yi,
                                                 label_chunk=chunk)
        _loss_close(ctx, f"output_layer_grad {tag} loss", be, lg, grad_r[0])
        _close(ctx, f"output_layer_grad {tag} dW2", be.to_host(dW2), grad_r[1], 1e-5)
        _close(ctx, f"output_layer_grad {tag} db2", be.to_host(db2), grad_r[2], 1e-5)
        _close(ctx, f"output_layer_grad {tag} dH", be.to_host(dHg), grad_r[3], 1e-5)
        idx, val = be.predict_scores_topk(Hd, be.asarray(W2), be.asarray(b2), 5,
                                          label_chunk=chunk)
        _check_topk(ctx, f"predict_scores_topk {tag}", be, idx, val, Z, 5)
    idx, val = be.topk(be.asarray(Z), 5)
    _check_topk(ctx, "topk", be, idx, val, Z, 5)
    # the logistic loss (loss="bce"): its kernels, whole and in label chunks
    dZb, loss_b = ref.bce_xent(Z.astype(f64), Y.indptr, Y.indices, 1.0 / Z.shape[0])
    for chunk in (None, 300):
        W2d, b2d, dHo = be.asarray(W2.copy()), be.asarray(b2.copy()), be.zeros(Hr.shape)
        lg, dW2, db2, dHg = be.output_layer_grad(Hd, W2d, b2d, yp, yi, label_chunk=chunk,
                                                 loss="bce")
        _loss_close(ctx, f"bce output_layer_grad chunk={chunk} loss", be, lg, loss_b)
        _close(ctx, f"bce output_layer_grad chunk={chunk} db2", be.to_host(db2),
               dZb.sum(axis=0), 1e-5)
        _close(ctx, f"bce output_layer_grad chunk={chunk} dW2", be.to_host(dW2),
               Hr.astype(f64).T @ dZb, 1e-5)


def _check_topk(ctx, name, be, idx, val, Z, k):
    """The returned values are the k largest of each row, in descending order, and each is the
    score of the label returned beside it (ties may pick either label)."""
    idx, val = be.to_host(idx), be.to_host(val)
    _, want = engine_reference().topk(Z, k)
    picked = np.take_along_axis(Z, np.asarray(idx, dtype=np.int64), axis=1)
    ok = (idx.shape == want.shape and bool(np.allclose(val, want, atol=1e-5, rtol=1e-5))
          and bool(np.allclose(picked, val, atol=1e-5, rtol=1e-5)))
    ctx.check(name, ok, max_abs_err=float(np.max(np.abs(val - want))) if ok else None)


def check_merge_and_adagrad(ctx, be, ref, pb):
    rng = pb["rng"]
    f32 = np.float32
    a1, a2, a3 = (rng.standard_normal(1000).astype(f32) for _ in range(3))
    o = be.empty(1000)
    be.weighted_sum([be.asarray(a1), be.asarray(a2)], [0.3, 0.7], o)
    _close(ctx, "weighted_sum", be.to_host(o), ref.weighted_sum([a1, a2], [0.3, 0.7]), 1e-6)
    be.momentum(be.asarray(a1), be.asarray(a2), be.asarray(a3), 0.9, o)
    _close(ctx, "momentum", be.to_host(o), ref.momentum(a1, a2, a3, 0.9), 1e-6)
    x, diff = be.asarray(a1.copy()), be.empty(1000)
    be.elastic(x, be.asarray(a2), 0.1, diff)
    x_r, diff_r = ref.elastic(a1, a2, 0.1)
    _close(ctx, "elastic x", be.to_host(x), x_r, 1e-6)
    _close(ctx, "elastic diff", be.to_host(diff), diff_r, 1e-6)
    acc0 = np.abs(a3)
    w, acc = be.asarray(a1.copy()), be.asarray(acc0.copy())
    be.adagrad_dense(w, be.asarray(a2), acc, 0.05, 1e-10)
    w_r, acc_r = ref.adagrad_dense(a1, a2, acc0, 0.05, 1e-10)
    _close(ctx, "adagrad_dense w", be.to_host(w), w_r, 1e-5)
    _close(ctx, "adagrad_dense acc", be.to_host(acc), acc_r, 1e-5)
    W = rng.standard_normal((300, 70)).astype(f32)
    A = np.abs(rng.standard_normal((300, 70))).astype(f32)
    rows = np.unique(rng.integers(0, 300, 90)).astype(np.int64)
    G = rng.standard_normal((rows.size, 70)).astype(f32)
    Wd, Ad = be.asarray(W.copy()), be.asarray(A.copy())
    be.adagrad_rows(Wd, be.asarray(rows), be.asarray(G), Ad, 0.05, 1e-10)
    W_r, A_r = ref.adagrad_rows(W, rows, G, A, 0.05, 1e-10)
    _close(ctx, "adagrad_rows W", be.to_host(Wd), W_r, 1e-5)
    _close(ctx, "adagrad_rows acc", be.to_host(Ad), A_r, 1e-5)


def check_sampled_layer(ctx, be, ref, pb):
    """The sampled output layer's kernels (``output="sampled"``): the column gather, scatter
    and Adagrad, and the gradient on the candidate labels with each loss."""
    rng, f32, f64 = pb["rng"], np.float32, np.float64
    X, Y, W1, b1, W2, b2 = pb["X"], pb["Y"], pb["W1"], pb["b1"], pb["W2"], pb["b2"]
    nh, L = pb["nh"], pb["L"]
    cols = np.unique(np.concatenate([Y.indices, rng.integers(0, L, 200)])).astype(np.int64)
    m = cols.size
    W2s, b2s = be.empty((nh, m)), be.empty(m)
    be.gather_columns(be.asarray(W2), be.asarray(b2), be.asarray(cols), W2s, b2s)
    W2_r, b2_r = ref.gather_columns(W2, b2, cols)
    _close(ctx, "gather_columns W2", be.to_host(W2s), W2_r, 0.0, 0.0)
    _close(ctx, "gather_columns b2", be.to_host(b2s), b2_r, 0.0, 0.0)
    dW2s = rng.standard_normal((nh, m)).astype(f32)
    db2s = rng.standard_normal(m).astype(f32)
    W2d, b2d = be.asarray(W2.copy()), be.asarray(b2.copy())
    be.scatter_add_columns(W2d, b2d, be.asarray(cols), be.asarray(dW2s), be.asarray(db2s), -0.1)
    W_r, b_r = ref.scatter_add_columns(W2, b2, cols, dW2s, db2s, -0.1)
    _close(ctx, "scatter_add_columns W2", be.to_host(W2d), W_r, 1e-6)
    _close(ctx, "scatter_add_columns b2", be.to_host(b2d), b_r, 1e-6)
    aW, ab = np.abs(W2).astype(f32), np.abs(b2).astype(f32)
    W2d, b2d, aWd, abd = (be.asarray(a.copy()) for a in (W2, b2, aW, ab))
    be.adagrad_columns(W2d, b2d, aWd, abd, be.asarray(cols), be.asarray(dW2s),
                       be.asarray(db2s), 0.05, 1e-10)
    for name, got, want in zip(("W2", "b2", "acc_W2", "acc_b2"), (W2d, b2d, aWd, abd),
                               ref.adagrad_columns(W2, b2, aW, ab, cols, dW2s, db2s, 0.05,
                                                   1e-10), strict=True):
        _close(ctx, f"adagrad_columns {name}", be.to_host(got), want, 1e-5)
    # the gradient on the candidates: the batch's labels first, then negatives
    pos = np.unique(Y.indices).astype(np.int64)
    neg = np.setdiff1d(cols, pos)
    cand = np.concatenate([pos, neg]).astype(np.int64)
    where = {int(c): j for j, c in enumerate(cand)}
    local = np.array([where[int(y)] for y in Y.indices], dtype=np.int32)
    H = ref.sparse_forward(X.indptr, X.indices, X.data, W1, b1).astype(f32)
    B, log_w = H.shape[0], -1.5
    yp = be.asarray(Y.indptr)
    for loss in ("softmax", "bce"):
        got = be.sampled_output_grad(be.asarray(H), be.asarray(W2), be.asarray(b2),
                                     be.asarray(cand), pos.size, log_w, yp, be.asarray(local),
                                     loss=loss)
        Ws, H64 = W2[:, cand].astype(f64), H.astype(f64)
        if loss == "softmax":  # the negatives' logits carry the sampled-softmax weight
            offs = np.zeros(cand.size)
            offs[pos.size:] = log_w
            want_loss, dW2, db2, dH = ref.sampled_output_grad(
                H64, W2.astype(f64), b2.astype(f64), Y.indptr, Y.indices, cand, offs)
            wants = (dW2[:, cand], db2[cand], dH)
        else:  # each candidate's term counted once (the reference has no sampled form)
            dZ, want_loss = ref.bce_xent(H64 @ Ws + b2[cand], Y.indptr, local, 1.0 / B)
            wants = (H64.T @ dZ, dZ.sum(axis=0), dZ @ Ws.T)
        _loss_close(ctx, f"sampled_output_grad {loss} loss", be, got[0], want_loss)
        for name, g, want in zip(("dW2s", "db2s", "dH"), got[1:], wants, strict=True):
            _close(ctx, f"sampled_output_grad {loss} {name}", be.to_host(g), want, 1e-5)


def check_sparse_merge(ctx, be, ref, pb):
    """The row- and column-sparse merge and broadcast of ``adaptive`` / ``average``."""
    rng, f32 = pb["rng"], np.float32
    A = [rng.standard_normal((300, 70)).astype(f32) for _ in range(2)]
    out0 = rng.standard_normal((300, 70)).astype(f32)
    rows = np.unique(rng.integers(0, 300, 90)).astype(np.int64)
    out = be.asarray(out0.copy())
    finite, delta = be.merge_rows([be.asarray(a) for a in A], [0.3, 0.7], rows, out)
    want = out0.astype(np.float64).copy()
    want[rows] = ref.weighted_sum([a[rows] for a in A], [0.3, 0.7])
    ctx.check("merge_rows finite", bool(finite))
    _close(ctx, "merge_rows", be.to_host(out), want, 1e-5)
    want_delta = float((want[rows] ** 2).sum() - (out0[rows].astype(np.float64) ** 2).sum())
    ctx.check("merge_rows norm change", abs(delta - want_delta) <= 1e-3 * max(1.0, abs(want_delta)),
              got=float(delta), want=want_delta)
    dst = be.asarray(A[0].copy())
    be.copy_rows(dst, be.asarray(A[1]), rows)
    want = A[0].copy()
    want[rows] = A[1][rows]
    _close(ctx, "copy_rows", be.to_host(dst), want, 0.0, 0.0)
    cols = np.unique(rng.integers(0, 70, 30)).astype(np.int64)
    Q = rng.random((2, cols.size)).astype(f32)
    out = be.asarray(out0.copy())
    ok = be.merge_columns([be.asarray(a) for a in A], Q, cols, out)
    want = out0.astype(np.float64).copy()
    want[:, cols] = Q[0] * A[0][:, cols] + Q[1] * A[1][:, cols]
    ctx.check("merge_columns finite", bool(ok))
    _close(ctx, "merge_columns", be.to_host(out), want, 1e-5)
    dst = be.asarray(A[0].copy())
    be.copy_columns(dst, be.asarray(A[1]), cols)
    want = A[0].copy()
    want[:, cols] = A[1][:, cols]
    _close(ctx, "copy_columns", be.to_host(dst), want, 0.0, 0.0)
    # the merges that write the merged values back (the scheduler's sparse merge)
    Ad = [be.asarray(a.copy()) for a in A]
    be.merge_rows(Ad, [0.3, 0.7], rows, be.asarray(out0.copy()), broadcast=True)
    merged = 0.3 * A[0][rows].astype(np.float64) + 0.7 * A[1][rows]
    for i, a in enumerate(Ad):
        _close(ctx, f"merge_rows broadcast replica {i}", be.to_host(a)[rows], merged, 1e-5)
    Ad = [be.asarray(a.copy()) for a in A]
    be.merge_columns(Ad, Q, cols, be.asarray(out0.copy()), broadcast=True)
    merged = Q[0] * A[0][:, cols].astype(np.float64) + Q[1] * A[1][:, cols]
    for i, a in enumerate(Ad):
        _close(ctx, f"merge_columns broadcast replica {i}", be.to_host(a)[:, cols], merged,
               1e-5)
    bad = A[1].copy()
    bad[rows[0], 3] = np.nan
    finite, _ = be.merge_rows([be.asarray(A[0]), be.asarray(bad)], [0.5, 0.5], rows,
                              be.asarray(out0.copy()))
    ctx.check("merge_rows reports a NaN", not finite)


KERNEL_GROUPS = {"sparse_layer": check_sparse_layer, "output_layer": check_output_layer,
                 "merge_and_adagrad": check_merge_and_adagrad,
                 "sampled_layer": check_sampled_layer, "sparse_merge": check_sparse_merge}


def section_kernels(ctx: Context) -> None:
    """Every launcher of the backend against the reference; a group that raises is recorded as
    a failed check and the next group still runs."""
    be = engine_backend(ctx.args.device)
    ref = engine_reference()
    pb = kernel_problem(ctx.args.seed)
    for name, group in KERNEL_GROUPS.items():
        t = time.perf_counter()
        try:
            group(ctx, be, ref, pb)
        except Exception as e:  # noqa: BLE001 - one broken launcher must not hide the others
            ctx.check(f"{name} ran", False, error=f"{type(e).__name__}: {e}",
                      traceback=traceback.format_exc())
        ctx.put(f"seconds_{name}", round(time.perf_counter() - t, 2))


# ------------------------------------------------------------------------------- fits

def fit_specs(section: str, device: str) -> tuple[str, str, str, dict | None]:
    """``(algorithm, spec under test, CPU reference spec, algorithm_params)`` of a fit section."""
    if section == "fit_single":
        return "single", device, "cpu", None
    if section == "sync":
        return "sync", f"{device},{device}", "cpu,cpu", None
    if section == "adaptive":
        return "adaptive", f"{device},{device}@0.5", "cpu,cpu@0.5", dict(ADAPTIVE_PARAMS)
    raise ValueError(f"{section!r} is not a fit section; expected one of {list(FIT_TOLERANCE)}")


def _fit_record(clf, seconds: float, quality: dict) -> dict:
    fin = final_record(clf.history_)
    merges = [r for r in clf.history_ if r.get("event") == "merge"]
    rec = {"wall_s": round(seconds, 2), "train_time_s": fin.get("train_time"),
           "samples": fin.get("samples"), "mean_loss": fin.get("mean_loss"),
           "events": sorted({r.get("event") for r in clf.history_}), "merges": len(merges),
           "solo_merges": sum(r.get("solo") is not None for r in merges), **quality}
    if fin.get("train_time"):
        rec["samples_per_s"] = fin["samples"] / fin["train_time"]
    if merges:
        rec["last_merge"] = [{k: d.get(k) for k in MERGE_FIELDS}
                             for d in merges[-1].get("devices", [])]
    return rec


def run_fit_section(ctx: Context, section: str) -> None:
    """Fit on the device under test and on the CPU (same seed, same parameters), evaluate both
    on the CPU, and check the fit ran cleanly and P@1 agrees within ``FIT_TOLERANCE``."""
    args = ctx.args
    algorithm, spec, cpu_spec, algo_params = fit_specs(section, args.device)
    X, Y, Xt, Yt = load_data(args.data)
    ctx.put("data", {"path": str(args.data), "n_train": X.shape[0], "n_test": Xt.shape[0],
                     "n_features": X.shape[1], "n_labels": Y.shape[1]})
    params = {"devices": spec, "algorithm": algorithm, "seed": args.seed,
              "algorithm_params": algo_params}
    if args.epochs is not None:
        params["epochs"] = args.epochs
    ctx.put("params", params)
    t = time.perf_counter()
    clf = engine_fit(X, Y, **params)
    rec = _fit_record(clf, time.perf_counter() - t, engine_evaluate(clf, Xt, Yt))
    ctx.put("device_run", rec)
    troubles = history_troubles(clf.history_)
    ctx.check("trained cleanly", not troubles, events=troubles)
    if section == "adaptive":
        ctx.check("the first device trained periods alone (solo_epochs)",
                  rec["solo_merges"] > 0, solo_merges=rec["solo_merges"], merges=rec["merges"])
        compare_adaptive_on_virtual_clock(ctx, params, spec, cpu_spec, X, Y, Xt, Yt, rec)
        return
    if section in args.cpu_p1:
        cpu_p1, source = args.cpu_p1[section], "--cpu-p1"
    else:
        t = time.perf_counter()
        cpu = engine_fit(X, Y, **dict(params, devices=cpu_spec))
        cpu_rec = _fit_record(cpu, time.perf_counter() - t, engine_evaluate(cpu, Xt, Yt))
        ctx.put("cpu_run", dict(cpu_rec, devices=cpu_spec))
        cpu_p1, source = cpu_rec["P@1"], cpu_spec
    tol = FIT_TOLERANCE[section]
    diff = abs(rec["P@1"] - cpu_p1)
    ctx.check(f"|P@1 - CPU P@1| <= {tol}", diff <= tol, p1=rec["P@1"], cpu_p1=cpu_p1,
              cpu_source=source, diff=diff)
    if section == "fit_single" and spec.startswith("cuda"):
        # Last, so that a failure of the GPU inference path leaves the training checks intact.
        try:
            gpu = engine_evaluate(clf, Xt, Yt, on_gpu=True)
        except Exception as e:  # noqa: BLE001 - recorded as a failed check
            ctx.check("GPU inference ran", False, error=f"{type(e).__name__}: {e}",
                      traceback=traceback.format_exc())
        else:
            ctx.put("gpu_inference", gpu)
            d = abs(gpu["P@1"] - rec["P@1"])
            ctx.check("|P@1 of GPU inference - CPU inference| <= 0.005", d <= 0.005, diff=d)


def simulated_fit(params: dict, spec: str, X, Y, Xt, Yt) -> dict:
    """Fit with ``params`` on ``spec`` on the virtual clock of :data:`SIM_COST_S`
    (``fit_model(simulate=...)``: the devices take turns, the schedule depends on the speed
    factors alone); P@1 and P@5 evaluated on the CPU."""
    from xmc_engine import XMCClassifier
    from xmc_engine.backends import get_backend
    from xmc_engine.metrics import evaluate
    from xmc_engine.model import predict_topk
    from xmc_engine.training import fit_model

    fixed, per_row = SIM_COST_S
    cfg = XMCClassifier(**dict(params, devices=spec)).get_config()
    t = time.perf_counter()
    res = fit_model(cfg, X, Y, simulate=lambda i, n: fixed + n * per_row)
    wall = time.perf_counter() - t
    be = get_backend("cpu")
    top, _ = predict_topk(be, [be.asarray(p) for p in res["params"]], Xt, 5)
    met = evaluate(top, Yt, ks=(1, 5))
    merges = [r for r in res["history"] if r.get("event") == "merge"]
    return {"devices": spec, "wall_s": round(wall, 2), "merges": len(merges),
            "P@1": float(met["P@1"]), "P@5": float(met["P@5"]),
            "troubles": history_troubles(res["history"]),
            "last_merge": [{k: d.get(k) for k in MERGE_FIELDS}
                           for d in (merges[-1].get("devices", []) if merges else [])]}


def compare_adaptive_on_virtual_clock(ctx: Context, params: dict, spec: str, cpu_spec: str,
                                      X, Y, Xt, Yt, threaded: dict) -> None:
    """adaptive's checks: the threaded run above trained cleanly (its P@1 is recorded, not
    compared: its schedule follows measured speeds); the same fit on the virtual clock on the
    device and on the CPU follows one schedule, so P@1 must agree within the tolerance."""
    tol = FIT_TOLERANCE["adaptive"]
    dev = simulated_fit(params, spec, X, Y, Xt, Yt)
    ctx.put("virtual_clock_run", dev)
    ctx.check("virtual-clock run trained cleanly", not dev["troubles"], events=dev["troubles"])
    if "adaptive" in ctx.args.cpu_p1:
        cpu_p1, source = ctx.args.cpu_p1["adaptive"], "--cpu-p1"
    else:
        cpu = simulated_fit(params, cpu_spec, X, Y, Xt, Yt)
        ctx.put("virtual_clock_cpu_run", cpu)
        cpu_p1, source = cpu["P@1"], cpu_spec
        ctx.check("same virtual-clock schedule on both",
                  [d["batch_size"] for d in dev["last_merge"]]
                  == [d["batch_size"] for d in cpu["last_merge"]],
                  device=dev["last_merge"], cpu=cpu["last_merge"])
    diff = abs(dev["P@1"] - cpu_p1)
    ctx.check(f"virtual clock: |P@1 - CPU P@1| <= {tol}", diff <= tol, p1=dev["P@1"],
              cpu_p1=cpu_p1, cpu_source=source, diff=diff)
    ctx.put("threaded_vs_virtual_p1", {"threaded": threaded["P@1"], "virtual": dev["P@1"]})


def section_fit_single(ctx: Context) -> None:
    run_fit_section(ctx, "fit_single")


def section_sync(ctx: Context) -> None:
    run_fit_section(ctx, "sync")


def section_adaptive(ctx: Context) -> None:
    run_fit_section(ctx, "adaptive")


# ------------------------------------------------------------------------------- throughput

def throughput_shape(scale: float) -> dict:
    """The Amazon-670K shape with features and labels multiplied by ``scale`` (at least 1)."""
    return {"n_features": max(1, round(AMAZON_670K["n_features"] * scale)),
            "n_labels": max(1, round(AMAZON_670K["n_labels"] * scale)),
            "hidden": THROUGHPUT_HIDDEN, "batch_size": THROUGHPUT_BATCH}


def projected_epoch_s(samples_per_s: float, n_train: int = AMAZON_670K["n_train"]) -> float:
    """Seconds of one epoch over ``n_train`` samples at ``samples_per_s``."""
    return n_train / samples_per_s if samples_per_s > 0 else float("inf")


def gemm_share(gemm_s: dict, step_s: float) -> float:
    """Share of a step's time that the GEMMs alone take (may exceed 1 with measurement noise)."""
    return sum(gemm_s.values()) / step_s if step_s > 0 else float("nan")


def time_engine_steps(be, params, batches, lr: float, warmup: int) -> dict:
    """Engine steps on pre-sliced host batches (upload included, as in training): wall-clock
    seconds per step after ``warmup`` steps, and the last loss read after synchronising."""
    for Xb, Yb in batches[:warmup]:
        engine_train_step(be, params, Xb, Yb, lr)
    be.synchronize()  # synchronize!
    timed = batches[warmup:]
    t0 = time.perf_counter()
    loss = None
    for Xb, Yb in timed:
        loss = engine_train_step(be, params, Xb, Yb, lr)
    be.synchronize()  # synchronize!
    dt = time.perf_counter() - t0
    return {"steps": len(timed), "step_ms": 1e3 * dt / len(timed),
            "samples_per_s": sum(Xb.shape[0] for Xb, _ in timed) / dt,
            "last_loss_sum": float(loss)}


def time_gemms(be, W2, B: int, repeat: int = 10) -> dict:
    """The step's three GEMMs alone at its shapes, median seconds each: ``Z = H @ W2``,
    ``dH = dZ @ W2.T`` and the in-place update ``W2 -= lr * H.T @ dZ``."""
    xp = be.xp
    h, L = W2.shape
    with on_device(be):
        H = xp.ones((B, h), dtype=xp.float32)
        Z = xp.empty((B, L), dtype=xp.float32)
        dH = xp.empty((B, h), dtype=xp.float32)
        Wc = W2.copy()
        xp.matmul(H, W2, out=Z)
        Z *= 1e-6
        if be.name == "cuda":
            import cupy.cublas

            def update():
                cupy.cublas.gemm("T", "N", H, Z, out=Wc, alpha=-1e-3, beta=1.0)
        else:
            def update():
                xp.subtract(Wc, 1e-3 * (H.T @ Z), out=Wc)
        fns = {"forward H@W2": lambda: xp.matmul(H, W2, out=Z),
               "backward dZ@W2.T": lambda: xp.matmul(Z, W2.T, out=dH),
               "update W2 += H.T@dZ": update}
        out = {k: float(np.median(time_calls(be, f, repeat))) for k, f in fns.items()}
    be.synchronize()  # synchronize!
    return out


def time_softmax(be, B: int, L: int, repeat: int = 10, seed: int = 0) -> dict:
    """The plain path's softmax with its db2 column sum alone at ``(B, L)``, median seconds:
    the tiled kernels (``backend.softmax_bias``) and the previous design (one block per row,
    then a column-sum pass); and the largest |difference| of their dZ and db2."""
    from xmc_engine.kernels import output_layer, sparse_backward

    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 9, size=B)
    yp = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    yi = np.concatenate([np.sort(rng.choice(L, size=c, replace=False)) for c in counts])
    Z0 = be.asarray(rng.standard_normal((B, L), dtype=np.float32))
    b2 = be.asarray(rng.standard_normal(L, dtype=np.float32) * 0.1)
    ypd, yid = be.asarray(yp), be.asarray(yi.astype(np.int32))
    with on_device(be):
        Z = Z0.copy()
        db2 = be.xp.zeros(L, dtype=np.float32)
        db2_old = be.xp.zeros(L, dtype=np.float32)
        loss_rows = be.xp.zeros(B, dtype=np.float64)

    def tiled():
        be.softmax_bias(Z, b2, ypd, yid, 1.0 / B, db2)

    def rowblock():
        with on_device(be):
            be._launch(output_layer.softmax_rowblock_launch, Z, ypd, yid, 1.0 / B, loss_rows,
                       bias=b2)
            db2_old[...] = 0
            be._launch(sparse_backward.column_sum_launch, Z, db2_old, 1.0)

    out = {}
    for name, fn in (("tiled", tiled), ("rowblock + column sum", rowblock)):
        with on_device(be):
            Z[...] = Z0
        out[name] = float(np.median(time_calls(be, fn, repeat)))
    with on_device(be):  # once more each from the same logits, to compare the results
        Z[...] = Z0
        tiled()
        dz_new = be.to_host(Z)
        Z[...] = Z0
        rowblock()
        dz_old = be.to_host(Z)
    be.synchronize()  # synchronize!
    out["max_abs_diff_dZ"] = float(np.abs(dz_new - dz_old).max())
    out["max_abs_diff_db2"] = float(np.abs(be.to_host(db2) - be.to_host(db2_old)).max())
    return out


def torch_step_rate(device: str, X, Y, params, batches, lr: float, warmup: int) -> dict:
    """The same network in PyTorch (``bench/torch_baseline.py``'s ``SparseMLP``: EmbeddingBag
    with sparse gradient + bias + ReLU + Linear, softmax cross-entropy against ``y/|y|``, plain
    SGD) from the engine's initial weights, on the same host batches; each step includes the
    batch's upload. Timed with CUDA events on a GPU."""
    try:
        import torch
        import torch_baseline as tb
    except ImportError as e:
        raise SectionSkipped(f"PyTorch not importable: {e}") from None
    dev = torch.device(device)
    n_features, n_labels = X.shape[1], Y.shape[1]
    model = tb.SparseMLP(n_features, n_labels, params[0].shape[1], sparse=True,
                         init=params).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    host = [tb.csr_to_batch(Xb, Yb) for Xb, Yb in batches]
    on_gpu = dev.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(dev)

    def step(b):
        inp, off = b.input.to(dev), b.offsets.to(dev)
        psw, target = b.per_sample_weights.to(dev), b.target.to(dev)
        if not target.is_coalesced():  # batch_loss reads target.indices()
            target = target.coalesce()
        opt.zero_grad(set_to_none=True)
        loss = tb.batch_loss(model(inp, off, psw), target, 1.0 / b.n_rows)
        loss.backward()
        opt.step()
        return loss

    for b in host[:warmup]:
        step(b)
    timed = host[warmup:]
    if on_gpu:
        torch.cuda.synchronize(dev)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for b in timed:
        loss = step(b)
    if on_gpu:
        stop.record()
        torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t0
    gpu_s = start.elapsed_time(stop) / 1e3 if on_gpu else wall
    out = {"torch": torch.__version__, "steps": len(timed), "step_ms": 1e3 * wall / len(timed),
           "event_step_ms": 1e3 * gpu_s / len(timed),
           "samples_per_s": sum(b.n_rows for b in timed) / wall,
           "last_loss_mean": float(loss.detach())}
    if on_gpu:
        out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(dev))
        out["allow_tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
    return out


def section_throughput(ctx: Context) -> None:
    """Samples/s, projected epoch, GEMM share and peak memory at the Amazon-670K shape, and
    the same network in PyTorch beside it."""
    args = ctx.args
    shape = throughput_shape(args.scale)
    B, warmup = shape["batch_size"], 3
    n_rows = max(args.steps + warmup, args.fit_steps) * B
    ctx.put("shape", dict(shape, synthetic_rows=n_rows))
    t = time.perf_counter()
    X, Y = synthetic_rows(n_rows, shape["n_features"], shape["n_labels"], args.seed)
    ctx.put("data", {"seconds": round(time.perf_counter() - t, 2),
                     "nnz_per_row": X.nnz / n_rows, "labels_per_row": Y.nnz / n_rows})
    batches = [(X[i * B:(i + 1) * B], Y[i * B:(i + 1) * B]) for i in range(args.steps + warmup)]
    host_params = engine_init_params(X, shape["n_labels"], shape["hidden"], args.seed)
    lr = 0.1

    be = engine_backend(args.device)
    if be.name == "cuda":
        be.xp.get_default_memory_pool().free_all_blocks()
    params = [be.asarray(p) for p in host_params]
    eng = time_engine_steps(be, params, batches, lr, warmup)
    eng["memory"] = device_memory(be)
    ctx.put("engine_step", eng)
    ctx.check("engine loss finite", bool(np.isfinite(eng["last_loss_sum"])),
              loss=eng["last_loss_sum"])
    gemms = time_gemms(be, params[2], B)
    share = gemm_share(gemms, eng["step_ms"] / 1e3)
    ctx.put("gemms_ms", {k: 1e3 * v for k, v in gemms.items()})
    ctx.put("gemm_share_of_step", share)
    if be.name == "cuda":
        sm = time_softmax(be, B, shape["n_labels"], seed=args.seed)
        ctx.put("softmax_ms", {k: (1e3 * v if k in ("tiled", "rowblock + column sum") else v)
                               for k, v in sm.items()})
        ctx.check("tiled softmax agrees with the previous kernel",
                  sm["max_abs_diff_dZ"] <= 1e-7 and sm["max_abs_diff_db2"] <= 1e-6,
                  dZ=sm["max_abs_diff_dZ"], db2=sm["max_abs_diff_db2"])
    else:
        ctx.put("softmax_ms", {"skipped": "the kernels' comparison runs on CUDA only"})
    del params
    if be.name == "cuda":
        be.xp.get_default_memory_pool().free_all_blocks()

    def fit(key: str, check: str | None = None, **options) -> dict:
        """A one-epoch ``single`` fit on the section's first ``--fit-steps`` batches, recorded
        under ``key`` (and checked to have trained cleanly when ``check`` names the check)."""
        fit_rows = args.fit_steps * B
        t = time.perf_counter()
        clf = engine_fit(X[:fit_rows], Y[:fit_rows], devices=args.device, algorithm="single",
                         hidden=shape["hidden"], batch_size=B, epochs=1, lr=lr, seed=args.seed,
                         **options)
        rec = _fit_record(clf, time.perf_counter() - t, {})
        if options:
            rec["projected_epoch_s"] = projected_epoch_s(rec.get("samples_per_s") or 0.0)
        ctx.put(key, rec)
        if check is not None:
            ctx.check(check, not history_troubles(clf.history_),
                      events=history_troubles(clf.history_))
        return rec

    if ctx.left() > 20:
        rate = fit("single_fit", "single fit trained cleanly").get("samples_per_s") \
            or eng["samples_per_s"]
    else:
        ctx.put("single_fit", {"skipped": f"{ctx.left():.0f} s left of the section's limit"})
        rate = eng["samples_per_s"]
    if ctx.left() > 30:  # the same fit with plain SGD: the default optimizer's share of a step
        fit("single_fit_sgd", optimizer="sgd")
    if ctx.left() > 25:  # the sampled output layer (negatives: the engine's default count)
        fit("sampled_fit", "sampled fit trained cleanly", output="sampled")
    if ctx.left() > 25:  # where the default fit's wall time goes: every thread's stack per ms
        with StackSampler() as sampler:
            rec = fit("single_fit_profiled")
        ctx.put("single_fit_profile", {"train_time_s": rec.get("train_time_s"),
                                       "wall_s": rec.get("wall_s"), **sampler.report(top=25)})
    epoch = projected_epoch_s(rate)
    ctx.put("projected_epoch_s", epoch)
    if args.scale == 1.0:  # the goal is for the full shape only
        ctx.target(f"projected Amazon-670K epoch <= {TARGET_EPOCH_S:.0f} s",
                   epoch <= TARGET_EPOCH_S, epoch_s=epoch, samples_per_s=rate)

    if ctx.left() > 15:
        try:
            tor = torch_step_rate(args.device, X, Y, host_params, batches, lr, warmup)
        except SectionSkipped as e:
            logger.info("PyTorch comparison skipped: %s", e)
            ctx.put("torch_step", {"skipped": str(e)})
            return
        ctx.put("torch_step", tor)
        ratio = eng["samples_per_s"] / tor["samples_per_s"]
        ctx.put("engine_over_torch", ratio)
        ctx.target("engine step >= PyTorch step", ratio >= 1.0, ratio=ratio)
    else:
        ctx.put("torch_step", {"skipped": f"{ctx.left():.0f} s left of the section's limit"})


SECTIONS = {
    "kernels": Section("kernels", section_kernels, SECTION_LIMITS_S["kernels"]),
    "fit_single": Section("fit_single", section_fit_single, SECTION_LIMITS_S["fit_single"]),
    "throughput": Section("throughput", section_throughput, SECTION_LIMITS_S["throughput"]),
    "sync": Section("sync", section_sync, SECTION_LIMITS_S["sync"]),
    "adaptive": Section("adaptive", section_adaptive, SECTION_LIMITS_S["adaptive"]),
}


# ------------------------------------------------------------------------------- main

def _setup_logging(stream, tag: str = "") -> None:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {tag}%(message)s", "%H:%M:%S"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child is not None:
        _setup_logging(sys.stdout, f"[{args.child}] ")
        return child_main(args)
    args.out.mkdir(parents=True, exist_ok=True)
    tee = Tee(args.out / LOG_NAME)
    _setup_logging(tee)
    report_path = args.out / REPORT_NAME

    def write(report):
        _common.write_result(report_path, report)

    def metadata(gpu):
        extra = {"gpu": gpu, "gpu_libraries": _common.library_versions(GPU_LIBRARIES)}
        return _common.result_metadata(machine_extra=extra, argv=[__file__, *argv])

    try:
        if args.device != "cpu" and not engine_cuda_available():
            reason = ("no CUDA device: bench/gpu_check.py needs a GPU with CuPy "
                      "(xmc_engine.backends.cuda_available() is False)")
            report = new_report(args, metadata(None))
            for rec in report["sections"].values():
                rec.update(status="skipped", reason=reason)
            report.update(status="skipped", reason=reason, finished=True,
                          summary=summarise(report))
            write(report)
            logger.info("SKIPPED: %s; wrote %s", reason, report_path)
            return 0
        report = new_report(args, metadata(gpu_info(args.device)))
        write(report)
        logger.info("gpu_check on %s: sections %s, budget %.0f s -> %s", args.device,
                    ",".join(args.sections), args.budget, report_path)
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            execute = make_child_executor(Path(__file__).resolve(), argv, Path(tmp), tee.write)
            run_sections([SECTIONS[s] for s in args.sections], execute, report, write,
                         budget_s=args.budget)
        summary = report["summary"]
        logger.info("done: %s; wrote %s", json.dumps({k: v for k, v in summary.items() if v}),
                    report_path)
        return 1 if summary["failed"] else 0
    finally:
        logger.handlers.clear()
        logger.propagate = True
        tee.close()


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: a non-daemon thread left by the engine (recorded in the report) must not
    # keep the process, and so the time budget, waiting.
    os._exit(rc)
