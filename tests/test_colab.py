"""The notebook where learners open it: alone, in Google Colab.

A lone notebook has no checkout beside it: what it imports later must be installed
by its own setup cell when missing, its figures must be addresses on the
repository's main, and the committed run's Results must be in its text. The
repository's address is written once (pyproject.toml, read by tools.repository)
and every link is derived from it. The last test runs the notebook alone in
.venv-colab, which holds Colab's versions (pyproject.toml's `colab` group; `make
setup-colab`, which .ci/run runs). The Chinese edition has the same button, links
and figures; its code cells, and so its run, are the English one's
(tests/test_chinese_edition.py checks that they are).
"""

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
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


def pins(lines):
    """name==version lines, by lowercase name."""
    found = (line.split("#")[0].strip() for line in lines)
    return {line.split("==")[0].lower(): line for line in found if "==" in line}


with open(REPO_ROOT / "pyproject.toml", "rb") as f:
    COLAB = pins(tomllib.load(f)["dependency-groups"]["colab"])  # Colab's versions


def test_the_setup_cell_installs_exactly_the_missing_modules_at_the_projects_pins():
    assert tat.missing_requirements() == []  # this venv: the pinned requirements
    absent = ["vl_convert", "sacrebleu"]  # what Colab lacks
    found = tat.missing_requirements(lambda module: None if module in absent else 1)
    assert found == [tat.LATER_IMPORTS[module] for module in absent]
    # Its pins are the project's, and leave torch alone.
    pinned = pins((REPO_ROOT / "requirements.txt").read_text().splitlines())
    assert all(pinned[pin.split("==")[0]] == pin for pin in tat.LATER_IMPORTS.values())
    names = {pin.split("==")[0] for pin in tat.LATER_IMPORTS.values()}
    assert not names & {"torch", "numpy", "pandas"}  # replacing them needs a restart
    # Every other module the book imports inside a function is one of them;
    # transformers serves only the last section's offline check, which says how to
    # install it where it is missing (Colab has it).
    book = (REPO_ROOT / "the_annotated_transformer.py").read_text(encoding="utf-8")
    later = set(re.findall(r"^ +(?:import|from) (\w+)", book, re.MULTILINE))
    third_party = later - set(sys.stdlib_module_names) - {"torch", "IPython"}
    assert third_party == set(tat.LATER_IMPORTS) | {"pandas", "transformers"}
    # The Colab stand-in runs offline: it holds beforehand, at the same pins, what
    # the setup cell would install on Colab.
    assert {COLAB["sacrebleu"], COLAB["vl-convert-python"]} <= {*pinned.values()}


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_the_readme_and_the_title_cell_open_the_notebook_on_main_in_colab(notebook):
    """The README's first screen has an Open in Colab button for each edition (the
    English one first); each notebook's title cell links to itself in Colab, and
    the Chinese one to the English edition."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8").split("\n## ")[0]
    badge = r"\[!\[([^\]]*)\]\(https://colab\.research\.google\.com/[^)]+\)\]\(([^)]+)"
    buttons = {url: words for words, url in re.findall(badge, readme)}
    assert list(buttons.values())[0] == "Open in Colab"
    assert repository.colab_url(notebook) in buttons
    title = nbformat.read(REPO_ROOT / notebook, as_version=4).cells[0].source
    assert f"]({repository.colab_url(notebook)})" in title
    assert repository.colab_url(({*NOTEBOOKS} - {notebook}).pop()) not in title
    if notebook == ZH_NOTEBOOK:
        english = f"[English edition]({repository.blob_url(NOTEBOOK)})"
        assert title.partition("\n\n")[2].startswith(english)


def test_every_link_to_the_repositorys_files_follows_pyprojects_one_line(tmp_path):
    """Each link of the LINKING files names pyproject.toml's address; a fork sets
    that line and relinks them all."""
    here = repository.repository()
    for name in repository.LINKING:
        found = repository.own_links((REPO_ROOT / name).read_text(encoding="utf-8"))
        assert found and set(found) == {here}, name
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    toml = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    (fork := tmp_path / "pyproject.toml").write_text(toml.replace(here, "a/fork"))
    repository.relink(tmp_path, fork)
    for name in repository.LINKING:
        found = repository.own_links((tmp_path / name).read_text(encoding="utf-8"))
        assert found and set(found) == {"a/fork"}, name


def test_the_address_check_passes_this_repository_and_stops_on_another():
    """The site workflow's first check (GitHub's names ignore case)."""
    check = [sys.executable, "-m", "tools.repository", "--check"]
    for named, status in [(repository.repository().upper(), 0), ("a/fork", 1)]:
        result = subprocess.run([*check, named], capture_output=True, text=True)
        assert result.returncode == status, result.stderr
    assert "set that line to https://github.com/a/fork" in result.stderr


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_every_figure_and_the_results_reach_a_lone_notebook(notebook):
    """Each figure is an address of a committed file on main; the Results table is
    the committed run's (rerun tools.results_table after `make multi30k`)."""
    cells = nbformat.read(REPO_ROOT / notebook, as_version=4).cells
    markdown = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    own = repository.raw_url("")
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)", markdown)
    assert images
    for src in images:
        assert src.startswith(own), f"{src} does not reach a lone notebook"
        assert (REPO_ROOT / src.removeprefix(own)).is_file(), src
    lines = results_table.results_lines()
    record = json.loads((REPO_ROOT / "results" / "multi30k.json").read_text())
    bleu = f"| {record['test_greedy']['bleu']:.2f} |"
    assert bleu in lines[2] and bleu in markdown
    if notebook == NOTEBOOK:
        assert "\n".join(lines[:3]) in markdown


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the whole book, smoke profile: minutes on 2 cores
def test_the_notebook_alone_runs_top_to_bottom_on_colabs_versions(
    multi30k_dir, tmp_path
):
    """The committed notebook copied into an empty folder and run in .venv-colab,
    which holds Colab's versions (smoke profile, the data folder given): no cell
    fails, the setup cell finds nothing to install, it printed numbers and drew
    charts, and it wrote nothing beside itself."""
    if not COLAB_PYTHON.is_file():
        skip_or_fail_in_ci(os.environ, "no .venv-colab: `make setup-colab` makes it")
    (alone := tmp_path / "alone").mkdir()
    shutil.copy(REPO_ROOT / NOTEBOOK, alone / "book.ipynb")
    ours = ("JUPYTER", "PYTHONPATH", "VIRTUAL_ENV")  # no user kernel in the way
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    env |= {name: str(tmp_path) for name in ("JUPYTER_DATA_DIR", "IPYTHONDIR")}
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path)
    env |= {"ANNOTATED_TRANSFORMER_PROFILE": "smoke", tat.DATA_ENV: str(multi30k_dir)}
    run = functools.partial(subprocess.run, cwd=alone, env=env, capture_output=True)
    frozen = run([COLAB_PYTHON, "-m", "pip", "freeze"], text=True).stdout.lower()
    assert {pin for name, pin in COLAB.items() if name != "torch"} <= {*frozen.split()}
    execute = [COLAB_PYTHON.parent / "jupyter-execute", "--inplace", "book.ipynb"]
    result = run(execute, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    cells = nbformat.read(alone / "book.ipynb", as_version=4).cells
    outputs = [o for c in cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "installing what this Python lacks" not in printed
    assert "test 2016, greedy:" in printed  # Part 5 scored the notebook's own model
    chart = {"application/vnd.vegalite.v5+json", "image/png", "text/plain"}
    assert any(set(o.get("data", {})) == chart for o in outputs)
    assert [p.name for p in alone.iterdir()] == ["book.ipynb"]
