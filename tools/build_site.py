"""Build the book's website (`make site`): one folder that a static host serves.

    python -m tools.build_site --out site

The folder holds
  index.html                        the book, every cell run, as one offline page
                                    (tools.export_html: math, charts, figures inside)
  the_annotated_transformer.ipynb   the executed notebook, outputs included
  zh/index.html                     the Chinese edition's page (中文版), and beside it
  zh/the_annotated_transformer.zh.ipynb   its notebook, with the same outputs
  images/                           the figures, for linking to them one by one
  .nojekyll                         GitHub Pages serves the files as they are
Each page links to the other at its top (中文 / English).

The book is read from the_annotated_transformer.py, so the site shows the book as it
stands even before `make notebook`. Its cells run with the kernel `python3` of the
Python that runs this script (the project's .venv under `make site`), in the folder
being built: a cell that wrote a file would show up in the site, and the tests check
that none does. The profile comes from $ANNOTATED_TRANSFORMER_PROFILE (the book's
default, `quick`, when unset) and Part 3 finds Multi30k through
$ANNOTATED_TRANSFORMER_DATA. The Chinese notebook is built from its catalogue
(tools.translation) before anything runs, so a cell without a current
translation stops the build at once. The folder is built beside --out and replaces
it only once complete, so a failed build leaves the previous site as it was.
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BOOK = REPO_ROOT / "the_annotated_transformer.py"
IMAGES = REPO_ROOT / "images"
PROFILE_ENV = "ANNOTATED_TRANSFORMER_PROFILE"
# The editions, in the order of the link at the top of each page: (language, the
# link's words, the page's folder in the site).
EDITIONS = [("zh", "中文", "zh"), ("en", "English", "")]


class BuildError(Exception):
    """Something the person building the site can fix; the message says what."""


def check_environment(environ):
    """Fail early, in one line, on a profile or data folder the notebook cannot use."""
    from the_annotated_transformer import DATA_ENV, MULTI30K_SHA256, PROFILES

    profile = environ.get(PROFILE_ENV, "quick")
    if profile not in PROFILES:
        raise BuildError(
            f"${PROFILE_ENV} is {profile!r}; use one of {', '.join(PROFILES)}."
        )
    data = environ.get(DATA_ENV)
    if data and not Path(data).is_dir():
        raise BuildError(
            f"${DATA_ENV} names {data}, which is not a folder; point it at the "
            "Multi30k folder (make site DATA_DIR=...) or unset it."
        )
    folder = Path(data) if data else None
    missing = [n for n in MULTI30K_SHA256 if folder and not (folder / n).is_file()]
    if missing:  # the notebook would skip Part 3's examples: a broken site
        raise BuildError(
            f"${DATA_ENV} names {data}, which lacks {', '.join(missing)}; fill it "
            f"with `make data DATA_DIR={data}`, or point DATA_DIR at the Multi30k "
            "folder."
        )
    if not data:
        print(
            f"note: ${DATA_ENV} is not set, so Part 3 reads data/multi30k and "
            "downloads Multi30k there if it is not there yet (`make site` runs "
            "`make data` first).",
            flush=True,
        )
    return profile


def execute(notebook, folder):
    """Run every cell of `notebook` in `folder`, printing each as it finishes."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    code_cells = sum(cell.cell_type == "code" for cell in notebook.cells)
    done, start = 0, time.perf_counter()

    def report(cell, cell_index, execute_reply):
        nonlocal done
        if cell.cell_type != "code":
            return
        done += 1
        first_line = cell.source.strip().partition("\n")[0][:60]
        elapsed = time.perf_counter() - start
        print(f"[{done}/{code_cells}, {elapsed:5.0f} s] {first_line}", flush=True)

    client = NotebookClient(
        notebook,
        timeout=3600,
        kernel_name="python3",
        resources={"metadata": {"path": str(folder)}},
        on_cell_executed=report,
    )
    try:
        client.execute()
    except CellExecutionError as error:
        failed = next((c for c in notebook.cells if _cell_failed(c)), None)
        first_line = failed.source.strip().partition("\n")[0][:60] if failed else "?"
        name = getattr(error, "ename", None) or type(error).__name__
        value = " ".join(str(getattr(error, "evalue", "") or "").split())
        raise BuildError(
            f"the cell that starts {first_line!r} failed: {name}: {value}"
        ) from error


def _cell_failed(cell):
    """Whether an executed code cell holds an error output."""
    outputs = cell.get("outputs", []) if cell.cell_type == "code" else []
    return any(output.get("output_type") == "error" for output in outputs)


def editions_seen_from(language):
    """The links at the top of the page of `language`: (language, words, address
    relative to that page, or None for the page itself)."""
    here = next(folder for lang, _, folder in EDITIONS if lang == language)
    up = "../" * len(Path(here).parts)
    links = []
    for lang, words, folder in EDITIONS:
        page = f"{up}{folder}/index.html" if folder else f"{up}index.html"
        links.append((lang, words, None if lang == language else page))
    return links


def translated_notebook(lang):
    """The LANG notebook built from its catalogue; BuildError, saying which cells,
    when one has no current translation."""
    from tools import translation

    try:
        notebook, _ = translation.translated_notebook(lang)
    except translation.TranslationError as error:
        raise BuildError(str(error)) from error
    return notebook


def with_outputs_of(notebook, executed):
    """`notebook` (a translation) with the outputs of `executed` (the English book,
    run): the code cells are the same, character for character, in the same order
    (tests/test_chinese_edition.py checks it), so running them a second time would
    spend as long again to print the same. `make execute` and tests/test_colab.py
    do run the Chinese notebook itself."""
    ours = [c for c in notebook.cells if c.cell_type == "code"]
    run = [c for c in executed.cells if c.cell_type == "code"]
    if [c.source for c in ours] != [c.source for c in run]:
        raise BuildError(
            "the translated notebook's code cells are not the book's: rebuild it "
            "with `make translations`"
        )
    for cell, done in zip(ours, run, strict=True):
        cell.outputs = done.outputs
        cell.execution_count = done.execution_count
    if "language_info" in executed.metadata:
        notebook.metadata["language_info"] = executed.metadata["language_info"]
    return notebook


def build_site(out):
    """Build the site into `out`; return the path of its index.html."""
    out = Path(out).resolve()
    profile = check_environment(os.environ)
    import jupytext  # the notebook tools, a second of imports: after the checks
    import nbformat

    from tools.export_html import export_html
    from tools.repository import blob_url
    from tools.translation import ENGLISH_NOTEBOOK, notebook_name

    chinese = translated_notebook("zh")  # before the minutes of running the book
    building = out.with_name(out.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)

    print(f"executing the book with the {profile} profile in {building}", flush=True)
    notebook = jupytext.read(BOOK)
    execute(notebook, building)
    # A copy to read and download, not a second source: unpaired from the .py.
    notebook.metadata.pop("jupytext", None)
    executed = building / "the_annotated_transformer.ipynb"
    nbformat.write(notebook, executed)
    export_html(executed, building / "index.html", editions=editions_seen_from("en"))

    start = time.perf_counter()
    (building / "zh").mkdir()
    translated = building / "zh" / Path(notebook_name("zh")).name
    nbformat.write(with_outputs_of(chinese, notebook), translated)
    export_html(
        translated,
        building / "zh" / "index.html",
        language="zh",
        editions=editions_seen_from("zh"),
        # Its line to the English edition: the page beside it, not GitHub's.
        links={blob_url(ENGLISH_NOTEBOOK): "../index.html"},
    )
    seconds = time.perf_counter() - start
    print(f"wrote the Chinese page, zh/index.html, in {seconds:.0f} s", flush=True)
    shutil.copytree(IMAGES, building / "images")
    (building / ".nojekyll").touch()

    previous = out.with_name(out.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    if out.exists():
        out.rename(previous)
    building.rename(out)
    shutil.rmtree(previous, ignore_errors=True)
    return out / "index.html"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tools.build_site", description=__doc__.partition("\n")[0]
    )
    parser.add_argument("--out", default="site", help="the site's folder (site/)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        index = build_site(args.out)
    except BuildError as error:
        sys.exit(f"make site: {error}")
    minutes = (time.perf_counter() - start) / 60
    print(f"wrote {index} ({index.stat().st_size:,} bytes) in {minutes:.1f} min")


if __name__ == "__main__":
    main()
