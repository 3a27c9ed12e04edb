"""CPU backend: NumPy/SciPy arrays, the ``@njit`` kernels of :mod:`xmc_engine.kernels`, BLAS GEMMs.

Implements the whole :class:`xmc_engine.backends.base.Backend` protocol, mirroring
:mod:`xmc_engine.backends.cuda` method by method.
Every kernel runs with ``nogil=True``, so several CPU devices driven by different host threads run
truly in parallel (numba ``omp`` threading layer); each thread sets its own budget with
:meth:`CPUBackend.thread_budget` (DESIGN.md §3).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from contextlib import contextmanager, nullcontext

import numba
import numpy as np
import scipy.sparse

from xmc_engine import output_layer as host_output_layer
from xmc_engine.backends.base import fortran_only
from xmc_engine.batches import CSRBatch
from xmc_engine.kernels import (
    adagrad,
    bce_output,
    merge,
    output_layer,
    sampled_output,
    sparse_backward,
    sparse_forward,
    topk,
    train_step,
)
from xmc_engine.output_layer import is_bce

_F32 = np.float32
_PARALLEL_COPY_MIN = 1 << 16  # elements: below this np.copyto beats waking the numba threads
_SGEMM = None
_EMPTY_1D = np.zeros(0, _F32)  # the accumulators of train_step_cpu when the step is SGD
_EMPTY_2D = np.zeros((0, 0), _F32)
_NO_ROWS = np.zeros(0, np.bool_)  # "mark no changed rows"
#: logits per thread below which the top-k fold of a chunk takes fewer threads: handing a
#: block to a pool thread costs tens of microseconds, the fold about a nanosecond per logit
FOLD_ENTRIES_PER_THREAD = 1 << 17
_FOLD_POOL: list = []  # [the ThreadPoolExecutor of CPUBackend.topk_fold], once
_FOLD_POOL_LOCK = threading.Lock()


def _fold_pool():
    """The threads that fold blocks of rows beside the caller's
    (:meth:`CPUBackend.topk_fold`), made on first use; shared by every backend (the blocks of
    concurrent callers queue)."""
    with _FOLD_POOL_LOCK:
        if not _FOLD_POOL:
            from concurrent.futures import ThreadPoolExecutor

            _FOLD_POOL.append(ThreadPoolExecutor(max(1, (os.cpu_count() or 2) - 1),
                                                 thread_name_prefix="xmc-topk"))
    return _FOLD_POOL[0]


def _blas_operand(a):
    """(data pointer, leading dimension, 'N'/'T') of a 2-D float32 view in row-major terms."""
    s0, s1 = a.strides
    if s1 == 4 and s0 >= 4 * max(1, a.shape[1]) and s0 % 4 == 0:
        return a.ctypes.data, s0 // 4, b"N"
    if s0 == 4 and s1 >= 4 * max(1, a.shape[0]) and s1 % 4 == 0:
        return a.ctypes.data, s1 // 4, b"T"
    return None


def sgemm_rm(alpha, A, Bm, beta, C):
    """C = alpha * A @ Bm + beta * C in one BLAS call, in place, for strided float32 views.

    Every operand may be a row-major view with a row stride (``W2[:, c0:c1]``) or the transpose
    of one (``W2[:, c0:c1].T``): nothing is copied (NumPy's ``matmul`` has no ``beta``, SciPy's
    f2py ``sgemm`` copies non-contiguous operands). Uses SciPy's ``cython_blas`` (LP64) through
    ctypes. Returns False (and does nothing) when a layout is not BLAS-compatible.
    """
    global _SGEMM
    m, k = A.shape
    n = Bm.shape[1]
    if C.shape != (m, n) or Bm.shape[0] != k or min(m, n, k) == 0 \
            or not all(x.dtype == _F32 for x in (A, Bm, C)):
        return False
    oa, ob, oc = _blas_operand(A), _blas_operand(Bm), _blas_operand(C)
    if oa is None or ob is None or oc is None or oc[2] != b"N":
        return False
    if _SGEMM is None:
        from numba.extending import get_cython_function_address

        p_int, p_f = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_float)
        proto = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, p_int, p_int, p_int,
                                 p_f, ctypes.c_void_p, p_int, ctypes.c_void_p, p_int, p_f,
                                 ctypes.c_void_p, p_int)
        _SGEMM = proto(get_cython_function_address("scipy.linalg.cython_blas", "sgemm"))
    ci, cf = ctypes.c_int, ctypes.c_float
    # column-major BLAS: C^T = alpha * op(B)^T op(A)^T + beta * C^T (same memory, no copies)
    _SGEMM(ob[2], oa[2], ctypes.byref(ci(n)), ctypes.byref(ci(m)), ctypes.byref(ci(k)),
           ctypes.byref(cf(alpha)), ob[0], ctypes.byref(ci(ob[1])), oa[0],
           ctypes.byref(ci(oa[1])), ctypes.byref(cf(beta)), oc[0], ctypes.byref(ci(oc[1])))
    return True


@contextmanager
def numba_threads(n: int):
    """numba's threads for the calling thread only limited to ``n`` inside the block, then
    put back (numba's limit is per thread)."""
    old = numba.get_num_threads()
    numba.set_num_threads(min(int(n), numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(old)


_OMP_PAUSE: list = []  # [the libgomp functions found], once


def _omp_pause() -> list:
    """``omp_pause_resource_all`` of every GNU libgomp loaded in the process (numba's ``omp``
    threading layer uses one; another package may bring its own copy, as PyTorch's wheel
    does, and which one numba's resolved to is not asked: pausing a copy in which the thread
    has no pool does nothing); empty where there is none (another threading layer or OpenMP
    runtime, a libgomp older than GCC 9, no parallel kernel run yet, not Linux)."""
    if _OMP_PAUSE:
        return _OMP_PAUSE[0]
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run: no pool to free, look again later
        return []
    fns = []
    if layer == "omp":
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({line.split()[-1] for line in f if "libgomp" in line})
        except OSError:
            paths = []
        for path in paths:
            try:
                fn = ctypes.CDLL(path).omp_pause_resource_all  # the copy already loaded
            except (OSError, AttributeError):
                continue
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            fns.append(fn)
    _OMP_PAUSE.append(fns)
    return fns


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (``omp_pause_resource_all(omp_pause_soft)``
    of GNU libgomp; numba makes a new one at the thread's next parallel kernel). True where a
    pool could be freed (or there was none), False where it cannot be done here.

    libgomp counts the threads of every pool, and where they outnumber the cores it spins
    only briefly at its barriers (100 times instead of 300,000, as documented), so each
    parallel region sleeps and wakes. On the 2-core machine, after the main thread had run a
    parallel kernel on two threads, a device worker's two-thread imdb step took 0.46 ms
    against 0.10 ms on one thread; with the main thread's pool freed, 0.089 ms.

    The trainer does not call it: with the pool freed, libgomp's spinning workers hold the
    cores that OpenBLAS's threads need, and a budget of two threads for both (the trainer's)
    trained the synthetic 10,000-label shape 2.5x slower than with the pool kept. A thread
    calibration that gave a device's threads to numba's kernels alone (this pool freed) or to
    BLAS alone was tried and not kept (``bench/bench_thread_pools.py``,
    ``bench/RESULTS.md``, "One pool at a time")."""
    fns = _omp_pause()
    # omp_pause_soft in each copy; -1 inside a parallel region
    return bool(fns) and all([fn(1) == 0 for fn in fns])


class CPUBackend:
    """Host device: NumPy arrays, ``@njit(nogil=True)`` kernels, BLAS through NumPy/SciPy.

    Parameters
    ----------
    threads : int, optional
        Default thread budget of :meth:`thread_budget` (numba threads and BLAS threads);
        ``None`` means all of numba's threads.

    Notes
    -----
    A backend object (its workspaces) belongs to one host thread at a time: give every device
    worker its own backend (:func:`xmc_engine.backends.get_backend` returns a new one per call).
    Workspaces are kept between steps: an output-layer step allocates nothing of size
    ``B x L`` or ``n_hidden x L``.
    """

    name = "cpu"
    xp = np
    sp = scipy.sparse
    device_id = None
    threads: int
    #: the row-sparse merge (:func:`xmc_engine.scheduler.merge.merge_changed_rows`): a dense
    #: merge of a big ``W1`` is most of a merge's time on the host
    tracks_rows = True

    def __init__(self, threads: int | None = None):
        self.threads = int(threads) if threads else numba.config.NUMBA_NUM_THREADS
        self._ws: dict[str, np.ndarray] = {}

    def __repr__(self):
        return f"CPUBackend(threads={self.threads})"

    # ------------------------------------------------------------------ arrays and plumbing
    @staticmethod
    def asarray(a, dtype=None):
        """Host or device array -> NumPy array (dtype kept unless ``dtype`` is given)."""
        if not isinstance(a, np.ndarray) and hasattr(a, "get"):
            a = a.get()
        return np.ascontiguousarray(a, dtype=dtype)

    @staticmethod
    def to_host(a):
        if not isinstance(a, np.ndarray) and hasattr(a, "get"):
            return a.get()
        return np.asarray(a)

    @staticmethod
    def to_float(x) -> float:
        """``float(x)``: host kernels have finished when they return."""
        return float(x)

    @staticmethod
    def empty(shape, dtype=_F32):
        return np.empty(shape, dtype)

    @staticmethod
    def zeros(shape, dtype=_F32):
        """Zeros written now, page by page, not ``np.zeros``' lazily mapped pages: those fault
        on their first write, which for an Adagrad accumulator is inside a training step (a
        device worker's first step took 3-50 ms instead of 2; bench/RESULTS.md, "Zeros written
        at allocation")."""
        return np.full(shape, 0, dtype)

    def workspace(self, name, shape, dtype=_F32):
        n = math.prod(shape)
        buf = self._ws.get(name)
        if buf is None or buf.size < n or buf.dtype != dtype:
            buf = self._ws[name] = np.empty(n, dtype)
        return buf[:n].reshape(shape)

    @staticmethod
    def copy_into(dst, src):
        """dst[...] = src (host <- host or device array); large contiguous float32 arrays with
        the numba threads of the calling thread (a merge's broadcast)."""
        if not isinstance(src, np.ndarray) and hasattr(src, "get"):
            src = src.get()
        if (dst.size >= _PARALLEL_COPY_MIN and dst.dtype == src.dtype == _F32
                and dst.shape == src.shape and _order(dst) == _order(src) != "strided"):
            merge.copy_cpu(*_c_views(dst, src))
        else:
            np.copyto(dst, src)

    @staticmethod
    def upload(arrays):
        """Host arrays are this backend's arrays: returned as they are."""
        return list(arrays)

    @staticmethod
    def csr_parts(X):
        """SciPy CSR (or a :class:`~xmc_engine.batches.CSRBatch`) -> ``(indptr, indices,
        data float32)`` NumPy arrays. A SciPy matrix's row pointers come back as int64, the
        type of the training batches' (:class:`~xmc_engine.batches.RowGather`), so that
        prediction calls the forward kernel Numba compiled for training rather than a second
        compilation of it (1.5 s of a first run)."""
        if isinstance(X, CSRBatch):
            return X.indptr, X.indices, X.data
        X = scipy.sparse.csr_matrix(X) if not scipy.sparse.isspmatrix_csr(X) else X
        data = X.data if X.data.dtype == _F32 else X.data.astype(_F32)
        return X.indptr.astype(np.int64, copy=False), X.indices, data

    def synchronize(self):
        """Nothing to wait for: CPU kernels return when done."""

    def fence(self):
        """Nothing to order: host kernels have finished when they return."""

    def activate(self):
        """Nothing to make current on the host (the protocol's worker context)."""
        return nullcontext()

    @contextmanager
    def thread_budget(self, n: int | None = None):
        """Limit numba threads (this thread only) and BLAS threads to ``n`` inside the block.

        numba's limit is per calling thread; OpenBLAS's limit (threadpoolctl) is process-wide,
        so concurrent CPU workers should agree on their budgets.
        """
        from threadpoolctl import threadpool_limits

        n = int(n or self.threads)
        with self.kernel_threads(n), threadpool_limits(limits=n, user_api="blas"):
            yield

    @staticmethod
    def kernel_threads(n: int):
        """Limit numba's threads for this thread only to ``n`` inside the block (the trainer's
        merges on the main thread): :func:`numba_threads`. Costs microseconds where
        :meth:`thread_budget`, which also asks threadpoolctl for the BLAS libraries, costs
        about 2 ms per entry."""
        return numba_threads(n)

    # ------------------------------------------------------------------ dense arithmetic
    @staticmethod
    def matmul(a, b, out):
        np.matmul(a, b, out=out)

    def gemm_acc(self, C, A, Bm, alpha=1.0):
        """C += alpha * A @ Bm in one BLAS call (beta = 1); strided views, no copies."""
        if sgemm_rm(alpha, A, Bm, 1.0, C):
            return
        tmp = self.workspace("gemm_tmp", C.shape)
        np.matmul(A, Bm, out=tmp)
        self.axpy(C, tmp, alpha)

    def gemm_update(self, W, A, Bm, alpha):
        """W += alpha * A.T @ Bm in one BLAS call (beta = 1), W may be a strided view."""
        self.gemm_acc(W, A.T, Bm, alpha)

    @staticmethod
    def axpy(y, x, alpha):
        """y += alpha * x; serial below ``SERIAL_BELOW`` elements (a parallel region costs
        more there)."""
        if y.ndim == 1 or y.size < output_layer.SERIAL_BELOW:
            output_layer.axpy_serial_cpu(y, x, alpha)
        else:
            output_layer.axpy_parallel_cpu(y, x, alpha)

    # ------------------------------------------------------------------ output layer
    @staticmethod
    def _n_parts(B):
        return max(1, min(numba.get_num_threads(), B))

    @staticmethod
    def softmax_xent(Z, y_indptr, y_indices, scale):
        return float(output_layer.softmax_xent_cpu(Z, y_indptr, y_indices, scale))

    def softmax_bias(self, Z, b2, y_indptr, y_indices, scale, db2_out):
        loss_rows = self.workspace("loss_rows", (Z.shape[0],), np.float64)
        parts = self.workspace("colsum_parts", (self._n_parts(Z.shape[0]), Z.shape[1]))
        output_layer.softmax_xent_fused_cpu(Z, b2, True, y_indptr, y_indices, scale, loss_rows,
                                            parts)
        output_layer.sum_parts_cpu(parts, db2_out, 1.0, 0.0)
        return float(loss_rows.sum())

    def bce_bias(self, Z, b2, c0, y_indptr, y_indices, scale, db2_out, alpha=1.0, beta=0.0,
                 colw=None):
        B, C = Z.shape
        loss_rows = self.workspace("loss_rows", (B,), np.float64)
        loss_rows.fill(0.0)
        n_parts = self._n_parts(B)
        parts = self.workspace("colsum_parts_c", (n_parts * C,)).reshape(n_parts, C)
        bce_output.bce_fused_cpu(Z, b2, True, int(c0), _EMPTY_1D if colw is None else colw,
                                 y_indptr, y_indices, scale, loss_rows, parts)
        output_layer.sum_parts_cpu(parts, db2_out, alpha, beta)
        return float(loss_rows.sum())

    def row_stats(self, B):
        m, s, ysum = (self.workspace(k, (B,)) for k in ("row_m", "row_s", "row_ysum"))
        m.fill(output_layer.RUNNING_MAX_START)  # not -inf: the kernels use fastmath
        s.fill(0.0)
        ysum.fill(0.0)
        return m, s, ysum

    def chunk_stats(self, Zc, b2c, c0, y_indptr, y_indices, m, s, ysum):
        output_layer.softmax_chunk_stats_cpu(Zc, b2c, c0, y_indptr, y_indices, m, s, ysum,
                                             self._n_parts(Zc.shape[0]))

    def chunk_loss(self, m, s, ysum, y_indptr):
        lse = self.workspace("row_lse", m.shape)
        return float(output_layer.chunk_loss_cpu(m, s, ysum, y_indptr, lse)), lse

    def chunk_grad(self, Zc, b2c, c0, y_indptr, y_indices, lse, scale, db2c_out, alpha=1.0,
                   beta=0.0):
        n_parts = self._n_parts(Zc.shape[0])
        parts = self.workspace("colsum_parts_c", (n_parts * Zc.shape[1],))
        parts = parts.reshape(n_parts, Zc.shape[1])
        output_layer.softmax_chunk_grad_cpu(Zc, b2c, c0, y_indptr, y_indices, lse, scale, parts)
        output_layer.sum_parts_cpu(parts, db2c_out, alpha, beta)

    @staticmethod
    def add_bias(Z, b):
        output_layer.add_bias_cpu(Z, b)

    @staticmethod
    def topk_into(scores, k, idx, val):
        topk.topk_cpu(scores, k, idx, val)

    def topk_fold(self, scores, bias, offset, idx, val, filled):
        """Fold a label chunk's logits plus ``bias`` into the running top lists
        (:func:`xmc_engine.kernels.topk.topk_fold_cpu`): what
        :func:`xmc_engine.output_layer.predict_scores_topk` calls, where a backend has it, in
        place of the bias, top-k and merge of each chunk.

        Blocks of rows run on the calling thread and on :func:`_fold_pool`'s threads, one block
        per numba thread of the caller (fewer below ``FOLD_ENTRIES_PER_THREAD`` logits a
        block), not in a numba parallel region: libgomp's workers spin after a region on the
        cores that the next chunk's sgemm needs (``kernels/topk.py``)."""
        offset = int(offset)
        B = scores.shape[0]
        n = min(self._n_parts(B), max(1, scores.size // FOLD_ENTRIES_PER_THREAD))
        if n == 1:
            topk.topk_fold_cpu(scores, bias, offset, idx, val, filled)
            return
        edges = [B * t // n for t in range(n + 1)]
        futures = [_fold_pool().submit(topk.topk_fold_cpu, scores[a:b], bias, offset, idx[a:b],
                                       val[a:b], filled[a:b])
                   for a, b in zip(edges[1:-1], edges[2:], strict=True)]
        topk.topk_fold_cpu(scores[:edges[1]], bias, offset, idx[:edges[1]], val[:edges[1]],
                           filled[:edges[1]])
        for f in futures:
            f.result()

    @staticmethod
    def topk_merge(ia, va, ib, vb, io, vo):
        topk.topk_merge_cpu(ia, va, ib, vb, io, vo)

    def output_layer_step(self, H, W2, b2, y_indptr, y_indices, lr, dH_out, *, label_chunk=None,
                          loss="softmax"):
        return host_output_layer.output_layer_step(self, H, W2, b2, y_indptr, y_indices, lr,
                                                   dH_out, label_chunk=label_chunk, loss=loss)

    def output_layer_grad(self, H, W2, b2, y_indptr, y_indices, *, dH_out=None, dW2_out=None,
                          db2_out=None, label_chunk=None, loss="softmax"):
        return host_output_layer.output_layer_grad(self, H, W2, b2, y_indptr, y_indices,
                                                   dH_out=dH_out, dW2_out=dW2_out,
                                                   db2_out=db2_out, label_chunk=label_chunk,
                                                   loss=loss)

    def sampled_output_grad(self, H, W2, b2, cols, n_pos, log_weight, y_indptr, local_y, *,
                            loss="softmax"):
        return host_output_layer.sampled_output_grad(self, H, W2, b2, cols, n_pos, log_weight,
                                                     y_indptr, local_y, loss=loss)

    @staticmethod
    def gather_columns(W2, b2, cols, W2s, b2s):
        sampled_output.gather_columns_cpu(W2, b2, cols, W2s, b2s)

    @staticmethod
    def scatter_add_columns(W2, b2, cols, dW2s, db2s, alpha):
        sampled_output.scatter_add_columns_cpu(W2, b2, cols, dW2s, db2s, alpha)

    def predict_scores_topk(self, H, W2, b2, k, *, label_chunk=None):
        return host_output_layer.predict_scores_topk(self, H, W2, b2, k, label_chunk=label_chunk)

    def fused_train_step(self, params, acc, Xb, Yb, lr: float, eps: float, changed, *,
                         loss: str = "softmax") -> float:
        """One SGD (``acc is None``) or Adagrad step of the default network (one hidden layer,
        the exact softmax in one label chunk) in one ``nogil`` call
        (:func:`xmc_engine.kernels.train_step.train_step_cpu`); returns the summed loss.

        ``params`` = ``[W1, b1, W2, b2]``, ``acc`` their accumulators; ``Xb``, ``Yb`` host CSR
        batches; ``changed`` the bool mask of changed ``W1`` rows to mark, or ``None``. The
        scratch arrays are the output layer's workspaces (``Z``, ``db2``, ...), so the step adds
        ``dW2`` (``n_hidden x L``) to what the host-level path keeps. ``loss``: ``"softmax"``
        or ``"bce"`` (:attr:`xmc_engine.config.TrainConfig.loss`).
        """
        x, y, scratch = self._fused_args(params, Xb, Yb)
        return float(train_step.train_step_cpu(
            *x, *y, *params, *_optimizer_args(acc), float(lr), float(eps), is_bce(loss), *scratch,
            _NO_ROWS if changed is None else changed))

    def fused_sampled_step(self, params, acc, Xb, y_indptr, cols, local_y, n_pos: int,
                           log_weight, lr: float, eps: float, changed, changed_cols, *,
                           loss: str = "softmax") -> float:
        """:meth:`fused_train_step` with the sampled output layer on the candidate labels
        ``cols`` (:func:`xmc_engine.output_layer.sample_candidates`' ``cols``, ``local_y``,
        ``n_pos``, ``log_weight``: a float, or one per negative)
        (:func:`xmc_engine.kernels.train_step.sampled_train_step_cpu`); ``changed_cols`` the
        bool mask of changed ``W2`` columns to mark, or ``None``. Returns the summed loss."""
        batch, scratch = self._sampled_args(params, Xb, y_indptr, cols, local_y, n_pos,
                                            log_weight, loss)
        return float(train_step.sampled_train_step_cpu(
            *batch, is_bce(loss), *params, *_optimizer_args(acc), float(lr), float(eps),
            *scratch,
            _NO_ROWS if changed is None else changed,
            _NO_ROWS if changed_cols is None else changed_cols))

    def fused_sampled_grad_step(self, params, Xb, y_indptr, cols, local_y, n_pos: int,
                                log_weight, *, loss: str = "softmax"):
        """The gradient of :meth:`fused_sampled_step` without the update
        (:func:`xmc_engine.kernels.train_step.sampled_grad_step_cpu`): ``(loss_sum, grads)`` in
        the layout of :meth:`xmc_engine.model.MLPReplica.grad_batch` (``W2``, ``b2``
        column-sparse, in this backend's workspaces, valid until its next step)."""
        batch, scratch = self._sampled_args(params, Xb, y_indptr, cols, local_y, n_pos,
                                            log_weight, loss)
        total, rows, grad_rows, grad_b1 = train_step.sampled_grad_step_cpu(
            *batch, is_bce(loss), *params, *scratch)
        cols = batch[5]
        return float(total), [(rows, grad_rows), grad_b1, (cols, scratch[5]), (cols, scratch[6])]

    def _sampled_args(self, params, Xb, y_indptr, cols, local_y, n_pos, log_weight,
                      loss) -> tuple:
        """The batch's and the candidates' arrays of the fused sampled kernels, and their
        scratch arrays ``(H, W2s, b2s, Zs, dH, dW2s, db2s, loss_rows, colsum_parts)``. The
        negatives' log-weights are empty for the logistic loss unless
        :data:`xmc_engine.output_layer.BCE_WEIGHTED_NEGATIVES`."""
        B, nh, m = Xb.shape[0], params[0].shape[1], len(cols)
        if is_bce(loss) and not host_output_layer.BCE_WEIGHTED_NEGATIVES:
            neg_weight = np.zeros(0, _F32)
        else:
            neg_weight = np.broadcast_to(np.asarray(log_weight, _F32), (m - n_pos,))
        batch = (Xb.indptr, Xb.indices, np.asarray(Xb.data, _F32), y_indptr, local_y,
                 np.asarray(cols, np.int64), int(n_pos), np.ascontiguousarray(neg_weight))
        scratch = (self.workspace("H", (B, nh)), self.workspace("W2s", (nh, m)),
                   self.workspace("b2s", (m,)), self.workspace("Zs", (B, m)),
                   self.workspace("dH", (B, nh)), self.workspace("dW2s", (nh, m)),
                   self.workspace("db2s", (m,)), self.workspace("loss_rows", (B,), np.float64),
                   self.workspace("colsum_parts", (self._n_parts(B), m)))
        return batch, scratch

    def fused_grad_step(self, params, Xb, Yb, *, loss: str = "softmax"):
        """The gradient of :meth:`fused_train_step` without the update
        (:func:`xmc_engine.kernels.train_step.grad_step_cpu`): ``(loss_sum, grads)`` in the
        layout of :meth:`xmc_engine.model.MLPReplica.grad_batch`; ``dW2``, ``db2`` are this
        backend's workspaces, valid until its next step."""
        x, y, scratch = self._fused_args(params, Xb, Yb)
        total, rows, grad_rows, grad_b1 = train_step.grad_step_cpu(*x, *y, *params,
                                                                   is_bce(loss), *scratch)
        dW2, db2 = scratch[3], scratch[4]
        return float(total), [(rows, grad_rows), grad_b1, dW2, db2]

    def _fused_args(self, params, Xb, Yb) -> tuple:
        """The batch's arrays and the scratch arrays of the fused kernels: ``(X parts, Y parts,
        (H, Z, dH, dW2, db2, loss_rows, colsum_parts))``."""
        B, nh, L = Xb.shape[0], params[0].shape[1], params[2].shape[1]
        scratch = (self.workspace("H", (B, nh)), self.workspace("Z", (B, L)),
                   self.workspace("dH", (B, nh)), self.workspace("dW2", (nh, L)),
                   self.workspace("db2", (L,)), self.workspace("loss_rows", (B,), np.float64),
                   self.workspace("colsum_parts", (self._n_parts(B), L)))
        return ((Xb.indptr, Xb.indices, np.asarray(Xb.data, _F32)), (Yb.indptr, Yb.indices),
                scratch)

    # ------------------------------------------------------------------ kernels
    @staticmethod
    def sparse_forward(indptr, indices, data, W1, b1, out):
        sparse_forward.sparse_forward_cpu(indptr, indices, data, W1, b1, out)
        return out

    @staticmethod
    def sparse_backward_update(indptr, indices, data, dZ1, W1, b1, lr):
        sparse_backward.sparse_backward_update_cpu(indptr, indices, data, dZ1, W1, b1, lr)

    @staticmethod
    def sparse_grad(indptr, indices, data, dZ1):
        return sparse_backward.sparse_grad_cpu(indptr, indices, data, dZ1)

    @staticmethod
    def sparse_rows_update(W1, rows, grad_rows, lr):
        sparse_backward.sparse_rows_update_cpu(W1, rows, grad_rows, lr)

    @staticmethod
    def relu_backward(dH, H):
        sparse_backward.relu_backward_cpu(dH, H)
        return dH

    @staticmethod
    def topk(scores, k):
        k = int(min(k, scores.shape[1]))
        idx = np.empty((scores.shape[0], k), np.int64)
        val = np.empty((scores.shape[0], k), scores.dtype)
        if k > 0:
            topk.topk_cpu(scores, k, idx, val)
        return idx, val

    @staticmethod
    def all_finite(a) -> bool:
        """No NaN or infinity in ``a`` (the merge's check; one parallel pass)."""
        a = a.T if _order(a) == "F" else np.ascontiguousarray(a)
        if a.dtype != _F32:
            return bool(np.isfinite(a).all())
        return bool(merge.all_finite_cpu(a))

    @staticmethod
    def weighted_sum(arrays, weights, out):
        *views, out_view = _c_views(*arrays, out)
        return merge.weighted_sum_cpu(views, weights, out_view)

    @staticmethod
    def merge_rows(arrays, weights, rows, out, broadcast: bool = False,
                   norm: bool = True) -> tuple[bool, float]:
        """``out[r] = sum_i weights[i] arrays[i][r]`` for ``r`` in ``rows`` (float32 2-D, C order);
        returns ``(all finite, change of sum(out**2))`` (the row-sparse merge,
        :func:`xmc_engine.scheduler.merge.merge_changed_rows`). ``broadcast``: each finite
        merged row is also written back to every array of ``arrays``, in the same pass.
        ``norm=False``: the change is not computed (``0.0``), which spares a pass over the old
        rows (:func:`~xmc_engine.kernels.merge.merge_rows_cpu`)."""
        ok, delta = merge.merge_rows_cpu(tuple(arrays), np.asarray(weights, np.float64),
                                         np.asarray(rows, np.int64), out, bool(broadcast),
                                         bool(norm))
        return bool(ok), float(delta)

    @staticmethod
    def copy_rows(dst, src, rows) -> None:
        """``dst[r] = src[r]`` for ``r`` in ``rows`` (float32 2-D, C order; parallel)."""
        merge.copy_rows_cpu(dst, src, np.asarray(rows, np.int64))

    @staticmethod
    def merge_columns(arrays, weights, cols, out, broadcast: bool = False) -> bool:
        """``out[:, c_j] = sum_i weights[i, j] arrays[i][:, c_j]`` for the columns of ``cols``
        (2-D float32, C order; a 1-D array is one row); returns whether all are finite (the
        column-sparse merge of ``W2``, ``b2``). ``broadcast``: the merged values are also
        written back to every array of ``arrays`` in the same pass, except in a block of
        columns of a row that holds a non-finite value."""
        return bool(merge.merge_columns_cpu(tuple(_as_rows(a) for a in arrays),
                                            np.asarray(weights, np.float32),
                                            np.asarray(cols, np.int64), _as_rows(out),
                                            bool(broadcast)))

    @staticmethod
    def copy_columns(dst, src, cols) -> None:
        """``dst[:, c] = src[:, c]`` for ``c`` in ``cols`` (parallel over rows; 1-D: entries)."""
        merge.copy_columns_cpu(_as_rows(dst), _as_rows(src), np.asarray(cols, np.int64))

    @staticmethod
    def momentum(wbar, z1, z2, mu, out):
        w, a, b, o = _c_views(wbar, z1, z2, out)
        merge.momentum_cpu(w, a, b, mu, o)
        return out

    @staticmethod
    def elastic(x, center, alpha, diff_out):
        xv, c, d = _c_views(x, center, diff_out)
        merge.elastic_cpu(xv, c, alpha, d)
        return diff_out

    @staticmethod
    def adagrad_dense(w, g, acc, lr, eps):
        # flat views: the kernel compiles once, for weights and biases alike
        adagrad.adagrad_dense_cpu(*(_flat(a) for a in _c_views(w, g, acc)), lr, eps)

    @staticmethod
    def adagrad_rows(W, rows, grad_rows, acc_W, lr, eps):
        adagrad.adagrad_rows_cpu(W, rows, grad_rows, acc_W, lr, eps)

    @staticmethod
    def adagrad_columns(W2, b2, acc_W2, acc_b2, cols, dW2s, db2s, lr, eps):
        sampled_output.adagrad_columns_cpu(W2, b2, acc_W2, acc_b2, cols, dW2s, db2s, lr, eps)


def _optimizer_args(acc) -> tuple:
    """``(acc_W1, acc_b1, acc_W2, acc_b2, adagrad)`` of the fused kernels: the accumulators of
    an Adagrad replica, or empty stand-ins and ``False`` for SGD (``acc is None``)."""
    if acc is None:
        return _EMPTY_2D, _EMPTY_1D, _EMPTY_2D, _EMPTY_1D, False
    return (*acc, True)


def _order(a) -> str:
    """``"C"`` (C-contiguous, also any 1-D or one-row array), ``"F"`` (:func:`fortran_only`)
    or ``"strided"``."""
    if a.flags.c_contiguous:
        return "C"
    return "F" if fortran_only(a) else "strided"


def _c_views(*arrays) -> tuple:
    """The arrays of one flat (elementwise) kernel as C-order views: a Fortran-order array as
    its transpose, the same memory in the same order. The flat loops pair entries by their place
    in memory, so every array of a call must be in the same order (``ValueError`` otherwise:
    it would pair ``W2[h, c]`` of one with another entry of the other)."""
    orders = {_order(a) for a in arrays if a.ndim > 1}
    if len(orders) > 1:
        raise ValueError(f"arrays of one elementwise kernel in different memory orders "
                         f"{sorted(orders)}: allocate them alike (empty_like)")
    return tuple(a.T if a.ndim > 1 and _order(a) == "F" else a for a in arrays)


def _flat(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array as a 1-D view of the same memory (never a copy: an in-place
    kernel's writes must land in ``a``)."""
    if not a.flags.c_contiguous:
        raise ValueError(f"an in-place flat kernel needs C-contiguous arrays, got strides "
                         f"{a.strides} for shape {a.shape}")
    return a.reshape(-1)


def _as_rows(a: np.ndarray) -> np.ndarray:
    """A 2-D view: a 1-D array (``b2``) as one row."""
    return a.reshape(1, -1) if a.ndim == 1 else a
