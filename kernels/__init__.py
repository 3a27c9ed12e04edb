"""Kernels of the sparse MLP, one module per operation (installed as ``xmc_engine.kernels``).

See ``kernels/README.md`` for how to study one: where it is, its reference, its test, its benchmark.
"""
