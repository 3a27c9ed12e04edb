"""``xmc-engine datasets list | info | fetch | convert``."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("datasets", help="list, inspect, fetch and convert datasets")
    p.set_defaults(func=lambda args: p.print_help())
