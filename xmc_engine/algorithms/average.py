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
from typing import Any

import numpy as np

from xmc_engine.algorithms.base import Policy
from xmc_engine.distributed import combine_nodes
from xmc_engine.scheduler.merge import weighted_merge

logger = logging.getLogger(__name__)

__all__ = ["ModelAveraging"]


class ModelAveraging(Policy):
    """Static-partition model averaging, the paper's "GD" baseline (options:
    :class:`~xmc_engine.config.AverageConfig`)."""

    name = "average"
    static = True
    supports_nodes = True

    def setup(self, replicas: Sequence, **kw) -> None:
        super().setup(replicas, **kw)
        self._spare = self.empty_params(self.central)

    def merge(self, replicas: Sequence, updates: Sequence[int], ctx) -> dict[str, Any]:
        if self.config.sparse_merge:
            p = np.full(len(replicas), 1.0 / len(replicas))
            if self.merge_rows_only(replicas, p, ctx) is not None:
                return {"weights": [float(x) for x in p], "nonfinite": []}
        params = [r.params() for r in replicas]
        counts, bad = self.finite_updates(params, np.ones(len(replicas)), ctx)
        p = counts / counts.sum()
        weighted_merge(params, p, self._spare, self.backend, check=False)
        # Across nodes (DESIGN.md §6): weighted by replicas merged, a uniform mean over devices.
        nodes = combine_nodes(ctx.comm, self._spare, float(counts.sum()), self.backend)
        self.central, self._spare = self._spare, self.central
        self.broadcast(replicas, self.central)
        return {"weights": [float(x) for x in p], "nonfinite": bad, **nodes}
