"""``xmc-engine datasets list | info | fetch | convert``: argument parsing, then library calls."""

from __future__ import annotations

import argparse
from pathlib import Path

from xmc_engine.cli.argtypes import positive_float, user_path


def register(sub) -> None:
    """Add the ``datasets`` command group to the top-level subparsers."""
    p = sub.add_parser("datasets", help="list, inspect, fetch and convert datasets",
                       description="List, inspect, fetch and convert datasets.")
    p.set_defaults(func=lambda args: p.print_help())
    ds = p.add_subparsers(dest="datasets_command", metavar="ACTION")

    q = ds.add_parser("list", help="known datasets (local, XC repository, synthetic)")
    q.set_defaults(func=cmd_list)

    q = ds.add_parser("info", help="counts and label statistics of a dataset or file")
    q.add_argument("target", type=user_path, metavar="PATH_OR_NAME")
    q.add_argument("--no-cache", action="store_true", help="parse without the binary cache")
    q.set_defaults(func=cmd_info)

    q = ds.add_parser("fetch", help="download, verify and unpack a dataset")
    q.add_argument("name", metavar="NAME")
    q.add_argument("--url", help="download from this URL instead of the registry's")
    q.add_argument("--sha256", help="expected sha256 of the downloaded file")
    q.add_argument("--dest", type=Path, help="folder to unpack into "
                                             "(default XMC_DOWNLOAD_DIR/NAME)")
    q.add_argument("--timeout", type=positive_float, default=10.0,
                   help="network timeout in seconds")
    q.set_defaults(func=cmd_fetch)

    q = ds.add_parser("convert", help="convert XC / LIBSVM / .npz to XC text (by OUT suffix: "
                                      ".txt, .txt.xz, .txt.gz, .txt.bz2) or .npz")
    q.add_argument("input", type=_input_path, metavar="IN")
    q.add_argument("output", type=Path, metavar="OUT")
    q.add_argument("--input-format", choices=["auto", "xc", "libsvm", "npz"], default="auto")
    q.add_argument("--one-based", action="store_true",
                   help="LIBSVM input: feature indices start at 1")
    q.set_defaults(func=cmd_convert)


# ------------------------------------------------------------------------------------ handlers
def cmd_list(args) -> int:
    from xmc_engine.datasets import list_datasets

    rows = [("name", "kind", "train", "test", "features", "labels", "where")]
    for i in list_datasets():
        if i.kind == "synthetic":
            where = "generated"
        elif i.train_path is not None:
            where = str(i.train_path.parent)
        else:
            where = "not downloaded" + ("" if i.url else " (no URL: manual)")
        rows.append((i.name, i.kind, _n(i.n_train), _n(i.n_test), _n(i.n_features),
                     _n(i.n_labels), where))
    print(_table(rows))
    return 0


def cmd_info(args) -> int:
    from xmc_engine.datasets import describe, load_dataset
    from xmc_engine.datasets.registry import find_dataset_info

    target = args.target
    info = None if Path(target).expanduser().exists() else find_dataset_info(target)
    if info is not None:
        print(f"{info.name} ({info.kind})  {info.note}")
        print(f"  expected: train {_n(info.n_train)}  test {_n(info.n_test)}  "
              f"features {_n(info.n_features)}  labels {_n(info.n_labels)}  "
              f"avg nnz {_f(info.avg_nnz)}  labels/row {_f(info.avg_labels)}")
        if info.kind == "remote" and info.train_path is None:
            print(f"  not downloaded: xmc-engine datasets fetch {info.name}"
                  + (f"   (url {info.url})" if info.url else f"   (by hand: {info.page})"))
            return 0
    X_tr, Y_tr, X_te, Y_te = load_dataset(target, cache=not args.no_cache)
    splits = [("train", X_tr, Y_tr)] + ([("test", X_te, Y_te)] if X_te is not None else [])
    for split, X, Y in splits:
        print(format_stats(split, describe(X, Y)))
    return 0


def format_stats(split: str, s: dict) -> str:
    return (f"{split}: {s['n_samples']} samples, {s['n_features']} features, "
            f"{s['n_labels']} labels\n"
            f"  avg nnz/row {s['avg_nnz']:.2f} (max {s['max_nnz']}), "
            f"avg labels/row {s['avg_labels']:.2f} (max {s['max_labels']})\n"
            f"  label frequency: top 1% of labels hold {100 * s['top1pct_label_share']:.1f}% "
            f"of occurrences, top 10% hold {100 * s['top10pct_label_share']:.1f}%, "
            f"median {s['median_label_freq']:g}, max {s['max_label_freq']} "
            f"({s['labels_seen']} labels occur)\n"
            f"  rows without labels {s['rows_without_labels']}, "
            f"rows without features {s['rows_without_features']}")


def cmd_fetch(args) -> int:
    from xmc_engine.datasets import fetch

    dest = fetch(args.name, url=args.url, sha256=args.sha256, dest=args.dest,
                 timeout=args.timeout)
    print(f"fetched {args.name} into {dest}")
    return 0


def cmd_convert(args) -> int:
    from xmc_engine.datasets import load_libsvm, load_npz, load_xc, save_xc
    from xmc_engine.datasets.registry import load_file

    fmt = args.input_format
    if fmt == "auto":
        if args.one_based:
            X, Y = load_libsvm(args.input, zero_based=False)
        else:
            X, Y = load_file(args.input, cache=False)
    elif fmt == "xc":
        X, Y = load_xc(args.input, cache=False)
    elif fmt == "npz":
        X, Y = load_npz(args.input)
    else:
        X, Y = load_libsvm(args.input, zero_based=not args.one_based)
    out = save_xc(args.output, X, Y)
    print(f"wrote {out}: {X.shape[0]} samples, {X.shape[1]} features, {Y.shape[1]} labels")
    return 0


# ------------------------------------------------------------------------------------- helpers
def _input_path(s: str) -> Path:
    """argparse type of an input file: :func:`~xmc_engine.cli.argtypes.user_path` as a Path."""
    return Path(user_path(s))


def _n(v) -> str:
    return "?" if v is None else str(v)


def _f(v) -> str:
    return "?" if v is None else f"{v:.2f}"


def _table(rows) -> str:
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``datasets ...`` arguments alone (for tests)."""
    parser = argparse.ArgumentParser(prog="xmc-engine")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["datasets", *argv])
