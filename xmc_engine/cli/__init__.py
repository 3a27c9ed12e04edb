"""Command-line interface: ``xmc-engine SUBCOMMAND ...`` (also ``python -m xmc_engine``).

Each subcommand group lives in its own module with ``register(subparsers)``; argument parsing is
kept apart from the work it triggers (the handlers call library functions).

Exit status: 0 on success; 2 on bad input (an argument, a file, a busy run folder), with one line
``xmc-engine: error: ...`` on stderr naming the value and what to do; 1 when a result could not
be written (disk full); ``128 + signal`` after SIGINT / SIGTERM. Anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import errno
import logging
import sys

from xmc_engine.errors import SaveError, TrainingInterrupted, XMCError

# Errors of the machine rather than of the input: exit 1, as for SaveError.
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS}


def build_parser() -> argparse.ArgumentParser:
    from xmc_engine.cli import datasets as _datasets
    from xmc_engine.cli import plan as _plan
    from xmc_engine.cli import train as _train

    parser = argparse.ArgumentParser(
        prog="xmc-engine",
        description="Adaptive SGD for extreme multi-label classification on heterogeneous devices.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _train.register(sub)
    _datasets.register(sub)
    _plan.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        if args.command is None:
            # `xmc-engine` alone runs the main job: train on the built-in default.
            args = parser.parse_args(["train", *(argv or [])])
        else:
            parser.parse_args([args.command, "--help"])
    try:
        return int(args.func(args) or 0)
    except TrainingInterrupted as exc:
        print(f"xmc-engine: {exc}", file=sys.stderr)
        return exc.returncode
    except SaveError as exc:
        print(f"xmc-engine: error: {exc}", file=sys.stderr)
        return 1
    except XMCError as exc:
        print(f"xmc-engine: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path that cannot be read or written as given
        what = f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)
        print(f"xmc-engine: error: {what}", file=sys.stderr)
        return 1 if exc.errno in _ENVIRONMENT_ERRNOS else 2
    except KeyboardInterrupt:
        print("xmc-engine: interrupted", file=sys.stderr)
        return 130
