"""Checkpoints and model folders: round trips, and every kind of damage refused."""

from __future__ import annotations

import json
import logging
import zipfile

import numpy as np
import pytest

from xmc_engine import checkpoint
from xmc_engine.checkpoint import (
    CheckpointManager,
    load_arrays,
    load_model_dir,
    save_arrays,
    save_model_dir,
)
from xmc_engine.errors import CheckpointError


@pytest.fixture(autouse=True)
def _never_unpickle(monkeypatch):
    """Every np.load in this module must be called with allow_pickle=False."""
    real_load = np.load

    def guarded_load(*args, **kwargs):
        assert kwargs.get("allow_pickle") is False, "np.load called without allow_pickle=False"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(checkpoint.np, "load", guarded_load)


def sample_arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "W1": rng.standard_normal((50, 8)).astype(np.float32),
        "b1": np.zeros(8, np.float32),
        "W2": np.asfortranarray(rng.standard_normal((8, 30))),
        "counts": np.arange(5, dtype=np.int64),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.array(3.5),
        "flags": np.array([True, False]),
    }


def assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k])


def test_round_trip(tmp_path):
    arrays = sample_arrays()
    meta = {"epoch": 3, "lr": 0.01, "batch_sizes": [128, 64], "name": "é"}
    path = save_arrays(tmp_path / "sub" / "a.npz", arrays, meta)
    assert path == tmp_path / "sub" / "a.npz"
    assert [p.name for p in path.parent.iterdir()] == ["a.npz"]  # no temp file left
    got, got_meta = load_arrays(path)
    assert_same(got, arrays)
    assert got_meta == meta
    # a plain npz: readable by numpy alone, with the header as JSON text
    with zipfile.ZipFile(path) as z:
        assert sorted(z.namelist()) == sorted([f"{k}.npy" for k in arrays] + ["__meta__.npy"])
    with np.load(path, allow_pickle=False) as z:
        header = json.loads(z["__meta__"].tobytes())
    assert header["format"] == "xmc-engine/arrays" and len(header["sha256"]) == 64


def test_overwrite_is_atomic_replace(tmp_path):
    path = tmp_path / "a.npz"
    save_arrays(path, {"x": np.zeros(3)}, {"v": 1})
    save_arrays(path, {"x": np.ones(4)}, {"v": 2})
    arrays, meta = load_arrays(path)
    assert meta == {"v": 2} and arrays["x"].shape == (4,)


@pytest.mark.parametrize("frac", [0.0, 0.001, 0.1, 0.35, 0.5, 0.8, 0.95, 0.999])
def test_truncated_file_refused(tmp_path, frac):
    path = save_arrays(tmp_path / "a.npz", sample_arrays(), {"epoch": 1})
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * frac)])
    with pytest.raises(CheckpointError, match="a.npz"):
        load_arrays(path)


def test_bit_flips_never_load_wrong_data(tmp_path):
    arrays, meta = sample_arrays(), {"epoch": 1}
    path = save_arrays(tmp_path / "a.npz", arrays, meta)
    data = path.read_bytes()
    rng = np.random.default_rng(0)
    positions = rng.choice(len(data), size=150, replace=False)
    refused = 0
    for pos in positions:
        bad = bytearray(data)
        bad[pos] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(bad))
        try:
            got, got_meta = load_arrays(path)
        except CheckpointError as exc:
            assert "a.npz" in str(exc)
            refused += 1
            continue
        # a flip in bytes the reader does not use (timestamps, ...) is harmless
        assert_same(got, arrays)
        assert got_meta == meta
    assert refused > 100


def test_flip_in_array_payload_refused(tmp_path):
    arrays = {"W": np.arange(1000, dtype=np.float32)}
    path = save_arrays(tmp_path / "a.npz", arrays)
    data = bytearray(path.read_bytes())
    pos = bytes(data).find(np.float32(500).tobytes())
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"a\.npz.*(CRC|checksum)"):
        load_arrays(path)


def test_checksum_catches_consistent_rewrite(tmp_path):
    # a rewritten archive with valid CRCs but altered content fails the sha256
    path = save_arrays(tmp_path / "a.npz", {"x": np.zeros(4)}, {"epoch": 1})
    with np.load(path, allow_pickle=False) as z:
        header = z["__meta__"]
    np.savez(path, x=np.ones(4), __meta__=header)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_arrays(path)


def test_object_arrays_refused(tmp_path):
    path = save_arrays(tmp_path / "evil.npz", {"x": np.zeros(2)})
    with np.load(path, allow_pickle=False) as z:
        header = z["__meta__"]
    # same names and a valid header, but x is pickled by numpy
    np.savez(path, x=np.array([{"a": 1}, None], dtype=object), __meta__=header)
    with pytest.raises(CheckpointError, match="evil.npz.*pickle"):
        load_arrays(path)
    with pytest.raises(CheckpointError, match="cannot be stored without pickle"):
        save_arrays(tmp_path / "b.npz", {"x": np.array([None], dtype=object)})


def test_foreign_and_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_arrays(tmp_path / "nope.npz")
    np.savez(tmp_path / "plain.npz", x=np.zeros(2))
    with pytest.raises(CheckpointError, match="__meta__"):
        load_arrays(tmp_path / "plain.npz")
    np.save(tmp_path / "single.npy", np.zeros(2))
    with pytest.raises(CheckpointError, match="not an .npz"):
        load_arrays(tmp_path / "single.npy")
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(CheckpointError, match="text.npz"):
        load_arrays(tmp_path / "text.npz")


def test_save_validation(tmp_path):
    with pytest.raises(CheckpointError, match="name"):
        save_arrays(tmp_path / "a.npz", {"__meta__": np.zeros(1)})
    with pytest.raises(CheckpointError, match="name"):
        save_arrays(tmp_path / "a.npz", {"a/b": np.zeros(1)})
    with pytest.raises(CheckpointError, match="JSON"):
        save_arrays(tmp_path / "a.npz", {"x": np.zeros(1)}, {"lr": float("nan")})
    with pytest.raises(CheckpointError, match="JSON"):
        save_arrays(tmp_path / "a.npz", {"x": np.zeros(1)}, {"f": object()})
    assert list(tmp_path.iterdir()) == []


def test_manager_prunes_and_numbers(tmp_path):
    mgr = CheckpointManager(tmp_path / "run", keep=2)
    assert mgr.latest_valid() is None
    for step in range(5):
        mgr.save({"epoch": step}, {"w": np.full(3, step, np.float32)})
    assert [p.name for p in mgr.paths()] == ["ckpt-00000005.npz", "ckpt-00000004.npz"]
    arrays, meta = mgr.latest_valid()
    assert meta["epoch"] == 4 and meta["seq"] == 5 and meta["path"].endswith("ckpt-00000005.npz")
    np.testing.assert_array_equal(arrays["w"], np.full(3, 4, np.float32))
    # a new manager on the same folder continues the numbering and clears stale temp files
    stale = tmp_path / "run" / ".ckpt-00000006.npz.abc123.tmp"
    stale.write_bytes(b"partial")
    mgr2 = CheckpointManager(tmp_path / "run", keep=3)
    assert not stale.exists()
    assert mgr2.save({"epoch": 5}, {"w": np.zeros(1)}).name == "ckpt-00000006.npz"
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "empty"])
def test_manager_falls_back_to_previous(tmp_path, caplog, damage):
    mgr = CheckpointManager(tmp_path, keep=3)
    for step in range(3):
        mgr.save({"epoch": step}, sample_arrays(step))
    newest = mgr.paths()[0]
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "bitflip":
        data[len(data) // 3] ^= 0x10
    else:
        data = b""
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="xmc_engine.checkpoint"):
        arrays, meta = mgr.latest_valid()
    assert meta["epoch"] == 1
    assert_same(arrays, sample_arrays(1))
    assert newest.name in caplog.text
    # every file damaged: None
    for p in mgr.paths():
        p.write_bytes(b"PK\x03\x04")
    assert mgr.latest_valid() is None


def test_model_dir_round_trip_and_replace(tmp_path):
    folder = tmp_path / "models" / "m1"
    config = {"n_hidden": 128, "labels": [1, 2], "nested": {"lr": 0.1}}
    assert save_model_dir(folder, config, sample_arrays()) == folder
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "params.npz"]
    assert json.loads((folder / "config.json").read_text()) == config
    got_config, arrays = load_model_dir(folder)
    assert got_config == config
    assert_same(arrays, sample_arrays())
    save_model_dir(folder, {"n_hidden": 64}, {"w": np.ones(2)})  # replaces the old model
    assert load_model_dir(folder)[0] == {"n_hidden": 64}
    assert sorted(p.name for p in folder.parent.iterdir()) == ["m1"]  # no temp folders left


def test_model_dir_refuses_to_clobber(tmp_path):
    other = tmp_path / "home"
    other.mkdir()
    (other / "thesis.tex").write_text("precious")
    with pytest.raises(CheckpointError, match="refusing to replace"):
        save_model_dir(other, {}, {"w": np.ones(1)})
    assert (other / "thesis.tex").read_text() == "precious"
    with pytest.raises(CheckpointError, match="JSON"):
        save_model_dir(tmp_path / "m", {"x": float("inf")}, {"w": np.ones(1)})
    assert not (tmp_path / "m").exists()


def test_model_dir_failed_save_leaves_old_model(tmp_path, monkeypatch):
    folder = tmp_path / "m"
    save_model_dir(folder, {"v": 1}, {"w": np.ones(2)})

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.np, "savez", boom)
    with pytest.raises(OSError, match="disk full"):
        save_model_dir(folder, {"v": 2}, {"w": np.zeros(2)})
    assert load_model_dir(folder)[0] == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_model_dir_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model_dir(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a folder"):
        load_model_dir(tmp_path / "file")
    folder = tmp_path / "m"
    save_model_dir(folder, {"v": 1}, {"w": np.ones(2)})
    params = (folder / "params.npz").read_bytes()

    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_model_dir(folder)
    (folder / "config.json").write_text('{"v": 1,\n "w": }')
    with pytest.raises(CheckpointError, match="invalid JSON at line 2"):
        load_model_dir(folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="JSON object"):
        load_model_dir(folder)
    (folder / "config.json").write_text('{"v": 1}')
    (folder / "params.npz").unlink()
    with pytest.raises(CheckpointError, match="params.npz is missing"):
        load_model_dir(folder)
    (folder / "params.npz").write_bytes(params[:-100])
    with pytest.raises(CheckpointError, match="params.npz"):
        load_model_dir(folder)
