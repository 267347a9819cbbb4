"""The ``multihead`` command: ``multihead demo | bench | export`` (``python -m multihead`` is the same).

Exit status: 0 success; 1 the command ran and failed (a missing optional extra, a failed check);
2 a usage error (bad options, or a file named on the command line that is missing or unusable).
Usage errors and missing extras print one line on stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

EXAMPLES = """\
examples:
  multihead demo                      train, decode, inspect and prune a small Transformer (~1 min)
  multihead demo --help               the demo's options
  multihead export --checkpoint demo-out/model_pruned.pt --out dates.onnx
  multihead bench --quick             a few seconds of benchmarks
  multihead view MODEL_DIR --text "The cat sat." --out heads.html   every head of a checkpoint
  multihead prune MODEL_DIR --data lines.txt --heads 0.25 --out OUT_DIR

exit status: 0 ok, 1 failed (e.g. a missing extra), 2 usage error"""

DEMO_EXAMPLES = """\
examples:
  multihead demo                      the date task at seed 0, artefacts in demo-out/
  multihead demo --out runs/s1 --seed 1 --steps 300
  multihead demo --data fra-eng.tsv   your own source<TAB>target pairs
  multihead demo --seeds              only the seed notebooks' parity table (seconds)

Writes report.html, PNG plots, results.md, model.pt, model_pruned.pt and config.json under --out
(export a saved model with: multihead export --checkpoint OUT/model_pruned.pt).
Needs the extra multihead[viz] (matplotlib) for its plots and report; it checks before training."""

PRUNE_EXAMPLES = """\
examples:
  multihead prune my-model/ --data lines.txt --heads 0.25 --out my-model-pruned/
  multihead prune my-model/ --data lines.txt --heads 18 --recover 0 --out quick/
  multihead prune my-model/ --data lines.txt --quality 0.99 --out my-model-99/

Writes the pruned weights (safetensors), config, tokenizer and prune_report.{json,md} under --out;
multihead.integrations.transformers.from_pretrained(AutoModel, OUT_DIR) loads it."""

BENCH_EXAMPLES = """\
examples:
  multihead bench --quick             tiny shapes, a few seconds (a smoke test)
  multihead bench --only gqa          only the cases whose name contains 'gqa'
  multihead bench --device cuda --out results/"""


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


def _version() -> str:
    from . import __version__

    return __version__


def _demo(args: argparse.Namespace) -> int:
    from .demo import seeds

    if args.seeds:
        return seeds.run(seed=args.seed)  # the seed notebooks' examples, checked against torch
    from .demo.data import DataError
    from .demo.run import DemoConfig, check_dependencies, run

    check_dependencies()  # before any work: a missing matplotlib fails in seconds, not after training
    status = seeds.run(seed=args.seed)
    print()
    cfg = DemoConfig(seed=args.seed, data=args.data)
    if args.steps is not None:
        cfg.steps = args.steps
    try:
        run(cfg, args.out)
    except DataError as e:
        raise UsageError(str(e)) from e
    return status


def _export(args: argparse.Namespace) -> int:
    from .checkpoint import CheckpointError
    from .export import run_cli

    try:
        return run_cli(args)
    except (CheckpointError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e


def _view(args: argparse.Namespace) -> int:
    from .commands.model_dir import BadInput
    from .commands.view import run

    try:
        return run(args)
    except BadInput as e:
        raise UsageError(str(e)) from e


def _prune(args: argparse.Namespace) -> int:
    from .commands.prune import PruneError, options_from, run

    try:
        run(options_from(args))
    except PruneError as e:
        raise UsageError(str(e)) from e
    return 0


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.run(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``multihead`` argument parser: one subparser per command, each with examples in its ``--help``."""
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser and its subparsers by command name."""
    parser = argparse.ArgumentParser(
        prog="multihead",
        description="Multi-head attention that is correct, fast and inspectable: the demo, the benchmarks, "
        "ONNX export.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,export,view,prune}")
    demo = sub.add_parser(
        "demo",
        help="run the end-to-end demo",
        description="Train a small Transformer on date normalisation (or --data FILE.tsv), decode with the "
        "KV cache, plot its attention, score and prune its heads, and compare before/after.",
        epilog=DEMO_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--out", default="demo-out", help="directory for the report, plots and models")
    demo.add_argument("--seed", type=int, default=0, help="seed for the data, the model and training")
    demo.add_argument(
        "--data", metavar="FILE.tsv", help="train on your own source<TAB>target pairs (d2l fra-eng format)"
    )
    demo.add_argument("--steps", type=_positive, help="training steps (default 900)")
    demo.add_argument("--seeds", action="store_true", help="only print the seed notebooks' parity table")
    demo.set_defaults(handler=_demo)
    bench = sub.add_parser(
        "bench",
        help="benchmark multihead against its peers (see docs/performance.md)",
        description="Interleaved benchmarks of multihead against torch, Keras and a naive implementation.",
        epilog=BENCH_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from .bench import add_arguments as add_bench_arguments

    add_bench_arguments(bench)
    bench.set_defaults(handler=_bench)
    from .export import add_cli as add_export_cli

    add_export_cli(sub)
    sub.choices["export"].set_defaults(handler=_export)
    from .commands.view import add_cli as add_view_cli

    add_view_cli(sub).set_defaults(handler=_view)
    prune = sub.add_parser(
        "prune",
        help="prune the heads of a Hugging Face checkpoint folder",
        description="Remove the heads whose output the rest of their layer can best make up for (measured "
        "on your text), refit each pruned layer's output projection (and, in BERT-family encoders, each "
        "layer's feed-forward output projection) by least squares, train each pruned layer to give the "
        "original layer's output, recover by distilling "
        "toward the original, and save a folder that loads back (see docs/heads.md).",
        epilog=PRUNE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prune.add_argument(
        "model_dir", metavar="MODEL_DIR", help="a save_pretrained folder (config, weights, tokenizer)"
    )
    prune.add_argument("--data", required=True, metavar="LINES.txt", help="your text, one text per line")
    prune.add_argument(
        "--heads",
        metavar="FRACTION|COUNT",
        help="0.25 prunes a quarter of the heads, 18 prunes 18 (or give --quality)",
    )
    prune.add_argument(
        "--quality",
        metavar="Q",
        help="prune the most heads that keep this share of the original's quality on the validation texts, "
        "e.g. 0.99 (a perplexity ratio of at most 1/Q for language models); instead of --heads",
    )
    prune.add_argument(
        "--recover",
        metavar="STEPS",
        help="distillation steps after pruning (default 240, or 120 when the reconstruction was kept, "
        "scaled down for models larger than MiniLM's 23M parameters; 0.1-0.4 s a step for MiniLM on a quiet "
        "2-core CPU; 0: none)",
    )
    prune.add_argument(
        "--reconstruct",
        metavar="STEPS",
        help="training steps per pruned layer to give the original layer's output (default 300, about "
        "8 s a layer for MiniLM on a quiet 2-core CPU, scaled down for larger models, none below 25 a layer; "
        "0: none)",
    )
    prune.add_argument(
        "--out", required=True, metavar="OUT_DIR", help="a new folder for the pruned checkpoint"
    )
    prune.add_argument("--truncate", action="store_true", help="cut texts longer than the model takes")
    prune.set_defaults(handler=_prune)
    return parser, dict(sub.choices)


def _positive(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``multihead`` command; returns the exit status (argparse exits 2 on bad usage)."""
    parser, commands = _build()
    args = parser.parse_args(argv)
    check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = getattr(
        args, "check_args", None
    )
    if check is not None:
        check(commands[args.command], args)  # more usage errors: exit 2 with the subcommand's usage line
    from ._extras import MissingExtra

    try:
        return args.handler(args)
    except UsageError as e:
        print(f"multihead {args.command}: error: {e}", file=sys.stderr)
        return 2
    except MissingExtra as e:
        print(f"multihead {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"multihead {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
