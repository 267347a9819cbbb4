"""Two models timed side by side (the tools' before/after speed figures), and the machine that timed them.

``multihead prune`` and ``multihead demo`` compare an original model with its pruned copy. Both do it the
way the benchmarks do (:mod:`multihead.bench.measure`): the two calls run in interleaved rounds
(A B A B ...) on the same inputs, so machine load hits both alike, and the speed-up is the median of the
per-round ratios with its interquartile range (:func:`multihead.bench.stats.per_round_ratio`). A figure
from one machine says which machine it came from (:func:`machine`).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from .contenders import Step
from .measure import Settings, interleaved
from .stats import Spread, per_round_ratio, spread

__all__ = ["PAIR_SETTINGS", "Machine", "PairTiming", "cpu_words", "machine", "pair_timing", "time_pair"]


class Machine(NamedTuple):
    """Where a timing ran: CPU model, logical cores, torch's intra-op threads, 1-minute load average."""

    cpu: str
    cores: int
    threads: int
    load: float | None

    def words(self) -> str:
        """``"Intel Xeon ... (2 cores, 2 torch threads, load 1.3)"``."""
        load = "" if self.load is None else f", load {self.load:.1f}"
        return f"{self.cpu} ({self.cores} cores, {self.threads} torch threads{load})"


def machine() -> Machine:
    """The CPU model (``/proc/cpuinfo``'s model name with its family and model numbers, which tell the
    generations apart where a virtual machine's name does not: "AMD EPYC" is family 25 on Zen 4 and 26 on
    Zen 5; else ``platform``), cores, threads and load now."""
    cpu = ""
    info = Path("/proc/cpuinfo")
    if info.exists():
        fields: dict[str, str] = {}
        for line in info.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if not line.strip():
                break  # the first processor's block is enough
            fields.setdefault(key.strip().lower(), value.strip())
        cpu = fields.get("model name", "")
        if cpu and "cpu family" in fields and "model" in fields:
            cpu += f" (family {fields['cpu family']}, model {fields['model']})"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return Machine(
        cpu or platform.processor() or platform.machine(), os.cpu_count() or 1, torch.get_num_threads(), load
    )


def cpu_words() -> str:
    """``"AMD EPYC, x86_64, torch's AVX512 kernels"``: the CPU model and the kernels torch picked for it
    (``ATEN_CPU_CAPABILITY`` may force others), which decide what a CPU timing measured."""
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    return f"{machine().cpu}, {platform.machine()}, torch's {capability} kernels"


PAIR_SETTINGS = Settings(warmup=2, min_rounds=7, max_rounds=41, budget_s=10.0)
"""Default rounds of :func:`time_pair`: 7 to 41 timed rounds after 2 warm-up rounds, within ~10 s."""


class PairTiming(NamedTuple):
    """Seconds per call of the two contenders and the speed-up (first's time / second's, per round).

    ``first_s``, ``second_s``: each contender's own spread over the rounds; ``speedup``: the spread of the
    per-round ratios; ``median_round``: (first, second) seconds of the round whose ratio is the median. A
    table that shows a time or rate per contender beside the speed-up shows ``median_round``'s: each
    contender's own median can come from a different round, and on a loaded machine those two medians and
    the median ratio can disagree in direction (the demo once printed 1,994 sentences/s against 2,741
    beside "1.15x" faster).
    """

    first_s: Spread
    second_s: Spread
    speedup: Spread
    median_round: tuple[float, float]


def pair_timing(first: Sequence[float], second: Sequence[float]) -> PairTiming:
    """:class:`PairTiming` of per-round seconds (round i: ``first[i]``, ``second[i]``). An odd number of
    rounds is used (the last of an even count left out), so the median ratio is one round's own and
    ``median_round[0] / median_round[1] == speedup.median``."""
    n = min(len(first), len(second))
    if n == 0:
        raise ValueError("pair_timing needs at least one round timed for both contenders, got none")
    n -= 1 - n % 2  # odd
    first, second = first[:n], second[:n]
    ratios = [a / b for a, b in zip(first, second, strict=True)]
    mid = sorted(range(n), key=ratios.__getitem__)[n // 2]  # the median round
    return PairTiming(
        spread(first), spread(second), per_round_ratio(first, second), (first[mid], second[mid])
    )


def time_pair(
    first: Callable[[], object],
    second: Callable[[], object],
    *,
    settings: Settings = PAIR_SETTINGS,
    device: torch.device | str = "cpu",
    note: Callable[[str], None] = lambda _: None,
) -> PairTiming:
    """Time ``first()`` and ``second()`` in interleaved rounds (same work each round); returns both spreads.

    Each callable must do the same work every call (same inputs): e.g. the original and the pruned
    model's forward pass on one batch. ``speedup`` > 1 means ``second`` is faster. Raises the first
    error either callable raised.
    """
    steps = {"first": Step(first), "second": Step(second)}
    with torch.inference_mode():
        times, errors = interleaved(steps, torch.device(device), settings, note)
    if errors:
        raise RuntimeError("; ".join(f"{k}: {v}" for k, v in errors.items()))
    return pair_timing(times["first"], times["second"])
