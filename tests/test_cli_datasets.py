"""``xmc-engine datasets ...`` through a subprocess, and its argument parsing alone."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from xmc_engine.datasets import load_xc, save_xc

from tests._helpers import run_cli
from xmc_engine.cli.datasets import parse_args


def run(*args, env_extra=None):
    return run_cli("datasets", *args, env=env_extra, check=False, timeout=120)


def test_parse_args():
    a = parse_args(["fetch", "EURLex-4K", "--url", "http://127.0.0.1/x", "--sha256", "ab"])
    assert (a.name, a.url, a.sha256, a.timeout) == ("EURLex-4K", "http://127.0.0.1/x", "ab", 10.0)
    a = parse_args(["convert", "in.txt", "out.npz", "--input-format", "libsvm"])
    assert a.input.name == "in.txt" and a.output.suffix == ".npz"


def test_cli_info_convert_list(tmp_path):
    rng = np.random.default_rng(0)
    X = sp.random(40, 9, density=0.3, format="csr", dtype=np.float32, random_state=rng)
    Y = sp.random(40, 5, density=0.3, format="csr", random_state=rng)
    Y.data[:] = 1
    src = save_xc(tmp_path / "train.txt.gz", X, Y)
    env = {"XMC_CACHE_DIR": str(tmp_path / "cache"), "XMC_DATA_DIR": str(tmp_path)}
    r = run("info", str(src), env_extra=env)
    assert r.returncode == 0, r.stderr
    assert "train: 40 samples, 9 features, 5 labels" in r.stdout
    assert "avg nnz/row" in r.stdout and "top 1% of labels" in r.stdout
    assert "rows without labels" in r.stdout
    r = run("convert", str(src), str(tmp_path / "out.txt.bz2"), env_extra=env)
    assert r.returncode == 0, r.stderr
    X2, Y2 = load_xc(tmp_path / "out.txt.bz2", cache=False)
    assert (X2 != X).nnz == 0 and (Y2 != Y).nnz == 0
    r = run("convert", str(tmp_path / "out.txt.bz2"), str(tmp_path / "out.npz"), env_extra=env)
    assert r.returncode == 0 and (tmp_path / "out.npz").exists()
    r = run("list", env_extra=env)
    assert r.returncode == 0 and "Amazon-670K" in r.stdout and "synthetic" in r.stdout


def test_cli_errors_are_clean(tmp_path):
    bad = tmp_path / "train.txt"
    bad.write_text("1 5 3\n0 7:1\n")
    r = run("info", str(bad), env_extra={"XMC_CACHE_DIR": str(tmp_path / "c")})
    assert r.returncode == 2
    assert "train.txt line 2: feature index 7 >= n_features 5" in r.stderr
    assert "Traceback" not in r.stderr
    r = run("fetch", "Delicious-200K", env_extra={"XMC_DOWNLOAD_DIR": str(tmp_path / "dl")})
    assert r.returncode == 2 and "by hand" in r.stderr and "Traceback" not in r.stderr


def test_cli_info_real(data_dir, tmp_path):
    r = run("info", "bibtex", env_extra={"XMC_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "train: 4880 samples, 1836 features, 159 labels" in r.stdout
    assert "test: 2515 samples" in r.stdout
