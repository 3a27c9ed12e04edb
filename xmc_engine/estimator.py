"""``XMCClassifier``: the scikit-learn estimator surface of the engine (STYLE.md "Estimator
surface").

``fit(X, Y)`` trains a sparse-input MLP (:mod:`xmc_engine.model`) with one of the algorithms of
DESIGN.md §4 on the devices of a spec string. ``predict`` returns a 0/1 indicator matrix,
``predict_proba`` / ``decision_function`` the top-k probabilities / logits as sparse rows (with
the neighbour votes of ``neighbours``, the blend's scores for both),
``score`` P@1, ``predict_topk`` the top-k labels and scores as dense arrays; ``save(dir)`` /
``XMCClassifier.load(dir)`` store a folder with ``config.json`` and ``params.npz`` (no pickle).

The estimator's parameters are the fields of :class:`~xmc_engine.config.TrainConfig` plus the
run folder options (``log_dir``, ``checkpoint_every``); they are read from the dataclass when
this module is imported, so a field added to the config is a parameter here too. scikit-learn is
not a dependency: ``get_params``, ``set_params`` and ``__sklearn_tags__`` follow its protocol
without importing it (the tags import it when scikit-learn asks for them).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import numbers
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmc_engine.config import ALGORITHMS, EVAL_ROWS, TRAIN_LOSSES, TrainConfig
from xmc_engine.errors import CheckpointError, ConfigError
from xmc_engine.model import ModelShape, fitted_hidden, predict_topk
from xmc_engine.validation import check_k, check_X, check_Y, normalize_rows, parse_every

logger = logging.getLogger(__name__)

MODEL_FORMAT = "xmc-engine-model/1"

#: Most logits (rows x labels) held at once when every label's score is needed (64 MB float32).
LOGIT_BLOCK = 1 << 24

#: The nested parameter holding the algorithm's options (``algorithm_params__merge_period``).
NESTED = "algorithm_params"


def _signature_default(f: dataclasses.Field):
    """The estimator's default for config field ``f``: the field's default, a list default as a
    tuple, and ``None`` (the config's own default, taken in ``fit``) for other mutable ones."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is dataclasses.MISSING:  # a required field: fit will say so
        return None
    value = f.default_factory()
    return tuple(value) if isinstance(value, list) else None


CONFIG_FIELDS = dataclasses.fields(TrainConfig)

#: Parameter name -> default, in signature order: the config's fields, then the run folder.
PARAM_DEFAULTS = {f.name: _signature_default(f) for f in CONFIG_FIELDS}
PARAM_DEFAULTS.update(log_dir=None, checkpoint_every=None)


def _option_defaults(algorithm) -> dict | None:
    """Options of ``algorithm`` with their defaults (the fields of its options dataclass,
    :data:`xmc_engine.config.ALGORITHMS`), or ``None`` when the name is not an algorithm (``fit``
    refuses it)."""
    cls = ALGORITHMS.get(algorithm) if isinstance(algorithm, str) else None
    if cls is None:
        return None
    return dataclasses.asdict(cls())


def _equal(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except (TypeError, ValueError):  # arrays and other values without a truth value
        return False


def _rows_matrix(labels: np.ndarray, values: np.ndarray, n_labels: int) -> sp.csr_matrix:
    """CSR ``(n_samples, n_labels)`` holding ``values[i, j]`` at column ``labels[i, j]``;
    explicit zeros are kept (a logit or probability of 0 is a score, not a missing entry)."""
    n, k = labels.shape
    M = sp.csr_matrix((values.ravel(), labels.ravel(), np.arange(0, n * k + 1, k)),
                      shape=(n, n_labels))
    M.sort_indices()
    return M


class XMCClassifier:
    """Extreme multi-label classifier: a sparse-input MLP trained with (Adaptive) SGD.

    Every parameter is keyword-only, stored unmodified by ``__init__`` and validated by
    ``fit`` (``ConfigError``, a ``ValueError``, naming the parameter).

    Parameters
    ----------
    hidden : int or sequence of int, default (128,)
        Hidden layer widths (first layer sparse, the rest dense).
    epochs, batch_size : training length, base batch size ``B``.
    max_train_seconds : float or None
        Stop once this much training time has passed (evaluation excluded; ``None``: all
        ``epochs``), at the first merge barrier after it.
    ensemble : int, default 1
        Networks trained (each for ``epochs``, with its own seed; side by side, a core each,
        on one CPU device of several cores where that is faster) and combined into one
        of that many times the hidden width whose logits are the mean of theirs
        (:attr:`xmc_engine.config.TrainConfig.ensemble`): P@3 / P@5 rise on every shared
        dataset, at that many times the training samples.
    lr : float or None
        Base learning rate; ``None``: the optimizer's default
        (:data:`xmc_engine.config.DEFAULT_LR`: 0.05 for Adagrad, 2.0 for SGD; with
        ``loss="bce"`` :data:`~xmc_engine.config.DEFAULT_LR_BCE`: 0.1 for Adagrad).
    lr_warmup_epochs, lr_decay : linear warm-up length; decay ``lr0 / (1 + λ (e - e_warm))``;
        the schedule of every algorithm (``lr_warmup_epochs=None``: the algorithm's own,
        none by default). ``lr_decay="plateau"``: the rate halves after every epoch whose P@1
        on 2,000 training rows held out of training is not above the best so far, and
        training stops once it is below 1/32 of the base
        (:data:`xmc_engine.config.PLATEAU_STOP_SCALE`);
        ``"auto"`` (the default): ``"plateau"`` with Adagrad from
        :data:`xmc_engine.config.PLATEAU_MIN_ROWS` training rows, else the optimizer's fixed
        decay, or none where ``loss="auto"``'s probe found the softmax clearly ahead
        (:data:`xmc_engine.config.PROBED_SOFTMAX_DECAY`); ``None``: that fixed decay,
        :data:`xmc_engine.config.DEFAULT_LR_DECAY` (0.5 for
        Adagrad, 0 for SGD).
    keep_best : bool, default True
        With the plateau schedule (held-out rows): the fitted model is that of the epoch with
        the best held-out P@1 where the last model is behind it by more than
        :data:`xmc_engine.config.KEEP_BEST_Z` standard errors; ``False`` keeps the last one.
    back_to_best : bool, default True
        With the plateau schedule: where an epoch lowers the rate and left the model behind
        the best epoch's on the held-out rows by more than
        :data:`xmc_engine.config.BACK_TO_BEST_Z` standard errors (``BACK_TO_BEST_STALE_Z``
        once the best epoch is two or more epochs old), training goes on from the best
        epoch's model at the lowered rate; ``False`` goes on from the last one.
    label_chunk : int or None
        Output-layer label chunk; ``None`` keeps the ``B x n_labels`` logits in memory.
    optimizer : {"adagrad", "sgd"}
        Adagrad (the default: per-parameter accumulators, row-sparse for ``W1``; each replica
        keeps its own, merges average parameters only) or plain SGD (the paper's).
    loss : {"softmax", "bce", "auto"}
        Training loss: the softmax cross-entropy against ``y/|y|``, the one-vs-all logistic
        loss, or ``"auto"`` (the default): a short probe of each on the start of the run's
        first epoch picks one by P@1 on the rows that come next, the logistic loss unless the
        softmax is clearly ahead
        (:func:`xmc_engine.training.choose_loss`; the fitted choice is ``loss_``)
        (:attr:`xmc_engine.config.TrainConfig.loss`).
    continue_probe : bool, default True
        With ``loss="auto"`` (in one process): training goes on from the probe's winning
        fit (its model and Adagrad state on every device, its samples and training time)
        rather than starting over: on one device and one thread the same model, without
        training the fit's rows twice; ``False`` starts every run from the initialisation.
    output : {"exact", "sampled", "auto"}
        Output layer of training: the softmax over every label, or over the batch's positives
        plus ``negatives`` sampled labels (prediction is exact either way); ``"auto"`` picks
        from the data's shape (:meth:`xmc_engine.config.TrainConfig.output_for`).
    normalize : {"l2", "none"}
        Feature rows scaled to unit Euclidean norm before training and prediction (the
        default), or taken as given.
    negatives : int
        Negatives per batch of ``output="sampled"``.
    negative_sampling : {"frequency", "uniform", "lsh"}
        How ``output="sampled"`` draws them: by label frequency (the default), uniformly, or
        half from the labels whose ``W2`` column hashes near a positive's.
    devices : str
        Device spec, e.g. ``"cpu"``, ``"cpu,cpu@0.5"``, ``"cuda:0,cuda:0"``, ``"auto"``.
    algorithm : str
        ``"single"`` (one device), ``"adaptive"`` (Adaptive SGD), ``"average"`` (the paper's GD),
        ``"sync"``, ``"easgd"``, ``"crossbow"`` (DESIGN.md §4).
    algorithm_params : dict or None
        Options of the algorithm (see :mod:`xmc_engine.algorithms`); ``None``: all defaults.
        Each option is also a nested parameter ``algorithm_params__<option>`` of
        ``get_params(deep=True)`` / ``set_params``, so a grid search can tune it.
    seed : int
        Seeds initialisation and shuffling; a one-device run with a fixed ``threads`` repeats
        exactly.
    threads : int or None
        CPU threads (None: all cores, split over the CPU devices, calibrated per run).
    eval_every : float
        Evaluate on ``eval_set`` every this many epochs (0: only at the end).
    eval_k : int
        Largest cut-off of the evaluation metrics, and the number of scores per row that
        ``predict_proba`` and ``decision_function`` return by default.
    neighbours : int or "auto"
        Predictions blend the network's probabilities with the labels of the ``neighbours``
        training rows nearest each row in the network's last hidden layer, and as many in the
        features (:mod:`xmc_engine.neighbours`); the fitted model keeps its training rows for
        it (``neighbours_``, saved with it). 0: the network alone. ``"auto"`` (the default):
        25 (:data:`xmc_engine.config.NEIGHBOURS_K`) where the model trained the logistic loss,
        or a softmax the loss probe found ahead by fewer than 6 standard errors
        (:data:`xmc_engine.config.NEIGHBOURS_SOFTMAX_Z`), on up to 100,000 rows
        (:data:`xmc_engine.config.NEIGHBOURS_MAX_ROWS`), else 0.
        Evaluations during ``fit`` score the network alone; ``metrics_`` and every
        prediction after it, the blend.
    propensity_a, propensity_b : float
        Constants of the Jain et al. label propensities behind PSP@k and PSnDCG@k.
    log_dir : str or None
        Folder for ``log.jsonl`` and checkpoints.
    checkpoint_every : int or str or None
        Checkpoint every N samples (``20000``) or seconds (``"60s"``); needs ``log_dir``.

    Attributes
    ----------
    n_features_, n_labels_ : int
        Shape of the training data (``n_features_in_`` is scikit-learn's name of the first).
    params_ : list of numpy.ndarray
        float32, host, the order of :mod:`xmc_engine.model`; with ``ensemble`` > 1 the
        combined network, whose hidden widths are the members' summed.
    history_ : list of dict
        The run-log records of the last ``fit``.
    metrics_ : dict or None
        The last evaluation on ``eval_set`` (with ``neighbours_``, of the blend; the run log's
        ``neighbours`` record also has the network alone's).
    neighbours_ : xmc_engine.neighbours.NeighbourIndex or None
        The training rows predictions vote with (``neighbours``); ``None``: the network
        alone.
    label_frequency_ : numpy.ndarray
        int64 ``(n_labels,)``: training rows per label (for the propensities).
    n_train_ : int
        Training rows.
    loss_ : {"softmax", "bce"}
        The loss the model was trained with (``loss``, or what ``loss="auto"`` chose).

    Notes
    -----
    ``X`` and ``Y`` may be sparse or dense, of any real dtype; :mod:`xmc_engine.validation`
    says what is accepted and how it is normalised.
    """

    def __init__(self, **params):
        unknown = sorted(set(params) - set(PARAM_DEFAULTS))
        if unknown:
            raise TypeError(f"XMCClassifier got unexpected parameter(s) {', '.join(unknown)}; "
                            f"valid: {', '.join(PARAM_DEFAULTS)}")
        for name, default in PARAM_DEFAULTS.items():
            setattr(self, name, params.get(name, default))

    # -- the scikit-learn parameter protocol ----------------------------------------------------
    def get_params(self, deep: bool = True) -> dict:
        """Parameters of this estimator.

        Parameters
        ----------
        deep : bool
            Also list each option of the chosen algorithm as ``algorithm_params__<option>``:
            the value in ``algorithm_params`` or else the option's default.

        Returns
        -------
        dict
        """
        params = {name: getattr(self, name) for name in PARAM_DEFAULTS}
        if deep:
            options = _option_defaults(self.algorithm) or {}
            if isinstance(self.algorithm_params, dict):
                options.update(self.algorithm_params)
            params.update({f"{NESTED}__{key}": value for key, value in options.items()})
        return params

    def set_params(self, **params) -> XMCClassifier:
        """Set parameters; ``algorithm_params__<option>=v`` sets one algorithm option.

        The options go into a new dict (the one passed to ``__init__`` is never modified) and
        are checked against the options of ``algorithm`` (after any new ``algorithm`` of the
        same call is set) when that is a registered algorithm.

        Returns
        -------
        XMCClassifier
            ``self``.

        Raises
        ------
        ValueError
            For an unknown parameter or algorithm option.
        """
        plain, nested = {}, {}
        for key, value in params.items():
            name, sep, option = key.partition("__")
            if name not in PARAM_DEFAULTS or (sep and name != NESTED):
                raise ValueError(f"invalid parameter {key!r} for XMCClassifier; valid: "
                                 f"{', '.join(PARAM_DEFAULTS)} and {NESTED}__<option>")
            (nested if sep else plain)[option if sep else name] = value
        if nested:
            algorithm = plain.get("algorithm", self.algorithm)
            known = _option_defaults(algorithm)
            unknown = sorted(set(nested) - set(known or {}))
            if known is not None and unknown:
                names = ", ".join(f"{NESTED}__{u}" for u in unknown)
                raise ValueError(f"invalid parameter(s) {names}: algorithm {algorithm!r} "
                                 f"has the options {', '.join(sorted(known))}")
            current = plain.get(NESTED, self.algorithm_params)
            plain[NESTED] = {**(current if isinstance(current, dict) else {}), **nested}
        for name, value in plain.items():
            setattr(self, name, value)
        return self

    def __sklearn_tags__(self):
        """scikit-learn's tags: a multi-label classifier of 2-D (sparse or dense) input that
        needs a 2-D 0/1 indicator target (``single_output=False``); a multi-class class vector
        is refused (``multi_class=False``: binarise it first)."""
        from sklearn.utils import ClassifierTags, InputTags, Tags, TargetTags

        return Tags(estimator_type="classifier",
                    target_tags=TargetTags(required=True, two_d_labels=True, multi_output=True,
                                           single_output=False),
                    classifier_tags=ClassifierTags(multi_class=False, multi_label=True),
                    input_tags=InputTags(sparse=True))

    def __repr__(self) -> str:
        changed = [f"{name}={value!r}" for name, value in self.get_params(deep=False).items()
                   if not _equal(value, PARAM_DEFAULTS[name])]
        return f"XMCClassifier({', '.join(changed)})"

    # -- configuration --------------------------------------------------------------------------
    def get_config(self) -> TrainConfig:
        """The :class:`TrainConfig` of the current parameters (validated; ``ConfigError``)."""
        kwargs = {}
        for f in CONFIG_FIELDS:
            value = getattr(self, f.name)
            if value is None and f.default is dataclasses.MISSING:
                continue  # None stands for the config's own (mutable) default
            kwargs[f.name] = dict(value) if isinstance(value, dict) else value
        try:
            return TrainConfig(**kwargs)
        except TypeError as exc:  # a comparison in the config's checks met a wrong type
            raise ConfigError(f"XMCClassifier: a parameter has the wrong type ({exc}); "
                              f"given {kwargs}") from None

    @classmethod
    def from_config(cls, cfg: TrainConfig, **kwargs) -> XMCClassifier:
        """An estimator with the fields of ``cfg`` as parameters (``kwargs``: the others)."""
        return cls(**cfg.to_dict(), **kwargs)

    # -- training -------------------------------------------------------------------------------
    def fit(self, X, Y, eval_set=None, *, resume: bool = False) -> XMCClassifier:
        """Train on ``X`` and the 0/1 label matrix ``Y``.

        Parameters
        ----------
        X : sparse matrix or 2-D array-like, shape (n_samples, n_features)
        Y : sparse matrix or 2-D array-like, shape (n_samples, n_labels), values 0/1
        eval_set : pair (X_test, Y_test), optional
            Evaluated every ``eval_every`` epochs (time excluded from ``train_time``).
        resume : bool
            Continue from the newest valid checkpoint in ``log_dir``.

        Returns
        -------
        XMCClassifier
            ``self``.
        """
        from xmc_engine.training import fit_model

        cfg = self.get_config()
        every = parse_every(self.checkpoint_every)
        X = check_X(X, min_samples=1)
        Y = check_Y(Y, X.shape[0])
        if eval_set is not None:
            if not isinstance(eval_set, (tuple, list)) or len(eval_set) != 2:
                raise ValueError("eval_set must be a pair (X_test, Y_test), got "
                                 f"{type(eval_set).__name__}")
            Xt = check_X(eval_set[0], X.shape[1], name="X_test")
            Yt = check_Y(eval_set[1], Xt.shape[0], Y.shape[1], name="Y_test", x_name="X_test")
            eval_set = (Xt, Yt)
        result = fit_model(cfg, X, Y, eval_set, log_dir=self.log_dir, checkpoint_every=every,
                           resume=resume)
        self.n_features_, self.n_labels_ = X.shape[1], Y.shape[1]
        self.params_ = result["params"]
        self.history_ = result["history"]
        self.metrics_ = result.get("metrics")
        # Global over the nodes of a multi-node run (each rank holds only its rows).
        self.label_frequency_ = np.asarray(result.get("label_counts", Y.sum(axis=0))).ravel() \
            .astype(np.int64)
        self.n_train_ = int(result.get("n_train", X.shape[0]))
        self.loss_ = result["loss"]
        self.neighbours_ = None
        self._fit_neighbours(cfg, X, Y, eval_set, processes=int(result.get("processes", 1)))
        return self

    def _fit_neighbours(self, cfg: TrainConfig, X, Y, eval_set, *, processes: int = 1) -> None:
        """Keep the training rows for the neighbour votes (``neighbours``), and score the
        blend on ``eval_set`` (``metrics_``; the network alone's stays in the run log's
        ``eval`` records): a ``neighbours`` record in ``history_`` and the run log."""
        import time

        from xmc_engine.neighbours import NeighbourIndex, host_hidden

        probe = next((r for r in self.history_ if r.get("event") == "loss_probe"), None)
        k, why = cfg.neighbours_decision(self.n_train_, self.loss_,
                                         None if probe is None else probe.get("z"))
        if k == 0:
            return
        if processes > 1:  # each process (MPI rank) holds only its own rows
            logger.warning("neighbours=%s: off in a run over %d processes (this one holds %d "
                           "of the training rows)", cfg.neighbours, processes, X.shape[0])
            return
        t0 = time.perf_counter()
        Xn = self._features(X)
        self.neighbours_ = NeighbourIndex(Xn, host_hidden(self.params_, Xn), Y, k)
        seconds = time.perf_counter() - t0
        network = self.metrics_
        if eval_set is not None:
            self.metrics_ = self.evaluate(*eval_set)
        record = {"k": k, "why": why, "rows": self.neighbours_.n_rows, "seconds": seconds,
                  "network": network, "metrics": self.metrics_ if eval_set is not None else None,
                  "eval_time": time.perf_counter() - t0 - seconds}
        if self.log_dir is not None:
            from xmc_engine.runlog import RunLog

            with RunLog(self.log_dir) as log:
                self.history_.append(log.write("neighbours", **record))
        else:
            self.history_.append({"event": "neighbours", **record})

    @property
    def n_features_in_(self) -> int:
        """scikit-learn's name of ``n_features_``."""
        return self.n_features_

    # -- inference ------------------------------------------------------------------------------
    def _check_fitted(self):
        if not hasattr(self, "params_"):
            raise RuntimeError("this XMCClassifier is not fitted yet; call fit() or load()")

    def _inference_backend(self):
        from xmc_engine.backends import get_backend

        return get_backend(getattr(self, "_backend_name", "cpu"), threads=self.threads)

    @property
    def _votes(self):
        """The :class:`~xmc_engine.neighbours.NeighbourIndex` predictions vote with, or
        ``None`` (the network alone; also a model fitted or loaded before the votes existed)."""
        return getattr(self, "neighbours_", None)

    def _topk(self, X: sp.csr_matrix, k: int, row_chunk: int = EVAL_ROWS):
        """:meth:`predict_topk` on an already validated ``X``."""
        if self._votes is not None:  # on the host's cores, ``threads`` of them where given
            from xmc_engine.backends import get_backend

            with get_backend("cpu", threads=self.threads).thread_budget():
                return self._votes.blend_topk(self.params_, self.loss_, X, k, row_chunk)
        be = self._inference_backend()
        params = [be.asarray(p) for p in self.params_]
        return predict_topk(be, params, X, k, row_chunk=row_chunk, label_chunk=self.label_chunk)

    def _features(self, X) -> sp.csr_matrix:
        """``X`` validated against the fitted model and normalised as in training
        (``normalize``): the rows the model computes on."""
        return normalize_rows(check_X(X, self.n_features_), self.normalize)

    def predict_topk(self, X, k: int = 5, *, row_chunk: int = EVAL_ROWS):
        """Top-``k`` labels and scores per row.

        Parameters
        ----------
        X : sparse matrix or 2-D array-like, shape (n_samples, n_features)
        k : int
            Labels per row (``>= 1``); more than ``n_labels_`` gives all of them.
        row_chunk : int
            Rows scored at once.

        Returns
        -------
        labels : numpy.ndarray (n_samples, min(k, n_labels_)) int64, by descending score
        scores : numpy.ndarray (n_samples, min(k, n_labels_)) float32: the network's logits,
            or, where the model votes with its training rows (``neighbours_`` is not
            ``None``), the blended scores in ``[0, 1]`` (:mod:`xmc_engine.neighbours`)
        """
        self._check_fitted()
        k = check_k(k)
        row_chunk = check_k(row_chunk, "row_chunk")
        return self._topk(self._features(X), k, row_chunk)

    def _log_normaliser(self, X: sp.csr_matrix) -> np.ndarray:
        """``log sum_l exp(z_l)`` per row of validated ``X`` (float64, host).

        The engine's prediction keeps only the top-k logits, so the softmax normaliser is
        computed here on the host with the forward of :mod:`xmc_engine.model` (ReLU hidden
        layers, linear output), in blocks of at most ``LOGIT_BLOCK`` logits.
        """
        from xmc_engine.neighbours import host_hidden, host_logits

        out = np.empty(X.shape[0], dtype=np.float64)
        rows = max(1, LOGIT_BLOCK // self.n_labels_)
        for start in range(0, X.shape[0], rows):
            H = host_hidden(self.params_, X[start:start + rows])
            Z = host_logits(self.params_, H).astype(np.float64)
            m = Z.max(axis=1)
            out[start:start + rows] = m + np.log(np.exp(Z - m[:, None]).sum(axis=1))
        return out

    def _k_or_eval_k(self, k) -> int:
        return check_k(self.eval_k if k is None else k)

    def decision_function(self, X, *, k: int | None = None) -> sp.csr_matrix:
        """The top-``k`` logits of every row as a sparse matrix.

        Parameters
        ----------
        X : sparse matrix or 2-D array-like, shape (n_samples, n_features)
        k : int, optional
            Scores kept per row (default ``eval_k``).

        Returns
        -------
        scipy.sparse.csr_matrix, float32, shape (n_samples, n_labels_)
            Entry ``(i, l)`` is label ``l``'s logit (with ``neighbours_``: its blended score,
            as :meth:`predict_topk`) when ``l`` is among row ``i``'s top ``k``; the other
            entries are not stored (they are lower, not zero).
        """
        labels, scores = self.predict_topk(X, self._k_or_eval_k(k))
        return _rows_matrix(labels, scores, self.n_labels_)

    def predict_proba(self, X, *, k: int | None = None) -> sp.csr_matrix:
        """The top-``k`` probabilities of every row as a sparse matrix.

        With ``loss="softmax"`` the model is trained with a softmax over all labels, so a row's
        probabilities over all ``n_labels_`` labels sum to 1 and the stored top ``k`` sum to at
        most 1. With ``loss="bce"`` each label's probability is its own sigmoid (they need not
        sum to 1). Where the model votes with its training rows (``neighbours_``), a label's
        probability is the blend of the network's with the neighbours' votes
        (:mod:`xmc_engine.neighbours`), which need not sum to 1 either.

        Parameters
        ----------
        X : sparse matrix or 2-D array-like, shape (n_samples, n_features)
        k : int, optional
            Probabilities kept per row (default ``eval_k``).

        Returns
        -------
        scipy.sparse.csr_matrix, float32, shape (n_samples, n_labels_)
        """
        self._check_fitted()
        k = self._k_or_eval_k(k)
        X = self._features(X)
        labels, scores = self._topk(X, k)
        return _rows_matrix(labels, self._probabilities(X, scores), self.n_labels_)

    def _probabilities(self, X, scores) -> np.ndarray:
        """The probabilities of the logits ``scores`` (rows of validated ``X``) under the
        fitted loss: softmax over all labels, or each label's sigmoid; with ``neighbours_``
        ``scores`` are the blend's, probabilities already."""
        if self._votes is not None:
            return np.asarray(scores, dtype=np.float32)
        if self.loss_ == "bce":
            return (0.5 * (1.0 + np.tanh(0.5 * scores.astype(np.float64)))).astype(np.float32)
        return np.exp(scores - self._log_normaliser(X)[:, None]).astype(np.float32)

    def predict(self, X, *, k: int | None = None, threshold: float | None = None):
        """Predicted labels as a 0/1 indicator matrix (usable by ``sklearn.metrics``).

        Parameters
        ----------
        X : sparse matrix or 2-D array-like, shape (n_samples, n_features)
        k : int, optional
            Without ``threshold``: the ``k`` best labels of each row (default 1, the label
            that P@1, :meth:`score`, rates). With it: look only at the ``k`` best.
        threshold : float in (0, 1], optional
            Keep the labels whose probability (:meth:`predict_proba`) is at least
            ``threshold``: none, one or several per row; with ``loss="softmax"`` at most
            ``1 / threshold``, since the probabilities sum to 1; with ``loss="bce"`` or with
            ``neighbours_`` every label that reaches it (the top-k search widens until a row's
            last score is below).

        Returns
        -------
        scipy.sparse.csr_matrix, float32 ones, shape (n_samples, n_labels_)
        """
        if threshold is None:
            labels, _ = self.predict_topk(X, 1 if k is None else k)
            return _rows_matrix(labels, np.ones(labels.shape, np.float32), self.n_labels_)
        if (isinstance(threshold, bool) or not isinstance(threshold, numbers.Real)
                or not 0 < threshold <= 1):
            raise ValueError(f"threshold must be a probability in (0, 1], got {threshold!r}")
        if self.loss_ == "bce" or self._votes is not None:
            P = self._proba_reaching(X, threshold, None if k is None else check_k(k))
        else:
            most = int(1.0 / threshold)  # more labels cannot all reach the threshold
            P = self.predict_proba(X, k=most if k is None else min(check_k(k), most))
        P.data = (P.data >= threshold).astype(np.float32)
        P.eliminate_zeros()
        return P

    def _proba_reaching(self, X, threshold: float, k: int | None) -> sp.csr_matrix:
        """:meth:`predict_proba` of a ``loss="bce"`` model (or one with ``neighbours_``) with
        ``k`` large enough to hold every label whose probability reaches ``threshold`` (``k``
        given: at most that many)."""
        self._check_fitted()
        X = self._features(X)
        width = min(self.n_labels_, k or max(2 * self.eval_k, 8))
        while True:
            labels, scores = self._topk(X, width)
            probs = self._probabilities(X, scores)
            if k is not None or width >= self.n_labels_ or not (probs[:, -1] >= threshold).any():
                return _rows_matrix(labels, probs, self.n_labels_)
            width = min(self.n_labels_, 4 * width)

    def score(self, X, Y, *, metric: str = "P@1") -> float:
        """A top-k metric on ``(X, Y)``, higher is better (scikit-learn's ``score``).

        Parameters
        ----------
        X : sparse matrix or 2-D array-like, shape (n_samples, n_features)
        Y : sparse matrix or 2-D array-like, shape (n_samples, n_labels_), values 0/1
        metric : str
            A key of :meth:`evaluate`'s result: ``"P@k"``, ``"nDCG@k"``, ``"R@k"``,
            ``"PSP@k"`` or ``"PSnDCG@k"`` for any ``k >= 1``.

        Returns
        -------
        float
        """
        name, _, at = str(metric).partition("@")
        if not at.isdigit() or int(at) < 1:
            raise ValueError(f"metric={metric!r}: expected a name and a cut-off, e.g. 'P@1', "
                             "'nDCG@5', 'PSP@3', 'R@5'")
        result = self.evaluate(X, Y, ks=(int(at),))
        if metric not in result:
            raise ValueError(f"metric={metric!r}: not one of {', '.join(result)}")
        return result[metric]

    def evaluate(self, X, Y, ks=(1, 3, 5)) -> dict[str, float]:
        """P@k, nDCG@k, R@k, PSP@k and PSnDCG@k on ``(X, Y)``.

        The propensity-scored metrics are left out (with a warning) for a model trained on
        fewer than 3 rows, where the Jain et al. propensities are undefined.

        Parameters
        ----------
        X : sparse matrix or 2-D array-like, shape (n_samples, n_features)
        Y : sparse matrix or 2-D array-like, shape (n_samples, n_labels_), values 0/1
        ks : int or iterable of int
            Cut-offs, each ``>= 1``.

        Returns
        -------
        dict of str to float
        """
        from xmc_engine.metrics import TopKMetrics, jain_propensity

        self._check_fitted()
        ks = (ks,) if isinstance(ks, numbers.Integral) else tuple(ks)
        ks = tuple(check_k(k, "ks") for k in ks)
        if not ks:
            raise ValueError("ks must hold at least one cut-off")
        X = self._features(X)
        Y = check_Y(Y, X.shape[0], self.n_labels_)
        prop = None
        if self.n_train_ >= 3:
            prop = jain_propensity(self.label_frequency_, n_samples=self.n_train_,
                                   A=self.propensity_a, B=self.propensity_b)
        else:
            logger.warning("PSP@k and PSnDCG@k left out: propensities need at least 3 training "
                           "rows, this model saw %d", self.n_train_)
        m = TopKMetrics(ks=ks, propensity=prop)
        labels, _ = self._topk(X, max(ks))
        m.update(labels, Y)
        return m.result()

    # -- devices --------------------------------------------------------------------------------
    def to_cpu(self) -> XMCClassifier:
        """Run inference on the CPU backend (parameters always stay on the host here)."""
        self._backend_name = "cpu"
        return self

    def to_gpu(self) -> XMCClassifier:
        """Run the network's inference on CUDA device 0 (raises if no usable CUDA device);
        the neighbour votes (``neighbours_``) run on the host either way."""
        from xmc_engine.backends import get_backend

        get_backend("cuda")  # raises BackendUnavailableError with the fix
        self._backend_name = "cuda"
        return self

    # -- persistence ----------------------------------------------------------------------------
    def save(self, path) -> Path:
        """Write ``config.json`` + ``params.npz`` into folder ``path`` (atomically)."""
        from xmc_engine.checkpoint import save_model_dir

        self._check_fitted()
        cfg = self.get_config()
        # the widths of the fitted network: an ensemble's are its members' summed
        shape = ModelShape(self.n_features_, self.n_labels_, fitted_hidden(self.params_))
        config = {
            "format": MODEL_FORMAT,
            "train_config": cfg.to_dict(),
            "fitted_loss": self.loss_,  # what loss="auto" chose (or the loss given)
            "n_features": self.n_features_,
            "n_labels": self.n_labels_,
            "n_train": int(self.n_train_),
            "param_names": shape.param_names,
            "fitted_hidden": list(shape.hidden),
        }
        arrays = dict(zip(shape.param_names, self.params_, strict=True))
        arrays["label_frequency"] = self.label_frequency_
        index = self._votes
        config["neighbours_k"] = 0 if index is None else index.k
        if index is not None:
            arrays.update(neighbours_X_indptr=index.X.indptr, neighbours_X_indices=index.X.indices,
                          neighbours_X_data=index.X.data, neighbours_E=index.E,
                          neighbours_Y_indptr=index.Y.indptr,
                          neighbours_Y_indices=index.Y.indices)
        save_model_dir(path, config, arrays)
        return Path(path)

    @classmethod
    def load(cls, path) -> XMCClassifier:
        """Load a folder written by :meth:`save`; never executes code from the files."""
        from xmc_engine.checkpoint import load_model_dir

        config, arrays = load_model_dir(path)
        if config.get("format") != MODEL_FORMAT:
            raise CheckpointError(f"{path}/config.json: format {config.get('format')!r} is not "
                                  f"{MODEL_FORMAT!r}")
        try:
            cfg = TrainConfig.from_saved(config["train_config"], source=f"{path}/config.json")
            # saved before ensembles: the config's widths are the network's
            hidden = config.get("fitted_hidden", cfg.hidden)
            if (not isinstance(hidden, list) or not hidden
                    or not all(isinstance(h, int) and not isinstance(h, bool) and h > 0
                                   for h in hidden)):
                raise CheckpointError(f"{path}/config.json: fitted_hidden {hidden!r} is not a "
                                      f"list of positive widths")
            shape = ModelShape(int(config["n_features"]), int(config["n_labels"]),
                               tuple(hidden))
            params = [np.asarray(arrays[n], dtype=np.float32) for n in shape.param_names]
        except KeyError as exc:
            raise CheckpointError(f"{path}: missing entry {exc}") from None
        for name, p, s in zip(shape.param_names, params, shape.param_shapes, strict=True):
            if p.shape != s:
                raise CheckpointError(f"{path}/params.npz: {name} has shape {p.shape}, "
                                      f"config says {s}")
        model = cls.from_config(cfg)
        model.n_features_, model.n_labels_ = shape.n_features, shape.n_labels
        model.params_ = params
        model.n_train_ = int(config.get("n_train", 0))
        model.loss_ = config.get("fitted_loss", cfg.loss)  # saved before "auto": the loss given
        if model.loss_ not in TRAIN_LOSSES:
            raise CheckpointError(f"{path}/config.json: fitted_loss {model.loss_!r} is not one "
                                  f"of {', '.join(TRAIN_LOSSES)}")
        freq = arrays.get("label_frequency")
        model.label_frequency_ = (np.asarray(freq, dtype=np.int64) if freq is not None
                                  else np.zeros(shape.n_labels, dtype=np.int64))
        model.neighbours_ = _load_neighbours(path, config, arrays, shape)
        return model


def _load_neighbours(path, config: dict, arrays: dict, shape: ModelShape):
    """The :class:`~xmc_engine.neighbours.NeighbourIndex` a saved model holds (``None``: saved
    without one, or before neighbours existed); ``CheckpointError`` where its arrays disagree."""
    from xmc_engine.neighbours import NeighbourIndex

    k = config.get("neighbours_k", 0)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise CheckpointError(f"{path}/config.json: neighbours_k {k!r} is not an integer >= 0")
    if k == 0:
        return None
    names = ("neighbours_X_indptr", "neighbours_X_indices", "neighbours_X_data", "neighbours_E",
             "neighbours_Y_indptr", "neighbours_Y_indices")
    missing = [n for n in names if n not in arrays]
    if missing:
        raise CheckpointError(f"{path}/params.npz: neighbours_k is {k} but "
                              f"{', '.join(missing)} missing")
    E = np.asarray(arrays["neighbours_E"], dtype=np.float32)
    n = E.shape[0] if E.ndim == 2 else -1
    try:
        X = sp.csr_matrix((arrays["neighbours_X_data"], arrays["neighbours_X_indices"],
                           arrays["neighbours_X_indptr"]), shape=(n, shape.n_features))
        Yi = arrays["neighbours_Y_indices"]
        Y = sp.csr_matrix((np.ones(len(Yi), np.float32), Yi, arrays["neighbours_Y_indptr"]),
                          shape=(n, shape.n_labels))
        X.check_format(full_check=True)
        Y.check_format(full_check=True)
        if E.ndim != 2 or E.shape[1] != shape.hidden[-1]:
            raise ValueError(f"neighbours_E has shape {E.shape}, the last hidden layer is "
                             f"{shape.hidden[-1]} wide")
        index = NeighbourIndex(X, E, Y, k, unit=True)
    except ValueError as exc:
        raise CheckpointError(f"{path}/params.npz: the neighbour rows are inconsistent "
                              f"({exc})") from None
    return index


def _init_signature() -> inspect.Signature:
    """``__init__(self, *, hidden=(128,), epochs=10, ...)``: what scikit-learn's ``clone`` and
    the estimator checks read, generated from :data:`PARAM_DEFAULTS`."""
    kw = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(name, kw, default=d) for name, d in PARAM_DEFAULTS.items()])


XMCClassifier.__init__.__signature__ = _init_signature()

__all__ = ["XMCClassifier", "MODEL_FORMAT"]
