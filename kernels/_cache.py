"""Numba's on-disk cache for the kernels, invalidated by an edit of any kernel module.

Numba decides whether a cached ``@njit(cache=True)`` function is still valid from the source of
the file that defines it alone. A kernel that calls a kernel of another module
(``train_step.train_step_cpu`` composes five modules' kernels; ``sampled_output`` inlines
``adagrad``'s rule) holds the callee's compiled code in its own cache entry, so after an edit of
the callee numba would load the old code for the caller, silently. Here every function defined
in this package gets a source stamp made of its own file's stamp and a hash of all the package's
modules: editing any kernel recompiles the package's cached kernels (about 20 s on the
development machine), and an unchanged package keeps loading its cache.

``install()`` (called by the package's ``__init__`` before any kernel is defined) puts locator
classes in front of numba's own; each serves only files of this package and otherwise behaves as
numba's locator of the same kind (the user's ``NUMBA_CACHE_DIR``, the in-tree ``__pycache__``,
the user-wide cache directory). It uses numba's locator protocol
(``numba.core.caching.CacheImpl._locator_classes``, ``_CacheImpl`` in older numba); where a
numba version lacks it, nothing is installed and numba's per-file rule applies.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def package_stamp(directory: Path = PACKAGE_DIR) -> str:
    """SHA-256 over the names and contents of the ``*.py`` files of ``directory`` (sorted)."""
    files = sorted(Path(directory).glob("*.py"))
    return _stamp(tuple((str(f), *_stat(f)) for f in files))


def _stat(path: Path) -> tuple[float, int]:
    st = os.stat(path)
    return st.st_mtime, st.st_size


@functools.cache
def _stamp(files: tuple) -> str:
    """The hash of ``files`` (path, mtime, size): re-read only when one of them changed."""
    h = hashlib.sha256()
    for path, _, _ in files:
        h.update(Path(path).name.encode())
        h.update(Path(path).read_bytes())
    return h.hexdigest()


def _in_package(py_file) -> bool:
    try:
        return Path(py_file).resolve().parent == PACKAGE_DIR
    except (OSError, TypeError):
        return False


def _package_locator(base):
    """``base`` (a numba locator class) for this package's files, with the package stamp."""

    class Locator(base):
        def get_source_stamp(self):
            return (super().get_source_stamp(), package_stamp())

        @classmethod
        def from_function(cls, py_func, py_file):
            return super().from_function(py_func, py_file) if _in_package(py_file) else None

    Locator.__name__ = Locator.__qualname__ = f"Kernels{base.__name__}"
    return Locator


def install() -> bool:
    """Put the package's locators in front of numba's; True when installed (idempotent)."""
    try:
        from numba.core import caching

        impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
        bases = [caching.UserProvidedCacheLocator, caching.InTreeCacheLocator,
                 caching.UserWideCacheLocator]
    except (ImportError, AttributeError):
        return False
    if any(getattr(c, "_xmc_kernels", False) for c in impl._locator_classes):
        return True
    ours = [_package_locator(b) for b in bases]
    for c in ours:
        c._xmc_kernels = True
    impl._locator_classes = ours + list(impl._locator_classes)
    return True
