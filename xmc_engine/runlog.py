"""The machine-readable run log: one JSON object per line in ``<run_dir>/log.jsonl``.

Every record has ``"event"`` (a string) and ``"wall_time"`` (seconds since the :class:`RunLog`
was created, or since the ``t0`` it was given; added automatically). Times are in seconds, metrics
are fractions in ``[0, 1]`` with the names of :mod:`xmc_engine.metrics` (``"P@1"``, ``"nDCG@3"``,
``"PSP@5"``, ...). NaN and infinities are written as ``null``. Readers must ignore fields they do
not know. The events the engine writes:

``start``
    Once per training call, first. ``config`` (the run configuration as given, a JSON object:
    its ``algorithm``, ``devices``, ``seed`` and the rest), ``output`` (the output layer trained,
    ``"exact"`` or ``"sampled"``, what ``"auto"`` chose), ``loss`` (the loss trained: ``config``'s,
    or what ``"auto"`` chose), ``algorithm_params`` (the algorithm's options in effect, ``"auto"``
    ones resolved: ``adaptive``'s ``row_weights``, ``label_weights`` and
    ``weights_from_epoch``), ``lr``, ``lr_decay`` (a number, or ``"plateau"``) and
    ``warmup_epochs`` (the values in effect, defaults resolved), ``heldout_rows`` (the training
    rows the plateau rule, or ``keep_best`` from ``KEEP_BEST_MIN_ROWS`` rows, holds out of
    training, 0 without them; ``n_samples`` counts the rest),
    ``n_samples``, ``n_features``, ``n_labels``, ``devices`` (one object per device: ``kind``,
    ``index``, ``speed``, ``threads``), ``resumed`` (whether the run continues from a checkpoint)
    with ``samples`` and ``epoch`` (where it starts: 0 for a new run).
``loss_probe``
    Right after ``start`` when ``config`` says ``loss="auto"``
    (:func:`xmc_engine.training.choose_loss`, run before the start): ``loss`` (the choice),
    ``p1`` (held-out P@1 per loss; empty where the rows were too few to probe), ``z`` (the
    softmax's margin over the logistic loss in standard errors, which it must exceed to win,
    :func:`xmc_engine.training.pick_loss`; ``null`` without a probe), ``margin`` (that
    threshold: ``LOSS_PROBE_SOFTMAX_Z``, or ``LOSS_PROBE_SOFTMAX_Z_SAMPLED`` where the run
    trains the sampled output layer; ``null`` without a probe), ``rows``,
    ``heldout``, ``epochs``, ``seconds`` (outside ``train_time``), ``threads`` (the CPU thread
    budget calibrated once for the probe's fits and the run; ``null`` where none was),
    ``threads_timed`` (``false`` where the run was too short to repay timing the budgets, or
    its steps too short to gain from threads, and kept one thread), ``threads_speedup`` (the
    timing's speed-up of all the threads over one; ``null`` where not timed), ``together``
    (the fits ran side by side, each on its share of the device's threads) and ``continued``:
    ``null``, or, where the run continues the winning fit (``continue_probe``), its
    ``samples`` and ``train_time``: the run starts there, so
    those samples and seconds are in its ``eval`` records' ``samples`` and ``train_time`` (and
    in ``start``'s ``samples``) as well as in the probe's ``seconds``.
    ``first_look``: ``null``, or, where the probe looked twice (the sampled output layer, the
    softmax ahead but not clearly after a small part of the epoch,
    :func:`xmc_engine.training.second_look_samples`), the first look's ``z``, ``p1``, ``rows``
    and ``loss``; ``z``, ``p1``, ``rows`` and ``loss`` above are then the second look's, which
    decided.
``threads``
    Before training, per CPU device with several threads and no ``threads`` given: ``device``,
    ``threads`` (the budget it trains with), ``note`` (timed, not timed because the run or its
    steps are too short, taken from the loss probe or from an ensemble's first member, or one thread
    because an ensemble's members train side by side) and ``speedup`` (how many times as fast
    as one thread all the device's threads ran the step where timed, else ``null``).
``compile``
    Before training: ``seconds`` spent compiling the kernels or loading them from Numba's
    cache (outside ``train_time``), ``compiled`` (the Numba compilations of CPU code that took:
    0 where every kernel came from the cache; CUDA kernels are not counted), ``devices``. With
    ``loss="auto"`` a first one, before ``loss_probe``, has the kernels of both losses on the
    first device (``losses``, ``note``): the probe's ``seconds`` are then the probe's own.
``eval``
    After each evaluation. ``epoch`` (float, epochs of training data consumed), ``samples`` (int,
    training samples consumed), ``train_time`` (training seconds only; evaluation excluded),
    ``eval_time`` (seconds this evaluation took), ``metrics`` (``{"P@1": ..., ...}``).
``plateau``
    With held-out rows (``lr_decay="plateau"``, or ``keep_best`` with ``"auto"``'s fixed decay
    from ``KEEP_BEST_MIN_ROWS`` rows, where ``lowered`` is always false and ``lr_scale`` 1),
    after each whole epoch but the last: ``epoch`` (epochs done),
    ``heldout_p1`` (the central model's P@1 on the held-out rows; ``null`` on MPI ranks other
    than 0), ``best_p1`` (the highest so far), ``lowered`` (whether the rate was just
    multiplied by ``PLATEAU_FACTOR``), ``lr_scale`` (the multiplier now in effect), ``seconds``
    (the evaluation's time, counted in ``train_time``); with ``back_to_best`` (the default)
    also ``z`` (the best epoch's held-out hits ahead of these, in standard errors of the
    paired difference; ``null`` off rank 0) and ``back_to`` (the epoch whose model training
    goes on from, or ``null``).
``merge``
    After each merge period (every algorithm; one device's "merge" is the end of a period of
    its own). ``epoch`` (the whole epochs before it), ``period`` (index within the epoch),
    ``progress`` (epochs done, a float), ``lr`` (the schedule's rate before per-device scaling),
    ``algorithm``, ``merge_s`` (the merge's seconds), ``nonfinite`` (devices left out of it),
    ``devices``: a list with one object per device: ``device`` (index), ``name``,
    ``batch_size``, ``updates``, ``samples``, ``weight`` (merge weight ``p_i``), ``lr`` (its
    rate), ``busy_s``, ``idle_s`` (time computing vs. waiting at the barrier), ``cpu_s`` (its
    thread's CPU time), ``loss`` (its mean training loss in the period). The algorithm may add
    fields: ``adaptive``'s ``norm`` and ``flag`` (the adaptive-normalisation trend), ``solo``
    (the device that trained the period alone, ``solo_epochs``); its
    row-sparse merge's ``rows_touched`` and ``rows_single`` (``W1`` rows changed by any replica,
    by exactly one), ``row_sum_power`` (with a per-row sum: the sum of ``k`` replicas'
    changes to a shared row was scaled by ``k ** -row_sum_power``), ``labels_seen`` and
    ``labels_single`` (labels some / exactly one replica
    held as a positive, with the per-label weights) and ``labels_changed`` (``W2`` columns
    changed, sampled layer); with ``delta_stats`` the per-replica RMS changes
    ``delta_w1_single``, ``delta_w1_shared``, ``delta_w2_head``, ``delta_w2_tail``;
    ``node_weights`` (each MPI node's share of the merge); ``easgd``'s ``alpha``;
    ``crossbow``'s ``momentum``.
``checkpoint``
    After a checkpoint is written: ``path``, ``epoch``, ``samples``, ``train_time``, ``loss`` (the
    loss trained), ``lr_decay`` (the decay in effect, a number or ``"plateau"``: a resumed run
    of ``lr_decay="auto"`` keeps the one its probe's choice gave), and with the plateau rule
    ``lr_scale``, ``plateau_best_p1`` (its state) and ``best_epoch`` (whose model the
    checkpoint holds as ``best.<name>`` arrays: ``keep_best``).
    A resumed run says so in its ``start`` record (``resumed``, ``samples``, ``epoch``).
``nonfinite``
    A device's loss went non-finite in a period: it was left out of the merge, reset to the
    merged model and its rate halved: ``epoch``, ``period``, ``device`` (index), ``name``,
    ``lr_scale``.
``device_dropped``
    A device failed and the run continues without it: ``epoch``, ``period``, ``device``
    (index), ``name``, ``error``, ``remaining`` (the indices still training),
    ``rejoin_after`` (periods before it is tried again; ``null``: never).
``diverged``
    Training diverged (the run raises ``DivergenceError``): ``samples``, ``error``,
    ``last_checkpoint``.
``interrupted``
    SIGINT or SIGTERM stopped the run after a checkpoint (it raises ``TrainingInterrupted``):
    ``signal``, ``epoch``, ``samples``, ``train_time``, ``checkpoint``.
``plateau_stop``
    With ``lr_decay="plateau"``, when the rule has lowered the rate below
    ``PLATEAU_STOP_SCALE`` and training ends before ``epochs``: ``epoch``, ``samples``,
    ``train_time``, ``lr_scale``, ``stop_scale``, ``best_p1`` (the best held-out P@1).
``keep_best``
    With held-out rows and ``keep_best`` (the default), once after training, before
    the final evaluation: ``epoch`` (epochs trained), ``heldout_p1`` (the last model's P@1 on
    the held-out rows; ``null`` on MPI ranks other than 0, and where no epoch before the last
    was read: a run of one epoch has no earlier model to keep), ``best_p1`` and ``best_epoch``
    (the best epoch's), ``z`` (how far the best epoch's held-out hits are ahead of the last
    model's, in standard errors of the paired difference; ``null`` on other ranks),
    ``restored`` (whether that epoch's model replaced the last one: ``z`` above
    ``KEEP_BEST_Z``; the final evaluation, the result and the last checkpoint are then of
    that model), ``seconds`` (counted in ``train_time``).
``time_budget``
    When ``max_train_seconds`` ended training before ``epochs``: ``max_train_seconds``,
    ``train_time``, ``samples``, ``epoch``.
``final``
    Once, last, when training ended normally (a divergence or a signal writes ``diverged`` or
    ``interrupted`` instead and raises). ``status`` (``"completed"``: every epoch trained,
    ``"time_budget"`` or ``"plateau_stop"``: what ended it sooner), ``epoch``, ``samples``,
    ``train_time``, ``metrics`` (the last evaluation, if any), ``mean_loss`` (the training
    loss averaged over the samples of this call).
``ensemble``
    With ``ensemble`` > 1 the run folder's own log holds two records, this one and a
    ``final``; each member's run (every record above) is logged in its sub-folder
    ``member-<j>``. ``members``, ``seeds`` (each member's), ``loss`` (the loss they trained),
    ``hidden`` (the combined network's widths), ``member_metrics`` and
    ``member_train_time`` (each member's last evaluation and training seconds),
    ``lanes`` (how many members trained at once: 1, one after the other, or side by side),
    ``member_max_train_seconds`` (each member's share of ``max_train_seconds``, which its
    ``start`` record gives as ``1 / members`` of it where the share was set after it started,
    side by side; ``null`` without a budget),
    ``member_dirs``, ``metrics`` (the combined network's evaluation, if any) and
    ``eval_time``. The ``final`` after it has ``status`` ``"ensemble"``,
    ``member_status`` (each member's ``final`` status), ``samples`` (the members' summed),
    ``train_time`` (the first member's seconds before the others could start, then the longest
    lane's: the members' summed where they trained one after the other) and ``metrics``.
``neighbours``
    After ``final`` (written by :class:`xmc_engine.XMCClassifier`), where the fitted model
    votes with its training rows (``TrainConfig.neighbours``, :mod:`xmc_engine.neighbours`):
    ``k`` (the neighbours of each vote), ``why`` (``"given"``, or what decided
    ``neighbours="auto"``: :meth:`TrainConfig.neighbours_decision`), ``rows`` (the training
    rows kept), ``seconds``
    (keeping them: their hidden layer, outside ``train_time``), ``network`` (the last
    evaluation of the network alone, the ``final`` record's ``metrics``), ``metrics`` (the
    evaluation of the blend on the same rows, ``null`` without an ``eval_set``) and
    ``eval_time``.

For example::

    {"event": "eval", "wall_time": 12.9, "epoch": 1.0, "samples": 490449, "train_time": 11.2,
     "eval_time": 1.6, "metrics": {"P@1": 0.31, "P@3": 0.27, "P@5": 0.24}}

``checkpoint_failed``
    A checkpoint could not be written (disk full): ``error``, ``last_checkpoint`` (the newest
    good one, or ``null``), ``epoch``, ``samples``, ``train_time``. Training continues and the
    next checkpoint tries again.

The file is opened in append mode and written unbuffered after every record, so a crash loses at
most the record being written; :func:`read_log` drops such a truncated last line with a warning,
and a :class:`RunLog` that reopens the file first cuts it back to its last complete line. A write
that fails (disk full) keeps the unwritten bytes and a later :meth:`RunLog.write` writes them
first, so the file never holds a gap or a torn record once space is back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["LOG_NAME", "RunLog", "read_log", "log_path"]

LOG_NAME = "log.jsonl"


def log_path(path) -> Path:
    """The log file: ``path`` itself if it ends in ``.jsonl``, else ``path/log.jsonl``."""
    path = Path(path)
    return path if path.suffix == ".jsonl" else path / LOG_NAME


def _jsonable(obj):
    """``obj`` in plain JSON types (NaN/Inf -> None; NumPy, tuples, paths, dataclasses too)."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, np.bool_):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        obj = float(obj)
        return obj if math.isfinite(obj) else None
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)


def _cut_partial_last_line(path: Path) -> None:
    """Truncate ``path`` after its last newline, so that appended records start on a fresh line."""
    with open(path, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        pos, chunk = end, 65536
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            nl = f.read(pos - start).rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        else:
            keep = 0
        logger.warning("%s: dropping a truncated last record (%d bytes) before appending",
                       path, end - keep)
        f.truncate(keep)


class RunLog:
    """Append-only JSON-lines log of one run (record schema in the module docstring).

    Thread-safe: device workers and the evaluation loop may write concurrently.

    Parameters
    ----------
    path : str, os.PathLike or None
        The run folder (the log is ``path/log.jsonl``; the folder is created) or a ``.jsonl``
        file. ``None`` writes no file; records are still kept in :attr:`records`.
    t0 : float, optional
        A :func:`time.perf_counter` value that ``wall_time`` counts from (default: now).

    Attributes
    ----------
    path : pathlib.Path or None
        The log file.
    records : list of dict
        Every record written through this object, as written (after NaN -> None).
    """

    def __init__(self, path=None, t0: float | None = None):
        self.t0 = time.perf_counter() if t0 is None else float(t0)
        self.records: list[dict] = []
        self.path = None if path is None else log_path(path)
        self._lock = threading.Lock()
        self._file = None
        self._closed = False
        self._failing = False
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                _cut_partial_last_line(self.path)
            self._file = open(self.path, "ab", buffering=0)
        self._unwritten = bytearray()  # bytes a failed write left behind (disk full)

    def write(self, event: str, **fields) -> dict:
        """Append one record ``{"event": event, "wall_time": ..., **fields}``.

        Parameters
        ----------
        event : str
            The record type (``"eval"``, ``"merge"``, ...).
        **fields
            JSON-able values; NumPy scalars and arrays, tuples, paths and dataclasses are
            converted, NaN/Inf become ``null``, anything else is written as ``str(value)``.

        Returns
        -------
        dict
            The record as written.
        """
        if not isinstance(event, str) or not event:
            raise ValueError(f"event must be a non-empty string, got {event!r}")
        if "wall_time" in fields:
            raise ValueError("'wall_time' is set by RunLog; pass the time via t0")
        wall = time.perf_counter() - self.t0
        record = {"event": event, "wall_time": round(wall, 6), **_jsonable(fields)}
        line = json.dumps(record, allow_nan=False, separators=(", ", ": "))
        with self._lock:
            if self._closed:
                raise ValueError(f"RunLog {self.path} is closed")
            if self._file is not None:
                self._unwritten += (line + "\n").encode("utf-8")
                self._flush_unwritten()
            self.records.append(record)
        return record

    def _flush_unwritten(self) -> None:
        """Write the pending bytes; on failure keep what is left and warn (once per streak)."""
        try:
            while self._unwritten:
                n = self._file.write(self._unwritten)
                del self._unwritten[:n]
        except OSError as exc:
            if not self._failing:
                logger.warning("%s: cannot write the run log (%s); records are kept and written "
                               "when it works again", self.path, exc.strerror or exc)
            self._failing = True
            return
        self._failing = False

    def close(self) -> None:
        """Close the file (idempotent); :attr:`records` stays readable."""
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._flush_unwritten()
                self._file.close()
                self._file = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RunLog({str(self.path) if self.path else None!r}, records={len(self.records)})"


def read_log(path) -> list[dict]:
    """Read a run log written by :class:`RunLog`.

    Parameters
    ----------
    path : str or os.PathLike
        A run folder (reads ``path/log.jsonl``) or a ``.jsonl`` file.

    Returns
    -------
    list of dict
        The records in file order. A last line that is not valid JSON (the process died while
        writing it) is dropped with a warning; blank lines are skipped.

    Raises
    ------
    FileNotFoundError
        No log file.
    ValueError
        A line other than the last is not a JSON object (the message gives file and line).
    """
    path = log_path(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            if i == last:
                logger.warning("%s line %d: dropping a truncated last record (%s)",
                               path, i + 1, exc)
                break
            raise ValueError(f"{path} line {i + 1}: not a JSON record ({exc})") from None
        records.append(rec)
    return records
