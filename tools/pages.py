"""Stop the site workflow early, with the one setting to change, when the
repository's GitHub Pages does not publish from GitHub Actions.

    python -m tools.pages OWNER/NAME

It asks GitHub's REST API (GET /repos/OWNER/NAME/pages) with $GITHUB_TOKEN, at
$GITHUB_API_URL (GitHub's own address when unset). The workflow's token cannot turn
Pages on (actions/configure-pages' `enablement` needs a token of an administrator),
so this is a one-time setting that a person makes, as README.md says.
"""

import json
import os
import sys
import urllib.error
import urllib.request

SETTING = (
    "set it once in the repository's Settings > Pages > Build and deployment > "
    "Source: GitHub Actions, then run this workflow again"
)


def pages_problem(repository, api=None, token=None, timeout=30):
    """None when Pages publishes from GitHub Actions, else one line saying why not."""
    api = (api or os.environ.get("GITHUB_API_URL") or "https://api.github.com").rstrip(
        "/"
    )
    request = urllib.request.Request(f"{api}/repos/{repository}/pages")
    request.add_header("Accept", "application/vnd.github+json")
    token = token if token is not None else os.environ.get("GITHUB_TOKEN")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            site = json.load(response)
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return f"GitHub Pages is not enabled for {repository}: {SETTING}."
        return f"GitHub's API answered {error.code} about {repository}'s Pages."
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        return f"could not ask GitHub's API about Pages ({error})."
    if site.get("build_type") != "workflow":
        source = site.get("build_type") or "unknown"
        return f"GitHub Pages of {repository} publishes from {source!r}: {SETTING}."
    return None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].count("/") != 1:
        sys.exit("usage: python -m tools.pages OWNER/NAME")
    problem = pages_problem(argv[0])
    if problem:
        sys.exit(f"error: {problem}")
    print(f"GitHub Pages of {argv[0]} publishes from GitHub Actions.")


if __name__ == "__main__":
    main()
