"""Validation of the arrays and options given to the public API (estimator and CLI).

Every check names the offending argument (``X``, ``Y``, ``X_test`` ...) and value in a
``ValueError``, and returns the one form the engine computes on: canonical SciPy CSR on the host
(sorted, unique indices, no explicit zeros), ``float32`` data. The caller's matrix is never
modified; a copy is made only when something has to change.

Accepted and normalised
-----------------------
``X`` (features)
    Any SciPy sparse matrix or array (any format, 32- or 64-bit indices), a CuPy CSR matrix
    (copied to the host), or a dense 2-D array-like of real numbers or booleans (a NumPy array,
    an object array of numbers, a list of lists), converted to CSR. Integer, boolean and
    ``float64`` values become ``float32``; duplicate entries of a row are summed (SciPy's
    convention); explicit zeros are dropped; indices are sorted.
    Refused: ``None``, 1-D or 3-D input, ragged lists, complex or string values, NaN or
    infinity (also values beyond the ``float32`` range), a malformed CSR structure (indices out
    of range, decreasing ``indptr``), no rows (when training) or no columns.
``Y`` (labels)
    The same containers, holding a 0/1 indicator matrix of shape ``(n_samples, n_labels)``;
    booleans count as 0/1. A label stored twice in a row is one label. Rows without a label are
    allowed (they add nothing to the loss). Refused: any value other than 0 and 1, 1-D class
    vectors (encode them with ``sklearn.preprocessing.MultiLabelBinarizer`` first), a row count
    other than ``X``'s, no columns.
"""

from __future__ import annotations

import numbers

import numpy as np
import scipy.sparse as sp

from xmc_engine.errors import ConfigError

__all__ = ["check_X", "check_Y", "check_k", "normalize_rows", "parse_every"]


def _as_csr(M, name: str, what: str, hint_1d: str = "") -> sp.csr_matrix:
    """``M`` as a SciPy ``csr_matrix`` of a real dtype, sharing memory where possible."""
    if type(M).__module__.startswith("cupyx") and hasattr(M, "get"):
        M = M.get()
    if sp.issparse(M):
        if M.ndim != 2:
            raise ValueError(f"{name} must be 2-D, got shape {M.shape}")
        M = sp.csr_matrix(M)
        try:
            M.check_format(full_check=True)
        except ValueError as exc:
            raise ValueError(f"{name} is not a valid CSR matrix: {exc}") from None
    else:
        try:
            dense = np.asarray(M)
        except (TypeError, ValueError) as exc:  # ragged lists
            raise ValueError(f"{name} cannot be read as a 2-D {what} matrix: {exc}") from None
        if dense.ndim != 2:
            raise ValueError(f"{name} must be 2-D (n_samples, n_{what}s), got shape "
                             f"{dense.shape}{hint_1d if dense.ndim == 1 else ''}")
        if dense.dtype == object:  # numbers boxed as Python objects
            try:
                dense = dense.astype(np.float64)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{name} holds a value that is not a number: {exc}") from None
        _check_dtype(dense.dtype, name)
        M = sp.csr_matrix(dense)
    _check_dtype(M.dtype, name)
    return M


def _check_dtype(dtype, name: str) -> None:
    """``ValueError`` naming ``name`` unless ``dtype`` is a real number or boolean type."""
    if np.issubdtype(dtype, np.complexfloating):
        raise ValueError(f"Complex data not supported: {name} has dtype {dtype}")
    if not (dtype == np.bool_ or np.issubdtype(dtype, np.number)):
        raise ValueError(f"{name} must hold real numbers, got dtype {dtype}")


def _check_columns(M: sp.csr_matrix, name: str, expected: int | None, what: str) -> None:
    """``M`` has ``expected`` columns (the fitted model's) or, with ``expected=None``, one or
    more; ``ValueError`` naming ``name`` otherwise."""
    n = M.shape[1]
    if expected is not None and n != expected:
        raise ValueError(f"{name} has {n} {what}s, but XMCClassifier is expecting {expected} "
                         f"{what}s as input")
    if expected is None and n < 1:
        raise ValueError(f"{name} has 0 {what}(s) (shape={M.shape}) while a minimum of 1 is "
                         "required.")


def _row_of(M: sp.csr_matrix, position: int) -> int:
    """Row of the ``position``-th stored entry of CSR ``M``."""
    return int(np.searchsorted(M.indptr, position, side="right") - 1)


def check_X(X, n_features: int | None = None, name: str = "X", *,
            min_samples: int = 0) -> sp.csr_matrix:
    """Validate a feature matrix and return it as canonical ``float32`` CSR.

    Parameters
    ----------
    X : sparse matrix or array, or dense 2-D array-like, shape (n_samples, n_features)
        See the module docstring for what is accepted.
    n_features : int, optional
        The feature count ``X`` must have (the fitted model's).
    name : str
        The argument's name in messages.
    min_samples : int
        Fewest rows accepted (1 for training, 0 for prediction).

    Returns
    -------
    scipy.sparse.csr_matrix, float32, host, canonical format, no explicit zeros

    Raises
    ------
    ValueError
        Naming ``name`` and the offending shape, dtype, row or value.
    """
    if X is None:
        raise ValueError(f"{name} is None; expected a 2-D feature matrix")
    X = _as_csr(X, name, "feature", hint_1d="; Reshape your data with X.reshape(1, -1) for a "
                "single sample")
    if X.shape[0] < min_samples:
        raise ValueError(f"{name} has {X.shape[0]} sample(s) (shape={X.shape}) while a minimum "
                         f"of {min_samples} is required.")
    _check_columns(X, name, n_features, "feature")
    with np.errstate(over="ignore"):  # beyond float32's range shows as inf below
        X = X.astype(np.float32, copy=False)
    if not X.has_canonical_format or (X.nnz and not X.data.all()):
        X = X.copy()  # indices may still be shared with the caller's matrix
        X.sum_duplicates()
        X.eliminate_zeros()
    if X.nnz and not np.isfinite(X.data).all():
        bad = int(np.flatnonzero(~np.isfinite(X.data))[0])
        raise ValueError(f"{name} row {_row_of(X, bad)}: non-finite value {X.data[bad]} "
                         "(NaN, infinity, or beyond the float32 range)")
    return X


def normalize_rows(X: sp.csr_matrix, how: str) -> sp.csr_matrix:
    """The feature rows the model computes on (``TrainConfig.normalize``): ``"l2"`` scales
    each row of a validated ``X`` (:func:`check_X`) to unit Euclidean norm (rows without
    features stay empty), ``"none"`` leaves it as it is. ``X`` itself is never modified; it is
    returned as is when nothing changes (``"none"``, or every row's norm already 1 within
    1e-4, as for tf-idf data), else a new matrix sharing ``X``'s index arrays."""
    if how == "none" or X.nnz == 0:
        return X
    if how != "l2":
        raise ValueError(f"normalize={how!r}: choose l2 or none")
    counts = np.diff(X.indptr)
    rows = np.repeat(np.arange(X.shape[0]), counts)
    norms = np.sqrt(np.bincount(rows, weights=np.square(X.data, dtype=np.float64),
                                minlength=X.shape[0]))
    nonempty = norms > 0
    if np.all(np.abs(norms[nonempty] - 1.0) <= 1e-4):
        return X
    scale = np.ones_like(norms)
    scale[nonempty] = 1.0 / norms[nonempty]
    data = (X.data * scale[rows]).astype(np.float32)
    return sp.csr_matrix((data, X.indices, X.indptr), shape=X.shape)


def check_Y(Y, n_samples: int, n_labels: int | None = None, name: str = "Y", *,
            x_name: str = "X") -> sp.csr_matrix:
    """Validate a 0/1 label indicator matrix and return it as canonical ``float32`` CSR.

    Parameters
    ----------
    Y : sparse matrix or array, or dense 2-D array-like, shape (n_samples, n_labels)
        See the module docstring for what is accepted.
    n_samples : int
        Rows of the matching feature matrix.
    n_labels : int, optional
        The label count ``Y`` must have (the fitted model's).
    name, x_name : str
        Names of this argument and of the feature matrix in messages.

    Returns
    -------
    scipy.sparse.csr_matrix, float32 ones, host, canonical format

    Raises
    ------
    ValueError
        Naming ``name`` and the offending shape, row or value.
    """
    if Y is None:
        raise ValueError(f"training requires y to be passed, but the target y is None ({name}: "
                         "a 2-D 0/1 label indicator matrix)")
    Y = _as_csr(Y, name, "label", hint_1d=" (class values or a continuous target?); a 0/1 "
                "indicator matrix is needed: encode class labels with "
                "sklearn.preprocessing.MultiLabelBinarizer (or LabelBinarizer)")
    if Y.shape[0] != n_samples:
        raise ValueError(f"{name} has {Y.shape[0]} rows but {x_name} has {n_samples}")
    _check_columns(Y, name, n_labels, "label")
    bad = np.flatnonzero((Y.data != 0) & (Y.data != 1))
    if bad.size:
        value = Y.data[bad[0]]
        raise ValueError(f"{name} row {_row_of(Y, int(bad[0]))}: value {value} is not 0 or 1; "
                         f"{name} must be a 0/1 label indicator matrix, not class values or a "
                         "continuous target")
    Y = Y.astype(np.float32)  # a copy: the caller's matrix stays as it was
    Y.sum_duplicates()
    Y.eliminate_zeros()
    Y.data[:] = 1.0  # a label stored twice in a row is one label
    return Y


def check_k(k, name: str = "k") -> int:
    """``k`` as a positive ``int``; ``ValueError`` naming ``name`` otherwise (bools refused)."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {k!r}")
    return int(k)


def parse_every(spec) -> tuple[str, float] | None:
    """Parse a checkpoint cadence.

    ``"20000"`` / ``20000`` -> every 20,000 samples; ``"60s"`` -> every 60 seconds;
    ``None``, ``""`` or ``0`` -> no periodic checkpoints.

    Returns
    -------
    tuple of (unit, value) or None
        ``unit`` is ``"samples"`` or ``"seconds"``.
    """
    if spec is None or spec == "" or spec == 0:
        return None
    s = str(spec).strip().lower()
    try:
        if s.endswith("s"):
            value, unit = float(s[:-1]), "seconds"
        else:
            value, unit = float(s), "samples"
    except ValueError:
        raise ConfigError(f"checkpoint_every={spec!r}: expected a sample count like 20000 "
                          "or seconds like 60s") from None
    if not value > 0:
        raise ConfigError(f"checkpoint_every={spec!r}: must be > 0")
    return unit, value
