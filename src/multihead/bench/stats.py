"""Summaries of repeated measurements: median and interquartile range.

A benchmark on a shared machine is noisy, so every number the harness reports is a median with its
spread: the interquartile range (IQR, the 25th to the 75th percentile) of the rounds. Ratios between two
contenders are taken **per round** (both ran in the same round, one right after the other, so they saw
the same machine load) and then summarised the same way: the IQR of the per-round ratios is the
uncertainty the tables state.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Spread", "per_round_ratio", "spread"]


class Spread(NamedTuple):
    """The median and the interquartile range ``[q1, q3]`` of ``n`` measurements."""

    median: float
    q1: float
    q3: float
    n: int

    def scaled(self, factor: float) -> Spread:
        """Every value times ``factor`` (> 0), e.g. seconds to milliseconds."""
        return Spread(self.median * factor, self.q1 * factor, self.q3 * factor, self.n)

    def words(self, spec: str = ".2f", unit: str = "") -> str:
        """``"1.23x [1.20, 1.31]"``: the median, then the IQR."""
        return f"{self.median:{spec}}{unit} [{self.q1:{spec}}, {self.q3:{spec}}]"


def spread(values: Sequence[float]) -> Spread:
    """Median and IQR of ``values`` (one value: that value thrice; the IQR of a few is the sample's own)."""
    if not values:
        raise ValueError("spread of no values: measure at least one round")
    xs = sorted(values)
    if len(xs) == 1:
        return Spread(xs[0], xs[0], xs[0], 1)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return Spread(statistics.median(xs), q1, q3, len(xs))


def per_round_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Spread:
    """Spread of ``numerator[i] / denominator[i]`` over the rounds both completed."""
    n = min(len(numerator), len(denominator))
    return spread([a / b for a, b in zip(numerator[:n], denominator[:n], strict=True)])
