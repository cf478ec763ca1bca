"""The ``radixcache`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``radixcache`` console script. Returns the process exit status."""
    parser = argparse.ArgumentParser(prog="radixcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="walk through the slot pool's ownership rule and fences")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return 0 if run_demo() else 1
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse rejects first
    return 2


if __name__ == "__main__":
    sys.exit(main())
