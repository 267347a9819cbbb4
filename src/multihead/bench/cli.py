"""``multihead bench``: the command line over :mod:`multihead.bench`."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from .cases import cpu_suite, cuda_suite
from .measure import Settings
from .report import markdown, write
from .runner import run_suite

__all__ = ["add_arguments", "main", "run"]

QUICK = Settings(warmup=1, min_rounds=3, max_rounds=3, budget_s=0.0, matmul_n=256)
FULL = Settings()
#: On a GPU a case's call takes milliseconds and the grid is large: fewer rounds, and a bf16 yardstick big
#: enough to reach the tensor cores' rate (2 * 8192**3 = 1.1 TFLOP a call).
CUDA = Settings(min_rounds=5, max_rounds=30, budget_s=1.0, matmul_n=8192, matmul_dtype="bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` options, shared by ``multihead bench`` and :func:`main`."""
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a few seconds (a smoke test)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON, markdown and PNG")
    parser.add_argument(
        "--rounds", type=int, default=None, help=f"minimum timed rounds per case (default {FULL.min_rounds})"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds per case for more rounds (default {FULL.budget_s:g}; CUDA {CUDA.budget_s:g})",
    )
    parser.add_argument(
        "--only",
        default=None,
        help="run only cases whose name contains this text (or one of several, comma-separated)",
    )
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    """Run the suite the parsed ``args`` describe, write its reports and print the markdown."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("multihead bench: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    suite = (cuda_suite if device.type == "cuda" else cpu_suite)(args.quick).only(args.only)
    if not suite.cases:
        print(f"multihead bench: no case name contains {args.only!r}", file=sys.stderr)
        return 2
    settings = QUICK if args.quick else (CUDA if device.type == "cuda" else FULL)
    if device.type == "cuda":
        settings = settings._replace(matmul_dtype="bfloat16")
    if args.rounds:
        settings = settings._replace(min_rounds=args.rounds, max_rounds=max(args.rounds, settings.max_rounds))
    if args.budget is not None:
        settings = settings._replace(budget_s=args.budget)
    report = run_suite(suite, device, settings, progress=not args.no_progress, isolate=not args.quick)
    report = replace(report, quick=bool(args.quick))
    stem = device.type + ("-quick" if args.quick else "")
    for p in write(report, Path(args.out), stem):
        print(f"wrote {p}")
    print(markdown(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``multihead bench [--quick] [--device cpu|cuda] [--out DIR] [--only TEXT]``."""
    parser = argparse.ArgumentParser(
        prog="multihead bench", description="benchmark multihead against its peers"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
