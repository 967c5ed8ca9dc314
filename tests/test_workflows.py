"""The GitHub Actions workflows, read as YAML: CI runs the project's own script, once
per commit, on current actions, with pip's downloads cached; the Pages workflow
publishes what `make site` builds. (`make lint` runs actionlint on them too.)"""

import re
from pathlib import Path

import yaml
from conftest import CHROMIUM_FLAGS

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO_ROOT / ".github" / "workflows"
CI_WORKFLOW = WORKFLOWS / "ci.yml"
PAGES_WORKFLOW = WORKFLOWS / "site.yml"

# The current major version of every action the workflows use.
MAJORS = {
    "actions/checkout": "v5",
    "actions/cache": "v4",
    "actions/configure-pages": "v5",
    "actions/upload-pages-artifact": "v4",
    "actions/deploy-pages": "v4",
}


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
    assert runs == ["bash .ci/run"]  # which runs make lint, then make test
    assert job["env"]["CI"] == "true"
    script = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = [line.strip() for line in script.splitlines()]
    assert commands.index("make lint") < commands.index("make test")


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


def test_every_action_is_at_its_current_major_version():
    for path in (CI_WORKFLOW, PAGES_WORKFLOW):
        for step in steps(load(path)):
            if "uses" in step:
                action, _, version = step["uses"].partition("@")
                assert version == MAJORS[action], f"{path.name}: {step['uses']}"


def test_configure_pages_enables_pages_when_it_is_not_yet():
    (configure,) = [
        step
        for step in steps(load(PAGES_WORKFLOW))
        if step.get("uses", "").startswith("actions/configure-pages@")
    ]
    assert configure["with"]["enablement"] is True


def test_headless_chromium_does_not_rely_on_a_containers_small_dev_shm():
    assert "--disable-dev-shm-usage" in CHROMIUM_FLAGS


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
