"""CUDA backend: CuPy arrays, numba.cuda kernels and cuBLAS GEMMs on one non-blocking stream.

Implements the whole :class:`xmc_engine.backends.base.Backend` protocol, mirroring
:mod:`xmc_engine.backends.cpu` method by method. Importing this module needs neither CuPy nor a
GPU; :class:`CUDABackend` imports CuPy when it is constructed (DESIGN.md §3).

Streams and ordering
--------------------
Every array a backend allocates and every launch it makes happens inside :meth:`activate`: its
device current, its own ``cupy.cuda.Stream(non_blocking=True)`` current for CuPy/cuBLAS (so the
memory pool hands out blocks of that stream's arena, freed in stream order) and the same stream
for numba (``cuda.external_stream``). A worker thread enters it once for its lifetime through
:meth:`thread_budget`; each method enters it too, which costs nothing when it is already current.

Work on one stream is ordered by the stream. A read of an array another backend's stream wrote
(a merge reading the replicas, a replica copying the merged model back) first makes this stream
wait on an event recorded on every other live stream (:meth:`fence`), and afterwards makes every
other stream wait on an event recorded after the read, so that no owner overwrites what is still
being read (no host wait either way; the reads that end in a host wait need neither). Values read
on the host wait for this stream (the lines that end with ``# synchronize!``). Copies between
GPUs are peer copies when ``cudaDeviceCanAccessPeer`` says so (peer access is enabled
explicitly, once per pair) and go through the host otherwise.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np

from xmc_engine import output_layer as host_output_layer
from xmc_engine.kernels import (
    adagrad,
    bce_output,
    merge,
    output_layer,
    sampled_output,
    sparse_backward,
    sparse_forward,
    topk,
)

_F32 = np.float32
_PEER_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_ALIGN = 16  # bytes: every array packed into an upload starts at a multiple of this

_live_lock = threading.Lock()
_live: weakref.WeakSet = weakref.WeakSet()  # every CUDABackend alive: the streams fence() orders


class CUDABackend:
    """One CUDA device: CuPy arrays, numba.cuda kernels, cuBLAS, one non-blocking stream.

    Parameters
    ----------
    device_id : int
        CUDA ordinal. Several backends may share one GPU (one stream each, DESIGN.md §3).
    launch : callable, optional
        ``launch(launcher, *args, **kwargs)`` queues one launcher of :mod:`xmc_engine.kernels`
        (``sparse_forward.sparse_forward_launch``, ...) on this backend's stream. The default
        passes CuPy arrays as numba device arrays (``cuda.as_cuda_array(a, sync=False)``: the
        data is produced and consumed in this stream's order, so the CUDA-array-interface
        synchronisation would only add host waits) and the numba view of the stream. The test
        suite's CuPy stand-in passes one that runs NumPy versions of the kernels.

    Notes
    -----
    A backend object belongs to one host thread at a time (its workspaces are reused).
    """

    name = "cuda"
    #: the CPU thread budget: none, the host thread only queues work
    threads = None
    #: no row-sparse merge: a dense merge of ``W1`` streams at device bandwidth, while the rows'
    #: mask lives on the host and would cost an upload and a gather per merge (merge_rows and
    #: copy_rows work, for callers that pass rows themselves)
    tracks_rows = False
    xp: Any
    sp: Any
    device_id: int
    stream: Any

    def __init__(self, device_id: int = 0, *, launch=None):
        import cupy
        import cupy.cublas
        import cupyx.scipy.sparse

        self.xp = cupy
        self._cublas = cupy.cublas
        self.sp = cupyx.scipy.sparse
        self.device_id = int(device_id)
        self._local = threading.local()
        self._ws: dict[str, Any] = {}
        self._peer: dict[int, bool] = {}  # owning device -> this device reads it directly
        # two pinned staging buffers for upload(), each with the event of its last copy
        self._staging: list[list] = [[None, None], [None, None]]
        self._next_staging = 0
        with cupy.cuda.Device(self.device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        if launch is None:
            from numba import cuda

            with cuda.gpus[self.device_id]:
                self._nb_stream = cuda.external_stream(self.stream.ptr)
            self._numba = cuda
            launch = self._numba_launch
        self._launch = launch
        with _live_lock:
            _live.add(self)

    def __repr__(self):
        return f"CUDABackend(device_id={self.device_id})"

    # ------------------------------------------------------------------ context and ordering
    @contextmanager
    def activate(self):
        """This backend's device and stream current for CuPy and cuBLAS (numba launches are
        given the stream explicitly).

        Re-entrant per thread: nested entries (a method called inside a worker's context) cost
        one attribute read. Allocations inside land in the pool arena of this stream, so a
        block freed by a step is handed out again only in this stream's order.
        """
        if getattr(self._local, "active", False):
            yield
            return
        self._local.active = True
        try:
            with self.xp.cuda.Device(self.device_id), self.stream:
                yield
        finally:
            self._local.active = False

    @contextmanager
    def thread_budget(self, n: int | None = None):
        """No CPU threads to limit: enters :meth:`activate` for the worker's lifetime."""
        with self.activate():
            yield

    def kernel_threads(self, n: int):
        """No CPU kernel threads to limit."""
        return nullcontext()

    def synchronize(self):
        """Wait for all work queued on this backend's stream."""
        self.stream.synchronize()  # synchronize!

    def fence(self):
        """Make this stream wait for the work queued so far on every other live backend's
        stream (one recorded event each; the host does not wait)."""
        with _live_lock:
            others = [b for b in _live if b is not self]
        for b in others:
            if b.stream is self.stream:
                continue
            with self.xp.cuda.Device(b.device_id):
                ev = b.stream.record()
            with self.xp.cuda.Device(self.device_id):
                self.stream.wait_event(ev)

    def _release(self):
        """Make every other live backend's stream wait for the work queued so far on this one:
        after this stream read another stream's arrays, their owner must not overwrite them
        before the read is done (write-after-read)."""
        with _live_lock:
            others = [b for b in _live if b is not self and b.stream is not self.stream]
        if not others:
            return
        with self.xp.cuda.Device(self.device_id):
            ev = self.stream.record()
        for b in others:
            with self.xp.cuda.Device(b.device_id):
                b.stream.wait_event(ev)

    def _numba_launch(self, launcher, *args, **kwargs):
        nb = self._numba.as_cuda_array
        nd = self.xp.ndarray

        def conv(a):
            if isinstance(a, nd):
                return nb(a, sync=False)
            if isinstance(a, (list, tuple)):
                return [conv(x) for x in a]
            return a

        with self._numba.gpus[self.device_id]:
            launcher(*[conv(a) for a in args], stream=self._nb_stream,
                     **{k: conv(v) for k, v in kwargs.items()})

    def _peer_access(self, src: int) -> bool:
        """Whether this device can read device ``src``'s memory directly; enables it once.

        Asks ``cudaDeviceCanAccessPeer`` and, when allowed, calls ``cudaDeviceEnablePeerAccess``
        with this device current (explicitly: not as a side effect of CuPy's first copy).
        ``False`` means copies from ``src`` go through the host.
        """
        if src == self.device_id:
            return True
        if src not in self._peer:
            rt = self.xp.cuda.runtime
            ok = bool(rt.deviceCanAccessPeer(self.device_id, src))
            if ok:
                with self.xp.cuda.Device(self.device_id):
                    try:
                        rt.deviceEnablePeerAccess(src)
                    except rt.CUDARuntimeError as e:  # another backend of this device did it
                        if e.status != _PEER_ALREADY_ENABLED:
                            raise
            self._peer[src] = ok
        return self._peer[src]

    def _download(self, a) -> np.ndarray:
        """Host copy of another device's array, after all work queued on that device's streams
        (:meth:`to_host` of such an array, and the host fallback of a copy between GPUs without
        peer access)."""
        dev = a.device.id
        with _live_lock:
            owners = [b for b in _live if b.device_id == dev]
        for b in owners:
            b.synchronize()  # synchronize!
        with self.xp.cuda.Device(dev):
            stream = self.xp.cuda.Stream(non_blocking=True)
            out = a.get(stream=stream)
            stream.synchronize()  # synchronize!
        return out

    def _is_device(self, a) -> bool:
        return isinstance(a, self.xp.ndarray)

    def _readable(self, a, tag: str):
        """``a`` itself when this device can read it (its own or a peer-accessible device's
        array), else a copy here through the host (workspace ``tag``)."""
        if self._peer_access(a.device.id):
            return a
        local = self.workspace(tag, a.shape, a.dtype)
        self.copy_into(local, a)
        return local

    # ------------------------------------------------------------------ arrays and transfers
    def asarray(self, a, dtype=None):
        """Host or device array -> CuPy array on this device (async H2D on this stream).

        A device array of this device is returned as it is (converted when ``dtype`` differs),
        with this stream ordered after the other streams' pending writes (:meth:`fence`); one of
        another device is copied here."""
        with self.activate():
            if self._is_device(a):
                if a.device.id != self.device_id:
                    out = self.empty(a.shape, a.dtype if dtype is None else dtype)
                    self.copy_into(out, a)
                    return out
                self.fence()
            return self.xp.ascontiguousarray(self.xp.asarray(a, dtype=dtype))

    def to_host(self, a):
        """-> ``numpy.ndarray``, after this stream (an array of another device: after all of
        that device's streams)."""
        if not self._is_device(a):
            return np.asarray(a)
        if a.device.id != self.device_id:
            return self._download(a)
        with self.activate():
            out = a.get(stream=self.stream)
            self.stream.synchronize()  # synchronize!
        return out

    def to_float(self, x) -> float:
        """``float(x)`` read after this stream has finished (never on the null stream)."""
        if not self._is_device(x):
            return float(x)
        return float(self.to_host(x))  # synchronize!

    def empty(self, shape, dtype=_F32):
        with self.activate():
            return self.xp.empty(shape, dtype)

    def zeros(self, shape, dtype=_F32):
        with self.activate():
            return self.xp.zeros(shape, dtype)

    def workspace(self, name, shape, dtype=_F32):
        n = int(np.prod(shape))
        buf = self._ws.get(name)
        if buf is None or buf.size < n or buf.dtype != dtype:
            buf = self._ws[name] = self.empty(n, dtype)
        return buf[:n].reshape(shape)

    def copy_into(self, dst, src):
        """``dst[...] = src`` on this stream: host -> device, device -> device (after the
        source stream's pending work, :meth:`fence`), peer copy across GPUs when peer access is
        available, else through the host."""
        with self.activate():
            if not self._is_device(src):
                dst.set(np.ascontiguousarray(src, dtype=dst.dtype), stream=self.stream)
                return
            self.fence()
            if src.device.id == self.device_id:
                dst[...] = src
            elif self._peer_access(src.device.id):
                dst.data.copy_from_device_async(src.data, src.nbytes, stream=self.stream)
            else:  # no peer access: through the host
                dst.set(self._download(src), stream=self.stream)
            self._release()

    def upload(self, arrays):
        """Host arrays -> CuPy arrays on this device with one asynchronous copy on this stream.

        The arrays are packed into a pinned staging buffer (two alternate, so that packing the
        next batch overlaps the copy of this one; a buffer is reused only after the event of
        its previous copy), copied to one device block and returned as views of it.
        """
        arrays = [np.ascontiguousarray(a) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        slot = self._staging[self._next_staging]
        self._next_staging ^= 1
        buf, done = slot
        if done is not None:
            done.synchronize()  # synchronize! (the previous copy out of this buffer)
        if buf is None or buf.size < total:
            mem = self.xp.cuda.alloc_pinned_memory(max(total, 1 << 16))
            buf = slot[0] = np.frombuffer(mem, np.uint8, max(total, 1 << 16))
        for a, off in zip(arrays, offsets, strict=True):
            buf[off:off + a.nbytes] = a.view(np.uint8).reshape(-1)
        with self.activate():
            block = self.xp.empty(max(total, 1), np.uint8)
            block.set(buf[:max(total, 1)], stream=self.stream)
            slot[1] = self.stream.record()
            return [block[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
                    for a, off in zip(arrays, offsets, strict=True)]

    def csr_parts(self, X):
        """SciPy CSR (or a ``batches.CSRBatch``, or a CuPy CSR) -> ``(indptr int64, indices,
        data float32)`` CuPy arrays (async uploads on this stream). The row pointers are int64,
        the type of the training batches' (as on the CPU backend), so that prediction launches
        the forward kernel compiled for training rather than a second compilation for SciPy's
        int32 pointers (not timed on a GPU)."""
        with self.activate():
            if hasattr(X, "get") and not hasattr(X, "toarray"):
                X = X.get()
            return (self.asarray(X.indptr, dtype=np.int64), self.asarray(X.indices),
                    self.asarray(X.data, dtype=_F32))

    # ------------------------------------------------------------------ sparse input layer
    def sparse_forward(self, indptr, indices, data, W1, b1, out):
        with self.activate():
            self._launch(sparse_forward.sparse_forward_launch, indptr, indices, data, W1, b1,
                         out)
        return out

    def sparse_backward_update(self, indptr, indices, data, dZ1, W1, b1, lr):
        with self.activate():
            self._launch(sparse_backward.sparse_backward_update_launch, indptr, indices, data,
                         dZ1, W1, b1, lr)

    def sparse_grad(self, indptr, indices, data, dZ1):
        cp = self.xp
        with self.activate():
            rows = cp.unique(indices.astype(np.int64))  # synchronize! (result size)
            inv = cp.searchsorted(rows, indices)
            grad_rows = cp.zeros((rows.shape[0], dZ1.shape[1]), _F32)
            grad_b1 = cp.zeros(dZ1.shape[1], _F32)
            self._launch(sparse_backward.sparse_grad_launch, indptr, inv, data, dZ1, grad_rows,
                         grad_b1)
        return rows, grad_rows, grad_b1

    def sparse_rows_update(self, W1, rows, grad_rows, lr):
        with self.activate():
            self._launch(sparse_backward.sparse_rows_update_launch, W1, rows, grad_rows, lr)

    def relu_backward(self, dH, H):
        with self.activate():
            self._launch(sparse_backward.relu_backward_launch, dH, H)
        return dH

    # ------------------------------------------------------------------ dense arithmetic
    def matmul(self, a, b, out):
        with self.activate():
            self.xp.matmul(a, b, out=out)

    def gemm_acc(self, C, A, Bm, alpha=1.0):
        """C += alpha * A @ Bm: one cuBLAS GEMM with beta = 1 when ``C`` is C-contiguous, else
        through a workspace and an add (strided ``C``)."""
        with self.activate():
            if C.flags.c_contiguous:
                self._cublas.gemm("N", "N", A, Bm, out=C, alpha=float(alpha), beta=1.0)
                return
            tmp = self.workspace("gemm_tmp", C.shape)
            self.xp.matmul(A, Bm, out=tmp)
            self.axpy(C, tmp, alpha)

    def gemm_update(self, W, A, Bm, alpha):
        """W += alpha * A.T @ Bm: one cuBLAS GEMM with beta = 1 when ``W`` is C-contiguous,
        else through a workspace and an add (a strided ``W2`` chunk)."""
        with self.activate():
            if W.flags.c_contiguous:
                self._cublas.gemm("T", "N", A, Bm, out=W, alpha=float(alpha), beta=1.0)
                return
            tmp = self.workspace("gemm_tmp", W.shape)
            self.xp.matmul(A.T, Bm, out=tmp)
            self.axpy(W, tmp, alpha)

    def axpy(self, y, x, alpha):
        with self.activate():
            y += _F32(alpha) * x

    # ------------------------------------------------------------------ output layer
    def softmax_xent(self, Z, y_indptr, y_indices, scale):
        """Returns the summed loss as a 0-d device array (read it with :meth:`to_float`)."""
        with self.activate():
            loss_rows = self.workspace("loss_rows", (Z.shape[0],), np.float64)
            work = self.workspace("softmax_work", (output_layer.softmax_work_size(*Z.shape),))
            self._launch(output_layer.softmax_xent_launch, Z, y_indptr, y_indices, scale,
                         loss_rows, work, None)
            return loss_rows.sum()

    def softmax_bias(self, Z, b2, y_indptr, y_indices, scale, db2_out):
        with self.activate():
            loss_rows = self.workspace("loss_rows", (Z.shape[0],), np.float64)
            work = self.workspace("softmax_work", (output_layer.softmax_work_size(*Z.shape),))
            db2_out[...] = 0
            self._launch(output_layer.softmax_xent_launch, Z, y_indptr, y_indices, scale,
                         loss_rows, work, db2_out, bias=b2)
            return loss_rows.sum()

    def bce_bias(self, Z, b2, c0, y_indptr, y_indices, scale, db2_out, alpha=1.0, beta=0.0,
                 colw=None):
        """Returns the summed loss as a 0-d device array (read it with :meth:`to_float`)."""
        with self.activate():
            loss = self.workspace("bce_loss", (1,), np.float64)
            loss.fill(0.0)
            if alpha == 1.0 and beta == 0.0:
                colsum = db2_out
            else:  # b2c may be the kernel's input and the sum's target: sum into a workspace
                colsum = self.workspace("colsum_c", db2_out.shape)
            colsum[...] = 0
            w = self.workspace("no_weights", (0,)) if colw is None else colw
            self._launch(bce_output.bce_launch, Z, b2, True, int(c0), w, y_indptr, y_indices,
                         scale, loss, colsum)
            if colsum is not db2_out:
                db2_out *= _F32(beta)
                db2_out += _F32(alpha) * colsum
            return loss.sum()

    def row_stats(self, B):
        m, s, ysum = (self.workspace(k, (B,)) for k in ("row_m", "row_s", "row_ysum"))
        with self.activate():
            m.fill(-np.inf)  # the CUDA kernels are not compiled with fastmath
            s.fill(0.0)
            ysum.fill(0.0)
        return m, s, ysum

    def chunk_stats(self, Zc, b2c, c0, y_indptr, y_indices, m, s, ysum):
        with self.activate():
            self._launch(output_layer.softmax_chunk_stats_launch, Zc, b2c, c0, y_indptr,
                         y_indices, m, s, ysum)

    def chunk_loss(self, m, s, ysum, y_indptr):
        with self.activate():
            cp = self.xp
            lse = m + cp.log(s)
            ny = cp.diff(y_indptr).astype(_F32)
            per_row = cp.where(ny > 0, lse - ysum / cp.maximum(ny, 1), 0)
            return per_row.sum(dtype=np.float64), lse

    def chunk_grad(self, Zc, b2c, c0, y_indptr, y_indices, lse, scale, db2c_out, alpha=1.0,
                   beta=0.0):
        with self.activate():
            if beta == 0.0 or alpha == 0.0:
                colsum = db2c_out
            else:  # b2c is the kernel's input and the sum's target: sum into a workspace
                colsum = self.workspace("colsum_c", db2c_out.shape)
            self._launch(output_layer.softmax_chunk_grad_launch, Zc, b2c, c0, y_indptr,
                         y_indices, lse, scale)
            colsum[...] = 0
            self._launch(sparse_backward.column_sum_launch, Zc, colsum, 1.0)
            if colsum is db2c_out:
                db2c_out *= _F32(alpha)
            else:
                db2c_out *= _F32(beta)
                db2c_out += _F32(alpha) * colsum

    def add_bias(self, Z, b):
        with self.activate():
            Z += b

    def topk(self, scores, k):
        with self.activate():
            k = int(min(k, scores.shape[1]))
            idx = self.xp.empty((scores.shape[0], k), np.int64)
            val = self.xp.empty((scores.shape[0], k), scores.dtype)
            if k > 0:
                self.topk_into(scores, k, idx, val)
        return idx, val

    def topk_into(self, scores, k, idx, val):
        with self.activate():
            shape = topk.topk_scratch_shape(scores.shape[0], k)
            ci = self.xp.empty(shape, np.int64)
            cv = self.xp.empty(shape, _F32)
            self._launch(topk.topk_launch, scores, k, ci, cv, idx, val)

    def topk_merge(self, ia, va, ib, vb, io, vo):
        with self.activate():
            self._launch(topk.topk_merge_launch, ia, va, ib, vb, io, vo)

    def output_layer_step(self, H, W2, b2, y_indptr, y_indices, lr, dH_out, *, label_chunk=None,
                          loss="softmax"):
        with self.activate():
            return host_output_layer.output_layer_step(self, H, W2, b2, y_indptr, y_indices, lr,
                                                       dH_out, label_chunk=label_chunk, loss=loss)

    def output_layer_grad(self, H, W2, b2, y_indptr, y_indices, *, dH_out=None, dW2_out=None,
                          db2_out=None, label_chunk=None, loss="softmax"):
        with self.activate():
            return host_output_layer.output_layer_grad(self, H, W2, b2, y_indptr, y_indices,
                                                       dH_out=dH_out, dW2_out=dW2_out,
                                                       db2_out=db2_out, label_chunk=label_chunk,
                                                       loss=loss)

    def sampled_output_grad(self, H, W2, b2, cols, n_pos, log_weight, y_indptr, local_y, *,
                            loss="softmax"):
        with self.activate():
            return host_output_layer.sampled_output_grad(self, H, W2, b2, cols, n_pos,
                                                         log_weight, y_indptr, local_y,
                                                         loss=loss)

    def gather_columns(self, W2, b2, cols, W2s, b2s):
        with self.activate():
            self._launch(sampled_output.gather_columns_launch, W2, b2, cols, W2s, b2s)

    def scatter_add_columns(self, W2, b2, cols, dW2s, db2s, alpha):
        with self.activate():
            self._launch(sampled_output.scatter_add_columns_launch, W2, b2, cols, dW2s, db2s,
                         alpha)

    def predict_scores_topk(self, H, W2, b2, k, *, label_chunk=None):
        with self.activate():
            return host_output_layer.predict_scores_topk(self, H, W2, b2, k,
                                                         label_chunk=label_chunk)

    # ------------------------------------------------------------------ merges
    def all_finite(self, a) -> bool:
        """No NaN or infinity in ``a`` (one reduction; waits for it)."""
        with self.activate():
            self.fence()
            a = self._readable(a, "finite_src")
            return bool(self.to_host(self.xp.isfinite(a).all()))  # synchronize!

    def weighted_sum(self, arrays, weights, out):
        with self.activate():
            self.fence()
            arrays = [self._readable(a, f"merge_src{i}") for i, a in enumerate(arrays)]
            self._launch(merge.weighted_sum_launch, list(arrays), weights, out)
            self._release()
        return out

    def merge_rows(self, arrays, weights, rows, out, broadcast=False,
                   norm=True) -> tuple[bool, float]:
        """``out[r] = sum_i weights[i] arrays[i][r]`` for ``r`` in ``rows``; returns ``(all
        finite, change of sum(out**2))`` (waits for the result). ``broadcast``: the finite
        merged rows are also written back to every array of ``arrays``. ``norm`` is accepted
        for the interface; the change is always computed here."""
        cp = self.xp
        with self.activate():
            self.fence()
            r = cp.asarray(np.asarray(rows, np.int64))
            old = out[r]
            new = cp.zeros_like(old)
            for a, w in zip(arrays, weights, strict=True):
                new += _F32(w) * self._readable(a, "merge_rows_src")[r]
            out[r] = new
            finite_rows = cp.isfinite(new).all(axis=1)
            if broadcast:
                keep = r[finite_rows]
                for a in arrays:
                    a[keep] = new[finite_rows]
            ok = finite_rows.all()
            delta = (new.astype(np.float64) ** 2).sum() - (old.astype(np.float64) ** 2).sum()
            ok, delta = self.to_host(cp.stack([ok.astype(np.float64), delta]))  # synchronize!
        return bool(ok), float(delta)

    def copy_rows(self, dst, src, rows) -> None:
        """``dst[r] = src[r]`` for ``r`` in ``rows`` (int64, host), after ``src``'s writes."""
        with self.activate():
            self.fence()
            r = self.xp.asarray(np.asarray(rows, np.int64))
            dst[r] = self._readable(src, "copy_rows_src")[r]
            self._release()

    def merge_columns(self, arrays, weights, cols, out, broadcast=False) -> bool:
        """``out[..., c_j] = sum_i weights[i, j] arrays[i][..., c_j]`` for the columns of
        ``cols``; returns whether all are finite (waits for the result). ``broadcast``: the
        merged values are also written back to every array of ``arrays``, all of them where
        they are finite, none otherwise."""
        cp = self.xp
        with self.activate():
            self.fence()
            c = cp.asarray(np.asarray(cols, np.int64))
            w = cp.asarray(np.asarray(weights, np.float32))
            new = cp.zeros(out.shape[:-1] + (c.size,), dtype=out.dtype)
            for i, a in enumerate(arrays):
                new += w[i] * self._readable(a, "merge_columns_src")[..., c]
            out[..., c] = new
            ok = bool(self.to_host(cp.isfinite(new).all()))  # synchronize!
            if broadcast and ok:
                for a in arrays:
                    a[..., c] = new
                self._release()  # the replicas' own streams after these writes
        return ok

    def copy_columns(self, dst, src, cols) -> None:
        """``dst[..., c] = src[..., c]`` for ``c`` in ``cols`` (int64, host), after ``src``'s
        writes."""
        with self.activate():
            self.fence()
            c = self.xp.asarray(np.asarray(cols, np.int64))
            dst[..., c] = self._readable(src, "copy_columns_src")[..., c]
            self._release()

    def momentum(self, wbar, z1, z2, mu, out):
        with self.activate():
            self._launch(merge.momentum_launch, wbar, z1, z2, mu, out)
        return out

    def elastic(self, x, center, alpha, diff_out):
        with self.activate():
            self.fence()
            self._launch(merge.elastic_launch, x, self._readable(center, "elastic_center"),
                         alpha, diff_out)
            self._release()
        return diff_out

    # ------------------------------------------------------------------ optimiser
    def adagrad_dense(self, w, g, acc, lr, eps):
        with self.activate():
            self._launch(adagrad.adagrad_dense_launch, w, g, acc, lr, eps)

    def adagrad_rows(self, W, rows, grad_rows, acc_W, lr, eps):
        with self.activate():
            self._launch(adagrad.adagrad_rows_launch, W, rows, grad_rows, acc_W, lr, eps)

    def adagrad_columns(self, W2, b2, acc_W2, acc_b2, cols, dW2s, db2s, lr, eps):
        with self.activate():
            self._launch(sampled_output.adagrad_columns_launch, W2, b2, acc_W2, acc_b2, cols,
                         dW2s, db2s, lr, eps)
