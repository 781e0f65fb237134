"""README.md's table of measured figures, generated from the summary of bench/RESULTS.md.

The README shows a few of RESULTS' summary rows (``SHOWN``), copied cell for cell: claim,
target, figure and status, so a figure or a verdict is typed once, in RESULTS, next to its
command, commit and date. ``--write`` rewrites the table between the README's markers;
``--check`` (the default; ``tests/test_readme_figures.py`` runs it) exits 1 when the README's
table is not the one RESULTS gives.

    .venv/bin/python scripts/readme_figures.py --write
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python scripts/readme_figures.py --write"
BEGIN = f"<!-- figures: generated from bench/RESULTS.md by `{COMMAND}` -->"
END = "<!-- end of figures -->"
SHOWN = (
    "gateway overhead: TTFT p50 added, 1 concurrent",
    "exact hit req/s vs a bare Litestar app (wrk)",
    "exact hit req/s with tenancy on vs a bare Litestar app (wrk)",
    "exact hit req/s vs LiteLLM's cache hit",
    "semantic lookup at 1M entries: encode + search p50, recall@1",
    "chat semantic hits: precision at recall ≥ 0.10",
    "`make serve` idle 60 s after traffic",
    "1P1D vs one server",
    "lose one host under mixed load",
    "fair share: tenant B",
)
"""The summary rows the README shows, by the start of their claim, in this order."""


def summary_rows(results: str) -> list[list[str]]:
    """The cells of each row of RESULTS' ``## Summary`` table (the header rows left out)."""
    lines = results.split("\n## Summary", 1)[1].split("\n## ", 1)[0].splitlines()
    rows = [line.strip().strip("|").split(" | ") for line in lines if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows[1:] if not row[0].startswith("---")]


def figures_table(results: str) -> str:
    """The README's table: the ``SHOWN`` rows of RESULTS' summary."""
    rows = summary_rows(results)
    out = ["| claim | target | measured | status |", "|---|---|---|---|"]
    for start in SHOWN:
        found = [row for row in rows if row[0].startswith(start)]
        if len(found) != 1:
            raise SystemExit(f"RESULTS.md's summary has {len(found)} rows starting {start!r}")
        out.append("| " + " | ".join(found[0]) + " |")
    return "\n".join(out)


def with_figures(readme: str, table: str) -> str:
    """``readme`` with ``table`` between its markers."""
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"README has no {BEGIN!r} … {END!r} markers")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the README's table")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    args = ap.parse_args(argv)
    readme = args.readme.read_text()
    wanted = with_figures(readme, figures_table(args.results.read_text()))
    if args.write:
        args.readme.write_text(wanted)
        return 0
    if wanted != readme:
        print(
            f"{args.readme}: its figures are not bench/RESULTS.md's; run `{COMMAND}`",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
