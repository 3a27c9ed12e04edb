"""Kernels of the sparse MLP, one module per operation (installed as ``xmc_engine.kernels``).

See ``kernels/README.md`` for how to study one: where it is, its reference, its test, its benchmark.
"""

from xmc_engine.kernels import _cache

# before any kernel module defines its @njit(cache=True) functions: a cached kernel is
# recompiled when any module of the package changed, not only its own (kernels/_cache.py)
_cache.install()
