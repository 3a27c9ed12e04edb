"""Host-side scheduling: the one training loop (device workers, merge barrier), the dynamic
batch queue, the learning-rate schedule and batch-size control, and the merge functions.

See :class:`Trainer` (arXiv 2110.07029 §III, DESIGN.md §3-4).
"""

from __future__ import annotations

from xmc_engine.scheduler.controller import BatchSizeController, Schedule, learning_rate
from xmc_engine.scheduler.queue import BatchQueue, FixedAssignmentQueue, epoch_permutation
from xmc_engine.scheduler.replica import FakeReplica, HostBackend, Replica
from xmc_engine.scheduler.runner import MergeContext, Trainer

__all__ = [
    "BatchQueue",
    "BatchSizeController",
    "FakeReplica",
    "FixedAssignmentQueue",
    "HostBackend",
    "MergeContext",
    "Replica",
    "Schedule",
    "Trainer",
    "epoch_permutation",
    "learning_rate",
]
