"""Run a suite: time every case, then measure memory, then fill in ratios and targets.

Order matters on the CPU: every timing runs first under the allocator's normal behaviour (as users run),
then the memory measurements, which make glibc hand freed blocks back to the OS at once. A case marked
``own_process`` (or, in the full suite, ``memory_only``) runs alone in a fresh process through
:func:`multihead.distributed.launch` with one rank: its heap holds nothing of the other cases, and ring
attention gets its process group.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import torch

from ..progress import Progress
from .cases import Case, Run, Suite, Sweep, flops
from .contenders import CONTENDERS, Step, build, matmul_step
from .measure import Settings, available_bytes, interleaved, peak_memory, track_cpu_memory
from .pair import cpu_words
from .peers import check_values
from .records import Check, Result
from .stats import Spread, per_round_ratio, spread
from .targets import evaluate, evaluate_growth

__all__ = ["CaseRecord", "Report", "Settings", "measure_case", "run_suite"]


@dataclass
class CaseRecord:
    """A case with its measurements: results by run label (in the case's order) and target checks."""

    case: Case
    flops: float
    matmul_gflops: Spread | None = None
    results: dict[str, Result] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)


@dataclass
class Report:
    device: str
    device_name: str
    torch: str
    threads: int
    settings: dict[str, float]
    date: str
    quick: bool
    cases: list[CaseRecord]
    sweeps: list[Check]
    sweep_defs: list[Sweep]


def _scores_bytes(case: Case) -> int:
    """Bytes of the (B, H, Lq, Lk) scores."""
    return case.batch * case.heads * case.lq * case.lk * torch.finfo(getattr(torch, case.dtype)).bits // 8


def _build_steps(
    case: Case, device: torch.device, results: dict[str, Result], checked: dict[str, dict[str, object]]
) -> dict[str, Step]:
    """Every run's step, its values checked first (:func:`multihead.bench.peers.check_values`: each passed
    check in ``checked``); a run that cannot be built gets a result saying why, a wrong one a result
    saying so with its reproducer, and neither is timed."""
    steps: dict[str, Step] = {}
    for r in case.runs:
        c = case.variant(r)
        contender = CONTENDERS.get((r.contender, c.level))
        if contender is not None and contender.holds_scores(c, device):
            need = _scores_bytes(c)
            if need > available_bytes(device) // 2:
                results[r.label] = Result(f"skipped: would hold (B, H, Lq, Lk) = {need / 2**30:.1f} GiB")
                continue
        try:
            step = build(r.contender, c, device)
            found = check_values(r.contender, c, device, step)
        except (ImportError, ModuleNotFoundError):
            results[r.label] = Result("not installed")
            continue
        except Exception as exc:  # a peer that cannot run this case says why, the suite goes on
            results[r.label] = Result(f"unavailable: {exc}"[:200])
            continue
        if found is not None and not found.ok:  # a wrong answer is reported, never timed
            results[r.label] = Result(found.words(), values=asdict(found))
            continue
        steps[r.label] = step
        if found is not None:
            checked[r.label] = asdict(found)
    return steps


def _result(case: Case, times: list[float], matmul_times: list[float] | None, matmul_n: int) -> Result:
    t = spread(times)
    of_matmul = None
    if matmul_times:  # per round: (FLOPs / t) / (matmul FLOPs / t_matmul)
        of_matmul = per_round_ratio(matmul_times, times).scaled(flops(case) / (2 * matmul_n**3))
    return Result("ok", times, t, flops(case) / t.median / 1e9, of_matmul)


def measure_case(
    case: Case, device: torch.device, settings: Settings, progress: Progress, *, memory: bool
) -> CaseRecord:
    """Time one case (interleaved; a memory-only case: one call each) and, with ``memory``, its memory."""
    progress.update(0, case=case.name, step="")
    runs: dict[str, Run] = {r.label: r for r in case.runs}
    results: dict[str, Result] = {}
    checked: dict[str, dict[str, object]] = {}
    steps = _build_steps(case, device, results, checked)
    record = CaseRecord(case, flops(case))
    if case.memory_only:  # one call each (long sequences): its time and its peak memory
        small = replace(case, length=min(case.length, 256))
        for label in steps:  # first-call costs (thread pools, lazy init) out of the measurement
            build(runs[label].contender, small.variant(runs[label]), device).run()
        if device.type == "cpu":
            track_cpu_memory()
            # and the process's first call at full size: on the CPU the first contender to run one paid
            # about 2 MiB more than the next (the long forward+backward: 134.0 vs 132.1 MiB ours, 133.9 vs
            # 132.3 torch's, whichever ran first), which one call at that size before any measurement
            # takes out for all of them: a call of a step built for it alone (the measured steps stay
            # fresh: a step run before keeps its gradients until its next call frees them, which would
            # put them in the level the peak is measured above)
            label = next(iter(steps))
            build(runs[label].contender, case.variant(runs[label]), device).run()
        for label, step in steps.items():
            t0 = time.perf_counter()
            mem = peak_memory(step, device)
            res = _result(case.variant(runs[label]), [time.perf_counter() - t0], None, settings.matmul_n)
            results[label] = replace(res, peak_memory_mib=mem)
            progress.update(0, step=label)
    else:
        if case.rounds:
            settings = settings._replace(
                min_rounds=min(settings.min_rounds, case.rounds),
                max_rounds=min(settings.max_rounds, case.rounds),
            )
        yardstick = (
            {"matmul": matmul_step(device, settings.matmul_n, settings.matmul_dtype)}
            if case.yardstick
            else {}
        )
        times, errors = interleaved(
            {**steps, **yardstick}, device, settings, lambda text: progress.update(0, step=text)
        )
        matmul = times.pop("matmul", None)
        if matmul:
            record.matmul_gflops = spread([2 * settings.matmul_n**3 / t / 1e9 for t in matmul])
        results.update({label: Result(e) for label, e in errors.items()})
        for label, ts in times.items():
            c = case.variant(runs[label])
            results[label] = _result(c, [t / c.steps for t in ts], matmul, settings.matmul_n)  # per step
    for label, values in checked.items():
        if label in results:
            results[label].values = values
    record.results = {r.label: results[r.label] for r in case.runs if r.label in results}
    if memory and not case.memory_only:
        add_memory(record, device, progress)
    progress.update(1, step="done")
    return compare(record)


def add_memory(record: CaseRecord, device: torch.device, progress: Progress) -> None:
    """The peak memory of every run of a timed case that completed (one call each, after two warm calls)."""
    if not record.case.measure_memory:
        return
    progress.update(0, case=record.case.name, step="")
    for r in record.case.runs:
        res = record.results.get(r.label)
        if res is not None and res.ok and res.peak_memory_mib is None:
            step = build(r.contender, record.case.variant(r), device)  # its inputs stay alive: not growth
            if step.prepare is not None:
                step.prepare()
            for _ in range(2):  # warm as the timed rounds are (2 warm-up rounds): lazy initialisation,
                step.run()  # thread pools, and a compile that auto routing starts on a repeated call
            res.peak_memory_mib = peak_memory(step, device)
            progress.update(0, step=f"memory of {r.label}")


def compare(record: CaseRecord) -> CaseRecord:
    """Fill in every run's ratios to the case's subject and the case's target checks."""
    subject = record.case.subject
    ours = record.results.get(subject)
    for res in record.results.values():
        if not (res.ok and ours is not None and ours.ok):
            continue
        if res.times_s and ours.times_s and not record.case.memory_only:
            res.time_vs_subject = per_round_ratio(res.times_s, ours.times_s)
        elif res.time_s and ours.time_s:
            ratio = res.time_s.median / ours.time_s.median
            res.time_vs_subject = Spread(ratio, ratio, ratio, 1)
        if ours.peak_memory_mib is not None and res.peak_memory_mib is not None:
            res.memory_vs_subject = res.peak_memory_mib / max(ours.peak_memory_mib, 1e-9)
    record.checks = [evaluate(t, subject, record.results) for t in record.case.targets]
    return record


def _measure_in_own_process(case: Case, settings: Settings) -> CaseRecord:
    """Inside the fresh process (a rank of :func:`multihead.distributed.launch`): timings, then memory."""
    device = torch.device("cpu")
    progress = Progress(1, "bench", enabled=False)
    record = measure_case(case, device, settings, progress, memory=False)
    if not case.memory_only:
        track_cpu_memory()
        add_memory(record, device, progress)
    return compare(record)


def in_own_process(case: Case, settings: Settings, progress: Progress) -> CaseRecord:
    """Measure ``case`` alone in a fresh process with a one-rank process group (CPU, gloo)."""
    from ..distributed import launch  # noqa: PLC0415  (only cases run in their own process need it)

    progress.update(0, case=case.name, step="")
    progress.update(0, step="in its own process")
    (record,) = launch(_measure_in_own_process, 1, (case, settings), timeout=1800.0)
    progress.update(1, step="done")
    return record


def run_suite(
    suite: Suite, device: torch.device, settings: Settings, *, progress: bool = True, isolate: bool = True
) -> Report:
    """Run ``suite`` on ``device``; ``isolate``: CPU memory-only cases in their own processes too."""
    bar = Progress(len(suite.cases), "bench", enabled=progress)
    alone = [c for c in suite.cases if c.own_process or (c.memory_only and isolate and device.type == "cpu")]
    here = [c for c in suite.cases if c not in alone]
    records = {
        c.name: measure_case(c, device, settings, bar, memory=False) for c in here if not c.memory_only
    }
    if device.type == "cpu":
        track_cpu_memory()  # before any memory measurement, so that no freed block lingers in the heap
    for c in here:
        if c.memory_only:
            records[c.name] = measure_case(c, device, settings, bar, memory=True)
        else:
            add_memory(records[c.name], device, bar)
            compare(records[c.name])
    for c in alone:
        records[c.name] = in_own_process(c, settings, bar)
    bar.close()
    sweeps = [
        evaluate_growth(
            s.target, s.subject, [_time_ratio(records[n], s.subject, s.target.peer) for n in s.cases]
        )
        for s in suite.sweeps
    ]
    return Report(
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_words(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        settings=settings._asdict(),
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        quick=False,
        cases=[records[c.name] for c in suite.cases],
        sweeps=sweeps,
        sweep_defs=suite.sweeps,
    )


def _time_ratio(record: CaseRecord, subject: str, peer: str | None) -> Spread | None:
    """Per round, the subject's time over the peer's in one case (None if either did not run)."""
    ours, theirs = record.results.get(subject), record.results.get(peer or "")
    if ours is None or theirs is None or not (ours.times_s and theirs.times_s):
        return None
    return per_round_ratio(ours.times_s, theirs.times_s)
