"""Benchmark the XC text loader against napkinXC, and the binary cache against parsing.

For each file (default: the largest train files of ../shared/data, decompressed to a temporary
folder so that both loaders read the same plain text): check that our ``load_xc`` equals
``napkinxc.datasets.load_libsvm_file``, then time both (best of ``--repeat``), then time a first
load through the cache (parse + cache write) against cached loads. Also times the cache key's
sampled hash against a full-file blake2b. Prints one line per file and writes
``bench/results/loader.json`` with the command, git commit and machine.

Run: ``python bench/bench_loader.py [--files PATH ...] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import hashlib
import lzma
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from xmc_engine.datasets import load_xc
from xmc_engine.datasets.cache import source_key

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

DEFAULT = ["imdb/train.txt.xz", "debian_debtags/train.txt.xz", "rcv1sub1/train.txt.xz"]


def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def napkin_load(path: Path):
    from napkinxc.datasets import load_libsvm_file

    return load_libsvm_file(str(path), labels_format="csr_matrix", sort_indices=True)


def check_equal(X, Y, Xn, Yn, name: str) -> None:
    """Same rows, same non-zeros (napkinXC sizes columns by the largest index seen)."""
    assert Xn.shape[0] == X.shape[0] and Yn.shape[0] == Y.shape[0], name
    for ours, theirs, what in ((X, Xn, "X"), (Y, Yn, "Y")):
        theirs = theirs.tocsr()
        theirs.sort_indices()
        assert np.array_equal(ours.indptr, theirs.indptr), f"{name}: {what} indptr differs"
        assert np.array_equal(ours.indices, theirs.indices), f"{name}: {what} indices differ"
        if what == "X":
            np.testing.assert_allclose(ours.data, theirs.data, rtol=1e-6,
                                       err_msg=f"{name}: X values differ")


def hash_times(path: Path, repeat: int) -> tuple[float, float]:
    def full():
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)

    return best_of(lambda: source_key(path), repeat), best_of(full, repeat)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", nargs="*", type=Path, help="XC files (default: largest local)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=_common.RESULTS_DIR / "loader.json")
    ap.add_argument("--skip-napkinxc", action="store_true")
    args = ap.parse_args(argv)

    files = args.files
    if not files:
        root = _common.data_dir()
        files = [root / f for f in DEFAULT if (root / f).exists()]
        if not files:
            ap.error(f"none of {DEFAULT} found in {root}: pass --files or set XMC_DATA_DIR")
    meta = _common.result_metadata()
    info = meta["machine"]
    print(f"machine: {info['cpu_model']}, {info['usable_cores']} cores, python {info['python']}, "
          + ", ".join(f"{k} {info['libraries'][k]}" for k in ("numpy", "scipy", "numba",
                                                              "napkinxc")))
    results = []
    with tempfile.TemporaryDirectory(prefix="xmc-bench-") as tmp:
        tmp = Path(tmp)
        os.environ["XMC_CACHE_DIR"] = str(tmp / "cache")
        load_xc(files[0], cache=False)  # JIT warm-up (cached compilation)
        for src in files:
            name = f"{src.parent.name}/{src.name}"
            plain = tmp / f"{src.parent.name}_{src.name.removesuffix('.xz')}"
            if src.suffix == ".xz":
                plain.write_bytes(lzma.decompress(src.read_bytes()))
            else:
                plain.write_bytes(src.read_bytes())
            X, Y = load_xc(plain, cache=False)  # warm the page cache
            n = X.shape[0]
            row = dict(file=name, bytes=plain.stat().st_size, n_samples=n, nnz=int(X.nnz))
            ours = best_of(lambda p=plain: load_xc(p, cache=False), args.repeat)
            row["ours_s"] = ours
            line = f"{name:32s} {n:7d} rows  ours {n / ours:11,.0f} rows/s"
            if not args.skip_napkinxc:
                Xn, Yn = napkin_load(plain)
                check_equal(X, Y, Xn, Yn, name)
                theirs = best_of(lambda p=plain: napkin_load(p), args.repeat)
                row["napkinxc_s"] = theirs
                row["slowdown_vs_napkinxc"] = ours / theirs
                line += (f"  napkinXC {n / theirs:11,.0f} rows/s  ours/napkinXC time "
                         f"{ours / theirs:4.2f}x (target <= 2)")
            # cache: first load (parse + write) vs cached loads; also on the .xz original
            for label, path in (("plain", plain), ("xz", src)):
                for f in (tmp / "cache").glob("*.npz"):
                    f.unlink()
                t0 = time.perf_counter()
                load_xc(path)
                first = time.perf_counter() - t0
                hit = best_of(lambda p=path: load_xc(p), args.repeat)
                row[f"cache_{label}_first_s"] = first
                row[f"cache_{label}_hit_s"] = hit
                line += f"\n{'':32s} cache ({label:5s}): first {first * 1e3:7.1f} ms, " \
                        f"cached {hit * 1e3:6.1f} ms, speed-up {first / hit:5.1f}x (target >= 10)"
            sampled, full = hash_times(plain, args.repeat)
            row["hash_sampled_s"], row["hash_full_blake2b_s"] = sampled, full
            line += (f"\n{'':32s} cache key: sampled hash {sampled * 1e3:.2f} ms vs full "
                     f"blake2b {full * 1e3:.2f} ms ({row['bytes'] / 2**20:.1f} MiB)")
            print(line, flush=True)
            results.append(row)
    _common.write_result(args.out, {**meta, "benchmark": "loader", "repeat": args.repeat,
                                    "results": results})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
