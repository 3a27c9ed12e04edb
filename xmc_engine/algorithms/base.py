"""The policy interface every training algorithm implements over the shared scheduler.

A *policy* decides, per merge period (DESIGN.md §4): how batches are assigned (dynamic shared
cursor or static equal quotas, and each device's batch size), the learning rate of each device,
and what the merge does (weighted average + broadcast for Adaptive SGD and model averaging;
elastic moves toward a centre for EASGD / CROSSBOW; one step per period with a global batch for
synchronous SGD). The scheduler (:class:`xmc_engine.scheduler.ParallelTrainer`) runs the devices
and calls the policy between periods, on the main thread.

How the baselines of DESIGN.md §4 map onto this interface:

``average``   static quotas ``S / n``, equal ``B``, uniform average + broadcast.
``sync``      static, ``S = n B`` (one batch per device per period), uniform average +
              broadcast: from a common start, averaging the models after one plain SGD step
              equals one step with the averaged gradient.
``easgd``     static, ``S = n τ b``; merge = :func:`~xmc_engine.scheduler.merge.elastic_update`
              of each replica toward the centre, centre += Σ of the elastic differences; no
              broadcast.
``crossbow``  static, ``S = n b`` (every step); merge = elastic updates + centre momentum
              ``z <- z + Σ α (w_j - z) + μ (z - z_prev)``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from collections.abc import Sequence
from typing import Any

import numpy as np

from xmc_engine.errors import ConfigError, DivergenceError
from xmc_engine.scheduler.merge import find_nonfinite, merge_changed_rows

logger = logging.getLogger(__name__)

__all__ = ["ConfigMixin", "Policy"]


class ConfigMixin:
    """JSON round-trip for config dataclasses; unknown keys and bad types are ``ConfigError``."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config"):
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {unknown} for {cls.__name__}; "
                              f"valid keys: {sorted(names)}")
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for k, v in d.items():
            t = hints[k]
            if t is bool:
                ok = isinstance(v, bool)
            elif t is int:
                ok = isinstance(v, int) and not isinstance(v, bool)
            elif t is float:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool)
                v = float(v) if ok else v
            elif t is str:
                ok = isinstance(v, str)
            else:
                ok = True
            if not ok:
                raise ConfigError(f"{source}: {cls.__name__}.{k} must be {t.__name__}, "
                                  f"got {v!r}")
            kwargs[k] = v
        return cls(**kwargs)

    def _check_min(self, low, *names: str) -> None:
        """``ConfigError`` unless every field in ``names`` is ``>= low`` (one message for all)."""
        values = [getattr(self, n) for n in names]
        if any(v < low for v in values):
            raise ConfigError(f"{' and '.join(names)} must be >= {low}, got "
                              f"{', '.join(str(v) for v in values)}")

    @classmethod
    def from_json(cls, text: str, *, source: str = "config"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{source}: not valid JSON: {e}") from None
        return cls.from_dict(d, source=source)


class Policy:
    """Base class of the training algorithms (subclasses override the hooks they need).

    Attributes
    ----------
    name : str
    static : bool
        Static equal quotas per period (``True``) or the dynamic shared cursor (``False``).
    merge_period : int
        ``S``, samples per merge period.
    """

    name = "base"
    static = False
    merge_period: int = 1

    # -- lifecycle -----------------------------------------------------------------------------
    def setup(self, replicas: Sequence, n_samples: int) -> None:
        """Called once by the trainer after the replicas were made identical."""
        self.n_devices = len(replicas)
        self.n_samples = int(n_samples)
        self.backend = replicas[0].backend
        xp = getattr(self.backend, "xp", np)
        self.central = [xp.array(a, copy=True) for a in replicas[0].params()]

    # -- per period ----------------------------------------------------------------------------
    def batch_sizes(self) -> list[int]:
        """Batch size of each device for the next period."""
        raise NotImplementedError

    def learning_rates(self, lr0: float, progress: float) -> tuple[float, list[float]]:
        """``(lr(t), [lr_i])`` for the next period; ``progress`` = epochs done at its end."""
        raise NotImplementedError

    def merge(self, replicas: Sequence, updates: Sequence[int]) -> dict[str, Any]:
        """Merge the replicas after a period (main thread); returns loggable info.

        The info holds at least ``weights`` (one float per device).
        """
        raise NotImplementedError

    def end_period(self, progress: float, updates: Sequence[int], samples: Sequence[int],
                   busy_s: Sequence[float]) -> None:
        """Observe the period's measurements (e.g. to adapt batch sizes)."""

    def central_params(self) -> list:
        """The central (merged) model: list of arrays on the first device's backend."""
        return self.central

    def state_dict(self) -> dict[str, Any]:
        """JSON-able scheduling state for checkpoints (not the model arrays)."""
        return {"name": self.name, "batch_sizes": self.batch_sizes()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output after :meth:`setup` (for resuming)."""

    # -- helpers -------------------------------------------------------------------------------
    def _make_config(self, config_class: type, config, overrides: dict[str, Any]):
        """``config`` (default: ``config_class()``) with ``overrides`` applied and validated."""
        source = f"{self.name} options"
        if config is None:
            return config_class.from_dict(overrides, source=source)
        if overrides:
            return config_class.from_dict({**config.to_dict(), **overrides}, source=source)
        return config

    def _finite_updates(self, params: Sequence[Sequence], updates: Sequence[int]):
        """Update counts with non-finite replicas zeroed; raises if no finite replica is left.

        Replicas in ``self.excluded`` (set by the trainer: failed devices, replicas whose loss
        went non-finite) are zeroed too, without being checked. Returns ``(counts, bad)`` with
        ``bad`` the non-finite ones found here (plus the excluded ones in ``self.nonfinite``);
        when every remaining replica has a zero count, they get count 1 (uniform).
        """
        excluded = set(getattr(self, "excluded", ()))
        flagged = set(getattr(self, "nonfinite", ()))
        check = [i for i in range(len(params)) if i not in excluded]
        bad = sorted({check[j] for j in find_nonfinite([params[i] for i in check], self.backend)}
                     | (flagged & set(check)))
        skip = sorted(excluded | set(bad))
        if len(skip) == len(params):
            raise DivergenceError(
                f"every remaining replica ({len(bad)}: devices {bad}) has non-finite parameters "
                f"or loss; lower the learning rate and resume from the last checkpoint")
        c = np.asarray(updates, dtype=np.float64).copy()
        if skip:
            if bad:
                logger.warning("replicas %s are non-finite: dropped from the merge and reset",
                               bad)
            c[skip] = 0.0
            if c.sum() == 0:
                c[:] = 1.0
                c[skip] = 0.0
        return c, bad

    def _merge_changed_rows(self, replicas: Sequence, p) -> float | None:
        """:func:`~xmc_engine.scheduler.merge.merge_changed_rows` into ``self.central`` when it
        may apply (every replica merged with a weight > 0, none flagged, one node); returns its
        result (``None``: merge densely)."""
        if getattr(self, "excluded", ()) or getattr(self, "nonfinite", ()):
            return None
        comm = getattr(self, "comm", None)
        if comm is not None and comm.size > 1:  # the nodes' changed rows differ
            return None
        return merge_changed_rows(replicas, p, self.central, self.backend)

    def _broadcast(self, replicas: Sequence, params: Sequence) -> None:
        for r in replicas:
            r.set_params(params)
