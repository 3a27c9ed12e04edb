"""The one place where ``XMC_*`` environment variables are read."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_ROOT = Path(__file__).resolve().parent


def data_dir() -> Path | None:
    """Folder of the local dataset collection.

    ``XMC_DATA_DIR`` if set; else ``../shared/data`` next to the source checkout (or next to the
    current directory) where it exists; else ``None``.
    """
    env = os.environ.get("XMC_DATA_DIR")
    if env:
        return Path(env).expanduser()
    for base in (_PACKAGE_ROOT.parent, Path.cwd()):
        cand = (base / ".." / "shared" / "data").resolve()
        if cand.is_dir():
            return cand
    return None


def cache_dir() -> Path | None:
    """Folder for binary dataset caches (``XMC_CACHE_DIR``); ``None``: beside the source file."""
    env = os.environ.get("XMC_CACHE_DIR")
    return Path(env).expanduser() if env else None


def download_dir() -> Path:
    """Where ``fetch`` puts downloads (``XMC_DOWNLOAD_DIR``, default ``~/.cache/xmc-engine``)."""
    env = os.environ.get("XMC_DOWNLOAD_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "xmc-engine"


def cudasim() -> bool:
    """True when numba's CUDA simulator is on (``NUMBA_ENABLE_CUDASIM=1``)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def progress_enabled() -> bool | None:
    """``XMC_PROGRESS=0/1`` forces progress bars off/on; ``None`` means: on only on a terminal."""
    env = os.environ.get("XMC_PROGRESS")
    if env is None or env == "":
        return None
    return env not in ("0", "false", "no")


def fault_spec() -> str | None:
    """Fault-injection spec for reliability tests (``XMC_FAULT``, grammar in
    :mod:`xmc_engine.faults`), e.g. ``device:1:step:40``; ``None`` when unset."""
    return os.environ.get("XMC_FAULT") or None


def memory_budget() -> str | None:
    """Bytes the memory planner may assume per device (``XMC_MEMORY_BUDGET``, e.g. ``8GiB``),
    overriding what the machine reports; ``None`` when unset."""
    return os.environ.get("XMC_MEMORY_BUDGET") or None


def mpi_launch() -> tuple[int, int] | None:
    """``(rank, size)`` when this process was started by an MPI launcher, else ``None``.

    Reads what the launchers set: ``PMI_RANK``/``PMI_SIZE`` (MPICH, Intel MPI: hydra),
    ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` (Open MPI), ``MV2_COMM_WORLD_RANK``/
    ``MV2_COMM_WORLD_SIZE`` (MVAPICH2).
    """
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE")):
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None and rank.isdigit() and size.isdigit():
            return int(rank), int(size)
    return None


def comm_timeout() -> float | None:
    """Seconds a node waits in a cross-node collective before stopping the run
    (``XMC_COMM_TIMEOUT``); ``None`` when unset."""
    env = os.environ.get("XMC_COMM_TIMEOUT")
    return float(env) if env else None


def mpi_fault_spec() -> str | None:
    """Node-level fault injection for the multi-node tests (``XMC_MPI_FAULT``, grammar in
    :mod:`xmc_engine.distributed`), e.g. ``1:3:raise``; ``None`` when unset."""
    return os.environ.get("XMC_MPI_FAULT") or None


#: OpenBLAS's ``OPENBLAS_THREAD_TIMEOUT`` that the engine sets unless the user set it: idle
#: workers wait 2^4 cycles (the least OpenBLAS takes) before they sleep, instead of 2^28.
BLAS_THREAD_TIMEOUT = "4"


def apply_blas_defaults() -> bool:
    """Set ``OPENBLAS_THREAD_TIMEOUT=4`` unless the user set it; True when it acts.

    OpenBLAS workers spin for about 2^28 cycles after every call before they sleep. Between the
    GEMMs of a training step numba's kernels then find the cores busy: measured on a 2-core
    machine, a delicious-sized step took 47-97 ms with 2 threads instead of 2.6 ms with this
    setting (``bench/bench_step.py``). OpenBLAS reads the variable when it is loaded. Where
    NumPy (or SciPy) loaded an OpenBLAS before ``import xmc_engine`` (a script that imports
    NumPy first), each such copy is told to read it again and its worker pool is stopped, so
    that the pool it starts at its next threaded call waits the new time
    (:func:`reset_loaded_openblas`; ``bench/bench_blas_timeout.py`` measures both).
    False where the user set the variable, or where a loaded copy could not be reset.
    """
    if "OPENBLAS_THREAD_TIMEOUT" in os.environ:
        return False
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = BLAS_THREAD_TIMEOUT
    return all(reset_loaded_openblas())


def loaded_openblas() -> list[str]:
    """Paths of the OpenBLAS libraries this process has loaded (NumPy and SciPy each bring
    their own copy); read from ``/proc/self/maps``, so empty where there is no such file."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths = []
    for line in lines:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        # NumPy's wheel: numpy.libs/libscipy_openblas64_-<hash>.so; a system OpenBLAS may be
        # .../openblas-pthread/libblas.so.3
        if "openblas" in path.lower() and ".so" in os.path.basename(path) and path not in paths:
            paths.append(path)
    return paths


def openblas_timeouts() -> list[int]:
    """``OPENBLAS_THREAD_TIMEOUT`` as each loaded OpenBLAS copy last read it (0: unset, i.e.
    OpenBLAS's own 2^28 cycles); libraries on an OpenBLAS path without the exported
    ``openblas_thread_timeout`` are left out, as :func:`reset_loaded_openblas` skips them."""
    import ctypes

    out = []
    for path in loaded_openblas():
        try:
            out.append(int(ctypes.CDLL(path).openblas_thread_timeout()))
        except (OSError, AttributeError):
            continue
    return out


def reset_loaded_openblas() -> list[bool]:
    """Make every loaded OpenBLAS read its environment again and stop its worker pool; one
    True per copy whose pool now follows ``OPENBLAS_THREAD_TIMEOUT``, False per copy that
    could not be opened or refused (a library on an OpenBLAS path without the exported
    ``openblas_read_env`` / ``blas_thread_shutdown_``, e.g. a LAPACK beside it, is skipped).

    ``blas_thread_shutdown_`` is what OpenBLAS itself runs before a ``fork``; the next threaded
    call starts a new pool, which takes the timeout from the environment just read. Call it
    while no other thread is inside a BLAS call (``import xmc_engine`` does, once)."""
    import ctypes

    done = []
    for path in loaded_openblas():
        try:
            lib = ctypes.CDLL(path)  # the copy already loaded: no second load
        except OSError:
            done.append(False)
            continue
        try:
            read_env, shutdown = lib.openblas_read_env, lib.blas_thread_shutdown_
        except AttributeError:
            continue
        read_env.restype, shutdown.restype = None, ctypes.c_int
        read_env()
        done.append(shutdown() == 0)
    return done
