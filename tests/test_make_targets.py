"""The Makefile's targets that run the command line (`make data`, `make results-*`),
and the venv it makes, each in a copy of the checkout with a stand-in venv:
nothing is installed; and the site's build, which fails in one line."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, names_in

from workshop import multi30k

REPO_ROOT = Path(__file__).resolve().parent.parent


def executable(path, text):
    path.write_text(text)
    path.chmod(0o755)
    return path


def make(tmp_path, *targets, python=sys.executable, **variables):
    """Run make TARGETS in a copy of the checkout whose venv's python is `python`
    (an installed venv: its stamp is newer than requirements.txt)."""
    checkout, venv = tmp_path / "checkout", tmp_path / "venv"
    shutil.copytree(REPO_ROOT / "workshop", checkout / "workshop", dirs_exist_ok=True)
    for name in ("Makefile", "the_annotated_transformer.py", "requirements.txt"):
        shutil.copy2(REPO_ROOT / name, checkout / name)
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    executable(venv / "bin" / "python", f'#!/bin/sh\nexec {python} "$@"\n')
    (venv / ".installed").touch()
    argv = ["make", "--no-print-directory", *targets, f"VENV={venv}"]
    argv += [f"{name}={value}" for name, value in variables.items()]
    # Not the variables of a make that runs the tests: its DATA_DIR would win.
    env = {k: v for k, v in os.environ.items() if "MAKE" not in k and k != "DATA_DIR"}
    return subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True)


def committed(tmp_path, name):
    """results/NAME in the copy of the checkout, as if committed."""
    log = tmp_path / "checkout" / "results" / name
    log.parent.mkdir(parents=True)
    log.write_text("the committed log\n")
    return log


@pytest.mark.parametrize("version", ["3.10", "3.11", "3.12", "3.13", "3.14"])
def test_make_makes_the_venv_with_python_3_11_to_3_13_and_refuses_another(
    version, tmp_path
):
    """A stand-in `python` that reports `version` and makes a venv as an empty
    bin/python; another version is refused in one line, and no venv made."""
    major, minor = version.split(".")
    python = executable(
        tmp_path / f"python{version}",
        '#!/bin/sh\n[ "$1" = "-m" ] && mkdir -p "$3/bin" && touch "$3/bin/python" '
        f'&& exit\nexec {sys.executable} -c "import sys; sys.version_info = '
        f'({major}, {minor}, 0); exec(sys.argv[2])" "$@"\n',
    )
    result = make(tmp_path, "venv/bin/python", PYTHON=python, VENV="venv")
    made = (tmp_path / "checkout" / "venv" / "bin" / "python").is_file()
    assert made == (version in ("3.11", "3.12", "3.13")), result.stderr
    if not made:
        assert f"is Python {version}" in result.stderr
        assert "3.11 3.12 3.13" in result.stderr


@pytest.mark.parametrize("status", [0, 1])
def test_a_results_log_replaces_the_committed_one_only_when_the_run_succeeds(
    status, tmp_path
):
    # The venv's python stands in for reproduce: its arguments, a line on stderr.
    script = f'#!/bin/sh\necho "ran: $*"\necho "on stderr" >&2\nexit {status}\n'
    fake = executable(tmp_path / "reproduce", script)
    log = committed(tmp_path, "quick.log")
    result = make(tmp_path, "results-quick", python=fake, DATA_DIR=tmp_path / "d")
    assert names_in(log.parent) == ["quick.log"]  # no partial log, either way
    assert (result.returncode == 0) == (status == 0), result.stderr
    ran = f"ran: -m workshop reproduce --profile quick --data-dir {tmp_path / 'd'} "
    ran += "--out runs/quick --results results --images images\non stderr\n"
    assert log.read_text() == (ran if status == 0 else "the committed log\n")


@pytest.mark.slow
def test_make_data_fills_the_default_folder_or_fails_in_one_line_leaving_none(
    multi30k_server, tmp_path
):
    # The default DATA_DIR must be fetched; first from a closed port, as offline.
    log = committed(tmp_path, "multi30k.log")
    closed = f"http://127.0.0.1:{free_port()}/"
    failed = make(tmp_path, "multi30k", DATA_URL=closed)  # stops at its data
    error, make_says = failed.stderr.splitlines()
    assert error.startswith(f"error: train.de.gz: could not download it from {closed}")
    assert make_says.startswith("make: *** [Makefile:") and "data] Error 1" in make_says
    assert not (tmp_path / "checkout" / "data").exists()
    assert names_in(log.parent) == ["multi30k.log"]
    assert log.read_text() == "the committed log\n"
    fetched = make(tmp_path, "data", DATA_URL=multi30k_server.url)
    assert fetched.returncode == 0, fetched.stderr
    folder = tmp_path / "checkout" / "data" / "multi30k"
    assert names_in(folder) == sorted(multi30k.MULTI30K_SHA256)


@pytest.mark.slow
def test_a_failing_cell_makes_the_site_build_fail_in_one_line(tmp_path):
    import nbformat

    from tools import build_site

    cells = ["x = 1", "y = x / 0  # divide\nprint(y)"]
    cells = [nbformat.v4.new_code_cell(source) for source in cells]
    with pytest.raises(build_site.BuildError) as error:
        build_site.execute(nbformat.v4.new_notebook(cells=cells), tmp_path)
    message = str(error.value)
    assert "\n" not in message and "y = x / 0" in message
    assert "ZeroDivisionError: division by zero" in message
