"""The committed notebook is the jupytext conversion of the book, without outputs.

The .py file is the source of the book; `make notebook` writes the notebook from it
with jupytext. These tests fail when someone edits one and forgets the other.
"""

import base64
from pathlib import Path

import jupytext
import nbformat
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
BOOK = REPO_ROOT / "the_annotated_transformer.py"
NOTEBOOK = REPO_ROOT / "notebooks" / "the_annotated_transformer.ipynb"
VEGA_LITE = "application/vnd.vegalite.v5+json"  # the type JupyterLab 4 draws
VEGA_LITE_SCHEMA = "https://vega.github.io/schema/vega-lite/"
# A line each of the book's five doing pieces prints: attention by hand, the two
# checks before a long run, the classic bugs, the proof against nn.Transformer, and
# the picture of beam search (its choice for each alpha).
TEACHING_BY_DOING = (
    "QK^T/sqrt(d_k) (1, 2, 4, 4)",
    "V =   11: first loss",
    "one batch learnt by heart, loss per token after k steps:",
    "A decoder mask that shows the future",
    "pre-norm, ours -> torch: memory",
    "α = 0.6 picks: ",
)


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
    # Parts 1-2 draw seven charts (mask, waves, the two bases, learning rate, the
    # two label-smoothing charts), Part 5 the attention maps.
    assert len(charts) >= 8
    for chart in charts:
        assert base64.b64decode(chart.data["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
        assert chart.data[VEGA_LITE]["$schema"].startswith(VEGA_LITE_SCHEMA)
    assert not [o for o in outputs if "text/html" in o.get("data", {})]  # no CDN charts
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "exact copy: yes" in text
    assert "reference:" in text and "model:" in text  # translations beside references
    assert "test 2016, greedy: BLEU =" in text
    # Part 4 runs what it teaches: the cache against recomputation, beam beside greedy.
    assert "translated identically with and without the cache" in text
    assert "\n  greedy:    " in text and "\n  beam:      " in text
    assert "signature: nrefs:1" in text
    # The book teaches by doing (issue 34): each of its five pieces printed.
    for line in TEACHING_BY_DOING:
        assert line in text, line
    folder = executed_notebook.parent  # the model is trained in memory
    assert not (folder / "runs").exists() and not list(folder.rglob("*.pt"))
