"""``XMCClassifier``: the estimator surface of the engine (STYLE.md "Estimator surface").

``fit(X, Y)`` trains a sparse-input MLP (:mod:`xmc_engine.model`) with one of the algorithms of
DESIGN.md §4 on the devices of a spec string; ``predict_topk(X, k)`` returns the top-k labels
and scores; ``save(dir)`` / ``XMCClassifier.load(dir)`` store a folder with ``config.json`` and
``params.npz`` (no pickle).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmc_engine.config import TrainConfig
from xmc_engine.errors import CheckpointError, ConfigError
from xmc_engine.model import ModelShape, predict_topk

logger = logging.getLogger(__name__)

MODEL_FORMAT = "xmc-engine-model/1"


# -- input validation ------------------------------------------------------------------------
def _to_host_csr(M, name: str):
    """Accept SciPy sparse (any format) or CuPy CSR; return SciPy CSR."""
    if hasattr(M, "get") and type(M).__module__.startswith("cupyx"):
        M = M.get()
    if not sp.issparse(M):
        raise ValueError(f"{name} must be a scipy.sparse matrix (CSR preferred), "
                         f"got {type(M).__name__}")
    return M.tocsr()


def check_X(X, n_features: int | None = None, name: str = "X") -> sp.csr_matrix:
    """Validate a feature matrix: sparse, finite, numeric; returns canonical float32 CSR."""
    X = _to_host_csr(X, name)
    if X.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {X.shape}")
    if not np.issubdtype(X.dtype, np.number) or np.issubdtype(X.dtype, np.complexfloating):
        raise ValueError(f"{name} must have a real numeric dtype, got {X.dtype}")
    if n_features is not None and X.shape[1] != n_features:
        raise ValueError(f"{name} has {X.shape[1]} features, the model expects {n_features}")
    X = X.astype(np.float32, copy=False)
    if X.nnz and not np.isfinite(X.data).all():
        bad = int(np.flatnonzero(~np.isfinite(X.data))[0])
        row = int(np.searchsorted(X.indptr, bad, side="right") - 1)
        raise ValueError(f"{name} row {row}: non-finite value {X.data[bad]}")
    if not X.has_canonical_format:
        X = X.copy()
        X.sum_duplicates()
    return X


def check_Y(Y, n_samples: int, n_labels: int | None = None, name: str = "Y") -> sp.csr_matrix:
    """Validate a label matrix: sparse, binary (0/1), ``n_samples`` rows."""
    Y = _to_host_csr(Y, name)
    if Y.shape[0] != n_samples:
        raise ValueError(f"{name} has {Y.shape[0]} rows but X has {n_samples}")
    if n_labels is not None and Y.shape[1] != n_labels:
        raise ValueError(f"{name} has {Y.shape[1]} labels, the model expects {n_labels}")
    Y = Y.copy()
    Y.sum_duplicates()
    Y.eliminate_zeros()
    if Y.nnz and not np.all(Y.data == 1):
        bad = Y.data[Y.data != 1][0]
        raise ValueError(f"{name} must be binary (0/1), found value {bad}")
    return Y.astype(np.float32)


def parse_every(spec) -> tuple[str, float] | None:
    """``"20000"`` / ``20000`` -> every 20,000 samples; ``"60s"`` -> every 60 seconds."""
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


class XMCClassifier:
    """Extreme multi-label classifier: a sparse-input MLP trained with (Adaptive) SGD.

    Parameters
    ----------
    hidden : int or list of int, default 128
        Hidden layer widths (first layer sparse, the rest dense).
    epochs, batch_size, lr : training length, base batch size ``B``, base learning rate
        (``None``: the optimizer's default, :data:`xmc_engine.config.DEFAULT_LR`).
    lr_warmup_epochs, lr_decay : linear warm-up length; decay ``lr0 / (1 + λ (e - e_warm))``;
        the schedule of every algorithm (``lr_warmup_epochs=None``: each algorithm's own
        warm-up, none by default).
    label_chunk : int or None
        Output-layer label chunk; ``None`` keeps the ``B x n_labels`` logits in memory.
    optimizer : {"adagrad", "sgd"}
        Adagrad (the default; per-parameter accumulators, row-sparse for ``W1``; each replica
        keeps its own, merges average parameters only) or plain SGD (the paper's).
    devices : str
        Device spec, e.g. ``"cpu"``, ``"cpu,cpu@0.5"``, ``"cuda:0,cuda:0"``, ``"auto"``.
    algorithm : str
        ``"single"`` (one device), ``"adaptive"`` (Adaptive SGD), ``"average"`` (the paper's GD).
    algorithm_params : dict
        Options of the algorithm (see :mod:`xmc_engine.algorithms`).
    seed : int
        Seeds initialisation and shuffling; a one-device run with a fixed ``threads`` repeats
        exactly.
    threads : int or None
        CPU threads (None: all cores, split over the CPU devices; a device with several
        threads then times a few steps under 1 and all of them and keeps the faster).
    eval_every : float
        Evaluate on ``eval_set`` every this many epochs (0: only at the end). On several
        devices an evaluation waits for the next merge barrier (the central model); several
        nodes evaluate at epoch ends.
    log_dir : str or None
        Folder for ``log.jsonl`` and checkpoints.
    checkpoint_every : int or str or None
        Checkpoint every N samples (``20000``) or seconds (``"60s"``); needs ``log_dir``.

    Attributes (after ``fit``)
    --------------------------
    n_features_, n_labels_ : int
    params_ : list of numpy arrays (see :mod:`xmc_engine.model`)
    history_ : list of dict, the run-log records of the last ``fit``
    """

    def __init__(self, hidden=128, epochs=10, batch_size=64, lr=None, lr_warmup_epochs=None,
                 lr_decay=0.0, label_chunk=None, optimizer="adagrad", devices="cpu",
                 algorithm="single", algorithm_params=None, seed=0, threads=None,
                 eval_every=1.0, eval_k=5, propensity_a=0.55, propensity_b=1.5, log_dir=None,
                 checkpoint_every=None):
        self.hidden = hidden
        self.epochs = epochs
        self.batch_size = batch_size
        self.lr = lr
        self.lr_warmup_epochs = lr_warmup_epochs
        self.lr_decay = lr_decay
        self.label_chunk = label_chunk
        self.optimizer = optimizer
        self.devices = devices
        self.algorithm = algorithm
        self.algorithm_params = algorithm_params
        self.seed = seed
        self.threads = threads
        self.eval_every = eval_every
        self.eval_k = eval_k
        self.propensity_a = propensity_a
        self.propensity_b = propensity_b
        self.log_dir = log_dir
        self.checkpoint_every = checkpoint_every

    # -- configuration -----------------------------------------------------------------------
    def get_config(self) -> TrainConfig:
        return TrainConfig(
            hidden=self.hidden, epochs=self.epochs, batch_size=self.batch_size, lr=self.lr,
            lr_warmup_epochs=self.lr_warmup_epochs, lr_decay=self.lr_decay,
            label_chunk=self.label_chunk, optimizer=self.optimizer, devices=self.devices,
            algorithm=self.algorithm,
            algorithm_params=dict(self.algorithm_params or {}), seed=self.seed,
            threads=self.threads, eval_every=self.eval_every, eval_k=self.eval_k,
            propensity_a=self.propensity_a, propensity_b=self.propensity_b)

    @classmethod
    def from_config(cls, cfg: TrainConfig, **kwargs) -> XMCClassifier:
        d = cfg.to_dict()
        return cls(**d, **kwargs)

    # -- training ------------------------------------------------------------------------------
    def fit(self, X, Y, eval_set=None, *, resume: bool = False) -> XMCClassifier:
        """Train on ``X`` (n_samples, n_features) and binary ``Y`` (n_samples, n_labels).

        ``eval_set=(X_test, Y_test)`` is evaluated every ``eval_every`` epochs (time excluded
        from ``train_time``). ``resume=True`` continues from the newest valid checkpoint in
        ``log_dir``. Returns ``self``.
        """
        from xmc_engine.training import fit_model

        cfg = self.get_config()
        X = check_X(X)
        Y = check_Y(Y, X.shape[0])
        if eval_set is not None:
            Xt = check_X(eval_set[0], X.shape[1], name="X_test")
            Yt = check_Y(eval_set[1], Xt.shape[0], Y.shape[1], name="Y_test")
            eval_set = (Xt, Yt)
        self.n_features_, self.n_labels_ = X.shape[1], Y.shape[1]
        result = fit_model(cfg, X, Y, eval_set, log_dir=self.log_dir,
                           checkpoint_every=parse_every(self.checkpoint_every), resume=resume)
        self.params_ = result["params"]
        self.history_ = result["history"]
        self.metrics_ = result.get("metrics")
        # Global over the nodes of a multi-node run (each rank holds only its rows).
        self.label_frequency_ = np.asarray(result.get("label_counts", Y.sum(axis=0))).ravel() \
            .astype(np.int64)
        self.n_train_ = int(result.get("n_train", X.shape[0]))
        return self

    # -- inference -----------------------------------------------------------------------------
    def _check_fitted(self):
        if not hasattr(self, "params_"):
            raise RuntimeError("this XMCClassifier is not fitted yet; call fit() or load()")

    def _inference_backend(self):
        from xmc_engine.backends import get_backend

        return get_backend(getattr(self, "_backend_name", "cpu"), threads=self.threads)

    def predict_topk(self, X, k: int = 5, *, row_chunk: int = 4096):
        """Top-``k`` labels and scores per row.

        Returns
        -------
        labels : numpy.ndarray (n_samples, k) int64, by descending score
        scores : numpy.ndarray (n_samples, k) float32 (logits)
        """
        self._check_fitted()
        if int(k) < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        X = check_X(X, self.n_features_)
        be = self._inference_backend()
        params = [be.asarray(p) for p in self.params_]
        return predict_topk(be, params, X, int(k), row_chunk=row_chunk,
                            label_chunk=self.label_chunk)

    def evaluate(self, X, Y, ks=(1, 3, 5)) -> dict[str, float]:
        """P@k, nDCG@k, PSP@k, PSnDCG@k and R@k on ``(X, Y)``."""
        from xmc_engine.metrics import TopKMetrics, jain_propensity

        self._check_fitted()
        X = check_X(X, self.n_features_)
        Y = check_Y(Y, X.shape[0], self.n_labels_)
        prop = jain_propensity(self.label_frequency_, n_samples=self.n_train_,
                               A=self.propensity_a, B=self.propensity_b)
        m = TopKMetrics(ks=tuple(ks), propensity=prop)
        labels, _ = self.predict_topk(X, max(ks))
        m.update(labels, Y)
        return m.result()

    # -- devices -------------------------------------------------------------------------------
    def to_cpu(self) -> XMCClassifier:
        """Run inference on the CPU backend (parameters always stay on the host here)."""
        self._backend_name = "cpu"
        return self

    def to_gpu(self) -> XMCClassifier:
        """Run inference on CUDA device 0 (raises if no usable CUDA device)."""
        from xmc_engine.backends import get_backend

        get_backend("cuda")  # raises BackendUnavailableError with the fix
        self._backend_name = "cuda"
        return self

    # -- persistence ---------------------------------------------------------------------------
    def save(self, path) -> Path:
        """Write ``config.json`` + ``params.npz`` into folder ``path`` (atomically)."""
        from xmc_engine.checkpoint import save_model_dir

        self._check_fitted()
        shape = ModelShape(self.n_features_, self.n_labels_, tuple(self.get_config().hidden))
        config = {
            "format": MODEL_FORMAT,
            "train_config": self.get_config().to_dict(),
            "n_features": self.n_features_,
            "n_labels": self.n_labels_,
            "n_train": int(self.n_train_),
            "param_names": shape.param_names,
        }
        arrays = dict(zip(shape.param_names, self.params_, strict=True))
        arrays["label_frequency"] = self.label_frequency_
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
            cfg = TrainConfig.from_dict(config["train_config"], source=f"{path}/config.json")
            shape = ModelShape(int(config["n_features"]), int(config["n_labels"]),
                               tuple(cfg.hidden))
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
        freq = arrays.get("label_frequency")
        model.label_frequency_ = (np.asarray(freq, dtype=np.int64) if freq is not None
                                  else np.zeros(shape.n_labels, dtype=np.int64))
        return model

    def __repr__(self) -> str:
        return (f"XMCClassifier(hidden={self.hidden!r}, epochs={self.epochs}, "
                f"batch_size={self.batch_size}, lr={self.lr}, devices={self.devices!r}, "
                f"algorithm={self.algorithm!r}, seed={self.seed})")


__all__ = ["XMCClassifier", "check_X", "check_Y", "parse_every"]
