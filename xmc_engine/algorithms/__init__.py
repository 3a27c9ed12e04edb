"""Training algorithms as policy objects over the one training loop, and their registry.

``get_algorithm(name, config, **options)`` builds one: ``"single"`` (one device), ``"adaptive"``
(Adaptive SGD, arXiv 2110.07029 §III), ``"average"`` (static-partition model averaging, the
paper's "GD" baseline), and the baselines of DESIGN.md §4 over the same devices and kernels:
``"sync"`` (synchronous data-parallel SGD, per-step gradient all-reduce), ``"easgd"`` (Elastic
Averaging SGD, Zhang et al. 2015) and ``"crossbow"`` (CROSSBOW synchronous model averaging,
Koliousis et al. 2019). Their options are the dataclasses of :data:`xmc_engine.config.ALGORITHMS`.
"""

from __future__ import annotations

from xmc_engine.algorithms.adaptive import AdaptiveSGD
from xmc_engine.algorithms.average import ModelAveraging
from xmc_engine.algorithms.base import Policy
from xmc_engine.algorithms.crossbow import Crossbow
from xmc_engine.algorithms.easgd import EASGD
from xmc_engine.algorithms.single import Single
from xmc_engine.algorithms.sync import SyncSGD
from xmc_engine.errors import ConfigError

__all__ = [
    "EASGD",
    "POLICIES",
    "AdaptiveSGD",
    "Crossbow",
    "ModelAveraging",
    "Policy",
    "Single",
    "SyncSGD",
    "get_algorithm",
]

#: Algorithm name -> policy class (the same names as :data:`xmc_engine.config.ALGORITHMS`).
POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Single, AdaptiveSGD, ModelAveraging, SyncSGD, EASGD, Crossbow)
}


def get_algorithm(name: str, config=None, **options) -> Policy:
    """A fresh policy object for algorithm ``name``.

    Parameters
    ----------
    name : str
        A key of :data:`xmc_engine.config.ALGORITHMS`.
    config : AlgorithmConfig or dict, optional
        The algorithm's options (its dataclass, or a dict of its fields).
    **options
        Option fields overriding ``config`` (unknown names raise ``ConfigError``).
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}; expected one of "
                          f"{', '.join(POLICIES)}") from None
    return cls(config, **options)
