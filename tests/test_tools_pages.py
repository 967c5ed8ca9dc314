"""tools.pages, the site workflow's first step: it passes only when the repository's
GitHub Pages publishes from GitHub Actions, and otherwise says in one line which
setting to change (asked of a local stand-in for GitHub's API, never the network)."""

import http.server
import json
import threading

import pytest

from tools import pages

ANSWERS = {
    "o/actions": (200, {"build_type": "workflow"}),
    "o/branch": (200, {"build_type": "legacy"}),
    "o/private": (403, {"message": "Forbidden"}),
}


class FakeGitHub(http.server.BaseHTTPRequestHandler):
    """GET /repos/OWNER/NAME/pages as GitHub answers it; each request kept in seen."""

    seen = []

    def do_GET(self):
        self.seen.append((self.path, self.headers.get("Authorization")))
        name = self.path.removeprefix("/repos/").removesuffix("/pages")
        status, body = ANSWERS.get(name, (404, {"message": "Not Found"}))
        self.send_response(status)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def github():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeGitHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeGitHub.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize(
    "repository, says",
    [
        ("o/actions", None),
        ("o/missing", "GitHub Pages is not enabled for o/missing"),
        ("o/branch", "publishes from 'legacy'"),
        ("o/private", "answered 403"),
    ],
)
def test_pages_passes_only_when_publishing_from_actions(github, repository, says):
    problem = pages.pages_problem(repository, api=github, token="t")
    assert FakeGitHub.seen == [(f"/repos/{repository}/pages", "Bearer t")]
    if says is None:
        assert problem is None
    else:
        assert says in problem and "\n" not in problem
        if repository != "o/private":
            assert "Source: GitHub Actions" in problem


def test_pages_says_when_github_cannot_be_reached():
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens
    assert "could not ask GitHub's API" in pages.pages_problem("o/a", api=closed)
