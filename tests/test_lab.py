"""`make lab` serves the book in JupyterLab, from the project's .venv, offline.

The test runs `make lab` headless on a free port in a copy of the checkout (so that
saving through the server cannot touch the repository), with Jupyter's own folders
in a temporary place, and opens the URL it prints in headless Chromium
(tests/browser.py). The page shows the book, asks nothing and fetches nothing but
from the server and the book's own figures; the book's folded cells show collapsed
and open on a click; a reader runs the first cells, sees a chart, and finds the
kernel is the project's .venv with the data folder. Through the server's API, the
.py opens as the same notebook and saving writes both. The same server opens the
Chinese edition, its Chinese drawn in a CJK font. One Ctrl-C stops the server,
without asking.
"""

import contextlib
import json
import os
import pty
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import jupytext
import nbformat
import pytest
from browser import drawn_outside, requested_urls, start_chromium, wait_for
from conftest import free_port, skip_or_fail_in_ci
from selenium.webdriver import ActionChains, Keys
from test_site import ALL, CJK_FONTS, fold_tag, non_blank, script

import the_annotated_transformer as tat
from tools import repository

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV = REPO_ROOT / ".venv"
BOOK = "the_annotated_transformer.py"
NOTEBOOK = "notebooks/the_annotated_transformer.ipynb"
ZH_NOTEBOOK = "notebooks/the_annotated_transformer.zh.ipynb"
CELLS = ALL % ".jp-Notebook .jp-Cell"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A running `make lab`: its checkout, URL, port, token and data folder. Its
    input is a terminal, as in a reader's shell: Jupyter handles Ctrl-C its own way
    only then, and that is the way the end of this fixture tests."""
    if subprocess.run(["make", "-q", ".venv/.installed"], cwd=REPO_ROOT).returncode:
        skip_or_fail_in_ci(os.environ, "The .venv is not up to date: `make setup`.")
    root = tmp_path_factory.mktemp("lab")
    checkout, data, log = root / "checkout", root / "multi30k", root / "lab.log"
    # What `make lab` needs; requirements.txt keeps its time, so that make finds the
    # venv's install stamp up to date and installs nothing.
    needs = ["Makefile", "requirements.txt", "tools/lab/overrides.json", BOOK]
    for name in [*needs, NOTEBOOK, ZH_NOTEBOOK]:
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, checkout / name)
    data.mkdir()  # exists, so make hands it to the kernel
    env = {k: v for k, v in os.environ.items() if k != tat.DATA_ENV}
    for variable in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR"):
        env[variable] = str(root / variable)
    env["IPYTHONDIR"] = str(root / "ipython")
    port, terminal = free_port(), pty.openpty()
    options = [f"VENV={VENV}", f"DATA_DIR={data}", f"LAB_PORT={port}"]
    make = ["make", "--no-print-directory", "lab", *options, "LAB_OPTIONS=--no-browser"]
    out = log.open("w")
    io = dict(stdin=terminal[1], stdout=out, stderr=out, start_new_session=True)
    process = subprocess.Popen(make, cwd=checkout, env=env, **io)  # make, sh, jupyter
    url = re.compile(rf"http://127\.0\.0\.1:{port}/lab/tree/{NOTEBOOK}\?token=(\w+)")
    try:
        deadline = time.monotonic() + 180
        while not (found := url.search(log.read_text())):
            alive = process.poll() is None and time.monotonic() < deadline
            assert alive, log.read_text()
            time.sleep(0.5)
        yield dict(
            url=found[0], token=found[1], port=port, checkout=checkout, data=data
        )
        # One Ctrl-C: SIGINT to make, sh and jupyter, as a terminal sends it to its
        # foreground group. Jupyter would ask "Shut down this Jupyter server
        # (y/[n])?" and carry on, unless make lab told it to answer yes.
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)  # make ends once jupyter has
        assert "Shutting down" in log.read_text()
        assert "Shut down this Jupyter server" not in log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        for end in terminal:
            os.close(end)


def api(lab, name, body=None, query="content=1"):
    """GET a file or notebook from the server's contents API, or PUT `body`."""
    url = f"http://127.0.0.1:{lab['port']}/api/contents/{name}?{query}"
    data = body and json.dumps({"type": "notebook", "content": body}).encode()
    request = urllib.request.Request(
        f"{url}&token={lab['token']}", data, method="PUT" if body else "GET"
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())["content"]


def press(browser, *keys, modifier=Keys.SHIFT):
    ActionChains(browser).key_down(modifier).send_keys(*keys).key_up(modifier).perform()


def open_book(browser, url, cells):
    """Open JupyterLab at `url`; wait until the notebook holds all `cells` (make lab
    turns windowing off, so that none is missing from the page)."""
    browser.get(url)
    wait_for(browser, f"{CELLS}.length === {cells}", 120, "the notebook did not open")


def test_the_folded_cells_are_collapsed_and_a_click_opens_them(lab):
    """The book's cells tagged hide-input (or hide-cell) carry JupyterLab's
    jupyter.source_hidden beside the tag, and hide-output (or hide-cell) its
    outputs_hidden: JupyterLab shows each such part as a placeholder (the code's
    first line and "..."), and a click on an input placeholder shows the code."""
    cells = jupytext.read(REPO_ROOT / BOOK).cells  # what the server reads
    tags = [{fold_tag(cell)} for cell in cells]
    folded = [
        [i for i, t in enumerate(tags) if t & {part, "hide-cell"}]
        for part in ("hide-input", "hide-output")
    ]
    assert folded[0], "the book folds no cell"
    placeholders = ".flatMap((c, i) => c.querySelector('.jp-%sPlaceholder') ? [i] : [])"
    # A window taller than any folded cell (asserted), so that CodeMirror draws
    # every line of it.
    with start_chromium(size=(1280, 2000)) as browser:
        open_book(browser, lab["url"], len(cells))
        # JupyterLab builds a cell's insides while idle, after the cell itself.
        built = f"{CELLS}.every(c => c.querySelector('.jp-Cell-inputWrapper'))"
        wait_for(browser, built, 120, "JupyterLab did not build every cell")
        for part, indices in zip(("Input", "Output"), folded, strict=True):
            assert script(browser, CELLS + placeholders % part) == indices
        for index in folded[0]:
            this, code = f"{CELLS}[{index}]", non_blank(cells[index].source)
            shown = script(browser, f"{this}.querySelector('.jp-PlaceholderText')")
            assert shown.get_property("textContent") == code[0]
            assert script(browser, f"{this}.querySelector('.jp-InputArea')") is None
            browser.execute_script(f"{this}.scrollIntoView({{block: 'start'}})")
            shown.click()
            lines = f"[...{this}.querySelectorAll('.jp-InputArea .cm-line')]"
            drawn = f"{lines}.map(line => line.textContent).filter(t => t.trim())"
            wait_for(browser, f"{drawn}.length >= {len(code)}", 30, index)
            assert script(
                browser, f"{this}.getBoundingClientRect().height < innerHeight"
            )
            assert script(browser, drawn) == code, index


def test_a_reader_runs_the_first_cells_in_the_kernel_of_the_projects_venv(lab):
    """The page shows the book's title; a click on the top of the book, then
    Shift+Enter down to the first chart (a rendered text cell just passes the
    selection on), runs the code cells in the page's kernel: the chart comes back,
    drawn by JupyterLab's Vega renderer. A cell the reader adds prints the
    kernel's Python and data folder: the .venv's, make's DATA_DIR. JupyterLab asked
    nothing about its news, and fetched nothing from elsewhere."""
    cells = nbformat.read(REPO_ROOT / NOTEBOOK, as_version=4).cells
    chart = next(
        i for i, c in enumerate(cells) if "(chart_subsequent_mask)" in c.source
    )
    active = f"{CELLS}.findIndex(c => c.classList.contains('jp-mod-active'))"
    with start_chromium() as browser:
        open_book(browser, lab["url"], len(cells))
        title = script(browser, f"{CELLS}[0].querySelector('h1').innerText")
        assert title.rstrip("¶") == cells[0].source.partition("\n")[0][2:]
        browser.find_element("css selector", ".jp-Notebook .jp-Cell").click()
        while script(browser, active) <= chart:  # run a cell, select the next
            press(browser, Keys.ENTER)
            time.sleep(0.2)
        output = f"{CELLS}[{chart}].querySelector('.jp-OutputArea')"
        drawn = f"{output}.querySelector('.jp-RenderedVegaLite .marks')"
        wait_for(browser, drawn, 180, "the chart was not drawn by Vega")
        assert script(browser, f"{output}.querySelector('img')") is None
        # A cell of the reader's own, below the selected one.
        ActionChains(browser).send_keys(Keys.ESCAPE, "b", Keys.ENTER).perform()
        code = "import os, sys; print('kernel', sys.prefix, os.environ[%r])"
        ActionChains(browser).send_keys(code % tat.DATA_ENV).perform()
        press(browser, Keys.ENTER)
        said = f"{ALL % '.jp-OutputArea-output'}.map(o => o.innerText)"
        said += ".find(text => text.startsWith('kernel '))"
        prefix, data = wait_for(browser, said, 60).split()[1:]
        assert (Path(prefix).resolve(), Path(data)) == (VENV.resolve(), lab["data"])
        text = script(browser, "document.body.innerText")
        assert "Would you like to get notified about official Jupyter news?" not in text
        # Nothing but the server's, besides the book's figures (on main, for a lone
        # notebook; none of JupyterLab's own news, updates or extensions).
        ours = (f"http://127.0.0.1:{lab['port']}/", "data:", repository.raw_url(""))
        urls = requested_urls(browser)
        assert lab["url"] in urls and [u for u in urls if not u.startswith(ours)] == []


def test_the_py_opens_as_the_notebook_and_saving_the_notebook_writes_both(lab):
    from_py = api(lab, BOOK, query="type=notebook&content=1")
    notebook = api(lab, NOTEBOOK)
    assert [(c["cell_type"], c["source"]) for c in from_py["cells"]] == [
        (c["cell_type"], c["source"]) for c in notebook["cells"]
    ]
    notebook["cells"][0]["source"] += "\n\nA note a reader added."
    api(lab, NOTEBOOK, notebook)
    book = (lab["checkout"] / BOOK).read_text(encoding="utf-8")
    assert "# A note a reader added." in book
    saved = nbformat.read(lab["checkout"] / NOTEBOOK, as_version=4)
    assert saved.cells[0].source.endswith("A note a reader added.")


def test_the_chinese_notebook_opens_in_jupyterlab_in_a_cjk_font(lab):
    """In a workspace of its own (the default one would restore the English
    notebook beside it): its Chinese title, every cell, every Chinese character
    drawn in a CJK font (tests/test_chinese_edition.py: it is a plain notebook,
    paired with no .py)."""
    committed = nbformat.read(REPO_ROOT / ZH_NOTEBOOK, as_version=4)
    url = lab["url"].replace("/lab/tree/", "/lab/workspaces/zh/tree/")
    with start_chromium() as browser:
        open_book(browser, url.replace(NOTEBOOK, ZH_NOTEBOOK), len(committed.cells))
        title = wait_for(browser, f"{CELLS}[0].querySelector('h1')?.textContent")
        assert title.rstrip("¶") == committed.cells[0].source.partition("\n")[0][2:]
        markdown = sum(c.cell_type == "markdown" for c in committed.cells)
        wait_for(browser, f"{ALL % '.jp-RenderedMarkdown'}.length === {markdown}")
        elements, outside = drawn_outside(browser, CJK_FONTS)
    assert outside == [] and elements >= 300
