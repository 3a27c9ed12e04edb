"""XMCClassifier under scikit-learn: clone, GridSearchCV, cross_val_score, a text Pipeline and the
estimator checks of ``sklearn.utils.estimator_checks`` that apply.

scikit-learn is a test dependency only (the ``dev`` extra); the module skips without it.

The estimator checks run through ``parametrize_with_checks`` in strict-xfail mode: each check
below that does not apply to a multi-label classifier with sparse outputs must fail, so the list
cannot go stale. The checks that do not apply, and why:

- ``check_estimators_unfitted``: wants ``sklearn.exceptions.NotFittedError``; scikit-learn is no
  dependency of the engine, which raises ``RuntimeError("... not fitted yet ...")``.
- ``check_n_features_in_after_fitting``: calls ``score(X, y=y)`` by keyword; ``score`` names its
  label matrix ``Y`` as ``fit`` does (scikit-learn's ``check_fit_score_takes_y`` accepts both
  names, positional calls work). ``predict``, ``decision_function`` and ``predict_proba`` pass
  its feature-count part, which ``test_estimator.py`` also tests.
- ``check_estimators_dtypes``, ``check_classifier_data_not_an_array``, ``check_fit2d_1feature``:
  train on the class values ``y in {1, 2}``; ``Y`` must be a 0/1 indicator matrix. The input
  dtypes and containers they vary are covered by ``test_api_fuzz.py``.
- ``check_dtype_object``: wants a ``TypeError`` for a dict inside an object array; every bad
  input raises a ``ValueError`` naming the argument here (issue 17). Object arrays of numbers
  are accepted (``test_api_fuzz.py``).
- ``check_estimator_sparse_array``, ``check_estimator_sparse_matrix``: expect
  ``predict_proba`` of shape ``(n_samples, 2)`` for a binary target, the two-class layout of
  single-label classifiers; here it has one column per label. Fit and ``predict`` on every
  sparse format they generate (including 64-bit indices) pass.
- ``check_classifiers_classes``, ``check_classifiers_train`` (all three variants),
  ``check_decision_proba_consistency``: 1-D class-label targets, ``classes_`` and accuracy on
  blobs: single-label classification.
- ``check_classifier_multioutput``: multi-class multi-output targets (several classes per
  output).
- ``check_classifier_not_supporting_multiclass``: wants the message "Only binary
  classification is supported"; a multi-class vector is refused with a message to binarise it
  (multi-label targets are the supported kind).
- ``check_classifiers_multilabel_output_format_predict``, ``..._predict_proba``,
  ``..._decision_function``: want dense ``(n_samples, n_labels)`` arrays; the outputs are SciPy
  CSR (a dense matrix does not fit an extreme label space).
- ``check_classifiers_multilabel_representation_invariance``: compares the predictions with
  ``assert_array_equal``, which cannot compare sparse matrices; the invariance itself (``Y`` as
  a matrix, a list of lists or a list of arrays) is tested below.

``check_array_api_input`` skips itself (``SCIPY_ARRAY_API`` is not set).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_engine import XMCClassifier
from xmc_engine.errors import ConfigError
from xmc_engine.estimator import PARAM_DEFAULTS

sklearn = pytest.importorskip("sklearn")
from sklearn.base import clone  # noqa: E402
from sklearn.feature_extraction.text import TfidfVectorizer  # noqa: E402
from sklearn.metrics import f1_score  # noqa: E402
from sklearn.model_selection import GridSearchCV, cross_val_score  # noqa: E402
from sklearn.pipeline import Pipeline  # noqa: E402
from sklearn.preprocessing import MultiLabelBinarizer  # noqa: E402
from sklearn.utils.estimator_checks import parametrize_with_checks  # noqa: E402

from tests.conftest import real_dataset  # noqa: E402

NOT_APPLICABLE = {
    "check_estimators_unfitted": "NotFittedError is scikit-learn's class; no dependency",
    "check_n_features_in_after_fitting": "calls score(X, y=...); the argument is named Y",
    "check_estimators_dtypes": "trains on class values {1, 2}, not a 0/1 indicator",
    "check_classifier_data_not_an_array": "trains on class values {1, 2}",
    "check_fit2d_1feature": "trains on class values {1, 2}",
    "check_dtype_object": "wants TypeError; bad input raises ValueError naming X",
    "check_estimator_sparse_array": "expects predict_proba (n, 2); ours has one column a label",
    "check_estimator_sparse_matrix": "expects predict_proba (n, 2); ours has one column a label",
    "check_classifiers_classes": "1-D class-label targets",
    "check_classifiers_train": "1-D targets, classes_, accuracy on blobs",
    "check_decision_proba_consistency": "1-D targets",
    "check_classifier_multioutput": "multi-class multi-output targets",
    "check_classifier_not_supporting_multiclass": "wants 'Only binary classification ...'",
    "check_classifiers_multilabel_output_format_predict": "returns CSR, not a dense array",
    "check_classifiers_multilabel_output_format_predict_proba": "returns CSR, not dense",
    "check_classifiers_multilabel_output_format_decision_function": "returns CSR, not dense",
    "check_classifiers_multilabel_representation_invariance": "cannot compare sparse outputs",
}

CHECKED = XMCClassifier(hidden=8, epochs=1, batch_size=16, threads=1)


with warnings.catch_warnings():
    # By design: the estimator follows the protocol without importing scikit-learn.
    warnings.filterwarnings("ignore", "Estimator XMCClassifier does not inherit from",
                            UserWarning)
    WITH_CHECKS = parametrize_with_checks(
        [CHECKED], expected_failed_checks=lambda est: NOT_APPLICABLE, xfail_strict=True)


@WITH_CHECKS
def test_sklearn_estimator_checks(estimator, check):
    check(estimator)


def test_parameters_are_the_config_fields():
    import dataclasses

    from xmc_engine.config import TrainConfig

    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    assert list(PARAM_DEFAULTS) == fields + ["log_dir", "checkpoint_every"]
    assert list(XMCClassifier().get_params(deep=False)) == list(PARAM_DEFAULTS)


def test_clone_round_trips_every_parameter():
    est = XMCClassifier(hidden=[256], algorithm="adaptive", algorithm_params={"merge_period": 2048})
    copy = clone(est)
    assert copy is not est
    assert copy.get_params(deep=False) == est.get_params(deep=False)
    assert copy.get_params(deep=True) == est.get_params(deep=True)
    assert copy.algorithm_params is not est.algorithm_params  # a deep copy
    # every parameter set to a non-default value survives
    custom = {"normalize": "none", "hidden": [32, 16], "epochs": 3, "max_train_seconds": 60.0,
              "ensemble": 2,
              "batch_size": 64, "lr": 0.5,
              "lr_warmup_epochs": 0.5, "lr_decay": 0.1, "keep_best": False, "back_to_best": False,
              "label_chunk": 7,
              "optimizer": "adagrad", "loss": "bce", "continue_probe": False,
              "output": "sampled", "negatives": 64,
              "negative_sampling": "frequency",
              "devices": "cpu,cpu", "algorithm": "average",
              "algorithm_params": {"merge_period": 512}, "seed": 7, "threads": 2,
              "eval_every": 0.5, "eval_k": 3, "neighbours": 10, "propensity_a": 0.6,
              "propensity_b": 2.6,
              "log_dir": "runs/x", "checkpoint_every": "60s"}
    assert set(custom) == set(PARAM_DEFAULTS)
    assert clone(XMCClassifier(**custom)).get_params(deep=False) == custom


def test_deep_params_and_set_params():
    est = XMCClassifier(algorithm="adaptive", algorithm_params={"merge_period": 2048})
    deep = est.get_params(deep=True)
    assert deep["algorithm_params__merge_period"] == 2048
    assert "algorithm_params__rule" in deep  # the option's default, from AdaptiveConfig
    given = est.algorithm_params
    assert est.set_params(algorithm_params__merge_period=4096, lr=0.1) is est
    assert est.algorithm_params == {"merge_period": 4096} and est.lr == 0.1
    assert given == {"merge_period": 2048}  # the caller's dict is not modified
    with pytest.raises(ValueError, match="algorithm_params__no_such_option"):
        est.set_params(algorithm_params__no_such_option=1)
    with pytest.raises(ValueError, match="invalid parameter 'hiden'"):
        est.set_params(hiden=3)
    with pytest.raises(TypeError, match="hiden"):
        XMCClassifier(hiden=3)
    # a new algorithm in the same call decides which options are valid
    est.set_params(algorithm="average", algorithm_params__merge_period=64)
    assert est.get_params()["algorithm_params__merge_period"] == 64
    with pytest.raises(ValueError, match="'easgd' has the options alpha"):
        est.set_params(algorithm="easgd", algorithm_params__merge_period=64)
    assert est.algorithm == "average"  # nothing set when a parameter is refused


def test_bad_parameter_fails_in_fit_naming_it():
    est = XMCClassifier(lr=-1.0)  # stored as given
    assert est.lr == -1.0
    X = sp.random(10, 5, density=0.5, format="csr", random_state=0)
    Y = sp.csr_matrix(np.eye(10, 3))
    with pytest.raises(ConfigError, match="lr"):
        est.fit(X, Y)


def test_repr_shows_the_changed_parameters():
    assert repr(XMCClassifier()) == "XMCClassifier()"
    assert repr(XMCClassifier(lr=0.1, hidden=[64])) == "XMCClassifier(hidden=[64], lr=0.1)"


@pytest.fixture(scope="module")
def bibtex(data_dir):
    from xmc_engine.datasets import load_dataset

    real_dataset(data_dir, "bibtex")  # skips with a reason when absent
    X, Y, Xt, Yt = load_dataset(str(data_dir / "bibtex"))
    rows = np.random.default_rng(0).choice(X.shape[0], 2000, replace=False)
    return X[rows], Y[rows], Xt, Yt


def test_grid_search_on_bibtex_tunes_a_nested_option(bibtex):
    """2x2 grid over lr and the Adaptive SGD merge period (a nested parameter), 2-fold CV on
    2,000 rows of bibtex; ``score`` (P@1) ranks the candidates."""
    X, Y, Xt, Yt = bibtex
    base = XMCClassifier(epochs=2, batch_size=64, optimizer="adagrad", threads=1, eval_every=0,
                         algorithm="adaptive", devices="cpu,cpu")
    grid = {"lr": [0.02, 0.002], "algorithm_params__merge_period": [256, 2048]}
    gs = GridSearchCV(base, grid, cv=2).fit(X, Y)
    scores = gs.cv_results_["mean_test_score"]
    assert len(scores) == 4 and np.all((scores >= 0) & (scores <= 1))
    assert scores.max() - scores.min() > 0.05  # the grid matters: the candidates differ
    best = gs.best_estimator_
    assert best.algorithm_params["merge_period"] == gs.best_params_[
        "algorithm_params__merge_period"]
    popular = int(np.asarray(Y.sum(axis=0)).argmax())
    assert gs.score(Xt, Yt) > float(Yt[:, popular].mean()) + 0.1


def _docs():
    topics = {"sports": "match goal team score league player coach",
              "science": "atom energy physics experiment theory particle lab",
              "cooking": "recipe oven flour sugar bake butter taste"}
    rng = np.random.default_rng(0)
    docs, tags = [], []
    for i in range(120):
        chosen = [t for t in topics if rng.random() < 0.5] or ["sports"]
        words = " ".join(" ".join(rng.choice(topics[t].split(), size=4)) for t in chosen)
        docs.append(f"doc{i} {words}")
        tags.append(chosen)
    return docs, tags


def test_text_pipeline_and_cross_val_score():
    docs, tags = _docs()
    Y = MultiLabelBinarizer().fit_transform(tags)  # dense 0/1, accepted as is
    pipe = Pipeline([("tfidf", TfidfVectorizer()),
                     ("clf", XMCClassifier(hidden=16, epochs=20, batch_size=16, lr=0.5,
                                           threads=1, eval_every=0))])
    pipe.fit(docs[:90], Y[:90])
    pred = pipe.predict(docs[90:])
    assert sp.issparse(pred) and pred.shape == (30, 3)
    assert pipe.score(docs[90:], Y[90:]) > 0.9  # P@1
    assert f1_score(Y[90:], pred.toarray(), average="micro") > 0.5  # usable by sklearn.metrics
    scores = cross_val_score(pipe, docs, Y, cv=3)
    assert scores.shape == (3,) and scores.min() > 0.8


def test_label_representations_give_equal_predictions():
    docs, tags = _docs()
    X = TfidfVectorizer().fit_transform(docs)
    Y = MultiLabelBinarizer().fit_transform(tags)
    est = XMCClassifier(hidden=8, epochs=2, batch_size=16, threads=1)
    preds = [est.fit(X, y).predict(X, k=2).toarray()
             for y in (Y, sp.csr_matrix(Y), Y.tolist(), list(Y), Y.astype(bool))]
    for p in preds[1:]:
        np.testing.assert_array_equal(p, preds[0])
