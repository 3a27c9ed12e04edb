"""Time-to-accuracy plots drawn from run logs (:mod:`xmc_engine.runlog`), headless (Agg).

Matplotlib is imported on first use, through its object API (``Figure`` + the Agg canvas), so
drawing never touches pyplot's global state or needs a display.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from pathlib import Path

from xmc_engine.runlog import log_path, read_log

logger = logging.getLogger(__name__)

__all__ = ["plot_runs"]

_AXIS_LABELS = {
    "train_time": "training time (s, evaluation excluded)",
    "wall_time": "wall time (s)",
    "samples": "training samples",
    "epoch": "epoch",
}


def _run_label(run_path: Path, records: list[dict]) -> str:
    """Folder name, plus algorithm and devices from the ``start`` record when present (an
    ensemble's own log: the number of members)."""
    name = run_path.parent.name if run_path.suffix == ".jsonl" else run_path.name
    ens = next((r for r in records if r.get("event") == "ensemble"), None)
    if ens is not None:
        return f"{name} (ensemble of {ens.get('members')})"
    start = next((r for r in records if r.get("event") == "start"), {})
    config = start.get("config") if isinstance(start.get("config"), dict) else {}
    extra = []
    for key in ("algorithm", "devices"):  # prefer plain strings (a device spec, not a list)
        value = next((v for v in (start.get(key), config.get(key)) if isinstance(v, str)), None)
        if value:
            extra.append(value)
    return f"{name} ({', '.join(extra)})" if extra else name


def _curve(records: list[dict], metric: str, x: str) -> tuple[list[float], list[float]]:
    """Points ``(x, metric)`` of the ``eval`` records, plus the ``final`` one if it adds a point.

    A log appended to by a resumed run may step back in ``x`` (the run restarted from an older
    checkpoint): the later points replace the earlier ones they overlap.
    """
    xs, ys = [], []
    for r in records:
        if r.get("event") not in ("eval", "final"):
            continue
        xv, yv = r.get(x), (r.get("metrics") or {}).get(metric)
        if xv is None or yv is None:
            continue
        xv = float(xv)
        if r.get("event") == "final" and xs and xv == xs[-1]:
            continue
        while xs and xs[-1] >= xv:
            xs.pop()
            ys.pop()
        xs.append(xv)
        ys.append(float(yv))
    return xs, ys


def plot_runs(run_dirs, out_png, metrics=("P@1",), x: str = "train_time") -> Path:
    """Draw metric curves of one or several runs against ``x`` and against epochs.

    Parameters
    ----------
    run_dirs : str, os.PathLike or sequence of them
        Run folders holding ``log.jsonl``, or ``.jsonl`` files.
    out_png : str or os.PathLike
        Output PNG; its folder is created. Written atomically (temporary file + rename).
    metrics : sequence of str
        Metric names as logged (``"P@1"``, ``"nDCG@5"``, ...); one line style each.
    x : str
        Record field of the first panel: ``"train_time"`` (default), ``"wall_time"``,
        ``"samples"`` or ``"epoch"``. The second panel is against ``"epoch"`` (omitted when
        ``x == "epoch"``).

    Returns
    -------
    pathlib.Path
        ``out_png``.

    Raises
    ------
    ValueError
        No run has a point for any requested metric.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    if isinstance(metrics, str):
        metrics = (metrics,)
    runs = []
    for run in run_dirs:
        run = Path(run)
        records = read_log(run)
        runs.append((_run_label(run, records), records))

    xs_fields = [x] if x == "epoch" else [x, "epoch"]
    fig = Figure(figsize=(6.0 * len(xs_fields), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, len(xs_fields), i + 1) for i in range(len(xs_fields))]
    styles = ["-", "--", ":", "-."]
    colors = [f"C{i % 10}" for i in range(len(runs))]
    n_points = 0
    for ax, field in zip(axes, xs_fields, strict=True):
        for (label, records), color in zip(runs, colors, strict=True):
            for m_i, metric in enumerate(metrics):
                xs, ys = _curve(records, metric, field)
                if not xs:
                    continue
                n_points += len(xs)
                name = label if len(metrics) == 1 else f"{label} {metric}"
                ax.plot(xs, ys, styles[m_i % len(styles)], color=color, marker="o",
                        markersize=3, label=name)
        ax.set_xlabel(_AXIS_LABELS.get(field, field))
        ax.set_ylabel(", ".join(metrics))
        ax.grid(True, alpha=0.3)
    if n_points == 0:
        raise ValueError(f"no eval points with metrics {list(metrics)} against {x!r} in "
                         f"{[str(log_path(r)) for r in run_dirs]}")
    axes[0].legend(fontsize="small")
    axes[0].set_title(f"{', '.join(metrics)} against {_AXIS_LABELS.get(x, x)}", fontsize="medium")

    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_png.parent, prefix=f".{out_png.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f, warnings.catch_warnings():
            # a run folder's name is its legend label: a character the font lacks is drawn as
            # a box, which is no reason to warn
            warnings.filterwarnings("ignore", message="Glyph .* missing from font")
            fig.savefig(f, format="png", dpi=120)
        os.replace(tmp, out_png)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    logger.info("wrote %s (%d runs, %d points)", out_png, len(runs), n_points)
    return out_png
