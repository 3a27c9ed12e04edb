"""The declared backend interface: what model, output layer and scheduler may call on a device.

Two ``typing.Protocol`` classes, the second extending the first:

:class:`SchedulerBackend`
    What the scheduler, the merges and the algorithms use (:mod:`xmc_engine.scheduler`,
    :mod:`xmc_engine.algorithms`): arrays and their transfers, the worker context
    (``activate``, ``thread_budget``, ``synchronize``) and the merge launchers. The scheduler's
    test double :class:`xmc_engine.scheduler.replica.HostBackend` implements this part.
:class:`Backend`
    Everything: the above plus the model's kernels and the output layer
    (:mod:`xmc_engine.model`, :mod:`xmc_engine.output_layer`). :class:`~.cpu.CPUBackend` and
    :class:`~.cuda.CUDABackend` implement all of it with the same signatures
    (``tests/test_backends.py`` checks names, parameter kinds and defaults).

Capabilities differ only through declared class attributes (never ``hasattr`` probes):

``tracks_rows``
    Replicas on this backend record the ``W1`` rows their steps change, and the merge reads and
    writes only those rows (``merge_rows`` / ``copy_rows``,
    :func:`xmc_engine.scheduler.merge.merge_changed_rows`); with the sampled output layer also
    only the ``W2`` columns and ``b2`` entries the steps changed (``merge_columns`` /
    ``copy_columns``). Where it is False the merge is dense.

Arrays are float32 (parameters, activations) and int32/int64 (CSR indices) on the backend's
device. Launchers queue work on the backend's stream and return without waiting; the methods
that wait say so (``to_host``, ``to_float``, ``all_finite``, ``merge_rows``, ``sparse_grad``
on CUDA). A backend object (its workspaces) belongs to one host thread at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["Backend", "SchedulerBackend", "empty_like", "fortran_only"]

F32 = np.float32


@runtime_checkable
class SchedulerBackend(Protocol):
    """The part of a backend the scheduler, the merges and the algorithms call.

    Attributes
    ----------
    name : str
        ``"cpu"`` or ``"cuda"``.
    xp : module
        The array module (``numpy`` / ``cupy``).
    device_id : int or None
        CUDA ordinal; ``None`` on the host.
    threads : int or None
        Default CPU thread budget of :meth:`thread_budget`; ``None`` where the host thread only
        queues work (CUDA).
    tracks_rows : bool
        Capability flag: the row-sparse merge (module docstring).
    """

    name: str
    xp: Any
    device_id: int | None
    threads: int | None
    tracks_rows: bool

    # -- arrays and transfers ------------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """Host or device array -> array of this backend (dtype kept unless given)."""

    def to_host(self, a) -> np.ndarray:
        """-> ``numpy.ndarray`` (waits for this backend's stream)."""

    def to_float(self, x) -> float:
        """A scalar (Python number, 0-d host or device array) -> ``float``; on a device it waits
        for this backend's stream first, so a value a kernel is still writing is never read."""

    def empty(self, shape, dtype=F32):
        """Uninitialised array on this backend (on its stream on CUDA)."""

    def zeros(self, shape, dtype=F32):
        """Zero-filled array on this backend."""

    def copy_into(self, dst, src) -> None:
        """``dst[...] = src``: host -> device, device -> device, or across devices; queued on
        this (the destination's) backend, ordered after the source's pending writes."""

    # -- the worker's context ------------------------------------------------------------------
    def activate(self) -> AbstractContextManager:
        """Context manager: this backend's device and stream current in the calling thread.

        Entered once per worker thread for its lifetime (``thread_budget`` enters it); every
        method also enters it, which costs nothing when it is already current."""

    def thread_budget(self, n: int | None = None) -> AbstractContextManager:
        """Context manager for a worker thread's lifetime: limits CPU threads to ``n`` (or
        :attr:`threads`) and makes the backend current (:meth:`activate`)."""

    def kernel_threads(self, n: int) -> AbstractContextManager:
        """CPU backends: context manager limiting this thread's kernel threads (numba's, not
        BLAS's) to ``n``; cheap enough to enter at every merge."""

    def synchronize(self) -> None:
        """Wait for all work queued on this backend's stream."""

    def fence(self) -> None:
        """Order this backend's next work after the work queued so far on every other
        backend's stream (recorded events on CUDA; nothing to do on the host). The merges call
        it before they read other replicas' arrays with ``xp`` arithmetic; the backend's own
        copies and merge launchers do it themselves, and also order the other streams' next
        work after their reads."""

    # -- merges (arXiv 2110.07029 §III-B; :mod:`xmc_engine.scheduler.merge`) ---------------------
    def all_finite(self, a) -> bool:
        """No NaN or infinity in ``a`` (waits for the result)."""

    def weighted_sum(self, arrays: Sequence, weights: Sequence[float], out):
        """``out = sum_i weights[i] * arrays[i]``; returns ``out``."""

    def momentum(self, wbar, z1, z2, mu: float, out):
        """``out = wbar + mu * (z1 - z2)``; returns ``out``."""

    def elastic(self, x, center, alpha: float, diff_out):
        """``diff_out = alpha * (x - center)``; ``x -= diff_out``; returns ``diff_out``."""

    def merge_rows(self, arrays: Sequence, weights: Sequence[float], rows,
                   out, broadcast: bool = False, norm: bool = True) -> tuple[bool, float]:
        """``out[r] = sum_i weights[i] arrays[i][r]`` for ``r`` in ``rows`` (float32 2-D);
        returns ``(all finite, change of sum(out**2))`` (waits for the result). With
        ``broadcast`` each merged row whose values are all finite is also written back to every
        array of ``arrays`` (the merge's broadcast); a row with a non-finite value is not.
        With ``norm=False`` the caller does not need the change, and it may be ``0.0``."""

    def copy_rows(self, dst, src, rows) -> None:
        """``dst[r] = src[r]`` for ``r`` in ``rows`` (int64, host)."""

    def merge_columns(self, arrays: Sequence, weights, cols, out,
                      broadcast: bool = False) -> bool:
        """``out[:, c_j] = sum_i weights[i, j] arrays[i][:, c_j]`` for the columns ``c_j`` of
        ``cols`` (int64, host; ``weights`` (n_arrays, len(cols)), host; 2-D arrays, a 1-D one
        is one row); returns whether all merged values are finite (waits for the result). With
        ``broadcast`` the merged values are also written back to every array of ``arrays``,
        except where a non-finite value is among them (per row, or per block of a row's
        columns)."""

    def copy_columns(self, dst, src, cols) -> None:
        """``dst[:, c] = src[:, c]`` for ``c`` in ``cols`` (int64, host; 1-D arrays: entries)."""


@runtime_checkable
class Backend(SchedulerBackend, Protocol):
    """A whole backend: :class:`SchedulerBackend` plus the model's kernels and output layer.

    ``loss_sum`` below is a Python float on the CPU and a 0-d device array on CUDA (read it
    with :meth:`SchedulerBackend.to_float`).
    """

    sp: Any

    def csr_parts(self, X) -> tuple:
        """A SciPy CSR batch (or a :class:`xmc_engine.batches.CSRBatch`) -> ``(indptr, indices,
        data float32)`` arrays on this backend."""

    def upload(self, arrays: Sequence[np.ndarray]) -> list:
        """Host arrays -> arrays of this backend, in one transfer (a step's batch: CSR parts of
        ``X`` and the label pointers). On CUDA through a double-buffered pinned staging buffer,
        asynchronous on this stream; on the host the arrays themselves."""

    def workspace(self, name: str, shape, dtype=F32):
        """A reusable scratch array ``name`` of ``shape`` (reallocated only when it grows): the
        output layer's logits and chunk buffers, kept between steps."""

    # -- the sparse input layer (:mod:`xmc_engine.kernels.sparse_forward` / ``sparse_backward``)
    def sparse_forward(self, indptr, indices, data, W1, b1, out):
        """``out = relu(X @ W1 + b1)``; returns ``out``."""

    def sparse_backward_update(self, indptr, indices, data, dZ1, W1, b1, lr: float) -> None:
        """SGD on the touched ``W1`` rows and ``b1``, in place."""

    def sparse_grad(self, indptr, indices, data, dZ1) -> tuple:
        """``(rows int64 sorted unique, grad_rows, grad_b1)`` of the batch (no update)."""

    def sparse_rows_update(self, W1, rows, grad_rows, lr: float) -> None:
        """``W1[rows] -= lr * grad_rows``."""

    def relu_backward(self, dH, H):
        """``dH[H <= 0] = 0`` in place; returns ``dH``."""

    # -- dense arithmetic ----------------------------------------------------------------------
    def matmul(self, a, b, out) -> None:
        """``out[...] = a @ b`` (BLAS / cuBLAS)."""

    def gemm_acc(self, C, A, Bm, alpha: float = 1.0) -> None:
        """``C += alpha * A @ Bm`` (``C`` may be a strided view)."""

    def gemm_update(self, W, A, Bm, alpha: float) -> None:
        """``W += alpha * A.T @ Bm`` (``W`` may be a strided column view of ``W2``)."""

    def axpy(self, y, x, alpha: float) -> None:
        """``y += alpha * x`` in place (1-D or 2-D, ``y`` may be strided)."""

    # -- output layer (:mod:`xmc_engine.kernels.output_layer`, :mod:`xmc_engine.output_layer`) --
    def softmax_xent(self, Z, y_indptr, y_indices, scale: float):
        """``Z -> scale * (softmax(Z) - y/|y|)`` in place; returns the summed loss."""

    def softmax_bias(self, Z, b2, y_indptr, y_indices, scale: float, db2_out):
        """``softmax_xent`` of ``Z + b2`` with ``db2_out = dZ.sum(0)``; returns the loss sum."""

    def bce_bias(self, Z, b2, c0: int, y_indptr, y_indices, scale: float, db2_out,
                 alpha: float = 1.0, beta: float = 0.0, colw=None):
        """The one-vs-all logistic loss of ``Z + b2``, the logits of labels ``[c0, c0 + C)``:
        ``Z -> scale * w * (sigmoid(Z + b2) - Y)`` in place (``w``: ``colw``, or 1), ``db2_out =
        beta db2_out + alpha dZ.sum(0)`` (``b2`` read first); returns the loss sum over these
        labels (:mod:`xmc_engine.kernels.bce_output`)."""

    def row_stats(self, B: int) -> tuple:
        """Start values ``(m, s, ysum)``, (B,) float32 each, of the chunked path's pass 1."""

    def chunk_stats(self, Zc, b2c, c0: int, y_indptr, y_indices, m, s, ysum) -> None:
        """Pass 1 on the logits of labels ``[c0, c0 + C)``: fold them into ``m, s, ysum``."""

    def chunk_loss(self, m, s, ysum, y_indptr) -> tuple:
        """``(loss_sum, lse)`` from the pass-1 statistics."""

    def chunk_grad(self, Zc, b2c, c0: int, y_indptr, y_indices, lse, scale: float, db2c_out,
                   alpha: float = 1.0, beta: float = 0.0) -> None:
        """Pass 2: ``Zc`` -> dZ chunk in place; ``db2c_out = beta db2c_out + alpha dZc.sum(0)``
        (``alpha = -lr, beta = 1`` is the b2 chunk's SGD step; ``b2c`` is read first)."""

    def add_bias(self, Z, b) -> None:
        """``Z += b`` on every row."""

    def topk(self, scores, k: int) -> tuple:
        """``(idx int64 (B, k), val (B, k))``, descending; ties to the lower index."""

    def topk_into(self, scores, k: int, idx, val) -> None:
        """:meth:`topk` into given ``idx``/``val`` arrays."""

    def topk_merge(self, ia, va, ib, vb, io, vo) -> None:
        """Merge two descending top-k lists per row into ``(io, vo)``."""

    def output_layer_step(self, H, W2, b2, y_indptr, y_indices, lr: float, dH_out, *,
                          label_chunk: int | None = None, loss: str = "softmax"):
        """:func:`xmc_engine.output_layer.output_layer_step` on this backend."""

    def output_layer_grad(self, H, W2, b2, y_indptr, y_indices, *, dH_out=None, dW2_out=None,
                          db2_out=None, label_chunk: int | None = None,
                          loss: str = "softmax") -> tuple:
        """:func:`xmc_engine.output_layer.output_layer_grad` on this backend."""

    def predict_scores_topk(self, H, W2, b2, k: int, *, label_chunk: int | None = None) -> tuple:
        """:func:`xmc_engine.output_layer.predict_scores_topk` on this backend."""

    # -- sampled output layer (:mod:`xmc_engine.kernels.sampled_output`) ------------------------
    def gather_columns(self, W2, b2, cols, W2s, b2s) -> None:
        """``W2s[...] = W2[:, cols]``; ``b2s[...] = b2[cols]`` (``cols`` int64, unique)."""

    def scatter_add_columns(self, W2, b2, cols, dW2s, db2s, alpha: float) -> None:
        """``W2[:, cols] += alpha dW2s``; ``b2[cols] += alpha db2s``."""

    def adagrad_columns(self, W2, b2, acc_W2, acc_b2, cols, dW2s, db2s, lr: float,
                        eps: float) -> None:
        """:meth:`adagrad_dense` on the columns ``cols`` of ``W2`` and entries of ``b2`` only."""

    def sampled_output_grad(self, H, W2, b2, cols, n_pos: int, log_weight: float, y_indptr,
                            local_y, *, loss: str = "softmax") -> tuple:
        """:func:`xmc_engine.output_layer.sampled_output_grad` on this backend."""

    # -- optimiser -----------------------------------------------------------------------------
    def adagrad_dense(self, w, g, acc, lr: float, eps: float) -> None:
        """``acc += g^2; w -= lr g / (sqrt(acc) + eps)``."""

    def adagrad_rows(self, W, rows, grad_rows, acc_W, lr: float, eps: float) -> None:
        """The same on ``W[rows]`` only."""


def fortran_only(a) -> bool:
    """Whether ``a`` is 2-D and contiguous in Fortran order only (a column's entries adjacent):
    the label-major ``W2`` of a sampled CPU replica, :func:`xmc_engine.model.label_major_w2`."""
    return a.ndim == 2 and a.flags.f_contiguous and not a.flags.c_contiguous


def empty_like(backend, a, *, zero: bool = False):
    """An array on ``backend`` with ``a``'s shape, dtype and memory order (C, or Fortran for the
    label-major ``W2`` of a sampled CPU replica, :func:`xmc_engine.model.label_major_w2`), so
    that the flat merge kernels pair its entries with ``a``'s; uninitialised, or zeros with
    ``zero``. Every merge buffer shaped like a replica's parameters is made here."""
    make = backend.zeros if zero else backend.empty
    if fortran_only(a):
        return make(a.shape[::-1], a.dtype).T
    return make(a.shape, a.dtype)
