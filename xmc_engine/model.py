"""The sparse-input MLP (DESIGN.md §2), written once against a backend.

Parameters, in this order everywhere (replicas, merges, checkpoints)::

    W1  (n_features, hidden[0])   float32   sparse input layer ("embedding bag")
    b1  (hidden[0],)              float32
    Wk  (hidden[k-1], hidden[k])  float32   extra dense hidden layers, k = 1 .. len(hidden)-1
    bk  (hidden[k],)              float32
    W2  (hidden[-1], n_labels)    float32   output layer
    b2  (n_labels,)               float32

Forward: ``H = relu(X @ W1 + b1)`` (then ``relu(H @ Wk + bk)`` per extra layer),
``Z = H @ W2 + b2``; loss: softmax cross-entropy against the row-normalised label vector.
A step is plain SGD (or Adagrad, ``optimizer="adagrad"``), applied in place; the ``W1``
gradient is row-sparse and applied only to the rows of the features in the batch (never a dense
``n_features x hidden`` gradient). With ``output="sampled"`` the softmax runs over a batch's
candidate labels only (:func:`xmc_engine.output_layer.sample_candidates`) and ``W2``, ``b2`` are
updated on those columns only.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from xmc_engine.backends.base import empty_like
from xmc_engine.batches import CSRBatch, RowGather, mark_columns
from xmc_engine.config import (
    EVAL_ROWS,
    HELDOUT_LOGITS,
    NEGATIVE_SAMPLING,
    OPTIMIZERS,
    TRAIN_LOSSES,
    TrainConfig,
)
from xmc_engine.output_layer import FrequencyProposal, LSHProposal, sample_candidates

logger = logging.getLogger(__name__)


ADAGRAD_EPS = 1e-10


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the network: ``n_features -> hidden[0] -> ... -> hidden[-1] -> n_labels``."""

    n_features: int
    n_labels: int
    hidden: tuple[int, ...] = (128,)

    @property
    def param_names(self) -> list[str]:
        names = ["W1", "b1"]
        for k in range(1, len(self.hidden)):
            names += [f"W1_{k}", f"b1_{k}"]
        return names + ["W2", "b2"]

    @property
    def param_shapes(self) -> list[tuple[int, ...]]:
        shapes: list[tuple[int, ...]] = [(self.n_features, self.hidden[0]), (self.hidden[0],)]
        for k in range(1, len(self.hidden)):
            shapes += [(self.hidden[k - 1], self.hidden[k]), (self.hidden[k],)]
        return shapes + [(self.hidden[-1], self.n_labels), (self.n_labels,)]

    def n_params(self) -> int:
        return int(sum(np.prod(s) for s in self.param_shapes))


def init_params(shape: ModelShape, seed: int = 0, avg_nnz: float = 32.0) -> list[np.ndarray]:
    """Seeded host initialisation (float32, C-contiguous).

    ``W1`` is uniform with variance ``1 / avg_nnz`` (``avg_nnz`` non-zeros per input row;
    :func:`init_params_for_data` takes it from the data); dense layers use Glorot-uniform;
    biases start at zero.
    """
    rng = np.random.default_rng(seed)
    params: list[np.ndarray] = []
    for name, s in zip(shape.param_names, shape.param_shapes, strict=True):
        if len(s) == 1:
            params.append(np.zeros(s, dtype=np.float32))
            continue
        if name == "W1":
            bound = np.sqrt(3.0 / max(avg_nnz, 1e-6))
        else:
            bound = np.sqrt(6.0 / (s[0] + s[1]))
        params.append(rng.uniform(-bound, bound, size=s).astype(np.float32))
    return params


#: Where the output biases start with ``loss="bce"``: ``"minus_log_labels"`` (``-log(n_labels)``,
#: every sigmoid near ``1 / n_labels``) or ``"zero"``. Chosen by ``bench/bench_bce_settings.py``
#: (``bench/RESULTS.md``, "The logistic loss"): at the default decay ``-log(n_labels)`` has the
#: better mean P@1 over the nine shared sets (0.6105 against 0.6081 from zero); from zero the
#: synthetic shapes train faster (synth10k 0.700 against 0.514).
BCE_BIAS_INIT = "minus_log_labels"


def init_params_for_data(shape: ModelShape, X, seed: int = 0, *,
                         loss: str = "softmax") -> list[np.ndarray]:
    """:func:`init_params` with ``W1`` sized by the training rows ``X``: variance
    ``1 / avg_nnz`` (non-zeros per row), feature values not counted. With ``loss="bce"`` the
    output biases start at ``-log(n_labels)`` (:data:`BCE_BIAS_INIT`): every sigmoid then
    starts near ``1 / n_labels`` instead of 1/2 (debian_debtags, 5 epochs, lr 0.05: P@1 0.843
    against 0.824 from 0; the choice over every set: ``bench/RESULTS.md``, "The logistic
    loss").

    Why not unit pre-activation variance (``1 / (avg_nnz x mean squared value)``): with tf-idf
    features the values are small, the weights would come out large, and a step (Adagrad's above
    all, about ``lr`` per weight whatever the gradient) then moves them slowly; binary features
    are the same either way. Measured: ``bench/RESULTS.md``, "Quality on small real datasets".
    """
    avg_nnz = max(X.nnz / max(X.shape[0], 1), 1.0)
    params = init_params(shape, seed, avg_nnz=avg_nnz)
    if loss == "bce" and BCE_BIAS_INIT == "minus_log_labels":
        params[-1] -= np.float32(np.log(max(shape.n_labels, 1)))
    return params


def fitted_hidden(params) -> tuple[int, ...]:
    """The hidden widths of the network whose host parameters (in :class:`ModelShape` order)
    are ``params``: ``W1``'s columns, then each further layer's (a combined ensemble's are
    the members' summed, :func:`combine_members`)."""
    n_layers = (len(params) - 2) // 2
    return tuple(int(params[2 * k].shape[1]) for k in range(n_layers))


def combine_members(members) -> list[np.ndarray]:
    """One network whose logits are the mean of the ``members``' logits (``TrainConfig.
    ensemble``): the members' hidden units side by side. ``W1`` and every bias of a hidden
    layer are concatenated, each further hidden layer's weights placed block-diagonally (a
    member's units see only that member's units), ``W2`` stacked row-wise and divided by the
    number of members, ``b2`` averaged. So ``relu`` acts on each member's units as in that
    member, and ``H W2 + b2 = mean_m (H_m W2_m + b2_m)`` exactly: prediction, ``predict_proba``
    (the softmax or the sigmoids of the mean logits), saving and loading are those of a plain
    network of the summed widths. ``members``: lists of host arrays of one :class:`ModelShape`
    each."""
    members = [[np.asarray(p, dtype=np.float32) for p in m] for m in members]
    n, n_hidden = len(members), (len(members[0]) - 2) // 2
    out = [np.concatenate([m[0] for m in members], axis=1),
           np.concatenate([m[1] for m in members])]
    for k in range(1, n_hidden):
        blocks = [m[2 * k] for m in members]
        W = np.zeros((sum(b.shape[0] for b in blocks), sum(b.shape[1] for b in blocks)),
                     dtype=np.float32)
        r = c = 0
        for b in blocks:
            W[r:r + b.shape[0], c:c + b.shape[1]] = b
            r, c = r + b.shape[0], c + b.shape[1]
        out += [W, np.concatenate([m[2 * k + 1] for m in members])]
    out.append(np.concatenate([m[-2] for m in members], axis=0) / np.float32(n))
    out.append(np.mean([m[-1] for m in members], axis=0, dtype=np.float64).astype(np.float32))
    return [np.ascontiguousarray(p) for p in out]


class MLPReplica:
    """One model copy on one device, trained on rows of a training set.

    Implements the Replica protocol of :mod:`xmc_engine.scheduler`: ``train_batch(rows, lr)``,
    ``params()``, ``set_params(params)``; on a backend with ``tracks_rows`` (the CPU) also
    ``changed_rows()`` and ``set_params(params, rows=...)``: the replica records which ``W1``
    rows its steps changed since its parameters were last set, so that a merge reads and writes
    only those rows (:func:`xmc_engine.scheduler.merge.merge_changed_rows`).

    Parameters
    ----------
    backend : :class:`~xmc_engine.backends.base.Backend`
    X : scipy.sparse.csr_matrix, (n_samples, n_features) float32, host
    Y : scipy.sparse.csr_matrix, (n_samples, n_labels), host (binary)
    params : list of host float32 arrays (see module docstring); copied to the device
    label_chunk : int or None; output-layer label chunk (None = plain path, logits in memory)
    optimizer : ``"sgd"`` (default) or ``"adagrad"``; Adagrad keeps one accumulator per
        parameter on this device (local to the replica: merges average parameters only)
    loss : ``"softmax"`` (default) or ``"bce"``: the output layer's training loss
        (:attr:`~xmc_engine.config.TrainConfig.loss`)
    output : ``"exact"`` (default) or ``"sampled"``: the output layer of a step
        (:class:`~xmc_engine.config.TrainConfig` ``output``). Sampled steps touch only the
        ``W2`` columns and ``b2`` entries of their candidate labels (SGD and Adagrad alike);
        :meth:`grad_batch` scatters their gradient into dense ``dW2``/``db2`` arrays. Where
        the backend tracks rows the replica also records the columns its steps changed
        (:meth:`changed_columns`), and a merge reads and writes only those.
    negatives : int; ``K`` of the sampled mode
    negative_sampling : ``"frequency"`` (default), ``"uniform"`` or ``"lsh"``: the rule that
        draws the negatives (:class:`~xmc_engine.output_layer.FrequencyProposal` from ``Y``'s
        label counts, :class:`~xmc_engine.output_layer.LSHProposal` from this replica's ``W2``)
    seed : int; seed of the negatives' random stream (give replicas different seeds). The
        stream is not part of checkpoints: a resumed sampled run draws other negatives than an
        uninterrupted one would (the same distribution).
    fused : bool; ``True`` (default): where the backend has ``fused_train_step`` (the CPU) and
        the network has one hidden layer, :meth:`train_batch` and :meth:`grad_batch` are one
        ``nogil`` call each (:mod:`xmc_engine.kernels.train_step`) with the sampled output
        layer and with the exact softmax in one label chunk; ``False``: the
        host-level step through the backend's kernels, the fused step's reference
        (``bench/bench_fused_step.py`` times both)
    """

    def __init__(self, backend, X, Y, params, *, label_chunk: int | None = None,
                 optimizer: str = "sgd", output: str = "exact",
                 negatives: int = TrainConfig.negatives,
                 negative_sampling: str = TrainConfig.negative_sampling, seed: int = 0,
                 fused: bool = True, loss: str = "softmax"):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        if loss not in TRAIN_LOSSES:
            raise ValueError(f"loss={loss!r}: choose one of {', '.join(TRAIN_LOSSES)}")
        if output not in ("exact", "sampled"):  # "auto" is resolved before (make_replica)
            raise ValueError(f"output={output!r}: choose exact or sampled")
        if negatives < 0:
            raise ValueError(f"negatives={negatives!r}: must be >= 0")
        if negative_sampling not in NEGATIVE_SAMPLING:
            raise ValueError(f"negative_sampling={negative_sampling!r}: choose one of "
                             f"{', '.join(NEGATIVE_SAMPLING)}")
        self.backend = backend
        self.X = X
        self.Y = Y
        # Batches are cut from copies in canonical dtypes without holding the GIL (batches.py).
        self._take_x = RowGather(X)
        self._take_y = RowGather(Y)
        self.label_chunk = label_chunk
        self.optimizer = optimizer
        self.loss = loss
        self.output = output
        self.negatives = int(negatives)
        self._proposal = None  # the negatives' rule when not uniform (output_layer)
        if output == "sampled" and negative_sampling == "frequency":
            self._proposal = FrequencyProposal(np.bincount(Y.indices, minlength=Y.shape[1]))
        elif output == "sampled" and negative_sampling == "lsh":
            self._proposal = LSHProposal(Y.shape[1], int(np.shape(params[-2])[0]), seed=seed)
        self._rng = np.random.default_rng(seed)
        #: was the thread budget timed (:meth:`calibrate_threads`)? False where the run was too
        #: short to repay timing it or its steps too short to gain from threads; None where it
        #: was never calibrated
        self.threads_timed: bool | None = None
        #: where timed, how many times as fast as one thread all the budget's threads ran the
        #: step (:func:`calibrate_threads`' ``speedup``); None elsewhere
        self.threads_speedup: float | None = None
        #: why the budgets were not timed: 'step' (a step too short, CALIBRATE_MIN_STEP_S) or
        #: 'run' (a run too short to repay the timing); None where timed or not calibrated
        self.threads_skipped: str | None = None
        self._params = [backend.asarray(np.array(p, dtype=np.float32, copy=True)) for p in params]
        if label_major_w2(backend, output):
            self._params[-2] = np.asfortranarray(self._params[-2])
        self.n_dense = (len(self._params) - 4) // 2
        self._acc = ([empty_like(backend, p, zero=True) for p in self._params]
                     if optimizer == "adagrad" else None)
        # W1 rows changed by steps since the last set_params (a step changes only the rows of
        # its batch's features); None where the backend's merges are dense.
        self._changed = np.zeros(X.shape[1], dtype=np.bool_) if backend.tracks_rows else None
        # W2 columns (and b2 entries) changed by sampled steps since the last set_params; None
        # where every step changes all of them (the exact softmax) or merges are dense.
        self._changed_cols = (np.zeros(Y.shape[1], dtype=np.bool_)
                              if backend.tracks_rows and output == "sampled" else None)
        # One nogil call per step where the backend has it and the network has the shape
        # fused_step_covers names (kernels/train_step.py).
        self._fused = (fused and hasattr(backend, "fused_train_step")
                       and fused_step_covers(self.n_dense + 1, output, label_chunk, Y.shape[1]))
        # labels that were a positive of a batch row since the last set_params, once
        # track_labels() asked for them (AdaptiveConfig.label_weights='positives')
        self._seen = None

    def calibrate_threads(self, batch_size: int, max_threads: int,
                          run_samples: float | None = None) -> int:
        """Set this replica's CPU thread budget to the faster of 1 and ``max_threads``
        (:func:`calibrate_threads`, timing this replica's own step: its optimizer, output layer
        and batch gather) and return it; other backends are left as they are. ``run_samples``
        (the samples the budget will train, if known) lets a run too short to repay the timing
        keep one thread untimed; :attr:`threads_timed` says afterwards whether it was timed.

        The timed steps run at learning rate 0 on one batch and with a throwaway random stream
        for the negatives; afterwards the optimizer state, the random stream, the negatives'
        proposal and the records of changed rows, columns and labels are what they were, so a
        calibrated run trains as an uncalibrated one would."""
        be = self.backend
        if be.name != "cpu" or max_threads <= 1:
            return be.threads if be.name == "cpu" else max_threads
        rows = np.random.default_rng(0).permutation(self.X.shape[0])[:batch_size]
        rng, proposal = self._rng, copy.copy(self._proposal)  # LSH: its refresh count, buckets
        acc = None if self._acc is None else [a.copy() if a.any() else None for a in self._acc]
        marks = [m for m in (self._changed, self._changed_cols, self._seen) if m is not None]
        saved_marks = [m.copy() for m in marks]
        self._rng = np.random.default_rng(0)
        report: dict = {}
        try:
            be.threads = calibrate_threads(
                be, lambda: self.train_batch(rows, 0.0), max_threads, report=report,
                run_steps=None if run_samples is None else run_samples / batch_size)
            self.threads_timed = report["timed"]
            self.threads_skipped = report["skipped"]
            self.threads_speedup = report.get("speedup")
        finally:
            self._rng, self._proposal = rng, proposal
            for a, saved in zip(self._acc or [], acc or [], strict=True):
                a[...] = 0 if saved is None else saved
            for m, saved in zip(marks, saved_marks, strict=True):
                m[...] = saved
        return be.threads

    # -- optimiser state (checkpoints) -------------------------------------------------------
    def optimizer_state(self) -> list[np.ndarray]:
        """Host copies of the Adagrad accumulators (empty for SGD)."""
        if self._acc is None:
            return []
        return [np.asarray(self.backend.to_host(a)) for a in self._acc]

    def load_optimizer_state(self, state) -> None:
        if self._acc is None or not state:
            return
        for dst, src in zip(self._acc, state, strict=True):
            self.backend.copy_into(dst, np.asarray(src, dtype=np.float32))

    def rng_state(self) -> dict:
        """The state of the negative sampler's generator (``output="sampled"``), as JSON-able
        data: a checkpoint keeps it so that a resumed run draws the negatives the uninterrupted
        run would have drawn."""
        return self._rng.bit_generator.state

    def load_rng_state(self, state: dict) -> None:
        self._rng.bit_generator.state = state

    def accumulators(self) -> list:
        """The live Adagrad accumulators on this replica's backend, one per parameter (empty
        for SGD): a merge may average or reset them in place
        (:attr:`~xmc_engine.config.AdaptiveConfig.optimizer_state`)."""
        return [] if self._acc is None else self._acc

    # -- Replica protocol ----------------------------------------------------------------------
    def params(self) -> list:
        return self._params

    def set_params(self, params, rows=None, cols=None) -> None:
        """Copy ``params`` into this replica. With ``rows`` (int64 ``W1`` row numbers, on a
        backend with ``tracks_rows``) only those rows of ``W1`` are copied, with ``cols`` (int64
        label numbers) only those columns of ``W2`` and entries of ``b2``, and every other
        parameter in full: the caller vouches that the rest already holds ``params``' values (a
        row- and column-sparse merge). Either way the record of changes starts afresh."""
        be = self.backend
        last = len(self._params) - 2  # W2, b2
        for k, (dst, src) in enumerate(zip(self._params, params, strict=True)):
            if k == 0 and rows is not None:
                if len(rows):  # an empty list: nothing to launch
                    be.copy_rows(dst, src, rows)
            elif k >= last and cols is not None:
                if len(cols):
                    be.copy_columns(dst, src, cols)
            else:
                be.copy_into(dst, src)
        if self._changed is not None:
            self._changed[:] = False
        if self._changed_cols is not None:
            self._changed_cols[:] = False
        if self._seen is not None:
            self._seen[:] = False

    def track_labels(self) -> None:
        """Record from now on which labels the batches hold as positives (:meth:`seen_labels`),
        where the backend tracks rows; a step's bookkeeping otherwise skips it."""
        if self.backend.tracks_rows and self._seen is None:
            self._seen = np.zeros(self.Y.shape[1], dtype=np.bool_)

    def seen_labels(self):
        """Boolean mask (n_labels,) of the labels that were a positive of some row of this
        replica's batches since its parameters were last set, or ``None`` where not tracked
        (before :meth:`track_labels`, or on a backend without row tracking)."""
        return self._seen

    def changed_rows(self):
        """Boolean mask (n_features,) of the ``W1`` rows this replica's steps changed since its
        parameters were last set, or ``None`` where not tracked (no row-sparse merge on this
        backend). Parameters change only through steps and :meth:`set_params`."""
        return self._changed

    def changed_columns(self):
        """Boolean mask (n_labels,) of the ``W2`` columns (and ``b2`` entries) this replica's
        steps changed since its parameters were last set, or ``None`` where not tracked (the
        exact output layer changes every column; no row tracking on this backend)."""
        return self._changed_cols

    def train_batch(self, rows: np.ndarray, lr: float) -> float:
        """One optimiser step on training rows ``rows`` (int64, host); returns the summed loss."""
        Xb = self._take_x(rows)
        if self._changed is not None and not self._fused:  # the fused step marks them itself
            self._changed[Xb.indices] = True
        if self._seen is not None:
            mark_columns(self.Y.indptr, self.Y.indices, np.asarray(rows, np.int64), self._seen)
        if self.output == "sampled":
            return self._sampled_step(Xb, self._take_y(rows), lr)
        if self._fused:
            return self.backend.fused_train_step(self._params, self._acc, Xb,
                                                 self._take_y(rows), lr, ADAGRAD_EPS,
                                                 self._changed, loss=self.loss)
        if self._acc is not None:
            total, grads = grad_step(self.backend, self._params, Xb, self._take_y(rows),
                                     label_chunk=self.label_chunk, loss=self.loss)
            apply_adagrad(self.backend, self._params, grads, self._acc, lr)
            return total
        return train_step(self.backend, self._params, Xb, self._take_y(rows), lr,
                          label_chunk=self.label_chunk, loss=self.loss)

    # -- gradient interface (synchronous data-parallel SGD, DESIGN.md §4 "sync") -------------
    def grad_batch(self, rows: np.ndarray) -> tuple[float, list]:
        """Gradients of the mean loss over training rows ``rows`` (int64, host); no update.

        Returns ``(loss_sum, grads)``: ``grads`` follows the order of :meth:`params`;
        ``grads[0]`` (``W1``) is row-sparse, a pair ``(rows int64 (n_rows,) sorted unique
        features of the batch, grad_rows float32 (n_rows, hidden[0]))``; with
        ``output="sampled"`` the last two (``W2``, ``b2``) are column-sparse, ``(cols int64
        (m,) the candidate labels, dW2 float32 (hidden[-1], m))`` and ``(cols, db2 (m,))``;
        every other entry is a dense float32 array of its parameter's shape. All live on this
        replica's device (the sampled ones, and ``dW2`` and ``db2`` of the fused CPU step, in
        workspaces, valid until its next step) and are
        already scaled as the mean over the batch (``apply_grads(grads, lr)`` is the step
        ``train_batch(rows, lr)`` makes). ``loss_sum`` is summed over the rows.
        """
        Xb, Yb = self._take_x(rows), self._take_y(rows)
        if self._fused and self.output == "exact":
            return self.backend.fused_grad_step(self._params, Xb, Yb, loss=self.loss)
        if self._fused:
            return self.backend.fused_sampled_grad_step(
                self._params, Xb, Yb.indptr,
                *draw_candidates(self.backend, self._params[-2], Yb.indices, self.negatives,
                                 self._rng, self._proposal), loss=self.loss)
        if self.output == "exact":
            return grad_step(self.backend, self._params, Xb, Yb, label_chunk=self.label_chunk,
                             loss=self.loss)
        return sampled_grad_step(self.backend, self._params, Xb, Yb, self.negatives,
                                 self._rng, self._proposal, loss=self.loss)

    def _sampled_step(self, Xb, Yb, lr: float) -> float:
        """A step with the sampled output layer: ``W1`` on its touched rows, ``W2`` / ``b2``
        on the candidate columns, the dense layers in full (SGD or Adagrad)."""
        be, params = self.backend, self._params
        if self._fused:
            candidates = draw_candidates(be, params[-2], Yb.indices, self.negatives, self._rng,
                                         self._proposal)
            return be.fused_sampled_step(params, self._acc, Xb, Yb.indptr, *candidates, lr,
                                         ADAGRAD_EPS, self._changed, self._changed_cols,
                                         loss=self.loss)
        total, grads = sampled_grad_step(be, params, Xb, Yb, self.negatives, self._rng,
                                         self._proposal, loss=self.loss)
        if self._changed_cols is not None:
            self._changed_cols[grads[-1][0]] = True
        if self._acc is not None:
            apply_adagrad(be, params, grads, self._acc, lr)
        else:
            apply_grads(be, params, grads, lr)
        return total

    def apply_grads(self, grads: list, lr: float) -> None:
        """This replica's optimiser step (SGD ``p -= lr * g``, or Adagrad) with gradients in
        the :meth:`grad_batch` layout.

        The arrays may live on the host or on this device (copied here when needed); only the
        listed rows of ``W1`` are touched. ``grads`` is not modified, so one averaged gradient
        can be applied to every replica (identical replicas then keep identical accumulators).
        """
        if self._changed is not None:
            self._changed[np.asarray(self.backend.to_host(grads[0][0]), dtype=np.int64)] = True
        if self._changed_cols is not None:
            if isinstance(grads[-1], tuple):  # column-sparse W2, b2 (sampled)
                self._changed_cols[np.asarray(self.backend.to_host(grads[-1][0]),
                                              dtype=np.int64)] = True
            else:
                self._changed_cols[:] = True
        if self._acc is not None:
            apply_adagrad(self.backend, self._params, grads, self._acc, lr)
        else:
            apply_grads(self.backend, self._params, grads, lr)


def _hidden_forward(be, params, x_parts, n_rows: int):
    """Hidden activations of a batch given as CSR parts on the backend: list of
    (n_rows, hidden[k]) arrays.

    Call it with the backend active (:meth:`~xmc_engine.backends.base.SchedulerBackend.activate`):
    the activations are then allocated on the backend's stream."""
    W1, b1 = params[0], params[1]
    H = be.empty((n_rows, W1.shape[1]))
    be.sparse_forward(*x_parts, W1, b1, H)
    acts = [H]
    for k in range((len(params) - 4) // 2):
        W, b = params[2 + 2 * k], params[3 + 2 * k]
        Hk = acts[-1] @ W
        Hk += b
        be.xp.maximum(Hk, 0, out=Hk)
        acts.append(Hk)
    return acts


def _upload_batch(be, Xb, Yb) -> tuple:
    """``((indptr, indices, data), (y_indptr, y_indices))`` of a host batch on the backend, in
    one transfer (the labels' values are not used)."""
    ip, ix, d, yp, yi = be.upload([Xb.indptr, Xb.indices, np.asarray(Xb.data, np.float32),
                                   Yb.indptr, Yb.indices])
    return (ip, ix, d), (yp, yi)


def train_step(be, params, Xb, Yb, lr: float, *, label_chunk: int | None = None,
               loss: str = "softmax") -> float:
    """Forward, loss, backward and in-place SGD update of ``params`` on one batch.

    Parameters
    ----------
    be : :class:`~xmc_engine.backends.base.Backend`
    params : list of arrays on ``be`` (module docstring order), updated in place
    Xb : scipy.sparse.csr_matrix (B, n_features) float32, or a
        :class:`~xmc_engine.batches.CSRBatch`, host
    Yb : the same, (B, n_labels)
    lr : float, learning rate of this step
    label_chunk, loss : the output layer's label chunk and loss
        (:func:`xmc_engine.output_layer.output_layer_step`)

    Returns
    -------
    float : loss summed over the batch rows (rows without labels contribute 0); reading it waits
        for the backend's stream
    """
    with be.activate():  # every array of the step is allocated on the backend's stream
        (indptr, indices, data), (y_indptr, y_indices) = _upload_batch(be, Xb, Yb)
        acts = _hidden_forward(be, params, (indptr, indices, data), Xb.shape[0])
        W2, b2 = params[-2], params[-1]
        dH = be.empty(acts[-1].shape)
        total = be.output_layer_step(acts[-1], W2, b2, y_indptr, y_indices, lr, dH,
                                     label_chunk=label_chunk, loss=loss)
        # Extra dense hidden layers, last to first.
        for k in reversed(range(len(acts) - 1)):
            W, b = params[2 + 2 * k], params[3 + 2 * k]
            be.relu_backward(dH, acts[k + 1])
            d_prev = dH @ W.T
            W -= lr * (acts[k].T @ dH)
            b -= lr * dH.sum(axis=0)
            dH = d_prev
        be.relu_backward(dH, acts[0])
        be.sparse_backward_update(indptr, indices, data, dH, params[0], params[1], lr)
        return be.to_float(total)  # synchronize!


def grad_step(be, params, Xb, Yb, *, label_chunk: int | None = None,
              loss: str = "softmax") -> tuple[float, list]:
    """Forward, loss and backward of one batch without updating: ``(loss_sum, grads)``.

    Same arithmetic as :func:`train_step` (gradients of the mean loss; the ``dH`` of a layer is
    taken with its weights before the step), built on the backend's ``output_layer_grad`` and
    ``sparse_grad``. ``grads`` layout: :meth:`MLPReplica.grad_batch`.
    """
    with be.activate():
        x_parts, (y_indptr, y_indices) = _upload_batch(be, Xb, Yb)
        acts = _hidden_forward(be, params, x_parts, Xb.shape[0])
        W2, b2 = params[-2], params[-1]
        total, dW2, db2, dH = be.output_layer_grad(acts[-1], W2, b2, y_indptr, y_indices,
                                                   label_chunk=label_chunk, loss=loss)
        grads = _hidden_grads(be, params, x_parts, acts, dH)
        return be.to_float(total), [*grads, dW2, db2]  # synchronize!


def label_major_w2(backend, output: str) -> bool:
    """Whether a replica on ``backend`` holds ``W2`` (and its Adagrad accumulator) label-major:
    still of shape ``(n_hidden, n_labels)``, but in Fortran order, a label's column of
    ``n_hidden`` floats adjacent in memory. So on the CPU with the sampled output layer, whose
    steps gather and update a few thousand scattered columns out of a ``W2`` far larger than
    the caches, and whose merges read and write the columns the period changed: in C order each
    column is ``n_hidden`` cache lines, in Fortran order ``n_hidden / 16`` (``bench/RESULTS.md``,
    "``W2`` label-major on the CPU"). Everything else reads ``W2`` by its indices, BLAS calls
    by its strides, the flat merge kernels through C-order views of buffers of the same order
    (:func:`xmc_engine.backends.base.empty_like`), and MPI's all-reduce in C order (a copy);
    the exact layer (whole rows of ``W2`` per step) and the CUDA backend keep C order."""
    return backend.name == "cpu" and output == "sampled"


def fused_step_covers(n_hidden_layers: int, output: str, label_chunk: int | None,
                      n_labels: int) -> bool:
    """Whether a network has the shape the fused CPU step covers
    (:mod:`xmc_engine.kernels.train_step`): one hidden layer, and the sampled output layer or
    the exact softmax in one label chunk (the replica's choice of step, and the memory
    planner's count of the ``dW2`` it holds)."""
    return n_hidden_layers == 1 and (output == "sampled" or not label_chunk
                                     or label_chunk >= n_labels)


def draw_candidates(be, W2, y_indices, negatives: int, rng, proposal=None) -> tuple:
    """The candidate labels of a sampled step on ``W2`` (:func:`sample_candidates`' ``(cols,
    local_y, n_pos, log_weight)``); a ``proposal`` first sees the current ``W2`` (its
    ``before_step``)."""
    if proposal is not None:
        proposal.before_step(be, W2)
    return sample_candidates(y_indices, W2.shape[1], negatives, rng, proposal)


def sampled_grad_step(be, params, Xb, Yb, negatives: int, rng,
                      proposal=None, *, loss: str = "softmax") -> tuple[float, list]:
    """:func:`grad_step` with the sampled output layer: ``(loss_sum, grads)``.

    The candidate labels ``cols`` (int64, on the backend) are the batch's positives plus
    ``negatives`` draws from ``rng`` (uniform, or from ``proposal``, whose
    ``before_step`` sees the current ``W2`` first)
    (:func:`xmc_engine.output_layer.sample_candidates`); ``grads`` is in the
    :meth:`MLPReplica.grad_batch` layout, its last two entries column-sparse:
    ``(cols, dW2[:, cols])`` (n_hidden, m) and ``(cols, db2[cols])`` (m,) (backend workspaces,
    valid until the next sampled step).
    """
    W2, b2 = params[-2], params[-1]
    cols, local_y, n_pos, log_weight = draw_candidates(be, W2, Yb.indices, negatives, rng,
                                                       proposal)
    Yl = CSRBatch(Yb.indptr, local_y, local_y, (Yb.shape[0], len(cols)))
    with be.activate():
        x_parts, (y_indptr, y_local) = _upload_batch(be, Xb, Yl)
        cols = be.asarray(cols)
        acts = _hidden_forward(be, params, x_parts, Xb.shape[0])
        total, dW2s, db2s, dH = be.sampled_output_grad(acts[-1], W2, b2, cols, n_pos,
                                                       log_weight, y_indptr, y_local,
                                                       loss=loss)
        grads = _hidden_grads(be, params, x_parts, acts, dH)
        return be.to_float(total), [*grads, (cols, dW2s), (cols, db2s)]  # synchronize!


def _hidden_grads(be, params, x_parts, acts, dH) -> list:
    """Backward through the hidden layers from ``dH`` (the gradient of the last activations,
    overwritten): ``[(rows, grad_rows), grad_b1, dW1_1, db1_1, ...]`` (the
    :meth:`MLPReplica.grad_batch` layout without ``W2``, ``b2``)."""
    dense: list = []
    for k in reversed(range(len(acts) - 1)):
        W = params[2 + 2 * k]
        be.relu_backward(dH, acts[k + 1])
        dense = [acts[k].T @ dH, dH.sum(axis=0)] + dense
        dH = dH @ W.T
    be.relu_backward(dH, acts[0])
    rows, grad_rows, grad_b1 = be.sparse_grad(*x_parts, dH)
    return [(rows, grad_rows), grad_b1, *dense]


def apply_grads(be, params, grads, lr: float) -> None:
    """In-place SGD ``p -= lr * g`` for ``grads`` in the :meth:`MLPReplica.grad_batch` layout.

    ``W1`` through ``sparse_rows_update`` (touched rows only); dense arrays through the
    backend's ``axpy`` (no temporary the size of ``W2``). ``grads`` may be host arrays: they are
    copied to the device of ``be`` first (no copy on the CPU backend).
    """
    rows, grad_rows = grads[0]
    dense = _dense_part(params, grads)
    with be.activate():
        if len(rows):
            be.sparse_rows_update(params[0], be.asarray(rows, dtype=np.int64),
                                  be.asarray(grad_rows, dtype=np.float32), lr)
        for p, g in zip(params[dense], grads[dense], strict=True):
            be.axpy(p, be.asarray(g, dtype=np.float32), -float(lr))
        if isinstance(grads[-1], tuple):
            be.scatter_add_columns(params[-2], params[-1], *_columns(be, grads), -float(lr))


def _dense_part(params, grads) -> slice:
    """The dense entries of a :meth:`MLPReplica.grad_batch` list: all after ``W1``, or all
    between ``W1`` and a column-sparse ``W2``, ``b2`` (the sampled output layer)."""
    return slice(1, len(params) - 2 if isinstance(grads[-1], tuple) else len(params))


def _columns(be, grads) -> tuple:
    """``(cols, dW2s, db2s)`` of a column-sparse ``W2``, ``b2`` gradient, on ``be``."""
    (cols, dW2s), (_, db2s) = grads[-2], grads[-1]
    return (be.asarray(cols, dtype=np.int64), be.asarray(dW2s, dtype=np.float32),
            be.asarray(db2s, dtype=np.float32))


def apply_adagrad(be, params, grads, acc, lr: float, eps: float = ADAGRAD_EPS) -> None:
    """In-place Adagrad (Duchi et al. 2011) for ``grads`` in the :meth:`MLPReplica.grad_batch`
    layout: ``acc += g^2; p -= lr g / (sqrt(acc) + eps)``; ``W1`` on its touched rows only."""
    rows, grad_rows = grads[0]
    dense = _dense_part(params, grads)
    with be.activate():
        if len(rows):
            be.adagrad_rows(params[0], be.asarray(rows, dtype=np.int64),
                            be.asarray(grad_rows, dtype=np.float32), acc[0], lr, eps)
        for p, g, a in zip(params[dense], grads[dense], acc[dense], strict=True):
            be.adagrad_dense(p, be.asarray(g, dtype=np.float32), a, lr, eps)
        if isinstance(grads[-1], tuple):
            cols, dW2s, db2s = _columns(be, grads)
            be.adagrad_columns(params[-2], params[-1], acc[-2], acc[-1], cols, dW2s, db2s, lr,
                               eps)


#: :func:`calibrate_threads` takes ``max_threads`` only when its step is at least this much
#: faster than one thread's (ties go to one thread: it leaves the other cores free and its
#: workers do not spin-wait).
THREADS_MARGIN = 0.95
#: :func:`calibrate_threads` keeps one thread, untimed, where one thread's warm step takes less
#: than this many seconds. On the 2-core machine two threads train slower than one on the sets
#: with the shortest steps (bibtex, rcv1sub1, imdb: 0.67x-0.89x), faster on delicious and
#: debian_debtags (1.09x-1.25x, steps near the floor, which they cross in some runs) and on
#: the larger ones (1.3x-1.7x); without the floor the timing chose the same budgets and cost
#: imdb's fits 0.3-0.4 s (``bench/RESULTS.md``, "Thread calibration", "Steps too short to
#: time"; the first measurements there, with OpenBLAS spinning in the benchmark's process,
#: read the small sets 0.27x-0.70x). Not measured on more cores, where shorter steps may gain.
CALIBRATE_MIN_STEP_S = 1e-3


def calibrate_threads(be, step, max_threads: int, *, rounds: int = 3,
                      seconds: float = 0.05, run_steps: float | None = None,
                      report: dict | None = None) -> int:
    """The thread budget (1 or ``max_threads``) under which ``step()`` (a training step that
    leaves the model as it is) runs faster on backend ``be``.

    Timed as training runs it: each round of a budget in a fresh thread that enters the budget
    once and runs the steps while the caller's thread waits (the scheduler's device workers are
    such threads; timed on the calling thread, or switching budgets inside one thread, the
    imdb shape's 0.17 ms step took as long with two threads as with one, while a worker thread
    took 0.63 ms with two). The budgets alternate over ``rounds`` rounds of about ``seconds`` of
    steps each (one round where a step takes longer than 0.1 s), each scored by its fastest
    round, so that one interruption cannot decide; ``max_threads`` wins only when it is faster
    by :data:`THREADS_MARGIN`. On the 2-core machine this engine is developed on one
    thread beat two on the small shared datasets (numba's OpenMP workers and OpenBLAS's both
    spin-wait, and fight over the cores) and two beat one on the large synthetic shapes; a
    many-core server gains more from threads: so it is measured, not assumed.

    A step shorter than :data:`CALIBRATE_MIN_STEP_S` on one thread (its second warm-up step)
    keeps one thread untimed.

    ``run_steps`` (the steps the budget will serve, if known) lets a short run skip the timing:
    once one thread's warm-up step is timed, a run that would save less than the calibration
    costs even if ``max_threads`` threads ran it ``max_threads`` times as fast keeps one thread
    (on a small shared dataset the calibration took longer than the whole training). ``report``
    (a dict), if given, receives ``timed`` (False where it was skipped), ``skipped`` (why:
    ``'step'``, a step too short, or ``'run'``, a run too short; ``None`` where timed),
    ``one_thread_run_s`` (the run's estimated seconds on one thread; ``None`` without
    ``run_steps``) and, where timed, ``speedup`` (one thread's best step time over
    ``max_threads`` threads') and ``rounds`` (per round, each budget's seconds per step).
    """
    import threading
    import time

    if max_threads <= 1 or be.name != "cpu":
        return max(1, int(max_threads))
    budgets = (1, int(max_threads))
    best = {n: float("inf") for n in budgets}
    steps = {n: 1 for n in budgets}  # per round, set from the first round's warm-up
    failure: list[BaseException] = []
    outcome: dict = {"timed": True, "skipped": None, "one_thread_run_s": None,  # for ``report``
                     "rounds": []}

    def too_short(first: float) -> bool:
        """Can the run not repay the calibration? ``first``: one thread's warm step."""
        if run_steps is None:
            return False
        run_s = float(run_steps) * first
        outcome["one_thread_run_s"] = run_s
        cost = (1 if first > 0.1 else rounds) * len(budgets) * max(seconds, first)
        return run_s * (1.0 - 1.0 / budgets[1]) < cost

    def run(n: int, warm: bool) -> None:
        """One round of budget ``n`` in a fresh thread that enters the budget once, as a
        device worker does: warm-up steps (workspaces, first touch, thread pools), then
        ``steps[n]`` timed ones."""
        try:
            with be.thread_budget(n):
                for _ in range(2 if warm else 1):
                    t0 = time.perf_counter()
                    step()
                    first = time.perf_counter() - t0
                if warm:
                    steps[n] = max(1, min(200, int(seconds / max(first, 1e-6))))
                    if n == 1 and (too_short(first) or first < CALIBRATE_MIN_STEP_S):
                        outcome["timed"] = False
                        outcome["skipped"] = "step" if first < CALIBRATE_MIN_STEP_S else "run"
                        return
                t0 = time.perf_counter()
                for _ in range(steps[n]):
                    step()
                took = (time.perf_counter() - t0) / steps[n]
                best[n] = min(best[n], took)
                outcome["rounds"][-1][n] = took
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(e)

    for r in range(rounds):
        outcome["rounds"].append({})
        for n in budgets:
            worker = threading.Thread(target=run, args=(n, r == 0),
                                      name=f"xmc-calibrate-threads-{n}")
            worker.start()
            worker.join()
            if failure:
                raise failure[0]
            if not outcome["timed"]:
                logger.debug("thread calibration skipped (%s too short): the run takes about "
                             "%s s on one thread", outcome["skipped"],
                             outcome["one_thread_run_s"])
                if report is not None:
                    report.update(outcome)
                return 1
        if max(best.values()) > 0.1:  # slow steps: one round is enough (and all we can afford)
            break
    logger.debug("thread calibration: %s ms/step", {n: round(1e3 * t, 3) for n, t in best.items()})
    outcome["speedup"] = best[1] / best[budgets[1]]
    if report is not None:
        report.update(outcome)
    return budgets[1] if best[budgets[1]] < THREADS_MARGIN * best[1] else 1


def predict_topk(be, params, X, k: int = 5, *, row_chunk: int = EVAL_ROWS,
                 label_chunk: int | None = None):
    """Top-``k`` labels and scores for every row of ``X``, computed in row chunks.

    Returns host arrays ``labels`` (n_samples, k) int64 and ``scores`` (n_samples, k) float32,
    sorted by descending score.
    """
    if not sp.issparse(X):
        raise TypeError("X must be a scipy.sparse CSR matrix")
    X = X.tocsr()
    n = X.shape[0]
    k_eff = min(k, params[-1].shape[0])
    labels = np.empty((n, k_eff), dtype=np.int64)
    scores = np.empty((n, k_eff), dtype=np.float32)
    for start in range(0, n, row_chunk):
        stop = min(n, start + row_chunk)
        with be.activate():
            acts = _hidden_forward(be, params, be.csr_parts(X[start:stop]), stop - start)
            idx, val = be.predict_scores_topk(acts[-1], params[-2], params[-1], k_eff,
                                              label_chunk=label_chunk)
            labels[start:stop] = be.to_host(idx)
            scores[start:stop] = be.to_host(val)
    return labels, scores


def heldout_hits(be, params, X, Y, *, label_chunk: int | None = None,
                 row_chunk: int = 512) -> np.ndarray:
    """Per row of host CSR ``X``, ``Y``: is ``params``' top label one of the row's labels (bool;
    a row without labels: False), by :func:`predict_topk` in blocks of ``row_chunk`` rows and
    ``label_chunk`` labels (``None``: as many as keep a block within
    :data:`~xmc_engine.config.HELDOUT_LOGITS`). What the plateau schedule reads
    (``TrainConfig.lr_decay="plateau"``): its mean is the P@1, and two models' hits on the same
    rows tell them apart (``keep_best``)."""
    from xmc_engine.metrics import label_hits

    if X.shape[0] == 0:
        raise ValueError("heldout_hits needs at least one row")
    label_chunk = label_chunk or max(1, HELDOUT_LOGITS // row_chunk)
    top, _ = predict_topk(be, params, X, 1, row_chunk=row_chunk, label_chunk=label_chunk)
    return label_hits(top, Y)[:, 0]


def heldout_p1(be, params, X, Y, **kw) -> float:
    """P@1 of ``params`` on host CSR ``X``, ``Y``: the mean of :func:`heldout_hits`."""
    return float(np.mean(heldout_hits(be, params, X, Y, **kw)))
