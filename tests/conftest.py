"""Shared test setup: make the book's module importable from the repository root."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import the_annotated_transformer as tat  # noqa: E402  (needs the path above)


def run_python(code):
    """Run `code` in a fresh Python process from the repository root."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def point_data_at(folder, tmp_path, monkeypatch):
    """Leave the data variable unset (folder None) or point it at an empty folder."""
    if folder is None:
        monkeypatch.delenv(tat.DATA_ENV, raising=False)
    else:
        monkeypatch.setenv(tat.DATA_ENV, str(tmp_path))


def data_dir_or_skip(environ):
    """The data folder named in `environ`; skip without it, but fail in CI."""
    value = environ.get(tat.DATA_ENV)
    if value:
        return Path(value)
    message = (
        f"${tat.DATA_ENV} is not set, so the Multi30k tests cannot find the data. "
        "Point it at a folder holding the six Multi30k files (`make test` does)."
    )
    if environ.get("CI") == "true":
        pytest.fail(message + " CI must run every test, so this is an error.")
    pytest.skip(message)


@pytest.fixture(scope="session")
def multi30k_dir():
    """The Multi30k folder from $ANNOTATED_TRANSFORMER_DATA (skip; fail in CI)."""
    return data_dir_or_skip(os.environ)


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Run torch on one thread: for the tiny models of the data tests it is faster,
    and it keeps two threads from waiting on each other on a busy shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def executed_notebook(multi30k_dir, tmp_path_factory):
    """The committed notebook, every cell run with the smoke profile, saved to disk.

    tests/test_notebook.py checks its outputs and tests/test_html.py its HTML page;
    both share this one run (about a minute on a CPU). The notebook trains its model
    in memory and writes no run folder.
    """
    import nbformat
    from nbclient import NotebookClient

    folder = tmp_path_factory.mktemp("executed_notebook")
    notebook = nbformat.read(
        REPO_ROOT / "notebooks" / "the_annotated_transformer.ipynb", as_version=4
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ANNOTATED_TRANSFORMER_PROFILE", "smoke")
        env.setenv(tat.DATA_ENV, str(multi30k_dir))
        client = NotebookClient(
            notebook,
            timeout=600,
            kernel_name="python3",
            resources={"metadata": {"path": str(folder)}},
        )
        client.execute()  # raises CellExecutionError on the first failing cell
    path = folder / "the_annotated_transformer.executed.ipynb"
    nbformat.write(notebook, path)
    return path
