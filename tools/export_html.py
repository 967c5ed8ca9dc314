"""Export an executed notebook as one self-contained HTML page (`make html`).

    python -m tools.export_html notebooks/the_annotated_transformer.executed.ipynb

The page fetches nothing from the network. nbconvert's own template loads MathJax,
require.js and mermaid from CDNs; tools/offline.html.j2 drops the last two (the book
has no widgets and no diagrams) and inlines MathJax 3 from the pinned
django-static-mathjax package instead. The book's charts (Vega-Lite outputs, with a
PNG of each for viewers without JavaScript) are drawn in the page by Vega-Embed, so
they stay interactive: its JavaScript, with Vega and Vega-Lite, is vl-convert's
bundle, inlined once. The figures that markdown cells link to, by a path or by
their address on the repository's main (tools.repository), are embedded from this
checkout as data URLs. The cells the book folds (Jupyter Book's hide-input,
hide-output and hide-cell tags) are closed <details> folds, which the browser opens
on a click without any script (the template's codecell, input_group and
output_group blocks). A translated edition (`--lang zh`) names its language in the
page and a font stack for its script that falls back sensibly on readers' machines
(FONT_STACKS) and says the page's own words, such as the folds' "show code", in
it (CHROME); the site puts a link to each edition at the top of each page
(`editions`).
tools.build_site (`make site`) uses it too; tests/test_site.py opens its page in
headless Chromium.
"""

import argparse
import base64
import json
import mimetypes
import re
from importlib.resources import files
from pathlib import Path

import nbformat
import vl_convert
from nbconvert import HTMLExporter
from nbconvert.preprocessors import Preprocessor

from tools.repository import raw_url
from workshop.files import atomic_write_text

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = REPO_ROOT / "tools" / "offline.html.j2"
# The committed notebook's folder: its markdown links to figures start here.
NOTEBOOKS = REPO_ROOT / "notebooks"
# MathJax's single-file builds; the template inlines tex-svg-full.js, which holds every
# TeX extension (nothing left to load on demand) and draws glyphs as SVG (no fonts).
MATHJAX_ES5 = files("mathjax") / "static" / "mathjax" / "es5"


class TitleFromFirstHeading(Preprocessor):
    """Title the page with the notebook's first `# ` heading (it has no title)."""

    def preprocess(self, nb, resources):
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                first_line = cell.source.lstrip().partition("\n")[0]
                if first_line.startswith("# "):
                    nb.metadata.setdefault("title", first_line[2:].strip())
                break
        return nb, resources


# A markdown image, ![alt](src "title"); the alt text may run over several lines.
MARKDOWN_IMAGE = re.compile(r'(!\[[^\]]*\]\()([^)\s]+)((?:\s+"[^"]*")?\))')


class AttachLocalImages(Preprocessor):
    """Make each markdown image that links to a local file, or to a file of the
    repository's main (the book links its figures so, for a notebook opened alone),
    a cell attachment read from this checkout: the page then fetches nothing.

    nbconvert writes attachments into the page as data URLs; its own embed_images
    option refuses files outside the notebook's folder, such as ../images/.
    """

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type != "markdown":
            return cell, resources
        folder, own = Path(resources["metadata"]["path"]), raw_url("")

        def attach(match):
            before, src, after = match.groups()
            if src.startswith(own):
                path = REPO_ROOT / src.removeprefix(own)
            elif ":" in src:  # another URL, a data URL or an attachment already
                return match.group(0)
            else:
                path = folder / src
            if not path.is_file():  # a typo, or a figure that was never committed
                raise FileNotFoundError(
                    f"markdown cell {index} shows {src}, but there is no {path}"
                )
            mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            data = base64.b64encode(path.read_bytes()).decode("ascii")
            cell.setdefault("attachments", {})[path.name] = {mime: data}
            return f"{before}attachment:{path.name}{after}"

        cell.source = MARKDOWN_IMAGE.sub(attach, cell.source)
        return cell, resources


VEGA_LITE = "application/vnd.vegalite.v5+json"  # the book's ChartOutput writes it
# A chart: where Vega-Embed draws it (as SVG: crisp, and its marks are elements),
# and its spec as data. "</" is escaped in the spec so that no text in it can end
# the script element early.
CHART_HTML = """<div class="vega-chart" id="chart-{n}"></div>
<script type="application/json" id="chart-{n}-spec">{spec}</script>
<script>
vegaEmbed("#chart-{n}", JSON.parse(document.getElementById("chart-{n}-spec").text),
          {{renderer: "svg", actions: false}});
</script>"""


class Relink(Preprocessor):
    """Rewrite the targets of markdown links named in `resources["links"]` ({old:
    new}): a translated page's link to the English notebook on GitHub becomes the
    site's English page beside it."""

    def preprocess_cell(self, cell, resources, index):
        links = resources.get("links") or {}
        if cell.cell_type == "markdown" and links:
            for old, new in links.items():
                cell.source = cell.source.replace(f"]({old})", f"]({new})")
        return cell, resources


# Each translated edition's fonts, the Latin ones first (they draw the Latin
# letters and digits), then the CJK fonts readers have: macOS (PingFang SC,
# Hiragino Sans GB), Windows (Microsoft YaHei), Linux and Android (Noto Sans CJK SC,
# Source Han Sans SC, and WenQuanYi Micro Hei, Debian's fonts-wqy-microhei, which
# the browser tests use), then the browser's own sans-serif.
LATIN_FONTS = ["system-ui", "-apple-system", "blinkmacsystemfont", '"Segoe UI"']
LATIN_FONTS += ["helvetica", "arial"]
FONT_STACKS = {
    "zh": LATIN_FONTS
    + [
        '"PingFang SC"',
        '"Hiragino Sans GB"',
        '"Microsoft YaHei"',
        '"Noto Sans CJK SC"',
        '"Source Han Sans SC"',
        '"WenQuanYi Micro Hei"',
        "sans-serif",
    ],
}


# The page's own words, in each edition's language (English where one is not
# named): a fold's summary by what the fold holds (tools/offline.html.j2), and the
# name of the list of editions, for screen readers.
CHROME = {
    "en": {
        "code": ("show code", "hide code"),
        "output": ("show output", "hide output"),
        "code and output": ("show code and output", "hide code and output"),
        "editions": "Editions",
    },
    "zh": {
        "code": ("显示代码", "隐藏代码"),
        "output": ("显示输出", "隐藏输出"),
        "code and output": ("显示代码和输出", "隐藏代码和输出"),
        "editions": "版本",
    },
}


class InteractiveCharts(Preprocessor):
    """Put each Vega-Lite output in the page as a chart that Vega-Embed draws (in
    place of its PNG), and Vega-Embed's JavaScript in the page once."""

    def preprocess(self, nb, resources):
        resources["charts"] = 0
        nb, resources = super().preprocess(nb, resources)
        resources["vega_bundle"] = (
            vl_convert.javascript_bundle() if resources["charts"] else ""
        )
        return nb, resources

    def preprocess_cell(self, cell, resources, index):
        for output in cell.get("outputs", []):
            spec = output.get("data", {}).get(VEGA_LITE)
            if spec is not None:
                resources["charts"] += 1
                text = json.dumps(spec).replace("</", "<\\/")
                html = CHART_HTML.format(n=resources["charts"], spec=text)
                output["data"] = nbformat.from_dict({"text/html": html})
        return cell, resources


def make_exporter(language="en"):
    """The HTMLExporter behind `make html`: lab template, offline, images embedded,
    charts interactive; `language` is the page's (ISO 639-1)."""
    exporter = HTMLExporter(
        language_code=language,
        template_name="lab",
        template_file=str(TEMPLATE),
        extra_template_paths=[str(MATHJAX_ES5)],
        embed_images=True,  # <img> tags in markdown, for files under the folder
    )
    exporter.register_preprocessor(TitleFromFirstHeading, enabled=True)
    exporter.register_preprocessor(Relink, enabled=True)
    exporter.register_preprocessor(AttachLocalImages, enabled=True)
    exporter.register_preprocessor(InteractiveCharts, enabled=True)
    return exporter


def export_html(
    notebook, out=None, images_from=NOTEBOOKS, language="en", editions=(), links=None
):
    """Write the notebook file as HTML beside it (or to `out`); return its path.

    Relative image links in markdown cells start at `images_from`: the folder of the
    committed notebook, wherever the executed copy was written. `language` is the
    page's; `editions`, (language, label, address or None for this page), are
    linked at the top of the page; `links` ({old: new}) rewrites link targets.
    """
    notebook = Path(notebook)
    out = Path(out) if out else notebook.with_suffix(".html")
    nb = nbformat.read(notebook, as_version=4)
    resources = {
        "metadata": {"path": str(Path(images_from).resolve())},
        "font_stack": ", ".join(FONT_STACKS.get(language, [])),
        "editions": [
            {"language": lang, "label": label, "href": href}
            for lang, label, href in editions
        ],
        "links": links or {},
        "chrome": CHROME.get(language, CHROME["en"]),
    }
    exporter = make_exporter(language)
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    return atomic_write_text(out, body)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tools.export_html", description=__doc__.partition("\n")[0]
    )
    parser.add_argument("notebook", help="an executed .ipynb")
    parser.add_argument("--out", help="the HTML file (default: beside the notebook)")
    parser.add_argument(
        "--lang", default="en", help="the notebook's language: en, or zh (Chinese)"
    )
    args = parser.parse_args(argv)
    path = export_html(args.notebook, args.out, language=args.lang)
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
