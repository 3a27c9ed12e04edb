"""Glue between the training driver and the multi-device scheduler (DESIGN.md §3-4).

Builds one :class:`~xmc_engine.model.MLPReplica` per device of the spec, wraps them in a
:class:`~xmc_engine.scheduler.ParallelTrainer` with the chosen algorithm, and exposes the small
runner interface the driver in :mod:`xmc_engine.training` uses (merge periods up to the driver's
next stop; the central model is what is evaluated, checkpointed and returned; evaluations fall on
merge barriers, checkpoints on epoch ends).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from xmc_engine.backends import get_backend
from xmc_engine.config import TrainConfig
from xmc_engine.model import MLPReplica

_STATE_KEY = "scheduler_state"
#: ``algorithm_params`` keys that configure the trainer (elastic device set, fault injection;
#: see :class:`~xmc_engine.scheduler.ParallelTrainer`), not the algorithm.
TRAINER_KEYS = ("rejoin_after", "fault")


def algorithm_options(cfg: TrainConfig) -> dict:
    """The algorithm's options: ``cfg.algorithm_params`` plus the shared fields (``batch_size``,
    ``lr_decay``, and ``lr_warmup_epochs`` as ``warmup_epochs`` unless it is ``None``) where the
    algorithm has them and the params do not set them."""
    from xmc_engine.algorithms import ALGORITHMS

    _, cfg_cls = ALGORITHMS[cfg.algorithm]
    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    opts = {k: v for k, v in cfg.algorithm_params.items() if k not in TRAINER_KEYS}
    shared = [("batch_size", cfg.batch_size), ("lr_decay", cfg.lr_decay)]
    if cfg.lr_warmup_epochs is not None:
        shared.append(("warmup_epochs", cfg.lr_warmup_epochs))
    for name, value in shared:
        if name in fields:
            opts.setdefault(name, value)
    return opts


class ParallelRunner:
    """Runs ``cfg.algorithm`` over the devices of ``devices`` (a list of DeviceSpec)."""

    def __init__(self, cfg: TrainConfig, devices, X, Y, params, state, log, *, comm=None,
                 assignment: str = "shared"):
        from xmc_engine.algorithms import get_algorithm
        from xmc_engine.scheduler import ParallelTrainer

        self.cfg = cfg
        policy = get_algorithm(cfg.algorithm, algorithm_options(cfg))
        replicas = []
        for d in devices:
            be = get_backend(d.kind, d.index, threads=d.threads)
            replicas.append(MLPReplica(be, X, Y, params, label_chunk=cfg.label_chunk,
                                   optimizer=cfg.optimizer))
            replicas[-1].calibrate_threads(cfg.batch_size, d.threads)
        self.replicas = replicas
        extra = {k: cfg.algorithm_params[k] for k in TRAINER_KEYS if k in cfg.algorithm_params}
        self.trainer = ParallelTrainer(replicas, devices, policy, X.shape[0], seed=cfg.seed,
                                       log=log, rejoin_after=extra.get("rejoin_after"),
                                       faults=extra.get("fault"))
        # One node of a multi-node run (DESIGN.md §6): cross-node merges, aligned periods.
        from xmc_engine.distributed import attach

        self.n_global = attach(self.trainer, comm, assignment=assignment)
        self._multi = comm is not None and comm.size > 1
        saved = state.get("extra", {}).get(_STATE_KEY)
        if saved is not None:  # resuming: batch sizes, trend flag, period counter
            self.trainer.load_state_dict(json.loads(bytes(np.asarray(saved, np.uint8))))
        self._done = False
        self._epoch_samples = 0  # samples of the current epoch done by earlier calls

    def run_until(self, epoch: int, stop_samples: int, state: dict) -> None:
        """Merge periods of epoch ``epoch`` until it ends or, on one node, until the first merge
        barrier at or after ``state['samples'] == stop_samples`` (an evaluation between
        periods). Several nodes always run whole epochs (their periods are aligned)."""
        stop_after = None
        if not self._multi:
            stop_after = self._epoch_samples + max(stop_samples - state["samples"], 1)
        res = self.trainer.run_epoch(epoch, self.cfg.lr, stop_after=stop_after)
        state["train_time"] += res["train_seconds"]
        n = self.n_global if self._multi else res["samples"]  # every node did an epoch
        state["samples"] += n
        state["loss_sum"] = state.get("loss_sum", 0.0) + res["loss"] * n
        self._epoch_samples += res["samples"]
        self._done = res["done"]

    def epoch_done(self) -> bool:
        return self._done

    def can_checkpoint(self) -> bool:
        """Checkpoints hold whole epochs only: the shuffled queue of an open epoch is not saved
        (a resume starts the epoch over)."""
        return self._epoch_samples == 0

    def end_epoch(self) -> None:
        self._done = False
        self._epoch_samples = 0

    def eval_params(self):
        return self.replicas[0].backend, self.trainer.central_params()

    def host_params(self) -> list[np.ndarray]:
        be = self.replicas[0].backend
        return [np.array(be.to_host(p), dtype=np.float32) for p in self.trainer.central_params()]

    def checkpoint_extra(self) -> dict:
        """The scheduler's JSON state, as a uint8 array beside the parameters."""
        text = json.dumps(self.trainer.state_dict()).encode()
        return {_STATE_KEY: np.frombuffer(text, dtype=np.uint8).copy()}

    def close(self) -> None:
        self.trainer.close()
