"""Device specification strings: parse ``"cpu,cpu@0.5"`` or ``"cuda:0,cuda:1"`` into DeviceSpecs.

A *device* holds one model replica and is driven by one host thread (DESIGN.md §3). One spec
string describes all devices of a run.

Grammar
-------
::

    spec    := "auto" | entry ("," entry)*
    entry   := kind ["@" speed] ["*" count]
    kind    := "cpu" | "cuda:" N            N = CUDA ordinal, integer >= 0
    speed   := decimal number in (0, 1]    relative speed factor, default 1
    count   := integer >= 1                repeat the entry, default 1

Spaces around entries are ignored; anything else is an error (``DeviceSpecError`` naming the
entry). Examples:

``cpu``                one CPU device using every core
``cpu,cpu@0.5``        two CPU devices, the second emulated at half speed
``cpu*2,cpu@0.5``      three CPU devices, the last at half speed
``cuda:0,cuda:1``      two GPUs
``cuda:0,cuda:0``      two workers sharing GPU 0 (one stream each)
``auto``               every visible GPU; without a GPU, ``max(1, min(8, cores // 2))`` CPU
                       devices

A speed factor ``s < 1`` makes the device's worker idle for ``(1/s - 1)`` times its busy time
after every step: this emulates heterogeneous devices on identical hardware (DESIGN.md §3).

CPU thread budget: the machine's cores are split evenly among the CPU devices,
``threads = max(1, cores // n_cpu_devices)`` (the remainder stays free for the host threads and
the merge). A CUDA device gets ``threads = 1`` (its host thread only launches work).

``auto`` on a CPU-only machine uses one device per two cores (at most 8): two threads per device
keep the BLAS GEMM of the output layer efficient, while more devices than 8 would multiply the
replica memory and the merge cost for little gain.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from xmc_engine.errors import DeviceSpecError

logger = logging.getLogger(__name__)

__all__ = ["DeviceSpec", "parse_devices", "format_devices", "GRAMMAR", "available_cores"]

GRAMMAR = (
    'spec := "auto" | entry ("," entry)* ; entry := kind ["@" speed] ["*" count] ; '
    'kind := "cpu" | "cuda:N" (N >= 0) ; speed in (0, 1] ; count >= 1 '
    '(e.g. "cpu,cpu@0.5", "cpu*2", "cuda:0,cuda:0,cuda:1", "auto")'
)

_ENTRY = re.compile(
    r"^(?P<kind>[a-z]+)(?::(?P<index>[^@*]*))?(?:@(?P<speed>[^*]*))?(?:\*(?P<count>.*))?$"
)
_AUTO_MAX_CPU_DEVICES = 8


@dataclass(frozen=True)
class DeviceSpec:
    """One device of a run.

    Parameters
    ----------
    kind : {'cpu', 'cuda'}
    index : int or None
        CUDA ordinal; ``None`` for a CPU device.
    speed : float
        Relative speed factor in (0, 1]; ``s < 1`` is emulated by idling (DESIGN.md §3).
    threads : int
        Thread budget of the device's worker (numba/BLAS threads in its host thread).
    """

    kind: str
    index: int | None = None
    speed: float = 1.0
    threads: int = 1

    def __post_init__(self):
        if self.kind not in ("cpu", "cuda"):
            raise DeviceSpecError(f"device kind {self.kind!r} is not 'cpu' or 'cuda'; {GRAMMAR}")
        if self.kind == "cuda" and (self.index is None or self.index < 0):
            raise DeviceSpecError(f"cuda device needs an index >= 0, got {self.index!r}")
        if self.kind == "cpu" and self.index is not None:
            raise DeviceSpecError(f"cpu device takes no index, got {self.index!r}")
        if not (0.0 < self.speed <= 1.0):
            raise DeviceSpecError(f"speed factor must be in (0, 1], got {self.speed!r}")
        if self.threads < 1:
            raise DeviceSpecError(f"threads must be >= 1, got {self.threads!r}")

    @property
    def name(self) -> str:
        """``"cpu"`` or ``"cuda:N"`` (without the speed factor)."""
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    def __str__(self) -> str:
        return self.name if self.speed == 1.0 else f"{self.name}@{self.speed:g}"


def available_cores() -> int:
    """Cores this process may run on (affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _bad(entry: str, why: str) -> DeviceSpecError:
    return DeviceSpecError(f"bad device entry {entry!r}: {why}; grammar: {GRAMMAR}")


def _parse_entry(entry: str) -> list[tuple[str, int | None, float]]:
    m = _ENTRY.match(entry)
    if m is None:
        raise _bad(entry, "not of the form kind[:N][@speed][*count]")
    kind, index, speed, count = m.group("kind", "index", "speed", "count")
    if kind == "cpu":
        if index is not None:
            raise _bad(entry, "a cpu device takes no ':N' index")
        idx = None
    elif kind == "cuda":
        if index is None or not re.fullmatch(r"\d+", index):
            raise _bad(entry, "cuda needs a non-negative integer index, e.g. 'cuda:0'")
        idx = int(index)
    else:
        raise _bad(entry, f"unknown device kind {kind!r} (expected 'cpu' or 'cuda:N')")
    s = 1.0
    if speed is not None:
        if not re.fullmatch(r"(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?", speed):
            raise _bad(entry, f"speed {speed!r} is not a decimal number")
        s = float(speed)
        if not (0.0 < s <= 1.0):
            raise _bad(entry, f"speed {speed} is outside (0, 1]")
    n = 1
    if count is not None:
        if not re.fullmatch(r"\d+", count) or int(count) < 1:
            raise _bad(entry, f"count {count!r} is not an integer >= 1")
        n = int(count)
    return [(kind, idx, s)] * n


def parse_devices(spec: str, *, cores: int | None = None,
                  n_gpus: int | None = None) -> list[DeviceSpec]:
    """Parse a device specification string (grammar in the module docstring).

    Parameters
    ----------
    spec : str
        E.g. ``"cpu,cpu@0.5"``, ``"cuda:0,cuda:0,cuda:1"``, ``"auto"``.
    cores : int, optional
        Cores to split among the CPU devices; default :func:`available_cores`.
    n_gpus : int, optional
        Visible GPUs for ``"auto"``; default :func:`xmc_engine.backends.cuda_device_count`.
        (Explicit ``cuda:N`` entries are not checked against the machine here: the backend
        raises when it opens the device.)

    Returns
    -------
    list of DeviceSpec
        In spec order; the position in the list is the device id used by the scheduler.

    Raises
    ------
    DeviceSpecError
        Empty spec, unknown kind, cuda without index or with a negative one, speed <= 0 or > 1
        or not a number, stray characters. The message names the bad entry and the grammar.
    """
    if not isinstance(spec, str):
        raise DeviceSpecError(f"device spec must be a string, got {type(spec).__name__}")
    cores = available_cores() if cores is None else max(1, int(cores))
    text = spec.strip().lower()
    if not text:
        raise DeviceSpecError(f"empty device spec; grammar: {GRAMMAR}")
    if text == "auto":
        if n_gpus is None:
            from xmc_engine.backends import cuda_device_count

            n_gpus = cuda_device_count()
        if n_gpus > 0:
            items = [("cuda", i, 1.0) for i in range(n_gpus)]
        else:
            n_cpu = max(1, min(_AUTO_MAX_CPU_DEVICES, cores // 2))
            items = [("cpu", None, 1.0)] * n_cpu
    else:
        items = []
        for raw in text.split(","):
            entry = raw.strip()
            if not entry:
                raise _bad(raw, "empty entry (doubled or trailing comma?)")
            items.extend(_parse_entry(entry))
    n_cpu = sum(1 for kind, _, _ in items if kind == "cpu")
    cpu_threads = max(1, cores // n_cpu) if n_cpu else 1
    devices = [
        DeviceSpec(kind, idx, speed, cpu_threads if kind == "cpu" else 1)
        for kind, idx, speed in items
    ]
    logger.debug("devices %r -> %s", spec, format_devices(devices))
    return devices


def format_devices(devices: list[DeviceSpec]) -> str:
    """Inverse of :func:`parse_devices` (thread budgets are derived, so not written).

    ``parse_devices(format_devices(d))`` gives back ``d`` on the same machine.
    """
    return ",".join(str(d) for d in devices)
