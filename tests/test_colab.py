"""The notebook where learners open it: alone, in Google Colab (issue 42).

A lone notebook has no checkout beside it: what it imports later must be installed
by its own setup cell when missing, its figures must be addresses on the
repository's main, and the committed run's Results must be in its text. The
repository's address is written once (pyproject.toml, read by tools/repository.py)
and every link is derived from it. The last test runs the notebook alone in
.venv-colab, which holds Colab's versions (requirements-colab.txt; `make
setup-colab`, which .ci/run runs).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import skip_or_fail_in_ci

import the_annotated_transformer as tat

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tools"))
import repository  # noqa: E402
import results_table  # noqa: E402

NOTEBOOK = "notebooks/the_annotated_transformer.ipynb"
COLAB_PYTHON = REPO_ROOT / ".venv-colab" / "bin" / "python"
MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)")


def pins(path):
    """name==version lines of a requirements file, by lowercase name."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    found = (line.split("#")[0].strip() for line in lines)
    return {line.split("==")[0].lower(): line for line in found if "==" in line}


# ---------------------------------------------------------------------------
# The setup cell's decision


def test_the_setup_cell_installs_nothing_when_everything_is_there():
    assert tat.missing_requirements(find_spec=lambda module: object()) == []
    assert tat.missing_requirements() == []  # this venv: the pinned requirements


def test_the_setup_cell_installs_exactly_the_missing_modules_at_their_pins():
    absent = {"vl_convert", "sacrebleu"}  # what Colab lacks

    def find_spec(module):
        return None if module in absent else object()

    assert tat.missing_requirements(find_spec) == [
        "vl-convert-python==1.9.0.post1",
        "sacrebleu==2.6.0",
    ]
    assert tat.missing_requirements(lambda module: None) == list(
        tat.LATER_IMPORTS.values()
    )


def test_the_setup_cells_pins_are_requirements_txts_and_leave_torch_alone():
    pinned = pins(REPO_ROOT / "requirements.txt")
    for pin in tat.LATER_IMPORTS.values():
        assert pinned[pin.split("==")[0]] == pin
    names = {pin.split("==")[0] for pin in tat.LATER_IMPORTS.values()}
    assert not names & {"torch", "numpy", "pandas"}  # replacing them needs a restart
    # Every other module the book imports inside a function is one of them.
    book = (REPO_ROOT / "the_annotated_transformer.py").read_text(encoding="utf-8")
    later = set(re.findall(r"^ +(?:import|from) (\w+)", book, re.MULTILINE))
    third_party = later - set(sys.stdlib_module_names) - {"torch", "IPython"}
    assert third_party == set(tat.LATER_IMPORTS) | {"pandas"}


def test_the_colab_stand_in_holds_the_setup_cells_pins():
    """The test below runs without network, so what the setup cell would install is
    installed beforehand, at the same pins."""
    colab = pins(REPO_ROOT / "requirements-colab.txt")
    for name in ("sacrebleu", "vl-convert-python"):
        assert colab[name] in tat.LATER_IMPORTS.values()


# ---------------------------------------------------------------------------
# One address, every link derived from it


def test_the_readmes_button_opens_the_notebook_on_main_in_colab():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    first_screen = readme.split("\n## ", 1)[0]
    button = re.search(r"\[!\[Open in Colab\]\([^)]*\)\]\(([^)]+)\)", first_screen)
    assert button, "no Open in Colab button on the README's first screen"
    assert button.group(1) == repository.colab_url(NOTEBOOK)
    assert (REPO_ROOT / NOTEBOOK).is_file()


def test_the_books_title_cell_has_the_same_link():
    title = nbformat.read(REPO_ROOT / NOTEBOOK, as_version=4).cells[0].source
    assert f"]({repository.colab_url(NOTEBOOK)})" in title


def test_every_link_to_the_repositorys_files_uses_pyprojects_address():
    here = repository.repository()
    for name in repository.LINKING:
        text = (REPO_ROOT / name).read_text(encoding="utf-8")
        found = repository.own_links(text)
        assert found and set(found) == {here}, name


def test_a_fork_sets_one_line_and_relinks(tmp_path):
    for name in repository.LINKING:
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    toml = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    here = repository.repository()
    (tmp_path / "pyproject.toml").write_text(
        toml.replace(f"github.com/{here}", "github.com/a-fork/of-it"), encoding="utf-8"
    )
    repository.relink(tmp_path, tmp_path / "pyproject.toml")
    for name in repository.LINKING:
        links = repository.own_links((tmp_path / name).read_text(encoding="utf-8"))
        assert links and set(links) == {"a-fork/of-it"}


def test_the_site_workflow_stops_when_the_address_is_not_this_repositorys():
    here = repository.repository()
    check = [sys.executable, str(REPO_ROOT / "tools" / "repository.py"), "--check"]
    same = subprocess.run([*check, here.upper()], capture_output=True, text=True)
    assert same.returncode == 0, same.stderr  # GitHub's names ignore case
    other = subprocess.run([*check, "a-fork/of-it"], capture_output=True, text=True)
    assert other.returncode == 1
    assert "set that line to https://github.com/a-fork/of-it" in other.stderr
    workflow = (REPO_ROOT / ".github" / "workflows" / "site.yml").read_text()
    assert 'tools/repository.py --check "${{ github.repository }}"' in workflow


# ---------------------------------------------------------------------------
# Figures and Results that reach a lone notebook


def test_every_figure_of_the_book_is_an_address_of_a_committed_file_on_main():
    cells = nbformat.read(REPO_ROOT / NOTEBOOK, as_version=4).cells
    sources = [c.source for c in cells if c.cell_type == "markdown"]
    images = [src for text in sources for src in MARKDOWN_IMAGE.findall(text)]
    assert images
    own = repository.raw_url("")
    for src in images:
        assert src.startswith(own), f"{src} does not reach a lone notebook"
        assert (REPO_ROOT / src.removeprefix(own)).is_file(), src


def test_the_books_results_table_is_the_committed_runs():
    """tools/results_table.py renders results/multi30k.json with the workshop's own
    Markdown; the book holds exactly those lines (rerun it after `make multi30k`)."""
    book = (REPO_ROOT / "the_annotated_transformer.py").read_text(encoding="utf-8")
    lines = [f"# {line}".rstrip() for line in results_table.results_lines()]
    assert "\n".join(lines) in book
    record = json.loads((REPO_ROOT / "results" / "multi30k.json").read_text())
    assert f"| {record['test_greedy']['bleu']:.2f} |" in lines[2]


# ---------------------------------------------------------------------------
# The notebook, alone, on Colab's versions


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the whole book, smoke profile: minutes on 2 cores
def test_the_notebook_alone_runs_top_to_bottom_on_colabs_versions(
    multi30k_dir, tmp_path
):
    """The committed notebook copied into an empty folder and run in .venv-colab
    (the smoke profile, the data folder given): no cell fails, the setup cell finds
    nothing to install, and the Results table is in the notebook."""
    if not COLAB_PYTHON.is_file():
        skip_or_fail_in_ci(os.environ, "no .venv-colab: `make setup-colab` makes it")
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(REPO_ROOT / NOTEBOOK, alone / "the_annotated_transformer.ipynb")
    runner = (
        "import nbformat, sys, numpy, pandas, altair, torch\n"
        "from nbclient import NotebookClient\n"
        "print('versions:', sys.version.split()[0], torch.__version__,"
        " numpy.__version__, pandas.__version__, altair.__version__)\n"
        "nb = nbformat.read('the_annotated_transformer.ipynb', as_version=4)\n"
        "NotebookClient(nb, timeout=900, kernel_name='python3').execute()\n"
        "nbformat.write(nb, 'executed.ipynb')\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JUPYTER", "PYTHONPATH", "VIRTUAL_ENV"))
    }
    env.update(
        ANNOTATED_TRANSFORMER_PROFILE="smoke",
        ANNOTATED_TRANSFORMER_DATA=str(multi30k_dir),
        JUPYTER_DATA_DIR=str(tmp_path / "jupyter"),  # no user kernel in the way
        JUPYTER_CONFIG_DIR=str(tmp_path / "jupyter-config"),
        IPYTHONDIR=str(tmp_path / "ipython"),
    )
    result = subprocess.run(
        [str(COLAB_PYTHON), "-c", runner],
        cwd=alone,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "versions: " in result.stdout and " 2.1.3 2.2.3 5.5.0" in result.stdout
    executed = nbformat.read(alone / "executed.ipynb", as_version=4)
    outputs = [o for c in executed.cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "installing what this Python lacks" not in printed
    assert "test 2016, greedy:" in printed  # Part 5 scored the notebook's own model
    table = [f"{line}" for line in results_table.results_lines()][:3]
    markdown = "\n".join(c.source for c in executed.cells if c.cell_type == "markdown")
    assert "\n".join(table) in markdown
    # Nothing was written beside the notebook but what the runner wrote.
    assert sorted(p.name for p in alone.iterdir()) == [
        "executed.ipynb",
        "the_annotated_transformer.ipynb",
    ]
