"""Data layer (installed as ``xmc_engine.datasets``): readers, writers, cache, registry, fetch,
synthetic generator.

Every loader returns canonical ``scipy.sparse.csr_matrix`` on the host: ``X`` float32 of shape
``(n_samples, n_features)`` and ``Y`` float32 ones of shape ``(n_samples, n_labels)``.
"""

from xmc_engine.errors import DatasetFormatError

from .fetch import FetchError, fetch
from .io import load_libsvm, load_npz, load_split, load_xc, save_npz, save_xc
from .registry import (
    DatasetInfo,
    get_dataset_info,
    list_datasets,
    load_dataset,
    load_file,
    resolve,
)
from .shard import load_xc_rows, load_xc_shard, shard_range
from .stats import describe
from .synthetic import PRESETS, make_synthetic

__all__ = [
    "DatasetFormatError",
    "DatasetInfo",
    "FetchError",
    "PRESETS",
    "describe",
    "fetch",
    "get_dataset_info",
    "list_datasets",
    "load_dataset",
    "load_file",
    "load_libsvm",
    "load_npz",
    "load_split",
    "load_xc",
    "load_xc_rows",
    "load_xc_shard",
    "make_synthetic",
    "resolve",
    "save_npz",
    "save_xc",
    "shard_range",
]
