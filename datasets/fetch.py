"""Download a data set archive over HTTP(S), verify its sha256 and unpack it, atomically.

No pickle, no third-party client: ``urllib`` with a short connect timeout, so that an offline
machine fails at once with a message saying where to get the file by hand and where to put it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

from xmc_engine import _env, progress
from xmc_engine.errors import FetchError

logger = logging.getLogger(__name__)

XC_REPOSITORY = "http://manikvarma.org/downloads/XC/XMLRepository.html"


def fetch(name: str, *, url: str | None = None, dest=None, sha256: str | None = None,
          timeout: float = 10.0) -> Path:
    """Download data set ``name`` into ``dest`` and unpack it.

    Parameters
    ----------
    name : str
        A registry name (its URL and checksum are used unless given) or any new name.
    url : str, optional
        Where to download from; overrides the registry's.
    dest : str or Path, optional
        Folder that receives the unpacked files; default ``XMC_DOWNLOAD_DIR/<name>``
        (``~/.cache/xmc-engine/<name>``). Replaced atomically on success.
    sha256 : str, optional
        Expected hex digest of the downloaded file; overrides the registry's. A mismatch leaves
        nothing behind.
    timeout : float
        Seconds to wait for the connection and for each read.

    Returns
    -------
    Path
        ``dest``. Zip and tar(.gz/.bz2/.xz) archives are unpacked into it; any other file is
        stored in it under its URL's file name.

    Raises
    ------
    FetchError
        With the URL, the reason and where to put a hand-downloaded copy.
    """
    from .registry import find_dataset_info

    info = find_dataset_info(name)
    key = info.name if info is not None else name
    if url is None and info is not None:
        url = info.url
    if sha256 is None and info is not None and url == info.url:
        sha256 = info.sha256
    dest = Path(dest) if dest is not None else _env.download_dir() / key
    page = (info.page if info is not None and info.page else None) or url or XC_REPOSITORY
    manual = (f"Download it by hand from {page} and unpack it into {dest} "
              f"(or set XMC_DOWNLOAD_DIR, or pass --dest)")
    if not url:
        raise FetchError(f"no download URL is known for {key!r}. {manual}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        digest, content_type = _download(url, tmp, timeout, manual)
        if sha256 and digest != sha256.lower():
            raise FetchError(f"sha256 mismatch for {url}: expected {sha256.lower()}, got "
                             f"{digest}; the download was discarded. {manual}")
        if not sha256:
            logger.warning("no sha256 known for %s; downloaded file has sha256 %s", url, digest)
        if "text/html" in content_type and not _is_archive(tmp):
            raise FetchError(f"{url} returned an HTML page, not a data file (a sign-in or "
                             f"confirmation page?). {manual}")
        _unpack_into(tmp, url, dest)
    except FetchError:
        raise
    except (OSError, tarfile.TarError, zipfile.BadZipFile) as exc:
        raise FetchError(f"could not unpack {url}: {exc}. {manual}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("fetched %s into %s", url, dest)
    return dest


def _download(url: str, tmp: Path, timeout: float, manual: str) -> tuple[str, str]:
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("http", "https", "file"):
        raise FetchError(f"unsupported URL scheme {scheme!r} in {url!r}. {manual}")
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (scheme checked)
            total = resp.headers.get("Content-Length")
            content_type = resp.headers.get("Content-Type", "") or ""
            with open(tmp, "wb") as out, progress.bar(
                    total=int(total) if total and total.isdigit() else None,
                    desc=f"fetch {Path(urllib.parse.urlsplit(url).path).name}", unit="B",
                    unit_scale=True) as pbar:
                while True:
                    chunk = resp.read(1 << 20)
                    if not chunk:
                        break
                    out.write(chunk)
                    h.update(chunk)
                    pbar.update(len(chunk))
    except urllib.error.HTTPError as exc:
        raise FetchError(f"could not download {url}: HTTP {exc.code} {exc.reason}. "
                         f"{manual}") from exc
    except (TimeoutError, urllib.error.URLError, ConnectionError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FetchError(f"could not download {url} (offline or unreachable: {reason}). "
                         f"{manual}") from exc
    return h.hexdigest(), content_type


def _is_archive(path: Path) -> bool:
    return zipfile.is_zipfile(path) or tarfile.is_tarfile(path)


def _unpack_into(src: Path, url: str, dest: Path) -> None:
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".unpack", dir=dest.parent))
    try:
        if zipfile.is_zipfile(src):
            with zipfile.ZipFile(src) as zf:
                for member in zf.namelist():
                    _check_member(member)
                zf.extractall(stage)
        elif tarfile.is_tarfile(src):
            with tarfile.open(src) as tf:
                for member in tf.getmembers():
                    _check_member(member.name)
                    if not (member.isfile() or member.isdir()):
                        raise FetchError(f"{url}: archive member {member.name!r} is a link or "
                                         "device; refusing to unpack")
                tf.extractall(stage, filter="data")
        else:
            fname = Path(urllib.parse.urlsplit(url).path).name or "download"
            shutil.copyfile(src, stage / fname)
        old = None
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(dest, old)
        os.replace(stage, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _check_member(name: str) -> None:
    p = Path(name)
    if p.is_absolute() or ".." in p.parts:
        raise FetchError(f"archive member {name!r} would be written outside the target folder")
