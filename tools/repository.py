"""The repository's public address, read from its one place: pyproject.toml's
[project.urls] Repository. Everything that links to the repository's files from
outside the checkout (the "Open in Colab" links, the figures of a lone notebook)
is derived from it, and tests/test_colab.py checks that they agree.

    python -m tools.repository                  prints OWNER/NAME
    python -m tools.repository --check O/N      exits 1, saying which line to set,
                                                unless the address is github.com/O/N
    python -m tools.repository --relink         rewrites the links of LINKING files
                                                to the address pyproject.toml names
"""

import argparse
import re
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = REPO_ROOT / "pyproject.toml"
GITHUB = "https://github.com/"
BRANCH = "main"


def repository(pyproject=PYPROJECT):
    """OWNER/NAME of the GitHub repository that pyproject.toml names."""
    with open(pyproject, "rb") as f:
        url = tomllib.load(f)["project"]["urls"]["Repository"]
    if not url.startswith(GITHUB) or url.rstrip("/").count("/") != 4:
        raise ValueError(f"{pyproject}: Repository = {url!r} is not {GITHUB}OWNER/NAME")
    return url.rstrip("/").removeprefix(GITHUB)


def raw_url(path, pyproject=PYPROJECT):
    """Where GitHub serves the file `path` (relative to the root) of main, as is."""
    return f"https://raw.githubusercontent.com/{repository(pyproject)}/{BRANCH}/{path}"


def blob_url(path, pyproject=PYPROJECT):
    """The page on GitHub that shows the file `path` of main."""
    return f"{GITHUB}{repository(pyproject)}/blob/{BRANCH}/{path}"


def colab_url(path, pyproject=PYPROJECT):
    """The address that opens the notebook `path` of main in Google Colab."""
    return (
        f"https://colab.research.google.com/github/{repository(pyproject)}"
        f"/blob/{BRANCH}/{path}"
    )


# The files that link to the repository's own files from outside the checkout, and
# the links' forms: each group 1 is an OWNER/NAME. The Chinese catalogue holds the
# book's figures' addresses in each cell's English and its translation alike: both
# are rewritten, so its entries stay current (tools.translation).
LINKING = (
    "README.md",
    "the_annotated_transformer.py",
    "translations/zh/the_annotated_transformer.po",
)
OWN_LINK = re.compile(
    r"https://(?:raw\.githubusercontent\.com|github\.com"
    r"|colab\.research\.google\.com/github)"
    rf"/([\w.-]+/[\w.-]+)/(?:blob/)?{BRANCH}/"
)


def own_links(text):
    """The OWNER/NAME of every link of `text` to a file of the repository's main."""
    return OWN_LINK.findall(text)


def relink(root=REPO_ROOT, pyproject=PYPROJECT):
    """Point every such link of the LINKING files at pyproject.toml's repository."""
    here = repository(pyproject)
    for name in LINKING:
        path = Path(root) / name
        text = path.read_text(encoding="utf-8")
        new = OWN_LINK.sub(lambda m: m.group(0).replace(m.group(1), here), text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"{name}: links now point at {GITHUB}{here}")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tools.repository", description=__doc__.partition("\n\n")[0]
    )
    parser.add_argument("--check", metavar="OWNER/NAME")
    parser.add_argument("--relink", action="store_true")
    args = parser.parse_args(argv)
    here = repository()
    if args.relink:
        relink()
    elif args.check is None:
        print(here)
    elif args.check.lower() != here.lower():
        sys.exit(
            f"pyproject.toml names {GITHUB}{here} (the Repository line under "
            f"[project.urls]), but this is {args.check}: set that line to "
            f"{GITHUB}{args.check}, then run `python -m tools.repository --relink` "
            "and `make notebook`, and commit what they change."
        )


if __name__ == "__main__":
    main()
