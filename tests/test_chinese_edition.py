"""The Chinese edition (中文版): one book in two languages, never out of step.

The English book is the one source of the code. translations/zh/ holds a gettext
catalogue of its markdown cells (tools.translation extracts it; an edited English
cell turns its entry fuzzy) and the glossary that fixes each term's Chinese form;
notebooks/the_annotated_transformer.zh.ipynb is built from the two. These tests fail
when a markdown cell has no current translation, when the Chinese notebook's code is
not the book's to the character, when the notebook is not what the catalogue builds,
when a heading or a link to one does not resolve, when a glossary term appears in
English in the Chinese prose, when a cell renders a term otherwise than the glossary,
and when a core term's English gloss is missing, repeated or not at its first use.
The controls run on a temporary copy of the book and of the catalogue, every entry
given a stand-in translation, or one slip made. (tests/test_site.py checks the
Chinese page, tests/test_colab.py runs the Chinese notebook alone.)
"""

import re
import shutil

import jupytext
import nbformat
import polib
import pytest
from conftest import REPO_ROOT

from tools import repository, translation

LANG = "zh"
BOOK = REPO_ROOT / "the_annotated_transformer.py"
CATALOGUE = translation.catalogue_path(LANG)
NOTEBOOK = REPO_ROOT / translation.notebook_name(LANG)
GLOSSARY = translation.read_glossary(translation.glossary_path(LANG))
MARKER = "【译】"  # what a stand-in translation starts with


@pytest.fixture(scope="module")
def book_cells():
    return jupytext.read(BOOK).cells


@pytest.fixture(scope="module")
def chinese():
    return nbformat.read(NOTEBOOK, as_version=4)


def markdown_of(cells):
    return [cell.source for cell in cells if cell.cell_type == "markdown"]


def stand_in_translations(catalogue, text=None):
    """Give every entry a current translation: `text`, or a stand-in, the English
    marked at its start and in each heading (so that the headings still pair)."""
    entries = polib.pofile(str(catalogue), wrapwidth=0)
    for entry in entries:
        marked = re.sub(r"^(#{1,6} +)", r"\g<1>" + MARKER, entry.msgid, flags=re.M)
        marked = marked if marked.startswith("#") else MARKER + marked
        entry.msgstr = marked if text is None else text
        entry.flags, entry.previous_msgid = [], None
    entries.save(str(catalogue))
    return [entry for entry in entries if not entry.obsolete]


@pytest.fixture
def copies(tmp_path):
    """A copy of the book and of the catalogue, every cell translated by a stand-in."""
    book, catalogue = tmp_path / BOOK.name, tmp_path / CATALOGUE.name
    shutil.copy(BOOK, book)
    shutil.copy(CATALOGUE, catalogue)
    stand_in_translations(catalogue)
    assert translation.untranslated_cells(LANG, book, catalogue) == []
    return book, catalogue


def test_every_english_markdown_cell_has_a_current_translation(book_cells):
    keys = [key for key, _ in translation.english_cells(BOOK)]
    assert len(keys) == len(markdown_of(book_cells)) == len(set(keys))
    missing = translation.untranslated_cells(LANG)
    assert missing == [], f"run `make translations` and translate: {missing}"


@pytest.mark.slow
def test_an_edited_or_new_english_cell_alone_goes_stale_and_stops_the_build(copies):
    """`extract` keeps an edited cell's translation but marks it fuzzy, with the
    English it translated as the previous msgid. A cell added before others under
    the same heading moves their places (msgctxt's number): their translations
    follow their English, still current. The build stops on the two unless told to
    keep their English."""
    book, catalogue = copies
    text, cells = book.read_text("utf-8"), dict(translation.english_cells(book))
    part = text[text.index("# ## Background") :].splitlines()[1:]
    line = next(ln for ln in part if ln.startswith("# ") and len(ln) > 40)
    # a new cell before the second under a heading that has a third: both move
    second = next(cells[k] for k in cells if k.endswith("#2") and k[:-1] + "3" in cells)
    at = text.rindex("# %% [markdown]", 0, text.index("# " + second.split("\n")[0]))
    text = text[:at] + "# %% [markdown]\n# A new cell.\n\n" + text[at:]
    book.write_text(text.replace(line, line + " (edited)", 1), encoding="utf-8")
    translation.extract(LANG, book=book, path=catalogue)
    cells = dict(translation.english_cells(book))
    stale = dict(translation.untranslated_cells(LANG, book, catalogue))
    (edited,) = [k for k in stale if "(edited)" in cells[k]]
    (new,) = [k for k, source in cells.items() if source == "A new cell."]
    assert stale == {edited: "fuzzy", new: "untranslated"} and new.endswith(" #2")
    (entry,) = [e for e in polib.pofile(str(catalogue)) if e.msgctxt == edited]
    assert MARKER in entry.msgstr
    assert entry.previous_msgid == cells[edited].replace(" (edited)", "")
    out = book.with_suffix(".ipynb")
    with pytest.raises(translation.MissingTranslations, match=re.escape(repr(new))):
        translation.build(LANG, book, catalogue, out=out)
    out, kept = translation.build(LANG, book, catalogue, out=out, allow_missing=True)
    shown = markdown_of(nbformat.read(out, as_version=4).cells)
    assert sorted(kept) == sorted(stale) and cells[edited] in shown


def test_a_forks_relink_keeps_every_translation_current(tmp_path):
    """A fork relinks the book's figures to its own address (tools.repository):
    the catalogue's English and Chinese are relinked alike, so no cell goes stale;
    the book relinked alone would leave the cells with figures stale."""
    for name in repository.LINKING:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    toml = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(toml.replace(repository.repository(), "a-fork/of-it"), "utf-8")
    book, catalogue = tmp_path / BOOK.name, tmp_path / CATALOGUE.relative_to(REPO_ROOT)
    stand_in_translations(catalogue)
    kept = catalogue.read_bytes()
    repository.relink(tmp_path, pyproject)
    assert "a-fork/of-it" in catalogue.read_text(encoding="utf-8")
    assert translation.untranslated_cells(LANG, book, catalogue) == []
    catalogue.write_bytes(kept)  # the control: the catalogue left as it was
    stale = dict(translation.untranslated_cells(LANG, book, catalogue))
    assert set(stale.values()) == {"not extracted"}


def test_the_chinese_notebook_is_the_books_code_with_the_catalogues_prose(
    book_cells, chinese, tmp_path
):
    """Each cell in its place, each code cell's source and metadata (its fold tags)
    the book's, without outputs; the notebook what the catalogue builds."""

    def cells(nb):  # a markdown cell's kind; a code cell whole, but its id
        return [{**c, "id": 0} if c.cell_type == "code" else c.cell_type for c in nb]

    assert cells(chinese.cells) == cells(book_cells)
    rebuilt, _ = translation.build(LANG, out=tmp_path / NOTEBOOK.name)
    assert rebuilt.read_bytes() == NOTEBOOK.read_bytes(), "run `make translations`"
    assert "jupytext" not in chinese.metadata  # a plain notebook, paired with no .py


def test_headings_pair_with_the_books_and_every_link_resolves(book_cells, chinese):
    english, translated = markdown_of(book_cells), markdown_of(chinese.cells)
    headings = [h for source in translated for _, h in translation.headings(source)]
    anchors, links = {translation.anchor(h) for h in headings}, 0
    for ours, theirs in zip(english, translated, strict=True):
        assert translation.heading_problems(ours, theirs) == [], theirs[:80]
        found = translation.internal_links(theirs)  # as many as the English has
        assert len(found) == len(translation.internal_links(ours)), theirs[:80]
        assert set(found) <= anchors, theirs[:80]
        links += len(found)
    assert links >= 10


def test_a_translation_that_loses_a_heading_stops_the_build(copies):
    book, catalogue = copies
    entries = polib.pofile(str(catalogue), wrapwidth=0)
    headed = next(e for e in entries if e.msgstr.startswith("## " + MARKER))
    headed.msgstr = headed.msgstr.replace("## " + MARKER, MARKER, 1)
    entries.save(str(catalogue))
    with pytest.raises(translation.TranslationError, match=re.escape(headed.msgctxt)):
        translation.build(LANG, book, catalogue, out=book.with_suffix(".ipynb"))


def test_the_anchor_of_a_heading_is_jupyters():
    """JupyterLab and nbconvert give a heading the id of its rendered text with
    spaces as '-': the form of the book's own links."""
    anchor = translation.anchor
    assert anchor("Part 1: Model architecture") == "Part-1:-Model-architecture"
    assert anchor("The `multi30k` run") == "The-multi30k-run"
    assert anchor("第三部分：在 Multi30k 上") == "第三部分：在-Multi30k-上"
    assert anchor("**粗体** 与 *斜体*") == "粗体-与-斜体"


def test_no_glossary_term_stands_in_english_in_the_chinese_prose(chinese):
    lowered = {}  # one Chinese form per English term, whatever its case
    for english, chinese_form in GLOSSARY.items():
        assert lowered.setdefault(english.lower(), chinese_form) == chinese_form
    for source in markdown_of(chinese.cells):
        assert translation.glossary_problems(source, GLOSSARY) == [], source[:80]


def test_each_term_is_rendered_one_way_and_glossed_once_at_first_use():
    """What `python -m tools.translation check zh` says of the catalogue: a cell
    whose English has a glossary term holds the term's one Chinese form (the same
    English term, the same Chinese term, in every cell), and each core term is
    glossed with its English once, at its first use (translations/zh/STYLE.md)."""
    assert translation.catalogue_problems(LANG) == []


def test_the_term_check_finds_another_rendering_and_a_gloss_out_of_place(tmp_path):
    """Controls on a copy of the catalogue, each found and placed: d2l-zh's 贪心搜索
    for 贪心解码 in one cell, 记忆 glossed twice, 束搜索 glossed after its first use,
    困惑度 never glossed."""
    catalogue = tmp_path / CATALOGUE.name
    shutil.copy(CATALOGUE, catalogue)
    entries = polib.pofile(str(catalogue), wrapwidth=0)

    def edit(old, new, english=""):  # in the first cell holding `old` (and `english`)
        entry = next(e for e in entries if old in e.msgstr and english in e.msgid)
        entry.msgstr = entry.msgstr.replace(old, new)
        return entry.msgctxt

    other = edit("贪心解码", "贪心搜索", "Beam search beside greedy decoding")
    again = edit("得到记忆；", "得到记忆（memory）；")
    first = edit("束搜索（beam search）", "束搜索")
    later = edit("*束搜索*", "*束搜索*（beam search）")
    edit("困惑度（perplexity）", "困惑度")
    entries.save(str(catalogue))
    memory = next(e.msgctxt for e in entries if "（memory）" in e.msgstr)
    assert translation.catalogue_problems(LANG, BOOK, catalogue) == [
        f"{other!r}: zh glossary: 'greedy decoding' in the English, but not 贪心解码 "
        "in the translation",
        f"zh glossary: 记忆 glossed 2 times: {[memory, again]}",
        f"zh glossary: 束搜索 glossed in {later!r}, first used in {first!r}",
        "zh glossary: 困惑度 (perplexity) is never glossed",
    ]


@pytest.mark.parametrize(
    ("text", "flagged"),
    [
        # English terms in the prose, in any case, as whole words, the longest first.
        ("我们用 beam search 解码。", ["beam search"]),
        ("多头注意力由若干个 Heads 组成。", ["Heads"]),
        ("这里的self-attention与交叉注意力不同。", ["self-attention"]),
        ("先做 Layer Normalisation，再相加。", ["Layer Normalisation"]),
        ("这个（beam search）不是注释。", ["beam search"]),  # no 束搜索 before it
        ("束搜索。下一句（beam search）。", ["beam search"]),  # another sentence
        ("一个 [beam search 的例子](https://example.org/)。", ["beam search"]),
        ("用 multi-head attention 计算。", ["multi-head attention"]),
        # Where an English form is allowed: a gloss right after its Chinese term,
        # code, math, link targets and image alt text, a cited title, a term kept
        # in English, and words that only contain a term.
        ("*束搜索*（beam search）每步保留 $k$ 个候选。", []),
        ("查询、键和值（query、key 和 value）来自同一处。", []),
        ("调用 `beam_search(model, key=value)` 即可。", []),
        ("设 $\\text{key} \\cdot \\text{query}$ 为分数。", []),
        ("$$\\text{softmax}(QK^T)V \\quad \\text{attention}$$", []),
        ("见[束搜索](https://example.org/beam-search#attention)。", []),
        ("![attention heads of layer 1](images/attention.png)", []),
        ("[*Attention Is All You Need*](https://arxiv.org/abs/1706.03762)", []),
        ("Transformer 用 softmax 和 dropout，以 BLEU 评分。", []),
        ("keyboard 与 monkeys、Headset 都不是术语。", []),
    ],
)
def test_the_glossary_check_finds_english_terms_only_where_they_do_not_belong(
    text, flagged
):
    problems = translation.glossary_problems(text, GLOSSARY)
    assert [re.match(r"'([^']*)'", p).group(1) for p in problems] == flagged
    if flagged == ["multi-head attention"]:  # the problem names the Chinese form
        assert problems[0].startswith("'multi-head attention' (glossary: 多头注意力)")


def translators_file(path, *entries):
    """A PO file of (msgctxt, msgid, msgstr, flag...) entries, as a translator hands
    one back."""
    po = polib.POFile(wrapwidth=0)
    po.metadata = {"Content-Type": "text/plain; charset=UTF-8"}
    for ctxt, msgid, msgstr, *flags in entries:
        po.append(polib.POEntry(msgctxt=ctxt, msgid=msgid, msgstr=msgstr, flags=flags))
    po.save(str(path))
    return path


def test_merge_takes_the_translations_of_the_same_cell_and_english(copies, tmp_path):
    """A translation of older English is merged fuzzy, unless the cell has a current
    one; two files translating one cell differently stop the merge unwritten."""
    _, catalogue = copies
    first, second, third, cell, *rest = stand_in_translations(catalogue, text="")
    part = translators_file(
        tmp_path / "part_a.po",
        (first.msgctxt, first.msgid, "第一格。"),
        (second.msgctxt, second.msgid, "第二格。", "fuzzy"),  # not yet final
        (third.msgctxt, third.msgid + " An older English.", "第三格。"),
        ("No such place #1", "Nothing.", "无。"),
    )
    report = translation.merge([part], LANG, path=catalogue)
    assert report[0] == f"{part}: 1 merged, 2 stale, 1 unknown"
    summary = f"1 of {4 + len(rest)} cells translated and current, 2 stale (fuzzy)"
    assert report[-1].endswith(f"{summary}, {1 + len(rest)} untranslated")
    merged = {e.msgctxt: e for e in polib.pofile(str(catalogue))}
    current = [translation.current(merged[e.msgctxt]) for e in (first, second, third)]
    assert current == [True, False, False] and "No such place #1" not in merged
    assert merged[third.msgctxt].previous_msgid == third.msgid + " An older English."
    again = translation.merge([part], LANG, path=catalogue)
    assert again[0] == f"{part}: 1 unchanged, 2 stale, 1 unknown"

    def one(name, msgstr, english=cell.msgid):
        return translators_file(tmp_path / name, (cell.msgctxt, english, msgstr))

    before, two = catalogue.read_bytes(), [one("a.po", "甲。"), one("b.po", "乙。")]
    with pytest.raises(translation.TranslationError, match="differently"):
        translation.merge(two, LANG, path=catalogue)
    translation.merge(two[:1], LANG, path=catalogue, dry_run=True)
    assert catalogue.read_bytes() == before  # neither wrote anything
    translation.merge([one("new.po", "新。")], LANG, path=catalogue)
    old = one("old.po", "旧。", cell.msgid + " Older.")
    assert translation.merge([old], LANG, path=catalogue)[0] == f"{old}: 1 skipped"
    (entry,) = [e for e in polib.pofile(str(catalogue)) if e.msgctxt == cell.msgctxt]
    assert entry.msgstr == "新。" and translation.current(entry)
    other = one("other.po", "另一种译法。")
    assert translation.merge([other], LANG, path=catalogue)[0] == f"{other}: 1 replaced"
