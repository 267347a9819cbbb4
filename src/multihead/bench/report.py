"""A run's report as JSON, markdown tables and a PNG chart (``DIR/<stem>.json|.md|.png``)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from .cases import Case, Run, Sweep
from .records import Check, Result
from .runner import CaseRecord, Report
from .stats import Spread, per_round_ratio
from .targets import Target

__all__ = ["chart", "load", "markdown", "to_json", "write"]


def to_json(obj: object) -> object:
    """``obj`` as JSON-able data: dataclasses and NamedTuples become dicts, tuples lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        data = {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, Check):
            data["verdict"] = obj.verdict
        return data
    if isinstance(obj, tuple) and hasattr(obj, "_asdict"):
        return {k: to_json(v) for k, v in obj._asdict().items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    return obj


def _f(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


#: Dense bf16 tensor-core peak by the vendor's datasheet (SXM parts), TFLOP/s: the "% of peak" column.
BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def bf16_peak(device_name: str) -> float | None:
    """The datasheet's dense bf16 peak (TFLOP/s) of the GPU ``device_name`` names, ``None`` if unknown."""
    return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in device_name), None)


def _extra(rec: CaseRecord, r: Result, peak: float | None) -> str:
    """The CUDA table's last column: decoding tokens/s, or the share of the bf16 peak."""
    if rec.case.level == "decode" and r.time_s is not None:
        return f"{rec.case.batch * rec.case.lq / r.time_s.median:,.0f} tok/s"
    if peak and r.gflops:
        return f"{r.gflops / 1e3 / peak:.0%}"
    return ""


def _case_rows(rec: CaseRecord, unit_scale: float, peak: float | None = None) -> list[str]:
    case, rows, cuda = rec.case, [], peak is not None
    for label, r in rec.results.items():
        head = f"{case.name} ({case.shape()}, {case.mode}, {case.dtype})" if label == case.subject else ""
        if not r.ok or r.time_s is None:
            rows.append(f"| {head} | {label} | {r.status} | | | | |" + (" |" if cuda else ""))
            continue
        t = r.time_s.scaled(1e3)
        time_ms = f"{t.median:.3g}" if t.n == 1 else t.words(".3g")
        ratio = (
            r.time_vs_subject.words(".2f", "x")
            if r.time_vs_subject and r.time_vs_subject.n > 1
            else (_f(r.time_vs_subject.median if r.time_vs_subject else None, ".2f") + "x")
        )
        of_mm = r.of_matmul.words(".0%") if r.of_matmul else ""
        rows.append(
            f"| {head} | {label} | {time_ms} | {_f((r.gflops or 0) * unit_scale, '.1f')} | {of_mm} | {ratio} "
            f"| {_f(r.peak_memory_mib, '.0f')} |" + (f" {_extra(rec, r, peak)} |" if cuda else "")
        )
    return rows


def _values_words(report: Report) -> list[str]:
    """How many contenders' outputs were checked against the float64 reference before they were timed, and
    each wrong one with its reproducer (its row says "wrong" and has no times)."""
    checked = [(rec.case.name, r) for rec in report.cases for r in rec.results.values() if r.values]
    if not checked:
        return []
    wrong = [(name, r.values) for name, r in checked if r.values and not r.values["ok"]]
    lines = [
        "",
        f"Values: {len(checked)} contenders' outputs (every one that computes attention) were compared with "
        "the float64 reference before they were timed, under the 2x rule (`multihead.bench.peers`); "
        + (f"{len(wrong)} wrong, reported and not timed:" if wrong else "none was wrong."),
    ]
    for name, v in wrong:
        lines.append(
            f"- {name}: {v['contender']}, max error {v['error']:.3g} (allowed {v['allowed']:.3g}) at "
            f"{v['checked']}; rerun: `{v['reproducer']}`"
        )
    return lines


def _sweep_tables(report: Report) -> list[str]:
    """One table per sweep: the subject's and the peer's times per case, and their per-round ratio."""
    lines: list[str] = []
    by_name = {rec.case.name: rec for rec in report.cases}
    for check, sweep in zip(report.sweeps, report.sweep_defs, strict=True):
        subject, peer = sweep.subject, sweep.target.peer or ""
        lines += ["", f"{sweep.name}: {check.target}.", ""]
        lines += [f"| case | {subject} ms [IQR] | {peer} ms [IQR] | {subject} / {peer} [IQR] |"]
        lines += ["| --- | ---: | ---: | ---: |"]
        for name in sweep.cases:
            rec = by_name.get(name)
            ours, theirs = (rec.results.get(subject), rec.results.get(peer)) if rec else (None, None)
            if not (ours and theirs and ours.times_s and theirs.times_s and ours.time_s and theirs.time_s):
                lines.append(f"| {name} | | | |")
                continue
            ratio = per_round_ratio(ours.times_s, theirs.times_s)
            lines.append(
                f"| {name} | {ours.time_s.scaled(1e3).words('.3f')} | {theirs.time_s.scaled(1e3).words('.3f')} "
                f"| {ratio.words('.2f', 'x')} |"
            )
    return lines


def markdown(report: Report) -> str:
    """The report as markdown: one table of contenders per case, then the targets with their spread."""
    unit, scale = ("TFLOP/s", 1e-3) if report.device.startswith("cuda") else ("GFLOP/s", 1.0)
    s = report.settings
    # rounds as run (a case may cap them below the settings)
    timed = [len(r.times_s) for rec in report.cases for r in rec.results.values() if r.times_s]
    low, high = (min(timed), max(timed)) if timed else (s["min_rounds"], s["max_rounds"])
    lines = [
        f"Device {report.device} ({report.device_name}), torch {report.torch}, {report.threads} threads, "
        f"{report.date}. Each case: {s['warmup']} warm-up rounds, then "
        + (f"{low} interleaved rounds" if low == high else f"{low}-{high} interleaved rounds")
        + f" (as many as fit in {s['budget_s']:g} s, within each case's cap). Times are medians with the "
        f"interquartile range [q1, q3] of the rounds; ratios are per round (both contenders in the same "
        f"round), median [IQR]. Memory-only cases: one call each.",
        "",
        f"| case | contender | ms, median [IQR] | {unit} | of matmul [IQR] | time / subject [IQR] | peak MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    peak = None
    if report.device.startswith("cuda"):
        peak = bf16_peak(report.device_name) or 0.0
        rates = [r.matmul_gflops.median / 1e3 for r in report.cases if r.matmul_gflops]
        lines[0] += (
            f" The yardstick is a ({s['matmul_n']}, {s['matmul_n']}) {s.get('matmul_dtype', 'float32')} "
            f"matmul: {statistics.median(rates) if rates else float('nan'):.0f} TFLOP/s here. '% of peak': "
            f"of the datasheet's dense bf16 peak, {peak or 'unknown'} TFLOP/s; decoding cases give tokens/s."
        )
        lines[2] += " % of bf16 peak, or tokens/s |"
        lines[3] += " ---: |"
    for rec in report.cases:
        lines += _case_rows(rec, scale, peak)
    lines += _values_words(report)
    lines += _sweep_tables(report)
    checks = [(rec.case.name, c) for rec in report.cases for c in rec.checks]
    checks += [("(sweep)", c) for c in report.sweeps]
    if checks:
        lines += [
            "",
            "Targets: `met` compares the median with the bound; `within spread` means the IQR crosses it.",
            "",
            "| case | target | measured, median [IQR] | met |",
            "| --- | --- | ---: | :---: |",
        ]
        for name, c in checks:
            value = (
                ""
                if c.value is None
                else (c.value.words(".3f") if c.value.n > 1 else f"{c.value.median:.3f}")
            )
            lines.append(f"| {name} | {c.target} | {value} | {c.verdict} |")
    return "\n".join(lines) + "\n"


def _decode_points(report: Report) -> list[tuple[int, dict[str, tuple[float, float, float]]]]:
    """(cached length, {label: (median, q1, q3) ms}) of every decode case."""
    points = []
    for rec in report.cases:
        if rec.case.level == "decode":
            ms = {lab: r.time_s.scaled(1e3) for lab, r in rec.results.items() if r.ok and r.time_s}
            points.append((rec.case.length, {lab: (t.median, t.q1, t.q3) for lab, t in ms.items()}))
    return points


#: Above this many timed cases the left panel shows times relative to the subject, one row per case: a bar
#: per contender of every case no longer fits a readable width.
BARS_UP_TO = 12


def _rate_bars(ax: object, cases: list[CaseRecord], labels: list[str]) -> None:
    """GFLOP/s per contender, one group of bars per case, with the matmul yardstick as a line."""
    width = 0.8 / max(1, len(labels))
    for j, lab in enumerate(labels):
        ys = [r.results[lab].gflops or 0.0 if lab in r.results else 0.0 for r in cases]
        ax.bar([i + j * width for i in range(len(cases))], ys, width, label=lab)  # type: ignore[attr-defined]
    rates = [r.matmul_gflops.median for r in cases if r.matmul_gflops]
    if rates:
        ax.axhline(statistics.median(rates), color="k", ls="--", lw=1, label="matmul yardstick")  # type: ignore[attr-defined]
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])  # type: ignore[attr-defined]
    ax.set_xticklabels([r.case.name.replace(" ", "\n", 2) for r in cases], fontsize=7)  # type: ignore[attr-defined]
    ax.set_ylabel("GFLOP/s (higher is better)")  # type: ignore[attr-defined]


def _relative_rows(ax: object, cases: list[CaseRecord], labels: list[str]) -> None:
    """Each contender's time / the subject's (median of the per-round ratios), one row per case, log scale."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    markers, colors = "o^sDv<>PX*h", plt.get_cmap("tab20").colors  # type: ignore[attr-defined]
    for j, lab in enumerate(labels):
        pts = [
            (r.results[lab].time_vs_subject.median, i)  # type: ignore[union-attr]
            for i, r in enumerate(cases)
            if lab in r.results and r.results[lab].ok and r.results[lab].time_vs_subject
        ]
        if pts:
            xs, ys = zip(*pts, strict=True)
            style = {"marker": markers[j % len(markers)], "color": colors[2 * j % 20 + j // 10 % 2]}
            ax.scatter(xs, ys, s=18, label=lab, **style)  # type: ignore[attr-defined]
    ax.axvline(1.0, color="k", lw=1)  # type: ignore[attr-defined]
    ax.set_xscale("log")  # type: ignore[attr-defined]
    ax.set_yticks(range(len(cases)), [r.case.name for r in cases], fontsize=7)  # type: ignore[attr-defined]
    ax.invert_yaxis()  # type: ignore[attr-defined]
    ax.grid(axis="x", which="both", lw=0.3)  # type: ignore[attr-defined]
    ax.set_xlabel("time / the subject's (median of per-round ratios; < 1: faster than the subject)")  # type: ignore[attr-defined]


def chart(report: Report, path: Path) -> None:
    """Left: every timed case's GFLOP/s per contender (or, past :data:`BARS_UP_TO` cases, each contender's
    time relative to the subject, a row per case). Right: decode step time vs cached length."""
    import matplotlib  # noqa: PLC0415  (optional, only for the chart)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    cases = [r for r in report.cases if not r.case.memory_only and r.case.level != "decode"]
    decode = _decode_points(report)
    rows = len(cases) > BARS_UP_TO
    height = max(5.0, 0.2 * len(cases) + 1.5) if rows else 5.0
    fig, axes = plt.subplots(1, 2 if decode else 1, figsize=(15 if decode else 10, height), squeeze=False,
                             gridspec_kw={"width_ratios": [2.2, 1] if decode else [1]})  # fmt: skip
    ax = axes[0][0]
    labels = sorted(
        {lab for r in cases for lab in r.results}, key=lambda s: (not s.startswith("multihead"), s)
    )
    (_relative_rows if rows else _rate_bars)(ax, cases, labels)
    ax.set_title(f"attention on {report.device} ({report.threads} threads, torch {report.torch})", fontsize=9)
    if ax.get_legend_handles_labels()[0]:  # anything drawn with a label
        ax.legend(fontsize=7, ncol=2)
    if decode:
        ax = axes[0][1]
        lengths = [n for n, _ in decode]
        for lab in sorted({lab for _, d in decode for lab in d}):
            pts = [(n, d[lab]) for n, d in decode if lab in d]
            xs, (med, lo, hi) = [n for n, _ in pts], zip(*(v for _, v in pts), strict=True)
            err = [
                [m - a for m, a in zip(med, lo, strict=True)],
                [b - m for m, b in zip(med, hi, strict=True)],
            ]
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=lab)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("cached length")
        ax.set_ylabel("ms per decoding step (median, IQR bars)")
        ax.set_title("one decoding step vs its bare work", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: Report, out: Path, stem: str) -> list[Path]:
    """Write ``stem``.json / .md / .png under ``out``; returns the paths (no PNG without matplotlib)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    paths[0].write_text(json.dumps(to_json(report), indent=1) + "\n")
    paths[1].write_text(markdown(report))
    try:
        chart(report, paths[2])
    except ImportError:
        paths.pop()
    return paths


def _spread(d: dict | None) -> Spread | None:
    return None if d is None else Spread(**d)


def _case(d: dict) -> Case:
    runs = tuple(Run(r["label"], r["contender"], tuple(tuple(c) for c in r["changes"])) for r in d["runs"])
    targets = tuple(Target(**t) for t in d["targets"])
    return Case(**{**d, "runs": runs, "targets": targets, "lengths": tuple(d.get("lengths", ()))})


def _check(d: dict) -> Check:
    return Check(d["target"], _spread(d["value"]), d["met"], d["clear"])


def load(path: Path) -> Report:
    """The :class:`Report` a ``.json`` written by :func:`write` holds (to re-render its tables/chart)."""
    data = json.loads(Path(path).read_text())
    spreads = ("time_s", "of_matmul", "time_vs_subject")
    cases = [
        CaseRecord(
            _case(rec["case"]),
            rec["flops"],
            _spread(rec["matmul_gflops"]),
            {
                lab: Result(**{**r, **{k: _spread(r[k]) for k in spreads}})
                for lab, r in rec["results"].items()
            },
            [_check(c) for c in rec["checks"]],
        )
        for rec in data["cases"]
    ]
    sweep_defs = [
        Sweep(s["name"], tuple(s["cases"]), s["subject"], Target(**s["target"])) for s in data["sweep_defs"]
    ]
    rest = {k: v for k, v in data.items() if k not in ("cases", "sweeps", "sweep_defs")}
    return Report(**rest, cases=cases, sweeps=[_check(c) for c in data["sweeps"]], sweep_defs=sweep_defs)
