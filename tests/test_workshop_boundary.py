"""The book stands alone; the workshop package uses only its public names.

The book (the_annotated_transformer.py) never imports `workshop`; the package uses
only the book's public names, and the original notebook's names import from the book.
"""

import ast
from pathlib import Path

import pytest
from conftest import loaded_by_importing_the_book, run_python

REPO_ROOT = Path(__file__).resolve().parent.parent


WORKSHOP = REPO_ROOT / "workshop"


BOOK = "the_annotated_transformer"


def test_importing_the_book_loads_no_workshop_module():
    assert loaded_by_importing_the_book(["workshop"]) == []


def private_uses_of_the_book(tree):
    """`from the_annotated_transformer import _x` and `book._x`, where `book` is
    a name the module binds to the book, as (line, text) pairs."""
    aliases = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == BOOK:
                    aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module == BOOK:
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append((node.lineno, f"from {BOOK} import {alias.name}"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
        ):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return found


def test_the_private_use_finder_finds_both_forms():
    """The control for the test below: the finder sees what it looks for."""
    code = (
        f"import {BOOK} as tat\nfrom {BOOK} import _fit, PAD\n"
        "tat._fit([1], 2)\ntat.PAD\nother._x\n"
    )
    assert private_uses_of_the_book(ast.parse(code)) == [
        (2, f"from {BOOK} import _fit"),
        (3, "tat._fit"),
    ]


@pytest.mark.parametrize(
    "path", sorted(WORKSHOP.glob("*.py")), ids=lambda path: path.name
)
def test_the_workshop_uses_only_the_books_public_names(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    assert private_uses_of_the_book(tree) == []


def test_the_original_notebooks_names_import_from_the_book():
    result = run_python(
        "from the_annotated_transformer import (make_model, Batch, run_epoch, rate,\n"
        "    LabelSmoothing, SimpleLossCompute, greedy_decode, subsequent_mask,\n"
        "    attention, MultiHeadedAttention, PositionalEncoding, EncoderDecoder,\n"
        "    beam_search, Vocab)\n"
    )
    assert result.returncode == 0, result.stderr
