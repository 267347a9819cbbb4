"""Every CPU target on every CPU the project has met: one table, a column per CPU, from the committed results.

Each column reads the ``multihead bench`` reports (JSON) measured on one CPU; where two reports of a column
check the same (case, target), the later one counts. A cell is the target's measured median [IQR] and
whether it was met, so a regression on one CPU shows at a glance::

    python benchmarks/cpu_table.py            # prints the table
    python benchmarks/cpu_table.py --write    # and puts it into docs/performance.md between its markers

The reports name their CPU (``device_name``: model, family and model numbers where the report has them,
and torch's kernels); the columns below say which files were measured on which CPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- cpu-table: benchmarks/cpu_table.py --write -->", "<!-- /cpu-table -->"

#: column -> the reports measured on that CPU (2 cores, 2 threads; AVX-512 kernels unless the column says), oldest first
COLUMNS: dict[str, tuple[str, ...]] = {
    "Zen 4 (EPYC, family 25 model 17)": (
        "cpu_targets",
        "flex_masks_cpu_quiet",
        "seed_shape_cpu",
        "issue48_zen4_2232",
        "flex_masks_cpu_zen4",
        "seed_shape_cpu_zen4",
        "cpu_zen4_full",
        "cpu_targets_zen4",
    ),
    "Zen 5 (EPYC, family 26 model 2)": ("cpu_targets_zen5", "flex_masks_cpu_zen5"),
    "Zen 1 (EPYC, family 23 model 1; AVX2, no AVX-512)": ("flex_masks_cpu_zen1",),
}


def _cell(check: dict) -> str:
    """``"1.34 [1.33, 1.36] no"`` (a share of the matmul rate as a percentage)."""
    v = check.get("value")
    if not v:
        return "-"
    pct = "matmul rate" in check["target"]
    fmt = (lambda x: f"{x:.0%}") if pct else (lambda x: f"{x:.2f}")
    met = "yes" if check["met"] else "**no**"
    spread = "" if v["q1"] == v["q3"] else f" [{fmt(v['q1'])}, {fmt(v['q3'])}]"
    return f"{fmt(v['median'])}{spread} {met}"


def collect() -> tuple[list[tuple[str, str]], dict[str, dict[tuple[str, str], str]], dict[str, list[str]]]:
    """Rows (case, target) in first-seen order, each column's cells, and each column's sources (file, date)."""
    rows: list[tuple[str, str]] = []
    cells: dict[str, dict[tuple[str, str], str]] = {}
    sources: dict[str, list[str]] = {}
    for column, names in COLUMNS.items():
        reports = [
            json.loads(p.read_text()) | {"file": p.stem}
            for n in names
            if (p := RESULTS / f"{n}.json").exists()
        ]
        cells[column], sources[column] = {}, []
        for report in sorted(reports, key=lambda r: r["date"]):
            sources[column].append(f"`{report['file']}` ({report['date'][:16]})")
            for case in report["cases"]:
                for check in case["checks"]:
                    key = (case["case"]["name"], check["target"])
                    if key not in rows:
                        rows.append(key)
                    cells[column][key] = _cell(check)
    return rows, cells, sources


def table() -> str:
    """The markdown table (and the line naming its sources)."""
    rows, cells, sources = collect()
    columns = list(COLUMNS)
    lines = [
        "| case | target | " + " | ".join(columns) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in columns) + " |",
    ]
    for case, target in sorted(rows, key=lambda r: (r[0].startswith("flex"), r[0])):
        lines.append(
            f"| {case} | {target} | " + " | ".join(cells[c].get((case, target), "-") for c in columns) + " |"
        )
    named = "; ".join(f"{c}: {', '.join(s)}" for c, s in sources.items())
    return "\n".join([*lines, "", f"Sources (a later report wins a cell): {named}."])


def write(doc: Path = DOC) -> None:
    """Replace the table between the markers in ``doc``."""
    text = doc.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    doc.write_text(f"{head}{BEGIN}\n{table()}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"put the table into {DOC.relative_to(ROOT)}")
    args = parser.parse_args()
    print(table())
    if args.write:
        write()


if __name__ == "__main__":
    main()
