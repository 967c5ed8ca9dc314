"""`make site` builds the book's website: one page that a browser renders offline.

The build (conftest.py's `built_site`: `make site` with the smoke profile) runs every
cell of the book and writes the page with tools.export_html, the exporter behind
`make html` too. Headless Chromium (Debian's, which .ci/run installs) then opens the
page from disk with every host name unresolvable, takes a screenshot and dumps the
DOM after its scripts ran: the title, the table of contents and the typeset math
must all be there without the network. Driven through its DevTools protocol
(tests/browser.py), the same browser then does what a reader does with the charts:
every chart must be drawn, the page must request nothing but itself, pointing at a
cell of the attention maps must show that cell's query, key and weight, and the
menus must show the kind, layer and head picked. And as a reader skips the support
cells: each cell the book folds (Jupyter Book's hide-input, hide-output and
hide-cell tags) is a closed fold that a click opens, on the book's page and on a
small notebook with every tag. The site has two pages, the book and its Chinese
edition (site/zh/), and each test of a page runs on both (the fixture
`edition`): each links to the other at its top, and every Chinese character of a
page is drawn in a CJK font, with no missing-glyph box (the fonts Chromium used,
read through the DevTools protocol). (tests/test_workflows.py checks that the
GitHub Pages workflow builds the site with the same target.)
"""

import json
import os
import re
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from urllib.parse import unquote

import nbformat
import pytest
from browser import Browser
from bs4 import BeautifulSoup
from conftest import CHROMIUM_FLAGS, book_title, fold_tag, run_chromium
from test_notebook import is_beam_chart, not_shown

from tools.export_html import FONT_STACKS, LATIN_FONTS

REPO_ROOT = Path(__file__).resolve().parent.parent

IMAGES = REPO_ROOT / "images"
VEGA_LITE = "application/vnd.vegalite.v5+json"
# Each edition's page and executed notebook in the site, and its committed notebook.
PAGES = {"en": "index.html", "zh": "zh/index.html"}
EXECUTED = {
    "en": "the_annotated_transformer.ipynb",
    "zh": "zh/the_annotated_transformer.zh.ipynb",
}
COMMITTED = {
    "en": "notebooks/the_annotated_transformer.ipynb",
    "zh": "notebooks/the_annotated_transformer.zh.ipynb",
}
CONTENTS = {"en": r"^\s*(Table of )?[Cc]ontents\s*$", "zh": r"^\s*目录\s*$"}
# The CJK fonts the Chinese page names (Debian's fonts-wqy-microhei, which .ci/run
# installs, among them).
CJK_FONTS = {
    name.strip('"')
    for name in FONT_STACKS["zh"]
    if name not in LATIN_FONTS and name != "sans-serif"
}

pytestmark = pytest.mark.slow


def png_pixels(data):
    """Yield the pixels of an 8-bit, non-interlaced PNG, row by row, as byte strings.

    A small decoder (zlib and the five PNG filters) so that the test needs no imaging
    library; it is lazy, so a caller that has seen enough pixels can stop early.
    """
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    chunks, pos = {}, 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        chunks.setdefault(kind, []).append(data[pos + 8 : pos + 8 + length])
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(
        ">IIBBBBB", chunks[b"IHDR"][0]
    )
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[colour]
    assert depth == 8 and interlace == 0, "only 8-bit, non-interlaced PNGs"
    raw = zlib.decompress(b"".join(chunks[b"IDAT"]))
    bpp, stride = channels, width * channels
    previous = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, row = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            left = row[i - bpp] if i >= bpp else 0
            up = previous[i]
            if kind == 1:
                row[i] = (row[i] + left) & 255
            elif kind == 2:
                row[i] = (row[i] + up) & 255
            elif kind == 3:
                row[i] = (row[i] + (left + up) // 2) & 255
            elif kind == 4:
                up_left = previous[i - bpp] if i >= bpp else 0
                estimate = left + up - up_left
                pa, pb, pc = (abs(estimate - v) for v in (left, up, up_left))
                nearest = left if pa <= pb and pa <= pc else up if pb <= pc else up_left
                row[i] = (row[i] + nearest) & 255
        previous = row
        yield [bytes(row[x : x + bpp]) for x in range(0, stride, bpp)]


def distinct_colours(data, enough):
    """How many distinct pixel values the PNG holds, counting up to `enough`."""
    seen = set()
    for row in png_pixels(data):
        seen.update(row)
        if len(seen) >= enough:
            break
    return len(seen)


@pytest.fixture(scope="module", params=sorted(PAGES))
def edition(request):
    """Which edition's page a test reads: "en", the book, or "zh", its Chinese."""
    return request.param


@pytest.fixture(scope="module")
def page(built_site, edition):
    """The edition's page as `make site` wrote it."""
    return built_site / PAGES[edition]


@pytest.fixture(scope="module")
def page_notebook(built_site, edition):
    """The executed notebook beside the edition's page."""
    return built_site / EXECUTED[edition]


@pytest.fixture(scope="module")
def screenshot(chromium, page, tmp_path_factory):
    folder = tmp_path_factory.mktemp("screenshot")
    path = folder / "page.png"
    run_chromium(
        chromium,
        page.as_uri(),
        folder / "profile",
        f"--screenshot={path}",
        "--window-size=1280,4000",
    )
    return path


@pytest.fixture(scope="module")
def dom(chromium, page, tmp_path_factory):
    """The page's DOM after its scripts (MathJax) ran, parsed."""
    folder = tmp_path_factory.mktemp("dom")
    html = run_chromium(chromium, page.as_uri(), folder / "profile", "--dump-dom")
    return BeautifulSoup(html, "html.parser")


def test_page_is_titled_with_the_books_title(dom, edition):
    assert dom.title is not None
    title = nbformat.read(REPO_ROOT / COMMITTED[edition], as_version=4).cells[0]
    heading = title.source.partition("\n")[0].removeprefix("# ").strip()
    assert dom.title.get_text(strip=True) == heading
    if edition == "en":
        assert heading == book_title()


def test_the_page_shows_what_the_book_teaches_by_doing(dom):
    """The five pieces of the book that put numbers on screen show their output (the
    lines of tests/test_notebook.py's TEACHING_BY_DOING), and the beam of beam search
    is a chart of the page, with its spec beside it (the PNG stays in the notebook:
    test_every_chart_is_drawn_in_the_page)."""
    assert not_shown(dom.get_text()) == []
    specs = dom.find_all("script", id=re.compile(r"^chart-\d+-spec$"))
    beams = [spec for spec in specs if is_beam_chart(json.loads(spec.string))]
    assert len(beams) == 1, [spec["id"] for spec in specs]
    assert dom.find(id=beams[0]["id"].removesuffix("-spec"), class_="vega-chart")


def test_table_of_contents_links_to_sections_of_the_page(dom, edition):
    label = dom.find(string=re.compile(CONTENTS[edition]))
    assert label is not None, "no 'Contents' heading in the page"
    contents = label.find_next(["ol", "ul"])
    links = [a["href"] for a in contents.find_all("a", href=True)]
    assert len(links) >= 5, f"the table of contents has only {links}"
    ids = {element["id"] for element in dom.find_all(id=True)}
    for href in links:
        assert href.startswith("#"), f"{href} does not point into the page"
        # Browsers match the fragment as written, then percent-decoded.
        fragment = href[1:]
        assert {fragment, unquote(fragment)} & ids, f"no section with the id {href}"


@pytest.fixture(scope="module")
def opened(chromium, page, tmp_path_factory):
    """The page open in a headless Chromium that a test can point and click in, once
    every chart is drawn: (the browser, the number of charts)."""
    with Browser(chromium, CHROMIUM_FLAGS, tmp_path_factory.mktemp("browser")) as tab:
        tab.open(page.as_uri())
        charts = tab.evaluate("document.querySelectorAll('.vega-chart').length")
        drawn = "document.querySelectorAll('.vega-chart svg .role-mark').length"
        tab.wait_for(f"{drawn} >= {charts}", message="a chart was not drawn")
        # The math is typeset too, so nothing moves any more under the pointer.
        tab.evaluate("MathJax.startup.promise.then(() => true)")
        yield tab, charts


def test_every_chart_is_drawn_in_the_page(opened, page_notebook):
    tab, charts = opened
    notebook = nbformat.read(page_notebook, as_version=4)
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert charts == sum(VEGA_LITE in o.get("data", {}) for o in outputs) >= 8
    # Each chart is an SVG with its marks (lines, or a heat map's cells) drawn in it.
    marks = tab.evaluate(
        "[...document.querySelectorAll('.vega-chart')].map(chart =>"
        " chart.querySelectorAll('svg .role-mark path').length)"
    )
    assert len(marks) == charts and min(marks) > 0, marks
    # No output is a picture any more: the PNGs stay in the notebook's outputs.
    assert tab.evaluate("document.querySelectorAll('.jp-OutputArea img').length") == 0


def requested_elsewhere(tab, page):
    """What the open page requested besides itself and data: URLs."""
    urls = tab.requested_urls()
    assert urls[0] == page.as_uri()
    return [url for url in urls[1:] if not url.startswith("data:")]


# The page's folds (tools/offline.html.j2), in the order of the page.
FOLDS = "document.querySelectorAll('details.jp-Fold')"
# One fold, as a reader sees it: its kind, whether it is open, the words of its
# summary, and its cell's code and output: the code's text, or null while it is
# hidden; whether the output shows, or null for a cell without output.
FOLD_SEEN = """(fold => {
  const cell = fold.closest('.jp-Cell') ?? fold.querySelector('.jp-Cell');
  const shown = element => element.checkVisibility()
    && element.getBoundingClientRect().height > 0;
  const code = cell.querySelector('.jp-InputArea-editor');
  const outputs = cell.querySelector('.jp-OutputArea-child') !== null;
  return {
    kind: [...fold.classList].find(name => name.startsWith('jp-Fold-')),
    open: fold.open,
    summary: fold.querySelector(':scope > summary').innerText.trim(),
    code: shown(code) ? code.innerText : null,
    output: outputs ? shown(cell.querySelector('.jp-Cell-outputWrapper')) : null,
  };
})"""
# Each tag's fold: its class, and whether it hides the code and the output.
FOLD_OF_TAG = {
    "hide-input": ("jp-Fold-input", True, False),
    "hide-output": ("jp-Fold-output", False, True),
    "hide-cell": ("jp-Fold-cell", True, True),
}


def code_lines(text):
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def folded_on_the_page(cells):
    """The code cells that the page shows in a fold: each with a fold tag, except a
    hide-output cell without output (a fold with nothing in it)."""
    return [
        cell
        for cell in cells
        if fold_tag(cell) and (fold_tag(cell) != "hide-output" or cell.outputs)
    ]


def fold_seen(tab, index):
    seen = tab.evaluate(f"{FOLD_SEEN}({FOLDS}[{index}])")
    return {**seen, "code": None if seen["code"] is None else code_lines(seen["code"])}


def fold_expected(cell, opened):
    """What a reader should see of `cell`'s fold, closed or opened."""
    kind, hides_code, hides_output = FOLD_OF_TAG[fold_tag(cell)]
    what = {"jp-Fold-input": "code", "jp-Fold-output": "output"}.get(
        kind, "code and output" if cell.outputs else "code"
    )
    return {
        "kind": kind,
        "open": opened,
        "summary": f"{'hide' if opened else 'show'} {what}",
        "code": code_lines(cell.source) if opened or not hides_code else None,
        "output": (opened or not hides_output) if cell.outputs else None,
    }


def check_folds(tab, cells):
    """The open page folds exactly `cells` (code cells, in order), each closed at
    first with its tag's part hidden; a click on its summary opens it and shows the
    cell's code and output, and a second click closes it again."""
    assert tab.evaluate(f"{FOLDS}.length") == len(cells)
    for index, cell in enumerate(cells):
        where = f"fold {index} (the cell that starts {cell.source[:40]!r})"
        assert fold_seen(tab, index) == fold_expected(cell, opened=False), where
        summary = f"{FOLDS}[{index}].querySelector(':scope > summary')"
        for opened in (True, False):
            tab.click_on(summary)
            state = "" if opened else "!"
            tab.wait_for(f"{state}{FOLDS}[{index}].open", timeout=10, message=where)
            assert fold_seen(tab, index) == fold_expected(cell, opened), where


def test_every_folded_cell_is_a_closed_fold_that_a_click_opens(
    opened, page, page_notebook
):
    """The support cells of the book, tagged for Jupyter Book: each is one closed
    fold on the page, its code out of sight (the output of a hide-input cell in
    sight) until a click on the fold's summary shows it; the page still fetches
    nothing."""
    tab, _ = opened
    cells = nbformat.read(page_notebook, as_version=4).cells
    folded = folded_on_the_page(cells)
    assert folded, "the book folds no cell"
    check_folds(tab, folded)
    assert requested_elsewhere(tab, page) == []


def test_the_page_requests_nothing_but_itself(opened, page):
    tab, _ = opened
    elsewhere = requested_elsewhere(tab, page)
    assert elsewhere == [], f"the page requested {elsewhere}"


def test_each_fold_tag_folds_its_part_of_a_cell(chromium, tmp_path):
    """Jupyter Book's three tags on a small notebook, exported as `make html` and
    `make site` export the book: hide-input folds the code, hide-output the output,
    hide-cell both in one fold; a cell without a tag, or a hide-output cell without
    output, has no fold."""

    def cell(number, tag=None, printed=None):
        source = f"def helper_{number}():\n    return {number}\n"
        if printed:
            source += f"\nprint({printed!r})"
        made = nbformat.v4.new_code_cell(source, execution_count=number)
        if tag:
            made.metadata["tags"] = [tag]
        if printed:
            output = nbformat.v4.new_output("stream", name="stdout", text=printed)
            made.outputs = [output]
        return made

    cells = [
        cell(1, None, "plain"),
        cell(2, "hide-input", "code folded"),
        cell(3, "hide-input"),
        cell(4, "hide-output", "output folded"),
        cell(5, "hide-output"),
        cell(6, "hide-cell", "both folded"),
        cell(7, "hide-cell"),
    ]
    notebook = tmp_path / "folds.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), notebook)
    exported = subprocess.run(
        [sys.executable, "-m", "tools.export_html", str(notebook)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert exported.returncode == 0, exported.stderr
    with Browser(chromium, CHROMIUM_FLAGS, tmp_path / "profile") as tab:
        tab.open(notebook.with_suffix(".html").as_uri())
        assert tab.evaluate("document.querySelectorAll('.jp-CodeCell').length") == 7
        check_folds(tab, folded_on_the_page(cells))


EXPLORER = "document.querySelector('.vega-chart:has(select)')"  # the attention maps


CELLS = f"[...{EXPLORER}.querySelectorAll('.role-mark path')]"


def attention_cells(tab):
    """The description of each drawn cell of the attention chart. Vega describes
    every mark by its encoded fields: 'key: 2:Hunde; query: 1:Two; weight: 0.31'."""
    return tab.evaluate(f"{CELLS}.map(cell => cell.getAttribute('aria-label'))")


def described(label):
    return dict(part.split(": ", 1) for part in label.split("; "))


def pick(tab, menu, value):
    """Choose `value` in the attention chart's menu `menu` (kind, layer or head)."""
    tab.evaluate(
        f"(() => {{ const menu = {EXPLORER}.querySelector('select[name=pick_{menu}]');"
        f" menu.value = {json.dumps(str(value))};"
        " menu.dispatchEvent(new Event('change')); })()"
    )


def test_hovering_an_attention_cell_shows_its_query_key_and_weight(opened):
    tab, _ = opened
    cells = attention_cells(tab)
    assert cells, "the attention chart has no cells"
    for index in (0, len(cells) // 2, len(cells) - 1):
        label = cells[index]
        tab.move_pointer(*tab.centre_of(f"{CELLS}[{index}]"))
        shown = tab.wait_for(
            "(() => { const tip = document.getElementById('vg-tooltip-element');"
            " return tip && tip.classList.contains('visible') && tip.innerText; })()",
            timeout=10,
            message=f"no tooltip over {label}",
        )
        # The tooltip is a table: a name, a tab, then the value.
        rows = [line for line in shown.replace("\t\n", "\t").splitlines() if line]
        told = dict(row.split("\t", 1) for row in rows)
        cell = described(label)
        assert {k.strip(): v.strip() for k, v in told.items()} == {
            "query": cell["query"],
            "key": cell["key"],
            "weight": f"{float(cell['weight']):.2f}",
        }


def test_the_attention_menus_pick_the_kind_layer_and_head(opened, page_notebook):
    tab, _ = opened
    notebook = nbformat.read(page_notebook, as_version=4)
    specs = [
        o.data[VEGA_LITE]
        for cell in notebook.cells
        for o in cell.get("outputs", [])
        if VEGA_LITE in o.get("data", {})
    ]
    (spec,) = [s for s in specs if "pick_kind" in json.dumps(s.get("params", []))]
    (rows,) = spec["datasets"].values()
    kinds = list(dict.fromkeys(row["kind"] for row in rows))
    assert kinds == [
        "encoder_self_attention",
        "decoder_self_attention",
        "decoder_source_attention",
    ]
    last_layer = max(row["layer"] for row in rows)
    last_head = max(row["head"] for row in rows)
    for kind in reversed(kinds):
        for menu, value in (("kind", kind), ("layer", last_layer), ("head", last_head)):
            pick(tab, menu, value)
        # A cell's label gives its weight to 12 significant digits (d3-format's
        # default), the data to all of a float's: rounded to 6 decimals both give
        # the same number, but for a weight within 1e-12 of a rounding boundary.
        expected = {
            (row["query"], row["key"], round(row["weight"], 6))
            for row in rows
            if (row["kind"], row["layer"], row["head"]) == (kind, last_layer, last_head)
        }

        def drawn():
            cells = [described(label) for label in attention_cells(tab)]
            return {(c["query"], c["key"], round(float(c["weight"]), 6)) for c in cells}

        deadline = time.monotonic() + 10
        while drawn() != expected and time.monotonic() < deadline:
            time.sleep(0.2)
        assert drawn() == expected, f"{kind}, layer {last_layer}, head {last_head}"


def test_math_is_typeset_offline(dom):
    rendered = dom.select("mjx-container[jax='SVG']")
    assert len(rendered) >= 20, f"only {len(rendered)} formulas were typeset"
    errors = dom.select("mjx-merror, [data-mjx-error]")
    assert not errors, f"MathJax could not typeset: {errors[0].get_text()[:200]}"


def test_screenshot_shows_the_page(screenshot):
    assert screenshot.is_file(), "chromium wrote no screenshot"
    assert distinct_colours(screenshot.read_bytes(), enough=16) >= 16, "blank page"


def test_page_is_one_file_that_fetches_nothing(page):
    html = page.read_text(encoding="utf-8")
    soup = BeautifulSoup(html, "html.parser")
    assert not soup.select("script[src]"), "a script is loaded from elsewhere"
    assert not soup.select("link[href]"), "a stylesheet or icon is loaded from a file"
    for tag in soup.select("[src]"):
        assert tag["src"].startswith("data:"), f"<{tag.name}> loads {tag['src'][:80]}"
    styles = " ".join(
        [style.get_text() for style in soup.find_all("style")]
        + [tag["style"] for tag in soup.find_all(style=True)]
    )
    remote = re.compile(r"""(url\(\s*['"]?|@import\s+['"]?)(https?:)?//""")
    assert not remote.search(styles), "a stylesheet fetches from another host"
    scripts = " ".join(script.get_text() for script in soup.find_all("script"))
    remote_import = re.compile(r"""import\s*\(?\s*['"](https?:)?//""")
    assert not remote_import.search(scripts), "a script imports from another host"
    for cdn in ("cdnjs.cloudflare.com", "require.min.js", "mermaid", "unpkg.com"):
        assert cdn not in html, f"the page still mentions {cdn}"


def test_site_holds_the_page_the_figures_and_the_executed_notebook(built_site):
    # Exactly these: a file that a cell wrote in its working folder (the site being
    # built) would show up here, and so would a build folder left behind.
    assert sorted(p.name for p in built_site.iterdir()) == [
        ".nojekyll",
        "images",
        "index.html",
        "the_annotated_transformer.ipynb",
        "zh",
    ]
    assert sorted(p.name for p in (built_site / "zh").iterdir()) == [
        "index.html",
        "the_annotated_transformer.zh.ipynb",
    ]
    figures = sorted(p.name for p in IMAGES.glob("*.png"))
    assert figures and sorted(p.name for p in (built_site / "images").iterdir()) == (
        figures
    )
    assert sorted(p.name for p in built_site.parent.iterdir()) == ["site"]


def test_the_chinese_page_has_the_books_code_and_the_english_runs_outputs(
    built_site,
):
    """The Chinese page shows the outputs of the English run (tools.build_site):
    the same code cells, in the same order, each with the same outputs; its
    markdown is the committed Chinese notebook's."""
    english, chinese = (
        nbformat.read(built_site / EXECUTED[lang], as_version=4)
        for lang in ("en", "zh")
    )
    assert [c.cell_type for c in chinese.cells] == [c.cell_type for c in english.cells]
    code = [(c.source, c.outputs) for c in english.cells if c.cell_type == "code"]
    assert [(c.source, c.outputs) for c in chinese.cells if c.cell_type == "code"] == (
        code
    )
    # Not an empty run copied: the book printed numbers and drew charts.
    assert {"stream", "execute_result"} <= {o.output_type for _, os in code for o in os}
    committed = nbformat.read(REPO_ROOT / COMMITTED["zh"], as_version=4)
    assert [c.source for c in chinese.cells if c.cell_type == "markdown"] == [
        c.source for c in committed.cells if c.cell_type == "markdown"
    ]


# Each page's links to the editions, in order: (words, the page it opens, or None
# for the page itself).
EDITION_LINKS = {
    "en": [("中文", "zh/index.html"), ("English", None)],
    "zh": [("中文", None), ("English", "index.html")],
}


def test_each_page_links_to_the_other_edition_at_its_top(dom, edition, page):
    main = dom.find("main")
    nav = main.find(True)  # its first element
    assert nav.name == "nav" and "jp-Editions" in nav["class"], nav
    assert nav.get_text(" ", strip=True) == "中文 / English"
    seen = []
    for child in nav.find_all(["a", "span"]):
        href = child.get("href")
        target = (page.parent / href).resolve() if href else None
        site = page.parent.parent if edition == "zh" else page.parent
        seen.append(
            (child.get_text(), target and target.relative_to(site.resolve()).as_posix())
        )
        if target:
            assert target.is_file(), href
    assert seen == EDITION_LINKS[edition]
    # The page says its language, for fonts, hyphenation and screen readers.
    assert dom.find("html")["lang"] == edition
    # The Chinese page's link to the English edition, in its title cell, opens the
    # site's English page, not GitHub's view of the notebook.
    if edition == "zh":
        link = dom.find("a", string="English edition")
        assert link is not None and link["href"] == "../index.html"


def test_every_chinese_character_is_drawn_in_a_cjk_font(opened, edition):
    """Read from Chromium (CSS.getPlatformFontsForNode): each element with Chinese
    on the page is drawn in a CJK font the Chinese page names, every character of
    it. On the English page that is the link 中文; the Chinese page names its font
    stack, CJK fonts after the Latin ones, and the browser uses it."""
    tab, _ = opened
    elements, gaps = tab.drawn_outside(CJK_FONTS, script="Han")
    assert gaps == [], (
        "Chinese drawn without a CJK font (missing-glyph boxes): install one, e.g. "
        f"Debian's fonts-wqy-microhei (.ci/run does). {gaps[:5]}"
    )
    assert elements >= (300 if edition == "zh" else 1)
    family = tab.evaluate(
        "getComputedStyle(document.querySelector('.jp-MarkdownOutput')).fontFamily"
    )
    if edition == "zh":
        assert family.replace(", ", ",") == ",".join(FONT_STACKS["zh"])
    else:
        assert not CJK_FONTS & set(re.findall(r'"([^"]+)"', family))


def test_a_character_no_font_has_is_found(chromium, tmp_path):
    """The control of the font test: a Han character outside every installed font
    (U+2A6D6, of CJK Extension B) is drawn as a box, by a font that is no CJK
    font, and found; the common characters beside it are found drawn right."""
    page = tmp_path / "boxes.html"
    stack = ", ".join(FONT_STACKS["zh"])
    page.write_text(
        '<html lang="zh"><body style=\'font-family: ' + stack + "'>"
        "<p>注意力</p><p>\U0002a6d6</p><p>多头<b>注意力</b></p></body></html>",
        encoding="utf-8",
    )
    with Browser(chromium, CHROMIUM_FLAGS, tmp_path / "profile") as tab:
        tab.open(page.as_uri())
        elements, gaps = tab.drawn_outside(CJK_FONTS, script="Han")
    assert elements == 4
    assert [text for text, _ in gaps] == ["\U0002a6d6"]
    assert not CJK_FONTS & set(gaps[0][1])


def make_site(site, **environ):
    # Not the variables of a make that runs this test: its DATA_DIR would win.
    outer = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "DATA_DIR")
    env = {k: v for k, v in os.environ.items() if k not in outer}
    return subprocess.run(
        ["make", "--no-print-directory", "site", f"SITE_DIR={site}"],
        cwd=REPO_ROOT,
        env={**env, **environ},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"ANNOTATED_TRANSFORMER_PROFILE": "huge", "DATA_DIR": "/no/such/folder"},
            "make site: $ANNOTATED_TRANSFORMER_PROFILE is 'huge'; use one of smoke, "
            "quick, base.",
        ),
        (
            {"DATA_DIR": "/no/such/folder"},
            "make site: $ANNOTATED_TRANSFORMER_DATA names /no/such/folder, which is "
            "not a folder; point it at the Multi30k folder (make site DATA_DIR=...) "
            "or unset it.",
        ),
    ],
)
def test_make_site_says_what_is_wrong_and_keeps_the_previous_site(
    environ, message, tmp_path
):
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("the previous build")
    # DATA_DIR, named, is used as it is: nothing is fetched into it.
    result = make_site(site, **environ)
    assert result.returncode != 0
    assert message in result.stderr.splitlines()
    assert "Traceback" not in result.stderr
    assert (site / "index.html").read_text() == "the previous build"


def test_make_site_with_a_data_folder_lacking_files_says_how_to_fill_it(tmp_path):
    site, data = tmp_path / "site", tmp_path / "data"
    data.mkdir()  # named, so nothing is fetched into it: the site would skip Part 3
    (data / "train.de.gz").write_bytes(b"")  # one of the six, of whatever content
    result = make_site(site, DATA_DIR=str(data))
    assert result.returncode != 0
    message = (
        f"make site: $ANNOTATED_TRANSFORMER_DATA names {data}, which lacks "
        "train.en.gz, val.de.gz, val.en.gz, test_2016_flickr.de.gz, "
        f"test_2016_flickr.en.gz; fill it with `make data DATA_DIR={data}`, or point "
        "DATA_DIR at the Multi30k folder."
    )
    assert message in result.stderr.splitlines(), result.stderr
    assert "Traceback" not in result.stderr
    assert not site.exists()
