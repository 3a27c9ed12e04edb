"""Model merging as pure functions: merge weights, adaptive normalization, weighted sum, momentum.

arXiv 2110.07029 §III-B ("normalized model merging"), DESIGN.md §4.3. Array arguments are lists of
parameter arrays (one list per replica, same order and shapes), on the device of ``backend``
(a :class:`~xmc_engine.backends.base.SchedulerBackend`). The arithmetic goes through the backend's
merge launchers (``all_finite``, ``weighted_sum``, ``momentum``, ``elastic``, and ``merge_rows``
/ ``copy_rows`` where its ``tracks_rows`` flag says so), which order their reads after the
other replicas' pending writes (``backend.fence``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

from xmc_engine.errors import DivergenceError

logger = logging.getLogger(__name__)

__all__ = [
    "FLAG_RULES",
    "SHARD_MIN_VALUES",
    "NormTrend",
    "adaptive_normalization",
    "central_momentum",
    "delta_stats",
    "elastic_update",
    "find_nonfinite",
    "l2_norm",
    "merge_changed_rows",
    "merge_weights",
    "reduce_gradients",
    "sq_norms",
    "weighted_merge",
]

#: Rules for the L2-norm trend flag of adaptive normalization (see :class:`NormTrend`).
FLAG_RULES = ("norm_rise", "always", "never")
#: :func:`merge_changed_rows` splits the changed ``W1`` rows over the device workers (its
#: ``run_shards``) from this many values (rows x hidden units, 1 MiB of float32) on, where
#: they are merged with the replicas' weights ``p`` (the paper's; not the per-row weights).
#: The workers wait idle at the barrier, each on its own core and thread budget, so the split
#: leaves no OpenMP helper spinning on a core, as two numba threads on the main thread do
#: (``runner.MERGE_ONE_THREAD_MAX_S``). Measured with the merges of each run alternating
#: between the split and one pass (``bench/bench_merge_cpu.py --in-runs ... --shard-alternate``,
#: ``bench/RESULTS.md``, "The merge's rows split over the device workers"): with the paper's
#: weights (the logistic loss) debian_debtags', debian_builddeps', rcv1sub1's and the
#: synthetic 30,000-label shape's merges took 0.51-0.93x the time on ``cpu,cpu`` and
#: ``cpu,cpu@0.5``; with the per-row weights (the softmax on that shape) 1.27x and 1.65x,
#: so those rows are merged in one pass; and only while the main thread merges on one
#: thread (``Trainer._run_shards``: at the Amazon-670K shape, whose merges run on its full
#: budget, the parts took 1.31x its time). The line itself is not measured: it is an estimate
#: of where handing out the parts (two queue hand-offs, of the order of 0.1 ms) is paid back
#: at about 1 ns a merged value; delicious' 500 x 128 stays under it.
SHARD_MIN_VALUES = 1 << 18


def merge_weights(updates: Sequence[float]) -> np.ndarray:
    """Normalized merge weights ``p_i = c_i / sum_j c_j`` (arXiv 2110.07029 §III-B).

    Parameters
    ----------
    updates : sequence of float, length n_devices
        ``c_i``: the updates (steps) device ``i`` made in the period (the paper's), or what
        else the weights are the shares of (``AdaptiveConfig.weight_by``: the rows it trained
        on).

    Returns
    -------
    numpy.ndarray of float64, shape (n_devices,)
        Sums to 1. When every count is 0 the weights are uniform.
    """
    c = np.asarray(updates, dtype=np.float64)
    if c.ndim != 1 or c.size == 0 or np.any(c < 0) or not np.all(np.isfinite(c)):
        raise ValueError(f"update counts must be a non-empty list of finite counts >= 0, got {c}")
    total = c.sum()
    if total == 0:
        return np.full(c.size, 1.0 / c.size)
    return c / total


def adaptive_normalization(p: Sequence[float], flag: int, boost: float = 0.1) -> np.ndarray:
    """Adaptive normalization of merge weights (arXiv 2110.07029 §III-B, DESIGN.md §4.3).

    When ``flag == +1`` the largest weight is multiplied by ``1 + boost`` and the smallest by
    ``1 - boost``, then the weights are renormalised to sum to 1. Otherwise (and when all
    weights are equal, or there is one device) ``p`` is returned unchanged (as a copy). Ties go
    to the lowest index.

    Parameters
    ----------
    p : sequence of float, shape (n_devices,)
        Merge weights summing to 1.
    flag : int
        The L2-norm trend flag (+1 to boost; see :class:`NormTrend`).
    boost : float
        Relative change, the paper's 10 %: ``0.1``.
    """
    q = np.array(p, dtype=np.float64)
    if flag != 1 or q.size < 2 or boost == 0:
        return q
    hi, lo = int(np.argmax(q)), int(np.argmin(q))
    if q[hi] == q[lo]:
        return q
    q[hi] *= 1.0 + boost
    q[lo] *= 1.0 - boost
    return q / q.sum()


class NormTrend:
    """The L2-norm trend flag that switches adaptive normalization on.

    The paper boosts the weights "while the L2-norm of the merged model rises" without giving the
    exact condition. Ours, rule ``"norm_rise"``: after merge ``t`` the flag is ``+1`` iff
    ``||w̄_t||_2 > ||w̄_{t-1}||_2``, where ``w̄`` is the merged model *before* momentum and the norm
    is taken over all parameter arrays together; the flag is then used at merge ``t + 1`` (so each
    merge needs only one weighted sum). Before two merges have been seen the flag is ``0``. Rule
    ``"always"`` gives ``+1`` at every merge, rule ``"never"`` gives ``0`` (no boost: the
    baseline to benchmark the boost against).
    """

    def __init__(self, rule: str = "norm_rise"):
        if rule not in FLAG_RULES:
            raise ValueError(f"unknown flag rule {rule!r}; expected one of {FLAG_RULES}")
        self.rule = rule
        self.norms: list[float] = []

    @property
    def flag(self) -> int:
        """``+1`` (boost at the next merge) or ``0``."""
        if self.rule == "always":
            return 1
        if self.rule == "never" or len(self.norms) < 2:
            return 0
        return 1 if self.norms[-1] > self.norms[-2] else 0

    def observe(self, norm: float) -> None:
        """Record the L2 norm of the merged model of the merge just done."""
        self.norms.append(float(norm))
        del self.norms[:-2]


def sq_norms(params: Sequence, backend) -> list[float]:
    """``sum(a**2)`` of each array (host floats; on the backend's stream, after the other
    streams' pending writes; synchronizes it)."""
    xp = backend.xp
    out = []
    with backend.activate():
        backend.fence()
        for a in params:
            v = xp.ravel(a, order="K")  # no copy of a label-major W2
            out.append(backend.to_float(xp.dot(v, v)))  # synchronize!
    return out


def l2_norm(params: Sequence, backend) -> float:
    """L2 norm of all parameter arrays together (host float; synchronizes the device)."""
    return math.sqrt(sum(sq_norms(params, backend)))


def find_nonfinite(replica_params: Sequence[Sequence], backend) -> list[int]:
    """Indices of the replicas with a NaN or infinite parameter (host list; synchronizes).

    One ``backend.all_finite`` pass per array, stopping at a replica's first bad array.
    """
    return [i for i, params in enumerate(replica_params)
            if not all(backend.all_finite(a) for a in params)]


def weighted_merge(replica_params: Sequence[Sequence], p: Sequence[float], out: Sequence,
                   backend, *, check: bool = True) -> Sequence:
    """Merged model ``w̄ = sum_i p_i w_i`` (arXiv 2110.07029 §III-B), written into ``out``.

    Parameters
    ----------
    replica_params : list (n_devices) of list of arrays
        Each replica's parameters; arrays on the device of ``backend`` (or peer-accessible).
    p : sequence of float, shape (n_devices,)
        Merge weights (summing to 1 for a convex combination). Replicas with weight 0 are
        skipped entirely, so a non-finite replica with weight 0 cannot poison the merge.
    out : list of arrays
        Destination, same shapes, on the merging device; must not alias any replica's arrays.
        (Replicas on other GPUs must be peer-accessible from it, or copied there first.)
    backend : SchedulerBackend
        Runs ``backend.weighted_sum(arrays, weights, out)`` per parameter.
    check : bool
        Raise ``DivergenceError`` if a replica with non-zero weight is non-finite.

    Returns
    -------
    out
    """
    n = len(replica_params)
    w = [float(x) for x in p]
    if len(w) != n:
        raise ValueError(f"{len(w)} weights for {n} replicas")
    used = [i for i in range(n) if w[i] != 0.0]
    if not used:
        raise ValueError("all merge weights are zero")
    if check:
        bad = find_nonfinite([replica_params[i] for i in used], backend)
        if bad:
            raise DivergenceError(f"replicas {[used[j] for j in bad]} have non-finite "
                                  "parameters and a non-zero merge weight")
    ws = [w[i] for i in used]
    for k, dst in enumerate(out):
        backend.weighted_sum([replica_params[i][k] for i in used], ws, dst)
    return out


def central_momentum(wbar: Sequence, z_prev: Sequence, z_prev2: Sequence, mu: float,
                     out: Sequence, backend) -> Sequence:
    """Momentum on the central model ``z_t = w̄_t + mu (z_{t-1} - z_{t-2})`` into ``out``.

    arXiv 2110.07029 §III-B (merge followed by momentum), DESIGN.md §4.3. All arguments are lists
    of arrays with the same shapes; ``out`` must not alias ``z_prev``. With ``mu == 0`` this is an
    exact copy of ``wbar`` (``backend.copy_into``); otherwise ``backend.momentum``.
    """
    for wb, z1, z2, dst in zip(wbar, z_prev, z_prev2, out, strict=True):
        if mu == 0:
            if dst is not wb:
                backend.copy_into(dst, wb)
        else:
            backend.momentum(wb, z1, z2, mu, dst)
    return out


def elastic_update(x: Sequence, center: Sequence, alpha: float, diff_out: Sequence,
                   backend) -> Sequence:
    """Elastic step ``d = alpha (x - c)``, ``x <- x - d``; returns ``diff_out`` holding ``d``.

    The building block of EASGD (Zhang et al. 2015) and CROSSBOW (Koliousis et al. 2019),
    DESIGN.md §4 baselines; the caller accumulates ``d`` into the centre. Runs
    ``backend.elastic(x, center, alpha, diff_out)`` per parameter.
    """
    for xi, c, d in zip(x, center, diff_out, strict=True):
        backend.elastic(xi, c, alpha, d)
    return diff_out


def _touch_counts(replicas: Sequence) -> tuple[np.ndarray, np.ndarray] | None:
    """``(touched, n_touch)``: the replicas' masks of changed ``W1`` rows stacked
    (n_replicas, n_features), and per row how many replicas changed it; ``None`` where a replica
    does not record its changed rows."""
    masks = [r.changed_rows() if hasattr(r, "changed_rows") else None for r in replicas]
    if any(m is None for m in masks):
        return None
    touched = np.stack(masks)
    return touched, touched.sum(axis=0)


def merge_changed_rows(replicas: Sequence, p: Sequence[float], central: Sequence,
                       backend, *, per_row: bool = False, row_sum: bool = False,
                       row_sum_power: float = 0.0, per_label: bool = False,
                       stats: dict | None = None, norm: bool = True,
                       run_shards=None) -> float | None:
    """The row-sparse merge: ``central = sum_i p_i w_i`` and its broadcast, reading and writing
    only the ``W1`` rows some replica changed in the period and, where the replicas record them
    (the sampled output layer, ``changed_columns()``), only the ``W2`` columns and ``b2``
    entries some replica changed (every other parameter in full). The merge kernels write the
    merged rows and columns back to the replicas in the same pass (``broadcast``): about half
    the time of a merge and a broadcast of ``W2``'s columns in turn at the Amazon-670K shape.

    Between two merges a step changes only the ``W1`` rows of its batch's features, so every
    other row of every replica still equals the central model's: merging it would write back the
    value it has. On sparse data with many features many rows are untouched in a period
    (4,096 samples touch 59 % of debian_debtags' rows and 36 % of rcv1sub1's; all of delicious'
    500; ``bench/bench_merge_cpu.py --touched-in``), and a dense merge of the big ``W1`` is most
    of a merge's time. Here one pass over the touched rows merges, checks for
    NaN/inf and updates the norm, and a second writes them back to the replicas
    (``bench/bench_merge_cpu.py`` times it against the dense merge).

    Parameters
    ----------
    replicas : list of replicas
        Each with ``changed_rows()`` (a boolean mask over ``W1``'s rows), optionally
        ``changed_columns()`` (over ``W2``'s columns, or ``None``), and
        ``set_params(params, rows=..., cols=...)`` (:class:`xmc_engine.model.MLPReplica`), all
        of whose parameters equal ``central`` outside the changed rows and columns (true after a
        merge's broadcast).
    p : sequence of float
        Merge weights, all > 0.
    central : list of arrays
        The central model, updated in place.
    backend : SchedulerBackend
        Its ``tracks_rows`` flag says whether the row-sparse merge applies (the CPU backend).
    per_row : bool
        Renormalize the weights of each ``W1`` row over the replicas that changed it
        (``AdaptiveConfig.row_weights = 'touched'``): row ``r`` gets ``p_i m_i(r) / sum_j p_j
        m_j(r)``, ``m_i(r)`` = replica ``i`` changed it. Rows are grouped by which replicas
        changed them (at most ``2^n - 1`` groups), one ``merge_rows`` per group.
    row_sum : bool
        With ``per_row``: a row several replicas changed becomes the central row plus the sum
        of their changes, ``c(r) + sum_i m_i(r) (w_i(r) - c(r))``, as if one model had made
        all their steps (``AdaptiveConfig.row_weights = 'sum'``), instead of their weighted
        mean; a row one replica changed is that replica's row either way.
    row_sum_power : float
        With ``row_sum``: the sum of ``k`` replicas' changes is scaled by ``k **
        -row_sum_power`` (``AdaptiveConfig.row_weights = 'sum_sqrt'``: 0.5; 1 gives their
        plain mean).
    per_label : bool
        The same for the output layer by label (``AdaptiveConfig.label_weights =
        'positives'``): column ``l`` of ``W2`` and ``b2[l]`` get ``p_i s_i(l) / sum_j p_j
        s_j(l)``, ``s_i(l)`` = label ``l`` was a positive in replica ``i``'s batches
        (``seen_labels()``); a label no replica saw keeps the weights ``p``.
    stats : dict, optional
        Receives ``rows_touched`` (rows some replica changed) and ``rows_single`` (rows exactly
        one replica changed), with ``per_label`` also ``labels_seen`` and ``labels_single``,
        and with the sampled output layer ``labels_changed`` (``W2`` columns some replica
        changed): the instrumentation of how sparse a period's updates are.
    norm : bool
        Compute the change of ``sum(central[0]**2)`` (the return value); ``False`` (a caller
        without the L2-norm trend) spares the merge a pass over the old rows and returns
        ``0.0`` in its place.
    run_shards : callable ``(n, fn) -> list``, optional
        Runs ``fn(start, stop)`` over contiguous parts of ``range(n)``, in parallel, and
        returns the results (:attr:`xmc_engine.scheduler.runner.MergeContext.run_shards`: one
        part per device worker, which wait idle at the barrier). Where given, the rows merged
        with the weights ``p`` (not ``per_row``) and the changed rows of ``W1`` hold at least
        :data:`SHARD_MIN_VALUES` values, they are merged in such parts, each part's rows by
        one worker (the parts are disjoint, so are their writes); the merged model is the
        same, row for row. ``None``: one pass on the calling thread.

    Returns
    -------
    float or None
        The change of ``sum(central[0]**2)`` (for the merged model's L2 norm; ``0.0`` without
        ``norm``) when the merge was done; ``None`` when it does not apply (a replica or the
        backend without row tracking, a weight of 0) or a replica is non-finite, and the
        caller merges densely. Where it does not apply nothing is written; where a merged
        value is non-finite the changed rows of ``central[0]`` (and columns of ``W2``) may
        hold partial results and the replicas' finite merged rows (blocks of columns) may
        already be written back, but every non-finite value stays in the replica that holds
        it, so that the dense merge finds and drops that replica.
    """
    if not backend.tracks_rows:
        return None
    counted = _touch_counts(replicas)
    w = [float(x) for x in p]
    if counted is None or len(w) != len(replicas) or min(w) <= 0.0:
        return None
    params = [r.params() for r in replicas]
    changed = [r.changed_columns() if hasattr(r, "changed_columns") else None
               for r in replicas]
    sparse_cols = all(m is not None for m in changed)
    # W2 and b2 are checked by their merge where only changed columns are read.
    if find_nonfinite([ps[1:-2] if sparse_cols else ps[1:] for ps in params], backend):
        return None
    touched, n_touch = counted
    rows = np.flatnonzero(n_touch).astype(np.int64)
    if stats is not None:
        stats["rows_touched"] = int(rows.size)
        stats["rows_single"] = int(np.count_nonzero(n_touch == 1))
    W1s = [ps[0] for ps in params]
    if per_row and len(replicas) > 1:
        finite, delta = True, 0.0
        # which replicas changed each touched row, as a bit pattern: one group per pattern
        code = (touched[:, rows].astype(np.int64) << np.arange(len(w))[:, None]).sum(axis=0)
        for pattern in np.unique(code):
            sel = np.array([(pattern >> i) & 1 for i in range(len(w))], dtype=bool)
            k = int(sel.sum())
            if row_sum and k > 1:
                # c + g sum_i (w_i - c), g = k ** -row_sum_power: the central rows (unchanged
                # since the last merge) enter the sum first, so each value is read before the
                # merge overwrites it
                g = float(k) ** -row_sum_power
                arrays = [central[0], *W1s]
                q = np.concatenate([[1.0 - k * g], g * sel.astype(np.float64)])
            else:
                arrays, q = W1s, np.where(sel, w, 0.0)
                q = q / q.sum()
            ok, d = backend.merge_rows(arrays, q, rows[code == pattern], central[0],
                                       broadcast=True, norm=norm)
            finite, delta = finite and ok, delta + d
    else:
        def merge_w1(start: int, stop: int) -> tuple[bool, float]:
            """Merge (and write back) the changed rows ``rows[start:stop]`` of ``W1``."""
            return backend.merge_rows(W1s, w, rows[start:stop], central[0], broadcast=True,
                                      norm=norm)

        if run_shards is not None and rows.size * central[0].shape[1] >= SHARD_MIN_VALUES:
            parts = run_shards(int(rows.size), merge_w1)
        else:
            parts = [merge_w1(0, int(rows.size))]
        finite, delta = all(ok for ok, _ in parts), sum(d for _, d in parts)
    if not finite:
        return None
    seen = [r.seen_labels() if hasattr(r, "seen_labels") else None for r in replicas]
    per_label = per_label and len(replicas) > 1 and all(m is not None for m in seen)
    # The sampled output layer: only the W2 columns (b2 entries) some replica changed.
    cols = (np.flatnonzero(np.logical_or.reduce(changed)).astype(np.int64)
            if sparse_cols else None)
    # What set_params still copies to the replicas: the merge kernels wrote W1's rows and the
    # merged W2 columns (b2 entries) back themselves, while in cache
    nothing = np.empty(0, dtype=np.int64)
    copy_cols = nothing
    if not per_label and cols is None:
        weighted_merge([ps[1:] for ps in params], w, central[1:], backend, check=False)
        copy_cols = None  # W2 and b2 merged densely: copied in full
    else:
        weighted_merge([ps[1:-2] for ps in params], w, central[1:-2], backend, check=False)
        if per_label:  # a label's weights over the replicas that held it as a positive
            S = np.stack(seen) if cols is None else np.stack(seen)[:, cols]
            n_seen = S.sum(axis=0)
            Q = np.asarray(w, np.float64)[:, None] * S
            Q = np.where(n_seen > 0, Q / np.maximum(Q.sum(axis=0), 1e-300),
                         np.asarray(w)[:, None])
            if stats is not None:
                stats["labels_seen"] = int(np.count_nonzero(n_seen))
                stats["labels_single"] = int(np.count_nonzero(n_seen == 1))
        else:
            Q = np.repeat(np.asarray(w, np.float64)[:, None], cols.size, axis=1)
        Q = Q.astype(np.float32)
        idx = np.arange(central[-1].shape[0], dtype=np.int64) if cols is None else cols
        for k in (-2, -1):
            if not backend.merge_columns([ps[k] for ps in params], Q, idx, central[k],
                                         broadcast=True):
                return None
        if stats is not None and cols is not None:
            stats["labels_changed"] = int(cols.size)
    for r in replicas:
        r.set_params(central, rows=nothing, cols=copy_cols)
    return delta


#: A label is in the tail when it has at most this many positive training rows (the data
#: README's cut: 81 % of debian_builddeps' labels).
TAIL_MAX_POSITIVES = 5


def delta_stats(replicas: Sequence, central: Sequence, tail: np.ndarray) -> dict | None:
    """How big each replica's change since the last merge is, where a merge may shrink it.

    Per replica ``i``, the root mean square of ``w_i - central`` over: the ``W1`` rows that it
    alone changed in the period (``delta_w1_single``), the rows it and another replica changed
    (``delta_w1_shared``), and ``W2``'s columns of head and of tail labels (``delta_w2_head``,
    ``delta_w2_tail``; ``tail`` a boolean mask over the labels). ``None`` where the replicas do
    not record their changed rows or live off the host (the row-sparse merge's conditions). Call
    it before the merge: it reads ``central`` as the model the period started from."""
    counted = _touch_counts(replicas)
    if counted is None:
        return None
    touched, n_touch = counted
    c1, c2 = np.asarray(central[0]), np.asarray(central[-2])
    head = ~tail
    c2_head, c2_tail = c2[:, head], c2[:, tail]  # the centre's columns, gathered once

    def rms(d) -> float:
        return float(np.sqrt(np.mean(np.square(d, dtype=np.float64)))) if d.size else 0.0

    out: dict[str, list[float]] = {"delta_w1_single": [], "delta_w1_shared": [],
                                   "delta_w2_head": [], "delta_w2_tail": []}
    for i, r in enumerate(replicas):
        W1, W2 = np.asarray(r.params()[0]), np.asarray(r.params()[-2])
        single = np.flatnonzero(touched[i] & (n_touch == 1))
        shared = np.flatnonzero(touched[i] & (n_touch > 1))
        out["delta_w1_single"].append(rms(W1[single] - c1[single]))
        out["delta_w1_shared"].append(rms(W1[shared] - c1[shared]))
        out["delta_w2_head"].append(rms(W2[:, head] - c2_head))
        out["delta_w2_tail"].append(rms(W2[:, tail] - c2_tail))
    return out


def reduce_gradients(grads: Sequence[list | None], weights: Sequence[float], backend) -> list:
    """Weighted sum of per-device gradients on ``backend``'s device: the all-reduce of
    synchronous SGD, with no trip through the host on GPUs (peer reads, :meth:`fence`).

    Parameters
    ----------
    grads : list (n_devices) of gradient lists or ``None``
        In the layout of :meth:`xmc_engine.model.MLPReplica.grad_batch`, on any device: entry 0
        row-sparse ``(rows int64 (n_rows_i,) sorted unique, grad_rows (n_rows_i, h))``, with
        the sampled output layer the last two column-sparse ``(cols, values (..., m_i))``, the
        others dense. ``None`` (a device without rows this step) is skipped.
    weights : sequence of float, shape (n_devices,)
        ``b_i / sum_j b_j``, each device's share of the global batch (the result is then the
        gradient of the mean loss over the global batch). Weight 0 is skipped.
    backend : SchedulerBackend
        Where the sum is made and lives.

    Returns
    -------
    list
        Same layout, fresh arrays on ``backend``: ``W1`` over the sorted union of the devices'
        rows (a row a device did not touch contributes 0), likewise a column-sparse ``W2``,
        ``b2`` over the union of the columns, dense entries ``sum_i w_i g_i``. Only the row and
        column numbers travel to the host (to form the unions). Returns after the sum is
        done (the devices may reuse their gradient buffers at once).
    """
    used = [i for i, g in enumerate(grads) if g is not None and weights[i] != 0.0]
    if not used:
        raise ValueError("reduce_gradients: no device contributed a gradient")
    w = [float(weights[i]) for i in used]
    out = []
    with backend.activate():
        backend.fence()
        for k in range(len(grads[used[0]])):
            like = grads[used[0]][k]
            if isinstance(like, tuple):  # W1 by rows; a sampled W2, b2 by columns
                out.append(_sparse_sum([grads[i][k] for i in used], w, backend,
                                       last_axis=k > 0))
            else:
                out.append(backend.weighted_sum([grads[i][k] for i in used], w,
                                                backend.empty(like.shape, like.dtype)))
        backend.synchronize()  # synchronize! the sum has read every device's buffers
    return out


def _sparse_sum(entries: Sequence[tuple], w: Sequence[float], backend, *, last_axis: bool):
    """``(union, sum_i w_i g_i)`` of index-sparse gradients ``(index int64, values)``, indexed
    on the first axis of ``values`` (``W1``'s rows) or the last (``W2``'s columns, ``b2``):
    an index a device did not list contributes 0. Only the indices travel to the host."""
    idx = [np.asarray(backend.to_host(e[0]), dtype=np.int64) for e in entries]
    union = np.unique(np.concatenate(idx))
    first = entries[0][1]
    shape = (*first.shape[:-1], union.size) if last_axis else (union.size, *first.shape[1:])
    total = backend.zeros(shape, first.dtype)
    for ix, (_, values), wi in zip(idx, entries, w, strict=True):
        # indices are unique within a device, so fancy-index += is an exact scatter-add
        at = backend.asarray(np.searchsorted(union, ix))
        if last_axis:
            total[..., at] += first.dtype.type(wi) * backend.asarray(values)
        else:
            total[at] += first.dtype.type(wi) * backend.asarray(values)
    return backend.asarray(union), total
