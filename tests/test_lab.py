"""`make lab` serves the book in JupyterLab, from the project's .venv.

The test runs `make lab` headless on a free port in a copy of the checkout (so that
saving through the server cannot touch the repository), with Jupyter's own folders
in a temporary place. It waits for the URL that `make lab` prints, opens it in
headless Chromium (the flags of the site test) and checks that the page shows the
book's title and its first code cell, that the book's folded cells show collapsed
and open on a click, and that a reader can run the first cells. It then asks the
same server what a reader's actions would do: open the .py as a notebook, save the
notebook, and run code in the kernel. The same server opens the Chinese edition,
a plain notebook paired with no .py, its Chinese drawn in a CJK font.
`make lab LAB_BOOK=...` opens it first. The server is stopped after.

JupyterLab is an optional install (`make setup-lab`, requirements-lab.txt), which
.ci/run makes before `make check`; without it the test skips, except in CI.
"""

import asyncio
import json
import os
import pty
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import jupytext
import nbformat
import pytest
from browser import Browser
from bs4 import BeautifulSoup
from conftest import (
    CHROMIUM_FLAGS,
    book_title,
    fold_tag,
    free_port,
    run_chromium,
    skip_or_fail_in_ci,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV = REPO_ROOT / ".venv"
BOOK = "the_annotated_transformer.py"
NOTEBOOK = "notebooks/the_annotated_transformer.ipynb"
ZH_NOTEBOOK = "notebooks/the_annotated_transformer.zh.ipynb"
# What `make lab` needs from a checkout; requirement files keep their times, so that
# make sees the venv's install stamps as up to date and installs nothing.
CHECKOUT_FILES = [
    "Makefile",
    "requirements.txt",
    "requirements-dev.txt",
    "requirements-lab.txt",
    "tools/lab/overrides.json",
    BOOK,
    NOTEBOOK,
    ZH_NOTEBOOK,
]
BOOK_URL = re.compile(
    r"http://127\.0\.0\.1:(\d+)/lab/tree/notebooks/the_annotated_transformer\.ipynb"
    r"\?token=(\w+)"
)

# Jupyter Book's tags (conftest.py's fold_tag) that fold a cell's code, or its output.
FOLD_INPUT = ("hide-input", "hide-cell")
FOLD_OUTPUT = ("hide-output", "hide-cell")

pytestmark = pytest.mark.slow


def lab_installed_or_skip(environ):
    """Skip unless `make setup-lab` is up to date in the .venv; fail in CI."""
    stamp = VENV / ".lab-installed"
    up_to_date = subprocess.run(
        ["make", "--question", str(stamp.relative_to(REPO_ROOT))],
        cwd=REPO_ROOT,
        capture_output=True,
        check=False,
    )
    if up_to_date.returncode == 0:
        return
    message = (
        "JupyterLab is not installed in .venv (or requirements-lab.txt changed since): "
        "run `make setup-lab` (.ci/run does)."
    )
    skip_or_fail_in_ci(environ, message)


class Lab:
    """`make lab` running in the background; `lines` collects what it prints."""

    def __init__(self, checkout, options, env):
        self.lines = []
        # Its input is a terminal, as in a reader's shell: Jupyter handles Ctrl-C its
        # own way only then (with input from a pipe, SIGINT just raises
        # KeyboardInterrupt), and that is the way `stop` tests.
        self.terminal, follower = pty.openpty()
        self.process = subprocess.Popen(
            ["make", "--no-print-directory", "lab"]
            + [f"{name}={value}" for name, value in options.items()],
            cwd=checkout,
            env=env,
            stdin=follower,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: make, sh and jupyter
        )
        os.close(follower)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)

    def output(self):
        return "".join(self.lines)

    def wait_for_url(self, timeout):
        """The book's URL, port and token, once printed and answering."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"make lab stopped:\n{self.output()}"
            match = BOOK_URL.search(self.output())
            if match and answers(int(match.group(1))):
                return match.group(0), int(match.group(1)), match.group(2)
            time.sleep(0.5)
        pytest.fail(f"make lab printed no URL in {timeout} s:\n{self.output()}")

    def stop(self, port, timeout=60):
        """Press Ctrl-C once: SIGINT to make, sh and jupyter, as a terminal sends it to
        its foreground group. Wait until the port is closed. Jupyter would ask
        "Shut down this Jupyter server (y/[n])?" and carry on unless make lab told it
        to answer yes; a server still up after `timeout` fails the test."""
        os.killpg(self.process.pid, signal.SIGINT)
        deadline = time.monotonic() + timeout
        while answers(port) and time.monotonic() < deadline:
            time.sleep(0.5)
        if answers(port):
            self.kill()
            pytest.fail(f"one Ctrl-C did not stop the server in {timeout} s")
        self.process.wait(timeout=timeout)
        os.close(self.terminal)
        # The output ends when the last of make, sh and jupyter has exited.
        self.reader.join(timeout=timeout)
        assert not self.reader.is_alive(), "a process of make lab is still running"

    def kill(self):
        """SIGKILL to whatever of make lab still runs; close its terminal."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        os.close(self.terminal)


def answers(port):
    """True while something accepts connections on 127.0.0.1:port."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A running `make lab` server: its checkout, URL, port, token and data folder."""
    lab_installed_or_skip(os.environ)
    root = tmp_path_factory.mktemp("lab")
    checkout = root / "checkout"
    for name in CHECKOUT_FILES:
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, checkout / name)
    data = root / "multi30k"  # exists, so make hands it to the kernel
    data.mkdir()
    env = dict(os.environ)
    env.pop("ANNOTATED_TRANSFORMER_DATA", None)  # must come from DATA_DIR
    for variable, name in [
        ("JUPYTER_CONFIG_DIR", "config"),
        ("JUPYTER_DATA_DIR", "data"),
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("IPYTHONDIR", "ipython"),
    ]:
        env[variable] = str(root / name)
    options = {
        "VENV": VENV,
        "DATA_DIR": data,
        "LAB_PORT": free_port(),
        "LAB_OPTIONS": "--no-browser",
    }
    server = Lab(checkout, options, env)
    try:
        url, port, token = server.wait_for_url(timeout=180)
    except BaseException:  # pytest.fail's exception included: leave nothing running
        server.kill()
        raise
    try:
        yield {
            "url": url,
            "port": port,
            "token": token,
            "checkout": checkout,
            "data": data,
        }
    finally:
        server.stop(port)
    assert "Shutting down" in server.output(), server.output()[-3000:]
    assert "Shut down this Jupyter server" not in server.output()  # it did not ask


def api(lab, path, method="GET", body=None):
    """Call the server's REST API; return the decoded JSON."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{lab['port']}/api/{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"token {lab['token']}"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        text = response.read()
    return json.loads(text) if text else None


def test_the_book_opens_in_jupyterlab_in_a_browser(lab, chromium, tmp_path):
    html = run_chromium(
        chromium,
        lab["url"],
        tmp_path / "profile",
        "--dump-dom",
        # JupyterLab builds the notebook with scripts after the page loads.
        "--virtual-time-budget=60000",
    )
    dom = BeautifulSoup(html, "html.parser")
    headings = [h.get_text(strip=True).rstrip("¶") for h in dom.select(".jp-Cell h1")]
    assert book_title() in headings, f"no title among {headings[:3]}"
    notebook = nbformat.read(REPO_ROOT / NOTEBOOK, as_version=4)
    first_code = next(c for c in notebook.cells if c.cell_type == "code").source
    shown = dom.select_one(".jp-CodeCell .cm-content")
    assert shown is not None, "the page shows no code cell"
    lines = [line.get_text() for line in shown.select(".cm-line")]
    assert [line for line in lines if line.strip()] == [
        line for line in first_code.splitlines() if line.strip()
    ]
    # jupytext's front end is loaded (it offers "Open With > Jupytext Notebook").
    config = json.loads(dom.select_one("#jupyter-config-data").get_text())
    extensions = {extension["name"] for extension in config["federated_extensions"]}
    assert "jupyterlab-jupytext" in extensions


def test_a_reader_runs_the_first_cells_in_the_page_and_sees_a_chart(
    lab, chromium, tmp_path
):
    """What a reader does first: click the top of the book and press Shift+Enter
    down to the first chart (a rendered text cell just passes the selection on). The
    code cells run in the kernel the page started, through the page's own websocket;
    their output, printed text and then the chart, drawn by JupyterLab's Vega
    renderer (no picture), comes back into the page."""
    cells = nbformat.read(REPO_ROOT / NOTEBOOK, as_version=4).cells

    def index(call):
        return next(i for i, c in enumerate(cells) if call in c.source)

    printing = index("show_example(example_layer_vs_batch_norm)")
    charting = index("show_example(chart_subsequent_mask)")
    cell = "document.querySelectorAll('.jp-Notebook .jp-Cell')"
    active = f"[...{cell}].findIndex(c => c.classList.contains('jp-mod-active'))"
    with Browser(chromium, CHROMIUM_FLAGS, tmp_path / "profile") as tab:
        tab.open(lab["url"], timeout=120)
        tab.wait_for(f"{cell}.length === {len(cells)}", timeout=120)
        middle = tab.evaluate(
            f"(() => {{ const box = {cell}[0].getBoundingClientRect();"
            " return [box.x + box.width / 2, box.y + box.height / 2]; })()"
        )
        tab.click(*middle)
        assert tab.evaluate(active) == 0

        def run_down_to(last):  # run the selected cell, select the next one
            for _ in range(len(cells)):
                if tab.evaluate(active) > last:
                    return
                tab.press("Enter", "Enter", 13, modifiers=8)  # 8: Shift
                time.sleep(0.2)
            raise AssertionError(f"Shift+Enter did not move on past cell {last}")

        # Each cell's output is read while it is on screen: JupyterLab takes cells far
        # from the view out of the page.
        run_down_to(printing)
        printed = tab.wait_for(
            f"{cell}[{printing}].querySelector('.jp-OutputArea')?.textContent",
            timeout=180,
            message="the cell that prints showed no output",
        )
        assert "LayerNorm: each row on its own" in printed
        run_down_to(charting)
        # JupyterLab's renderer for the Vega-Lite 5 output draws the marks itself.
        vega = f"{cell}[{charting}].querySelector('.jp-RenderedVegaLite')"
        drawn = f"{vega}?.querySelector('canvas.marks, svg.marks') != null"
        tab.wait_for(drawn, timeout=120, message="the chart was not drawn by Vega")
        assert tab.evaluate(f"{cell}[{charting}].querySelectorAll('img').length") == 0
        # JupyterLab's first-open question about the news never popped up.
        asked = "Would you like to get notified about official Jupyter news?"
        assert asked not in tab.evaluate("document.body.innerText")


def test_the_folded_cells_are_collapsed_and_a_click_opens_them(lab, chromium, tmp_path):
    """The book's support cells carry Jupyter Book's fold tags and, beside them,
    JupyterLab's own jupyter.source_hidden (and outputs_hidden). JupyterLab shows the
    code of each hide-input or hide-cell cell as its first line and "..." (its input
    placeholder), and the output of a hide-cell or hide-output cell as another; a
    click on an input placeholder shows the cell's code."""
    # The cells as JupyterLab gets them: jupytext reads the inputs from the .py.
    cells = jupytext.read(REPO_ROOT / BOOK).cells
    input_folded = [i for i, c in enumerate(cells) if fold_tag(c) in FOLD_INPUT]
    output_folded = [i for i, c in enumerate(cells) if fold_tag(c) in FOLD_OUTPUT]
    assert input_folded, "the book folds no cell"
    cell = "document.querySelectorAll('.jp-Notebook .jp-Cell')"

    def cells_with(tab, selector):
        """The indices of the cells that hold an element `selector` matches."""
        return tab.evaluate(
            f"[...{cell}].flatMap((c, i) => c.querySelector('{selector}') ? [i] : [])"
        )

    # A window taller than any folded cell (the tallest: 43 lines of about 17 pixels;
    # the test asserts that each fits), so that CodeMirror draws every line of it.
    size = (1280, 2000)
    with Browser(chromium, CHROMIUM_FLAGS, tmp_path / "profile", size=size) as tab:
        tab.open(lab["url"], timeout=120)
        tab.wait_for(f"{cell}.length === {len(cells)}", timeout=120)
        # JupyterLab builds a cell's insides while idle, after the cell itself.
        built = f"[...{cell}].every(c => c.querySelector('.jp-Cell-inputWrapper'))"
        tab.wait_for(built, timeout=120, message="JupyterLab did not build every cell")
        assert cells_with(tab, ".jp-InputPlaceholder") == input_folded
        assert cells_with(tab, ".jp-OutputPlaceholder") == output_folded
        for index in input_folded:
            source = cells[index].source
            this = f"{cell}[{index}]"
            # Folded: the first line of the code, and no editor.
            shown = tab.evaluate(
                f"{this}.querySelector('.jp-PlaceholderText').textContent"
            )
            assert shown == source.partition("\n")[0], index
            assert tab.evaluate(f"{this}.querySelector('.jp-InputArea')") is None
            tab.click_on(f"{this}.querySelector('.jp-InputPlaceholder')")
            # Open: the editor in place of the placeholder.
            tab.wait_for(
                f"{this}.querySelector('.jp-InputPlaceholder') === null"
                f" && {this}.querySelector('.jp-InputArea .cm-line') !== null",
                timeout=30,
                message=f"a click did not open cell {index}",
            )
            # CodeMirror draws only the lines near the view, and measures the view
            # after the first frame: bring the whole cell into view, then wait until
            # it has drawn as many lines as the cell has, and compare them.
            tab.evaluate(f"{this}.scrollIntoView({{block: 'start'}})")
            fits = f"{this}.getBoundingClientRect().height < innerHeight"
            assert tab.evaluate(fits), f"cell {index} is taller than the window"
            expected = [line for line in source.splitlines() if line.strip()]
            drawn = (
                f"[...{this}.querySelectorAll('.jp-InputArea .cm-line')]"
                ".map(line => line.textContent).filter(text => text.trim())"
            )
            tab.wait_for(f"{drawn}.length >= {len(expected)}", timeout=30)
            assert tab.evaluate(drawn) == expected, index


def served_defaults(lab, plugin):
    """The defaults the running server gives a plugin's settings. The overrides
    `make lab` copies become the defaults of the plugin's schema; no user setting
    (none in this test's fresh Jupyter folders) takes their place."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{lab['port']}/lab/api/settings/{plugin}",
        headers={"Authorization": f"token {lab['token']}"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    assert answer["settings"] == {}, answer["settings"]
    return {k: v.get("default") for k, v in answer["schema"]["properties"].items()}


def test_jupyterlab_asks_nothing_about_the_news_and_checks_for_no_update(lab):
    """The settings `make lab` hands JupyterLab: news never fetched (so it does not
    ask on first open whether to fetch them) and no update check."""
    defaults = served_defaults(lab, "@jupyterlab/apputils-extension:notification")
    assert defaults["fetchNews"] == "false"  # JupyterLab's own default, "none", asks
    assert defaults["checkForUpdates"] is False


def test_jupyterlab_puts_every_cell_of_the_book_in_the_page(lab):
    """`make lab` turns JupyterLab's windowing off: its own default
    ("contentVisibility") attaches cells in batches while the browser is idle, so a
    reader's Find, and the tests above, could meet a book with cells missing."""
    defaults = served_defaults(lab, "@jupyterlab/notebook-extension:tracker")
    assert defaults["windowingMode"] == "none"


def test_the_py_opens_as_the_same_notebook(lab):
    from_py = api(lab, f"contents/{BOOK}?type=notebook&content=1")["content"]
    from_ipynb = api(lab, f"contents/{NOTEBOOK}?content=1")["content"]
    cells = [(c["cell_type"], c["source"]) for c in from_ipynb["cells"]]
    assert [(c["cell_type"], c["source"]) for c in from_py["cells"]] == cells


def test_saving_the_notebook_writes_the_py_too(lab):
    model = api(lab, f"contents/{NOTEBOOK}?content=1")
    notebook = model["content"]
    marker = f"A note a reader added ({uuid.uuid4().hex})."
    notebook["cells"][0]["source"] += f"\n\n{marker}"
    api(lab, f"contents/{NOTEBOOK}", "PUT", {"type": "notebook", "content": notebook})
    book = (lab["checkout"] / BOOK).read_text(encoding="utf-8")
    assert f"# {marker}" in book
    saved = nbformat.read(lab["checkout"] / NOTEBOOK, as_version=4)
    assert saved.cells[0].source.endswith(marker)


def run_in_kernel(lab, code, timeout=120):
    """Start a kernel through the server, run `code`, return what it printed."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    kernel = api(lab, "kernels", "POST", {"name": "python3"})
    session = uuid.uuid4().hex

    async def talk():
        url = (
            f"ws://127.0.0.1:{lab['port']}/api/kernels/{kernel['id']}/channels"
            f"?session_id={session}"
        )
        headers = {"Authorization": f"token {lab['token']}"}
        socket = await websocket_connect(HTTPRequest(url, headers=headers))
        msg_id = uuid.uuid4().hex
        request = {
            "header": {
                "msg_id": msg_id,
                "msg_type": "execute_request",
                "session": session,
                "username": "test",
                "version": "5.3",
                "date": "",
            },
            "parent_header": {},
            "metadata": {},
            "content": {"code": code, "silent": False, "allow_stdin": False},
            "channel": "shell",
            "buffers": [],
        }
        await socket.write_message(json.dumps(request))
        printed = []
        while True:
            message = json.loads(await socket.read_message())
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            if message["msg_type"] == "stream":
                printed.append(message["content"]["text"])
            if message["msg_type"] == "error":
                raise AssertionError("\n".join(message["content"]["traceback"]))
            if (
                message["msg_type"] == "status"
                and message["content"]["execution_state"] == "idle"
            ):
                socket.close()
                return "".join(printed)

    try:
        return asyncio.run(asyncio.wait_for(talk(), timeout))
    finally:
        api(lab, f"kernels/{kernel['id']}", "DELETE")


def test_the_kernel_is_the_projects_venv_with_the_data_folder(lab):
    printed = run_in_kernel(
        lab,
        "import os, sys\n"
        "print(sys.prefix)\n"
        "print(os.environ.get('ANNOTATED_TRANSFORMER_DATA'))\n",
    )
    prefix, data = printed.splitlines()
    assert Path(prefix).resolve() == VENV.resolve()
    assert Path(data) == lab["data"]


def test_the_chinese_notebook_opens_in_jupyterlab_in_a_cjk_font(
    lab, chromium, tmp_path
):
    """The Chinese edition in the same server: every cell of the committed notebook,
    its Chinese title shown, and every Chinese character of the page drawn in a CJK
    font (Chromium's own report: tests/browser.py's drawn_outside), no box."""
    from test_site import CJK_FONTS

    committed = nbformat.read(REPO_ROOT / ZH_NOTEBOOK, as_version=4)
    title = committed.cells[0].source.partition("\n")[0].removeprefix("# ")
    # A workspace of its own: the default one would restore the English notebook
    # that the tests above opened, beside this one.
    url = lab["url"].replace(
        f"/lab/tree/{NOTEBOOK}", f"/lab/workspaces/zh-edition/tree/{ZH_NOTEBOOK}"
    )
    notebook = "document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)')"
    with Browser(chromium, CHROMIUM_FLAGS, tmp_path / "profile") as tab:
        tab.open(url, timeout=120)
        cells = f"{notebook}?.querySelectorAll('.jp-Cell').length"
        tab.wait_for(f"{cells} === {len(committed.cells)}", timeout=120)
        heading = f"{notebook}.querySelector('.jp-Cell h1')?.textContent"
        shown = tab.wait_for(heading, timeout=60, message="no title in the page")
        assert shown.rstrip("¶") == title
        panels = "document.querySelectorAll('.jp-NotebookPanel').length"
        assert tab.evaluate(panels) == 1  # the Chinese notebook alone
        rendered = f"{notebook}.querySelectorAll('.jp-RenderedMarkdown').length"
        markdown = sum(c.cell_type == "markdown" for c in committed.cells)
        tab.wait_for(f"{rendered} === {markdown}", timeout=60)
        elements, outside = tab.drawn_outside(CJK_FONTS, script="Han")
    assert outside == []
    assert elements >= 300


def test_the_chinese_notebook_is_a_plain_notebook_that_saves_alone(lab):
    """Saved through the server, the Chinese notebook writes itself and nothing
    beside it (jupytext pairs the English notebook with the .py, not this one)."""
    model = api(lab, f"contents/{ZH_NOTEBOOK}?content=1")
    committed = nbformat.read(REPO_ROOT / ZH_NOTEBOOK, as_version=4)
    got = [(c["cell_type"], c["source"]) for c in model["content"]["cells"]]
    assert got == [(c.cell_type, c.source) for c in committed.cells]
    book = (lab["checkout"] / BOOK).read_bytes()
    notebook = model["content"]
    notebook["cells"][0]["source"] += "\n\n读者加的一句话。"
    api(
        lab, f"contents/{ZH_NOTEBOOK}", "PUT", {"type": "notebook", "content": notebook}
    )
    saved = nbformat.read(lab["checkout"] / ZH_NOTEBOOK, as_version=4)
    assert saved.cells[0].source.endswith("读者加的一句话。")
    beside = [
        path.relative_to(lab["checkout"]).as_posix()
        for path in lab["checkout"].rglob("the_annotated_transformer.zh*")
        if ".ipynb_checkpoints" not in path.parts
    ]
    assert beside == [ZH_NOTEBOOK]
    assert (lab["checkout"] / BOOK).read_bytes() == book


def test_make_lab_opens_the_notebook_lab_book_names():
    """`make lab LAB_BOOK=...` opens the Chinese edition first, and `make lab` the
    book (make -n: nothing runs)."""
    for book, overrides in ((ZH_NOTEBOOK, [f"LAB_BOOK={ZH_NOTEBOOK}"]), (NOTEBOOK, [])):
        printed = subprocess.run(
            ["make", "-n", "--no-print-directory", "lab", *overrides],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert f"--LabApp.default_url=/lab/tree/{book}" in printed
