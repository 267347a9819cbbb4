"""Command line: ``multihead demo | bench | export`` (``python -m multihead`` is the same)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``multihead`` command."""
    parser = argparse.ArgumentParser(prog="multihead", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the end-to-end demo")
    demo.add_argument("--seed", type=int, default=0)
    bench = sub.add_parser("bench", help="benchmark multihead against its peers (see docs/performance.md)")
    from . import bench as _bench

    _bench.add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import seeds

        return seeds.run(seed=args.seed)
    if args.command == "bench":
        return _bench.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
