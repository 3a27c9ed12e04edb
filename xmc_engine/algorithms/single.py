"""One device: plain SGD/Adagrad steps over the shuffled epoch, no merging.

The baseline "single" of DESIGN.md §4, run by the same loop as every other algorithm
(:class:`xmc_engine.scheduler.Trainer`), so the shuffle, the learning-rate schedule and the
accounting are the ones the multi-device algorithms use. Its period (``merge_period`` of
:class:`~xmc_engine.config.SingleConfig`) spaces the trainer's barriers: a log record, and the
points where evaluations and checkpoints happen (the first barrier at or after each mark, as on
several devices). The model is the replica's own parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from xmc_engine.algorithms.base import Policy
from xmc_engine.errors import DivergenceError

__all__ = ["Single"]


class Single(Policy):
    """One device, no merge (module docstring)."""

    name = "single"
    max_devices = 1

    def setup(self, replicas: Sequence, *, n_samples: int, batch_size: int, merge_period: int,
              warmup_epochs: float) -> None:
        # No central copy: the replica's live parameters are the model.
        self._replica = replicas[0]
        self.n_devices, self.n_samples, self.batch_size = 1, int(n_samples), int(batch_size)
        self.merge_period, self.warmup_epochs = int(merge_period), float(warmup_epochs)
        self.backend = replicas[0].backend

    def merge(self, replicas: Sequence, updates: Sequence[int], ctx) -> dict[str, Any]:
        """Nothing to merge; a non-finite loss ends the run (there is no replica to fall back
        on)."""
        if ctx.nonfinite:
            raise DivergenceError(f"the loss became non-finite in epoch {ctx.epoch} period "
                                  f"{ctx.period} (lr {ctx.lrs[0]:g}); lower the learning rate")
        return {"weights": [1.0], "nonfinite": []}

    def central_params(self) -> list:
        return self._replica.params()

    def load_model(self, replicas: Sequence, params: Sequence) -> None:
        self._replica.set_params(params)
