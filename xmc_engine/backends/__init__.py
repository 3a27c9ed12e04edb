"""Device backends: one small object per kind of device, mirrored siblings (STYLE.md).

Model, scheduler and algorithms are written once against this interface. A backend has

``name``            ``"cpu"`` or ``"cuda"``
``xp``              the array module (``numpy`` / ``cupy``)
``sp``              the sparse module (``scipy.sparse`` / ``cupyx.scipy.sparse``)
``device_id``       ``None`` for the CPU, the CUDA ordinal otherwise
``asarray(a)``      host or device array -> array of this backend (float32 kept)
``to_host(a)``      -> ``numpy.ndarray``
``csr_parts(X)``    a SciPy CSR batch (or a ``batches.CSRBatch``) -> ``(indptr, indices, data)``
                    arrays on this backend
``synchronize()``   wait for all work queued by this backend's stream
``thread_budget``   context manager that limits numba/BLAS threads in the calling thread

and one launcher per kernel of :mod:`xmc_engine.kernels` (see each module's docstring). Arrays
are float32 (parameters, activations) and int32/int64 (CSR indices) on the backend's device;
launchers queue work on the backend's stream and return without waiting unless noted:

``sparse_forward(indptr, indices, data, W1, b1, out) -> out``      out = relu(X @ W1 + b1)
``sparse_backward_update(indptr, indices, data, dZ1, W1, b1, lr)``  in place on touched W1 rows
``sparse_grad(indptr, indices, data, dZ1) -> (rows, grad_rows, grad_b1)``
                    rows int64 sorted unique (CUDA: ``cupy.unique`` synchronises)
``sparse_rows_update(W1, rows, grad_rows, lr)``                      W1[rows] -= lr * grad_rows
``relu_backward(dH, H) -> dH``                                       dH[H <= 0] = 0 in place
``softmax_xent(Z, y_indptr, y_indices, scale) -> loss_sum``
                    Z -> scale * (softmax(Z) - y/|y|) in place; summed unscaled loss
``output_layer_step(H, W2, b2, y_indptr, y_indices, lr, dH_out, *, label_chunk=None)
  -> loss_sum``     one SGD step of the output layer (mean loss over the B rows), dH_out with
                    the old W2; ``label_chunk=C`` never holds the (B, n_labels) logits
``output_layer_grad(H, W2, b2, y_indptr, y_indices, *, dH_out=None, dW2_out=None,
  db2_out=None, label_chunk=None) -> (loss_sum, dW2, db2, dH)``   same, without updating
``predict_scores_topk(H, W2, b2, k, *, label_chunk=None) -> (idx int64 (B, k), val (B, k))``
``topk(scores, k) -> (idx, val)``                                    descending, ties: lower index
``weighted_sum(arrays, weights, out) -> out``                        sum_i weights[i] * arrays[i]
``momentum(wbar, z1, z2, mu, out) -> out``                           wbar + mu * (z1 - z2)
``elastic(x, center, alpha, diff_out) -> diff_out``                  diff = alpha (x - c); x -= diff
``adagrad_dense(w, g, acc, lr, eps)``                 acc += g^2; w -= lr g / (sqrt(acc) + eps)
``adagrad_rows(W, rows, grad_rows, acc_W, lr, eps)``  the same on ``W[rows]`` only

``loss_sum`` is a Python float on the CPU and a 0-d device array on CUDA (``float()`` waits).

Extra helpers: ``empty(shape, dtype=float32)``, ``zeros(shape, dtype=float32)``,
``copy_into(dst, src)`` (host -> device, device -> device, or a peer copy between GPUs, queued
on the destination backend's stream). CUDA backends also expose ``stream`` (the
``cupy.cuda.Stream(non_blocking=True)``) and ``nb_stream`` (the same stream for numba).

A backend object (its reusable workspaces) belongs to one host thread at a time: give each
device worker its own (``get_backend`` returns a new object per call). CPU workers should run
inside ``with backend.thread_budget(n):`` (numba's limit is per thread; BLAS's is process-wide).

``import xmc_engine`` never imports CuPy; :func:`get_backend` imports ``backends.cuda`` lazily.
"""

from __future__ import annotations

from xmc_engine.errors import BackendUnavailableError

_GPU_HINT = ("install the 'gpu' extra (pip install 'xmc-engine[gpu]') or use backend='cpu'")


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one usable CUDA device."""
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:  # noqa: BLE001 - any import or driver failure means "no GPU"
        return False


def cuda_device_count() -> int:
    if not cuda_available():
        return 0
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


def get_backend(name: str = "cpu", device_id: int | None = None, threads: int | None = None):
    """Return a backend object for ``name`` (``"cpu"`` or ``"cuda"``).

    Raises
    ------
    BackendUnavailableError
        ``name == "cuda"`` on a machine where ``cupy.is_available()`` is False.
    """
    if name == "cpu":
        from xmc_engine.backends.cpu import CPUBackend

        return CPUBackend(threads=threads)
    if name == "cuda":
        if not cuda_available():
            raise BackendUnavailableError(
                "backend='cuda' requested but no usable CUDA device (cupy.is_available() is "
                f"False); {_GPU_HINT}"
            )
        from xmc_engine.backends.cuda import CUDABackend

        return CUDABackend(device_id=0 if device_id is None else device_id)
    raise BackendUnavailableError(f"unknown backend {name!r}; expected 'cpu' or 'cuda'")
