"""Data layer (installed as ``xmc_engine.datasets``)."""

from .io import load_libsvm, load_split, load_xc, save_xc

__all__ = ["load_libsvm", "load_split", "load_xc", "save_xc"]
