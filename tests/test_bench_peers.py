"""The bench checks every contender's values against the float64 reference before it times it.

Dimensions: B batch, H heads, L length, D head dim.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch

from multihead import attention
from multihead.bench import Case, Report, Settings, row
from multihead.bench.contenders import CONTENDERS, Contender, Step, attention_inputs
from multihead.bench.peers import checked_length, reference_keywords
from multihead.bench.report import markdown
from multihead.bench.runner import measure_case
from multihead.progress import Progress

CPU = torch.device("cpu")
QUICK = Settings(warmup=1, min_rounds=2, max_rounds=2, budget_s=1.0, matmul_n=64)


def _injected(offset: float, calls: list[str]) -> Contender:
    """An attention-level contender whose output is multihead's plus ``offset`` (NaN: NaN everywhere);
    each timed call is noted in ``calls``."""

    def build(case: Case, device: torch.device) -> Step:
        q, k, v = (t.detach() for t in attention_inputs(case, device))
        kw = reference_keywords(case) or {}

        def output() -> torch.Tensor:
            out = attention(q, k, v, **kw)  # type: ignore[arg-type]
            return out + offset if not math.isnan(offset) else torch.full_like(out, math.nan)

        def run() -> torch.Tensor:
            calls.append(case.name)
            return output()

        return Step(run, output=output)

    return Contender(build, lambda case, device: False)


@pytest.fixture
def injected(monkeypatch):
    calls: dict[str, list[str]] = {"off": [], "nan": [], "close": []}
    monkeypatch.setitem(CONTENDERS, ("off", "attention"), _injected(1e-2, calls["off"]))
    monkeypatch.setitem(CONTENDERS, ("nan", "attention"), _injected(math.nan, calls["nan"]))
    monkeypatch.setitem(CONTENDERS, ("close", "attention"), _injected(0.0, calls["close"]))
    return calls


def _case(**changes: object) -> Case:
    runs = (row("multihead"), row("off"), row("nan"), row("close"), row("sdpa"), row("naive"))
    base = Case("peers", 2, 24, 32, 4, level="attention", yardstick=False, measure_memory=False, runs=runs)
    return Case(**{**base.__dict__, **changes})


@pytest.mark.parametrize("changes", [{}, {"causal": True}, {"mask": "causal window", "length": 40}])
def test_a_wrong_contender_is_reported_wrong_and_never_timed(injected, changes):
    case = _case(**changes)
    record = measure_case(case, CPU, QUICK, Progress(1, "t", enabled=False), memory=False)
    res = record.results
    for wrong in ("off", "nan"):
        r = res[wrong]
        assert r.status.startswith("wrong: max error") and not r.ok and r.times_s == [] and r.time_s is None
        assert r.values is not None and r.values["ok"] is False and "Rerun: `" in r.status
        assert injected[wrong] == []  # built and checked, never run by the timer
        assert "seed 0" in r.values["checked"] and "L=" in r.values["checked"]
    assert not (res["off"].values["error"] <= res["off"].values["allowed"])
    assert math.isnan(res["nan"].values["error"])
    if case.mask:  # the seed notebooks' attention knows no mask function: the check catches a real peer too
        assert res["naive"].status.startswith("wrong:") and res["naive"].times_s == []
    for right in ("multihead", "close", "sdpa", *(() if case.mask else ("naive",))):
        r = res[right]
        assert r.ok and len(r.times_s) == 2, right
        assert r.values is not None and r.values["ok"] and r.values["error"] <= r.values["allowed"], right
    assert len(injected["close"]) == 3  # one warm-up round and two timed ones
    assert all(r.time_vs_subject is None for r in (res["off"], res["nan"]))


def test_the_reproducer_reruns_the_check_and_the_report_names_it(injected):
    case = _case()
    record = measure_case(case, CPU, QUICK, Progress(1, "t", enabled=False), memory=False)
    line = record.results["off"].values["reproducer"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(line, {})  # the line as a user pastes it
    assert "'ok': False" in out.getvalue() and "'contender': 'off'" in out.getvalue()
    report = Report("cpu", "test CPU", torch.__version__, 1, QUICK._asdict(), "now", True, [record], [], [])
    md = markdown(report)
    assert "| off | wrong: max error" in md and "2 wrong, reported and not timed" in md
    assert f"rerun: `{line}`" in md


def test_a_long_case_is_checked_at_a_length_its_reference_fits():
    long = Case("long", 1, 16384, 512, 8, level="attention", mask="two-sided window")
    assert checked_length(long) == 1024  # 1 * 8 * 1024**2 float64 scores: 64 MiB
    assert checked_length(_case()) == 24
    assert reference_keywords(Case("module", 2, 8, 32, 4)) is None  # a module's output is not attention's
    assert reference_keywords(Case("ragged", 1, 10, 32, 4, level="attention", lengths=(3, 7))) is None
