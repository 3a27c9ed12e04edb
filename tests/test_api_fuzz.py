"""Fuzzing the Python API (issue 17): ``fit``, ``predict``, ``predict_topk``, ``predict_proba``,
``evaluate``, ``score``, ``save`` and ``load`` on generated inputs.

Accepted, and normalised to canonical float32 CSR (rules in :mod:`xmc_engine.validation`):

- ``X``: SciPy CSR / CSC / COO matrices and CSR arrays; dense NumPy arrays of float32, float64,
  integers or booleans; lists of lists; object arrays of numbers; explicit zeros; unsorted or
  duplicate CSR indices (duplicates are summed); 64-bit index arrays.
- ``Y``: the same containers holding 0/1 (or booleans); a label stored twice in a row counts
  once; explicit zeros; rows, or a whole matrix, without any label.

Each accepted variant must train to exactly the parameters of its canonical form (same seed, one
thread), predict and evaluate the same, survive ``save``/``load``, and leave the caller's
arrays untouched.

Refused with a ``ValueError`` whose message names the argument (``X``, ``Y``, ``X_test``,
``Y_test``, ``k``, ``threshold``): NaN or infinity, values beyond float32, ``Y`` values other
than 0/1 (2, -1, 0.5, NaN), mismatched rows, empty matrices (0 rows for ``fit``, 0 features, 0
labels), 1-D and 3-D input, complex and string values, ragged lists, ``None``, a malformed CSR
structure, a feature or label count other than the model's at prediction and evaluation, and
top-k or threshold values out of range. Prediction on 0 rows is accepted and returns 0 rows.
Bad parameter values (wrong type or range) are stored by ``__init__`` and refused by ``fit``
with a ``ConfigError`` (a ``ValueError``) naming the parameter.
"""

from __future__ import annotations

import re
import tempfile

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xmc_engine import XMCClassifier
from xmc_engine.errors import ConfigError, DatasetFormatError

KW = dict(hidden=4, epochs=1, batch_size=4, threads=1, seed=0, eval_every=0)
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    """A small dense problem: integer-valued features (exact in every dtype) and 0/1 labels."""
    n = draw(st.integers(1, 7))
    n_features = draw(st.integers(1, 6))
    n_labels = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    X = np.where(rng.random((n, n_features)) < 0.5, rng.integers(1, 4, (n, n_features)), 0)
    Y = (rng.random((n, n_labels)) < 0.4).astype(np.float32)
    return X.astype(np.float32), Y, rng


def raw_csr(M: np.ndarray, rng, *, zeros=False, unsorted=False, duplicates=False,
            index_dtype=np.int32) -> sp.csr_matrix:
    """CSR of dense ``M`` built from raw arrays, so that SciPy keeps the given layout: explicit
    zeros, indices in a random order, or each value split into two entries of one column."""
    data, indices, indptr = [], [], [0]
    for row in M:
        cols = list(np.flatnonzero(row))
        vals = [float(row[c]) for c in cols]
        if zeros:
            for c in np.flatnonzero(row == 0)[:2]:
                cols.append(int(c))
                vals.append(0.0)
        if duplicates:
            cols, vals = cols + cols, [v / 2 for v in vals] * 2
        order = rng.permutation(len(cols)) if unsorted or duplicates else range(len(cols))
        indices += [cols[i] for i in order]
        data += [vals[i] for i in order]
        indptr.append(len(indices))
    return sp.csr_matrix((np.array(data, np.float32), np.array(indices, index_dtype),
                          np.array(indptr, index_dtype)), shape=M.shape)


#: name -> (given, canonical dense) from a dense float32 matrix of small integers
X_VARIANTS = {
    "csr float32": lambda X, rng: (sp.csr_matrix(X), X),
    "dense float32": lambda X, rng: (X, X),
    "dense float64": lambda X, rng: (X.astype(np.float64), X),
    "dense int64": lambda X, rng: (X.astype(np.int64), X),
    "csr int32": lambda X, rng: (sp.csr_matrix(X.astype(np.int32)), X),
    "dense bool": lambda X, rng: (X > 0, (X > 0).astype(np.float32)),
    "list of lists": lambda X, rng: (X.tolist(), X),
    "object array": lambda X, rng: (X.astype(object), X),
    "csc": lambda X, rng: (sp.csc_matrix(X), X),
    "coo": lambda X, rng: (sp.coo_matrix(X), X),
    "csr_array": lambda X, rng: (sp.csr_array(X), X),
    "explicit zeros": lambda X, rng: (raw_csr(X, rng, zeros=True), X),
    "unsorted indices": lambda X, rng: (raw_csr(X, rng, unsorted=True), X),
    "duplicate indices": lambda X, rng: (raw_csr(X, rng, duplicates=True), X),
    "int64 indices": lambda X, rng: (raw_csr(X, rng, index_dtype=np.int64), X),
}


def _double_ones(Y, rng):
    """Each label stored twice (value 1 both times): one label."""
    M = raw_csr(Y, rng, duplicates=True)
    M.data[:] = 1.0
    return M, Y


Y_VARIANTS = {
    "csr": lambda Y, rng: (sp.csr_matrix(Y), Y),
    "dense int": lambda Y, rng: (Y.astype(np.int64), Y),
    "dense bool": lambda Y, rng: (Y > 0, Y),
    "list of lists": lambda Y, rng: (Y.astype(int).tolist(), Y),
    "coo": lambda Y, rng: (sp.coo_matrix(Y), Y),
    "explicit zeros": lambda Y, rng: (raw_csr(Y, rng, zeros=True), Y),
    "label stored twice": _double_ones,
    "no label at all": lambda Y, rng: (np.zeros_like(Y), np.zeros_like(Y)),
}


def snapshot(M):
    """The raw content of an input, to check that the API did not modify it."""
    if sp.issparse(M):
        M = M.tocoo() if M.format == "coo" else M
        parts = ("row", "col", "data") if M.format == "coo" else ("indptr", "indices", "data")
        return [getattr(M, p).copy() for p in parts]
    return [np.array(M, dtype=object)]


def assert_unchanged(before, M):
    for a, b in zip(before, snapshot(M), strict=True):
        np.testing.assert_array_equal(a, b)


@SETTINGS
@given(problem=problems(), x_variant=st.sampled_from(sorted(X_VARIANTS)),
       y_variant=st.sampled_from(sorted(Y_VARIANTS)))
def test_accepted_inputs_behave_like_their_canonical_form(problem, x_variant, y_variant):
    Xd, Yd, rng = problem
    X, X_canon = X_VARIANTS[x_variant](Xd, rng)
    Y, Y_canon = Y_VARIANTS[y_variant](Yd, rng)
    X_before, Y_before = snapshot(X), snapshot(Y)
    X_canon, Y_canon = sp.csr_matrix(X_canon), sp.csr_matrix(Y_canon)

    ref = XMCClassifier(**KW).fit(X_canon, Y_canon)
    model = XMCClassifier(**KW).fit(X, Y)
    for a, b in zip(ref.params_, model.params_, strict=True):
        np.testing.assert_array_equal(a, b)
    k = Yd.shape[1]
    labels, scores = model.predict_topk(X, k)
    ref_labels, ref_scores = ref.predict_topk(X_canon, k)
    np.testing.assert_array_equal(labels, ref_labels)
    np.testing.assert_array_equal(scores, ref_scores)
    assert (model.predict(X, k=k) != ref.predict(X_canon, k=k)).nnz == 0
    proba = model.predict_proba(X, k=k)
    np.testing.assert_allclose(np.asarray(proba.sum(axis=1)).ravel(), 1.0, rtol=1e-4)
    assert model.evaluate(X, Y) == ref.evaluate(X_canon, Y_canon)
    assert 0.0 <= model.score(X, Y) <= 1.0
    with tempfile.TemporaryDirectory() as folder:
        loaded = XMCClassifier.load(model.save(f"{folder}/model"))
    np.testing.assert_array_equal(loaded.predict_topk(X, k)[0], labels)
    assert loaded.get_config() == model.get_config()
    assert_unchanged(X_before, X)
    assert_unchanged(Y_before, Y)


def _with(M: np.ndarray, value) -> np.ndarray:
    M = M.astype(np.float64)
    M.flat[0] = value
    return M


def _malformed(X: np.ndarray) -> sp.csr_matrix:
    """A CSR whose first index points past the last column (SciPy's constructor lets it by)."""
    n, f = X.shape
    return sp.csr_matrix((np.ones(1, np.float32), np.array([f + 3]), np.r_[0, np.ones(n, int)]),
                         shape=(n, f))


def _fitted(X, Y):
    return XMCClassifier(**KW).fit(sp.csr_matrix(X), sp.csr_matrix(Y))


def _wider(X):
    return np.hstack([X, np.ones((X.shape[0], 1), X.dtype)])


#: name -> (argument named in the message, call raising ValueError) from (X, Y) dense float32
REFUSED = {
    "X NaN": ("X", lambda X, Y: XMCClassifier(**KW).fit(_with(X, np.nan), Y)),
    "X inf in CSR": ("X", lambda X, Y: XMCClassifier(**KW).fit(sp.csr_matrix(_with(X, -np.inf)),
                                                               Y)),
    "X beyond float32": ("X", lambda X, Y: XMCClassifier(**KW).fit(_with(X, 1e300), Y)),
    "Y value 2": ("Y", lambda X, Y: XMCClassifier(**KW).fit(X, _with(Y, 2))),
    "Y value -1": ("Y", lambda X, Y: XMCClassifier(**KW).fit(X, sp.csr_matrix(_with(Y, -1)))),
    "Y value 0.5": ("Y", lambda X, Y: XMCClassifier(**KW).fit(X, _with(Y, 0.5))),
    "Y NaN": ("Y", lambda X, Y: XMCClassifier(**KW).fit(X, _with(Y, np.nan))),
    "Y one row more": ("Y", lambda X, Y: XMCClassifier(**KW).fit(X, np.vstack([Y, Y[:1]]))),
    "Y one row less": ("Y", lambda X, Y: XMCClassifier(**KW).fit(X, Y[:-1])),
    "X no rows": ("X", lambda X, Y: XMCClassifier(**KW).fit(X[:0], Y[:0])),
    "X no features": ("X", lambda X, Y: XMCClassifier(**KW).fit(X[:, :0], Y)),
    "Y no labels": ("Y", lambda X, Y: XMCClassifier(**KW).fit(X, Y[:, :0])),
    "X 1-D": ("X", lambda X, Y: XMCClassifier(**KW).fit(X[:, 0], Y)),
    "X 3-D": ("X", lambda X, Y: XMCClassifier(**KW).fit(X[None], Y)),
    "Y 1-D": ("Y", lambda X, Y: XMCClassifier(**KW).fit(X, Y[:, 0])),
    "X complex": ("X", lambda X, Y: XMCClassifier(**KW).fit(X.astype(np.complex64), Y)),
    "X strings": ("X", lambda X, Y: XMCClassifier(**KW).fit(X.astype(str), Y)),
    "X ragged": ("X", lambda X, Y: XMCClassifier(**KW).fit([[1.0, 2.0], [1.0]], Y)),
    "X None": ("X", lambda X, Y: XMCClassifier(**KW).fit(None, Y)),
    "Y None": ("Y", lambda X, Y: XMCClassifier(**KW).fit(X, None)),
    "X malformed CSR": ("X", lambda X, Y: XMCClassifier(**KW).fit(_malformed(X), Y)),
    "X_test features": ("X_test", lambda X, Y: XMCClassifier(**KW).fit(
        X, Y, eval_set=(_wider(X), Y))),
    "Y_test labels": ("Y_test", lambda X, Y: XMCClassifier(**KW).fit(
        X, Y, eval_set=(X, _wider(Y)))),
    "eval_set not a pair": ("eval_set", lambda X, Y: XMCClassifier(**KW).fit(X, Y, eval_set=X)),
    "predict features": ("X", lambda X, Y: _fitted(X, Y).predict(_wider(X))),
    "predict_topk no features": ("X", lambda X, Y: _fitted(X, Y).predict_topk(X[:, :0])),
    "predict_proba NaN": ("X", lambda X, Y: _fitted(X, Y).predict_proba(_with(X, np.nan))),
    "evaluate labels": ("Y", lambda X, Y: _fitted(X, Y).evaluate(X, _wider(Y))),
    "evaluate rows": ("Y", lambda X, Y: _fitted(X, Y).evaluate(X, np.vstack([Y, Y]))),
    "score Y values": ("Y", lambda X, Y: _fitted(X, Y).score(X, 3 * Y + 2)),
    "k 0": ("k", lambda X, Y: _fitted(X, Y).predict_topk(X, 0)),
    "k bool": ("k", lambda X, Y: _fitted(X, Y).predict(X, k=True)),
    "k float": ("k", lambda X, Y: _fitted(X, Y).decision_function(X, k=1.5)),
    "threshold 0": ("threshold", lambda X, Y: _fitted(X, Y).predict(X, threshold=0.0)),
}


@SETTINGS
@given(problem=problems(), case=st.sampled_from(sorted(REFUSED)))
def test_refused_inputs_raise_value_error_naming_the_argument(problem, case):
    Xd, Yd, _ = problem
    name, call = REFUSED[case]
    with pytest.raises(ValueError) as info:
        call(Xd, Yd)
    assert re.search(rf"(?<![\w]){name}(?![\w])", str(info.value)), (case, str(info.value))


def test_every_refused_case_is_drawn():
    """The cases are few enough that the fuzz run above can meet each; run each once here."""
    rng = np.random.default_rng(1)
    X = np.where(rng.random((5, 4)) < 0.5, 1.0, 0.0).astype(np.float32)
    Y = np.eye(5, 3, dtype=np.float32)
    for case, (name, call) in REFUSED.items():
        with pytest.raises(ValueError) as info:
            call(X, Y)
        assert re.search(rf"(?<![\w]){name}(?![\w])", str(info.value)), (case, str(info.value))


def test_prediction_on_zero_rows():
    X = np.eye(4, 3, dtype=np.float32)
    model = _fitted(X, np.eye(4, 2, dtype=np.float32))
    labels, scores = model.predict_topk(X[:0], 2)
    assert labels.shape == (0, 2) and scores.shape == (0, 2)
    assert model.predict(X[:0]).shape == (0, 2)
    assert model.predict_proba(X[:0]).shape == (0, 2)
    assert model.decision_function(X[:0], k=5).shape == (0, 2)


def test_dataset_format_error_is_exported_by_the_data_layer():
    from xmc_engine.datasets import DatasetFormatError as exported

    assert exported is DatasetFormatError and issubclass(exported, ValueError)


@pytest.mark.parametrize("param, value", [
    ("lr", "fast"), ("lr", 0.0), ("epochs", 0), ("batch_size", 0), ("hidden", "wide"),
    ("hidden", [8, 0]), ("optimizer", "adam"), ("algorithm", "magic"),
    ("algorithm_params", [("merge_period", 8)]), ("eval_k", 0), ("checkpoint_every", "soon"),
])
def test_bad_parameter_values_fail_in_fit_naming_the_parameter(param, value):
    """``__init__`` stores any value (scikit-learn's contract); ``fit`` refuses a bad one with a
    ``ConfigError`` (a ``ValueError``) that names it, before touching the data."""
    model = XMCClassifier(**{**KW, param: value})
    assert getattr(model, param) is value
    with pytest.raises(ConfigError, match=param):
        model.fit(np.eye(3, dtype=np.float32), np.eye(3, dtype=np.float32))
