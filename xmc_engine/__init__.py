"""xmc-engine: Adaptive SGD for extreme multi-label classification on heterogeneous devices.

``import xmc_engine`` is cheap: it imports neither CuPy nor the kernels; the estimator is loaded
on first use.
"""

from __future__ import annotations

from xmc_engine import _env

_env.apply_blas_defaults()  # before NumPy loads OpenBLAS, or reset the copies it loaded

__version__ = "0.1.0"

__all__ = ["XMCClassifier", "__version__"]


def __getattr__(name):
    if name == "XMCClassifier":
        from xmc_engine.estimator import XMCClassifier

        return XMCClassifier
    raise AttributeError(f"module 'xmc_engine' has no attribute {name!r}")
