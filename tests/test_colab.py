"""The notebook where learners open it: alone, in Google Colab.

A lone notebook has no checkout beside it: what it imports later must be installed
by its own setup cell when missing, its figures must be addresses on the
repository's main, and the committed run's Results must be in its text. The
repository's address is written once (pyproject.toml, read by tools.repository)
and every link is derived from it. The last tests run the notebook alone in
.venv-colab, which holds Colab's versions (requirements-colab.txt; `make
setup-colab`, which .ci/run runs). The Chinese edition has the same
button and the same tests of links and figures; its run is the English one's, since
it runs the same code cells (the last test checks that).
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
from tools import repository, results_table

REPO_ROOT = Path(__file__).resolve().parent.parent

NOTEBOOK = "notebooks/the_annotated_transformer.ipynb"
ZH_NOTEBOOK = "notebooks/the_annotated_transformer.zh.ipynb"
NOTEBOOKS = [NOTEBOOK, ZH_NOTEBOOK]
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
    # transformers: only the offline check of the last section, which says how to
    # install it where it is missing (Colab has it).
    assert third_party == set(tat.LATER_IMPORTS) | {"pandas", "transformers"}


def test_the_colab_stand_in_holds_the_setup_cells_pins():
    """The test below runs without network, so what the setup cell would install is
    installed beforehand, at the same pins."""
    colab = pins(REPO_ROOT / "requirements-colab.txt")
    for name in ("sacrebleu", "vl-convert-python"):
        assert colab[name] in tat.LATER_IMPORTS.values()


# ---------------------------------------------------------------------------
# One address, every link derived from it


# Colab's button, an image linked to the notebook's address in Colab.
BUTTON = re.compile(
    r"\[!\[([^\]]*)\]\(https://colab\.research\.google\.com/assets/colab-badge\.svg\)\]"
    r"\(([^)]+)\)"
)


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_the_readmes_button_opens_the_notebook_on_main_in_colab(notebook):
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    first_screen = readme.split("\n## ", 1)[0]
    buttons = {url: words for words, url in BUTTON.findall(first_screen)}
    assert list(buttons.values())[0] == "Open in Colab"  # the English one first
    assert repository.colab_url(notebook) in buttons, (
        f"no Open in Colab button for {notebook} on the README's first screen"
    )
    assert (REPO_ROOT / notebook).is_file()


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_the_books_title_cell_has_the_same_link(notebook):
    title = nbformat.read(REPO_ROOT / notebook, as_version=4).cells[0].source
    assert f"]({repository.colab_url(notebook)})" in title
    other = ({*NOTEBOOKS} - {notebook}).pop()
    assert repository.colab_url(other) not in title


def test_the_chinese_title_links_to_the_english_edition():
    title = nbformat.read(REPO_ROOT / ZH_NOTEBOOK, as_version=4).cells[0].source
    heading, _, rest = title.partition("\n\n")
    assert heading.startswith("# ")
    first_line = rest.partition("\n")[0]
    assert first_line.startswith(f"[English edition]({repository.blob_url(NOTEBOOK)})")


def test_every_link_to_the_repositorys_files_uses_pyprojects_address():
    here = repository.repository()
    for name in repository.LINKING:
        text = (REPO_ROOT / name).read_text(encoding="utf-8")
        found = repository.own_links(text)
        assert found and set(found) == {here}, name


def test_a_fork_sets_one_line_and_relinks(tmp_path):
    for name in repository.LINKING:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
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
    check = [sys.executable, "-m", "tools.repository", "--check"]
    same = subprocess.run(
        [*check, here.upper()], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert same.returncode == 0, same.stderr  # GitHub's names ignore case
    other = subprocess.run(
        [*check, "a-fork/of-it"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert other.returncode == 1
    assert "set that line to https://github.com/a-fork/of-it" in other.stderr
    workflow = (REPO_ROOT / ".github" / "workflows" / "site.yml").read_text()
    assert 'tools.repository --check "${{ github.repository }}"' in workflow


# ---------------------------------------------------------------------------
# Figures and Results that reach a lone notebook


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_every_figure_of_the_book_is_an_address_of_a_committed_file_on_main(
    notebook,
):
    cells = nbformat.read(REPO_ROOT / notebook, as_version=4).cells
    sources = [c.source for c in cells if c.cell_type == "markdown"]
    images = [src for text in sources for src in MARKDOWN_IMAGE.findall(text)]
    assert images
    own = repository.raw_url("")
    for src in images:
        assert src.startswith(own), f"{src} does not reach a lone notebook"
        assert (REPO_ROOT / src.removeprefix(own)).is_file(), src


def test_the_books_results_table_is_the_committed_runs():
    """tools.results_table renders results/multi30k.json with the workshop's own
    Markdown; the book holds its table's lines (header, rule and the run's row)
    exactly (rerun it after `make multi30k`)."""
    book = (REPO_ROOT / "the_annotated_transformer.py").read_text(encoding="utf-8")
    lines = [f"# {line}".rstrip() for line in results_table.results_lines()]
    assert "\n".join(lines[:3]) in book
    record = json.loads((REPO_ROOT / "results" / "multi30k.json").read_text())
    assert f"| {record['test_greedy']['bleu']:.2f} |" in lines[2]


# ---------------------------------------------------------------------------
# The notebook, alone, on Colab's versions


@pytest.fixture(scope="module")
def run_alone(multi30k_dir, tmp_path_factory):
    """The committed book notebook copied alone into an empty folder and run in
    .venv-colab (the smoke profile, the data folder given); returns (the runner's
    result, the executed notebook, the folder)."""
    if not COLAB_PYTHON.is_file():
        skip_or_fail_in_ci(os.environ, "no .venv-colab: `make setup-colab` makes it")
    tmp_path = tmp_path_factory.mktemp("colab")
    alone = tmp_path / "alone"
    alone.mkdir()
    name = Path(NOTEBOOK).name
    shutil.copy(REPO_ROOT / NOTEBOOK, alone / name)
    runner = (
        "import nbformat, sys, numpy, pandas, altair, torch\n"
        "from nbclient import NotebookClient\n"
        "print('versions:', sys.version.split()[0], torch.__version__,"
        " numpy.__version__, pandas.__version__, altair.__version__)\n"
        f"nb = nbformat.read({name!r}, as_version=4)\n"
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
    return result, nbformat.read(alone / "executed.ipynb", as_version=4), alone


def output_kinds(cell):
    """What a code cell showed, by kind: each output's type, with its stream's
    name or its data's MIME types."""
    kinds = set()
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            kinds.add(("stream", output.name))
        elif output.output_type in ("display_data", "execute_result"):
            kinds.add((output.output_type, tuple(sorted(output.data))))
        else:
            kinds.add((output.output_type,))
    return kinds


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the whole book, smoke profile: minutes on 2 cores
def test_the_notebook_alone_runs_top_to_bottom_on_colabs_versions(run_alone):
    """The committed notebook copied into an empty folder and run in .venv-colab: no
    cell fails, the setup cell finds nothing to install, it printed numbers and drew
    charts, and the Results table is in the notebook."""
    result, executed, alone = run_alone
    assert "versions: " in result.stdout and " 2.1.3 2.2.3 5.5.0" in result.stdout
    outputs = [o for c in executed.cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "installing what this Python lacks" not in printed
    assert "test 2016, greedy:" in printed  # Part 5 scored the notebook's own model
    # Not an empty run: numbers printed, and charts drawn (a Vega-Lite spec with its
    # PNG, ChartOutput's bundle).
    shown = set().union(*(output_kinds(c) for c in executed.cells))
    chart = ("application/vnd.vegalite.v5+json", "image/png", "text/plain")
    assert ("stream", "stdout") in shown and ("execute_result", chart) in shown
    markdown = "\n".join(c.source for c in executed.cells if c.cell_type == "markdown")
    assert "\n".join(results_table.results_lines()[:3]) in markdown
    # Nothing was written beside the notebook but what the runner wrote.
    assert sorted(p.name for p in alone.iterdir()) == sorted(
        ["executed.ipynb", Path(NOTEBOOK).name]
    )


def what_runs(notebook):
    """Everything of a notebook that decides what running it does: its kernel and
    language, and each code cell's source and tags (nbclient reads the tags
    `skip-execution` and `raises-exception`), in order. Markdown never runs."""
    nb = nbformat.read(REPO_ROOT / notebook, as_version=4)
    nbformat.validate(nb)
    kernel = nb.metadata.get("kernelspec"), nb.metadata.get("language_info")
    cells = [
        (c.source, c.metadata.get("tags", []))
        for c in nb.cells
        if c.cell_type == "code"
    ]
    return kernel, cells


def test_the_chinese_notebook_runs_as_the_english_one_run_alone_above():
    """The Chinese notebook runs alone on Colab's versions, top to bottom,
    with the English one's outputs. A run executes the code cells alone, in order,
    in the kernel the metadata names: those are the English notebook's, so its run
    is the run the test above makes (a second run would repeat it to the byte of
    code, for minutes). Its prose is its own, with the committed run's numbers."""
    english, chinese = what_runs(NOTEBOOK), what_runs(ZH_NOTEBOOK)
    assert len(chinese[1]) == len(english[1]) > 50
    assert chinese == english
    zh = nbformat.read(REPO_ROOT / ZH_NOTEBOOK, as_version=4)
    markdown = "\n".join(c.source for c in zh.cells if c.cell_type == "markdown")
    record = json.loads((REPO_ROOT / "results" / "multi30k.json").read_text())
    assert f"| {record['test_greedy']['bleu']:.2f} |" in markdown
