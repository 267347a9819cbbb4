"""Every contender's values against the float64 reference, before it is timed.

Dimensions: B batch, H query heads, Hkv key/value heads, L sequence length, D head dim.

A contender that computes attention (its :class:`~multihead.bench.contenders.Step` has an ``output``) is
run once on the case's inputs (:func:`~multihead.bench.contenders.attention_inputs`, seed 0) and its output
compared with :func:`multihead.attention_reference` in float64 under the project's rule
(:func:`multihead.testing.compare_to_reference`: at most 2x the reference's own error in the case's dtype).
A contender that fails is *wrong*: the runner reports it with a reproducer and never times it, so a wrong
peer is neither a loss nor a win. Seen on an AMD EPYC Zen 3 (family 25, model 1) with torch 2.13.0:
``torch.compile(flex_attention)`` on attn-gym's ``generate_natten(12, 10, 5, 3)`` (B=2, H=4, L=120, D=16,
float32) was off by 1.04 (NaN in another draw) while eager FlexAttention and multihead were exact.

Where the reference's (B, H, L, L) float64 scores would pass :data:`BUDGET` bytes (long cases), the check runs
on the same case at the longest length L/2**i that fits: the same contender, mask and dtype, built again.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields, replace

import torch

from ..testing import compare_to_reference
from .cases import Case
from .contenders import Step, attention_inputs, build, window_function
from .masks import KINDS

__all__ = ["BUDGET", "ValueCheck", "check_values", "checked_length", "recheck", "reference_keywords"]

BUDGET = 1 << 27
"""Bytes of the float64 (B, H, L, L) scores above which a case is checked at a shorter length."""


@dataclass(frozen=True)
class ValueCheck:
    """One contender's output against the float64 reference: its max absolute ``error``, the ``allowed``
    one (2x the reference's own ``reference_error`` in the case's dtype, plus a floor), the shapes it was
    checked at (``checked``: "B=2 H=4 Hkv=4 L=120 D=16 float32, seed 0") and a line of Python that reruns
    the check (``reproducer``)."""

    contender: str
    ok: bool
    error: float
    allowed: float
    reference_error: float
    checked: str
    reproducer: str

    def words(self) -> str:
        """The status of a wrong contender, for the report (no ``|``: it sits in a markdown table)."""
        return (
            f"wrong: max error {self.error:.3g} against the float64 reference, allowed {self.allowed:.3g} "
            f"({self.checked}); not timed. Rerun: `{self.reproducer}`"
        )


def reference_keywords(case: Case) -> dict[str, object] | None:
    """The :func:`multihead.attention_reference` keywords that mean what ``case``'s contenders compute, or
    ``None`` where the contenders' outputs are not attention's on :func:`attention_inputs` (module and
    decode levels, a ragged batch). Every mask form of a mask case allows the same pairs: the plain
    lambda serves."""
    if case.level != "attention" or case.lengths:
        return None
    if case.mask:
        return {"mask": KINDS[case.mask].plain(case.length)}
    if case.window:
        return {"mask": window_function(case.window, "lambda"), "causal": case.causal}
    return {"causal": case.causal}


def checked_length(case: Case) -> int:
    """The length ``case`` is checked at: its own, halved until the reference's float64 (B, H, L, L) scores
    fit in :data:`BUDGET` bytes."""
    n = case.length
    while n > 1 and case.batch * case.heads * n * n * 8 > BUDGET:
        n //= 2
    return n


def check_values(name: str, case: Case, device: torch.device, step: Step) -> ValueCheck | None:
    """Contender ``name``'s output on ``case`` (``step``, built for it) against the float64 reference;
    ``None`` where it cannot be compared (see :func:`reference_keywords`)."""
    keywords = reference_keywords(case)
    if keywords is None or step.output is None:
        return None
    n = checked_length(case)
    if n != case.length:  # the same contender on the same case, shorter
        case = replace(case, length=n)
        step, keywords = build(name, case, device), reference_keywords(case)
    q, k, v = (t.detach() for t in attention_inputs(case, device))
    output = step.output
    assert output is not None and keywords is not None
    report = compare_to_reference(lambda *args, **kw: output(), q, k, v, **keywords)
    b, h, _, d = q.shape
    return ValueCheck(
        name,
        report.ok,
        report.fast,
        report.allowed(report.reference),
        report.reference,
        f"B={b} H={h} Hkv={k.shape[1]} L={n} D={d} {case.dtype}, {_mask_words(case)}, seed 0",
        reproducer(name, case),
    )


def _mask_words(case: Case) -> str:
    if case.mask:
        return f"mask {case.mask!r} as {case.mask_form}"
    if case.window:
        return f"window {case.window} ({case.window_form}){', causal' if case.causal else ''}"
    return "causal" if case.causal else "no mask"


def reproducer(name: str, case: Case) -> str:
    """A line of Python that reruns contender ``name``'s check on ``case`` (its fields that differ from the
    defaults; runs and targets left out)."""
    given = [repr(case.name), str(case.batch), str(case.length), str(case.embed_dim), str(case.heads)]
    for f in fields(case):
        value = getattr(case, f.name)
        if f.default is MISSING or f.name in ("runs", "targets") or value == f.default:
            continue
        given.append(f"{f.name}={value!r}")
    return (
        "from multihead.bench import Case; from multihead.bench.peers import recheck; "
        f"print(recheck({name!r}, Case({', '.join(given)})))"
    )


def recheck(name: str, case: Case, device: str = "cpu") -> dict[str, object]:
    """Rerun contender ``name``'s check on ``case`` (what a wrong contender's reproducer calls)."""
    dev = torch.device(device)
    found = check_values(name, case, dev, build(name, case, dev))
    if found is None:
        raise ValueError(f"contender {name!r} on case {case.name!r} has no attention output to check")
    return asdict(found)
