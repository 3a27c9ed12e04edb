"""The output layer at host level: GEMMs, softmax cross-entropy and label chunks (DESIGN.md §2).

Written once against the :class:`~xmc_engine.backends.base.Backend` protocol: the GEMMs go to
``backend.matmul`` / ``gemm_acc`` / ``gemm_update`` (BLAS or cuBLAS), the softmax passes to the
backend's launchers of :mod:`xmc_engine.kernels.output_layer`, and every scratch array comes from
``backend.workspace`` (kept between steps: a step allocates nothing of size ``B x L`` or
``n_hidden x L``). The backends' ``output_layer_step``, ``output_layer_grad`` and
``predict_scores_topk`` call these functions with their device and stream current.

Arrays (all on the backend's device)
------------------------------------
H : (B, n_hidden) float32                 hidden activations, C-contiguous
W2 : (n_hidden, L) float32                C-contiguous, updated in place by the step
b2 : (L,) float32                         updated in place by the step
y_indptr : (B + 1,) int32/int64           CSR row pointers of the batch's labels (no data)
y_indices : (n_pos,) int32/int64          label ids, unique within a row
dH_out : (B, n_hidden) float32            gradient w.r.t. H (computed with W2 BEFORE the update)

Loss and gradient: :mod:`xmc_engine.kernels.output_layer` (the softmax cross-entropy) or
:mod:`xmc_engine.kernels.bce_output` (``loss="bce"``, the one-vs-all logistic loss); mean over the
``B`` rows of the batch, ``scale = 1/B``; the summed, unscaled loss is returned.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import njit

from xmc_engine.config import TRAIN_LOSSES

__all__ = ["FrequencyProposal", "LSHProposal", "output_layer_grad", "output_layer_step",
           "predict_scores_topk", "sample_candidates", "sampled_output_grad"]

_F32 = np.float32


#: Whether the sampled output layer's logistic loss (``loss="bce"``) weights each drawn negative
#: by the inverse of its chance of being drawn (an unbiased estimate of the sum over every label
#: that is not a positive) or, ``False``, counts it once. Chosen by
#: ``bench/bench_bce_negatives.py`` (``bench/RESULTS.md``, "The logistic loss"): unweighted, P@1
#: / P@3 / P@5 within 0.003 of weighted and PSP@5 higher on each of three sets (debian_builddeps
#: 0.278 against 0.261), since the full weight pushes the rare labels down as hard as the exact
#: loss does.
BCE_WEIGHTED_NEGATIVES = False


def is_bce(loss: str) -> bool:
    """Whether ``loss`` (a :data:`~xmc_engine.config.TRAIN_LOSSES` name) is the logistic loss; any
    other name is refused (``ValueError``). The one check of the loss name below the config."""
    if loss not in TRAIN_LOSSES:
        raise ValueError(f"loss={loss!r}: choose one of {', '.join(TRAIN_LOSSES)}")
    return loss == "bce"


def _chunks(L: int, label_chunk: int | None) -> tuple[int, list[tuple[int, int]]]:
    """Chunk width ``C`` and the ``[c0, c1)`` label ranges covering ``L`` labels."""
    C = L if not label_chunk or label_chunk >= L else int(label_chunk)
    return C, [(c0, min(L, c0 + C)) for c0 in range(0, L, C)]


def _workspace_2d(backend, name: str, rows: int, cols: int, max_cols: int):
    """A (rows, cols) C-contiguous view of a workspace sized for (rows, max_cols): the chunk
    buffers keep one allocation although the last chunk is narrower."""
    return backend.workspace(name, (rows * max_cols,))[: rows * cols].reshape(rows, cols)


def output_layer_step(backend, H, W2, b2, y_indptr, y_indices, lr: float, dH_out, *,
                      label_chunk: int | None = None, loss: str = "softmax"):
    """One SGD step of the output layer; returns the summed loss of the batch.

    ``Z = H @ W2 + b2``; ``dZ = (softmax(Z) - y/|y|) / B``; ``dH_out[:] = dZ @ W2.T`` (old W2);
    ``W2 -= lr * H.T @ dZ``; ``b2 -= lr * dZ.sum(0)``. With ``label_chunk=C`` the logits are
    produced C labels at a time and the full (B, L) matrix is never held (two passes: row
    statistics, then recompute -> gradient -> dH accumulation -> immediate W2/b2 chunk update).
    ``loss="bce"``: the one-vs-all logistic loss, ``dZ = (sigmoid(Z) - Y) / B`` (chunked in
    one pass: it needs no row statistics).

    Returns
    -------
    float or 0-d device array
        A Python float on host backends; on CUDA a 0-d array queued on the backend's stream
        (read it with ``backend.to_float``, which waits for the stream).
    """
    return _output_layer(backend, H, W2, b2, y_indptr, y_indices, lr, dH_out, None, None,
                         label_chunk, loss)


def output_layer_grad(backend, H, W2, b2, y_indptr, y_indices, *, dH_out=None, dW2_out=None,
                      db2_out=None, label_chunk: int | None = None, loss: str = "softmax"):
    """Gradients of the mean loss without updating: ``(loss_sum, dW2, db2, dH)``.

    Same semantics as :func:`output_layer_step` (``dW2 = H.T @ dZ``, ``db2 = dZ.sum(0)``,
    ``dH = dZ @ W2.T``); outputs are written into the ``*_out`` arrays when given, otherwise
    into fresh arrays of the backend (float32).
    """
    B, nh = H.shape
    L = W2.shape[1]
    dH_out = backend.empty((B, nh)) if dH_out is None else dH_out
    dW2_out = backend.empty((nh, L)) if dW2_out is None else dW2_out
    db2_out = backend.empty((L,)) if db2_out is None else db2_out
    total = _output_layer(backend, H, W2, b2, y_indptr, y_indices, 0.0, dH_out, dW2_out,
                          db2_out, label_chunk, loss)
    return total, dW2_out, db2_out, dH_out


def _output_layer(be, H, W2, b2, y_indptr, y_indices, lr, dH_out, dW2_out, db2_out,
                  label_chunk, loss="softmax"):
    """The step (``dW2_out is None``: update W2, b2 in place) or the gradient (into the outs)."""
    bce = is_bce(loss)
    B = H.shape[0]
    L = W2.shape[1]
    update = dW2_out is None
    scale = 1.0 / max(B, 1)
    C, chunks = _chunks(L, label_chunk)
    if B == 0:
        dH_out[...] = 0
        if not update:
            dW2_out[...] = 0
            db2_out[...] = 0
        return 0.0
    if len(chunks) == 1:  # plain path: three GEMMs, logits in memory
        Z = be.workspace("Z", (B, L))
        be.matmul(H, W2, Z)                                    # GEMM 1: logits
        db2 = db2_out if not update else be.workspace("db2", (L,))
        if bce:
            total = be.bce_bias(Z, b2, 0, y_indptr, y_indices, scale, db2)
        else:
            total = be.softmax_bias(Z, b2, y_indptr, y_indices, scale, db2)  # bias+xent+sum
        be.matmul(Z, W2.T, dH_out)                             # GEMM 2: dH with the old W2
        if update:
            be.gemm_update(W2, H, Z, -lr)                      # GEMM 3: W2 -= lr H^T dZ
            be.axpy(b2, db2, -lr)
        else:
            be.matmul(H.T, Z, dW2_out)                         # GEMM 3: dW2
        return total
    # label-chunked path (DESIGN.md §2). The softmax first needs each row's log-sum-exp (pass 1:
    # row statistics over every chunk); the logistic loss does not (every label's gradient is
    # its own). Then one pass: recompute each chunk's logits -> dZc -> dH, W2c, b2c.
    if bce:
        total = 0.0

        def chunk_dz(Zc, c0, b2c, out, alpha, beta):  # dZc in place; the chunk's loss
            return be.bce_bias(Zc, b2c, c0, y_indptr, y_indices, scale, out, alpha, beta)
    else:
        m, s, ysum = be.row_stats(B)
        for c0, c1 in chunks:
            Zc = _workspace_2d(be, "Zc", B, c1 - c0, C)
            be.matmul(H, W2[:, c0:c1], Zc)
            be.chunk_stats(Zc, b2[c0:c1], c0, y_indptr, y_indices, m, s, ysum)
        total, lse = be.chunk_loss(m, s, ysum, y_indptr)

        def chunk_dz(Zc, c0, b2c, out, alpha, beta):  # dZc in place; the loss is in total
            be.chunk_grad(Zc, b2c, c0, y_indptr, y_indices, lse, scale, out, alpha, beta)
    dH_out[...] = 0
    for c0, c1 in chunks:
        Zc = _workspace_2d(be, "Zc", B, c1 - c0, C)
        W2c = W2[:, c0:c1]
        be.matmul(H, W2c, Zc)                                  # recompute the chunk's logits
        if update:  # dZc, and b2c -= lr * dZc.sum(0) (after the kernel has read b2c)
            part = chunk_dz(Zc, c0, b2[c0:c1], b2[c0:c1], -lr, 1.0)
        else:
            part = chunk_dz(Zc, c0, b2[c0:c1], db2_out[c0:c1], 1.0, 0.0)
        if part is not None:  # the logistic loss of this chunk
            total = total + part
        be.gemm_acc(dH_out, Zc, W2c.T)                         # dH += dZc W2c^T (old W2c)
        if update:
            be.gemm_update(W2c, H, Zc, -lr)                    # W2c -= lr H^T dZc
        else:
            be.matmul(H.T, Zc, dW2_out[:, c0:c1])
    return total


def predict_scores_topk(backend, H, W2, b2, k: int, *, label_chunk: int | None = None):
    """Top-k labels of ``H @ W2 + b2``: ``(idx int64 (B, k), val float32 (B, k))``, descending.

    ``k`` is clipped to ``L``. With ``label_chunk`` the scores are produced chunk by chunk and the
    running top-k is merged with each chunk's top-k (:mod:`xmc_engine.kernels.topk`). A backend
    with ``topk_fold`` (the CPU's) folds each chunk's logits, bias included, into the running
    lists in one pass instead (the same labels and scores; ``bench/bench_predict.py``).
    """
    be = backend
    B = H.shape[0]
    L = W2.shape[1]
    k = int(min(k, L))
    C, chunks = _chunks(L, label_chunk)
    idx = be.empty((B, k), np.int64)
    val = be.empty((B, k), _F32)
    if B == 0 or k == 0:
        return idx, val
    # the running lists' counts per row where the backend folds each chunk into them
    filled = np.zeros(B, np.int64) if hasattr(be, "topk_fold") else None
    for c0, c1 in chunks:
        Zc = _workspace_2d(be, "Zc", B, c1 - c0, C)
        be.matmul(H, W2[:, c0:c1], Zc)
        if filled is not None:
            be.topk_fold(Zc, b2[c0:c1], c0, idx, val, filled)
            continue
        be.add_bias(Zc, b2[c0:c1])
        if len(chunks) == 1:
            be.topk_into(Zc, k, idx, val)
            break
        kc = min(k, c1 - c0)
        ic = be.empty((B, kc), np.int64)
        vc = be.empty((B, kc), _F32)
        be.topk_into(Zc, kc, ic, vc)
        ic += c0
        if c0 == 0:
            idx, val = ic, vc
        else:
            kk = min(k, idx.shape[1] + kc)
            i2 = be.empty((B, kk), np.int64)
            v2 = be.empty((B, kk), _F32)
            be.topk_merge(idx, val, ic, vc, i2, v2)
            idx, val = i2, v2
    return idx, val


class FrequencyProposal:
    """Negatives drawn in proportion to a power of the labels' training frequency.

    ``q_j ∝ (n_j + 1) ** power`` with ``n_j`` the rows that hold label ``j`` (``power=0.75``,
    word2vec's unigram rule, by default; ``+1`` so that labels never seen in training can be
    drawn). Frequent labels have large logits, so drawing them more often than uniformly lowers
    the variance of the sampled estimate of the partition sum (Bengio & Senecal 2008).

    Parameters
    ----------
    counts : (n_labels,) int array, the rows per label (``np.bincount(Y.indices)``)
    power : float >= 0 (0: the uniform rule, drawn with replacement)
    """

    def __init__(self, counts, power: float = 0.75):
        counts = np.asarray(counts, dtype=np.float64)
        if counts.ndim != 1 or counts.size < 2 or (counts < 0).any():
            raise ValueError("FrequencyProposal: need a count >= 0 for each of >= 2 labels")
        q = (counts + 1.0) ** float(power)
        self.q = q / q.sum()
        self._cdf = np.cumsum(self.q)
        # guide table (Chen & Asau 1974): _guide[g] is the first label whose cdf passes the
        # g-th of GUIDE_CELLS equal steps of u, so a draw searches one cell, not the whole cdf
        cells = min(GUIDE_CELLS, self.q.size)
        self._guide = np.searchsorted(self._cdf, np.arange(cells + 1) * (self._cdf[-1] / cells),
                                      side="right").astype(np.int64)
        self.power = float(power)

    @property
    def n_labels(self) -> int:
        return self.q.size

    def draw(self, rng, k: int) -> np.ndarray:
        """``k`` labels drawn with replacement from ``q`` (int64, ascending).

        The ``k`` uniforms are sorted first and each is found by a binary search inside its
        guide-table cell: the labels are those of ``searchsorted(cdf, u, "right")`` on the same
        uniforms (a test checks it), at about a third of its cost at 670,091 labels, where a
        search over the whole 5 MB cdf misses the cache at every level."""
        u = np.sort(rng.random(int(k))) * self._cdf[-1]
        return _guided_search(self._cdf, self._guide, u)

    def inclusion(self, labels, k: int) -> np.ndarray:
        """``P(label in k draws) = 1 - (1 - q) ** k`` for each of ``labels``."""
        return _inclusion(self.q[labels], k)

    def before_step(self, backend, W2) -> None:
        """Nothing to refresh: the counts do not change."""

    def negatives(self, pos, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
        """The distinct labels of ``k`` draws that are not in ``pos`` (sorted int64, distinct),
        and ``-log P(drawn)`` of each (float32): :func:`sample_candidates`' proposal protocol."""
        neg = _distinct_not_in(self.draw(rng, k), np.asarray(pos, dtype=np.int64))
        return neg, _log_weight(self.q[neg], k)


@njit(nogil=True, cache=True)
def _distinct_not_in(drawn, pos):
    """The distinct values of ascending ``drawn`` that are not in ascending ``pos`` (a merge
    of the two sorted lists; ``np.setdiff1d`` of them, without its sorts)."""
    out = np.empty(drawn.shape[0], dtype=np.int64)
    n = j = 0
    for i in range(drawn.shape[0]):
        x = drawn[i]
        if n > 0 and out[n - 1] == x:
            continue
        while j < pos.shape[0] and pos[j] < x:
            j += 1
        if j < pos.shape[0] and pos[j] == x:
            continue
        out[n] = x
        n += 1
    return out[:n]


#: cells of :class:`FrequencyProposal`'s guide table (at most one per label): 2**16 int64, 0.5 MB
GUIDE_CELLS = 1 << 16


@njit(nogil=True, cache=True)
def _guided_search(cdf, guide, u):
    """``min(searchsorted(cdf, u, side="right"), len(cdf) - 1)`` for ascending ``u`` in
    ``[0, cdf[-1])``, each searched within its cell of ``guide`` (``guide[g]`` =
    ``searchsorted(cdf, g * cdf[-1] / cells, "right")``)."""
    n, cells = cdf.shape[0], guide.shape[0] - 1
    scale = cells / cdf[-1]
    out = np.empty(u.shape[0], dtype=np.int64)
    for i in range(u.shape[0]):
        x = u[i]
        g = min(int(x * scale), cells - 1)
        lo, hi = guide[g], min(guide[g + 1] + 1, n)  # the answer lies in [lo, hi]
        # rounding of g * cdf[-1] / cells can put x just outside its cell: widen if so
        while lo > 0 and cdf[lo - 1] > x:
            lo = guide[g - 1] if g > 0 else 0
            g -= 1
        while hi < n and cdf[hi - 1] <= x:
            hi = n
        while lo < hi:  # first index with cdf > x
            mid = (lo + hi) // 2
            if cdf[mid] <= x:
                lo = mid + 1
            else:
                hi = mid
        out[i] = min(lo, n - 1)
    return out


def _inclusion(q, k: int) -> np.ndarray:
    """``1 - (1 - q) ** k``: the chance that an item of per-draw probability ``q`` is among
    ``k`` draws with replacement (computed without cancellation for small ``q``)."""
    return -np.expm1(int(k) * np.log1p(-q))


def _log_weight(q, k: int) -> np.ndarray:
    """The log-weight of negatives of per-draw probability ``q`` in ``k`` draws:
    ``-log P(drawn)`` (Horvitz-Thompson), float32."""
    return (-np.log(_inclusion(q, k))).astype(_F32)


class LSHProposal:
    """Negatives half uniform, half "hard": labels whose ``W2`` column hashes to the bucket of
    one of the batch's positives (SimHash, Charikar 2002: the signs of ``bits`` random
    projections of a column; SLIDE, Chen et al. 2020, samples output neurons the same way).
    Labels whose columns point the same way as a positive's score high where the positive
    does, so they are the negatives that cost the most probability mass.

    Each of the ``k`` draws (with replacement) comes from the union ``U`` of the positives'
    buckets with probability ``mix``, else uniformly from all labels, so a label's chance per
    draw is ``q = (1 - mix) / L + mix [j in U] / |U|``; each distinct drawn negative gets the
    weight ``1 / (1 - (1 - q) ** k)`` (unbiased, as :class:`FrequencyProposal`'s). The hash
    table is rebuilt from the current ``W2`` every ``refresh_steps`` steps
    (:meth:`before_step`), and on the first.

    Parameters
    ----------
    n_labels, n_hidden : int, the shape of ``W2`` is (n_hidden, n_labels)
    bits : int or None; SimHash bits (None: about 8 labels per bucket, ``log2(L / 8)``, 4-20)
    mix, refresh_steps, seed : float in [0, 1], int >= 1, int (the random projections)
    """

    def __init__(self, n_labels: int, n_hidden: int, *, bits: int | None = None,
                 mix: float = 0.5, refresh_steps: int = 100, seed: int = 0):
        if n_labels < 2 or n_hidden < 1 or not 0.0 <= mix <= 1.0 or refresh_steps < 1:
            raise ValueError("LSHProposal: need n_labels >= 2, n_hidden >= 1, 0 <= mix <= 1, "
                             "refresh_steps >= 1")
        self.n_labels = int(n_labels)
        bits = bits or int(np.clip(round(np.log2(n_labels / 8)), 4, 20))
        self.planes = np.random.default_rng(seed).standard_normal((n_hidden, int(bits)))
        self.planes = self.planes.astype(_F32)
        self.mix = float(mix)
        self.refresh_steps = int(refresh_steps)
        self._steps = 0
        self._codes = None      # (L,) int64 bucket of each label
        self._order = None      # labels sorted by bucket
        self._sorted = None     # their buckets

    def refresh(self, W2_host) -> None:
        """Rebuild the buckets from ``W2`` (host array, (n_hidden, n_labels))."""
        signs = (np.asarray(W2_host, dtype=_F32).T @ self.planes) > 0
        self._codes = signs @ (1 << np.arange(signs.shape[1], dtype=np.int64))
        self._order = np.argsort(self._codes, kind="stable")
        self._sorted = self._codes[self._order]

    def before_step(self, backend, W2) -> None:
        """Rebuild the buckets every ``refresh_steps`` steps (and before the first)."""
        if self._codes is None or self._steps % self.refresh_steps == 0:
            self.refresh(backend.to_host(W2))
        self._steps += 1

    def bucket_mates(self, pos) -> np.ndarray:
        """``U``: every label in the bucket of one of ``pos`` (sorted, distinct, int64)."""
        if self._codes is None:
            raise RuntimeError("LSHProposal: refresh(W2) before drawing")
        codes = np.unique(self._codes[pos])
        lo = np.searchsorted(self._sorted, codes, side="left")
        hi = np.searchsorted(self._sorted, codes, side="right")
        if not len(codes):
            return np.empty(0, np.int64)
        return np.sort(np.concatenate([self._order[a:b] for a, b in zip(lo, hi, strict=True)]))

    def negatives(self, pos, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
        """:func:`sample_candidates`' proposal protocol (:meth:`FrequencyProposal.negatives`)."""
        U = self.bucket_mates(pos)
        mix = self.mix if len(U) else 0.0
        n_hard = int(rng.binomial(int(k), mix))
        draws = np.concatenate([U[rng.integers(0, len(U), n_hard)] if n_hard else
                                np.empty(0, np.int64),
                                rng.integers(0, self.n_labels, int(k) - n_hard)])
        neg = _sorted_distinct(draws)
        neg = neg[~np.isin(neg, pos, assume_unique=True)]
        q = (1.0 - mix) / self.n_labels + np.where(np.isin(neg, U, assume_unique=True),
                                                   mix / max(len(U), 1), 0.0)
        return neg, _log_weight(q, k)


def sample_candidates(y_indices, n_labels: int, negatives: int, rng,
                      proposal=None) -> tuple:
    """The candidate labels of a sampled step: the batch's positives plus ``negatives`` others.

    The negatives are a uniform random subset of the labels that no row of the batch has (the
    first distinct ones of a stream of uniform draws, so no ``O(n_labels)`` work). Each row's
    softmax then runs over its own positives, the other rows' positives ("in-batch" negatives,
    present with probability 1 given the batch) and the sampled ones.

    Correction (sampled softmax, Jean et al. 2015 §3; Bengio & Senecal 2008): the partition sum
    over all labels is estimated by weighting each sampled negative with the inverse of its
    inclusion probability, ``(n_labels - n_pos) / n_neg`` with ``n_pos`` the batch's distinct
    positives and ``n_neg`` the negatives drawn; the batch's positives get weight 1. The weight
    enters as ``log_weight`` added to the logits of the negatives; for this uniform rule it is
    the same for every negative (it is not a constant shift of the whole softmax, because the
    positives do not get it). When ``negatives`` covers every other label, ``log_weight`` is 0
    and the step is the exact softmax.

    With a ``proposal`` (:class:`FrequencyProposal`, :class:`LSHProposal`) the negatives are
    the distinct labels of ``negatives`` draws from it, less the batch's positives, and each
    negative ``j`` gets its own weight ``1 / P(j drawn)`` (the Horvitz-Thompson estimate of the
    partition sum over the labels that are not positives, unbiased like the uniform rule's):
    ``log_weight`` is then an array, one entry per negative.

    Parameters
    ----------
    y_indices : (n_pos_total,) int array, host
        Label ids of the batch rows (CSR ``indices``; unique within a row).
    n_labels, negatives : int
    rng : numpy.random.Generator
    proposal : FrequencyProposal, LSHProposal or None (uniform)

    Returns
    -------
    cols : (m,) int64, host
        The batch's distinct positives (sorted), then the negatives.
    local_y : (n_pos_total,) int32, host
        ``y_indices`` renumbered as positions in ``cols``.
    n_pos : int
        Distinct positives (the first ``n_pos`` entries of ``cols``).
    log_weight : float, or (m - n_pos,) float32 array with a ``proposal``
        ``log((n_labels - n_pos) / n_neg)`` (0 without negatives); with a proposal
        ``-log P(j drawn)`` per negative ``j``.
    """
    pos = _sorted_distinct(y_indices)
    local_y = np.searchsorted(pos, y_indices).astype(np.int32)
    if proposal is not None:
        if proposal.n_labels != n_labels:
            raise ValueError(f"proposal over {proposal.n_labels} labels for {n_labels} labels")
        if negatives <= 0:
            return pos, local_y, len(pos), 0.0
        neg, log_weight = proposal.negatives(pos, negatives, rng)
        return np.concatenate([pos, neg]), local_y, len(pos), log_weight
    free = n_labels - len(pos)
    k = min(int(negatives), free)
    if k <= 0:
        return pos, local_y, len(pos), 0.0
    if k == free:
        neg = np.setdiff1d(np.arange(n_labels, dtype=np.int64), pos, assume_unique=True)
    else:
        neg = np.empty(k, dtype=np.int64)
        seen = _label_mask(n_labels)
        n = 0
        while n < k:  # one round almost always: 2k + n_pos draws for k distinct
            draw = rng.integers(0, n_labels, size=2 * k + len(pos))
            n = _first_distinct(draw, pos, neg, n, seen)
    log_weight = float(np.log(free / len(neg)))
    return np.concatenate([pos, neg]), local_y, len(pos), log_weight


def _sorted_distinct(a) -> np.ndarray:
    """``np.unique(a)`` as int64 by a sort and a comparison of neighbours: the same array at
    a fraction of the cost for a batch's labels (NumPy 2's ``unique`` took 115-180 us on 1,280
    labels here, the sort 20 us)."""
    s = np.sort(np.asarray(a, dtype=np.int64))
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if s.size else s


_MASKS = threading.local()  # one scratch mask per thread (each device's worker draws its own)


def _label_mask(n_labels: int) -> np.ndarray:
    """This thread's all-False bool mask of ``n_labels`` entries (``_first_distinct`` leaves it
    all-False again)."""
    mask = getattr(_MASKS, "mask", None)
    if mask is None or mask.size != n_labels:
        mask = _MASKS.mask = np.zeros(n_labels, dtype=np.bool_)
    return mask


@njit(nogil=True, cache=True)
def _first_distinct(draw, pos, neg, n, seen):
    """Append to ``neg[:n]`` the draws, in order, that are neither a positive (``pos``) nor
    already taken, until ``neg`` is full; returns the new count. ``seen`` (bool, one per label)
    must be all False on entry and is again on return. The same labels as ``np.isin`` and
    ``np.unique(return_index=True)`` over ``[neg[:n], draws]`` would keep, without the GIL."""
    k = neg.shape[0]
    for i in range(pos.shape[0]):
        seen[pos[i]] = True
    for i in range(n):
        seen[neg[i]] = True
    for i in range(draw.shape[0]):
        if n == k:
            break
        x = draw[i]
        if not seen[x]:
            seen[x] = True
            neg[n] = x
            n += 1
    for i in range(pos.shape[0]):
        seen[pos[i]] = False
    for i in range(n):
        seen[neg[i]] = False
    return n


def sampled_output_grad(backend, H, W2, b2, cols, n_pos: int, log_weight: float, y_indptr,
                        local_y, *, loss: str = "softmax") -> tuple:
    """Loss and gradients of the output layer on the candidate labels ``cols`` only.

    ``W2s, b2s = W2[:, cols], b2[cols]`` (gathered, :mod:`xmc_engine.kernels.sampled_output`);
    ``Zs = H @ W2s + b2s`` plus ``log_weight`` on the negatives (``cols[n_pos:]``,
    :func:`sample_candidates`); ``dZs = (softmax(Zs) - y/|y|) / B``. Three GEMMs of
    ``B x n_hidden x m`` instead of ``B x n_hidden x n_labels``. ``loss="bce"``: the logistic
    loss on the candidates, each term counted once (``log_weight`` is not added to the logits;
    with :data:`BCE_WEIGHTED_NEGATIVES` the negatives' terms are weighted by
    ``exp(log_weight)``).

    Parameters
    ----------
    backend, H, W2, b2 : as in :func:`output_layer_grad` (``W2``, ``b2`` are only read)
    cols : (m,) int64 on the backend, unique label ids
    n_pos, log_weight : from :func:`sample_candidates` (``log_weight`` a float, or a host array
        of one weight per negative)
    y_indptr : (B + 1,) int on the backend
    local_y : (n_pos_total,) int32 on the backend, label positions in ``cols``

    Returns
    -------
    (loss_sum, dW2s, db2s, dH) : ``dW2s`` (n_hidden, m) and ``db2s`` (m,) are the gradients of
        the columns ``cols`` (backend workspaces, valid until the next sampled step);
        ``dH`` (B, n_hidden) a fresh array. Mean over the ``B`` rows; summed loss.
    """
    be = backend
    B, nh = H.shape
    m = int(cols.shape[0])
    W2s = be.workspace("W2s", (nh, m))
    b2s = be.workspace("b2s", (m,))
    be.gather_columns(W2, b2, cols, W2s, b2s)
    bce = is_bce(loss)
    colw = None  # the logistic loss's column weights (None: every term once)
    if bce:
        if BCE_WEIGHTED_NEGATIVES:
            w = np.ones(m, dtype=_F32)
            w[n_pos:] = np.exp(np.asarray(log_weight, dtype=np.float64))
            colw = be.asarray(w)
    elif m > n_pos and np.ndim(log_weight):  # a weight per negative (a non-uniform proposal)
        b2s[n_pos:] += be.asarray(np.asarray(log_weight, dtype=_F32))
    elif m > n_pos and log_weight:
        b2s[n_pos:] += _F32(log_weight)
    dH = be.empty((B, nh))
    dW2s = be.workspace("dW2s", (nh, m))
    db2s = be.workspace("db2s", (m,))
    if B == 0 or m == 0:
        dH[...] = 0
        dW2s[...] = 0
        db2s[...] = 0
        return 0.0, dW2s, db2s, dH
    Z = be.workspace("Zs", (B, m))
    be.matmul(H, W2s, Z)
    if bce:
        total = be.bce_bias(Z, b2s, 0, y_indptr, local_y, 1.0 / B, db2s, colw=colw)
    else:
        total = be.softmax_bias(Z, b2s, y_indptr, local_y, 1.0 / B, db2s)
    be.matmul(Z, W2s.T, dH)
    be.matmul(H.T, Z, dW2s)
    return total, dW2s, db2s, dH
