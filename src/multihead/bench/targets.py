"""Benchmark targets as plain records, checked by code and printed in words.

A :class:`Target` compares the case's *subject* (usually multihead) with a *peer* contender::

    Target("speedup", "torch", ">=", 1.5)        # torch's time / ours >= 1.5, i.e. ours 1.5x faster
    Target("time", "multihead@causal=False", "<=", 0.65)   # ours / theirs <= 0.65
    Target("memory", "torch", "<=", 0.8)          # ours peak memory / theirs <= 0.8
    Target("matmul", None, ">=", 0.85)            # ours GFLOP/s / the matmul yardstick's >= 85%
    Target("growth", "bare", "<=", 1.25)          # over a sweep (see multihead.bench.cases.Sweep)

Time ratios are per round (both contenders ran in the same round), so a target's value is a median
with an interquartile range; memory is one measurement per contender.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, NamedTuple

from .records import Check, Result
from .stats import Spread, per_round_ratio

__all__ = ["Target", "describe", "evaluate", "evaluate_growth"]

Metric = Literal["speedup", "time", "memory", "matmul", "growth"]
Op = Literal["<=", ">="]
_OPS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge}


class Target(NamedTuple):
    """``metric(subject, peer) op bound``; see the module docstring for the metrics.

    ``peer``: a run label of the case (``"multihead@causal=False"``), or a contender name (``"torch"``),
    which then stands for the fastest (for memory: the smallest) of that contender's runs that completed.
    """

    metric: Metric
    peer: str | None
    op: Op
    bound: float


def describe(target: Target, subject: str) -> str:
    """The target in words, e.g. ``"multihead >= 1.5x faster than torch"``."""
    m, peer, op, bound = target
    if m == "speedup":
        return f"{subject} {op} {bound:g}x faster than {peer}"
    if m == "time":
        return f"{subject} {op} {bound:g}x the time of {peer}"
    if m == "memory":
        return f"{subject} peak memory {op} {bound:g}x {peer}'s"
    if m == "matmul":
        return f"{subject} {op} {bound:.0%} of the matmul rate (GFLOP/s)"
    return (
        f"{subject} / {peer} time at the longest length {op} {bound:g}x that at the shortest (flat in length)"
    )


def _verdict(text: str, value: Spread | None, target: Target) -> Check:
    if value is None:
        return Check(text, None, None, None)
    ok = _OPS[target.op]
    met = ok(value.median, target.bound)
    clear = ok(value.q1, target.bound) == met and ok(value.q3, target.bound) == met
    return Check(text, value, met, clear)


def _peer_runs(results: Mapping[str, Result], peer: str) -> list[Result]:
    """The completed runs ``peer`` names: that label (with ``@``), or every run of that contender."""
    return [
        r
        for label, r in results.items()
        if r.ok and (label == peer or ("@" not in peer and label.split("@")[0] == peer))
    ]


def evaluate(target: Target, subject: str, results: Mapping[str, Result]) -> Check:
    """Check ``target`` against one case's results (by run label)."""
    text = describe(target, subject)
    ours = results.get(subject)
    if ours is None or not ours.ok:
        return Check(text, None, None, None)
    if target.metric == "matmul":
        return _verdict(text, ours.of_matmul, target)
    peers = _peer_runs(results, target.peer or "")
    if target.metric == "memory":
        mems = [r.peak_memory_mib for r in peers if r.peak_memory_mib]
        if ours.peak_memory_mib is None or not mems:
            return Check(text, None, None, None)
        ratio = ours.peak_memory_mib / min(mems)
        return _verdict(text, Spread(ratio, ratio, ratio, 1), target)
    timed = [r for r in peers if r.time_s is not None]
    if not timed or not ours.times_s:
        return Check(text, None, None, None)
    peer = min(timed, key=lambda r: r.time_s.median)  # type: ignore[union-attr]
    if target.metric == "speedup":
        return _verdict(text, per_round_ratio(peer.times_s, ours.times_s), target)
    if target.metric == "time":
        return _verdict(text, per_round_ratio(ours.times_s, peer.times_s), target)
    raise ValueError(f"target metric {target.metric!r} is checked over a sweep: use evaluate_growth")


def evaluate_growth(target: Target, subject: str, ratios: Sequence[Spread | None]) -> Check:
    """A ``"growth"`` target over a sweep: the last case's subject/peer time ratio over the first's.

    ``ratios``: per case of the sweep (shortest first), the subject's time over the peer's. The
    reported interval combines the two cases' IQRs at their extremes (last q1 / first q3 up to
    last q3 / first q1), so it is wider than either.
    """
    text = describe(target, subject)
    if len(ratios) < 2 or ratios[0] is None or ratios[-1] is None:
        return Check(text, None, None, None)
    first, last = ratios[0], ratios[-1]
    value = Spread(last.median / first.median, last.q1 / first.q3, last.q3 / first.q1, min(first.n, last.n))
    return _verdict(text, value, target)
