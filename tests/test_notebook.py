"""The committed notebook is the jupytext conversion of the book, without outputs.

The .py file is the source of the book; `make notebook` writes the notebook from it
with jupytext. These tests fail when someone edits one and forgets the other.
"""

import base64
import re
from pathlib import Path

import jupytext
import nbformat
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
BOOK = REPO_ROOT / "the_annotated_transformer.py"
NOTEBOOK = REPO_ROOT / "notebooks" / "the_annotated_transformer.ipynb"
VEGA_LITE = "application/vnd.vegalite.v5+json"  # the type JupyterLab 4 draws
VEGA_LITE_SCHEMA = "https://vega.github.io/schema/vega-lite/"
NUMBER = r"-?\d+(?:\.\d+)?(?:e[-+]\d+)?"  # as the book prints one: 0.014, 2.1, 6e-07
# Below 1e-10, as `:.0e` prints it: tests/test_part1_reference.py bounds the two
# sides' difference by 5N * d_ff * u (u = 2^-53) times values of a few, about 1e-11
# for the book's N = 2; the book's runs differ by a few 1e-15, and a weight out of
# place by far more than 1e-10.
BELOW_1E_10 = r"(?:0e\+00|\de-(?:1[1-9]|[2-9]\d|\d{3}))"


def bug_lines(name, switched_on, books_path=None):
    """The three lines show_bug prints: the bug's name, its measurement with the bug
    switched on, then on the book's path (the same words unless given)."""
    off = switched_on if books_path is None else books_path
    on = rf"\s+bug switched on -> {switched_on}"
    return rf"{re.escape(name)}{on}\s+the book's path -> {off}"


# What the book's five doing pieces print, as patterns: the stable
# words, with the numbers, which vary by machine, left open.
WEIGHTS = rf"\[{NUMBER}, {NUMBER}\]"  # hidden_weight's per row
TEACHING_BY_DOING = (
    # Attention by hand: the scaled scores' table, with its shape.
    re.escape("QK^T/sqrt(d_k) (1, 2, 4, 4)"),
    # The two checks before a long run.
    re.escape("V =   11: first loss"),
    re.escape("one batch learnt by heart, loss per token after k steps:"),
    # What goes wrong: each of the eight classic bugs, switched on and off.
    bug_lines(
        "A decoder mask that shows the future",
        rf"training loss {NUMBER}, greedy decoding copies {NUMBER}%",
    ),
    bug_lines(
        "The Noam rate without warm-up",
        rf"step 1: loss {NUMBER}(?:, step \d+: loss {NUMBER})+",
    ),
    bug_lines("Fill value -1e4 (weight on hidden keys per row)", WEIGHTS),
    bug_lines(
        "Fill value -1e9 in float16",
        r"RuntimeError: value cannot be converted to type \S+ without overflow",
        WEIGHTS,
    ),
    bug_lines(
        "Gradient accumulation",
        rf"step of 4 micro-batches / step of one batch = {NUMBER}",
    ),
    bug_lines(
        "Smoothing 0.1 left on the padding column",
        rf"lowest loss {NUMBER} per token, padding predicted {NUMBER}%",
    ),
    bug_lines("Dropout left on at inference", rf"two passes differ by up to {NUMBER}"),
    bug_lines(
        "A padded key not masked",
        rf"4 padding tokens move the memory by up to {NUMBER}",
    ),
    # The proof against nn.Transformer: both layouts, both ways of copying.
    *(
        rf"{layout}, {re.escape(way)}: memory {BELOW_1E_10}, "
        rf"decoder output {BELOW_1E_10}"
        for layout in ("pre-norm", "post-norm")
        for way in ("ours -> torch", "torch -> ours")
    ),
    # The picture of beam search: each alpha's choice (its chart: is_beam_chart).
    *(rf"α = {alpha} picks: \S" for alpha in ("0.6", "2.0")),
)


def not_shown(text):
    """The patterns of TEACHING_BY_DOING that `text` does not show."""
    return [pattern for pattern in TEACHING_BY_DOING if not re.search(pattern, text)]


def is_beam_chart(spec):
    """Whether a Vega-Lite spec is the picture of beam search: data with a "log P"
    field (its named datasets, as altair writes them, or inline values)."""
    rows = [row for values in spec.get("datasets", {}).values() for row in values]
    rows += spec.get("data", {}).get("values", [])
    return any("log P" in row for row in rows)


def cells(notebook):
    """The (cell_type, source) pair of every cell."""
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


@pytest.fixture(scope="module")
def committed():
    return nbformat.read(NOTEBOOK, as_version=4)


def test_committed_notebook_equals_jupytext_conversion_of_the_book(committed, tmp_path):
    generated_path = tmp_path / "the_annotated_transformer.ipynb"
    jupytext.write(jupytext.read(BOOK), generated_path, fmt="ipynb")
    generated = nbformat.read(generated_path, as_version=4)
    want, got = cells(generated), cells(committed)
    first_difference = next(
        (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
        min(len(want), len(got)),
    )
    assert got == want, (
        f"notebooks/{NOTEBOOK.name} is out of date ({len(got)} cells, the .py gives "
        f"{len(want)}; first difference at cell {first_difference}). "
        "Run `make notebook`."
    )


def test_committed_notebooks_cell_ids_come_from_their_text(committed):
    """`make notebook` gives each cell an id drawn from its text (jupytext draws
    random ones), so that rebuilding the notebook, as `make execute` and `make site`
    do, leaves the checkout clean."""
    from tools.translation import cell_id

    seen = {}
    assert [cell.id for cell in committed.cells] == [
        cell_id(cell, seen) for cell in committed.cells
    ]


def test_committed_notebook_has_no_outputs_or_execution_counts(committed):
    code_cells = [cell for cell in committed.cells if cell.cell_type == "code"]
    assert code_cells
    for index, cell in enumerate(code_cells):
        assert cell.get("outputs", []) == [], f"code cell {index} has outputs"
        assert cell.get("execution_count") is None, f"code cell {index} was executed"


def test_committed_notebook_is_paired_with_the_book_by_jupytext(committed):
    assert committed.metadata["jupytext"]["formats"] == "notebooks//ipynb,py:percent"


@pytest.mark.slow
def test_notebook_executes_end_to_end_with_the_smoke_profile(executed_notebook):
    """Every cell runs; each chart comes out as a Vega-Lite chart (JupyterLab draws
    it) with a PNG of it (for viewers that run no JavaScript); translations, the
    cache's and beam search's examples and BLEU are printed."""
    notebook = nbformat.read(executed_notebook, as_version=4)  # make site ran it
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    charts = [o for o in outputs if VEGA_LITE in o.get("data", {})]
    # Twelve charts: Part 1's mask and positional bases; Part 2's teacher forcing,
    # learning rate, two of label smoothing and the two layouts; Part 3's batches;
    # Part 4's cache and beam tree; Part 5's attention grid and explorer.
    assert len(charts) == 12
    for chart in charts:
        assert base64.b64decode(chart.data["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
        assert chart.data[VEGA_LITE]["$schema"].startswith(VEGA_LITE_SCHEMA)
    assert not [o for o in outputs if "text/html" in o.get("data", {})]  # no CDN charts
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "exact copy: yes" in text
    assert "reference:" in text and "model:" in text  # translations beside references
    assert re.search(r"Your smoke model, test 2016, greedy: \d+\.\d\d BLEU", text)
    # Part 4 runs what it teaches: the cache against recomputation, beam beside greedy.
    assert "translated identically with and without the cache" in text
    assert "\n  greedy:    " in text and "\n  beam:      " in text
    assert "signature: nrefs:1" in text
    # The book teaches by doing: each of its five pieces printed, and the
    # beam drawn, interactive, with its PNG in the same output.
    assert not_shown(text) == []
    beam_charts = [o for o in charts if is_beam_chart(o.data[VEGA_LITE])]
    assert len(beam_charts) == 1 and "image/png" in beam_charts[0].data
    folder = executed_notebook.parent  # the model is trained in memory
    assert not (folder / "runs").exists() and not list(folder.rglob("*.pt"))
