"""The run's report page (Markdown, <stem>.md beside the CSV): the headline figure, the
run's time against its plan and budget, the targets, and each family's figure with its
table of cases."""

from __future__ import annotations

from pathlib import Path

from bench.plot import Figure
from bench.rows import Row
from bench.targets import Check


def _cell(text: object) -> str:
    """A table cell: Markdown's column bars escaped, one line."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g}"


def family_table(rows: list[Row]) -> list[str]:
    """A family's cases: ours and the baseline's median, their ratio, the check."""
    lines = ["| bench | case | ours (ms) | baseline (ms) | x | check |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {_cell(row.bench)} | {_cell(row.case)} | {_ms(row.ours_s)} | {_ms(row.baseline_s)} | "
                     f"{row.speedup:.2f} | {_cell(row.check)} |")  # fmt: skip
    return lines


def write_report(stem: Path, family_rows: dict[str, list[Row]], checks: list[Check], metadata: dict,
                 figures: list[Figure], time_lines: list[str]) -> Path:  # fmt: skip
    """Writes <stem>.md and returns its path. figures: the headline first, then the
    families' (bench/plot.py's write_figures; empty where plotting failed)."""
    folder = stem.parent
    by_path = {figure.path: figure for figure in figures}
    lines = [f"# seqpar-kernels bench: {metadata['device']}, {metadata['backend']} x {metadata['world_size']} ranks",
             "",
             f"{metadata['date']}, {metadata.get('size', 'default')} sizes, {metadata.get('cpu_count', '?')} cores, "
             f"torch {metadata['torch']}, commit {metadata['git_commit']}; results: `{stem.name}.csv`, "
             f"`{stem.name}.json`."]  # fmt: skip
    headline = stem.with_suffix(".png")
    if headline in by_path:
        lines += ["", f"![the headline figure]({headline.relative_to(folder)})"]
    lines += ["", "## Time", ""] + time_lines
    lines += ["", "## Targets", "", "| target | status | detail |", "|---|---|---|"]
    lines += [f"| {_cell(check.target)} | {_cell(check.status)} | {_cell(check.detail)} |" for check in checks]
    for name, rows in family_rows.items():
        if not rows:
            continue
        lines += ["", f"## {name}", ""]
        figure = stem / f"{name}.png"
        if figure in by_path:
            lines += [f"![{name}]({figure.relative_to(folder)})", ""]
        lines += family_table(rows)
    path = stem.with_suffix(".md")
    path.write_text("\n".join(lines) + "\n")
    return path
