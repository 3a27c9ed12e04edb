"""XC / LIBSVM / split / npz readers and writers: round trips, error messages, fuzzing, cache."""

from __future__ import annotations

import gzip
import os
import re

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xmc_engine.datasets import cache as cache_mod
from xmc_engine.datasets import (
    load_libsvm,
    load_npz,
    load_split,
    load_xc,
    save_npz,
    save_xc,
)

from xmc_engine.errors import DatasetFormatError

# ------------------------------------------------------------------ slow, obvious reference parser
_INT = re.compile(rb"[0-9]+\Z")
_FLOAT = re.compile(rb"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?\Z")
_SEP = re.compile(rb"[ \t\r]+")


class RefError(Exception):
    pass


def ref_parse(raw: bytes):
    """Pure-Python parser of the grammar in datasets/_parse.py: ``(X, Y)`` dense or RefError."""
    nl = raw.find(b"\n")
    head, body = (raw, b"") if nl < 0 else (raw[:nl], raw[nl + 1:])
    parts = head.split()
    if len(parts) != 3 or not all(_INT.match(p) for p in parts):
        raise RefError("header")
    n, d, ell = (int(p) for p in parts)
    lines = body.split(b"\n") if body else []
    if body.endswith(b"\n"):
        lines = lines[:-1]
    if len(lines) != n:
        raise RefError("row count")
    X = np.zeros((n, d), dtype=np.float32)
    Y = np.zeros((n, ell), dtype=np.float32)
    for i, line in enumerate(lines):
        if line and line[:1] not in (b" ", b"\t", b"\r"):
            m = re.match(rb"[^ \t\r]*", line)
            field, rest = m.group(0), line[m.end():]
            for tok in field.split(b","):
                if not _INT.match(tok) or int(tok) >= ell:
                    raise RefError("label")
                if Y[i, int(tok)]:
                    raise RefError("dup label")
                Y[i, int(tok)] = 1
        else:
            rest = line
        seen = set()
        for tok in _SEP.split(rest):
            if not tok:
                continue
            if b":" not in tok:
                raise RefError("colon")
            idx, val = tok.split(b":", 1)
            if not _INT.match(idx) or int(idx) >= d:
                raise RefError("feature")
            if not _FLOAT.match(val):
                raise RefError("value")
            with np.errstate(over="ignore"):
                v = np.float32(float(val))
            if not np.isfinite(v):
                raise RefError("nonfinite")
            if int(idx) in seen:
                raise RefError("dup feature")
            seen.add(int(idx))
            X[i, int(idx)] = v
    return X, Y


def assert_same(X, Y, Xr, Yr):
    assert X.has_canonical_format and Y.has_canonical_format
    assert X.dtype == np.float32 and Y.dtype == np.float32
    assert X.shape == Xr.shape and Y.shape == Yr.shape
    # structure exactly (explicit zeros are kept, so compare through the dense reference values)
    np.testing.assert_array_equal(Y.toarray(), Yr)
    np.testing.assert_allclose(X.toarray(), Xr, rtol=1e-6, atol=1e-44)
    for M in (X, Y):
        for r in range(M.shape[0]):
            row = M.indices[M.indptr[r]:M.indptr[r + 1]]
            assert np.all(np.diff(row) > 0)


def random_xy(rng, n, d, ell, density=0.3, empty_rows=True):
    X = sp.random(n, d, density=density, format="csr", dtype=np.float32, random_state=rng)
    X.data = (X.data * 10 - 3).astype(np.float32)
    Y = sp.random(n, ell, density=density, format="csr", random_state=rng)
    Y.data[:] = 1
    if empty_rows and n >= 3:
        X = X.tolil()
        Y = Y.tolil()
        X[0, :] = 0
        Y[1, :] = 0
        X[2, :] = 0
        Y[2, :] = 0
        X, Y = X.tocsr(), Y.tocsr()
        X.eliminate_zeros()
        Y.eliminate_zeros()
    return X.astype(np.float32), Y.astype(np.float32)


# ------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("suffix", [".txt", ".txt.xz", ".txt.gz", ".txt.bz2", ".npz"])
def test_round_trip(tmp_path, suffix):
    rng = np.random.default_rng(1)
    X, Y = random_xy(rng, 50, 30, 12)
    X.data[::7] = np.float32(1e-7)  # values that need more than 6 digits
    X.data[::11] = np.float32(123456789.0)
    p = save_xc(tmp_path / f"d{suffix}", X, Y)
    X2, Y2 = load_xc(p, cache=False)
    assert (X2 != X).nnz == 0 and (Y2 != Y).nnz == 0
    X.sort_indices()
    np.testing.assert_array_equal(X2.data, X.data)
    assert X2.shape == X.shape and Y2.shape == Y.shape
    assert not list(tmp_path.glob(".*tmp"))  # atomic write leaves no temp file


def test_round_trip_edge_shapes(tmp_path):
    for n, d, ell in [(0, 5, 3), (1, 1, 1), (4, 3, 2)]:
        X = sp.csr_matrix((n, d), dtype=np.float32)
        Y = sp.csr_matrix((n, ell), dtype=np.float32)
        X2, Y2 = load_xc(save_xc(tmp_path / f"e{n}.txt", X, Y), cache=False)
        assert X2.shape == (n, d) and Y2.shape == (n, ell) and X2.nnz == Y2.nnz == 0
    assert (tmp_path / "e4.txt").read_text() == "4 3 2\n\n\n\n\n"


def test_edge_cases_of_real_files(tmp_path):
    text = "4 6 5\n1,3 0:1 4:2.5\n 2:0.5\n\n4,0\n"
    p = tmp_path / "t.txt"
    p.write_text(text)
    X, Y = load_xc(p, cache=False)
    assert X.shape == (4, 6) and Y.shape == (4, 5)
    assert X.toarray()[0, [0, 4]].tolist() == [1, 2.5]
    assert Y[1].nnz == 0 and X[1].nnz == 1 and X[2].nnz == Y[2].nnz == 0
    assert Y[3].indices.tolist() == [0, 4] and X[3].nnz == 0  # unsorted labels are sorted
    Xr, Yr = ref_parse(text.encode())
    assert_same(X, Y, Xr, Yr)
    # CRLF line ends and no final newline
    p.write_bytes(b"2 3 2\r\n0 1:1\r\n1 2:2")
    X, Y = load_xc(p, cache=False)
    assert X.toarray().tolist() == [[0, 1, 0], [0, 0, 2]]


# ------------------------------------------------------------------------------ error messages
BAD = [
    ("", "line 1: missing header"),
    ("3 4\n", "line 1: bad header"),
    ("a b c\n", "line 1: bad header"),
    ("1 5 3\n0 7:1\n", "line 2: feature index 7 >= n_features 5"),
    ("1 5 3\n3 1:1\n", "line 2: label index 3 >= n_labels 3"),
    ("1 5 3\n0 -1:1\n", "line 2: negative feature index '-1'"),
    ("1 5 3\n-1 1:1\n", "line 2: negative label index '-1'"),
    ("1 5 3\n0 1:abc\n", "line 2: non-numeric value in '1:abc'"),
    ("1 5 3\n0 1:nan\n", "line 2: non-finite value in '1:nan'"),
    ("1 5 3\n0 1:1e39\n", "line 2: non-finite value in '1:1e39'"),
    ("1 5 3\n0 1:inf\n", "non-finite value"),
    ("1 5 3\n0 1:1 1:2\n", "line 2: duplicate feature index 1"),
    ("1 5 3\n0,0 1:1\n", "line 2: duplicate label index 0"),
    ("1 5 3\n0 x:1\n", "line 2: bad feature index 'x'"),
    ("1 5 3\n0 1\n", "line 2: feature token '1' is not 'index:value'"),
    ("1 5 3\n0,,1 1:1\n", "line 2: empty label"),
    ("1 5 3\n0, 1:1\n", "line 2: empty label"),
    ("1 5 3\n0 1:1\n1 2:1\n", "line 3: more rows than the header's n_samples 1"),
    ("3 5 3\n0 1:1\n1 2:1\n", "file ends after 2 rows but the header says n_samples 3"),
    ("1 5 3\n0 1:1:2\n", "non-numeric value"),
    ("1 5 3\n0 99999999999999999999999:1\n", ">= n_features 5"),
]


@pytest.mark.parametrize("text,msg", BAD)
def test_errors_name_file_line_token(tmp_path, text, msg):
    p = tmp_path / "train.txt"
    p.write_text(text)
    with pytest.raises(DatasetFormatError) as ei:
        load_xc(p, cache=False)
    assert str(ei.value).startswith("train.txt")
    assert msg in str(ei.value)
    with pytest.raises(RefError):
        ref_parse(text.encode())


def test_error_line_number_deep_in_file(tmp_path):
    rows = ["0 1:1"] * 1040 + ["0 5001:1"]
    p = tmp_path / "train.txt"
    p.write_text("1041 5000 1\n" + "\n".join(rows) + "\n")
    with pytest.raises(DatasetFormatError,
                       match=r"^train\.txt line 1042: feature index 5001 >= n_features 5000$"):
        load_xc(p, cache=False)


@pytest.mark.parametrize("suffix,opener", [(".xz", None), (".gz", None), (".bz2", None)])
def test_corrupt_compressed_stream(tmp_path, suffix, opener):
    rng = np.random.default_rng(2)
    X, Y = random_xy(rng, 200, 50, 10)
    good = save_xc(tmp_path / f"d.txt{suffix}", X, Y)
    raw = good.read_bytes()
    trunc = tmp_path / f"trunc.txt{suffix}"
    trunc.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DatasetFormatError, match=f"trunc.txt{re.escape(suffix)}: corrupt"):
        load_xc(trunc, cache=False)
    junk = tmp_path / f"junk.txt{suffix}"
    junk.write_bytes(b"this is not compressed at all\n" * 10)
    with pytest.raises(DatasetFormatError, match="corrupt"):
        load_xc(junk, cache=False)


# ------------------------------------------------------------------------------------- fuzzing
_FIXTURE_OK = [HealthCheck.function_scoped_fixture]
_ALPHABET = b"0123456789:, \n\t\r.-+eEnaif"


@st.composite
def valid_file(draw):
    n = draw(st.integers(0, 5))
    d = draw(st.integers(1, 8))
    ell = draw(st.integers(1, 6))
    lines = [f"{n} {d} {ell}"]
    for _ in range(n):
        labels = sorted(draw(st.sets(st.integers(0, ell - 1), max_size=3)))
        feats = sorted(draw(st.sets(st.integers(0, d - 1), max_size=4)))
        vals = [draw(st.sampled_from(["1", "0.5", "2", "-3.25", "1e-3", "7.", ".5", "1E2",
                                      "0", "123456.789"])) for _ in feats]
        lab = ",".join(map(str, labels))
        f = " ".join(f"{i}:{v}" for i, v in zip(feats, vals, strict=True))
        lines.append(f"{lab} {f}" if f else lab)
    return ("\n".join(lines) + "\n").encode()


@st.composite
def mutated_file(draw):
    raw = bytearray(draw(valid_file()))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["del", "ins", "rep", "dup"]))
        pos = draw(st.integers(0, max(len(raw) - 1, 0)))
        ch = draw(st.sampled_from(list(_ALPHABET)))
        if op == "del" and raw:
            del raw[pos]
        elif op == "ins":
            raw.insert(pos, ch)
        elif op == "rep" and raw:
            raw[pos] = ch
        elif op == "dup" and raw:
            raw[pos:pos] = raw[pos:pos + draw(st.integers(1, 6))]
    return bytes(raw)


@settings(max_examples=400, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(raw=mutated_file())
def test_fuzz_matches_reference_or_raises(tmp_path, raw):
    p = tmp_path / "fuzz.txt"
    p.write_bytes(raw)
    try:
        Xr, Yr = ref_parse(raw)
    except RefError:
        with pytest.raises(DatasetFormatError):
            load_xc(p, cache=False)
        return
    X, Y = load_xc(p, cache=False)
    assert_same(X, Y, Xr, Yr)


@settings(max_examples=60, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(n=st.integers(0, 12), d=st.integers(1, 20), ell=st.integers(1, 10),
       seed=st.integers(0, 2**31), suffix=st.sampled_from([".txt", ".txt.gz", ".txt.xz"]))
def test_property_round_trip(tmp_path, n, d, ell, seed, suffix):
    rng = np.random.default_rng(seed)
    X, Y = random_xy(rng, n, d, ell, density=0.4)
    X.data = rng.standard_normal(X.nnz).astype(np.float32) * np.float32(10.0) ** rng.integers(
        -8, 8, X.nnz).astype(np.float32)
    X2, Y2 = load_xc(save_xc(tmp_path / f"r{suffix}", X, Y), cache=False)
    np.testing.assert_array_equal(X2.toarray(), X.toarray())
    np.testing.assert_array_equal(Y2.toarray(), Y.toarray())


# ---------------------------------------------------------------------------- LIBSVM and splits
def test_load_libsvm(tmp_path):
    p = tmp_path / "a.svm"
    p.write_text("1,3 1:0.5 4:2\n 2:1\n0\n")
    X, Y = load_libsvm(p)
    assert X.shape == (3, 5) and Y.shape == (3, 4)
    assert X.toarray()[0].tolist() == [0, 0.5, 0, 0, 2]
    X1, Y1 = load_libsvm(p, zero_based=False)
    assert X1.shape == (3, 4) and X1.toarray()[0].tolist() == [0.5, 0, 0, 2]
    X2, Y2 = load_libsvm(p, n_features=10, n_labels=8)
    assert X2.shape == (3, 10) and Y2.shape == (3, 8)
    with pytest.raises(DatasetFormatError, match="a.svm line 1: feature index 4 >= n_features 3"):
        load_libsvm(p, n_features=3)
    p.write_text("0 0:1\n")
    with pytest.raises(DatasetFormatError, match="negative feature index"):
        load_libsvm(p, zero_based=False)
    gz = tmp_path / "b.svm.gz"
    gz.write_bytes(gzip.compress(b"2 0:1\n"))
    assert load_libsvm(gz)[1].toarray().tolist() == [[0, 0, 1]]


def test_load_split(tmp_path):
    rng = np.random.default_rng(3)
    X, Y = random_xy(rng, 10, 6, 4)
    data = save_xc(tmp_path / "Toy_data.txt", X, Y)
    (tmp_path / "tr.txt").write_text("1 10\n3 9\n5 8\n")  # 1-based, two split columns
    (tmp_path / "te.txt").write_text("2 1\n4 2\n")
    Xtr, Ytr, Xte, Yte = load_split(data, tmp_path / "tr.txt", tmp_path / "te.txt")
    assert (Xtr != X[[0, 2, 4]]).nnz == 0 and (Yte != Y[[1, 3]]).nnz == 0
    Xtr, Ytr, Xte, Yte = load_split(data, tmp_path / "tr.txt", tmp_path / "te.txt", split=1)
    assert (Xtr != X[[9, 8, 7]]).nnz == 0 and (Xte != X[[0, 1]]).nnz == 0
    (tmp_path / "bad.txt").write_text("11\n")
    with pytest.raises(DatasetFormatError, match="bad.txt line 1: row index 11 out of range"):
        load_split(data, tmp_path / "bad.txt", tmp_path / "te.txt")
    with pytest.raises(DatasetFormatError, match="split column 5"):
        load_split(data, tmp_path / "tr.txt", tmp_path / "te.txt", split=5)


def test_npz_no_pickle(tmp_path):
    rng = np.random.default_rng(4)
    X, Y = random_xy(rng, 20, 7, 5)
    p = save_npz(tmp_path / "a.npz", X, Y)
    X2, Y2 = load_npz(p)
    assert (X2 != X).nnz == 0 and (Y2 != Y).nnz == 0
    np.savez(tmp_path / "evil.npz", X_data=np.array([object()], dtype=object))
    with pytest.raises(DatasetFormatError):
        load_npz(tmp_path / "evil.npz")


# ------------------------------------------------------------------------------------------ cache
def _write_big(tmp_path, n=30000):
    rng = np.random.default_rng(5)
    X = sp.random(n, 2000, density=0.02, format="csr", dtype=np.float32, random_state=rng)
    Y = sp.random(n, 300, density=0.01, format="csr", random_state=rng)
    Y.data[:] = 1
    return save_xc(tmp_path / "big.txt", X, Y), X, Y


def test_cache_hit_does_not_parse(tmp_path, monkeypatch):
    """A second load comes from the cache without reading the text (the speed-up it buys is
    measured by bench/bench_reliability_timing.py)."""
    import xmc_engine.datasets.io as io_module

    monkeypatch.setenv("XMC_CACHE_DIR", str(tmp_path / "cache"))
    p, X, Y = _write_big(tmp_path, n=2000)
    X1, Y1 = load_xc(p)  # parse + write cache
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1

    def no_parse(*args, **kwargs):
        raise AssertionError("a cache hit parsed the text file")

    monkeypatch.setattr(io_module, "read_xc", no_parse)
    X2, Y2 = load_xc(p)
    assert (X2 != X1).nnz == 0 and (Y2 != Y1).nnz == 0 and X2.has_canonical_format
    assert (X2 != X).nnz == 0 and (Y2 != Y).nnz == 0


def test_cache_stale_and_corrupt_are_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("XMC_CACHE_DIR", str(tmp_path / "cache"))
    p = tmp_path / "d.txt"
    p.write_text("2 3 2\n0 1:1\n1 2:1\n")
    assert load_xc(p)[0].toarray()[0, 1] == 1
    (cpath,) = (tmp_path / "cache").glob("*.npz")
    # same size, new content, same mtime: the content hash catches it
    st_ = p.stat()
    p.write_text("2 3 2\n0 1:7\n1 2:1\n")
    os.utime(p, ns=(st_.st_atime_ns, st_.st_mtime_ns))
    assert load_xc(p)[0].toarray()[0, 1] == 7
    cpath.write_bytes(b"garbage, not a zip file")
    assert load_xc(p)[0].toarray()[0, 1] == 7
    with np.load(cpath, allow_pickle=False) as z:  # rebuilt
        assert int(z["src_size"]) == p.stat().st_size


def test_cache_beside_file_and_readonly_fallback(tmp_path, monkeypatch):
    monkeypatch.delenv("XMC_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    ro = tmp_path / "ro"
    ro.mkdir()
    p = ro / "d.txt"
    p.write_text("1 3 2\n0 1:1\n")
    load_xc(p)
    assert len(list(ro.glob("*.xmc.npz"))) == 1  # beside the file
    for f in ro.glob("*.xmc.npz"):
        f.unlink()
    ro.chmod(0o555)  # read-only folder (also for root: no write bits)
    try:
        load_xc(p)
        assert not list(ro.glob("*.npz"))
        assert len(list((tmp_path / "home" / ".cache" / "xmc-engine").glob("*.npz"))) == 1
        assert load_xc(p)[0].nnz == 1
    finally:
        ro.chmod(0o755)
    assert cache_mod.cache_candidates(p)[1].parent == tmp_path / "home" / ".cache" / "xmc-engine"
