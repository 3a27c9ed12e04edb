"""Device backends: one small object per kind of device, mirrored siblings (STYLE.md).

Model, output layer, scheduler and algorithms are written once against the interface declared in
:mod:`xmc_engine.backends.base` (:class:`Backend`, and its part :class:`SchedulerBackend`, with
capability flags such as ``tracks_rows``). :mod:`~xmc_engine.backends.cpu` (NumPy/SciPy and the
``@njit`` kernels) and :mod:`~xmc_engine.backends.cuda` (CuPy, numba.cuda and cuBLAS on one
non-blocking stream) implement all of it.

A backend object (its reusable workspaces) belongs to one host thread at a time: give each
device worker its own (``get_backend`` returns a new object per call), and run the worker inside
``with backend.thread_budget(n):`` (CPU: numba's limit is per thread, BLAS's process-wide; CUDA:
the worker's device and stream become current for its lifetime).

``import xmc_engine`` never imports CuPy; :func:`get_backend` imports ``backends.cuda`` lazily.
"""

from __future__ import annotations

from xmc_engine.backends.base import Backend, SchedulerBackend
from xmc_engine.errors import BackendUnavailableError

__all__ = ["Backend", "SchedulerBackend", "cuda_available", "cuda_device_count", "get_backend"]

_GPU_HINT = ("install the 'gpu' extra (pip install 'xmc-engine[gpu]') or use backend='cpu'")


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one usable CUDA device."""
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:  # noqa: BLE001 - any import or driver failure means "no GPU"
        return False


def cuda_device_count() -> int:
    """Number of CUDA devices CuPy sees (0 without a usable GPU)."""
    if not cuda_available():
        return 0
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


def get_backend(name: str = "cpu", device_id: int | None = None,
                threads: int | None = None) -> Backend:
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
