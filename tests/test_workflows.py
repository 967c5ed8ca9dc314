"""The GitHub Actions workflows, read as YAML: CI runs the project's own script, once
per commit, with pip's downloads cached; the Pages workflow stops early when Pages is
not set to publish from Actions (tools.pages, tested against a local server), and
publishes what `make site` builds. (`make lint` runs actionlint on them too.)"""

import http.server
import json
import re
import threading
from pathlib import Path

import pytest
import yaml

from tools import pages

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO_ROOT / ".github" / "workflows"
CI_WORKFLOW = WORKFLOWS / "ci.yml"
PAGES_WORKFLOW = WORKFLOWS / "site.yml"


def load(path):
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def triggers(workflow):
    return workflow.get("on", workflow.get(True))  # YAML 1.1 reads `on` as true


def steps(workflow):
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def test_ci_runs_the_projects_own_script_with_ci_set():
    workflow = load(CI_WORKFLOW)
    (job,) = workflow["jobs"].values()
    runs = [step["run"] for step in job["steps"] if "run" in step]
    assert runs == ["bash .ci/run"]  # ending in make check: tests/test_makefile.py
    assert job["env"]["CI"] == "true"


def makefile_pythons():
    """The Python versions the Makefile makes its .venv with (PYTHON_VERSIONS)."""
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    (line,) = re.findall(r"^PYTHON_VERSIONS := (.*)$", makefile, re.MULTILINE)
    return line.split()


def test_ci_runs_on_every_python_that_make_accepts_each_in_its_image():
    (job,) = load(CI_WORKFLOW)["jobs"].values()
    assert job["strategy"]["matrix"]["python"] == makefile_pythons()
    assert job["container"] == "python:${{ matrix.python }}-bookworm"
    assert job["strategy"]["fail-fast"] is False  # one Python's failure hides none


def test_ci_runs_once_per_commit_and_cancels_superseded_runs():
    workflow = load(CI_WORKFLOW)
    on = triggers(workflow)
    assert on["push"] == {"branches": ["main"]}  # branches run as pull requests
    assert "pull_request" in on
    concurrency = workflow["concurrency"]
    assert "github.ref" in concurrency["group"]
    assert concurrency["cancel-in-progress"] is True


def test_ci_caches_pips_downloads_keyed_on_the_requirements():
    (cache,) = [
        step["with"]
        for step in steps(load(CI_WORKFLOW))
        if step.get("uses", "").startswith("actions/cache@")
        and step["with"]["path"] == "~/.cache/pip"
    ]
    assert re.search(r"hashFiles\('requirements\*\.txt'\)", cache["key"])


class FakeGitHub(http.server.BaseHTTPRequestHandler):
    """GET /repos/OWNER/NAME/pages as GitHub's API answers it: `answers` maps a
    repository to (status, JSON body); every request is kept in `seen`."""

    answers, seen = {}, []

    def do_GET(self):
        FakeGitHub.seen.append((self.path, self.headers.get("Authorization")))
        repository = self.path.removeprefix("/repos/").removesuffix("/pages")
        status, body = self.answers.get(repository, (404, {"message": "Not Found"}))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def github():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeGitHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeGitHub.answers = {
        "o/actions": (200, {"build_type": "workflow"}),
        "o/branch": (200, {"build_type": "legacy"}),
        "o/private": (403, {"message": "Forbidden"}),
    }
    FakeGitHub.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_pages_check_passes_only_when_pages_publishes_from_actions(github):
    assert pages.pages_problem("o/actions", api=github, token="t") is None
    assert FakeGitHub.seen == [("/repos/o/actions/pages", "Bearer t")]
    for repository, says in [
        ("o/missing", "GitHub Pages is not enabled for o/missing"),
        ("o/branch", "publishes from 'legacy'"),
    ]:
        problem = pages.pages_problem(repository, api=github, token="t")
        assert says in problem and "Source: GitHub Actions" in problem
    assert "answered 403" in pages.pages_problem("o/private", api=github, token="t")


def test_the_pages_check_says_when_github_cannot_be_reached(github):
    closed = "http://127.0.0.1:9"  # discard: nothing listens
    assert "could not ask GitHub's API" in pages.pages_problem("o/a", api=closed)


def test_the_site_workflow_checks_pages_first_and_does_not_rely_on_enablement():
    """The workflow's token cannot turn Pages on (configure-pages' `enablement`
    needs an administrator's token): the build stops before any work instead."""
    (build,) = [load(PAGES_WORKFLOW)["jobs"]["build"]]
    runs = [step.get("run", "") for step in build["steps"]]
    check = next(i for i, run in enumerate(runs) if "-m tools.pages" in run)
    setup = next(i for i, run in enumerate(runs) if "make setup" in run)
    assert check < setup
    assert "github.token" in build["steps"][check]["env"]["GITHUB_TOKEN"]
    configure = [s for s in build["steps"] if "configure-pages" in s.get("uses", "")]
    assert configure and all("enablement" not in s.get("with", {}) for s in configure)


def test_pages_workflow_publishes_what_make_site_builds_on_pushes_to_main():
    workflow = load(PAGES_WORKFLOW)
    assert triggers(workflow)["push"]["branches"] == ["main"]
    assert workflow["permissions"]["pages"] == "write"
    assert workflow["permissions"]["id-token"] == "write"  # deploy-pages needs both
    build, deploy = workflow["jobs"]["build"], workflow["jobs"]["deploy"]
    runs = [step.get("run") for step in build["steps"]]
    uses = [
        (step["uses"].partition("@")[0], step.get("with", {}))
        for step in build["steps"]
        if "uses" in step
    ]
    data = build["env"]["DATA_DIR"]
    # The data is downloaded by the project's own command into the cached folder,
    # before the same target a reader runs builds the site from it.
    download = '.venv/bin/python -m workshop download --data-dir "$DATA_DIR"'
    make_site = 'make site DATA_DIR="$DATA_DIR"'
    assert ("actions/cache", {"path": data, "key": "multi30k-task1-raw-v1"}) in uses
    assert runs.index("make setup") < runs.index(download) < runs.index(make_site)
    artifact = dict(uses)["actions/upload-pages-artifact"]
    assert artifact["path"] == "site"  # SITE_DIR's default
    assert deploy["needs"] == "build"
    assert [step["uses"].partition("@")[0] for step in deploy["steps"]] == [
        "actions/deploy-pages"
    ]
