"""Registry (names, resolve, load_dataset) and fetch against a local http.server on 127.0.0.1."""

from __future__ import annotations

import hashlib
import http.server
import io
import socket
import tarfile
import threading
import zipfile

import numpy as np
import pytest
import scipy.sparse as sp
from xmc_engine.datasets import (
    FetchError,
    fetch,
    get_dataset_info,
    list_datasets,
    load_dataset,
    resolve,
    save_xc,
)

from xmc_engine.errors import XMCError

REMOTE = {  # XC repository: n_train, n_test, n_features, n_labels
    "EURLex-4K": (15539, 3809, 5000, 3993),
    "Wiki10-31K": (14146, 6616, 101938, 30938),
    "AmazonCat-13K": (1186239, 306782, 203882, 13330),
    "Delicious-200K": (196606, 100095, 782585, 205443),
    "WikiLSHTC-325K": (1778351, 587084, 1617899, 325056),
    "Amazon-670K": (490449, 153025, 135909, 670091),
    "Amazon-3M": (1717899, 742507, 337067, 2812281),
}


@pytest.fixture
def local_root(tmp_path, monkeypatch):
    """A private data folder with one dataset, and private download/cache folders."""
    root = tmp_path / "data"
    (root / "toy").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 30), ("test", 10)):
        X = sp.random(n, 8, density=0.3, format="csr", dtype=np.float32, random_state=rng)
        Y = sp.random(n, 4, density=0.3, format="csr", random_state=rng)
        Y.data[:] = 1
        save_xc(root / "toy" / f"{split}.txt.xz", X, Y)
    monkeypatch.setenv("XMC_DATA_DIR", str(root))
    monkeypatch.setenv("XMC_DOWNLOAD_DIR", str(tmp_path / "dl"))
    monkeypatch.setenv("XMC_CACHE_DIR", str(tmp_path / "cache"))
    return root


def test_registry_lists_all_kinds(local_root):
    infos = {i.name: i for i in list_datasets()}
    assert infos["toy"].kind == "local" and infos["toy"].train_path.name == "train.txt.xz"
    for name, counts in REMOTE.items():
        i = infos[name]
        assert i.kind == "remote" and (i.n_train, i.n_test, i.n_features, i.n_labels) == counts
        assert i.url or "by hand" in i.note
    for name in ("synthetic", "synthetic-amazon670k", "synthetic-delicious200k"):
        assert infos[name].kind == "synthetic"
    assert get_dataset_info("amazon670k").name == "Amazon-670K"  # lenient matching
    assert get_dataset_info("SYNTHETIC-Amazon670K").n_labels == 670091
    with pytest.raises(KeyError, match="unknown dataset 'nope'"):
        get_dataset_info("nope")


def test_resolve_and_load(local_root, tmp_path):
    train, test = resolve("toy")
    assert train == local_root / "toy" / "train.txt.xz" and test.name == "test.txt.xz"
    assert resolve(local_root / "toy") == (train, test)
    assert resolve(train) == (train, None)
    Xtr, Ytr, Xte, Yte = load_dataset("toy")
    assert Xtr.shape == (30, 8) and Yte.shape == (10, 4)
    with pytest.raises(XMCError, match="not on this machine.*datasets fetch Amazon-670K"):
        resolve("Amazon-670K")
    with pytest.raises(XMCError, match="neither a file, a folder nor a known dataset"):
        resolve("does-not-exist")
    with pytest.raises(XMCError, match="generated"):
        resolve("synthetic")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(XMCError, match="holds no train.txt"):
        resolve(empty)


def test_load_dataset_synthetic():
    a = load_dataset("synthetic")
    assert [m.shape for m in a] == [(20000, 5000), (20000, 2000), (5000, 5000), (5000, 2000)]


def test_load_dataset_libsvm_pair_widened(tmp_path):
    (tmp_path / "train.txt").write_text("0 3:1\n1 0:1\n")
    (tmp_path / "test.txt").write_text("2 5:1\n")
    Xtr, Ytr, Xte, Yte = load_dataset(tmp_path)
    assert Xtr.shape == (2, 6) == (Xtr.shape[0], Xte.shape[1]) and Ytr.shape == (2, 3)


@pytest.mark.parametrize("first, hinted", [("3 5", True), ("3 5 4 2", True),
                                           ("0 3:1", False)])
def test_a_bad_first_line_read_as_libsvm_says_why(tmp_path, first, hinted):
    """A first line of integers that is not three of them was meant as an XC header: the
    LIBSVM error on it says that the file was read as LIBSVM, and why."""
    from xmc_engine.datasets.registry import load_file

    from xmc_engine.errors import DatasetFormatError

    path = tmp_path / "data.txt"
    path.write_text(first + "\n0,1 0:1\n" + "1 x:1\n")
    with pytest.raises(DatasetFormatError) as info:
        load_file(path)
    msg = str(info.value)
    assert msg.startswith("data.txt line ")
    assert ("read as LIBSVM: line 1 " + repr(first) + " is not an XC header" in msg) == hinted


# ------------------------------------------------------------------------------------------ fetch
class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_root(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    handler = lambda *a, **k: _Quiet(*a, directory=str(root), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _toy_files():
    return {"Toy/train.txt": b"2 3 2\n0 1:1\n1 2:0.5\n", "Toy/test.txt": b"1 3 2\n1 0:1\n"}


def test_fetch_zip_good_checksum(http_root, tmp_path, monkeypatch):
    monkeypatch.setenv("XMC_CACHE_DIR", str(tmp_path / "cache"))
    root, base = http_root
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in _toy_files().items():
            zf.writestr(name, data)
    (root / "toy.zip").write_bytes(buf.getvalue())
    digest = hashlib.sha256(buf.getvalue()).hexdigest()
    dest = fetch("toy", url=f"{base}/toy.zip", dest=tmp_path / "dl" / "toy", sha256=digest)
    assert (dest / "Toy" / "train.txt").read_bytes() == _toy_files()["Toy/train.txt"]
    Xtr, Ytr, Xte, Yte = load_dataset(dest)
    assert Xtr.shape == (2, 3) and Xte.shape == (1, 3)
    assert [p.name for p in (tmp_path / "dl").iterdir()] == ["toy"]  # no temp files left


def test_fetch_tar_gz_and_plain_file(http_root, tmp_path):
    root, base = http_root
    with tarfile.open(root / "toy.tar.gz", "w:gz") as tf:
        for name, data in _toy_files().items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    dest = fetch("toy", url=f"{base}/toy.tar.gz", dest=tmp_path / "t")
    assert (dest / "Toy" / "test.txt").exists()
    (root / "train.txt").write_bytes(_toy_files()["Toy/train.txt"])
    dest = fetch("toy", url=f"{base}/train.txt", dest=tmp_path / "t")  # replaces the folder
    assert sorted(p.name for p in dest.iterdir()) == ["train.txt"]


def test_fetch_bad_checksum_leaves_nothing(http_root, tmp_path):
    root, base = http_root
    (root / "toy.zip").write_bytes(b"PK not really")
    dest = tmp_path / "dl" / "toy"
    with pytest.raises(FetchError, match="sha256 mismatch"):
        fetch("toy", url=f"{base}/toy.zip", dest=dest, sha256="0" * 64)
    assert not dest.exists()
    assert list((tmp_path / "dl").iterdir()) == []


def test_fetch_unreachable_fails_fast_with_instructions(tmp_path):
    with socket.socket() as s:  # a port on 127.0.0.1 that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dest = tmp_path / "dl" / "EURLex-4K"
    with pytest.raises(FetchError) as ei:  # how fast: bench/bench_reliability_timing.py
        fetch("EURLex-4K", url=f"http://127.0.0.1:{port}/eurlex.zip", dest=dest, timeout=2)
    msg = str(ei.value)
    assert "unreachable" in msg and "by hand" in msg and str(dest) in msg
    assert not dest.exists() and list((tmp_path / "dl").iterdir()) == []


def test_fetch_404_and_no_url(http_root, tmp_path, monkeypatch):
    monkeypatch.setenv("XMC_DOWNLOAD_DIR", str(tmp_path / "dl"))
    _, base = http_root
    with pytest.raises(FetchError, match="HTTP 404"):
        fetch("x", url=f"{base}/missing.zip", dest=tmp_path / "x")
    with pytest.raises(FetchError, match="no download URL.*Delicious-200K"):
        fetch("Delicious-200K")
