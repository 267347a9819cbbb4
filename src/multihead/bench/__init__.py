"""``multihead bench``: multihead against its peers, timed side by side in one process.

The package, by concern:

* :mod:`~multihead.bench.cases` -- the cases (shape, mode, contenders, targets) and the suites;
  FLOPs of a case;
* :mod:`~multihead.bench.contenders` -- a table (name, level) -> step builder: multihead, torch,
  naive, keras, sdpa, bare decode work, ring attention;
* :mod:`~multihead.bench.peers` -- every attention contender's values against the float64 reference,
  before it is timed (a wrong one is reported with a reproducer, never timed);
* :mod:`~multihead.bench.measure` -- interleaved timing rounds, peak memory, the progress bar;
* :mod:`~multihead.bench.stats` and :mod:`~multihead.bench.targets` -- medians with interquartile
  ranges, per-round ratios, and targets as ``Target(metric, peer, op, bound)`` records;
* :mod:`~multihead.bench.runner` -- a suite's run (timings first, then memory; some cases in a fresh
  process of their own);
* :mod:`~multihead.bench.report` -- JSON, markdown and the PNG chart; :mod:`~multihead.bench.cli` --
  the ``multihead bench`` options.

See docs/performance.md for what the cases measure and the committed results.
"""

from .cases import OURS, Case, Run, Suite, Sweep, cpu_suite, cuda_suite, flops, row
from .cli import add_arguments, main, run
from .measure import Settings
from .records import Check, Result
from .runner import Report, run_suite
from .stats import Spread
from .targets import Target

__all__ = [
    "OURS",
    "Case",
    "Check",
    "Report",
    "Result",
    "Run",
    "Settings",
    "Spread",
    "Suite",
    "Sweep",
    "Target",
    "add_arguments",
    "cpu_suite",
    "cuda_suite",
    "flops",
    "main",
    "row",
    "run",
    "run_suite",
]
