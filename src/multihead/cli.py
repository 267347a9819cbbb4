"""Command line: ``multihead demo | bench | export`` (``python -m multihead`` is the same)."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import seeds

    status = seeds.run(seed=args.seed)  # the seed notebooks' examples, checked against torch first
    if args.seeds:
        return status
    print()
    from .demo.data import DataError
    from .demo.run import DemoConfig, run

    cfg = DemoConfig(seed=args.seed, data=args.data)
    if args.steps is not None:
        cfg.steps = args.steps
    try:
        run(cfg, args.out)
    except DataError as e:
        print(f"multihead demo: {e}", file=sys.stderr)
        return 2
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``multihead`` command."""
    parser = argparse.ArgumentParser(prog="multihead", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run the end-to-end demo",
        description="Train a small Transformer on date normalisation (or --data FILE.tsv), decode with the "
        "KV cache, plot its attention, score and prune its heads, and compare before/after.",
    )
    demo.add_argument("--out", default="demo-out", help="directory for the report, plots and models")
    demo.add_argument("--seed", type=int, default=0, help="seed for the data, the model and training")
    demo.add_argument(
        "--data", metavar="FILE.tsv", help="train on your own source<TAB>target pairs (d2l fra-eng format)"
    )
    demo.add_argument("--steps", type=int, help="training steps (default 900)")
    demo.add_argument("--seeds", action="store_true", help="only print the seed notebooks' parity table")
    bench = sub.add_parser("bench", help="benchmark multihead against its peers (see docs/performance.md)")
    from . import bench as _bench

    _bench.add_arguments(bench)
    from .export import add_cli as add_export_cli

    add_export_cli(sub)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    if args.command == "bench":
        return _bench.run(args)
    if args.command == "export":
        from .export import run_cli as export_cli

        return export_cli(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
