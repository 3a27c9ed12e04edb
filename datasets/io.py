"""Readers and writers of the XC-repository, LIBSVM multi-label, split-file and ``.npz`` formats.

Every reader returns canonical ``scipy.sparse.csr_matrix`` pairs on the host: ``X`` of shape
``(n_samples, n_features)`` float32 and ``Y`` of shape ``(n_samples, n_labels)`` float32 holding
ones; indices sorted within each row, no duplicates, int32 indices. Malformed input raises
:class:`~xmc_engine.errors.DatasetFormatError` naming the file, the line and the offending token;
it never yields a wrong matrix.

Decisions on the edges of the format:

- A row with no labels starts with a blank; a row with no features is only its labels; an empty
  line is a row with neither (the header counts it).
- Feature indices need not increase within a row (they are sorted); a repeated feature index in a
  row is an error, and so is a repeated label (it would silently change the per-row label weight
  ``1/|y_i|`` of the loss).
- Values must be finite decimals (``nan``/``inf`` and values beyond float32 range are errors);
  explicit zero values are kept as stored. Lines may end in ``\\r\\n``; tokens may be separated by
  any run of spaces and tabs.
"""

from __future__ import annotations

import bz2
import gzip
import logging
import lzma
import zlib
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmc_engine.errors import DatasetFormatError

from . import _parse
from .npz import atomic_write, xy_arrays, xy_from_npz

logger = logging.getLogger(__name__)

#: file suffix -> opener of a compressed file (text mode with ``"rt"``)
OPENERS = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}
_INDEX_MAX = 2**31 - 1


# ----------------------------------------------------------------------------------------- bytes
def compression_of(path) -> str | None:
    """``"xz"``, ``"gz"``, ``"bz2"`` from the file suffix, or ``None`` for plain text."""
    suffix = Path(path).suffix.lower()
    return suffix[1:] if suffix in OPENERS else None


def read_bytes(path) -> bytes:
    """The whole file, decompressed according to its suffix (``.xz``, ``.gz``, ``.bz2``).

    Raises
    ------
    DatasetFormatError
        When the compressed stream is corrupt or truncated.
    FileNotFoundError
        When the file does not exist.
    """
    path = Path(path)
    opener = OPENERS.get(path.suffix.lower())
    if opener is None:
        return path.read_bytes()
    try:
        with opener(path, "rb") as fh:
            return fh.read()
    except (lzma.LZMAError, EOFError, zlib.error, gzip.BadGzipFile, OSError, ValueError) as exc:
        if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError):
            raise
        raise DatasetFormatError(
            f"{path.name}: corrupt or truncated {path.suffix[1:]} stream ({exc})") from exc


def read_head(path, n_bytes: int = 4096) -> bytes:
    """The first ``n_bytes`` of the decompressed file (for sniffing the format)."""
    path = Path(path)
    opener = OPENERS.get(path.suffix.lower(), open)
    try:
        with opener(path, "rb") as fh:
            return fh.read(n_bytes)
    except (lzma.LZMAError, EOFError, zlib.error, gzip.BadGzipFile, ValueError) as exc:
        raise DatasetFormatError(
            f"{path.name}: corrupt or truncated {path.suffix[1:]} stream ({exc})") from exc


def _first_line(buf: bytes) -> tuple[bytes, int]:
    end = buf.find(b"\n")
    if end < 0:
        return buf, len(buf)
    return buf[:end], end + 1


def parse_header(buf: bytes, name: str) -> tuple[int, int, int, int]:
    """``(n_samples, n_features, n_labels, offset_of_first_row)`` from an XC header line."""
    if not buf:
        raise DatasetFormatError(f"{name} line 1: missing header (file is empty); expected "
                                 "'n_samples n_features n_labels'")
    line, offset = _first_line(buf)
    text = line.decode("utf-8", errors="replace")
    parts = text.split()
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts):
        raise DatasetFormatError(f"{name} line 1: bad header {text[:80]!r}; expected three "
                                 "non-negative integers 'n_samples n_features n_labels'")
    n_samples, n_features, n_labels = (int(p) for p in parts)
    if n_features > _INDEX_MAX or n_labels > _INDEX_MAX:
        raise DatasetFormatError(f"{name} line 1: header {text!r}: n_features and n_labels must "
                                 f"be < 2**31")
    return n_samples, n_features, n_labels, offset


def looks_like_xc(buf: bytes) -> bool:
    """True when the first line is an XC header (three integers), else LIBSVM is assumed."""
    line, _ = _first_line(buf[:4096])
    parts = line.split()
    return len(parts) == 3 and all(p.isdigit() for p in parts)


# ---------------------------------------------------------------------------------------- parse
_MESSAGES = {
    _parse.ERR_LABEL_TOKEN: "bad label index {tok!r} (expected a non-negative integer)",
    _parse.ERR_LABEL_EMPTY: "empty label in label list {field!r}",
    _parse.ERR_LABEL_RANGE: "label index {value} >= n_labels {n_labels}",
    _parse.ERR_LABEL_NEGATIVE: "negative label index {tok!r}",
    _parse.ERR_FEATURE_TOKEN: "bad feature index {tok!r} (expected a non-negative integer)",
    _parse.ERR_FEATURE_NEGATIVE: "negative feature index {tok!r}",
    _parse.ERR_FEATURE_RANGE: "feature index {value} >= n_features {n_features}",
    _parse.ERR_MISSING_COLON: "feature token {tok!r} is not 'index:value'",
    _parse.ERR_VALUE_TOKEN: "non-numeric value in {tok!r}",
    _parse.ERR_VALUE_NONFINITE: "non-finite value in {tok!r} (float32)",
    _parse.ERR_FEATURE_DUPLICATE: "duplicate feature index {value} in one row",
    _parse.ERR_LABEL_DUPLICATE: "duplicate label index {value} in one row",
    _parse.ERR_TOO_MANY_ROWS: "more rows than the header's n_samples {n_samples} "
                              "(extra line {tok!r})",
    _parse.ERR_TOO_FEW_ROWS: "file ends after {value} rows but the header says n_samples "
                             "{n_samples}",
}


def _raise(name, buf, code, line, start, end, value, n_samples, n_features, n_labels):
    tok = bytes(buf[start:end]).decode("utf-8", errors="replace")[:60] if start >= 0 else ""
    field = ""
    if code == _parse.ERR_LABEL_EMPTY:
        ls = start
        while ls > 0 and buf[ls - 1] != 10:
            ls -= 1
        le = ls
        while le < len(buf) and buf[le] not in (32, 9, 10, 13):
            le += 1
        field = bytes(buf[ls:le]).decode("utf-8", errors="replace")[:60]
    msg = _MESSAGES[code].format(tok=tok, field=field, value=value, n_samples=n_samples,
                                 n_features=n_features, n_labels=n_labels)
    raise DatasetFormatError(f"{name} line {line}: {msg}")


def parse_rows(buf: bytes, offset: int, *, name: str, n_samples: int, n_features: int,
               n_labels: int, feature_shift: int = 0, first_line: int = 2):
    """Run the byte parser and build ``(X, Y, max_feature, max_label)``; raise on bad input.

    ``n_samples`` of -1 reads every line; the returned matrices then have as many rows as lines.
    """
    arr = np.frombuffer(buf, dtype=np.uint8)
    (x_indptr, x_indices, x_data, y_indptr, y_indices, n_rows, code, line, start, end, value,
     max_feature, max_label) = _parse.parse_rows(arr, offset, n_samples, n_features, n_labels,
                                                 feature_shift, first_line)
    if code != _parse.OK:
        _raise(name, arr, code, line, start, end, value, n_samples, n_features, n_labels)
    return x_indptr, x_indices, x_data, y_indptr, y_indices, int(max_feature), int(max_label)


def build_xy(x_indptr, x_indices, x_data, y_indptr, y_indices, n_features, n_labels):
    """Canonical CSR ``(X, Y)`` from parser output (indices already sorted and unique)."""
    n_samples = len(x_indptr) - 1
    x_indptr = _compact_indptr(x_indptr)
    y_indptr = _compact_indptr(y_indptr)
    X = sp.csr_matrix((x_data, x_indices, x_indptr), shape=(n_samples, n_features), copy=False)
    Y = sp.csr_matrix((np.ones(len(y_indices), dtype=np.float32), y_indices, y_indptr),
                      shape=(n_samples, n_labels), copy=False)
    X.has_sorted_indices = True
    Y.has_sorted_indices = True
    X.has_canonical_format = True
    Y.has_canonical_format = True
    return X, Y


def _compact_indptr(indptr):
    if indptr[-1] <= _INDEX_MAX:
        return indptr.astype(np.int32)
    return indptr


# ------------------------------------------------------------------------------------------- XC
def parse_xc_bytes(buf: bytes, name: str = "<bytes>"):
    """Parse a whole XC file held in memory; return canonical ``(X, Y)``."""
    n_samples, n_features, n_labels, offset = parse_header(buf, name)
    parts = parse_rows(buf, offset, name=name, n_samples=n_samples, n_features=n_features,
                       n_labels=n_labels)
    return build_xy(*parts[:5], n_features, n_labels)


def read_xc(path):
    """Parse an XC file (no cache); see :func:`load_xc`."""
    path = Path(path)
    return parse_xc_bytes(read_bytes(path), path.name)


def save_xc(path, X, Y) -> Path:
    """Write ``(X, Y)`` in the XC text format, compressed by suffix, atomically.

    Parameters
    ----------
    path : str or Path
        Destination; ``.xz``, ``.gz`` or ``.bz2`` compresses, anything else is plain text.
        ``.npz`` writes the binary format of :func:`save_npz` instead.
    X : sparse or dense matrix, shape (n_samples, n_features)
        Feature values; written with the fewest digits that read back to the same float32.
    Y : sparse or dense matrix, shape (n_samples, n_labels)
        Labels: the positions of the non-zeros are written (values are ignored).

    Returns
    -------
    Path
        ``path``, so that ``load_xc(save_xc(p, X, Y))`` round-trips.
    """
    path = Path(path)
    if path.suffix.lower() == ".npz":
        return save_npz(path, X, Y)
    X, Y = _canonical_pair(X, Y)
    n_samples, n_features = X.shape
    n_labels = Y.shape[1]
    body = _format_rows(X, Y)
    header = f"{n_samples} {n_features} {n_labels}\n".encode()
    opener = OPENERS.get(path.suffix.lower())

    def write(tmp):
        if opener is None:
            with open(tmp, "wb") as fh:
                fh.write(header)
                fh.write(body)
        else:
            with opener(tmp, "wb") as fh:
                fh.write(header)
                fh.write(body)

    atomic_write(path, write)
    return path


def _canonical_pair(X, Y):
    X = sp.csr_matrix(X, dtype=np.float32)
    Y = sp.csr_matrix(Y)
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows but Y has {Y.shape[0]}")
    X.sum_duplicates()
    X.sort_indices()
    Y.sum_duplicates()
    Y.eliminate_zeros()
    Y.sort_indices()
    return X, Y


def _format_values(data: np.ndarray) -> np.ndarray:
    """Shortest of ``%.6g`` / ``%.9g`` per value that reads back as the same float32."""
    data = np.asarray(data, dtype=np.float32)
    if not np.all(np.isfinite(data)):
        raise ValueError("X holds non-finite values; the XC format cannot store them")
    d64 = data.astype(np.float64)
    short = np.char.mod("%.6g", d64)
    if len(short):
        exact = short.astype(np.float64).astype(np.float32) == data
        if not exact.all():
            short = short.astype(object)
            short[~exact] = np.char.mod("%.9g", d64[~exact])
    return short.astype(str)


def _format_rows(X, Y) -> bytes:
    vals = _format_values(X.data)
    feats = np.char.add(np.char.add(X.indices.astype(str), ":"), vals) if X.nnz else vals
    labels = Y.indices.astype(str)
    xi, yi = X.indptr, Y.indptr
    feats = feats.tolist()
    labels = labels.tolist()
    lines = []
    for r in range(X.shape[0]):
        lab = ",".join(labels[yi[r]:yi[r + 1]])
        f = " ".join(feats[xi[r]:xi[r + 1]])
        lines.append(f"{lab} {f}" if f else lab)
    lines.append("")
    return "\n".join(lines).encode()


# -------------------------------------------------------------------------------------- LIBSVM
def load_libsvm(path, n_features: int | None = None, n_labels: int | None = None, *,
                zero_based: bool = True):
    """Load a multi-label LIBSVM file (``l1,l2,... f:v f:v ...`` per line, no header).

    Parameters
    ----------
    path : str or Path
        Plain or ``.xz``/``.gz``/``.bz2`` file.
    n_features, n_labels : int, optional
        Matrix widths; default ``max index + 1`` over the file. When given, a larger index is an
        error.
    zero_based : bool, default True
        Feature indices are used as written. ``False``: the file's feature indices start at 1
        and are shifted down by one (index 0 is then an error). Label indices are always used
        as written.

    Returns
    -------
    X : scipy.sparse.csr_matrix, shape (n_samples, n_features), float32
    Y : scipy.sparse.csr_matrix, shape (n_samples, n_labels), float32 ones
    """
    path = Path(path)
    buf = read_bytes(path)
    return parse_libsvm_bytes(buf, path.name, n_features=n_features, n_labels=n_labels,
                              zero_based=zero_based)


def parse_libsvm_bytes(buf: bytes, name: str = "<bytes>", *, n_features=None, n_labels=None,
                       zero_based=True):
    """Parse a LIBSVM multi-label file held in memory; see :func:`load_libsvm`."""
    for what, v in (("n_features", n_features), ("n_labels", n_labels)):
        if v is not None and not 0 <= v <= _INDEX_MAX:
            raise ValueError(f"{what}={v} must be in [0, 2**31)")
    parts = parse_rows(buf, 0, name=name, n_samples=-1,
                       n_features=_INDEX_MAX if n_features is None else n_features,
                       n_labels=_INDEX_MAX if n_labels is None else n_labels,
                       feature_shift=0 if zero_based else 1, first_line=1)
    max_feature, max_label = parts[5], parts[6]
    nf = max_feature + 1 if n_features is None else n_features
    nl = max_label + 1 if n_labels is None else n_labels
    return build_xy(*parts[:5], nf, nl)


# -------------------------------------------------------------------------------------- splits
def load_split(data_path, train_idx_path, test_idx_path, *, split: int = 0,
               one_based: bool = True):
    """Load the split-file variant of the small XC datasets (e.g. Bibtex, Mediamill, Delicious).

    Accepted format: ``data_path`` is one XC file (header + all rows, plain or compressed);
    ``train_idx_path`` / ``test_idx_path`` are whitespace-separated integer tables with one line
    per train (test) row and one column per split (the XC repository ships 10); entry
    ``[i, j]`` is the row of ``data_path`` that is the ``i``-th train (test) point of split
    ``j``. Indices are 1-based as in the XC repository (``one_based=False`` for 0-based).

    Returns
    -------
    X_train, Y_train, X_test, Y_test : scipy.sparse.csr_matrix
    """
    X, Y = load_xc(data_path)
    out = []
    for p in (train_idx_path, test_idx_path):
        idx = _read_split_column(Path(p), split, one_based, X.shape[0])
        out += [X[idx], Y[idx]]
    return tuple(out)


def _read_split_column(path: Path, split: int, one_based: bool, n_rows: int) -> np.ndarray:
    text = read_bytes(path).decode("utf-8", errors="replace")
    col = []
    n_cols = None
    for k, line in enumerate(text.splitlines(), start=1):
        parts = line.split()
        if not parts:
            continue
        if n_cols is None:
            n_cols = len(parts)
            if not 0 <= split < n_cols:
                raise DatasetFormatError(f"{path.name}: split column {split} requested but the "
                                         f"file has {n_cols} column(s)")
        if len(parts) != n_cols:
            raise DatasetFormatError(f"{path.name} line {k}: {len(parts)} columns, expected "
                                     f"{n_cols}")
        tok = parts[split]
        try:
            v = int(tok) - (1 if one_based else 0)
        except ValueError:
            raise DatasetFormatError(f"{path.name} line {k}: bad row index {tok!r}") from None
        if not 0 <= v < n_rows:
            raise DatasetFormatError(f"{path.name} line {k}: row index {tok} out of range for "
                                     f"{n_rows} rows ({'1' if one_based else '0'}-based)")
        col.append(v)
    return np.asarray(col, dtype=np.int64)


# ----------------------------------------------------------------------------------------- npz
def save_npz(path, X, Y) -> Path:
    """Write ``(X, Y)`` as CSR parts in an uncompressed ``.npz`` (no pickle), atomically."""
    path = Path(path)
    X, Y = _canonical_pair(X, Y)
    arrays = xy_arrays(X, Y)

    def write(tmp):
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)

    atomic_write(path, write)
    return path


def load_npz(path):
    """Load ``(X, Y)`` written by :func:`save_npz` (``allow_pickle=False``)."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            return xy_from_npz(z, path.name)
    except (ValueError, OSError, EOFError) as exc:
        if isinstance(exc, DatasetFormatError | FileNotFoundError):
            raise
        raise DatasetFormatError(f"{path.name}: not a valid npz file ({exc})") from exc


def load_xc(path, *, cache: bool = True):
    """Load an XC-repository sparse text file (plain, ``.xz``, ``.gz`` or ``.bz2``).

    Format: a header ``n_samples n_features n_labels``, then one line per sample
    ``l1,l2,... f:v f:v ...`` with 0-based indices (see the module docstring for the edge cases).

    Parameters
    ----------
    path : str or Path
        The file. A ``.npz`` written by :func:`save_npz` is also accepted.
    cache : bool, default True
        Reuse / write a binary ``.npz`` cache keyed by the file's size, mtime and content hash
        (see :mod:`xmc_engine.datasets.cache`); ``False`` always parses.

    Returns
    -------
    X : scipy.sparse.csr_matrix, shape (n_samples, n_features), float32, host
        Canonical: sorted indices, no duplicates.
    Y : scipy.sparse.csr_matrix, shape (n_samples, n_labels), float32 ones, host

    Raises
    ------
    DatasetFormatError
        Naming file, line and token, for any malformed input (see module docstring).
    """
    path = Path(path)
    if path.suffix.lower() == ".npz":
        return load_npz(path)
    if not cache:
        return read_xc(path)
    from .cache import cached_load

    return cached_load(path, read_xc)
