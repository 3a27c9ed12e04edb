"""Arrays on disk: the atomic file write and the ``(X, Y)`` npz layout shared by
:func:`~xmc_engine.datasets.save_npz` / :func:`~xmc_engine.datasets.load_npz` and the parse
cache (:mod:`xmc_engine.datasets.cache`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmc_engine.errors import DatasetFormatError

__all__ = ["NPZ_FORMAT", "atomic_write", "xy_arrays", "xy_from_npz"]

#: The ``format`` entry of an ``(X, Y)`` npz written by this package.
NPZ_FORMAT = "xmc-engine/xy-csr/1"


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename the temporary file onto ``path`` (same folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def xy_arrays(X, Y, **extra) -> dict:
    """The arrays that :func:`~xmc_engine.datasets.save_npz` stores, plus ``extra``."""
    return dict(format=np.array(NPZ_FORMAT), X_indptr=X.indptr, X_indices=X.indices,
                X_data=X.data, X_shape=np.array(X.shape, dtype=np.int64),
                Y_indptr=Y.indptr, Y_indices=Y.indices, Y_shape=np.array(Y.shape, dtype=np.int64),
                **extra)


def xy_from_npz(z, name: str):
    """Rebuild ``(X, Y)`` from an opened npz written by :func:`~xmc_engine.datasets.save_npz`
    (or the cache); ``DatasetFormatError`` naming ``name`` if malformed."""
    try:
        if str(z["format"]) != NPZ_FORMAT:
            raise DatasetFormatError(f"{name}: unknown npz format {str(z['format'])!r}")
        xs, ys = (tuple(int(v) for v in z[k]) for k in ("X_shape", "Y_shape"))
        y_indices = z["Y_indices"]
        X = sp.csr_matrix((z["X_data"], z["X_indices"], z["X_indptr"]), shape=xs)
        Y = sp.csr_matrix((np.ones(len(y_indices), dtype=np.float32), y_indices, z["Y_indptr"]),
                          shape=ys)
    except DatasetFormatError:
        raise
    except (KeyError, ValueError, TypeError, OSError, EOFError) as exc:
        raise DatasetFormatError(f"{name}: not a valid xmc-engine npz ({exc})") from exc
    if X.dtype != np.float32 or X.shape[0] != Y.shape[0]:
        raise DatasetFormatError(f"{name}: inconsistent arrays (dtype {X.dtype}, "
                                 f"{X.shape[0]} vs {Y.shape[0]} rows)")
    X.has_canonical_format = True
    Y.has_canonical_format = True
    return X, Y
