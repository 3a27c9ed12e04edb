"""Building a :class:`~xmc_engine.scheduler.Trainer` in tests from one keyword list."""

from __future__ import annotations

from xmc_engine.algorithms import get_algorithm
from xmc_engine.scheduler import Schedule, Trainer

#: Trainer keywords (everything else given to :func:`make_trainer` is an algorithm option).
TRAINER_KEYS = ("seed", "log", "mode", "cost", "timeout", "trace", "elastic", "rejoin_after",
                "faults", "comm", "assignment")


def make_trainer(replicas, devices, algorithm, n_samples, *, lr=0.1, batch_size=128,
                 warmup_epochs=1.0, lr_decay=0.1, **kw) -> Trainer:
    """``Trainer(replicas, devices, get_algorithm(algorithm, **options), n_samples, ...)`` with
    the schedule ``lr / warmup_epochs / lr_decay`` and base batch ``batch_size``; keywords in
    :data:`TRAINER_KEYS` go to the trainer, the rest are the algorithm's options."""
    trainer_kw = {k: kw.pop(k) for k in TRAINER_KEYS if k in kw}
    policy = algorithm if not isinstance(algorithm, str) else get_algorithm(algorithm, **kw)
    return Trainer(replicas, devices, policy, n_samples, batch_size=batch_size,
                   schedule=Schedule(lr, warmup_epochs, lr_decay), **trainer_kw)


class ListLog:
    """A run log that keeps its records in memory: ``records`` = ``[(event, fields), ...]``."""

    def __init__(self):
        self.records = []

    def write(self, event, **fields):
        self.records.append((event, fields))
