"""Model averaging ("GD" in arXiv 2110.07029 §V): static equal partition, uniform averaging.

Every merge period of ``S`` samples is split into equal quotas ``S / n``; every device uses the
same batch size ``B`` and learning rate; the merge is the uniform average of the replicas,
broadcast to all (DESIGN.md §4, baselines); like ``adaptive``'s, it reads and writes only the
``W1`` rows changed in the period where it can (``sparse_merge``). The slowest device sets the
pace.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xmc_engine.algorithms.base import ConfigMixin, Policy
from xmc_engine.distributed import combine_nodes
from xmc_engine.scheduler.controller import learning_rate
from xmc_engine.scheduler.merge import weighted_merge

logger = logging.getLogger(__name__)

__all__ = ["AverageConfig", "ModelAveraging"]


@dataclass
class AverageConfig(ConfigMixin):
    """Options of model averaging (same meanings and defaults as
    :class:`~xmc_engine.algorithms.adaptive.AdaptiveConfig`, so only the algorithm differs)."""

    merge_period: int = 4096
    batch_size: int = 128
    warmup_epochs: float = 1.0
    lr_decay: float = 0.1
    sparse_merge: bool = True

    def __post_init__(self):
        self._check_min(1, "merge_period", "batch_size")
        self._check_min(0, "warmup_epochs", "lr_decay")


class ModelAveraging(Policy):
    """Static-partition model averaging (the paper's "GD" baseline)."""

    name = "average"
    static = True

    def __init__(self, config: AverageConfig | None = None, **overrides):
        self.config = self._make_config(AverageConfig, config, overrides)
        self.merge_period = self.config.merge_period

    def setup(self, replicas: Sequence, n_samples: int) -> None:
        super().setup(replicas, n_samples)
        self._spare = [self.backend.xp.empty_like(a) for a in self.central]

    def batch_sizes(self) -> list[int]:
        return [self.config.batch_size] * self.n_devices

    def learning_rates(self, lr0: float, progress: float) -> tuple[float, list[float]]:
        c = self.config
        lr = learning_rate(lr0, progress, warmup_epochs=c.warmup_epochs, decay=c.lr_decay)
        return lr, [lr] * self.n_devices

    def merge(self, replicas: Sequence, updates: Sequence[int]) -> dict[str, Any]:
        if self.config.sparse_merge:
            p = np.full(len(replicas), 1.0 / len(replicas))
            if self._merge_changed_rows(replicas, p) is not None:
                return {"weights": [float(x) for x in p], "nonfinite": []}
        params = [r.params() for r in replicas]
        counts, bad = self._finite_updates(params, np.ones(len(replicas)))
        p = counts / counts.sum()
        weighted_merge(params, p, self._spare, self.backend, check=False)
        # Across nodes (DESIGN.md §6): weighted by replicas merged, a uniform mean over devices.
        nodes = combine_nodes(self, self._spare, float(counts.sum()))
        self.central, self._spare = self._spare, self.central
        self._broadcast(replicas, self.central)
        return {"weights": [float(x) for x in p], "nonfinite": bad, **nodes}
