"""Row-range loading (datasets/shard.py): a shard equals the same rows of the whole file."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import xmc_engine.datasets.shard as shard_mod
from xmc_engine.datasets import load_xc, load_xc_rows, load_xc_shard, save_xc, shard_range

from xmc_engine.errors import DatasetFormatError

N = 257


@pytest.fixture(scope="module")
def xy():
    X = sp.random(N, 50, density=0.1, format="csr", dtype=np.float32, random_state=1)
    Y = (sp.random(N, 20, density=0.1, format="csr", random_state=2) > 0).astype(np.float32)
    return sp.csr_matrix(X), sp.csr_matrix(Y)


def _same(A, B):
    return A.shape == B.shape and (A != B).nnz == 0


@pytest.mark.parametrize("suffix", ["txt", "txt.xz", "txt.gz"])
@pytest.mark.parametrize("chunk", [7, 64, 1 << 22])
def test_rows_equal_slices_of_the_whole_file(tmp_path, xy, suffix, chunk, monkeypatch):
    monkeypatch.setattr(shard_mod, "_CHUNK", chunk)
    path = tmp_path / f"t.{suffix}"
    save_xc(path, *xy)
    Xf, Yf = load_xc(path, cache=False)
    for a, b in [(0, N), (0, 0), (N, N), (3, 4), (10, 200), (N - 1, N), (100, 100)]:
        X, Y, n = load_xc_rows(path, a, b)
        assert n == N
        assert _same(X, Xf[a:b]) and _same(Y, Yf[a:b]), (a, b)
        assert X.dtype == np.float32 and X.has_canonical_format


def test_last_line_without_newline(tmp_path, xy, monkeypatch):
    monkeypatch.setattr(shard_mod, "_CHUNK", 33)
    full = tmp_path / "t.txt"
    save_xc(full, *xy)
    path = tmp_path / "nonl.txt"
    path.write_bytes(full.read_bytes().rstrip(b"\n"))
    Xf, _ = load_xc(full, cache=False)
    for a, b in [(0, N), (250, N), (N - 1, N)]:
        assert _same(load_xc_rows(path, a, b)[0], Xf[a:b])


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_shards_cover_the_file_once(tmp_path, xy, size):
    path = tmp_path / "t.txt.xz"
    save_xc(path, *xy)
    parts = [load_xc_shard(path, r, size) for r in range(size)]
    assert [p[2] for p in parts] == [shard_range(N, r, size) for r in range(size)]
    assert _same(sp.vstack([p[0] for p in parts]).tocsr(), load_xc(path, cache=False)[0])
    lengths = [p[2][1] - p[2][0] for p in parts]
    assert max(lengths) - min(lengths) <= 1 and all(p[3] == N for p in parts)


def test_shard_range_bounds():
    assert shard_range(10, 0, 3) == (0, 3) and shard_range(10, 2, 3) == (6, 10)
    with pytest.raises(ValueError, match="rank"):
        shard_range(10, 3, 3)


def test_errors_name_file_and_line(tmp_path, xy):
    path = tmp_path / "bad.txt"
    save_xc(path, *xy)
    lines = path.read_bytes().split(b"\n")
    lines[101] = b"0 99999:1.0"  # data row 100 = line 102
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(DatasetFormatError, match=r"bad.txt line 102: feature index 99999"):
        load_xc_rows(path, 90, 110)
    load_xc_rows(path, 0, 100)  # rows outside the range are not parsed
    with pytest.raises(DatasetFormatError, match="outside"):
        load_xc_rows(path, 5, N + 1)
    short = tmp_path / "short.txt"
    short.write_bytes(b"\n".join(lines[:50]) + b"\n")
    with pytest.raises(DatasetFormatError, match="file ends after 49 rows"):
        load_xc_rows(short, 40, 60)
