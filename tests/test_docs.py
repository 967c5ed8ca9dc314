"""The fenced blocks of README.md and docs/*.md, run as written.

A page's ```sh, ```bash and ```python blocks run in order, in an empty folder, with
the Multi30k folder as the data. A shell block's `python -m workshop` lines run with
the command line's main, STDIN on their standard input (`< F`); its other lines
(make targets) are not run here. A `train` line is stood in by a smoke-sized
random model in its --out: last.pt and epoch_001.pt to epoch_004.pt. A python block
runs in a process of its own, the checkout on its import path; it warns of nothing
and prints the next block, if a ```text one. A block after `<!-- not run: WHY -->`
(the network, a GPU) is only parsed, as every command line is in the quick tier.
"""

import io
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, tiny_checkpoint

from workshop import cli

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(
    r"(<!-- not run: [^>]*-->\n)?```(sh|bash|python)\n(.*?)```"
    r"(?:\n(?:(?!```)[^\n]*\n)*```text\n(.*?)```)?",
    re.DOTALL,
)
COMMAND = re.compile(r"(?:^|\s)\S*python3?\s+-m\s+workshop\s(.*)")
CAPTURE = dict(capture_output=True, text=True)
STDIN = "Zwei Hunde spielen im Schnee.\n\nEin Mann fährt Fahrrad.\n"


def blocks(page):
    """(where, language, code, the text printed or None, whether something in it
    runs) of each block."""
    text = page.read_text(encoding="utf-8")
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start(2)) + 1
        runs = not m[1] and (m[2] == "python" or any(command_lines(m[3])))
        yield f"{page.relative_to(REPO_ROOT)}:{line}", m[2], m[3], m[4], runs


def command_lines(code):
    """The arguments after `-m workshop` of each command line, up to `<` or `>`."""
    for line in code.replace("\\\n", " ").splitlines():
        if found := COMMAND.search(line):
            words = shlex.split(found[1], comments=True)
            yield list(itertools.takewhile(lambda w: w not in ("<", ">"), words))


def test_every_documented_command_line_parses():
    codes = [b[2] for page in PAGES for b in blocks(page) if b[1] != "python"]
    lines = [argv for code in codes for argv in command_lines(code)]
    assert len(lines) >= 12  # the control: the blocks' lines are found
    for argv in lines:
        cli.build_parser().parse_args(argv)  # argparse's exit fails the test


RUN = [page for page in PAGES if any(b[4] for b in blocks(page))]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stand_in")
    for epoch in range(1, 5):
        tiny_checkpoint(folder / f"epoch_{epoch:03d}.pt", seed=epoch, epoch=epoch)
    shutil.copy(folder / "epoch_004.pt", folder / "last.pt")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN, ids=[p.name for p in RUN])
def test_the_pages_blocks_run_as_written(
    page, stand_in, multi30k_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ANNOTATED_TRANSFORMER_DATA", str(multi30k_dir))
    for where, language, code, printed, runs in blocks(page):
        if runs and language == "python":
            env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}  # as the pages say
            done = subprocess.run([sys.executable, "-c", code], env=env, **CAPTURE)
            assert done.returncode == 0, f"{where}:\n{done.stderr}"
            assert "warning" not in done.stderr.lower(), f"{where}:\n{done.stderr}"
            assert printed is None or done.stdout == printed, where
        for argv in command_lines(code) if runs and language != "python" else []:
            if argv[0] == "train":
                out = cli.build_parser().parse_args(argv).out
                shutil.copytree(stand_in, out, dirs_exist_ok=True)
                continue
            monkeypatch.setattr(sys, "stdin", io.StringIO(STDIN))  # for `< F`
            status, (_, err) = cli.main(argv), capsys.readouterr()
            assert status == 0, f"{where}: {argv}\n{err}"
