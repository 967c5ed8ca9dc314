"""docs/build_on_it.md: the example runs as written and prints what the page says.

The page trains the book's model on a task of its own (reversing ten digits), reads its
attention, saves and reloads it. Its Python block is run as it stands, in an empty
folder, with only the repository on the import path, and its output must equal the
text block below it, line for line: held-out sequences reversed exactly, the source
positions the first decoder layer reads, and the reloaded model decoding the same.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGE = REPO_ROOT / "docs" / "build_on_it.md"


def blocks(language):
    """The page's fenced code blocks of one language, in order."""
    text = PAGE.read_text(encoding="utf-8")
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


@pytest.mark.slow
def test_the_build_on_it_example_prints_what_the_page_says(tmp_path):
    (code,), (printed,) = blocks("python"), blocks("text")
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == printed
    assert "warning" not in done.stderr.lower()  # no trap was sprung on the way
    assert sorted(p.name for p in tmp_path.iterdir()) == ["example.py", "reverse.pt"]
