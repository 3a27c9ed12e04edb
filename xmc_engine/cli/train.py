"""``xmc-engine train | evaluate | predict | plot | plan``."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model (no arguments: the built-in synthetic default)")
    p.set_defaults(func=lambda args: p.print_help())
