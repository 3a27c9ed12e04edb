"""Host-side scheduling: device workers, the dynamic batch queue, the merge barrier and merging.

See :class:`ParallelTrainer` (arXiv 2110.07029 §III, DESIGN.md §3-4).
"""

from __future__ import annotations

from xmc_engine.scheduler.controller import BatchSizeController, learning_rate
from xmc_engine.scheduler.queue import BatchQueue, epoch_permutation
from xmc_engine.scheduler.replica import FakeReplica, HostBackend, Replica
from xmc_engine.scheduler.runner import ParallelTrainer

__all__ = [
    "BatchQueue",
    "BatchSizeController",
    "FakeReplica",
    "HostBackend",
    "ParallelTrainer",
    "Replica",
    "epoch_permutation",
    "learning_rate",
]
