"""CUDA backend: CuPy arrays, numba.cuda kernels and cuBLAS GEMMs on one non-blocking stream.

Mirrors :mod:`xmc_engine.backends.cpu` method by method (interface: ``backends/__init__.py``).
Importing this module needs neither CuPy nor a GPU; :class:`CUDABackend` imports CuPy when it is
constructed (DESIGN.md §3). Every launch is queued on the backend's own
``cupy.cuda.Stream(non_blocking=True)``: CuPy/cuBLAS work under ``with stream:``, numba kernels
through ``cuda.external_stream(stream.ptr)``. Methods return without waiting, except those whose
line carries ``# synchronize!`` (device -> host results, and ``cupy.unique`` in ``sparse_grad``).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from xmc_engine.kernels import (
    adagrad,
    merge,
    output_layer,
    sparse_backward,
    sparse_forward,
    topk,
)

_F32 = np.float32


class _CUDAOutputOps:
    """Adapter used by the host-level output-layer functions (:mod:`kernels.output_layer`).

    Called inside ``backend._on()``, i.e. with the backend's device and stream current.
    """

    def __init__(self, backend):
        self.be = backend
        self._ws = {}

    def workspace(self, name, shape):
        cp = self.be.xp
        n = int(np.prod(shape))
        buf = self._ws.get(name)
        if buf is None or buf.size < n:
            buf = self._ws[name] = cp.empty(n, _F32)
        return buf[:n].reshape(shape)

    def workspace_2d(self, name, rows, cols, max_cols):
        return self.workspace(name, (rows * max_cols,))[: rows * cols].reshape(rows, cols)

    def loss_value(self, x):
        return self.be.xp.asarray(x, dtype=np.float64)

    def matmul(self, a, b, out):
        self.be.xp.matmul(a, b, out=out)

    def gemm_update(self, W, A, Bm, alpha):
        """W += alpha * A.T @ Bm: one cuBLAS GEMM with beta = 1 (in place for C-order W)."""
        import cupy.cublas

        cupy.cublas.gemm("T", "N", A, Bm, out=W, alpha=float(alpha), beta=1.0)

    def axpy(self, y, x, alpha):
        y += _F32(alpha) * x

    def softmax_bias(self, Z, b2, y_indptr, y_indices, scale, db2_out):
        cp = self.be.xp
        loss_rows = cp.empty(Z.shape[0], np.float64)
        s = self.be.nb_stream
        nb = self.be._nb
        output_layer.softmax_xent_launch(nb(Z), nb(y_indptr), nb(y_indices), scale,
                                         nb(loss_rows), s, bias=nb(b2))
        db2_out[...] = 0
        sparse_backward.column_sum_launch(nb(Z), nb(db2_out), 1.0, s)
        return loss_rows.sum()

    def row_stats(self, B):
        cp = self.be.xp
        return cp.full(B, -np.inf, _F32), cp.zeros(B, _F32), cp.zeros(B, _F32)

    def chunk_stats(self, Zc, b2c, c0, y_indptr, y_indices, m, s, ysum):
        nb = self.be._nb
        output_layer.softmax_chunk_stats_launch(nb(Zc), nb(b2c), c0, nb(y_indptr),
                                                nb(y_indices), nb(m), nb(s), nb(ysum),
                                                self.be.nb_stream)

    def chunk_loss(self, m, s, ysum, y_indptr):
        cp = self.be.xp
        lse = m + cp.log(s)
        ny = cp.diff(y_indptr).astype(_F32)
        per_row = cp.where(ny > 0, lse - ysum / cp.maximum(ny, 1), 0)
        return per_row.sum(dtype=np.float64), lse

    def chunk_grad(self, Zc, b2c, c0, y_indptr, y_indices, lse, scale, db2c_out):
        nb = self.be._nb
        s = self.be.nb_stream
        output_layer.softmax_chunk_grad_launch(nb(Zc), nb(b2c), c0, nb(y_indptr), nb(y_indices),
                                               nb(lse), scale, s)
        db2c_out[...] = 0
        sparse_backward.column_sum_launch(nb(Zc), nb(db2c_out), 1.0, s)

    def add_bias(self, Z, b):
        Z += b

    def topk(self, Z, k, idx, val):
        cp = self.be.xp
        nb = self.be._nb
        shape = topk.topk_scratch_shape(Z.shape[0], k)
        ci = cp.empty(shape, np.int64)
        cv = cp.empty(shape, _F32)
        topk.topk_launch(nb(Z), k, nb(ci), nb(cv), nb(idx), nb(val), self.be.nb_stream)

    def topk_merge(self, ia, va, ib, vb, io, vo):
        nb = self.be._nb
        topk.topk_merge_launch(nb(ia), nb(va), nb(ib), nb(vb), nb(io), nb(vo),
                               self.be.nb_stream)


class CUDABackend:
    """One CUDA device: CuPy arrays, numba.cuda kernels, cuBLAS, one non-blocking stream.

    Parameters
    ----------
    device_id : int
        CUDA ordinal. Several backends may share one GPU (one stream each, DESIGN.md §3).

    Notes
    -----
    A backend object belongs to one host thread at a time (its workspaces are reused).
    Numba kernels receive CuPy arrays through ``cuda.as_cuda_array(a, sync=False)``: the data
    is produced and consumed in the order of this one stream, so the CUDA-array-interface
    synchronisation would only add host waits.
    """

    name = "cuda"

    def __init__(self, device_id: int = 0):
        import cupy
        import cupyx.scipy.sparse
        from numba import cuda

        self.xp = cupy
        self.sp = cupyx.scipy.sparse
        self.device_id = int(device_id)
        self._cuda = cuda
        with cupy.cuda.Device(self.device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        with cuda.gpus[self.device_id]:
            self.nb_stream = cuda.external_stream(self.stream.ptr)
        self._output_ops = _CUDAOutputOps(self)

    def __repr__(self):
        return f"CUDABackend(device_id={self.device_id})"

    # ------------------------------------------------------------------ plumbing
    @contextmanager
    def _on(self):
        """This backend's device and stream current for CuPy and numba."""
        with self.xp.cuda.Device(self.device_id), self.stream, self._cuda.gpus[self.device_id]:
            yield

    def _nb(self, a):
        """CuPy array -> numba device array view, without CUDA-array-interface syncs."""
        return self._cuda.as_cuda_array(a, sync=False)

    def asarray(self, a, dtype=None):
        """Host or device array -> CuPy array on this device (async H2D on this stream)."""
        with self._on():
            return self.xp.ascontiguousarray(self.xp.asarray(a, dtype=dtype))

    def to_host(self, a):
        if isinstance(a, np.ndarray):
            return a
        with self._on():
            out = a.get(stream=self.stream)
            self.stream.synchronize()  # synchronize!
        return out

    def empty(self, shape, dtype=_F32):
        with self._on():
            return self.xp.empty(shape, dtype)

    def zeros(self, shape, dtype=_F32):
        with self._on():
            return self.xp.zeros(shape, dtype)

    def copy_into(self, dst, src):
        """dst[...] = src on this stream: host -> device, or device -> device (peer copy when
        ``src`` lives on another GPU)."""
        with self._on():
            if isinstance(src, np.ndarray):
                dst.set(np.ascontiguousarray(src, dtype=dst.dtype), stream=self.stream)
            elif src.device.id == self.device_id:
                dst[...] = src
            else:
                dst.data.copy_from_device_async(src.data, src.nbytes, stream=self.stream)

    def csr_parts(self, X):
        """SciPy (or CuPy) CSR -> ``(indptr, indices, data float32)`` CuPy arrays."""
        with self._on():
            if hasattr(X, "get") and not hasattr(X, "toarray"):
                X = X.get()
            return (self.xp.asarray(X.indptr), self.xp.asarray(X.indices),
                    self.xp.asarray(X.data, dtype=_F32))

    def synchronize(self):
        self.stream.synchronize()  # synchronize!

    @contextmanager
    def thread_budget(self, n: int | None = None):
        """No CPU threads to limit: the host thread only queues work."""
        yield

    # ------------------------------------------------------------------ kernels
    def sparse_forward(self, indptr, indices, data, W1, b1, out):
        nb = self._nb
        with self._on():
            sparse_forward.sparse_forward_launch(nb(indptr), nb(indices), nb(data), nb(W1),
                                                 nb(b1), nb(out), self.nb_stream)
        return out

    def sparse_backward_update(self, indptr, indices, data, dZ1, W1, b1, lr):
        nb = self._nb
        with self._on():
            sparse_backward.sparse_backward_update_launch(nb(indptr), nb(indices), nb(data),
                                                          nb(dZ1), nb(W1), nb(b1), lr,
                                                          self.nb_stream)

    def sparse_grad(self, indptr, indices, data, dZ1):
        cp, nb = self.xp, self._nb
        with self._on():
            rows = cp.unique(indices.astype(np.int64))  # synchronize! (result size)
            inv = cp.searchsorted(rows, indices)
            grad_rows = cp.zeros((rows.shape[0], dZ1.shape[1]), _F32)
            grad_b1 = cp.zeros(dZ1.shape[1], _F32)
            sparse_backward.sparse_grad_launch(nb(indptr), nb(inv), nb(data), nb(dZ1),
                                               nb(grad_rows), nb(grad_b1), self.nb_stream)
        return rows, grad_rows, grad_b1

    def sparse_rows_update(self, W1, rows, grad_rows, lr):
        nb = self._nb
        with self._on():
            sparse_backward.sparse_rows_update_launch(nb(W1), nb(rows), nb(grad_rows), lr,
                                                      self.nb_stream)

    def relu_backward(self, dH, H):
        nb = self._nb
        with self._on():
            sparse_backward.relu_backward_launch(nb(dH), nb(H), self.nb_stream)
        return dH

    def softmax_xent(self, Z, y_indptr, y_indices, scale):
        """Returns the summed loss as a 0-d device array (``float()`` synchronises)."""
        nb = self._nb
        with self._on():
            loss_rows = self.xp.empty(Z.shape[0], np.float64)
            output_layer.softmax_xent_launch(nb(Z), nb(y_indptr), nb(y_indices), scale,
                                             nb(loss_rows), self.nb_stream)
            return loss_rows.sum()

    def output_layer_step(self, H, W2, b2, y_indptr, y_indices, lr, dH_out, *, label_chunk=None):
        with self._on():
            return output_layer.output_layer_step(H, W2, b2, y_indptr, y_indices, lr, dH_out,
                                                  label_chunk=label_chunk, backend=self)

    def output_layer_grad(self, H, W2, b2, y_indptr, y_indices, *, dH_out=None, dW2_out=None,
                          db2_out=None, label_chunk=None):
        with self._on():
            return output_layer.output_layer_grad(H, W2, b2, y_indptr, y_indices, dH_out=dH_out,
                                                  dW2_out=dW2_out, db2_out=db2_out,
                                                  label_chunk=label_chunk, backend=self)

    def predict_scores_topk(self, H, W2, b2, k, *, label_chunk=None):
        with self._on():
            return output_layer.predict_scores_topk(H, W2, b2, k, label_chunk=label_chunk,
                                                    backend=self)

    def topk(self, scores, k):
        cp = self.xp
        with self._on():
            k = int(min(k, scores.shape[1]))
            idx = cp.empty((scores.shape[0], k), np.int64)
            val = cp.empty((scores.shape[0], k), scores.dtype)
            if k > 0:
                self._output_ops.topk(scores, k, idx, val)
        return idx, val

    def weighted_sum(self, arrays, weights, out):
        nb = self._nb
        with self._on():
            merge.weighted_sum_launch([nb(a) for a in arrays], weights, nb(out), self.nb_stream)
        return out

    def momentum(self, wbar, z1, z2, mu, out):
        nb = self._nb
        with self._on():
            merge.momentum_launch(nb(wbar), nb(z1), nb(z2), mu, nb(out), self.nb_stream)
        return out

    def elastic(self, x, center, alpha, diff_out):
        nb = self._nb
        with self._on():
            merge.elastic_launch(nb(x), nb(center), alpha, nb(diff_out), self.nb_stream)
        return diff_out

    def adagrad_dense(self, w, g, acc, lr, eps):
        nb = self._nb
        with self._on():
            adagrad.adagrad_dense_launch(nb(w), nb(g), nb(acc), lr, eps, self.nb_stream)

    def adagrad_rows(self, W, rows, grad_rows, acc_W, lr, eps):
        nb = self._nb
        with self._on():
            adagrad.adagrad_rows_launch(nb(W), nb(rows), nb(grad_rows), nb(acc_W), lr, eps,
                                        self.nb_stream)
