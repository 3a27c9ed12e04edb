"""Neighbour votes at prediction: the labels of the training rows nearest a query row, blended
with the network's probabilities (``TrainConfig.neighbours``).

A row's neighbour vote for label ``l`` is the share of its ``k`` nearest training rows that have
``l``, each neighbour weighted by its cosine similarity to the power :data:`NEIGHBOURS_POWER`.
Two votes are taken, each over its own ``k`` nearest rows: in the network's last hidden layer
(the space the network has learnt for the labels) and in the input features (the rows the
network trains on, rare features included). With ``w = NEIGHBOURS_NETWORK_WEIGHT`` a label's
score is

    w * p_l + (1 - w) * (vote_hidden_l + vote_input_l) / 2

with ``p_l`` the network's probability of label ``l``: its sigmoid under the logistic loss;
under the softmax, which trains against ``y / |y|``, the softmax times the mean number of labels
of a training row, at most 1. Every term is in ``[0, 1]``, so the score is too; it is what
``predict_proba`` gives and what the ranking uses. Chosen by ``bench/bench_neighbours.py``
(``bench/RESULTS.md``, "Neighbour votes at prediction").

Everything here runs on the host (NumPy, and the CPU kernels of ``kernels/neighbours.py`` and
``kernels/topk.py``): the reference set is the training rows and the search is exact (a chunk of
query rows against every training row), which is why it is on by default only up to
:data:`xmc_engine.config.NEIGHBOURS_MAX_ROWS` training rows.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from xmc_engine import progress
from xmc_engine.config import NEIGHBOURS_NETWORK_WEIGHT, NEIGHBOURS_POWER
from xmc_engine.kernels import neighbours, topk
from xmc_engine.validation import normalize_rows

#: Most similarities (query rows x reference rows) or scores (query rows x labels) held at once.
BLOCK = 1 << 24


def host_hidden(params, X: sp.csr_matrix) -> np.ndarray:
    """The last hidden layer's activations of the rows ``X`` (float32, host) under the forward
    of :mod:`xmc_engine.model`: ReLU hidden layers."""
    W = [np.asarray(p) for p in params]
    H = np.maximum(X @ W[0] + W[1], 0, dtype=np.float32)
    for i in range(2, len(W) - 2, 2):
        H = np.maximum(H @ W[i] + W[i + 1], 0)
    return np.asarray(H, dtype=np.float32)


def host_logits(params, H: np.ndarray) -> np.ndarray:
    """Every label's logit (the output layer of :mod:`xmc_engine.model`) of the rows whose last
    hidden layer is ``H`` (:func:`host_hidden`)."""
    return H @ np.asarray(params[-2]) + np.asarray(params[-1])


def network_probabilities(params, H: np.ndarray, loss: str,
                          labels_per_row: float = 1.0) -> np.ndarray:
    """The network's probability of every label (rows of ``H``, the last hidden layer): the
    sigmoid of each logit under ``loss="bce"``; under the softmax, whose target is ``y / |y|``,
    the softmax times ``labels_per_row`` (the training rows' mean), at most 1."""
    Z = host_logits(params, H)
    if loss == "bce":
        return (0.5 * (1.0 + np.tanh(0.5 * Z))).astype(np.float32)
    Z -= Z.max(axis=1, keepdims=True)
    np.exp(Z, out=Z)
    Z *= labels_per_row / Z.sum(axis=1, keepdims=True)
    np.minimum(Z, 1.0, out=Z)
    return Z.astype(np.float32, copy=False)


def _unit_rows(H: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(H, axis=1, keepdims=True)
    return H / np.where(norm > 0, norm, 1.0)


class NeighbourIndex:
    """The training rows a fitted model's predictions vote with.

    Parameters
    ----------
    X : scipy.sparse.csr_matrix, (n, n_features)
        The training rows (canonical CSR, as :func:`xmc_engine.validation.check_X` gives;
        kept scaled to unit norm).
    H : numpy.ndarray, (n, hidden)
        Their last hidden layer (:func:`host_hidden`).
    Y : scipy.sparse.csr_matrix, (n, n_labels)
        Their labels, 0/1.
    k : int
        Neighbours of each vote (at most ``n``).
    unit : bool
        ``X`` and ``H`` are already an index's unit rows (:attr:`X`, :attr:`E`: a saved
        index loaded back), kept as they are.
    """

    def __init__(self, X: sp.csr_matrix, H: np.ndarray, Y: sp.csr_matrix, k: int, *,
                 unit: bool = False):
        if not (X.shape[0] == H.shape[0] == Y.shape[0]):
            raise ValueError(f"reference rows disagree: X {X.shape[0]}, H {H.shape[0]}, "
                             f"Y {Y.shape[0]}")
        if X.shape[0] < 1 or k < 1:
            raise ValueError(f"need at least one reference row and k >= 1, got "
                             f"{X.shape[0]} rows, k={k}")
        # unit rows (cosine similarity whatever ``normalize`` was), not the caller's arrays
        self.X = sp.csr_matrix(X, dtype=np.float32, copy=True)
        self.E = np.array(H, dtype=np.float32)
        if not unit:
            self.X, self.E = normalize_rows(self.X, "l2"), _unit_rows(self.E)
        self.Y = sp.csr_matrix(Y, dtype=np.float32, copy=True)
        self.Y.eliminate_zeros()
        self.Y.data[:] = 1.0
        self.k = int(k)
        self.labels_per_row = self.Y.nnz / self.n_rows
        self._XT = None

    @property
    def n_rows(self) -> int:
        return self.X.shape[0]

    @property
    def n_labels(self) -> int:
        return self.Y.shape[1]

    def _vote(self, S: np.ndarray, scale: float, out: np.ndarray) -> None:
        """Add ``scale`` times the label votes of the ``k`` rows of highest cosine similarity
        in each row of ``S`` (query rows x reference rows) into ``out`` (query rows x labels);
        negative similarities count as 0, a row with no positive similarity votes for
        nothing."""
        k = min(self.k, S.shape[1])
        idx = np.empty((S.shape[0], k), dtype=np.int64)
        sims = np.empty((S.shape[0], k), dtype=np.float32)
        topk.topk_cpu(S, k, idx, sims)
        neighbours.vote_cpu(idx, sims, NEIGHBOURS_POWER, self.Y.indptr, self.Y.indices,
                            scale, out)

    def hidden_similarities(self, H: np.ndarray) -> np.ndarray:
        """Cosine similarities (float32, C-contiguous, query rows x reference rows) of the query
        rows' last hidden layer ``H`` to the reference rows'."""
        return np.ascontiguousarray(_unit_rows(np.asarray(H, dtype=np.float32)) @ self.E.T,
                                    dtype=np.float32)

    def input_similarities(self, X: sp.csr_matrix, out: np.ndarray) -> np.ndarray:
        """Cosine similarities of the query rows ``X`` to the reference rows in the features,
        written into ``out`` (float32, C-contiguous, query rows x reference rows; overwritten).
        Returns ``out``."""
        if self._XT is None:
            self._XT = self.X.T.tocsr()
        Xq = normalize_rows(sp.csr_matrix(X, dtype=np.float32), "l2")
        neighbours.sparse_dot_rows_cpu(Xq.indptr, Xq.indices, Xq.data, self._XT.indptr,
                                       self._XT.indices, self._XT.data, out)
        return out

    def votes(self, X: sp.csr_matrix, H: np.ndarray, scale: float = 1.0,
              out: np.ndarray | None = None) -> np.ndarray:
        """``scale`` times the mean of the hidden-layer vote and the input vote of query rows
        ``X`` with last hidden layer ``H`` (both by cosine similarity), added into ``out``
        (float32, C-contiguous, rows x labels; ``None``: zeros): each vote's entries are in
        ``[0, 1]``. Returns ``out``."""
        if out is None:
            out = np.zeros((X.shape[0], self.n_labels), dtype=np.float32)
        S = self.hidden_similarities(H)
        self._vote(S, 0.5 * scale, out)
        self._vote(self.input_similarities(X, out=S), 0.5 * scale, out)  # S's buffer again
        return out

    def blend_topk(self, params, loss: str, X: sp.csr_matrix, k: int,
                   row_chunk: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` labels and blended scores of the rows ``X`` (normalised as in training) of
        the network ``params`` trained with ``loss``: ``(labels int64, scores float32)``, each
        ``(rows, min(k, n_labels))``, by descending score (ties: the lower label first)."""
        n, L = X.shape[0], self.n_labels
        k = min(k, L)
        rows = max(1, BLOCK // max(L, self.n_rows))
        if row_chunk is not None:
            rows = min(rows, row_chunk)
        labels = np.empty((n, k), dtype=np.int64)
        scores = np.empty((n, k), dtype=np.float32)
        w = NEIGHBOURS_NETWORK_WEIGHT
        with progress.bar(total=n, desc="ranking with the votes", unit=" rows") as bar:
            for start in range(0, n, rows):
                self._blend_chunk(params, loss, X[start:start + rows], k, w,
                                  labels[start:start + rows], scores[start:start + rows])
                bar.update(min(rows, n - start))
        return labels, scores

    def _blend_chunk(self, params, loss: str, Xc: sp.csr_matrix, k: int, w: float,
                     labels: np.ndarray, scores: np.ndarray) -> None:
        """:meth:`blend_topk` of the rows ``Xc``, written into ``labels`` / ``scores``."""
        H = host_hidden(params, Xc)
        if loss == "bce" and k < self.n_labels:
            # the votes first; the sigmoid only where a label has a vote or is among the
            # network's own top k (the rest cannot reach the top k of the blend)
            S = self.votes(Xc, H, 1.0 - w)
            Z = np.ascontiguousarray(host_logits(params, H), dtype=np.float32)
            top = np.empty((Z.shape[0], k), dtype=np.int64)
            topk.topk_cpu(Z, k, top, np.empty((Z.shape[0], k), dtype=np.float32))
            neighbours.add_sigmoid_cpu(Z, top, w, S)
        else:
            S = w * network_probabilities(params, H, loss, self.labels_per_row)
            self.votes(Xc, H, 1.0 - w, out=S)
        topk.topk_cpu(S, k, labels, scores)

