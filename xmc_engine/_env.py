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
    """Folder for binary dataset caches (``XMC_CACHE_DIR``); ``None`` means beside the source file."""
    env = os.environ.get("XMC_CACHE_DIR")
    return Path(env).expanduser() if env else None


def download_dir() -> Path:
    """Where ``fetch`` puts downloaded datasets (``XMC_DOWNLOAD_DIR``, default ``~/.cache/xmc-engine``)."""
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
