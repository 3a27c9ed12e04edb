"""Fault injection for reliability tests: make a device worker raise, or its replica non-finite.

Spec grammar (``XMC_FAULT`` environment variable, or ``algorithm_params={"fault": ...}``)::

    spec   := entry ("," entry)*
    entry  := kind ":" device ":step:" N ["+"]
    kind   := "device"      the worker raises InjectedFault before its N-th step
            | "nan"         the replica's parameters become NaN after its N-th step
    device := integer >= 0 (position in the device spec) | "*" (every device)
    N      := integer >= 1  (steps counted per device from the start of the process)

Each entry fires once per device, or at every step from the N-th on with ``+``. Examples:
``device:1:step:40`` (device 1 fails at its 40th step), ``nan:*:step:5+`` (every replica
diverges from its 5th step on, as with a learning rate far too high).
"""

from __future__ import annotations

import logging
import math
import re
import threading
from dataclasses import dataclass

from xmc_engine.errors import ConfigError, InjectedFault

logger = logging.getLogger(__name__)

__all__ = ["Fault", "FaultInjector", "parse_faults"]

KINDS = ("device", "nan")
_ENTRY = re.compile(r"^(?P<kind>[a-z]+):(?P<device>\d+|\*):step:(?P<step>\d+)(?P<rep>\+?)$")


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` on ``device`` (``None`` = every device) at step ``step``."""

    kind: str
    device: int | None
    step: int
    repeat: bool = False


def parse_faults(spec: str, *, source: str = "XMC_FAULT") -> list[Fault]:
    """Parse a fault spec (module docstring); ``ConfigError`` naming the bad entry."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{source}={spec!r}: empty fault spec; expected e.g. device:1:step:40")
    faults = []
    for raw in spec.split(","):
        m = _ENTRY.match(raw.strip().lower())
        if m is None or m.group("kind") not in KINDS or int(m.group("step")) < 1:
            raise ConfigError(f"{source}: bad fault entry {raw!r}; expected KIND:DEVICE:step:N "
                              f"with KIND in {KINDS}, DEVICE an index or '*', N >= 1")
        dev = None if m.group("device") == "*" else int(m.group("device"))
        faults.append(Fault(m.group("kind"), dev, int(m.group("step")), bool(m.group("rep"))))
    return faults


class FaultInjector:
    """Counts each device's steps and fires the matching faults (thread-safe)."""

    def __init__(self, faults: list[Fault]):
        self.faults = list(faults)
        self._steps: dict[int, int] = {}
        self._fired: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    @classmethod
    def from_spec(cls, spec) -> FaultInjector | None:
        """An injector for ``spec`` (a string, a list of Fault, or None); ``XMC_FAULT`` is used
        when ``spec`` is None. ``None`` when there is nothing to inject."""
        from xmc_engine import _env

        if spec is None:
            spec = _env.fault_spec()
            if spec is None:
                return None
            faults = parse_faults(spec)
        elif isinstance(spec, str):
            faults = parse_faults(spec, source="fault")
        else:
            faults = list(spec)
        return cls(faults) if faults else None

    def _due(self, kind: str, device: int, step: int) -> bool:
        for k, f in enumerate(self.faults):
            if f.kind != kind or f.device not in (None, device):
                continue
            if f.repeat and step >= f.step:
                return True
            if f.step == step:
                if (k, device) not in self._fired:
                    self._fired.add((k, device))
                    return True
        return False

    def before_step(self, device: int) -> None:
        """Count the step; raise :class:`InjectedFault` if a ``device`` fault is due."""
        with self._lock:
            step = self._steps.get(device, 0) + 1
            self._steps[device] = step
            due = self._due("device", device, step)
        if due:
            logger.warning("fault injection: device %d fails at its step %d", device, step)
            raise InjectedFault(f"injected failure of device {device} at its step {step}")

    def after_step(self, device: int, replica) -> None:
        """Poison ``replica``'s parameters with NaN if a ``nan`` fault is due at this step."""
        with self._lock:
            due = self._due("nan", device, self._steps.get(device, 0))
        if due:
            logger.warning("fault injection: device %d goes non-finite", device)
            for p in replica.params():
                p[...] = math.nan
