"""Shared helpers for the benchmark scripts: machine record, peak RSS, data paths, JSON results.

Every result JSON carries :func:`result_metadata` (the command, the engine's git commit and the
machine) and is written with :func:`write_result`, which refuses a payload without it, so that a
table in ``bench/RESULTS.md`` can always name how, where and on which code it was measured.

Nothing here imports the engine's heavy parts or any optional library at module import time, so
every ``bench/*.py`` script can import it (``sys.path`` includes ``bench/`` when a script runs).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import json
import math
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

#: Libraries whose versions are recorded when importable (never imported just to record them
#: unless already installed; an import failure is recorded as ``None``).
DEFAULT_LIBRARIES = ("numpy", "scipy", "numba", "threadpoolctl", "psutil", "xmc_engine",
                     "torch", "napkinxc", "libpecos")


class SkipBenchmark(Exception):
    """A benchmark cannot run here (missing data or library); the message says why and how."""


# -- machine --------------------------------------------------------------------------------------

def cpu_model() -> str:
    """CPU model name from ``/proc/cpuinfo`` (Linux), else :func:`platform.processor`."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """Cores this process may run on (affinity mask), falling back to ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def library_versions(names=DEFAULT_LIBRARIES) -> dict[str, str | None]:
    """``{name: version}`` for each importable library, ``None`` for one that is not installed.

    ``libpecos`` is looked up by distribution metadata only (it may live in another venv).
    """
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
            continue
        except metadata.PackageNotFoundError:
            pass
        if name == "libpecos":
            out[name] = None
            continue
        try:
            mod = importlib.import_module(name)
            out[name] = str(getattr(mod, "__version__", "unknown"))
        except Exception:  # noqa: BLE001 - any import failure means "not usable here"
            out[name] = None
    return out


def blas_info() -> list[dict]:
    """The BLAS / OpenMP pools loaded in this process, via threadpoolctl (empty if missing)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    keep = ("user_api", "internal_api", "version", "num_threads", "threading_layer",
            "architecture", "prefix")
    return [{k: d.get(k) for k in keep} for d in threadpool_info()]


def machine_info(libraries=DEFAULT_LIBRARIES, extra: dict | None = None) -> dict:
    """A JSON-able record of the machine and software a result was measured on."""
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "mem_total_gib": _mem_total_gib(),
        "gpu": None,
        "loadavg_1_5_15": loadavg(),
        "libraries": library_versions(libraries),
        "blas": blas_info(),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("XMC_", "OMP_", "MKL_", "OPENBLAS_", "NUMBA_NUM_THREADS"))},
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if extra:
        info.update(extra)
    return info


def loadavg() -> list[float] | None:
    """1/5/15-minute load averages: a shared machine's contention, recorded with each result."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 2)
    except (OSError, ValueError, IndexError):
        pass
    return None


def mean_se(xs: list[float]) -> tuple[float, float]:
    """The mean of ``xs`` and its standard error (``nan`` for one value): a paired
    benchmark's mean difference over seeds."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def peak_rss_mib(children: bool = False) -> float:
    """Peak resident set size of this process (or of its waited-for children) in MiB.

    ``ru_maxrss`` is in KiB on Linux and in bytes on macOS.
    """
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    rss = resource.getrusage(who).ru_maxrss
    scale = 1.0 / 2**20 if sys.platform == "darwin" else 1.0 / 1024
    return round(rss * scale, 1)


# -- data -----------------------------------------------------------------------------------------

def data_dir() -> Path:
    """The folder of real datasets: ``$XMC_DATA_DIR``, else ``../shared/data`` next to the repo."""
    env = os.environ.get("XMC_DATA_DIR")
    if env:
        return Path(env).expanduser()
    for cand in (REPO_DIR.parent / "shared" / "data", REPO_DIR / "shared" / "data"):
        if cand.is_dir():
            return cand
    return REPO_DIR.parent / "shared" / "data"


def dataset_paths(name: str) -> tuple[Path, Path]:
    """``(train, test)`` XC files of dataset ``name``; raises :class:`SkipBenchmark` if absent."""
    root = data_dir()
    folder = root / name
    for suffix in (".txt.xz", ".txt", ".txt.gz", ".txt.bz2"):
        train, test = folder / f"train{suffix}", folder / f"test{suffix}"
        if train.is_file() and test.is_file():
            return train, test
    raise SkipBenchmark(
        f"dataset {name!r} not found: expected {folder}/train.txt.xz and test.txt.xz "
        f"(data dir {root}; set XMC_DATA_DIR to the folder that holds the datasets)")


def load_dataset(name: str):
    """``(X_train, Y_train, X_test, Y_test)`` as CSR float32, read with the engine's loader.

    Reads text (or the loader's ``.npz`` cache, loaded with ``allow_pickle=False``); never pickle.
    """
    train, test = dataset_paths(name)
    from xmc_engine.datasets import load_xc

    X_train, Y_train = load_xc(train)
    X_test, Y_test = load_xc(test)
    return X_train, Y_train, X_test, Y_test


# -- timing ---------------------------------------------------------------------------------------

def event_seconds(history, event: str) -> float:
    """The ``seconds`` of a run's ``event`` records summed (``compile``, ``loss_probe``: the
    time an engine run spends outside ``train_time``); 0 where it wrote none."""
    return sum(r.get("seconds", 0.0) for r in history if r.get("event") == event)


def final_record(history) -> dict:
    """The run's last ``final`` record: with ``ensemble`` > 1 the combination's (its members'
    come before it), whose ``train_time`` is theirs summed."""
    return next(r for r in reversed(history) if r.get("event") == "final")


def probe_seconds(history) -> float:
    """The seconds of a run's loss probe (``loss="auto"``) outside its ``train_time``: the
    ``loss_probe`` record's ``seconds`` less the ``train_time`` of the fit the run went on
    from (``continued``), which the run's ``train_time`` already counts; 0 without a probe."""
    total = 0.0
    for r in history:
        if r.get("event") == "loss_probe":
            total += r.get("seconds", 0.0) - ((r.get("continued") or {}).get("train_time", 0.0))
    return total


def add_device_args(p) -> None:
    """``--devices`` and ``--algorithm`` of a benchmark whose every run shares them
    (:func:`device_params` reads them back)."""
    p.add_argument("--devices", default=None,
                   help="device spec of every run (default: the engine's, one CPU device)")
    p.add_argument("--algorithm", default=None,
                   help="algorithm of every run (default: the engine's; adaptive on several "
                        "devices)")


def device_params(args) -> dict:
    """``XMCClassifier`` keywords of :func:`add_device_args`' options: those given, and
    ``algorithm="adaptive"`` where several devices are given without one."""
    params = {k: v for k, v in (("devices", args.devices), ("algorithm", args.algorithm))
              if v is not None}
    if args.devices and "," in args.devices and "algorithm" not in params:
        params["algorithm"] = "adaptive"
    return params


def warm_engine(X, Y, rows: int = 3000, **params) -> None:
    """One throwaway epoch of ``XMCClassifier(**params)`` (``loss="softmax"`` unless given) on
    the first ``rows`` rows of ``X``, ``Y``: Numba's cache and the engine's first-call costs
    are paid before the timed runs."""
    from xmc_engine import XMCClassifier

    params = {"epochs": 1, "seed": 0, "eval_every": 0, "loss": "softmax", **params}
    warm = min(rows, X.shape[0])
    XMCClassifier(**params).fit(X[:warm], Y[:warm])


def timings(fn, repeat: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``fn()``, after ``warmup`` untimed calls."""
    import time

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


# -- results --------------------------------------------------------------------------------------

def _jsonable(obj):
    """Convert NumPy scalars/arrays and non-finite floats (to ``None``) for strict JSON."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):
        return _jsonable(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(path, payload: dict) -> Path:
    """Write ``payload`` as indented JSON to ``path`` atomically (temp file + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_jsonable(payload), indent=2, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


#: Keys every result JSON carries (:func:`result_metadata`, checked by :func:`write_result`).
RESULT_KEYS = ("command", "git_commit", "machine")


def command_line(argv: list[str] | None = None) -> str:
    """The shell command that ran this script: ``python``, the script, its arguments, quoted.

    Parameters
    ----------
    argv : list of str, optional
        The script's argument vector; ``sys.argv`` by default. A script path inside the
        repository is written relative to its root, so the command can be pasted there.
    """
    argv = list(sys.argv if argv is None else argv)
    if argv:
        script = Path(argv[0])
        with contextlib.suppress(ValueError, OSError):
            script = script.resolve().relative_to(REPO_DIR)
        argv[0] = str(script)
    return shlex.join(["python", *argv])


def git_commit(repo=REPO_DIR) -> str | None:
    """``git rev-parse HEAD`` of ``repo``, with ``-dirty`` appended when its code has changes.

    Only tracked files count, and not those under ``bench/results/`` (results written by an
    earlier run do not change the code being measured). ``None`` when ``repo`` is not the root
    of a git work tree (a copied checkout, or one nested inside another project's repository)
    or git is not installed.
    """
    repo = Path(repo).resolve()

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                                  text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != repo:
        return None
    head = git("rev-parse", "HEAD")
    if head is None:
        return None
    changes = git("status", "--porcelain", "--untracked-files=no", "--",
                  ".", ":(exclude)bench/results")
    return head + "-dirty" if changes else head


#: The engine's packages whose code a benchmark measures: ``git_commit`` names it only where
#: they come from this checkout (:func:`engine_outside`).
ENGINE_PACKAGES = ("xmc_engine", "xmc_engine.kernels", "xmc_engine.datasets")


def engine_outside(repo=REPO_DIR, packages=ENGINE_PACKAGES) -> dict[str, str]:
    """The packages of ``packages`` whose code is not in ``repo``: name -> folder (or file).

    With the engine installed in editable mode from one checkout, ``PYTHONPATH=<another
    checkout>`` takes ``xmc_engine`` from the other checkout but ``xmc_engine.kernels`` and
    ``xmc_engine.datasets`` still from the installed one (the editable install maps them by
    path, since they live at the top of the repository), so a benchmark run there would record
    one commit and measure another's kernels. Linking ``xmc_engine/kernels`` to ``../kernels``
    and ``xmc_engine/datasets`` to ``../datasets`` in the other checkout avoids it. Packages
    that are not installed are left out.
    """
    import importlib.util

    repo = Path(repo).resolve()
    out = {}
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        where = next(iter(spec.submodule_search_locations or []), spec.origin)
        if where is None:
            continue
        path = Path(where).resolve()
        if path != repo and repo not in path.parents:
            out[name] = str(path)
    return out


def result_metadata(machine_extra: dict | None = None, argv: list[str] | None = None) -> dict:
    """The record every result JSON opens with: ``command``, ``git_commit`` and ``machine``.

    Call it once when the benchmark starts (the load average and the commit are those the
    measurement ran under) and spread it into the payload: ``{**result_metadata(), ...}``.

    Parameters
    ----------
    machine_extra : dict, optional
        Extra entries of the machine record (thread counts, load at start).
    argv : list of str, optional
        The script's argument vector (:func:`command_line`); ``sys.argv`` by default.
    """
    meta = {"command": command_line(argv), "git_commit": git_commit(),
            "machine": machine_info(extra=machine_extra)}
    outside = engine_outside()
    if outside:  # the commit does not name all the code measured: say so, and record it
        print(f"warning: {', '.join(f'{k} from {v}' for k, v in outside.items())}: not from "
              f"this checkout ({REPO_DIR}), so git_commit {meta['git_commit']} does not name "
              "the code measured", file=sys.stderr)
        meta["engine_outside_checkout"] = outside
    return meta


def write_result(path, payload: dict) -> Path:
    """Write a benchmark result with :func:`write_json` after checking it has its metadata.

    Raises
    ------
    ValueError
        If ``payload`` lacks one of :data:`RESULT_KEYS`; build it with :func:`result_metadata`.
    """
    missing = [k for k in RESULT_KEYS if k not in payload]
    if missing:
        raise ValueError(f"result for {path} lacks {missing}: start the payload with "
                         "{**_common.result_metadata(), ...}")
    return write_json(path, payload)


def add_from_results_arg(p) -> None:
    """``--from-results FILE``: a benchmark prints the summary of a results file it wrote
    instead of training (:func:`print_saved`)."""
    p.add_argument("--from-results", default=None,
                   help="print the summary of a results file instead of training")


def add_study_args(p, out_name: str) -> None:
    """The arguments every seeded study of the engine's defaults shares: ``--devices`` /
    ``--algorithm`` (:func:`add_device_args`), ``--from-results`` and ``--out`` (default
    ``bench/results/<out_name>``)."""
    add_device_args(p)
    add_from_results_arg(p)
    p.add_argument("--out", default=str(RESULTS_DIR / out_name))


def print_saved(path, show) -> bool:
    """Where ``path`` (``--from-results``) is given: ``show(results)`` with the JSON object it
    holds, and True (the benchmark stops there); else False."""
    if not path:
        return False
    with open(path, encoding="utf-8") as f:
        show(json.load(f))
    return True


def read_json(path) -> dict | None:
    """The JSON object at ``path``, or ``None`` if the file is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def compare_files(specs: list[str]) -> dict[str, list[dict]]:
    """The result files of each ``--compare`` argument ``LABEL=GLOB``, read: ``{label: [the
    JSON payload of every file the glob matches, in name order]}``. Exits with a message where
    a label is missing or its glob matches nothing."""
    import glob

    out = {}
    for spec in specs:
        label, _, pattern = spec.partition("=")
        files = sorted(glob.glob(pattern))
        if not label or not files:
            raise SystemExit(f"--compare {spec!r}: expected LABEL=GLOB matching result files")
        out[label] = [json.loads(Path(f).read_text()) for f in files]
    return out
