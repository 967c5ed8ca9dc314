"""`make site` runs the book end to end and builds its website: a page for the book
and one for its Chinese edition (site/zh/), each one file that renders offline.

The build (conftest.py's `built_site`: `make site`, smoke profile) runs every cell
and writes the pages with tools.export_html, the exporter behind `make html` too.
Headless Chromium (tests/browser.py), with every host name unresolvable, opens each
page from disk and does what a reader does: it sees the title, the contents, the
typeset math, the figures and every chart drawn; points at a cell of the attention
maps and reads its tooltip; picks from the menus; opens and closes each folded cell
(Jupyter Book's hide-input, hide-output and hide-cell tags); and the page requests
nothing but itself. Each page links to the other, and every Chinese character is
drawn in a CJK font, with no missing-glyph box.
"""

import json
import os
import re
import subprocess
from base64 import b64decode
from pathlib import Path
from urllib.parse import unquote

import nbformat
import pytest
from browser import drawn_outside, requested_urls, start_chromium, wait_for
from bs4 import BeautifulSoup
from selenium.webdriver import ActionChains
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait

from tools import export_html

REPO_ROOT = Path(__file__).resolve().parent.parent
VEGA_LITE = "application/vnd.vegalite.v5+json"
# Each edition's page and executed notebook, in the site.
PAGES = {"en": "index.html", "zh": "zh/index.html"}
RUNS = {"en": "the_annotated_transformer.ipynb"}
RUNS["zh"] = "zh/the_annotated_transformer.zh.ipynb"
# The CJK fonts the Chinese page names (Debian's fonts-wqy-microhei, which .ci/run
# installs, among them), between the Latin ones and sans-serif.
STACK, LATIN = export_html.FONT_STACKS["zh"], export_html.LATIN_FONTS
CJK_FONTS = {name.strip('"') for name in STACK[len(LATIN) : -1]}
ALL = "[...document.querySelectorAll('%s')]"  # as a JavaScript array

pytestmark = pytest.mark.slow

# What the book's five doing pieces print: attention by hand, the two checks before
# a long run, each classic bug measured switched on and on the book's path, the
# proof against nn.Transformer (below 1e-10 as `:.0e` prints it: the two sides
# differ by a few 1e-15, a weight out of place by far more), and beam search.
BUGS = ["A decoder mask that shows the future", "The Noam rate without warm-up"]
BUGS += ["Fill value -1e4", "Fill value -1e9 in float16", "Gradient accumulation"]
BUGS += ["Smoothing 0.1 left on the padding column", "Dropout left on at inference"]
BUGS += ["A padded key not masked"]
SMALL = r"(?:0e\+00|\de-(?:1[1-9]|[2-9]\d|\d{3}))"
TEACHING_BY_DOING = [re.escape("QK^T/sqrt(d_k) (1, 2, 4, 4)"), "V =   11: first loss"]
TEACHING_BY_DOING += ["one batch learnt by heart, loss per token after k steps:"]
TEACHING_BY_DOING += [
    rf"{re.escape(bug)}.*\n\s+bug switched on -> .+\n\s+the book's path -> .*\d"
    for bug in BUGS
] + [r"bug switched on -> RuntimeError: value cannot be converted .* overflow"]
TEACHING_BY_DOING += [
    rf"{layout}, {re.escape(way)}: memory {SMALL}, decoder output {SMALL}"
    for layout in ("pre-norm", "post-norm")
    for way in ("ours -> torch", "torch -> ours")
] + [r"α = 0\.6 picks: \S", r"α = 2\.0 picks: \S"]


def script(browser, expression):
    return browser.execute_script(f"return {expression}")


def not_shown(text):
    return [pattern for pattern in TEACHING_BY_DOING if not re.search(pattern, text)]


def charts_in(notebook):
    """The data of each Vega-Lite output of a notebook, in order."""
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    return [o.data for o in outputs if VEGA_LITE in o.get("data", {})]


def beams(specs):
    """How many of the Vega-Lite specs draw beam search (data with a "log P")."""
    return sum('"log P"' in json.dumps(spec) for spec in specs)


def cells_of(notebook, kind="markdown"):
    return [(c.source, c.get("outputs")) for c in notebook.cells if c.cell_type == kind]


def test_the_book_runs_end_to_end_and_both_editions_show_the_run(built_site):
    """Every cell runs; each of the twelve charts is a Vega-Lite chart with a PNG
    (for viewers that run no JavaScript); the book prints what it teaches by doing,
    translations and BLEU, trains in memory and writes nothing into the site. The
    Chinese notebook holds the same code cells with the same outputs."""
    english, chinese = (nbformat.read(built_site / RUNS[e], 4) for e in ("en", "zh"))
    outputs = [o for cell in english.cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if "text/html" in o.get("data", {})]  # no CDN
    charts = charts_in(english)
    pngs = [b64decode(chart["image/png"])[:4] for chart in charts]
    assert len(charts) == 12 and pngs == [b"\x89PNG"] * 12
    assert beams(data[VEGA_LITE] for data in charts) == 1
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert not_shown(text) == []
    assert "exact copy: yes" in text and "reference:" in text and "model:" in text
    assert re.search(r"Your smoke model, test 2016, greedy: \d+\.\d\d BLEU", text)
    assert "translated identically with and without the cache" in text
    assert "\n  greedy:    " in text and "\n  beam:      " in text
    assert "signature: nrefs:1" in text
    # Exactly these files: one a cell wrote in its working folder would show here.
    files = {p.relative_to(built_site).as_posix() for p in built_site.rglob("*")}
    figures = {f"images/{p.name}" for p in (REPO_ROOT / "images").glob("*.png")}
    expected = {".nojekyll", "images", "zh", *PAGES.values(), *RUNS.values()}
    assert figures and files - figures == expected
    assert cells_of(chinese, "code") == cells_of(english, "code")
    committed = nbformat.read(REPO_ROOT / "notebooks" / Path(RUNS["zh"]).name, 4)
    assert cells_of(chinese) == cells_of(committed)


@pytest.fixture(scope="module", params=sorted(PAGES))
def opened(request, built_site):
    """(edition, its page, its run, a browser showing it once every chart is drawn
    and the math typeset), for the book ("en") and its Chinese edition ("zh")."""
    page = built_site / PAGES[request.param]
    run = nbformat.read(built_site / RUNS[request.param], as_version=4)
    with start_chromium() as browser:
        browser.get(page.as_uri())
        charts, marks = ".vega-chart", ".vega-chart svg .role-mark"
        wait_for(browser, f"{ALL % marks}.length >= {ALL % charts}.length", 60)
        browser.execute_async_script("MathJax.startup.promise.then(arguments[0])")
        yield request.param, page, run, browser


def test_the_page_has_its_title_contents_and_a_link_to_the_other_edition(opened):
    edition, page, run, browser = opened
    dom = BeautifulSoup(browser.page_source, "html.parser")
    assert browser.title == run.cells[0].source.partition("\n")[0].removeprefix("# ")
    assert dom.html["lang"] == edition  # for fonts, hyphenation and screen readers
    label = {"en": r"^\s*(Table of )?[Cc]ontents\s*$", "zh": r"^\s*目录\s*$"}[edition]
    contents = dom.find(string=re.compile(label)).find_next(["ol", "ul"])
    links = [a["href"] for a in contents.find_all("a", href=True)]
    ids = {element["id"] for element in dom.find_all(id=True)}
    assert len(links) >= 5 and all({h[1:], unquote(h[1:])} & ids for h in links)
    nav = dom.find("main").find(True)  # at the top: 中文 / English, the other a link
    assert "jp-Editions" in nav["class"]
    assert nav.get_text(" ", strip=True) == "中文 / English"
    (link,) = nav.find_all("a")
    other = {"en": ("中文", "zh/index.html"), "zh": ("English", "../index.html")}
    assert (link.get_text(), link["href"]) == other[edition]
    assert (page.parent / link["href"]).is_file()
    if edition == "zh":  # the title cell's link opens the English page, not GitHub
        assert dom.find("a", string="English edition")["href"] == "../index.html"


def test_the_page_shows_typeset_math_figures_and_every_chart_drawn(opened):
    """The math is typeset (no raw $$, no error); every figure is loaded; each chart
    of the run is drawn as an SVG with its marks, not a picture; the book's five
    doing pieces are shown, and the beam of beam search is a chart."""
    _, _, run, browser = opened
    assert script(browser, f"{ALL % 'mjx-container[jax=SVG]'}.length") >= 20
    assert script(browser, f"{ALL % 'mjx-merror, [data-mjx-error]'}.length") == 0
    text = script(browser, "document.body.innerText")
    assert "$$" not in text and not_shown(text) == []
    figures = ".map(image => image.complete && image.naturalWidth)"
    assert all(widths := script(browser, ALL % ".jp-RenderedMarkdown img" + figures))
    assert widths and script(browser, f"{ALL % '.jp-OutputArea img'}.length") == 0
    marks = ".map(chart => chart.querySelectorAll('svg .role-mark path').length)"
    drawn = script(browser, ALL % ".vega-chart" + marks)
    assert len(drawn) == len(charts_in(run)) and min(drawn) > 0
    specs = script(browser, ALL % "script[id$=-spec]" + ".map(s => s.text)")
    assert beams(json.loads(spec) for spec in specs) == 1


EXPLORER = "document.querySelector('.vega-chart:has(select)')"  # the attention maps
CELLS = f"{EXPLORER}.querySelectorAll('.role-mark path')"


def attention_cells(browser):
    """Each drawn cell of the attention chart, as Vega describes it by its encoded
    fields ('key: 2:Hunde; query: 1:Two; weight: 0.31'): (query, key, weight)."""
    labels = script(browser, f"[...{CELLS}].map(c => c.getAttribute('aria-label'))")
    cells = [dict(part.split(": ") for part in label.split("; ")) for label in labels]
    return [(c["query"], c["key"], float(c["weight"])) for c in cells]


def drawing(want):
    """Whether the attention chart draws the cells `want`, as a wait's condition."""
    return lambda browser: (
        {(q, k, round(w, 6)) for q, k, w in attention_cells(browser)} == want
    )


def test_the_attention_maps_answer_the_pointer_and_the_menus(opened):
    """Pointing at a cell shows its query, key and weight in a tooltip; the menus
    draw the kind, layer and head picked, from the run's data."""
    _, _, run, browser = opened
    cells = attention_cells(browser)
    for index in (0, len(cells) // 2, len(cells) - 1):
        cell = script(browser, f"{CELLS}[{index}]")
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", cell)
        ActionChains(browser).move_to_element(cell).perform()
        tip = "document.querySelector('#vg-tooltip-element.visible')?.innerText"
        told = wait_for(browser, tip, 10).replace("\t\n", "\t").split()
        query, key, weight = cells[index]
        assert told == ["query", query, "key", key, "weight", f"{weight:.2f}"]
    (spec,) = [d[VEGA_LITE] for d in charts_in(run) if "pick_kind" in json.dumps(d)]
    (rows,) = spec["datasets"].values()
    kinds = list(dict.fromkeys(row["kind"] for row in rows))  # encoder self, ...
    last = {name: max(row[name] for row in rows) for name in ("layer", "head")}
    assert len(kinds) == 3
    for picked in ({"kind": kind, **last} for kind in reversed(kinds)):
        for menu, value in picked.items():
            menu = script(browser, f"{EXPLORER}.querySelector('[name=pick_{menu}]')")
            Select(menu).select_by_value(str(value))
        # A label gives its weight to 12 significant digits (d3-format's default):
        # rounded to 6 decimals, both give the data's weight.
        chosen = [r for r in rows if all(r[k] == v for k, v in picked.items())]
        want = {(r["query"], r["key"], round(r["weight"], 6)) for r in chosen}
        WebDriverWait(browser, 10).until(drawing(want), f"{picked}")


def fold_tag(cell):
    """The Jupyter Book tag that folds a code cell, or None: hide-input (the code
    folded, the output shown), hide-output (the reverse) or hide-cell (both, in one
    fold; it wins over the other two). JupyterLab collapses by the cell's
    jupyter.source_hidden and outputs_hidden, which the book sets beside them."""
    tags = cell.metadata.get("tags", []) if cell.cell_type == "code" else []
    folding = [tag for tag in ("hide-cell", "hide-input", "hide-output") if tag in tags]
    return folding[0] if folding else None


# Each fold as a reader sees it: its kind, whether it is open, the words of its
# summary, its cell's code lines (null while hidden) and whether its output shows
# (null for a cell without output).
FOLDS_SEEN = """return [...document.querySelectorAll('details.jp-Fold')].map(fold => {
  const cell = fold.closest('.jp-Cell') ?? fold.querySelector('.jp-Cell');
  const shown = element => element.checkVisibility()
    && element.getBoundingClientRect().height > 0;
  const code = cell.querySelector('.jp-InputArea-editor');
  const lines = code.innerText.split('\\n').filter(l => l.trim());
  return [[...fold.classList].find(name => name.startsWith('jp-Fold-')), fold.open,
    fold.querySelector(':scope > summary').innerText.trim(),
    shown(code) ? lines.map(line => line.trimEnd()) : null,
    cell.querySelector('.jp-OutputArea-child')
      ? shown(cell.querySelector('.jp-Cell-outputWrapper')) : null];
})"""
# Each tag's fold: its kind, the words of its summary, and whether it hides the
# code and the output.
FOLD_OF_TAG = {"hide-input": ("input", "code", 1, 0)}
FOLD_OF_TAG["hide-output"] = ("output", "output", 0, 1)
FOLD_OF_TAG["hide-cell"] = ("cell", "code and output", 1, 1)


def non_blank(text):
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def check_folds(browser, cells, edition="en", clicks="webdriver"):
    """The open page folds each code cell with a fold tag (but a hide-output cell
    without output: nothing to fold), in order, each closed with its tag's part
    hidden; a click on a fold's summary opens it, showing the cell's code and
    output, and a second click closes it again. On the book's hundreds of folds the
    clicks are the page's own (one script), not a WebDriver round trip each."""
    tagged = [(c, FOLD_OF_TAG[fold_tag(c)]) for c in cells if fold_tag(c)]
    folded = [(c, fold) for c, fold in tagged if c.outputs or fold[0] != "output"]
    assert folded, "no cell is folded"
    summaries = browser.find_elements("css selector", "details.jp-Fold > summary")
    for opened in (False, True, False):
        expected = []
        for cell, (kind, what, hides_code, hides_output) in folded:
            what = what if cell.outputs else what.removesuffix(" and output")
            words = export_html.CHROME[edition][what][opened]
            code = non_blank(cell.source) if opened or not hides_code else None
            output = (opened or not hides_output) if cell.outputs else None
            expected.append([f"jp-Fold-{kind}", opened, words, code, output])
        assert browser.execute_script(FOLDS_SEEN) == expected
        if clicks == "webdriver":
            for summary in summaries:
                summary.click()
        else:
            browser.execute_script("for (const s of arguments[0]) s.click()", summaries)


def test_every_folded_cell_of_the_book_is_a_closed_fold_that_a_click_opens(opened):
    check_folds(opened[3], opened[2].cells, opened[0], clicks="page")


def test_each_fold_tag_folds_its_part_of_a_cell(tmp_path):
    """Jupyter Book's three tags on a small notebook, with and without output,
    exported as `make site` exports the book; a cell without a fold tag has no fold."""
    tags = ["other", *(tag for tag in FOLD_OF_TAG for _ in "12")]
    new = nbformat.v4
    cells = [
        new.new_code_cell(f"x = {n}", metadata={"tags": [t]})
        for n, t in enumerate(tags)
    ]
    for cell in cells[::2]:
        cell.outputs = [new.new_output("stream", name="stdout", text="printed\n")]
    nbformat.write(new.new_notebook(cells=cells), tmp_path / "folds.ipynb")
    export_html.main([str(tmp_path / "folds.ipynb")])
    with start_chromium() as browser:
        browser.get((tmp_path / "folds.html").as_uri())
        assert script(browser, f"{ALL % '.jp-CodeCell'}.length") == 7
        check_folds(browser, cells)


def test_every_chinese_character_is_drawn_in_a_cjk_font(opened):
    """Read from Chromium: each element with Chinese on the page (on the English
    page, the link 中文) is drawn in a CJK font the Chinese page names, every
    character of it. The control: a character no installed font has (U+2A6D6),
    added to the page, is found drawn as a box, by a font that is no CJK font."""
    edition, _, _, browser = opened
    browser.execute_script(
        "document.body.append(document.createElement('p'));"
        " document.body.lastChild.textContent = '\U0002a6d6'"
    )
    elements, gaps = drawn_outside(browser, CJK_FONTS)
    # Chinese drawn without a CJK font shows missing-glyph boxes: install one, e.g.
    # Debian's fonts-wqy-microhei (.ci/run does).
    assert [text for text, _ in gaps] == ["\U0002a6d6"], gaps[:5]
    assert not CJK_FONTS & {*gaps[0][1]}
    assert elements >= (300 if edition == "zh" else 2)


def test_the_page_requests_nothing_but_itself(opened):
    """After all the tests above did with it: every request of the page was for
    the page itself or a data: URL."""
    page, urls = opened[1].as_uri(), requested_urls(opened[3])
    assert page in urls and [u for u in urls if not u.startswith((page, "data:"))] == []


# What make site says to each wrong setting: make's variables | its message (@: a
# folder holding one of the six Multi30k files).
WRONG_SETTINGS = [
    "ANNOTATED_TRANSFORMER_PROFILE=huge DATA_DIR=/no | $ANNOTATED_TRANSFORMER_PROFILE "
    "is 'huge'; use one of smoke, quick, base.",
    "DATA_DIR=/no | $ANNOTATED_TRANSFORMER_DATA names /no, which is not a folder; "
    "point it at the Multi30k folder (make site DATA_DIR=...) or unset it.",
    "DATA_DIR=@ | $ANNOTATED_TRANSFORMER_DATA names @, which lacks train.en.gz, "
    "val.de.gz, val.en.gz, test_2016_flickr.de.gz, test_2016_flickr.en.gz; fill it "
    "with `make data DATA_DIR=@`, or point DATA_DIR at the Multi30k folder.",
]


@pytest.mark.parametrize("wrong", WRONG_SETTINGS)
def test_make_site_says_what_is_wrong_and_keeps_the_previous_site(wrong, tmp_path):
    """A data folder named is used as it is: nothing is fetched into it."""
    (site := tmp_path / "site").mkdir()
    (site / "index.html").write_text("the previous build")
    (data := tmp_path / "data").mkdir()
    (data / "train.de.gz").write_bytes(b"")
    # Not the variables of a make that runs this test: its DATA_DIR would win.
    outer = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "DATA_DIR")
    env = {k: v for k, v in os.environ.items() if k not in outer}
    variables, says = wrong.replace("@", str(data)).split(" | ")
    env.update(variable.split("=") for variable in variables.split())
    make = ["make", "--no-print-directory", "site", f"SITE_DIR={site}"]
    made = subprocess.run(make, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert f"make site: {says}" in made.stderr.splitlines()
    assert made.returncode != 0 and "Traceback" not in made.stderr
    assert (site / "index.html").read_text() == "the previous build"
