"""Progress bars that are silent when stderr is not a terminal (or when ``XMC_PROGRESS=0``)."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

from xmc_engine import _env


def enabled() -> bool:
    forced = _env.progress_enabled()
    if forced is not None:
        return forced
    return sys.stderr.isatty()


def bar(total=None, desc: str = "", unit: str = "it", **kwargs):
    """A tqdm bar, disabled unless :func:`enabled`."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled(), leave=False,
                dynamic_ncols=True, **kwargs)
