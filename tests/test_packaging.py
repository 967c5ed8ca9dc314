"""The book and the workshop as an installed library.

`pip install .` builds a wheel from pyproject.toml's [project] table. Here the wheel
is built without network (`--no-build-isolation`, with the hatchling of the dev
extra), installed into a folder of its own, and used from an empty folder: `import
the_annotated_transformer` and `python -m workshop` must work there, from the
installed files, not from this checkout; torch and the rest are this environment's,
so that nothing is downloaded.
"""

import email
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from packaging.requirements import Requirement


def run(*args, cwd=None, target=None):
    """Run a command (with `target` on the import path); fail unless it succeeds."""
    env = {**os.environ, "PYTHONPATH": str(target)} if target else None
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built offline from the checkout, which the build leaves as it was."""
    out, before = tmp_path_factory.mktemp("wheel"), sorted(REPO_ROOT.iterdir())
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    run(*pip, "-w", out, REPO_ROOT)
    assert sorted(REPO_ROOT.iterdir()) == before  # no build/, dist/ or *.egg-info
    (built,) = out.glob("annotated_transformer-*.whl")
    return zipfile.ZipFile(built)


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """A folder the wheel is installed into, its dependencies this environment's."""
    target = tmp_path_factory.mktemp("installed")
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index"]
    run(*pip, "--target", target, wheel.filename)
    return target


def test_the_wheel_holds_the_book_and_workshop_and_needs_only_torch_and_numpy(wheel):
    names = wheel.namelist()
    assert {"the_annotated_transformer.py", "workshop/cli.py"} <= set(names)
    assert not [n for n in names if n.startswith(("tests/", "notebooks/", "results/"))]
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    wanted = email.message_from_bytes(wheel.read(metadata)).get_all("Requires-Dist")

    def needs(extra):
        found = [Requirement(line) for line in wanted]
        ok = [r for r in found if not r.marker or r.marker.evaluate({"extra": extra})]
        return {r.name.lower() for r in ok}

    assert needs("") == {"torch", "numpy"}  # no spaCy, altair or pandas
    assert needs("all") == needs("notebook") | needs("translate") | needs("pretrained")


@pytest.mark.slow
def test_the_installed_book_imports_from_an_empty_folder(installed, tmp_path):
    code = "import the_annotated_transformer as t, workshop as w; print(t.__file__)"
    code += "; print(w.__file__)"
    for path in run(sys.executable, "-c", code, cwd=tmp_path, target=installed).split():
        assert Path(path).is_relative_to(installed)  # not the checkout


def test_the_installed_command_line_and_its_script_answer_help(installed, tmp_path):
    python, script = sys.executable, installed / "bin" / "annotated-transformer"
    out = run(python, "-m", "workshop", "--help", cwd=tmp_path, target=installed)
    assert "translate" in out
    out = run(script, "translate", "--help", cwd=tmp_path, target=installed)
    assert "--checkpoint" in out and list(tmp_path.iterdir()) == []  # none written
