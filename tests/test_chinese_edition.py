"""The Chinese edition (中文版): one book in two languages, never out of step.

The English book is the one source of the code. translations/zh/ holds a gettext
catalogue of its markdown cells (tools.translation extracts it; an edited English
cell turns its entry fuzzy) and the glossary that fixes each term's Chinese form;
notebooks/the_annotated_transformer.zh.ipynb is built from the two. These tests fail
when a markdown cell has no current translation, when the Chinese notebook's code is
not the book's to the character, when the notebook is not what the catalogue builds,
when a heading or a link to one does not resolve, and when a glossary term appears
in English in the Chinese prose. Each comes with a control, on a temporary copy,
that shows the check failing where it should. (tests/test_site.py checks the Chinese
page, tests/test_colab.py runs the Chinese notebook alone.)
"""

import re
import shutil
from pathlib import Path

import jupytext
import nbformat
import polib
import pytest

from tools import repository, translation

REPO_ROOT = Path(__file__).resolve().parent.parent

LANG = "zh"
BOOK = REPO_ROOT / "the_annotated_transformer.py"
CATALOGUE = translation.catalogue_path(LANG)
NOTEBOOK = REPO_ROOT / translation.notebook_name(LANG)
GLOSSARY = translation.read_glossary(translation.glossary_path(LANG))
MARKER = "【译】"  # what a control's stand-in translation starts with


@pytest.fixture(scope="module")
def book_cells():
    return jupytext.read(BOOK).cells


@pytest.fixture(scope="module")
def chinese():
    return nbformat.read(NOTEBOOK, as_version=4)


def markdown_of(cells):
    return [cell.source for cell in cells if cell.cell_type == "markdown"]


@pytest.fixture
def copies(tmp_path):
    """A copy of the book and of the catalogue, for a control to change."""
    book, catalogue = tmp_path / BOOK.name, tmp_path / CATALOGUE.name
    shutil.copy(BOOK, book)
    shutil.copy(CATALOGUE, catalogue)
    return book, catalogue


def stand_in(english):
    """A stand-in translation: the English, marked at its start and in each
    heading (so that the headings still pair)."""
    text = re.sub(r"^(#{1,6} +)", r"\g<1>" + MARKER, english, flags=re.MULTILINE)
    return text if text.startswith("#") else MARKER + text


def stand_in_translations(catalogue):
    """Give every entry of the catalogue file a stand-in translation, current: a
    control then starts from a complete catalogue, whatever state the real one is
    in (and never from a real translation it could depend on)."""
    entries = polib.pofile(str(catalogue), wrapwidth=0)
    for entry in entries:
        entry.msgstr = stand_in(entry.msgid)
        entry.flags = [flag for flag in entry.flags if flag != "fuzzy"]
        entry.previous_msgid = None
    entries.save(str(catalogue))


def edit_cell(book, old, new):
    """Replace a sentence of the book's markdown (in the .py, one line of a cell)."""
    text = book.read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    book.write_text(text.replace(old, new), encoding="utf-8")


def key_of(book, words):
    """The msgctxt of the book's markdown cell that holds `words`."""
    (key,) = [k for k, source in translation.english_cells(book) if words in source]
    return key


# ---------------------------------------------------------------------------
# Every English markdown cell has a current translation


def test_every_english_markdown_cell_has_a_current_translation(book_cells):
    keys = [key for key, _ in translation.english_cells(BOOK)]
    assert len(keys) == len(markdown_of(book_cells)) == len(set(keys))
    missing = translation.untranslated_cells(LANG)
    assert missing == [], (
        f"{len(missing)} of {len(keys)} cells have no current translation: {missing}. "
        "Run `make translations`, translate translations/zh/*.po's fuzzy and empty "
        "entries, and build again."
    )


def a_line_of_prose(book):
    """A line of a markdown cell of the book that a control can edit: the first
    prose line of the Background section."""
    text = book.read_text(encoding="utf-8")
    part = text[text.index("# ## Background") :]
    line = next(
        ln for ln in part.splitlines()[1:] if ln.startswith("# ") and len(ln) > 40
    )
    return line


@pytest.mark.slow
def test_an_edited_english_cell_turns_its_translation_fuzzy(copies):
    """The control of the test above: one sentence of the book changed, `extract`
    keeps that cell's translation but marks it fuzzy, with the English it
    translated as the previous msgid; the check then names that cell, and only it,
    and the build stops on it unless told to keep its English."""
    book, catalogue = copies
    stand_in_translations(catalogue)
    assert translation.untranslated_cells(LANG, book, catalogue) == []
    line = a_line_of_prose(book)
    edit_cell(book, line, line + " (edited)")
    key = key_of(book, line[2:] + " (edited)")

    translation.extract(LANG, book=book, path=catalogue)
    assert translation.untranslated_cells(LANG, book, catalogue) == [(key, "fuzzy")]
    (entry,) = [e for e in polib.pofile(str(catalogue)) if e.msgctxt == key]
    assert "fuzzy" in entry.flags and MARKER in entry.msgstr
    assert line[2:] in entry.previous_msgid and "(edited)" not in entry.previous_msgid

    with pytest.raises(translation.MissingTranslations) as stopped:
        translation.build(LANG, book, catalogue, out=book.with_suffix(".ipynb"))
    assert stopped.value.keys == [key] and repr(key) in str(stopped.value)
    out, kept = translation.build(
        LANG, book, catalogue, out=book.with_suffix(".ipynb"), allow_missing=True
    )
    assert kept == [key]
    shown = markdown_of(nbformat.read(out, as_version=4).cells)
    assert sum(line[2:] + " (edited)" in text for text in shown) == 1


@pytest.mark.slow
def test_a_new_english_cell_leaves_the_other_translations_current(copies):
    """A cell added before others under the same heading moves their places
    (msgctxt's number): their translations follow their English, still current;
    only the new cell is untranslated. A cell removed leaves no stale entry."""
    book, catalogue = copies
    stand_in_translations(catalogue)
    cells = translation.english_cells(book)
    # The second cell under a heading that has a third: both move.
    second = next(
        source
        for key, source in cells
        if key.endswith(" #2") and key.replace(" #2", " #3") in dict(cells)
    )
    text = book.read_text(encoding="utf-8")
    at = text.index("# " + second.splitlines()[0])
    starts = text.rindex("# %% [markdown]", 0, at)
    new = "# %% [markdown]\n# A new cell, written today.\n\n"
    book.write_text(text[:starts] + new + text[starts:], encoding="utf-8")

    translation.extract(LANG, book=book, path=catalogue)
    key = key_of(book, "A new cell, written today.")
    assert key.endswith(" #2")
    assert translation.untranslated_cells(LANG, book, catalogue) == [
        (key, "untranslated")
    ]


def test_a_forks_relink_keeps_every_translation_current(tmp_path):
    """A fork relinks the book's figures to its own address (tools.repository):
    the catalogue's English and Chinese are relinked alike, so no cell goes stale.
    The control: the book relinked alone leaves the cells with figures fuzzy."""
    for name in repository.LINKING:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    here = repository.repository()
    toml = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(toml.replace(here, "a-fork/of-it"), encoding="utf-8")
    book, catalogue = tmp_path / BOOK.name, tmp_path / CATALOGUE.relative_to(REPO_ROOT)
    stand_in_translations(catalogue)
    kept = catalogue.read_bytes()
    repository.relink(tmp_path, pyproject)
    assert "a-fork/of-it" in catalogue.read_text(encoding="utf-8")
    assert translation.untranslated_cells(LANG, book, catalogue) == []
    catalogue.write_bytes(kept)  # the control: the catalogue left as it was
    stale = translation.untranslated_cells(LANG, book, catalogue)
    assert stale and {why for _, why in stale} == {"not extracted"}


# ---------------------------------------------------------------------------
# The Chinese notebook's code is the book's, to the character


def code_differences(english, translated):
    """Where two notebooks' cells differ in anything but the markdown's text: the
    kind of each cell, and each code cell's source and metadata (its fold tags)."""
    found = []
    if len(english) != len(translated):
        found.append(f"{len(translated)} cells, the book has {len(english)}")
    for index, (ours, theirs) in enumerate(zip(english, translated, strict=False)):
        if ours.cell_type != theirs.cell_type:
            found.append(f"cell {index} is {theirs.cell_type}, not {ours.cell_type}")
        elif ours.cell_type == "code" and ours.source != theirs.source:
            found.append(f"code cell {index} differs: {theirs.source[:60]!r}")
        elif ours.cell_type == "code" and ours.metadata != theirs.metadata:
            found.append(f"code cell {index}'s metadata differs")
    return found


def test_the_chinese_notebooks_code_cells_are_the_books(book_cells, chinese):
    assert code_differences(book_cells, chinese.cells) == []
    assert [c.source for c in chinese.cells if c.cell_type == "code"] == [
        c.source for c in book_cells if c.cell_type == "code"
    ]
    for cell in chinese.cells:  # committed without outputs, like the English one
        assert cell.get("outputs", []) == [] and cell.get("execution_count") is None


def test_a_changed_character_or_order_of_code_is_found(book_cells, chinese):
    """The control: one character of one code cell, two code cells swapped, a
    cell missing, and a fold tag dropped are each found."""
    code = [i for i, c in enumerate(chinese.cells) if c.cell_type == "code"]
    one = nbformat.from_dict(chinese)
    one.cells[code[5]].source = one.cells[code[5]].source.replace("(", "[", 1)
    swapped = nbformat.from_dict(chinese)
    first, second = code[3], code[4]
    cells = swapped.cells
    cells[first], cells[second] = cells[second], cells[first]
    fewer = nbformat.from_dict(chinese)
    del fewer.cells[code[-1]]
    untagged = nbformat.from_dict(chinese)
    tagged = next(i for i in code if untagged.cells[i].metadata.get("tags"))
    untagged.cells[tagged].metadata.pop("tags")
    for changed in (one, swapped, fewer, untagged):
        assert code_differences(book_cells, changed.cells) != []


# ---------------------------------------------------------------------------
# The Chinese notebook is what the catalogue builds


def test_the_chinese_notebook_is_what_the_catalogue_builds(tmp_path):
    rebuilt, _ = translation.build(LANG, out=tmp_path / NOTEBOOK.name)
    assert rebuilt.read_bytes() == NOTEBOOK.read_bytes(), (
        f"{NOTEBOOK.relative_to(REPO_ROOT)} is not what the catalogue builds: run "
        "`make translations` (or `make notebook`)."
    )
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert "jupytext" not in nb.metadata  # a plain notebook, paired with no .py


@pytest.mark.slow
def test_a_changed_translation_changes_the_built_notebook(copies, tmp_path):
    """The control: one translation changed in a copy of the catalogue builds a
    different notebook, different in that cell only."""
    book, catalogue = copies
    stand_in_translations(catalogue)
    before, _ = translation.build(LANG, book, catalogue, out=tmp_path / "before.ipynb")
    entries = polib.pofile(str(catalogue), wrapwidth=0)
    entries[3].msgstr += "\n\n补充一句。"
    entries.save(str(catalogue))
    after, _ = translation.build(LANG, book, catalogue, out=tmp_path / "after.ipynb")
    assert after.read_bytes() != before.read_bytes()
    old, new = (nbformat.read(p, as_version=4).cells for p in (before, after))
    changed = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
    assert len(changed) == 1 and new[changed[0]].source.endswith("补充一句。")


# ---------------------------------------------------------------------------
# Headings pair, and every link to one resolves


def link_problems(cells):
    """Each link into the notebook ('#...') that no heading of `cells` has as its
    anchor."""
    anchors = {
        translation.anchor(text)
        for source in markdown_of(cells)
        for _, text in translation.headings(source)
    }
    return [
        f"{target!r} in {source[:40]!r}"
        for source in markdown_of(cells)
        for target in translation.internal_links(source)
        if target not in anchors
    ]


def test_every_heading_pairs_with_the_books_and_every_link_resolves(
    book_cells, chinese
):
    english, translated = markdown_of(book_cells), markdown_of(chinese.cells)
    assert len(english) == len(translated)
    for ours, theirs in zip(english, translated, strict=True):
        assert translation.heading_problems(ours, theirs) == [], theirs[:80]
        # As many links into the book as the English cell has.
        assert len(translation.internal_links(theirs)) == len(
            translation.internal_links(ours)
        ), theirs[:80]
    assert link_problems(chinese.cells) == []
    assert len([t for s in translated for t in translation.internal_links(s)]) >= 10


def test_a_lost_heading_or_a_link_to_nowhere_is_found(copies, chinese, tmp_path):
    """The controls: a translation that drops a heading stops the build, naming
    the cell; a link to an anchor no heading has is found; and an English anchor
    left in a translation is rewritten to the Chinese heading's."""
    book, catalogue = copies
    stand_in_translations(catalogue)
    entries = polib.pofile(str(catalogue), wrapwidth=0)
    headed = next(e for e in entries if e.msgstr.startswith("## " + MARKER))
    headed.msgstr = headed.msgstr.replace("## " + MARKER, MARKER, 1)
    entries.save(str(catalogue))
    with pytest.raises(translation.TranslationError, match=re.escape(headed.msgctxt)):
        translation.build(LANG, book, catalogue, out=tmp_path / "lost.ipynb")

    nowhere = nbformat.from_dict(chinese)
    nowhere.cells[0].source += "\n\n见[不存在的一节](#不存在的一节)。"
    assert link_problems(nowhere.cells) == [
        f"'不存在的一节' in {nowhere.cells[0].source[:40]!r}"
    ]

    mapping = {"Part-1:-Model-architecture": "第一部分：模型结构"}
    assert (
        translation.relink("见[第一部分](#Part-1:-Model-architecture)。", mapping)
        == "见[第一部分](#第一部分：模型结构)。"
    )


def test_the_anchor_of_a_heading_is_jupyters():
    """JupyterLab and nbconvert give a heading the id of its rendered text with
    spaces as '-': the form of the book's own links."""
    assert translation.anchor("Part 1: Model architecture") == (
        "Part-1:-Model-architecture"
    )
    assert translation.anchor("The `multi30k` run") == "The-multi30k-run"
    assert translation.anchor("第三部分：真实例子——在 Multi30k 上做德译英") == (
        "第三部分：真实例子——在-Multi30k-上做德译英"
    )
    assert translation.anchor("**粗体** 与 *斜体*") == "粗体-与-斜体"


# ---------------------------------------------------------------------------
# The glossary: a term's English form stays out of the Chinese prose


def test_the_glossary_fixes_the_issues_terms_once():
    issue_terms = (
        "注意力 多头注意力 位置编码 层归一化 残差连接 前馈网络 标签平滑 束搜索"
    )
    issue_terms += " 贪心解码 子词 键值缓存 检查点平均"
    assert set(issue_terms.split()) <= set(GLOSSARY.values())
    # One Chinese form per English term, whatever its case.
    lowered = {}
    for english, chinese_form in GLOSSARY.items():
        assert lowered.setdefault(english.lower(), chinese_form) == chinese_form


def test_no_glossary_term_stands_in_english_in_the_chinese_prose(chinese):
    problems = [
        f"cell {index}: {problem}"
        for index, cell in enumerate(chinese.cells)
        if cell.cell_type == "markdown"
        for problem in translation.glossary_problems(cell.source, GLOSSARY)
    ]
    assert problems == []


@pytest.mark.parametrize(
    ("text", "flagged"),
    [
        # The controls: English terms in the prose, in any case, as whole words.
        ("我们用 beam search 解码。", ["beam search"]),
        ("多头注意力由若干个 Heads 组成。", ["Heads"]),
        ("这里的self-attention与交叉注意力不同。", ["self-attention"]),
        ("先做 Layer Normalisation，再相加。", ["Layer Normalisation"]),
        ("这个（beam search）不是注释。", ["beam search"]),  # no 束搜索 before it
        ("束搜索。下一句（beam search）。", ["beam search"]),  # another sentence
        ("一个 [beam search 的例子](https://example.org/)。", ["beam search"]),
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


def test_the_longest_term_is_read_first():
    (problem,) = translation.glossary_problems(
        "用 multi-head attention 计算。", GLOSSARY
    )
    assert problem.startswith("'multi-head attention' (glossary: 多头注意力)")


# ---------------------------------------------------------------------------
# merge: the translators' files into the catalogue


def translators_file(path, entries):
    """A PO file of (msgctxt, msgid, msgstr, flags) entries, as a translator hands
    one back."""
    po = polib.POFile(wrapwidth=0)
    po.metadata = {"Content-Type": "text/plain; charset=UTF-8"}
    for msgctxt, msgid, msgstr, flags in entries:
        po.append(
            polib.POEntry(msgctxt=msgctxt, msgid=msgid, msgstr=msgstr, flags=flags)
        )
    po.save(str(path))
    return path


@pytest.fixture
def empty_catalogue(copies):
    """The copy of the catalogue with every translation taken out."""
    _, catalogue = copies
    entries = polib.pofile(str(catalogue), wrapwidth=0)
    for entry in entries:
        entry.msgstr, entry.flags, entry.previous_msgid = "", [], None
    entries.save(str(catalogue))
    return catalogue, [e for e in entries if not e.obsolete]


def test_merge_takes_each_translation_of_the_same_cell_and_english(
    empty_catalogue, tmp_path
):
    catalogue, entries = empty_catalogue
    first, second, third = entries[:3]
    part = translators_file(
        tmp_path / "part_a.po",
        [
            (first.msgctxt, first.msgid, "第一格。", []),
            (second.msgctxt, second.msgid, "第二格。", ["fuzzy"]),  # not yet final
            (third.msgctxt, third.msgid + " An older English.", "第三格。", []),
            ("No such place #1", "Nothing.", "无。", []),
        ],
    )
    report = translation.merge([part], LANG, path=catalogue)
    assert report[0] == f"{part}: 1 merged, 2 stale, 1 unknown"
    merged = {e.msgctxt: e for e in polib.pofile(str(catalogue))}
    assert merged[first.msgctxt].msgstr == "第一格。"
    assert translation.current(merged[first.msgctxt])
    assert "fuzzy" in merged[second.msgctxt].flags
    assert "fuzzy" in merged[third.msgctxt].flags
    assert merged[third.msgctxt].previous_msgid == third.msgid + " An older English."
    assert "No such place #1" not in merged
    assert report[-1].endswith(
        f"1 of {len(entries)} cells translated and current, 2 stale (fuzzy), "
        f"{len(entries) - 3} untranslated"
    )
    # Merged again: nothing changes.
    again = translation.merge([part], LANG, path=catalogue)
    assert again[0] == f"{part}: 1 unchanged, 2 stale, 1 unknown"


def test_merge_stops_on_two_different_translations_of_one_cell(
    empty_catalogue, tmp_path
):
    catalogue, entries = empty_catalogue
    cell = entries[0]
    one = translators_file(tmp_path / "a.po", [(cell.msgctxt, cell.msgid, "甲。", [])])
    two = translators_file(tmp_path / "b.po", [(cell.msgctxt, cell.msgid, "乙。", [])])
    before = catalogue.read_bytes()
    with pytest.raises(translation.TranslationError, match="differently"):
        translation.merge([one, two], LANG, path=catalogue)
    assert catalogue.read_bytes() == before
    translation.merge([one], LANG, path=catalogue, dry_run=True)
    assert catalogue.read_bytes() == before  # a dry run writes nothing


def test_merge_keeps_a_current_translation_over_one_of_older_english(
    empty_catalogue, tmp_path
):
    catalogue, entries = empty_catalogue
    cell = entries[0]
    now = translators_file(tmp_path / "a.po", [(cell.msgctxt, cell.msgid, "新。", [])])
    translation.merge([now], LANG, path=catalogue)
    old = translators_file(
        tmp_path / "b.po", [(cell.msgctxt, cell.msgid + " Older.", "旧。", [])]
    )
    report = translation.merge([old], LANG, path=catalogue)
    assert report[0] == f"{old}: 1 skipped"
    (entry,) = [e for e in polib.pofile(str(catalogue)) if e.msgctxt == cell.msgctxt]
    assert entry.msgstr == "新。" and translation.current(entry)
    # Another translation of the same English replaces it, and the report says so.
    other = translators_file(
        tmp_path / "c.po", [(cell.msgctxt, cell.msgid, "另一种译法。", [])]
    )
    assert translation.merge([other], LANG, path=catalogue)[0] == f"{other}: 1 replaced"


# ---------------------------------------------------------------------------
# Where a reader finds the Chinese edition


def test_the_readmes_first_screen_points_chinese_readers_to_their_edition():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    first_screen = readme.split("\n## ", 1)[0]
    lines = [ln for ln in first_screen.splitlines() if translation.CJK.search(ln)]
    assert len(lines) == 1, lines
    (line,) = lines
    assert f"]({translation.notebook_name(LANG)})" in line  # the notebook
    assert "zh/" in line  # the rendered page of the site
    contributing = readme.split("\n## Contributing", 1)[1].split("\n## ", 1)[0]
    assert "make translations" in contributing
