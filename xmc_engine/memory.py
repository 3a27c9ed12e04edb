"""Memory planning: estimate what a training run needs on each device before it starts.

``fit_model`` calls :func:`check_memory` first, so that a run that cannot fit is refused at once
(:class:`~xmc_engine.errors.MemoryPlanError`, with the estimate and a setting that fits) instead of
dying in the middle of an epoch; ``xmc-engine plan`` prints the same estimate from a data set's
shape alone (no data generated or loaded for registered names).

What is counted (float32 = 4 bytes, ``P`` = bytes of one copy of the parameters)
--------------------------------------------------------------------------------
Per device (its own memory: host RAM for CPU devices, the GPU for ``cuda:N``):

- ``replica``: its model copy, ``P``;
- ``activations``: per step on the largest batch ``b`` it may get (``b_max`` for adaptive
  batch sizes): hidden activations and their gradients ``2 b sum(hidden)`` floats, the logits /
  softmax-gradient workspace ``b x n_labels`` (or ``b x label_chunk`` plus the ``hidden x
  label_chunk`` gradient block when chunked), the ``db2`` buffer (``n_labels``); with
  ``output="sampled"`` instead the ``m = min(n_labels, b x labels per row + negatives)``
  candidate columns: logits ``b x m``, the gathered block and its gradient ``2 x hidden x m``
  (plus a dense ``dW2``, ``db2`` for ``sync``, whose gradients are reduced densely); with the
  exact output layer a whole ``dW2`` (``hidden x n_labels``) where a step holds one: Adagrad's
  gradient, and the fused CPU step's (one hidden layer, no label chunk);
- ``optimizer state``: the Adagrad accumulators, ``P`` (``optimizer="adagrad"``);

On device 0 (where the central model lives and evaluation runs):

- ``merge``: the central-model buffers of the algorithm (adaptive: ``z_t``, ``z_{t-2}``, ``w̄``
  and a spare, i.e. ``4 P`` with momentum, ``2 P`` without; average: ``2 P``; other baselines:
  ``3 P``; single: none);
- ``evaluation``: the prediction workspace, ``4096 x n_labels`` floats (or ``4096 x
  label_chunk``), when a held-out set is evaluated; with ``lr_decay="plateau"`` (or ``"auto"``
  resolving to it) the held-out P@1's logits block too (:data:`xmc_engine.config.HELDOUT_LOGITS`).

On the host, shared by every device: the data (CSR ``X`` and ``Y`` of the training set and of the
held-out set: 4-byte values and indices, 8-byte ``indptr``), with ``normalize="l2"`` a second
copy of the feature values (made only where some row's norm is not 1; counted always), with the
plateau schedule a copy of the training rows it does not hold out (and with ``keep_best`` or
``back_to_best`` a copy of the parameters: the best epoch's model), and two
host copies of the parameters (the initial model, and the copy taken for checkpoints and the
result); and the process itself (:data:`RUNTIME_BYTES`: the interpreter, the libraries and the
compiled kernels, a constant measured on the development machine).

Available memory: ``MemAvailable`` of ``/proc/meminfo`` for the host, free memory of each GPU from
CuPy, each taken at 90 % (headroom for fragmentation and the rest of the process); a budget
(``memory_budget`` / ``XMC_MEMORY_BUDGET`` / ``--memory-budget``) replaces both and is used as is.
CPU devices all draw on the host; workers that share one GPU add up on it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass, field

from xmc_engine.config import EVAL_ROWS, HELDOUT_LOGITS
from xmc_engine.errors import ConfigError, MemoryPlanError

logger = logging.getLogger(__name__)

__all__ = ["MemoryPlan", "check_memory", "format_size", "parse_size", "plan_memory"]

F32 = 4
HEADROOM = 0.9
#: The process itself, counted once on the host: the interpreter, NumPy / SciPy / Numba and the
#: kernels a run compiles or loads. Measured on the development VM (Python 3.11, numba 0.68):
#: 117 MiB after ``import xmc_engine``, 243 MiB once a run of each output layer and loss had
#: loaded its kernels; without it the plan was 16-21 % below the measured peak of one-device
#: runs at the Amazon-670K shape (``bench/RESULTS.md``, "Amazon-670K shape at equal wall time").
RUNTIME_BYTES = 250 * 2**20
#: The name of that item in a plan's host pool.
RUNTIME_ITEM = "process (Python, libraries, kernels)"
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_size(text, *, source: str = "memory_budget") -> int:
    """Bytes of a size such as ``8GiB``, ``512MB``, ``1.5g`` or ``1000000``; ``ConfigError``
    naming the value otherwise."""
    if isinstance(text, (int, float)) and not isinstance(text, bool) and text > 0:
        return int(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{source}={text!r}: expected a positive size like 8GiB, 512MB or "
                          "1000000 (bytes)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


@dataclass
class PoolPlan:
    """One memory pool (the host, or one GPU): what it must hold and what it has."""

    name: str
    items: dict[str, int] = field(default_factory=dict)
    available: int | None = None
    source: str = "unknown"

    @property
    def total(self) -> int:
        return int(sum(self.items.values()))

    @property
    def fits(self) -> bool | None:
        return None if self.available is None else self.total <= self.available


@dataclass
class MemoryPlan:
    """The estimate of a run: one :class:`PoolPlan` per memory pool and the verdict."""

    pools: list[PoolPlan]
    settings: dict
    suggestion: dict | None = None
    suggestion_text: str = ""

    @property
    def fits(self) -> bool | None:
        """``True`` / ``False``; ``None`` when a pool's capacity is unknown (and the rest fit)."""
        verdicts = [p.fits for p in self.pools]
        if any(v is False for v in verdicts):
            return False
        return None if any(v is None for v in verdicts) else True

    def summary(self) -> str:
        s = self.settings
        lines = [f"memory plan: {s['n_samples']:,} samples x {s['n_features']:,} features -> "
                 f"hidden {s['hidden']} -> {s['n_labels']:,} labels; devices {s['devices']}; "
                 f"algorithm {s['algorithm']}; batch {s['batch_size']} (max {s['b_max']}); "
                 f"label_chunk {s['label_chunk']}; output {s['output']}"
                 + (f" (negatives {s['negatives']})" if s["output"] == "sampled" else ""),
                 f"parameters: {s['n_params']:,} floats = {format_size(s['param_bytes'])} "
                 "per copy"]
        for p in self.pools:
            verdict = {True: "fits", False: "DOES NOT FIT", None: "capacity unknown"}[p.fits]
            have = (f"{format_size(p.available)} available ({p.source})"
                    if p.available is not None else "available: unknown")
            lines.append(f"{p.name}: needs {format_size(p.total)}, {have}: {verdict}")
            for k, v in p.items.items():
                lines.append(f"    {k:<40s} {format_size(v):>10s}")
        verdict = {True: "fits", False: "does NOT fit", None: "fits where known"}[self.fits]
        lines.append(f"verdict: {verdict}")
        if self.fits is False:
            lines.append(f"suggestion: {self.suggestion_text}")
        return "\n".join(lines)


# -- estimate --------------------------------------------------------------------------------
def _csr_bytes(n_rows: int, nnz: float) -> int:
    return int(nnz * 2 * F32 + (n_rows + 1) * 8)


def _merge_copies(algorithm: str, params) -> int:
    """Model-sized buffers the algorithm's merge keeps (``params``: its typed options)."""
    if algorithm == "single":
        return 0
    if algorithm == "adaptive":
        return 4 if params.momentum > 0 else 2
    if algorithm == "average":
        return 2
    return 3


def _max_batch(cfg, n_labels: int, n_samples: int | None = None) -> int:
    """The largest batch a device may step on: with ``adaptive`` ``b_max`` (in base batches,
    ``batch_scale`` resolved by the loss, the softmax's where the probe has yet to pick it) or
    its base batch with ``rule="fixed"``."""
    p = cfg.algorithm_params
    if cfg.algorithm != "adaptive":
        return cfg.batch_size
    base = p.base_batch(cfg.batch_size, n_labels, cfg.loss, n_samples)
    return base if p.rule == "fixed" else max(p.b_max_for(base), base)


def _host_available() -> tuple[int | None, str]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * HEADROOM), "90% of MemAvailable"
    except OSError:
        pass
    return None, "unknown"


def _gpu_available(index: int) -> tuple[int | None, str]:
    try:
        import cupy

        free, _ = cupy.cuda.Device(index).mem_info
        return int(free * HEADROOM), "90% of free GPU memory"
    except Exception:  # noqa: BLE001 - no CuPy / no such GPU: capacity unknown
        return None, "unknown (no usable CUDA device here)"


def plan_memory(cfg, *, n_samples: int, n_features: int, n_labels: int, nnz: float,
                label_nnz: float, n_test: int = 0, test_nnz: float = 0.0,
                test_label_nnz: float = 0.0, budget=None, devices=None,
                suggest: bool = True) -> MemoryPlan:
    """Estimate the memory of training ``cfg`` on data of the given shape (module docstring).

    Parameters
    ----------
    cfg : TrainConfig
    n_samples, n_features, n_labels : int
        Training-set shape.
    nnz, label_nnz : float
        Non-zeros of the training ``X`` and ``Y``.
    n_test, test_nnz, test_label_nnz : int, float
        Held-out set (``n_test = 0``: no evaluation).
    budget : int or str, optional
        Bytes each pool may use (e.g. ``"8GiB"``); default ``XMC_MEMORY_BUDGET``, else what the
        machine reports.
    devices : list of DeviceSpec, optional
        Default ``parse_devices(cfg.devices)``.
    suggest : bool
        Look for a setting that fits when this one does not.
    """
    from xmc_engine import _env
    from xmc_engine.devices import parse_devices
    from xmc_engine.model import ModelShape, fused_step_covers

    if budget is None:
        budget = _env.memory_budget()
    budget_bytes = parse_size(budget) if budget is not None else None
    devs = parse_devices(cfg.devices) if devices is None else devices
    shape = ModelShape(int(n_features), int(n_labels), tuple(cfg.hidden))
    P = shape.n_params() * F32
    b = _max_batch(cfg, n_labels, n_samples)
    C = min(int(cfg.label_chunk), n_labels) if cfg.label_chunk else n_labels
    h_sum, h_last = sum(cfg.hidden), cfg.hidden[-1]
    output = cfg.output_for(n_labels, label_nnz / max(n_samples, 1))
    if output == "sampled":
        m = min(n_labels, math.ceil(b * label_nnz / max(n_samples, 1)) + cfg.negatives)
        # sync's gradients of W2, b2 are column-sparse too: inside the candidate workspaces
        act = 2 * b * h_sum * F32 + b * m * F32 + 2 * (h_last + 1) * m * F32
    else:
        act = 2 * b * h_sum * F32 + b * C * F32 + n_labels * F32
        if C < n_labels:
            act += h_last * C * F32 + b * h_last * F32  # dW2 chunk, dH chunk

    def dense_dW2(dev) -> int:
        """A whole ``dW2`` held during a step: Adagrad's gradient with the exact output layer,
        and the fused CPU step's (one hidden layer, one label chunk; kernels/train_step.py)."""
        if output == "sampled":
            return 0
        fused = dev.kind == "cpu" and fused_step_covers(len(cfg.hidden), output,
                                                         cfg.label_chunk, n_labels)
        return h_last * n_labels * F32 if cfg.optimizer == "adagrad" or fused else 0
    pools: dict[str, PoolPlan] = {}

    def pool(dev) -> PoolPlan:
        name = "host" if dev.kind == "cpu" else f"cuda:{dev.index}"
        if name not in pools:
            if budget_bytes is not None:
                avail, src = budget_bytes, "budget"
            elif dev.kind == "cpu":
                avail, src = _host_available()
            else:
                avail, src = _gpu_available(dev.index)
            pools[name] = PoolPlan(name, {}, avail, src)
        return pools[name]

    def add(p: PoolPlan, key: str, value: int) -> None:
        p.items[key] = p.items.get(key, 0) + int(value)

    host = pool(type(devs[0])("cpu")) if devs else None
    for i, d in enumerate(devs):
        p = pool(d)
        add(p, f"replica {i} ({d})", P)
        add(p, f"activations+logits {i} (b={b})", act + dense_dW2(d))
        if cfg.optimizer == "adagrad":
            add(p, f"optimizer state {i} (Adagrad, P)", P)
        if output == "sampled" and cfg.negative_sampling == "frequency":
            # output_layer.FrequencyProposal: the draw probabilities, their running sum and
            # the guide table of the draw (one int64 per cell, a cell per label at most)
            from xmc_engine.output_layer import GUIDE_CELLS

            add(host, f"negatives' frequency proposal {i} (2 x n_labels float64, guide table)",
                2 * 8 * n_labels + 8 * (min(GUIDE_CELLS, n_labels) + 1))
    p0 = pool(devs[0])
    copies = _merge_copies(cfg.algorithm, cfg.algorithm_params)
    if copies:
        add(p0, f"merge/momentum buffers ({copies} x P)", copies * P)
    if n_test:
        add(p0, f"evaluation workspace ({EVAL_ROWS} x {C})",
            EVAL_ROWS * (C * F32 + h_sum * F32) + EVAL_ROWS * 12 * max(5, cfg.eval_k))
    add(host, "training data (CSR X, Y)",
        _csr_bytes(n_samples, nnz) + _csr_bytes(n_samples, label_nnz))
    if n_test:
        add(host, "held-out data (CSR X, Y)",
            _csr_bytes(n_test, test_nnz) + _csr_bytes(n_test, test_label_nnz))
    if cfg.normalize == "l2":  # at most: nothing is copied when every row has norm 1
        add(host, "normalised row values (at most)", int((nnz + test_nnz) * F32))
    if cfg.holds_out(n_samples):  # training.hold_out copies the rows it keeps
        add(host, "training rows apart from the held-out ones (a copy)",
            _csr_bytes(n_samples, nnz) + _csr_bytes(n_samples, label_nnz))
        add(p0, "held-out P@1 workspace (plateau, keep_best)", HELDOUT_LOGITS * F32)
        if cfg.keep_best or cfg.back_to_best:
            add(host, "the best epoch's model (keep_best, back_to_best: P)", P)
    add(host, "host parameter copies (2 x P)", 2 * P)
    if cfg.ensemble > 1:  # the finished members, then their combination beside them
        k = cfg.ensemble
        add(host, f"ensemble: the other members and the combined network ({2 * k - 1} x P)",
            (2 * k - 1) * P)
    add(host, RUNTIME_ITEM, RUNTIME_BYTES)
    settings = {"n_samples": int(n_samples), "n_features": int(n_features),
                "n_labels": int(n_labels), "hidden": list(cfg.hidden), "devices": cfg.devices,
                "algorithm": cfg.algorithm, "batch_size": cfg.batch_size, "b_max": b,
                "label_chunk": cfg.label_chunk, "output": output,
                "negatives": cfg.negatives, "n_params": shape.n_params(), "param_bytes": P}
    plan = MemoryPlan(list(pools.values()), settings)
    if suggest and plan.fits is False:
        plan.suggestion, plan.suggestion_text = _suggest(
            cfg, devs, dict(n_samples=n_samples, n_features=n_features, n_labels=n_labels,
                            nnz=nnz, label_nnz=label_nnz, n_test=n_test, test_nnz=test_nnz,
                            test_label_nnz=test_label_nnz, budget=budget))
    return plan


def _candidates(cfg, n_devices: int):
    """Settings to try, least intrusive first: ``(overrides, CLI flags)``."""
    L_chunks = [c for c in (65536, 32768, 16384, 8192, 4096, 2048, 1024)
                if cfg.label_chunk is None or c < cfg.label_chunk]
    for c in L_chunks:
        yield {"label_chunk": c}, f"--label-chunk {c}"
    chunk = {"label_chunk": min(L_chunks[-1], cfg.label_chunk or 10**9)} if L_chunks else {}
    chunk_flag = f" --label-chunk {chunk['label_chunk']}" if chunk else ""
    b = cfg.batch_size
    while b > 16:
        b //= 2
        ov = {**chunk, "batch_size": b}
        flags = f"--batch-size {b}"
        if cfg.algorithm == "adaptive":
            ov["algorithm_params"] = {**cfg.algorithm_params.to_dict(),
                                      "b_min": min(b, cfg.algorithm_params.b_min), "b_max": b,
                                      "batch_scale": 1}
            flags += f" --algo-param b_max={b} --algo-param batch_scale=1"
        yield ov, flags + chunk_flag
    for n in range(n_devices - 1, 0, -1):
        yield {**chunk, "n_devices": n}, (
            f"{n} device(s)" + (" with --algorithm single" if n == 1 else "") + chunk_flag)


def _apply(cfg, devs, ov):
    from xmc_engine.devices import format_devices

    d = {k: v for k, v in ov.items() if k != "n_devices"}
    if "n_devices" in ov:
        n = ov["n_devices"]
        d["devices"] = format_devices(devs[:n])
        if n == 1:
            d["algorithm"] = "single"
    new = dataclasses.replace(cfg, **d)
    if "n_devices" in ov:
        return new, devs[:ov["n_devices"]]
    return new, devs


def _suggest(cfg, devs, shape_kw) -> tuple[dict | None, str]:
    for ov, flags in _candidates(cfg, len(devs)):
        new, new_devs = _apply(cfg, devs, ov)
        plan = plan_memory(new, devices=new_devs, suggest=False, **shape_kw)
        if plan.fits is not False:
            total = max(p.total for p in plan.pools)
            ov = {k: v for k, v in ov.items() if k != "n_devices"}
            if new.devices != cfg.devices:
                ov.update(devices=new.devices, algorithm=new.algorithm)
            return ov, f"{flags} (needs {format_size(total)} in its largest pool)"
    return None, ("no setting tried fits (label_chunk down to 1024, batch size down to 16, one "
                  "device): reduce --hidden or use a device with more memory")


# -- the hook in fit_model -------------------------------------------------------------------
def plan_for_data(cfg, X, Y, eval_set=None, *, budget=None) -> MemoryPlan:
    """:func:`plan_memory` of ``cfg`` with the shape of host CSR ``X`` (n_samples, n_features),
    ``Y`` (n_samples, n_labels) and the optional held-out ``(X_test, Y_test)``."""
    kw = {}
    if eval_set is not None:
        kw = {"n_test": eval_set[0].shape[0], "test_nnz": eval_set[0].nnz,
              "test_label_nnz": eval_set[1].nnz}
    return plan_memory(cfg, n_samples=X.shape[0], n_features=X.shape[1], n_labels=Y.shape[1],
                       nnz=X.nnz, label_nnz=Y.nnz, budget=budget, **kw)


def check_memory(cfg, X, Y, eval_set=None, *, budget=None) -> MemoryPlan:
    """Plan ``cfg`` on host CSR ``X`` (n_samples, n_features), ``Y`` (n_samples, n_labels) and
    the optional held-out ``(X_test, Y_test)``; raise :class:`MemoryPlanError` with the estimate
    and a setting that fits when it does not. ``XMC_MEMORY_BUDGET=off`` skips the check."""
    from xmc_engine import _env

    if budget is None and str(_env.memory_budget()).lower() in ("off", "none", "0"):
        return None
    plan = plan_for_data(cfg, X, Y, eval_set, budget=budget)
    if plan.fits is False:
        worst = max((p for p in plan.pools if p.fits is False), key=lambda p: p.total)
        raise MemoryPlanError(
            f"this run needs about {format_size(worst.total)} on {worst.name} but "
            f"{format_size(worst.available)} is available ({worst.source}); a setting that "
            f"fits: {plan.suggestion_text}\n{plan.summary()}")
    logger.info("memory plan: %s", "; ".join(f"{p.name} {format_size(p.total)}"
                                               for p in plan.pools))
    return plan
