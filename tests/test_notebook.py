"""The committed notebook is the jupytext conversion of the book, without outputs.

The .py file is the source of the book; `make notebook` writes the notebook from it
with jupytext. These tests fail when someone edits one and forgets the other.
"""

from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbformat = pytest.importorskip("nbformat")

REPO_ROOT = Path(__file__).resolve().parent.parent
BOOK = REPO_ROOT / "the_annotated_transformer.py"
NOTEBOOK = REPO_ROOT / "notebooks" / "the_annotated_transformer.ipynb"


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
