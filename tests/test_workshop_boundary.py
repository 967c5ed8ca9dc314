"""The book stands alone; the workshop package uses only public names.

The book (the_annotated_transformer.py) never imports `workshop`; the package uses
only the book's public names and public attributes (of the book's objects and of
torch's), and the original notebook's names import from the book.
"""

import ast
from pathlib import Path

import pytest
from conftest import loaded_by_importing_the_book, run_python

REPO_ROOT = Path(__file__).resolve().parent.parent


WORKSHOP = REPO_ROOT / "workshop"


BOOK = "the_annotated_transformer"


@pytest.mark.slow
def test_importing_the_book_loads_no_workshop_module():
    assert loaded_by_importing_the_book(["workshop"]) == []


def private_uses(tree):
    """Where a module reaches past public names, as (line, text) pairs: a private
    name imported from the book (`from the_annotated_transformer import _x`), a
    private attribute of anything but `self` (`book._x`, `model._x`, also through
    getattr or setattr), and a special attribute written (`obj.__class__ = ...`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == BOOK:
            found += [
                (node.lineno, f"from {BOOK} import {alias.name}")
                for alias in node.names
                if alias.name.startswith("_")
            ]
        elif isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            special = node.attr.startswith("__") and node.attr.endswith("__")
            if special and isinstance(node.ctx, ast.Store):
                found.append((node.lineno, f"{ast.unparse(node)} = ..."))
            elif node.attr.startswith("_") and not special and owner != "self":
                found.append((node.lineno, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
        ):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_private_use_finder_finds_every_form():
    """The control for the test below: the finder sees what it looks for, and
    lets a module's own private state and special names it only reads be."""
    code = (
        f"import {BOOK} as tat\nfrom {BOOK} import _fit, PAD\n"
        "tat._fit([1], 2)\nmodel.src_embed[1]._pe\nmodule.__class__ = Fused\n"
        "getattr(layer, '_last_target')\n"
        "self._own = 1\ntype(error).__name__\ntat.PAD\n"
    )
    assert private_uses(ast.parse(code)) == [
        (2, f"from {BOOK} import _fit"),
        (3, "tat._fit"),
        (4, "model.src_embed[1]._pe"),
        (5, "module.__class__ = ..."),
        (6, "getattr(layer, '_last_target')"),
    ]


@pytest.mark.parametrize(
    "path", sorted(WORKSHOP.glob("*.py")), ids=lambda path: path.name
)
def test_the_workshop_uses_only_public_names(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    assert private_uses(tree) == []


@pytest.mark.slow
def test_the_original_notebooks_names_import_from_the_book():
    result = run_python(
        "from the_annotated_transformer import (make_model, Batch, run_epoch, rate,\n"
        "    LabelSmoothing, SimpleLossCompute, greedy_decode, subsequent_mask,\n"
        "    attention, MultiHeadedAttention, PositionalEncoding, EncoderDecoder,\n"
        "    beam_search, Vocab)\n"
    )
    assert result.returncode == 0, result.stderr
