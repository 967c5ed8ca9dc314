"""The book and the workshop as an installed library.

`pip install .` builds a wheel from pyproject.toml's [project] table. Here the wheel
is built without network (`--no-build-isolation`, with the pinned hatchling of
requirements-dev.txt), installed into a fresh virtual environment, and used from an
empty folder: `import the_annotated_transformer` and `python -m workshop` must work
there, from the installed files, not from this checkout. The fresh environment
borrows this environment's dependencies (torch and the rest) through a .pth file, so
that nothing is downloaded.
"""

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def run(*args, cwd=None):
    """Run a command; fail the test with its output unless it succeeds."""
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def top_level():
    """The names at the checkout's top level."""
    return sorted(path.name for path in REPO_ROOT.iterdir())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built offline from the checkout itself, which the build must leave as
    it was (its backend, hatchling, builds in a folder of its own)."""
    out, before = tmp_path_factory.mktemp("wheel"), top_level()
    pip = [sys.executable, "-m", "pip"]
    run(*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", out, REPO_ROOT)
    (built,) = out.glob("annotated_transformer-*.whl")
    assert top_level() == before  # no build/, dist/ or *.egg-info left behind
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """The Python of a fresh venv with the wheel installed (dependencies borrowed)."""
    venv = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = run(python, "-c", where)
    ours = sysconfig.get_path("purelib")  # torch, numpy, ... of this environment
    (Path(purelib.strip()) / "borrowed.pth").write_text(ours + "\n", encoding="utf-8")
    pip = [sys.executable, "-m", "pip", "--python", python]
    run(*pip, "install", "--no-deps", "--no-index", wheel)
    return python


def requirements_of(wheel):
    """The wheel's Requires-Dist, as {extra (None: always): package names}."""
    found = {}
    (metadata,) = [
        n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("METADATA")
    ]
    for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines():
        if line.startswith("Requires-Dist: "):
            spec, _, marker = line.removeprefix("Requires-Dist: ").partition(";")
            extra = marker.split("extra ==")[-1].strip(" '\"") if marker else None
            name = spec.split("[")[0].split(">")[0].split("=")[0].strip().lower()
            found.setdefault(extra, set()).add(name.replace("_", "-"))
    return found


def test_the_book_alone_needs_torch_and_numpy_and_the_rest_are_extras(wheel):
    needs = requirements_of(wheel)
    assert needs[None] == {"torch", "numpy"}  # no spaCy, altair or pandas
    assert {"pandas", "altair"} <= needs["notebook"]
    assert {"spacy", "sacrebleu", "tokenizers"} <= needs["translate"]
    assert {"huggingface-hub", "safetensors", "sentencepiece"} <= needs["pretrained"]
    assert needs["all"] == needs["notebook"] | needs["translate"] | needs["pretrained"]


@pytest.mark.slow
def test_the_wheel_holds_the_book_and_the_workshop_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "the_annotated_transformer.py" in names
    assert "workshop/__main__.py" in names and "workshop/cli.py" in names
    assert not [n for n in names if n.startswith(("tests/", "notebooks/", "results/"))]
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


@pytest.mark.slow
def test_the_installed_book_imports_from_an_empty_folder(installed, tmp_path):
    code = (
        "import the_annotated_transformer as tat, workshop; "
        "print(tat.__file__); print(workshop.__file__); "
        "model = tat.make_model(11, 11, N=1, d_model=32, d_ff=64, h=2); "
        "print(tat.count_parameters(model))"
    )
    book, package, count = run(installed, "-c", code, cwd=tmp_path).split()
    for path in (book, package):
        assert REPO_ROOT not in Path(path).parents  # installed, not the checkout
        assert "site-packages" in path
    assert int(count) > 0


def test_the_installed_command_line_answers_help_from_an_empty_folder(
    installed, tmp_path
):
    out = run(installed, "-m", "workshop", "--help", cwd=tmp_path)
    for command in ("train", "translate", "evaluate"):
        assert command in out
    assert list(tmp_path.iterdir()) == []  # asking for help writes nothing


def test_the_installed_console_script_is_the_command_line(installed, tmp_path):
    script = installed.parent / "annotated-transformer"
    out = run(script, "translate", "--help", cwd=tmp_path)
    assert "--pretrained" in out and "--checkpoint" in out
