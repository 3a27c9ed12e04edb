"""Argument types for argparse that refuse bad values with a message naming them (exit 2)."""

from __future__ import annotations

import argparse
import math
import os


def int_list(s: str) -> list[int]:
    """``"64,32"`` -> ``[64, 32]``."""
    try:
        return [int(v) for v in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{s!r} is not a comma-separated list of integers (e.g. 128 or 64,32)") from None


def finite_float(s: str) -> float:
    """A float that is neither NaN nor infinite."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{s!r} is not a finite number")
    return v


def lr_decay(s: str) -> float | str:
    """``--lr-decay``: a finite number, ``plateau`` or ``auto``."""
    if s in ("plateau", "auto"):
        return s
    try:
        return finite_float(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{s!r} is not a number, 'plateau' or 'auto'") from None


def neighbours(s: str) -> int | str:
    """``--neighbours``: an integer >= 0 or ``auto``."""
    if s == "auto":
        return s
    return _int_at_least(s, 0, expected="an integer or 'auto'", note=" (0: the network alone)")


def positive_float(s: str) -> float:
    """A finite float > 0."""
    v = finite_float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{s!r} must be > 0")
    return v


def positive_int(s: str) -> int:
    """An integer >= 1."""
    return _int_at_least(s, 1)


def _int_at_least(s: str, low: int, *, expected: str = "an integer", note: str = "") -> int:
    """``s`` as an integer >= ``low``; else an error saying it is not ``expected`` or must be
    ``>= low`` (``note`` after it)."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not {expected}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"{s!r} must be >= {low}{note}")
    return v


def user_path(s: str) -> str:
    """A path or name with a leading ``~`` / ``~user`` expanded; refused when it names no user
    (``pathlib`` would raise ``RuntimeError`` on it later)."""
    expanded = os.path.expanduser(s)
    if expanded.startswith("~"):
        raise argparse.ArgumentTypeError(
            f"{s!r}: no home folder for {expanded.split(os.sep, 1)[0]!r}; give the full path")
    return expanded
