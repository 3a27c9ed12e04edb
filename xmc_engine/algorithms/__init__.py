"""Training algorithms as policy objects over the shared scheduler, and their registry.

``get_algorithm(name, **config)`` builds one: ``"adaptive"`` (Adaptive SGD, arXiv 2110.07029 §III)
or ``"average"`` (static-partition model averaging, the paper's "GD" baseline), and the baselines
of DESIGN.md §4 over the same devices and kernels: ``"sync"`` (synchronous data-parallel SGD,
per-step gradient all-reduce), ``"easgd"`` (Elastic Averaging SGD, Zhang et al. 2015) and
``"crossbow"`` (CROSSBOW synchronous model averaging, Koliousis et al. 2019).
"""

from __future__ import annotations

from xmc_engine.algorithms.adaptive import AdaptiveConfig, AdaptiveSGD
from xmc_engine.algorithms.average import AverageConfig, ModelAveraging
from xmc_engine.algorithms.base import ConfigMixin, Policy
from xmc_engine.algorithms.crossbow import Crossbow, CrossbowConfig
from xmc_engine.algorithms.easgd import EASGD, EASGDConfig
from xmc_engine.algorithms.sync import SyncConfig, SyncSGD
from xmc_engine.errors import ConfigError

__all__ = [
    "ALGORITHMS",
    "AdaptiveConfig",
    "AdaptiveSGD",
    "AverageConfig",
    "ConfigMixin",
    "Crossbow",
    "CrossbowConfig",
    "EASGD",
    "EASGDConfig",
    "ModelAveraging",
    "Policy",
    "SyncConfig",
    "SyncSGD",
    "get_algorithm",
]

#: name -> (policy class, config dataclass)
ALGORITHMS: dict[str, tuple[type[Policy], type]] = {
    "adaptive": (AdaptiveSGD, AdaptiveConfig),
    "average": (ModelAveraging, AverageConfig),
    "sync": (SyncSGD, SyncConfig),
    "easgd": (EASGD, EASGDConfig),
    "crossbow": (Crossbow, CrossbowConfig),
}


def get_algorithm(name: str, config=None, **options) -> Policy:
    """A fresh policy object for algorithm ``name``.

    Parameters
    ----------
    name : {'adaptive', 'average', 'sync', 'easgd', 'crossbow'}
    config : dataclass or dict, optional
        The algorithm's config (``AdaptiveConfig``, ``AverageConfig``, ``SyncConfig``,
        ``EASGDConfig``, ``CrossbowConfig``) or a dict of its fields.
    **options
        Config fields overriding ``config`` (unknown names raise ``ConfigError``).
    """
    try:
        cls, cfg_cls = ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}; expected one of {sorted(ALGORITHMS)}") \
            from None
    if isinstance(config, dict):
        config = cfg_cls.from_dict({**config, **options}, source=f"{name} options")
        options = {}
    elif config is not None and not isinstance(config, cfg_cls):
        raise ConfigError(f"algorithm {name!r} takes a {cfg_cls.__name__}, "
                          f"got {type(config).__name__}")
    return cls(config, **options)
