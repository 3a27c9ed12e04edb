"""CPU backend: NumPy/SciPy arrays, the ``@njit`` kernels of :mod:`xmc_engine.kernels`, BLAS GEMMs.

Mirrors :mod:`xmc_engine.backends.cuda` method by method (interface: ``backends/__init__.py``).
Every kernel runs with ``nogil=True``, so several CPU devices driven by different host threads run
truly in parallel (numba ``omp`` threading layer); each thread sets its own budget with
:meth:`CPUBackend.thread_budget` (DESIGN.md §3).
"""

from __future__ import annotations

from contextlib import contextmanager

import numba
import numpy as np
import scipy.sparse

from xmc_engine.kernels import merge, output_layer, sparse_backward, sparse_forward, topk

_F32 = np.float32


class _CPUOutputOps:
    """Adapter used by the host-level output-layer functions (:mod:`kernels.output_layer`)."""

    def __init__(self, backend):
        self._ws = {}
        self._gemm = None

    def workspace(self, name, shape):
        n = int(np.prod(shape))
        buf = self._ws.get(name)
        if buf is None or buf.size < n:
            buf = self._ws[name] = np.empty(n, _F32)
        return buf[:n].reshape(shape)

    def workspace_2d(self, name, rows, cols, max_cols):
        buf = self.workspace(name, (rows * max_cols,))
        return buf[: rows * cols].reshape(rows, cols)

    @staticmethod
    def loss_value(x):
        return float(x)

    @staticmethod
    def matmul(a, b, out):
        np.matmul(a, b, out=out)

    def gemm_update(self, W, A, Bm, alpha):
        """W += alpha * A.T @ Bm in one BLAS call (beta = 1) when W is C-contiguous."""
        if W.flags.c_contiguous and A.flags.c_contiguous and Bm.flags.c_contiguous:
            if self._gemm is None:
                from scipy.linalg.blas import sgemm

                self._gemm = sgemm
            # W.T (F-order) += alpha * Bm.T @ A: every operand is Fortran-contiguous, no copies
            res = self._gemm(alpha, Bm.T, A.T, 1.0, W.T, trans_a=0, trans_b=1, overwrite_c=1)
            if np.shares_memory(res, W):
                return
        tmp = self.workspace("gemm_tmp", W.shape)
        np.matmul(A.T, Bm, out=tmp)
        output_layer._axpy_2d(W, tmp, alpha)

    @staticmethod
    def axpy(y, x, alpha):
        if y.ndim == 1:
            output_layer._axpy_serial(y, x, alpha)
        elif y.size < output_layer.SERIAL_BELOW:
            output_layer._axpy_serial(y, x, alpha)
        else:
            output_layer._axpy_2d(y, x, alpha)

    def softmax_bias(self, Z, b2, y_indptr, y_indices, scale, db2_out):
        loss_rows = np.empty(Z.shape[0], np.float64)
        n_parts = max(1, min(numba.get_num_threads(), Z.shape[0]))
        parts = self.workspace("colsum_parts", (n_parts, Z.shape[1]))
        output_layer.softmax_xent_fused_cpu(Z, b2, True, y_indptr, y_indices, scale, loss_rows,
                                            parts)
        output_layer._sum_parts(parts, db2_out, 1.0, 0.0)
        return float(loss_rows.sum())

    @staticmethod
    def row_stats(B):
        return np.full(B, -np.inf, _F32), np.zeros(B, _F32), np.zeros(B, _F32)

    @staticmethod
    def chunk_stats(Zc, b2c, c0, y_indptr, y_indices, m, s, ysum):
        output_layer.softmax_chunk_stats_cpu(Zc, b2c, c0, y_indptr, y_indices, m, s, ysum)

    @staticmethod
    def chunk_loss(m, s, ysum, y_indptr):
        lse = np.empty_like(m)
        return float(output_layer.chunk_loss_cpu(m, s, ysum, y_indptr, lse)), lse

    def chunk_grad(self, Zc, b2c, c0, y_indptr, y_indices, lse, scale, db2c_out):
        n_parts = max(1, min(numba.get_num_threads(), Zc.shape[0]))
        parts = self.workspace_2d("colsum_parts_c", n_parts, Zc.shape[1], Zc.shape[1])
        output_layer.softmax_chunk_grad_cpu(Zc, b2c, c0, y_indptr, y_indices, lse, scale, parts)
        output_layer._sum_parts(parts, db2c_out, 1.0, 0.0)

    @staticmethod
    def add_bias(Z, b):
        output_layer._add_bias(Z, b)

    @staticmethod
    def topk(Z, k, idx, val):
        topk.topk_cpu(Z, k, idx, val)

    @staticmethod
    def topk_merge(ia, va, ib, vb, io, vo):
        topk.topk_merge_cpu(ia, va, ib, vb, io, vo)


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
    """

    name = "cpu"
    xp = np
    sp = scipy.sparse
    device_id = None

    def __init__(self, threads: int | None = None):
        self.threads = int(threads) if threads else numba.config.NUMBA_NUM_THREADS
        self._output_ops = _CPUOutputOps(self)

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
    def empty(shape, dtype=_F32):
        return np.empty(shape, dtype)

    @staticmethod
    def zeros(shape, dtype=_F32):
        return np.zeros(shape, dtype)

    @staticmethod
    def copy_into(dst, src):
        """dst[...] = src (host <- host or device array)."""
        if not isinstance(src, np.ndarray) and hasattr(src, "get"):
            src = src.get()
        np.copyto(dst, src)

    @staticmethod
    def csr_parts(X):
        """SciPy CSR -> ``(indptr, indices, data float32)`` NumPy arrays."""
        X = scipy.sparse.csr_matrix(X) if not scipy.sparse.isspmatrix_csr(X) else X
        data = X.data if X.data.dtype == _F32 else X.data.astype(_F32)
        return X.indptr, X.indices, data

    def synchronize(self):
        """Nothing to wait for: CPU kernels return when done."""

    @contextmanager
    def thread_budget(self, n: int | None = None):
        """Limit numba threads (this thread only) and BLAS threads to ``n`` inside the block.

        numba's limit is per calling thread; OpenBLAS's limit (threadpoolctl) is process-wide,
        so concurrent CPU workers should agree on their budgets.
        """
        from threadpoolctl import threadpool_limits

        n = int(n or self.threads)
        old = numba.get_num_threads()
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        try:
            with threadpool_limits(limits=n, user_api="blas"):
                yield
        finally:
            numba.set_num_threads(old)

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
    def softmax_xent(Z, y_indptr, y_indices, scale):
        return float(output_layer.softmax_xent_cpu(Z, y_indptr, y_indices, scale))

    def output_layer_step(self, H, W2, b2, y_indptr, y_indices, lr, dH_out, *, label_chunk=None):
        return output_layer.output_layer_step(H, W2, b2, y_indptr, y_indices, lr, dH_out,
                                              label_chunk=label_chunk, backend=self)

    def output_layer_grad(self, H, W2, b2, y_indptr, y_indices, *, dH_out=None, dW2_out=None,
                          db2_out=None, label_chunk=None):
        return output_layer.output_layer_grad(H, W2, b2, y_indptr, y_indices, dH_out=dH_out,
                                              dW2_out=dW2_out, db2_out=db2_out,
                                              label_chunk=label_chunk, backend=self)

    def predict_scores_topk(self, H, W2, b2, k, *, label_chunk=None):
        return output_layer.predict_scores_topk(H, W2, b2, k, label_chunk=label_chunk,
                                                backend=self)

    @staticmethod
    def topk(scores, k):
        k = int(min(k, scores.shape[1]))
        idx = np.empty((scores.shape[0], k), np.int64)
        val = np.empty((scores.shape[0], k), scores.dtype)
        if k > 0:
            topk.topk_cpu(scores, k, idx, val)
        return idx, val

    @staticmethod
    def weighted_sum(arrays, weights, out):
        return merge.weighted_sum_cpu(arrays, weights, out)

    @staticmethod
    def momentum(wbar, z1, z2, mu, out):
        merge.momentum_cpu(wbar, z1, z2, mu, out)
        return out

    @staticmethod
    def elastic(x, center, alpha, diff_out):
        merge.elastic_cpu(x, center, alpha, diff_out)
        return diff_out
