"""The ``torchferry`` command line: ``demo`` and ``plan``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchferry", description=__doc__)
    parser.add_subparsers(dest="command", required=True)
    args = parser.parse_args(argv)
    print(f"unknown command {args.command!r}", file=sys.stderr)
    return 2
