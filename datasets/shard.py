"""Row-range loading of XC files: one process reads only its own share of the rows (DESIGN.md §6).

:func:`shard_range` splits ``n_samples`` rows into ``size`` contiguous, nearly equal ranges;
:func:`load_xc_rows` streams an XC file (plain, ``.xz``, ``.gz``, ``.bz2``) in chunks, keeps only
the bytes of the wanted rows and parses them with the same byte parser as
:func:`~xmc_engine.datasets.io.load_xc` (same canonical output, same error messages, with line
numbers of the whole file). A compressed stream still has to be decompressed up to ``stop`` (no
random access), but neither the other rows' bytes nor their matrices are ever held in memory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from xmc_engine.errors import DatasetFormatError

from .io import OPENERS, build_xy, parse_header, parse_rows

__all__ = ["load_xc_rows", "load_xc_shard", "shard_range"]

_CHUNK = 1 << 22  # 4 MiB of decompressed text per read


def shard_range(n_samples: int, rank: int, size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of part ``rank`` of ``size`` contiguous, nearly equal parts.

    ``start = floor(rank * n_samples / size)``; the parts cover ``range(n_samples)`` exactly once
    and their lengths differ by at most one.
    """
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"need 0 <= rank < size, got rank={rank}, size={size}")
    if n_samples < 0:
        raise ValueError(f"n_samples must be >= 0, got {n_samples}")
    return rank * n_samples // size, (rank + 1) * n_samples // size


def _open(path: Path):
    opener = OPENERS.get(path.suffix.lower())
    return opener(path, "rb") if opener is not None else open(path, "rb")


def load_xc_rows(path, start: int, stop: int | None = None):
    """Rows ``[start, stop)`` of an XC file as canonical host CSR ``(X, Y)``.

    Parameters
    ----------
    path : str or Path
        XC text file, plain or compressed by suffix.
    start, stop : int
        Row range (0-based data rows, the header excluded); ``stop=None`` means to the end.

    Returns
    -------
    X : scipy.sparse.csr_matrix, shape (stop - start, n_features), float32, host
    Y : scipy.sparse.csr_matrix, shape (stop - start, n_labels), float32 ones, host
    n_samples : int
        Rows of the whole file (from its header).

    Raises
    ------
    DatasetFormatError
        Bad header, a row range outside the file, a file shorter than its header says, or a
        malformed row in the range (named by its line number in the whole file). Rows outside
        the range are not validated.
    """
    path = Path(path)
    name = path.name
    with _open(path) as fh:
        head = b""
        while b"\n" not in head:
            chunk = fh.read(_CHUNK)
            if not chunk:
                break
            head += chunk
        n_samples, n_features, n_labels, offset = parse_header(head, name)
        stop = n_samples if stop is None else int(stop)
        start = int(start)
        if not 0 <= start <= stop <= n_samples:
            raise DatasetFormatError(f"{name}: row range [{start}, {stop}) is outside the "
                                     f"file's {n_samples} rows")
        parts: list[bytes] = []
        row = 0  # index of the row that begins at ``pos`` of the current chunk
        chunk, pos = head, offset
        while row < stop and start < stop:
            if pos >= len(chunk):
                chunk, pos = fh.read(_CHUNK), 0
                if not chunk:
                    break
            view = np.frombuffer(chunk, dtype=np.uint8)
            nl = np.flatnonzero(view[pos:] == 10) + pos  # newline positions from pos on
            # Row ``row + j`` ends at nl[j]; keep the bytes of rows in [start, stop).
            a = pos if row >= start else (int(nl[start - row - 1]) + 1
                                          if start - row - 1 < len(nl) else None)
            if a is not None:
                if stop - row - 1 < len(nl):
                    b = int(nl[stop - row - 1]) + 1
                    parts.append(chunk[a:b])
                    row = stop
                    break
                parts.append(chunk[a:])
            row += len(nl)
            pos = len(chunk)
        if row < stop and start < stop:
            # End of file: the last line may lack its newline (it is then one more row).
            tail_rows = row + (1 if parts and parts[-1] and not parts[-1].endswith(b"\n")
                               else 0)
            if not (tail_rows == stop == n_samples):
                raise DatasetFormatError(f"{name}: file ends after {min(tail_rows, n_samples)} "
                                         f"rows but the header says n_samples {n_samples}")
    buf = b"".join(parts)
    x_indptr, x_indices, x_data, y_indptr, y_indices, _, _ = parse_rows(
        buf, 0, name=name, n_samples=stop - start, n_features=n_features, n_labels=n_labels,
        first_line=start + 2)
    X, Y = build_xy(x_indptr, x_indices, x_data, y_indptr, y_indices, n_features, n_labels)
    return X, Y, n_samples


def load_xc_shard(path, rank: int, size: int):
    """Part ``rank`` of ``size`` of an XC file (rows :func:`shard_range`); see
    :func:`load_xc_rows`.

    Returns
    -------
    X, Y : scipy.sparse.csr_matrix
        The shard's rows (canonical host CSR).
    rows : tuple of int
        ``(start, stop)`` in the whole file.
    n_samples : int
        Rows of the whole file.
    """
    from .registry import header_counts

    counts = header_counts(path)
    if counts is None:
        raise DatasetFormatError(f"{Path(path).name}: not an XC file (no 'n_samples n_features "
                                 "n_labels' header); shards need the XC format")
    start, stop = shard_range(counts[0], rank, size)
    X, Y, n = load_xc_rows(path, start, stop)
    return X, Y, (start, stop), n
