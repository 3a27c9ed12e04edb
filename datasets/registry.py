"""Named data sets: local folders, XC-repository benchmarks and synthetic presets, and loading.

Three kinds of name:

- ``local``: every subfolder of ``XMC_DATA_DIR`` (default ``../shared/data``) holding
  ``train.txt[.xz|.gz|.bz2]`` (and usually ``test.txt...``). The eight data sets documented in
  that folder's README carry their published counts as expected statistics.
- ``remote``: XC-repository benchmarks with their published statistics (n_train, n_test,
  n_features, n_labels, labels per point). ``fetch`` puts them under ``XMC_DOWNLOAD_DIR/<name>``
  where :func:`resolve` then finds the ``*train*.txt`` / ``*test*.txt`` files.
- ``synthetic``: ``synthetic`` (= ``synthetic-default``), ``synthetic-amazon670k``,
  ``synthetic-delicious200k``: :func:`~xmc_engine.datasets.synthetic.make_synthetic` presets.

Names match case-insensitively and ignoring ``-``, ``_`` and ``.``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

from xmc_engine import _env
from xmc_engine.errors import DatasetFormatError, XMCError

from .io import load_libsvm, load_npz, load_xc, looks_like_xc, read_head
from .synthetic import PRESETS, make_synthetic

logger = logging.getLogger(__name__)

_SUFFIXES = ("", ".xz", ".gz", ".bz2")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What the registry knows about a data set (counts are the published / expected ones).

    Attributes
    ----------
    name : str
        Canonical name.
    kind : {"local", "remote", "synthetic"}
    n_train, n_test, n_features, n_labels : int or None
    avg_nnz, avg_labels : float or None
        Average features / labels per train point, where published.
    train_path, test_path : Path or None
        Files on this machine (local, or remote once fetched).
    url, sha256 : str or None
        Download location and expected checksum (``None`` where unknown; see ``note``).
    page : str or None
        Human-readable page to download from by hand.
    note : str
    """

    name: str
    kind: str
    n_train: int | None = None
    n_test: int | None = None
    n_features: int | None = None
    n_labels: int | None = None
    avg_nnz: float | None = None
    avg_labels: float | None = None
    train_path: Path | None = None
    test_path: Path | None = None
    url: str | None = None
    sha256: str | None = None
    page: str | None = None
    note: str = ""


# Counts from ../shared/data/README.md (avg_nnz / avg_labels: train split).
_LOCAL_STATS = {
    "bibtex": (4880, 2515, 1836, 159, 68.49, 2.38),
    "delicious": (12920, 3185, 500, 983, 18.54, 19.05),
    "corel5k": (4500, 500, 499, 374, 8.2, 3.52),
    "stackex_cooking": (8393, 2098, 577, 400, 16.0, 2.22),
    "stackex_cs": (7416, 1854, 635, 274, 20.0, 2.56),
    "rcv1sub1": (4800, 1200, 47236, 101, 77.4, 2.90),
    "imdb": (96735, 24184, 1001, 28, 19.4, 2.00),
    "debian_debtags": (24215, 6088, 29261, 590, 47.4, 3.70),
}

_XC_PAGE = "http://manikvarma.org/downloads/XC/XMLRepository.html"
_GDRIVE = "https://drive.google.com/uc?export=download&id="
_MIRROR_NOTE = ("URL: napkinXC's mirror of the XC-repository BoW archive on Google Drive (large "
                "files may need a browser confirmation; then download by hand); no sha256 "
                "published")
# (name, n_train, n_test, n_features, n_labels, avg_nnz, avg_labels, url): counts and labels per
# point from the XC repository page; avg_nnz (approximate) only where DESIGN.md section 7 gives it.
_REMOTE = [
    ("EURLex-4K", 15539, 3809, 5000, 3993, None, 5.31,
     _GDRIVE + "1xWW1UykQBTD2IorVn7V8XubJatQDScol"),
    ("Wiki10-31K", 14146, 6616, 101938, 30938, None, 8.52,
     _GDRIVE + "1WbxhKvvBSynX5_Sf6OaPReTMs8K6bZ8u"),
    ("AmazonCat-13K", 1186239, 306782, 203882, 13330, None, 5.04,
     _GDRIVE + "1WvBWF9hH5ZlFcpCRhp8wLVGwdeGZXKD2"),
    ("Delicious-200K", 196606, 100095, 782585, 205443, 301.0, 75.54, None),
    ("WikiLSHTC-325K", 1778351, 587084, 1617899, 325056, None, 3.19,
     _GDRIVE + "1Y5xEJu-j3M7voyFV5Ouq9Wl3vyd9fus2"),
    ("Amazon-670K", 490449, 153025, 135909, 670091, 75.7, 5.45,
     _GDRIVE + "1d5EMgVxjjDBGjw7M09gaygx5wSt4-AqQ"),
    ("Amazon-3M", 1717899, 742507, 337067, 2812281, None, 36.04,
     _GDRIVE + "1tepPa5oOSp7jmih7LTEemHOL9KwdBtuB"),
]


def _norm(name: str) -> str:
    return re.sub(r"[-_.\s]", "", name.lower())


def _find(folder: Path, stem: str) -> Path | None:
    for s in _SUFFIXES:
        p = folder / f"{stem}.txt{s}"
        if p.is_file():
            return p
    return None


_TRAIN_RE = re.compile(r"(^|[_.\-])(train|trn)([_.\-][^/]*)?\.txt(\.(xz|gz|bz2))?$", re.I)
_TEST_RE = re.compile(r"(^|[_.\-])(test|tst)([_.\-][^/]*)?\.txt(\.(xz|gz|bz2))?$", re.I)


def _find_fetched(folder: Path) -> tuple[Path | None, Path | None]:
    """``*train*.txt`` / ``*test*.txt`` anywhere under a fetched folder (shortest path wins)."""
    if not folder.is_dir():
        return None, None
    files = sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: len(p.parts))
    train = next((p for p in files if _TRAIN_RE.search(p.name)), None)
    test = next((p for p in files if _TEST_RE.search(p.name)), None)
    return train, test


def _local_infos() -> list[DatasetInfo]:
    root = _env.data_dir()
    if root is None or not root.is_dir():
        return []
    out = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        train = _find(sub, "train")
        if train is None:
            continue
        test = _find(sub, "test")
        stats = _LOCAL_STATS.get(sub.name)
        if stats is not None:
            n_train, n_test, d, l_, nnz, lab = stats
            note = f"counts from {root / 'README.md'}"
        else:
            n_train = n_test = nnz = lab = None
            d = l_ = None
            note = "local folder (counts read from the file headers by 'info')"
        out.append(DatasetInfo(sub.name, "local", n_train, n_test, d, l_, nnz, lab,
                               train_path=train, test_path=test, note=note))
    return out


def _remote_infos() -> list[DatasetInfo]:
    out = []
    for name, n_train, n_test, d, l_, nnz, lab, url in _REMOTE:
        train, test = _find_fetched(_env.download_dir() / name)
        note = _MIRROR_NOTE if url else ("no public direct-download URL known: download the BoW "
                                         "archive by hand from the XC repository page")
        out.append(DatasetInfo(name, "remote", n_train, n_test, d, l_, nnz, lab,
                               train_path=train, test_path=test, url=url, sha256=None,
                               page=_XC_PAGE, note=note))
    return out


def _synthetic_infos() -> list[DatasetInfo]:
    out = []
    for preset, p in PRESETS.items():
        name = "synthetic" if preset == "default" else f"synthetic-{preset}"
        out.append(DatasetInfo(name, "synthetic", p.n_train, p.n_test, p.n_features, p.n_labels,
                               p.avg_nnz, p.avg_labels,
                               note=f"make_synthetic({preset!r}): {p.note}"))
    return out


def list_datasets() -> list[DatasetInfo]:
    """Every known data set: local ones first, then remote benchmarks, then synthetic presets."""
    return _local_infos() + _remote_infos() + _synthetic_infos()


def find_dataset_info(name: str) -> DatasetInfo | None:
    """The :class:`DatasetInfo` of a registered name (case and punctuation ignored), or None."""
    key = _norm(name)
    if key == "syntheticdefault":
        key = "synthetic"
    for info in list_datasets():
        if _norm(info.name) == key:
            return info
    return None


def get_dataset_info(name: str) -> DatasetInfo:
    """The :class:`DatasetInfo` of a registered name; ``KeyError`` naming the known ones."""
    info = find_dataset_info(name)
    if info is None:
        known = ", ".join(i.name for i in list_datasets())
        raise KeyError(f"unknown dataset {name!r}; known: {known}")
    return info


def resolve(path_or_name) -> tuple[Path, Path | None]:
    """``(train_path, test_path_or_None)`` for a file, a folder or a registered name.

    A file gives ``(file, None)``; a folder must hold ``train.txt[.xz|.gz|.bz2]`` (and may hold
    ``test.txt...``); a name is looked up in the registry (a remote one must be fetched first).
    Synthetic names have no files: use :func:`load_dataset`.

    Raises
    ------
    XMCError
        When nothing matches, with what to do about it.
    """
    p = Path(path_or_name).expanduser()
    if p.is_file():
        return p, None
    if p.is_dir():
        train = _find(p, "train")
        if train is None:
            train, test = _find_fetched(p)
            if train is None:
                raise XMCError(f"folder {p} holds no train.txt[.xz|.gz|.bz2]")
            return train, test
        return train, _find(p, "test")
    info = find_dataset_info(str(path_or_name))
    if info is None:
        known = ", ".join(i.name for i in list_datasets())
        raise XMCError(f"{path_or_name!r} is neither a file, a folder nor a known dataset "
                       f"(known: {known})")
    if info.kind == "synthetic":
        raise XMCError(f"{info.name!r} is generated, not stored: use load_dataset({info.name!r})")
    if info.train_path is None:
        raise XMCError(f"dataset {info.name!r} is not on this machine: run "
                       f"'xmc-engine datasets fetch {info.name}' (or download it by hand from "
                       f"{info.page or info.url} and unpack it into "
                       f"{_env.download_dir() / info.name})")
    return info.train_path, info.test_path


def load_file(path, *, cache: bool = True):
    """Load one file of any supported format: ``.npz``, XC (header sniffed) or LIBSVM."""
    path = Path(path)
    if path.suffix.lower() == ".npz":
        return load_npz(path)
    head = read_head(path)
    if looks_like_xc(head):
        return load_xc(path, cache=cache)
    try:
        return load_libsvm(path)
    except DatasetFormatError as exc:
        first = head.split(b"\n", 1)[0].decode("utf-8", "replace").strip()
        if " line 1:" in str(exc) and first and all(t.isdigit() for t in first.split()):
            # a header that is not one: say why the file was not read as XC
            raise DatasetFormatError(
                f"{exc} (read as LIBSVM: line 1 {first[:80]!r} is not an XC header, which is "
                f"three integers 'n_samples n_features n_labels')") from exc
        raise


def _sniff_xc(path: Path) -> bool:
    return looks_like_xc(read_head(path))


def load_dataset(path_or_name, *, cache: bool = True, seed: int = 0):
    """``(X_train, Y_train, X_test, Y_test)`` for a file, a folder or a registered name.

    Parameters
    ----------
    path_or_name : str or Path
        See :func:`resolve`; synthetic names call :func:`make_synthetic` with ``seed``.
    cache : bool
        Passed to :func:`load_xc`.

    Returns
    -------
    X_train, Y_train : scipy.sparse.csr_matrix
    X_test, Y_test : scipy.sparse.csr_matrix or None
        ``None`` when only a single file was given.
    """
    name = str(path_or_name)
    info = None if Path(name).expanduser().exists() else find_dataset_info(name)
    if info is not None and info.kind == "synthetic":
        preset = "default" if info.name == "synthetic" else info.name[len("synthetic-"):]
        return make_synthetic(preset, seed=seed)
    train, test = resolve(path_or_name)
    X_tr, Y_tr = load_file(train, cache=cache)
    if test is None:
        return X_tr, Y_tr, None, None
    X_te, Y_te = load_file(test, cache=cache)
    if X_tr.shape[1] != X_te.shape[1] or Y_tr.shape[1] != Y_te.shape[1]:
        if _sniff_xc(train) and _sniff_xc(test):
            raise DatasetFormatError(
                f"{train.name} and {test.name} disagree on the header: n_features "
                f"{X_tr.shape[1]} vs {X_te.shape[1]}, n_labels {Y_tr.shape[1]} vs "
                f"{Y_te.shape[1]}")
        # LIBSVM widths come from the largest index seen: widen both to the common width.
        d = max(X_tr.shape[1], X_te.shape[1])
        ell = max(Y_tr.shape[1], Y_te.shape[1])
        for M, w in ((X_tr, d), (X_te, d), (Y_tr, ell), (Y_te, ell)):
            M.resize((M.shape[0], w))
    return X_tr, Y_tr, X_te, Y_te


def header_counts(path) -> tuple[int, int, int] | None:
    """``(n_samples, n_features, n_labels)`` from an XC header, or ``None`` if not XC."""
    head = read_head(path)
    if not looks_like_xc(head):
        return None
    return tuple(int(v) for v in head.split(b"\n", 1)[0].split())


