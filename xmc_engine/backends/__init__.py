"""Device backends: one small object per kind of device, mirrored siblings (STYLE.md).

Model, scheduler and algorithms are written once against this interface. A backend has

``name``            ``"cpu"`` or ``"cuda"``
``xp``              the array module (``numpy`` / ``cupy``)
``sp``              the sparse module (``scipy.sparse`` / ``cupyx.scipy.sparse``)
``device_id``       ``None`` for the CPU, the CUDA ordinal otherwise
``asarray(a)``      host or device array -> array of this backend (float32 kept)
``to_host(a)``      -> ``numpy.ndarray``
``csr_parts(X)``    a SciPy CSR batch -> ``(indptr, indices, data)`` arrays on this backend
``synchronize()``   wait for all work queued by this backend's stream
``thread_budget``   context manager that limits numba/BLAS threads in the calling thread

and one launcher per kernel of :mod:`xmc_engine.kernels` (see each module's docstring):

``sparse_forward(indptr, indices, data, W1, b1, out)``
``sparse_backward_update(indptr, indices, data, dZ1, W1, b1, lr)``
``sparse_grad(indptr, indices, data, dZ1) -> (rows, grad_rows, grad_b1)``
``relu_backward(dH, H)``
``softmax_xent(Z, y_indptr, y_indices, scale) -> loss_sum``
``topk(scores, k) -> (idx, val)``
``weighted_sum(arrays, weights, out)``, ``momentum(wbar, z1, z2, mu, out)``,
``elastic(x, center, alpha, diff_out)``

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
