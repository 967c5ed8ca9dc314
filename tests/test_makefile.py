"""The Makefile's test targets, run with a stand-in for the venv's Python that records
what it was asked to do: `make test` is the quick tier, `make check` what CI runs,
and `make data test` hands the tests the folder that `data` has just filled."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    shutil.which("make") is None, reason="GNU make is not installed"
)

# `make test` and the first pass of `make check` run in pytest-xdist workers, one per
# core, each test file whole in one (tests/conftest.py's units of work).
PARALLEL = "-n auto --dist loadfile"

# Answers `-m workshop download --data-dir DIR` by making DIR, as the downloader
# would; every call is written to the log with the data folder the tests would see.
STAND_IN = """#!/bin/sh
echo "$* | data=${ANNOTATED_TRANSFORMER_DATA:-none}" >> "$LOG"
case "$*" in *"$FAIL_ON"*) [ -n "$FAIL_ON" ] && echo "failed: $*" && exit 3;; esac
if [ "$1 $2 $3" = "-m workshop download" ]; then mkdir -p "$5"; fi
"""


@pytest.fixture
def make(tmp_path):
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "LOG": str(log)}
    env.pop("ANNOTATED_TRANSFORMER_DATA", None)
    env.pop("DATA_DIR", None)
    env.pop("CI", None)  # lint without node fails under CI=true; the stand-in has none
    # Not the outer run's pytest options or workers, nor the variables of a make that
    # runs this test (`make test TEST_JOBS=0` hands them on in MAKEFLAGS).
    for name in ("PYTEST_ARGS", "TEST_JOBS", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"):
        env.pop(name, None)

    def run(*targets, data_dir, fail_on=""):
        """The calls make made; with fail_on, the calls holding it exit 3, and run
        returns make's CompletedProcess instead."""
        # Install stamps newer than every requirements file: nothing is installed.
        stamps = tmp_path / "installed", tmp_path / "installed-run"
        for stamp in stamps:
            stamp.touch()
        overrides = [
            f"VENV_PYTHON={python}",
            f"BIN={tmp_path}",
            f"STAMP={stamps[0]}",
            f"RUN_STAMP={stamps[1]}",
            f"DATA_DIR={data_dir}",
            f"PLAIN_LOG={tmp_path / 'plain.log'}",
            "HAVE_NODE=",
        ]
        done = subprocess.run(
            ["make", "--no-print-directory", *targets, *overrides],
            cwd=REPO_ROOT,
            env={**env, "FAIL_ON": fail_on},
            capture_output=True,
            text=True,
        )
        if fail_on:
            return done
        assert done.returncode == 0, done.stderr
        return log.read_text().splitlines() if log.exists() else []

    (tmp_path / "ruff").write_text('#!/bin/sh\necho "ruff $*" >> "$LOG"\n')
    (tmp_path / "ruff").chmod(0o755)
    return run


def test_make_data_test_hands_the_tests_the_folder_data_has_just_made(make, tmp_path):
    data = tmp_path / "fresh" / "multi30k"
    calls = make("data", "test", data_dir=data)
    download, tests = calls
    assert download.startswith(f"-m workshop download --data-dir {data}")
    assert tests == f"-m pytest {PARALLEL} -m not slow | data={data}"


def test_without_the_data_folder_the_tests_are_told_of_none(make, tmp_path):
    """Control: the folder is looked for, not assumed."""
    calls = make("test", data_dir=tmp_path / "absent")
    assert calls == [f"-m pytest {PARALLEL} -m not slow | data=none"]


def test_make_test_is_the_quick_tier_and_make_check_everything_ci_runs(make, tmp_path):
    calls = make("check", data_dir=tmp_path)
    ruff = calls[0].partition(" | ")[0]
    assert calls[1].startswith("ruff format --check")
    assert ruff == "ruff check ."
    # The two passes run at once: in either order in the log.
    full, plain = sorted((c.partition(" | ")[0] for c in calls[2:]), key=len)
    assert full == f"-m pytest {PARALLEL}"  # every test, the slow ones included
    assert plain == "-m pytest -p no:cacheprovider -m numerical"  # in one process
    script = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = [line.strip() for line in script.splitlines()]
    assert commands[-1] == "make check"


@pytest.mark.parametrize("failing", ["-m numerical", "--dist loadfile"])
def test_make_check_fails_when_either_pass_fails_and_prints_the_second(
    make, tmp_path, failing
):
    """The second pass runs beside the first: its failure fails `make check` as the
    first one's does, and its output is printed either way."""
    done = make("check", data_dir=tmp_path, fail_on=failing)
    assert done.returncode != 0
    assert "The numerical tests on the plain code path" in done.stdout
    failed = [line for line in done.stdout.splitlines() if line.startswith("failed:")]
    assert len(failed) == 1 and failing in failed[0]


def test_make_html_runs_the_book_again_only_when_the_book_is_newer(tmp_path):
    """The executed notebooks are files that depend on the book (and the Chinese one
    on its catalogue): `make html` exports a stale run never, and a current one
    without running it again. `make -n` prints what it would run."""
    book, catalogue, stamp = (tmp_path / n for n in ("book.py", "zh.po", "stamp"))
    executed, zh_executed = tmp_path / "en.ipynb", tmp_path / "zh.ipynb"

    def planned():
        done = subprocess.run(
            [
                "make",
                "-n",
                "--no-print-directory",
                "html",
                f"BOOK={book}",
                f"CATALOGUE={catalogue}",
                f"STAMP={stamp}",
                "NEEDS_DATA=",
                f"EXECUTED={executed}",
                f"ZH_EXECUTED={zh_executed}",
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        return [line for line in done.stdout.splitlines() if "nbconvert" in line]

    for path in (book, stamp, catalogue, executed, zh_executed):
        path.touch()
    os.utime(book, (1, 1))  # older than both runs
    assert planned() == []
    os.utime(catalogue, None)  # the translation changed: the Chinese run is stale
    os.utime(zh_executed, (2, 2))
    (line,) = planned()
    assert f"--output {zh_executed.name} " in line
    os.utime(book, None)  # the book changed: both are stale
    assert len(planned()) == 2


def test_the_tests_sent_to_one_worker_together_exist():
    """tests/conftest.py sends the tests that share an expensive fixture to one
    xdist worker by file, test name and parameter: a renamed one would silently be
    made twice."""
    from conftest import SAME_WORKER, worker_unit

    for key, unit in SAME_WORKER.items():
        file, _, test = key.partition("::")
        file, _, param = file.partition("[")
        text = (REPO_ROOT / "tests" / file).read_text(encoding="utf-8")
        assert not test or f"\ndef {test}(" in text, key
        nodeid = f"tests/{file}::{test or 'test_any'}[{param.rstrip(']') or 'x'}]"
        assert worker_unit(nodeid) == unit, key
    part2 = "tests/test_part2_training.py::test_x"
    seed_1 = worker_unit(part2 + "[seed 1]")
    assert seed_1 == worker_unit("tests/test_part4_decoding.py::test_x")
    assert worker_unit(part2 + "[seed 2]") not in (seed_1, "test_part2_training.py")
    assert worker_unit(part2 + "[1000]") == "test_part2_training.py"
