"""Synchronous data-parallel SGD: the ``sync`` baseline (DESIGN.md §4).

The scheme of TensorFlow's MirroredStrategy, Horovod and PyTorch DDP (e.g. Goyal et al. 2017,
"Accurate, Large Minibatch SGD", arXiv 1706.02677; Sergeev & Del Balso 2018, arXiv 1802.05799).
Every step ``t`` the global batch ``G_t`` is split over the ``n`` devices (``b_i`` rows each),
each device computes the gradient of its mean loss at the common model ``w_t``, and::

    ḡ_t = Σ_i (b_i / Σ_j b_j) ∇ℓ_i(w_t)          (gradient all-reduce, on the host)
    w_{t+1} = w_t − lr(t) ḡ_t                     (the same update on every replica)

so the run equals one device stepping on the global batch. The ``W1`` gradient is row-sparse
(union of the rows the devices touched); ``W2`` and the biases are dense. The slowest device sets
the pace (every step waits for the last gradient).

In the one training loop (:class:`xmc_engine.scheduler.Trainer`) a period is one global step:
each device takes one batch and its :meth:`SyncSGD.step` computes the gradient without updating;
the merge reduces the gradients on the host and every device applies the same update in its
own worker.

Global batch
------------
By default ``batch_size`` is the *per-device* batch ``B`` and the global batch is ``n B`` (the
DDP / Horovod convention: more devices, larger global batch, fewer updates per epoch).
``split_global_batch = True`` makes ``batch_size`` the global batch, split equally (``B / n`` rows
per device; ``B`` must be a multiple of ``n``, since the queue's static quotas are equal): the
same updates per epoch as one device with batch ``B``. ``lr_scaling = True`` applies the linear
scaling rule (Goyal et al. 2017 §2.1): ``lr × (global batch / batch_size)``, i.e. ``× n`` in the
default mode. Warm-up and decay are the run's schedule, as for every algorithm. Options:
:class:`~xmc_engine.config.SyncConfig`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from xmc_engine.algorithms.base import Policy
from xmc_engine.errors import ConfigError, DivergenceError

logger = logging.getLogger(__name__)

__all__ = ["SyncSGD", "allreduce_grads"]


def _weighted_sum(arrays: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``Σ_k w_k a_k`` of host arrays (same shape and dtype) in one output, no temporaries."""
    out = np.empty_like(arrays[0])
    if len(arrays) == 1 or out.dtype != np.float32:  # the kernel computes in float32
        np.multiply(arrays[0], out.dtype.type(weights[0]), out=out)
        for a, w in zip(arrays[1:], weights[1:], strict=True):
            out += out.dtype.type(w) * a
        return out
    from xmc_engine.kernels.merge import weighted_sum_cpu

    weighted_sum_cpu([np.ascontiguousarray(a) for a in arrays], list(weights), out)
    return out


def allreduce_grads(grads: Sequence[list | None], weights: Sequence[float]) -> list:
    """Weighted sum of per-device gradients on the host (the all-reduce of synchronous SGD).

    Parameters
    ----------
    grads : list (n_devices) of gradient lists or ``None``
        Host arrays in the layout of :meth:`xmc_engine.model.MLPReplica.grad_batch`: entry 0 is
        row-sparse ``(rows int64 (n_rows_i,) sorted unique, grad_rows (n_rows_i, h))``, the
        others dense. ``None`` (a device without rows this step) is skipped.
    weights : sequence of float, shape (n_devices,)
        ``b_i / Σ_j b_j``: each device's share of the global batch, so that the result is the
        gradient of the mean loss over the whole global batch. Weight 0 is skipped.

    Returns
    -------
    list
        Same layout: ``W1`` over the sorted union of the devices' rows (rows a device did not
        touch contribute 0), dense entries ``Σ_i w_i g_i``. Fresh arrays (inputs untouched).
    """
    used = [i for i, g in enumerate(grads) if g is not None and weights[i] != 0.0]
    if not used:
        raise ValueError("allreduce_grads: no device contributed a gradient")
    w = [float(weights[i]) for i in used]
    row_sets = [np.asarray(grads[i][0][0], dtype=np.int64) for i in used]
    parts = [np.asarray(grads[i][0][1]) for i in used]
    if len(used) == 1:
        rows = row_sets[0].copy()
        g1 = np.multiply(parts[0], parts[0].dtype.type(w[0]))
    else:
        rows = np.unique(np.concatenate(row_sets))
        g1 = np.zeros((rows.shape[0], *parts[0].shape[1:]), dtype=parts[0].dtype)
        for r, g, wi in zip(row_sets, parts, w, strict=True):
            # rows are unique within a device, so fancy-index += is an exact scatter-add
            g1[np.searchsorted(rows, r)] += g.dtype.type(wi) * g
    out = [(rows, g1)]
    for k in range(1, len(grads[used[0]])):
        out.append(_weighted_sum([np.asarray(grads[i][k]) for i in used], w))
    return out


def _to_host(backend, grads: list) -> list:
    rows, g1 = grads[0]
    return ([(backend.to_host(rows), backend.to_host(g1))]
            + [backend.to_host(g) for g in grads[1:]])


class SyncSGD(Policy):
    """Synchronous data-parallel SGD with a per-step gradient all-reduce (module docstring).

    The replicas stay identical, so the central model is the first live replica's parameters
    (no extra copy).
    """

    name = "sync"
    static = True
    max_steps_per_period = 1

    def period_samples(self, n_devices: int, batch_size: int) -> int:
        """One global batch: ``n B`` (``B`` when ``split_global_batch``)."""
        return sum(self._sizes(n_devices, batch_size))

    def _sizes(self, n: int, B: int) -> list[int]:
        return [B // n if self.config.split_global_batch else B] * n

    def setup(self, replicas: Sequence, **kw) -> None:
        super().setup(replicas, **kw)
        B, n = self.batch_size, self.n_devices
        if self.config.split_global_batch and B % n:
            raise ConfigError(f"sync: split_global_batch needs batch_size divisible by the "
                              f"{n} devices, got batch_size={B}")
        self._replicas = list(replicas)
        self._grads: list = [None] * n
        self._live = 0  # a replica that took part in the last step (the central model)

    def batch_sizes(self) -> list[int]:
        return self._sizes(self.n_devices, self.batch_size)

    def device_lrs(self, lr: float) -> list[float]:
        if self.config.lr_scaling:
            lr *= sum(self.batch_sizes()) / self.batch_size
        return [lr] * self.n_devices

    def step(self, device: int, replica, rows: np.ndarray, lr: float) -> float:
        """The gradient of the device's rows, kept (on the host) for the merge; no update."""
        loss, grads = replica.grad_batch(rows)
        self._grads[device] = (len(rows), _to_host(replica.backend, grads))  # synchronize!
        return float(loss)

    def merge(self, replicas: Sequence, updates: Sequence[int], ctx) -> dict[str, Any]:
        """All-reduce the period's gradients, then every live device applies the same step."""
        if ctx.nonfinite:
            raise DivergenceError(f"sync: the loss became non-finite on devices "
                                  f"{sorted(ctx.nonfinite)} in epoch {ctx.epoch} period "
                                  f"{ctx.period} (lr {max(ctx.lrs):g}); lower the learning rate")
        got = [g if i not in ctx.excluded else None for i, g in enumerate(self._grads)]
        self._grads = [None] * self.n_devices
        total = sum(g[0] for g in got if g is not None)
        weights = [g[0] / total if g is not None else 0.0 for g in got]
        if total:
            g = allreduce_grads([x[1] if x is not None else None for x in got], weights)
            ctx.run_on_devices(lambda i: replicas[i].apply_grads(g, ctx.lrs[i]))
        self._live = min(i for i in range(self.n_devices) if i not in ctx.excluded)
        return {"weights": weights, "nonfinite": []}

    def central_params(self) -> list:
        """A live replica's parameters (every live replica is identical after every step)."""
        return self._replicas[self._live].params()
