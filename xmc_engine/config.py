"""Training configuration: one dataclass that round-trips to JSON (STYLE.md "Configs")."""

from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xmc_engine.errors import ConfigError

OPTIMIZERS = ("sgd", "adagrad")
ALGORITHMS = ("single", "adaptive", "average", "sync", "easgd", "crossbow")


@dataclass
class TrainConfig:
    """Everything a training run needs besides the data.

    Fields are the keyword arguments of :class:`xmc_engine.XMCClassifier` and the long options of
    ``xmc-engine train``. ``algorithm_params`` holds the options of the chosen algorithm (for
    ``adaptive``: ``merge_period``, ``warmup_epochs``, ``rule``, ``b_min``, ``b_max``, ``delta_b``,
    ``momentum``, ``boost`` ...; see :mod:`xmc_engine.algorithms`).

    ``lr_warmup_epochs`` and ``lr_decay`` are the schedule of every algorithm: a multi-device
    algorithm takes them as its ``warmup_epochs`` / ``lr_decay`` unless ``algorithm_params`` sets
    those. ``lr_warmup_epochs=None`` (the default) leaves each algorithm its own warm-up: none
    for ``single``, one epoch (equal batches and a linear ramp) for the multi-device ones.
    """

    hidden: list[int] = field(default_factory=lambda: [128])
    epochs: int = 10
    batch_size: int = 256
    lr: float = 1.0
    lr_warmup_epochs: float | None = None
    lr_decay: float = 0.0
    label_chunk: int | None = None
    optimizer: str = "sgd"
    devices: str = "cpu"
    algorithm: str = "single"
    algorithm_params: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    threads: int | None = None
    eval_every: float = 1.0
    eval_k: int = 5
    propensity_a: float = 0.55
    propensity_b: float = 1.5

    def __post_init__(self) -> None:
        if isinstance(self.hidden, int):
            self.hidden = [self.hidden]
        if (isinstance(self.hidden, (str, bytes)) or not hasattr(self.hidden, "__iter__")
                or not all(isinstance(h, numbers.Integral) and not isinstance(h, bool)
                        for h in self.hidden)):
            raise ConfigError(f"hidden={self.hidden!r}: need a list of positive integer widths")
        self.hidden = [int(h) for h in self.hidden]
        self.validate()

    def validate(self) -> None:
        def bad(name, why):
            raise ConfigError(f"{name}={getattr(self, name)!r}: {why}")

        if not self.hidden or any(h < 1 for h in self.hidden):
            bad("hidden", "need one or more positive layer widths")
        if not (isinstance(self.epochs, (int, float)) and self.epochs > 0):
            bad("epochs", "must be > 0")
        if int(self.batch_size) < 1:
            bad("batch_size", "must be >= 1")
        if not self.lr > 0:
            bad("lr", "must be > 0")
        if self.lr_warmup_epochs is not None and not self.lr_warmup_epochs >= 0:
            bad("lr_warmup_epochs", "must be >= 0 (or None: the algorithm's own default)")
        if self.lr_decay < 0:
            bad("lr_decay", "must be >= 0")
        if self.label_chunk is not None and int(self.label_chunk) < 1:
            bad("label_chunk", "must be >= 1 or None")
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"unknown; choose one of {', '.join(OPTIMIZERS)}")
        if self.algorithm not in ALGORITHMS:
            bad("algorithm", f"unknown; choose one of {', '.join(ALGORITHMS)}")
        if self.threads is not None and int(self.threads) < 1:
            bad("threads", "must be >= 1 or None")
        if self.eval_every < 0:
            bad("eval_every", "must be >= 0 (0 = only at the end)")
        if self.eval_k < 1:
            bad("eval_k", "must be >= 1")
        if not isinstance(self.algorithm_params, dict):
            bad("algorithm_params", "must be a mapping")

    # -- JSON round trip -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> TrainConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(names))}")
        try:
            return cls(**d)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json_file(cls, path: str | Path) -> TrainConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} line {exc.lineno}: invalid JSON ({exc.msg})") from None
        return cls.from_dict(d, source=str(path))
