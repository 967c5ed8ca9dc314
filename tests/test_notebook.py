"""The committed notebook is the jupytext conversion of the book, without outputs.

The .py file is the source of the book; `make notebook` writes the notebook from it
with jupytext. This test fails when someone edits one and forgets the other. The
book run end to end, and its page: tests/test_site.py.
"""

from pathlib import Path

import jupytext
import nbformat

from tools.translation import cell_id

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO_ROOT / "notebooks" / "the_annotated_transformer.ipynb"


def test_the_committed_notebook_is_the_books_conversion_without_outputs():
    """Paired with the .py by jupytext; each cell's id drawn from its text (jupytext
    draws random ones), so that rebuilding the notebook, as `make execute` and
    `make site` do, leaves the checkout clean; never run."""
    committed = nbformat.read(NOTEBOOK, as_version=4)
    book = jupytext.read(REPO_ROOT / "the_annotated_transformer.py")
    want = [(c.cell_type, c.source) for c in book.cells]
    got = [(c.cell_type, c.source) for c in committed.cells]
    assert got == want, f"notebooks/{NOTEBOOK.name} is out of date: `make notebook`."
    assert committed.metadata["jupytext"]["formats"] == "notebooks//ipynb,py:percent"
    seen = {}
    assert [c.id for c in committed.cells] == [
        cell_id(c, seen) for c in committed.cells
    ]
    assert not [
        c for c in committed.cells if c.get("outputs") or c.get("execution_count")
    ]
