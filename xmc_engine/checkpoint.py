"""Atomic, checksummed array files: training checkpoints and saved model folders.

File format (``save_arrays``): a plain ``.npz`` (``np.savez``, never pickled) holding the named
arrays plus one entry ``__meta__``, a uint8 array of UTF-8 JSON::

    {"format": "xmc-engine/arrays", "version": 1,
     "sha256": "<hex>",                      # over the user meta and every array, see below
     "arrays": {"W1": {"dtype": "<f4", "shape": [135909, 128]}, ...},
     "meta": {...}}                          # the caller's JSON object

The checksum lives inside the file it protects, so the file is one atomic unit (a sidecar could
be left stale by a crash between two renames). It is the SHA-256 of: the canonical JSON of
``meta``, then for each array in name order its name, dtype string, shape and C-order bytes.
Together with the zip CRC-32 of each member, a truncated or altered file is refused with a
:class:`~xmc_engine.errors.CheckpointError` that names the file and the problem; a file that loads
always holds exactly what was saved. Files are loaded with ``allow_pickle=False`` only: an archive
holding an object array is refused.

Writes go to a temporary file in the destination folder, are flushed and ``fsync``-ed, then
``os.replace``-d over the destination, and the folder is ``fsync``-ed: after a crash the path holds
either the old file or the new one, never a mix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from xmc_engine.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "load_arrays", "load_model_dir", "save_arrays", "save_model_dir"]

FORMAT = "xmc-engine/arrays"
VERSION = 1
META_KEY = "__meta__"
CONFIG_NAME = "config.json"
PARAMS_NAME = "params.npz"
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _digest(meta: dict, arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    h.update(_canonical_json(meta).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{a.dtype.str}\0{list(a.shape)}\0".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


def _atomic_write(path: Path, write) -> None:
    """Call ``write(binary_file)`` on a temp file beside ``path``, fsync, rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def save_arrays(path, arrays: dict[str, np.ndarray], meta: dict | None = None) -> Path:
    """Write named arrays and a JSON ``meta`` object to ``path`` atomically, with a checksum.

    Parameters
    ----------
    path : str or os.PathLike
        Destination file (conventionally ``.npz``; the name is used as given). Its folder is
        created.
    arrays : dict of str to numpy.ndarray
        Host arrays of any non-object dtype and shape. Names: letters, digits, ``_.-``, not
        starting with a digit, not ``__meta__``. CuPy arrays must be copied to the host first.
    meta : dict, optional
        JSON-serialisable object (no NaN/Inf) stored beside the arrays.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    CheckpointError
        A bad array name, an object array, or ``meta`` that is not JSON-serialisable.
    """
    path = Path(path)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: meta must be a dict, got {type(meta).__name__}")
    host = {}
    for name, a in arrays.items():
        if not isinstance(name, str) or not _NAME_RE.match(name) or name == META_KEY:
            raise CheckpointError(f"{path}: invalid array name {name!r}")
        if not isinstance(a, np.ndarray):
            if type(a).__module__.split(".")[0] == "cupy":
                raise CheckpointError(f"{path}: array {name!r} is a CuPy array; copy it to the "
                                      "host first (.get())")
            a = np.asarray(a)
        if a.dtype.hasobject:
            raise CheckpointError(f"{path}: array {name!r} has dtype {a.dtype}, which cannot be "
                                  "stored without pickle")
        host[name] = a
    try:
        digest = _digest(meta, host)
        header = {
            "format": FORMAT, "version": VERSION, "sha256": digest,
            "arrays": {n: {"dtype": a.dtype.str, "shape": list(a.shape)} for n, a in host.items()},
            "meta": meta,
        }
        meta_bytes = json.dumps(header, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: meta is not JSON-serialisable: {exc}") from None
    payload = {**host, META_KEY: np.frombuffer(meta_bytes, dtype=np.uint8)}
    _atomic_write(path, lambda f: np.savez(f, **payload))
    return path


def load_arrays(path) -> tuple[dict[str, np.ndarray], dict]:
    """Read and verify a file written by :func:`save_arrays`.

    Parameters
    ----------
    path : str or os.PathLike
        The file.

    Returns
    -------
    arrays : dict of str to numpy.ndarray
        Host arrays, exactly as saved.
    meta : dict
        The ``meta`` object given to :func:`save_arrays`.

    Raises
    ------
    CheckpointError
        The file is missing, truncated, corrupted, holds pickled data, or was written by an
        unknown format version; the message names the file and the problem.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        z = np.load(path, allow_pickle=False)
        if not hasattr(z, "files"):
            raise CheckpointError(f"{path}: not an .npz archive (a single .npy array?)")
        with z:
            if META_KEY not in z.files:
                raise CheckpointError(f"{path}: no {META_KEY} entry (not written by save_arrays)")
            header = json.loads(z[META_KEY].tobytes().decode("utf-8"))
            arrays = {name: z[name] for name in z.files if name != META_KEY}
    except CheckpointError:
        raise
    except ValueError as exc:
        if "pickle" in str(exc):
            raise CheckpointError(f"{path}: holds pickled data (an object array?); refusing to "
                                  "load it with allow_pickle=True") from None
        raise CheckpointError(f"{path}: unreadable (truncated or corrupted?): {exc}") from None
    except Exception as exc:  # zipfile.BadZipFile (CRC), EOFError, OSError, MemoryError, ...
        raise CheckpointError(f"{path}: unreadable (truncated or corrupted?): "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(f"{path}: {META_KEY} is not an {FORMAT} header")
    if header.get("version") != VERSION:
        raise CheckpointError(f"{path}: format version {header.get('version')!r}, this engine "
                              f"reads version {VERSION}")
    specs, meta = header.get("arrays"), header.get("meta")
    if not isinstance(specs, dict) or not isinstance(meta, dict):
        raise CheckpointError(f"{path}: malformed {META_KEY} header")
    if set(specs) != set(arrays):
        raise CheckpointError(f"{path}: arrays {sorted(arrays)} do not match the header's "
                              f"{sorted(specs)}")
    for name, a in arrays.items():
        if a.dtype.str != specs[name].get("dtype") or list(a.shape) != specs[name].get("shape"):
            raise CheckpointError(f"{path}: array {name!r} is {a.dtype.str}{list(a.shape)}, the "
                                  f"header says {specs[name]}")
    digest = _digest(meta, arrays)
    if digest != header.get("sha256"):
        raise CheckpointError(f"{path}: checksum mismatch (stored {header.get('sha256')}, "
                              f"computed {digest}): the file is corrupted")
    return arrays, meta


class CheckpointManager:
    """Numbered checkpoints ``ckpt-<seq>.npz`` in a run folder, newest ``keep`` kept.

    One manager (one process) per run folder. Stale temporary files of an interrupted save are
    removed when the manager is created.

    Parameters
    ----------
    run_dir : str or os.PathLike
        The run folder (created).
    keep : int
        How many checkpoints to keep (``>= 1``); keep 2 or more so that a corrupted newest file
        can fall back to the previous one.
    """

    _PATTERN = re.compile(r"^ckpt-(\d+)\.npz$")

    def __init__(self, run_dir, keep: int = 2):
        if int(keep) < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.run_dir = Path(run_dir)
        self.keep = int(keep)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for tmp in self.run_dir.glob(".ckpt-*.npz.*.tmp"):
            logger.info("removing %s, left by an interrupted save", tmp)
            tmp.unlink(missing_ok=True)

    def paths(self) -> list[Path]:
        """Checkpoint files, newest (highest ``seq``) first."""
        found = []
        for p in self.run_dir.iterdir():
            m = self._PATTERN.match(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found, reverse=True)]

    def save(self, step_info: dict, arrays: dict[str, np.ndarray]) -> Path:
        """Write the next checkpoint atomically, then delete all but the newest ``keep``.

        Parameters
        ----------
        step_info : dict
            JSON-serialisable progress (epoch, samples, batch sizes, RNG state, ...). Stored as
            the checkpoint's meta with ``"seq"`` (the checkpoint number) added.
        arrays : dict of str to numpy.ndarray
            Host arrays (parameters, momentum buffers, ...).

        Returns
        -------
        pathlib.Path
            The new file.
        """
        existing = self.paths()
        seq = int(self._PATTERN.match(existing[0].name).group(1)) + 1 if existing else 1
        path = self.run_dir / f"ckpt-{seq:08d}.npz"
        save_arrays(path, arrays, {**step_info, "seq": seq})
        for old in self.paths()[self.keep:]:
            logger.debug("pruning %s", old)
            old.unlink(missing_ok=True)
        return path

    def latest_valid(self) -> tuple[dict[str, np.ndarray], dict] | None:
        """The newest checkpoint that loads and verifies, or ``None`` if there is none.

        A newest file that is truncated or corrupted is skipped with a warning naming it and the
        previous one is tried, and so on.

        Returns
        -------
        (arrays, meta) or None
            As :func:`load_arrays`; ``meta`` is the saved ``step_info`` plus ``"seq"`` and
            ``"path"`` (the file it came from).
        """
        for path in self.paths():
            try:
                arrays, meta = load_arrays(path)
            except CheckpointError as exc:
                logger.warning("skipping checkpoint %s: %s", path, exc)
                continue
            return arrays, {**meta, "path": str(path)}
        return None


def _model_dir_replaceable(folder: Path) -> bool:
    return all(p.name in (CONFIG_NAME, PARAMS_NAME) for p in folder.iterdir())


def save_model_dir(folder, config: dict, arrays: dict[str, np.ndarray]) -> Path:
    """Save a model as a folder with ``config.json`` and ``params.npz``, all or nothing.

    Both files are written into a temporary sibling folder ``<folder>.tmp-*`` which is then
    renamed to ``folder``. An existing model folder (holding only those two files) is replaced;
    any other existing path is refused rather than deleted.

    Parameters
    ----------
    folder : str or os.PathLike
        Destination folder.
    config : dict
        JSON-serialisable configuration (no NaN/Inf), written as readable ``config.json``.
    arrays : dict of str to numpy.ndarray
        Host parameter arrays, written with :func:`save_arrays`.

    Returns
    -------
    pathlib.Path
        ``folder``.

    Raises
    ------
    CheckpointError
        ``config`` is not JSON-serialisable, or ``folder`` exists and is not a model folder.
    """
    folder = Path(folder)
    if folder.exists() and not (folder.is_dir() and _model_dir_replaceable(folder)):
        raise CheckpointError(f"refusing to replace {folder}: it exists and is not a model folder "
                              f"(only {CONFIG_NAME} and {PARAMS_NAME} may be in it)")
    try:
        config_text = json.dumps(config, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder}: config is not JSON-serialisable: {exc}") from None
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f"{folder.name}.tmp-"))
    old = None
    try:
        save_arrays(tmp / PARAMS_NAME, arrays, {})
        _atomic_write(tmp / CONFIG_NAME, lambda f: f.write(config_text.encode("utf-8")))
        if folder.exists():
            old = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f"{folder.name}.old-"))
            os.replace(folder, old / folder.name)
        os.replace(tmp, folder)
        _fsync_dir(folder.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not folder.exists() and (old / folder.name).exists():
            os.replace(old / folder.name, folder)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def load_model_dir(folder) -> tuple[dict, dict[str, np.ndarray]]:
    """Load a folder written by :func:`save_model_dir`.

    Parameters
    ----------
    folder : str or os.PathLike
        The model folder.

    Returns
    -------
    config : dict
        The configuration.
    arrays : dict of str to numpy.ndarray
        The verified parameter arrays.

    Raises
    ------
    CheckpointError
        Missing folder, missing or invalid ``config.json``, missing or corrupted ``params.npz``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist"
                              if not folder.exists() else f"{folder} is not a folder")
    config_path, params_path = folder / CONFIG_NAME, folder / PARAMS_NAME
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} is missing: {folder} is not a saved model")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path}: invalid JSON at line {exc.lineno} column "
                              f"{exc.colno}: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path}: unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object, got "
                              f"{type(config).__name__}")
    if not params_path.is_file():
        raise CheckpointError(f"{params_path} is missing: the model's parameters are not there")
    arrays, _ = load_arrays(params_path)
    return config, arrays
