"""The committed `multi30k` run's Results: its row of the README's table and its
five example translations, generated from results/multi30k.json with the workshop's
own Markdown (workshop/report/reports.py). The book holds the table's first three
lines as text, so that a notebook opened alone shows them too; the examples stay in
results/multi30k.md and docs/results.md.

    python -m tools.results_table    prints the lines, as the book's markdown cell

tests/test_colab.py checks that the book holds the table's lines exactly.
"""

import json
from pathlib import Path

from workshop.report.reports import RESULTS_HEADER, results_row

REPO_ROOT = Path(__file__).resolve().parent.parent
RECORD = REPO_ROOT / "results" / "multi30k.json"


def results_lines(record_path=RECORD):
    """The Markdown lines of the run's table and examples."""
    record = json.loads(Path(record_path).read_text(encoding="utf-8"))
    examples = ["| German | Reference | Greedy | Beam |", "|---|---|---|---|"]
    for example in record["examples"]:
        texts = (example[k] for k in ("source", "reference", "greedy", "beam"))
        cells = (t.replace("|", "\\|").replace("<", "&lt;") for t in texts)
        examples.append(f"| {' | '.join(cells)} |")
    return [*RESULTS_HEADER.splitlines(), results_row(record), "", *examples]


if __name__ == "__main__":
    print("\n".join(f"# {line}".rstrip() for line in results_lines()))
