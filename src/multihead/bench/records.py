"""What a benchmark run produces: one :class:`Result` per contender, one :class:`Check` per target.

Both are plain dataclasses, written to JSON by :func:`multihead.bench.report.to_json` and returned from
a case measured in its own process (they pickle).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .stats import Spread

__all__ = ["Check", "Result"]


@dataclass
class Result:
    """One contender's measurements in one case.

    ``status`` is ``"ok"``, or why it did not run (not installed, would not fit in memory, failed).
    Times are per call in seconds; ``time_s`` is their median and IQR. ``of_matmul``: the contender's
    GFLOP/s over the matmul yardstick's, per round. ``time_vs_subject``: this contender's time over the
    case's subject's, per round (1.0 for the subject itself). Memory is one measurement (MiB of peak
    growth above inputs and weights), ``None`` where it was not measured. ``values``: its output's check
    against the float64 reference before it was timed (:class:`multihead.bench.peers.ValueCheck` as a
    dict; ``None``: not an attention output); a contender that failed it has ``status`` "wrong: ..." and
    no times.
    """

    status: str
    times_s: list[float] = field(default_factory=list)
    time_s: Spread | None = None
    gflops: float | None = None
    of_matmul: Spread | None = None
    time_vs_subject: Spread | None = None
    peak_memory_mib: float | None = None
    memory_vs_subject: float | None = None
    values: dict[str, object] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class Check:
    """One target, evaluated: ``value`` is the measured median with its IQR (``None``: not measurable).

    ``met``: the median is on the right side of the bound. ``clear``: the whole IQR is on the same side
    as the median, so the verdict does not depend on the machine's noise.
    """

    target: str
    value: Spread | None
    met: bool | None
    clear: bool | None

    @property
    def verdict(self) -> str:
        if self.met is None:
            return "n/a"
        word = "yes" if self.met else "**no**"
        return word if self.clear else f"{word} (within spread)"
