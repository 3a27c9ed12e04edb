"""Numba byte parser for the XC / LIBSVM multi-label sparse text formats (rows only, no header).

Input: ``buf`` uint8[n_bytes] on the host, the decompressed file; ``pos`` the byte offset of the
first row. Output: CSR parts ``x_indptr`` int64[n_rows + 1], ``x_indices`` int32[nnz],
``x_data`` float32[nnz], ``y_indptr`` int64[n_rows + 1], ``y_indices`` int32[n_label_nnz], with
indices sorted within each row (rows whose indices are not increasing in the file are sorted).

Grammar of one row (one line; the final newline of the file is optional)::

    row    := labels (sep feat)* ws* ("\\r")? "\\n"
    labels := "" | int ("," int)*          (empty when the line starts with a blank)
    feat   := int ":" float
    int    := [0-9]+
    float  := [+-]? ([0-9]+ ("." [0-9]*)? | "." [0-9]+) ([eE] [+-]? [0-9]+)?
    sep    := (" " | "\\t")+

Anything else is an error, reported as a code (``ERR_*``), the 1-based line number, the byte span
of the offending token and an integer value (the index, for range and duplicate errors); the
Python side turns these into a :class:`~xmc_engine.errors.DatasetFormatError`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

OK = 0
ERR_LABEL_TOKEN = 1
ERR_LABEL_EMPTY = 2
ERR_LABEL_RANGE = 3
ERR_LABEL_NEGATIVE = 4
ERR_FEATURE_TOKEN = 5
ERR_FEATURE_NEGATIVE = 6
ERR_FEATURE_RANGE = 7
ERR_MISSING_COLON = 8
ERR_VALUE_TOKEN = 9
ERR_VALUE_NONFINITE = 10
ERR_FEATURE_DUPLICATE = 11
ERR_LABEL_DUPLICATE = 12
ERR_TOO_MANY_ROWS = 13
ERR_TOO_FEW_ROWS = 14

_NL = 10
_CR = 13
_SP = 32
_TAB = 9
_COMMA = 44
_COLON = 58
_MINUS = 45
_PLUS = 43
_DOT = 46
_ZERO = 48
_NINE = 57
_E_LO = 101
_E_UP = 69

# Index values above this are reported as out of range without further accumulation.
_INDEX_CAP = np.int64(1) << np.int64(40)
_F32_MAX = 3.4028234663852886e38
_POW10 = np.array([10.0 ** k for k in range(23)], dtype=np.float64)


@njit(cache=True, nogil=True, inline="always")
def _is_blank(c):
    return c == _SP or c == _TAB or c == _CR


@njit(cache=True, nogil=True, inline="always")
def _is_end(c):
    return c == _SP or c == _TAB or c == _CR or c == _NL


@njit(cache=True, nogil=True)
def _parse_float(buf, a, b):
    """Parse ``buf[a:b]`` as a float; return ``(value, code)`` with code OK or an ERR_VALUE_*."""
    i = a
    neg = False
    if i < b and (buf[i] == _MINUS or buf[i] == _PLUS):
        neg = buf[i] == _MINUS
        i += 1
    mant = np.int64(0)
    n_mant = 0  # significant digits kept in mant
    exp10 = 0
    n_digits = 0
    while i < b and _ZERO <= buf[i] <= _NINE:
        if n_mant < 18:
            mant = mant * 10 + (buf[i] - _ZERO)
            if mant > 0:
                n_mant += 1
        else:
            exp10 += 1
        n_digits += 1
        i += 1
    if i < b and buf[i] == _DOT:
        i += 1
        while i < b and _ZERO <= buf[i] <= _NINE:
            if n_mant < 18:
                mant = mant * 10 + (buf[i] - _ZERO)
                if mant > 0:
                    n_mant += 1
                exp10 -= 1
            n_digits += 1
            i += 1
    if n_digits == 0:
        # "nan", "inf", "infinity" (any case, optional sign) are numbers, but not finite ones.
        j = a + 1 if (b > a and (buf[a] == _MINUS or buf[a] == _PLUS)) else a
        c = buf[j] if j < b else 0
        if c == 110 or c == 78 or c == 105 or c == 73:  # n N i I
            return 0.0, ERR_VALUE_NONFINITE
        return 0.0, ERR_VALUE_TOKEN
    if i < b and (buf[i] == _E_LO or buf[i] == _E_UP):
        i += 1
        eneg = False
        if i < b and (buf[i] == _MINUS or buf[i] == _PLUS):
            eneg = buf[i] == _MINUS
            i += 1
        e = 0
        n_e = 0
        while i < b and _ZERO <= buf[i] <= _NINE:
            if e < 100000:
                e = e * 10 + (buf[i] - _ZERO)
            n_e += 1
            i += 1
        if n_e == 0:
            return 0.0, ERR_VALUE_TOKEN
        exp10 += -e if eneg else e
    if i != b:
        return 0.0, ERR_VALUE_TOKEN
    v = float(mant)
    if mant == 0:
        v = 0.0
    elif exp10 > 0:
        if exp10 > 60:
            return 0.0, ERR_VALUE_NONFINITE
        while exp10 > 22:
            v *= _POW10[22]
            exp10 -= 22
        v *= _POW10[exp10]
    elif exp10 < 0:
        k = -exp10
        if k > 400:
            v = 0.0
        else:
            while k > 22:
                v /= _POW10[22]
                k -= 22
            v /= _POW10[k]
    if v >= _F32_MAX * (1.0 + 2.0 ** -25):
        return 0.0, ERR_VALUE_NONFINITE
    return (-v if neg else v), OK


@njit(cache=True, nogil=True)
def _parse_index(buf, a, b, bad_code, neg_code):
    """Parse ``buf[a:b]`` as a non-negative integer; return ``(value, code)``."""
    if a >= b:
        return np.int64(0), bad_code
    if buf[a] == _MINUS:
        if a + 1 < b:
            for j in range(a + 1, b):
                if not (_ZERO <= buf[j] <= _NINE):
                    return np.int64(0), bad_code
            return np.int64(0), neg_code
        return np.int64(0), bad_code
    v = np.int64(0)
    for j in range(a, b):
        c = buf[j]
        if not (_ZERO <= c <= _NINE):
            return np.int64(0), bad_code
        if v < _INDEX_CAP:
            v = v * 10 + (c - _ZERO)
    return v, OK


@njit(cache=True, nogil=True)
def _sort_row(indices, data, a, b, with_data):
    """Sort ``indices[a:b]`` (and ``data`` alongside); return the first duplicate or -1."""
    order = np.argsort(indices[a:b], kind="mergesort")
    tmp_i = indices[a:b][order]
    indices[a:b] = tmp_i
    if with_data:
        tmp_d = data[a:b][order]
        data[a:b] = tmp_d
    for j in range(a + 1, b):
        if indices[j] == indices[j - 1]:
            return np.int64(indices[j])
    return np.int64(-1)


@njit(cache=True, nogil=True)
def parse_rows(buf, pos, n_rows_expected, n_features, n_labels, feature_shift, first_line):
    """Parse the rows of an XC / LIBSVM file.

    Parameters
    ----------
    buf : uint8[n_bytes]
        The decompressed file.
    pos : int
        Byte offset of the first row.
    n_rows_expected : int
        Rows the header announces, or -1 to read every line (LIBSVM).
    n_features, n_labels : int
        Exclusive upper bounds of the feature / label indices (after ``feature_shift``).
    feature_shift : int
        Subtracted from every feature index (1 for one-based files).
    first_line : int
        Line number of the first row (2 after an XC header, 1 without).

    Returns
    -------
    tuple
        ``(x_indptr, x_indices, x_data, y_indptr, y_indices, n_rows,
        err_code, err_line, err_start, err_end, err_value, max_feature, max_label)``.
    """
    n = buf.shape[0]
    # Upper bounds: one feature per ':', one label per ',' plus one per line.
    n_colon = 0
    n_comma = 0
    n_nl = 0
    for i in range(pos, n):
        c = buf[i]
        if c == _COLON:
            n_colon += 1
        elif c == _COMMA:
            n_comma += 1
        elif c == _NL:
            n_nl += 1
    max_rows = n_nl + 1
    x_indptr = np.zeros(max_rows + 1, dtype=np.int64)
    y_indptr = np.zeros(max_rows + 1, dtype=np.int64)
    x_indices = np.empty(n_colon, dtype=np.int32)
    x_data = np.empty(n_colon, dtype=np.float32)
    y_indices = np.empty(n_comma + max_rows, dtype=np.int32)

    nx = 0
    ny = 0
    row = 0
    line = first_line
    max_feature = np.int64(-1)
    max_label = np.int64(-1)
    i = pos
    while i < n:
        if n_rows_expected >= 0 and row >= n_rows_expected:
            e = i
            while e < n and buf[e] != _NL:
                e += 1
            return (x_indptr, x_indices, x_data, y_indptr, y_indices, row,
                    ERR_TOO_MANY_ROWS, line, i, e, 0, max_feature, max_label)
        # ---- labels
        y_start = ny
        y_sorted = True
        if not _is_end(buf[i]):
            while True:
                a = i
                while i < n and not _is_end(buf[i]) and buf[i] != _COMMA:
                    i += 1
                if i == a:
                    return (x_indptr, x_indices, x_data, y_indptr, y_indices, row,
                            ERR_LABEL_EMPTY, line, a, a, 0, max_feature, max_label)
                v, code = _parse_index(buf, a, i, ERR_LABEL_TOKEN, ERR_LABEL_NEGATIVE)
                if code != OK:
                    return (x_indptr, x_indices, x_data, y_indptr, y_indices, row,
                            code, line, a, i, 0, max_feature, max_label)
                if v >= n_labels:
                    return (x_indptr, x_indices, x_data, y_indptr, y_indices, row,
                            ERR_LABEL_RANGE, line, a, i, v, max_feature, max_label)
                if ny > y_start and v <= y_indices[ny - 1]:
                    y_sorted = False
                y_indices[ny] = v
                ny += 1
                if v > max_label:
                    max_label = v
                if i < n and buf[i] == _COMMA:
                    i += 1
                    if i >= n or _is_end(buf[i]):
                        return (x_indptr, x_indices, x_data, y_indptr, y_indices, row,
                                ERR_LABEL_EMPTY, line, i, i, 0, max_feature, max_label)
                else:
                    break
        # ---- features
        x_start = nx
        x_sorted = True
        while True:
            while i < n and _is_blank(buf[i]):
                i += 1
            if i >= n or buf[i] == _NL:
                break
            a = i
            colon = -1
            while i < n and not _is_end(buf[i]):
                if buf[i] == _COLON and colon < 0:
                    colon = i
                i += 1
            if colon < 0:
                return (x_indptr, x_indices, x_data, y_indptr, y_indices, row,
                        ERR_MISSING_COLON, line, a, i, 0, max_feature, max_label)
            v, code = _parse_index(buf, a, colon, ERR_FEATURE_TOKEN, ERR_FEATURE_NEGATIVE)
            if code != OK:
                return (x_indptr, x_indices, x_data, y_indptr, y_indices, row,
                        code, line, a, colon, 0, max_feature, max_label)
            v -= feature_shift
            if v < 0:
                return (x_indptr, x_indices, x_data, y_indptr, y_indices, row,
                        ERR_FEATURE_NEGATIVE, line, a, colon, v, max_feature, max_label)
            if v >= n_features:
                return (x_indptr, x_indices, x_data, y_indptr, y_indices, row,
                        ERR_FEATURE_RANGE, line, a, colon, v, max_feature, max_label)
            val, code = _parse_float(buf, colon + 1, i)
            if code != OK:
                return (x_indptr, x_indices, x_data, y_indptr, y_indices, row,
                        code, line, a, i, 0, max_feature, max_label)
            if nx > x_start and v <= x_indices[nx - 1]:
                x_sorted = False
            x_indices[nx] = v
            x_data[nx] = val
            nx += 1
            if v > max_feature:
                max_feature = v
        if not y_sorted:
            dup = _sort_row(y_indices, x_data, y_start, ny, False)
            if dup >= 0:
                return (x_indptr, x_indices, x_data, y_indptr, y_indices, row,
                        ERR_LABEL_DUPLICATE, line, -1, -1, dup, max_feature, max_label)
        if not x_sorted:
            dup = _sort_row(x_indices, x_data, x_start, nx, True)
            if dup >= 0:
                return (x_indptr, x_indices, x_data, y_indptr, y_indices, row,
                        ERR_FEATURE_DUPLICATE, line, -1, -1, dup, max_feature, max_label)
        row += 1
        x_indptr[row] = nx
        y_indptr[row] = ny
        line += 1
        i += 1  # past the newline (or past the end)
    if n_rows_expected >= 0 and row < n_rows_expected:
        return (x_indptr, x_indices, x_data, y_indptr, y_indices, row,
                ERR_TOO_FEW_ROWS, line - 1, -1, -1, row, max_feature, max_label)
    return (x_indptr[: row + 1], x_indices[:nx], x_data[:nx], y_indptr[: row + 1],
            y_indices[:ny], row, OK, line, -1, -1, 0, max_feature, max_label)
