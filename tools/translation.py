"""The book in other languages: a gettext catalogue of its prose, one entry per
markdown cell, and the notebook each catalogue builds (the English code cells,
character for character, with the translated prose).

    python -m tools.translation extract [LANG]    the book's markdown into the catalogue
    python -m tools.translation merge FILE... [--lang LANG] [--dry-run]
                                                  translated PO files into the catalogue
    python -m tools.translation build [LANG] [--allow-missing]
                                                  the catalogue into the LANG notebook
    python -m tools.translation check [LANG]      what is missing, stale or off-glossary

Each entry's msgid is an English markdown cell as the reader sees it, and its
msgctxt says where the cell is: the heading it stands under and its place there
("Part 1: Model architecture > Attention (§3.2) #2"). `extract` keeps every
translation whose English is unchanged; a cell whose English changed keeps its old
translation marked fuzzy, with the English it translated as the previous msgid, so
that it shows as stale and never passes for current.

`build` writes notebooks/the_annotated_transformer.LANG.ipynb: every code cell is the
English one, and every markdown cell the current translation of its English. The
links to the book's own headings are rewritten from the English headings' anchors to
the translated ones (the headings of each msgid and msgstr paired in order), the
title cell's "Open in Colab" link opens the LANG notebook, and a line under the title
links to the English edition. A cell without a current translation stops the build,
which names it; --allow-missing keeps its English instead (for work in progress,
never for a committed notebook: tests/test_chinese_edition.py rebuilds it without).
"""

import argparse
import difflib
import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import jupytext
import nbformat
import polib

from tools.repository import blob_url, colab_url

REPO_ROOT = Path(__file__).resolve().parent.parent
BOOK = REPO_ROOT / "the_annotated_transformer.py"
TRANSLATIONS = REPO_ROOT / "translations"
ENGLISH_NOTEBOOK = "notebooks/the_annotated_transformer.ipynb"
HEADING = re.compile(r"^(#{1,4}) +(.+?) *$", re.MULTILINE)


@dataclass(frozen=True)
class Language:
    name: str
    # The line under the translated title, {english} the English edition's address.
    edition_line: str


LANGUAGES = {
    "zh": Language(
        name="Chinese (Simplified)",
        edition_line=(
            "[English edition]({english}) · 这是本书的中文版：代码单元格与英文原版"
            "逐字相同，只有文字是译文。"
        ),
    ),
}


def catalogue_path(lang):
    return TRANSLATIONS / lang / "the_annotated_transformer.po"


def notebook_name(lang):
    """The LANG notebook's path, relative to the repository root."""
    return f"notebooks/the_annotated_transformer.{lang}.ipynb"


def glossary_path(lang):
    return TRANSLATIONS / lang / "glossary.tsv"


def keyed_cells(cells):
    """(msgctxt, source) of each markdown cell: the headings above it, and its
    number among the cells under the same heading."""
    trail, count, out = [], {}, []
    for cell in cells:
        if cell.cell_type != "markdown":
            continue
        first = HEADING.match(cell.source)
        if first:
            level = len(first.group(1))
            trail = [t for t in trail if t[0] < level] + [(level, first.group(2))]
        where = " > ".join(text for level, text in trail if level > 1) or "Title"
        count[where] = count.get(where, 0) + 1
        out.append((f"{where} #{count[where]}", cell.source))
    return out


def english_cells(book=BOOK):
    """The book's markdown cells, keyed, as jupytext gives them to a notebook."""
    return keyed_cells(jupytext.read(book).cells)


def extract(lang, book=BOOK, path=None):
    """Bring the LANG catalogue level with the book's markdown; returns it."""
    path = Path(path or catalogue_path(lang))
    old = polib.pofile(str(path)) if path.is_file() else polib.POFile()
    live = [e for e in old if not e.obsolete]
    by_text = {(e.msgctxt, e.msgid): e for e in live}
    by_place = {e.msgctxt: e for e in live}
    new = polib.POFile(wrapwidth=0)
    new.metadata = old.metadata or {
        "Project-Id-Version": "the_annotated_transformer",
        "Language": lang,
        "MIME-Version": "1.0",
        "Content-Type": "text/plain; charset=UTF-8",
        "Content-Transfer-Encoding": "8bit",
    }
    # First each cell whose English the catalogue has, at its place or, when
    # cells were added or removed before it, at another; then each other cell
    # takes the translation at its place, or of the most alike English, as stale.
    cells = english_cells(book)
    before, used = {}, set()
    by_english = {}
    for entry in live:
        by_english.setdefault(entry.msgid, []).append(entry)
    for key, source in cells:
        candidates = [by_text.get((key, source))] + by_english.get(source, [])
        same = next(
            (e for e in candidates if e is not None and id(e) not in used), None
        )
        if same is not None:
            before[key] = same
            used.add(id(same))
    for key, source in cells:
        if key in before:
            continue
        here = by_place.get(key)
        found = here if here is not None and id(here) not in used else None
        found = found or closest(source, live, used)
        if found is not None:
            before[key] = found
            used.add(id(found))
    for key, source in cells:
        entry = polib.POEntry(msgctxt=key, msgid=source, msgstr="")
        old_entry = before.get(key)
        if old_entry is not None:
            entry.msgstr = old_entry.msgstr
            entry.tcomment = old_entry.tcomment
            stale = old_entry.msgid != source or "fuzzy" in old_entry.flags
            if stale and entry.msgstr:
                entry.flags.append("fuzzy")
                entry.previous_msgid = old_entry.previous_msgid or old_entry.msgid
        new.append(entry)
    for entry in live:  # cells the book no longer has: kept, out of the way
        if id(entry) not in used and entry.msgstr:
            entry.obsolete = True
            new.append(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    new.save(str(path))
    return new


def closest(source, entries, used, cutoff=0.6):
    """The unused entry whose English is most like `source`, if alike enough."""
    best, score = None, cutoff
    for entry in entries:
        if id(entry) in used:
            continue
        ratio = difflib.SequenceMatcher(None, entry.msgid, source).ratio()
        if ratio > score:
            best, score = entry, ratio
    return best


def current(entry):
    """Whether a catalogue entry holds a translation of its msgid as it stands."""
    return bool(entry.msgstr) and "fuzzy" not in entry.flags and not entry.obsolete


# ---------------------------------------------------------------------------
# merge: translators' PO files into the catalogue


class TranslationError(Exception):
    """Something in the catalogue or the translations that a person must fix; the
    message says what and where."""


def merge(files, lang="zh", path=None, dry_run=False):
    """Copy the translations of `files` (PO files holding entries of the catalogue,
    with the same msgctxt) into the LANG catalogue; return the report's lines.

    An entry whose msgctxt and msgid are the catalogue's (or whose English the
    catalogue has once, at another place: cells were added or removed before it)
    sets its msgstr, current unless it is fuzzy in its file; the report counts it
    "replaced" where the catalogue had another current translation. An entry
    whose msgctxt is the catalogue's but whose English is not (the cell changed
    since it was handed out) is merged fuzzy, its English kept as the previous
    msgid, unless the catalogue has a current translation there already. Entries
    matching no cell are reported and left out; two files translating one cell
    differently stop the merge before anything is written.
    """
    path = Path(path or catalogue_path(lang))
    catalogue = polib.pofile(str(path), wrapwidth=0)
    by_key = {(e.msgctxt, e.msgid): e for e in catalogue if not e.obsolete}
    by_place = {e.msgctxt: e for e in catalogue if not e.obsolete}
    by_english = {}
    for entry in catalogue:
        if not entry.obsolete:
            by_english.setdefault(entry.msgid, []).append(entry)
    chosen, lines = {}, []
    for name in files:
        counts = dict.fromkeys(
            ("merged", "replaced", "unchanged", "stale", "skipped", "unknown"), 0
        )
        notes = []
        for given in polib.pofile(str(name)):
            if given.obsolete or not given.msgstr or not given.msgid:
                continue
            target = by_key.get((given.msgctxt, given.msgid))
            if target is None and len(by_english.get(given.msgid, [])) == 1:
                (target,) = by_english[given.msgid]  # the same English, moved
            if target is None:
                target = by_place.get(given.msgctxt)
                if target is None:
                    counts["unknown"] += 1
                    notes.append(f"  no cell {given.msgctxt!r} in the book: left out")
                    continue
                if current(target):
                    counts["skipped"] += 1
                    notes.append(
                        f"  {given.msgctxt!r}: translates an older English text, "
                        "and the catalogue has a current translation: kept that one"
                    )
                    continue
            fuzzy = target.msgid != given.msgid or "fuzzy" in given.flags
            key = (target.msgctxt, target.msgid)
            if key in chosen and chosen[key][1] != (given.msgstr, fuzzy):
                raise TranslationError(
                    f"{chosen[key][0]} and {name} both translate {target.msgctxt!r}, "
                    "differently: keep one, then merge again"
                )
            chosen[key] = (name, (given.msgstr, fuzzy))
            if target.msgstr == given.msgstr and current(target) and not fuzzy:
                counts["unchanged"] += 1
                continue
            replacing = current(target)  # another current translation, overwritten
            target.msgstr = given.msgstr
            target.flags = [f for f in target.flags if f != "fuzzy"]
            target.previous_msgid = None
            if fuzzy:
                target.flags.append("fuzzy")
                if target.msgid != given.msgid:
                    target.previous_msgid = given.msgid
                counts["stale"] += 1
                notes.append(f"  {target.msgctxt!r}: merged as fuzzy (stale)")
            else:
                counts["replaced" if replacing else "merged"] += 1
            for problem in entry_problems(target.msgid, target.msgstr, lang):
                notes.append(f"  {target.msgctxt!r}: {problem}")
        said = ", ".join(f"{n} {what}" for what, n in counts.items() if n)
        lines.append(f"{name}: {said or 'no translated entries'}")
        lines.extend(notes)
    if not dry_run:
        catalogue.save(str(path))
    lines.append(progress(catalogue, path) + (" (dry run: not written)" * dry_run))
    return lines


def shown(path):
    """A path for a message: relative to the repository root when inside it."""
    path = Path(path).resolve()
    return path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path


def progress(catalogue, path):
    live = [e for e in catalogue if not e.obsolete]
    done = sum(current(e) for e in live)
    fuzzy = sum("fuzzy" in e.flags for e in live)
    return (
        f"{shown(path)}: {done} of {len(live)} cells translated and current, "
        f"{fuzzy} stale (fuzzy), {len(live) - done - fuzzy} untranslated"
    )


# ---------------------------------------------------------------------------
# Headings and the links to them


FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
ATX_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
INTERNAL_LINK = re.compile(r"(\]\(\s*)#([^)\s]+)(\s*\))")


def headings(markdown):
    """(level, text) of each heading of a markdown cell, outside fenced code."""
    prose = FENCE.sub("", markdown)
    return [(len(m.group(1)), m.group(2)) for m in ATX_HEADING.finditer(prose)]


def anchor(text):
    """The id Jupyter gives a heading: its text as rendered, spaces as '-'
    (JupyterLab and nbconvert both; nbconvert percent-encodes it in HTML)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    text = re.sub(r"`+([^`]*)`+", r"\1", text)  # code: its characters
    text = re.sub(r"(\*\*|__|\*|_)(\S(?:.*?\S)?)\1", r"\2", text)  # emphasis
    return text.strip().replace(" ", "-")


def internal_links(markdown):
    """The targets of a cell's links into the notebook ('#...'), decoded."""
    return [unquote(m.group(2)) for m in INTERNAL_LINK.finditer(markdown)]


def heading_problems(english, translated):
    """How the translated cell's headings differ from the English cell's."""
    ours, theirs = headings(english), headings(translated)
    if [level for level, _ in ours] != [level for level, _ in theirs]:
        return [
            "its headings are not the English ones, level for level: "
            f"{['#' * lv for lv, _ in ours]} in English, "
            f"{['#' * lv for lv, _ in theirs]} translated"
        ]
    return []


def anchor_map(pairs):
    """{English anchor: translated anchor} of every heading of (English, translated)
    cell pairs, paired in order; TranslationError where they do not pair."""
    mapping = {}
    for key, english, translated in pairs:
        problems = heading_problems(english, translated)
        if problems:
            raise TranslationError(f"{key!r}: {problems[0]}")
        for (_, ours), (_, theirs) in zip(
            headings(english), headings(translated), strict=True
        ):
            mapping.setdefault(anchor(ours), anchor(theirs))
    return mapping


def relink(markdown, mapping):
    """Point each link to an English heading's anchor at the translated heading's."""

    def swap(match):
        target = unquote(match.group(2))
        return f"{match.group(1)}#{mapping.get(target, target)}{match.group(3)}"

    return INTERNAL_LINK.sub(swap, markdown)


# ---------------------------------------------------------------------------
# The glossary: each term's English form stays out of the translated prose


def glossary_rows(path):
    """(English, Chinese, note) of each term of a glossary file (tab-separated, #
    comments, a header line `english<TAB>chinese`); the note, an optional third
    column, is "gloss" for a core term, glossed once at its first use."""
    rows = []
    for number, line in enumerate(Path(path).read_text("utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        english, chinese, note = (line.split("\t") + [""])[:3]
        if "\t" not in line or not chinese.strip():
            raise TranslationError(
                f"{path}:{number}: not ENGLISH<TAB>CHINESE: {line!r}"
            )
        if (english, chinese) != ("english", "chinese"):
            rows.append((english.strip(), chinese.strip(), note.strip()))
    return rows


def read_glossary(path):
    """{English term: Chinese form} of a glossary file (glossary_rows)."""
    return {english: chinese for english, chinese, _ in glossary_rows(path)}


def core_terms(path):
    """The English terms a glossary marks "gloss": each glossed once, at first use."""
    return [english for english, _, note in glossary_rows(path) if note == "gloss"]


DISPLAY_MATH = re.compile(
    r"\$\$.+?\$\$|\\\[.+?\\\]|\\begin\{(\w+\*?)\}.+?\\end\{\1\}", re.S
)
INLINE_MATH = re.compile(r"(?<![\\$])\$(?!\$)(?:\\.|[^$\\])+?\$|\\\(.+?\\\)", re.S)
CODE_SPAN = re.compile(r"(`+)(?:.(?!\1))*?.?\1", re.S)
IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")
# A cited work's title: link text all in italics, [*Attention Is All You Need*](...).
CITED_TITLE = re.compile(r"\[(\*|_)[^\]*_]+\1\]\([^)]*\)")
LINK_TARGET = re.compile(r"(\[[^\]]*\])\([^)\s]*(?:\s+\"[^\"]*\")?\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:.*$", re.M)
URL = re.compile(r"<?(?:https?|ftp)://[^\s)>]+>?")
HTML_TAG = re.compile(r"</?[A-Za-z][^>\n]*>")
GLOSS = re.compile(r"（[^（）]*）")
CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f]")
SENTENCE_END = re.compile(r"[。！？；\n]")


def prose(markdown):
    """The text a glossary check reads: the cell without fenced code, math, code
    spans, images (their alt text too), the titles of cited works, link targets,
    URLs and HTML tags. Each is
    replaced by a space, so that words on either side stay apart."""
    for pattern in (FENCE, DISPLAY_MATH, INLINE_MATH, CODE_SPAN, IMAGE, CITED_TITLE):
        markdown = pattern.sub(" ", markdown)
    markdown = REFERENCE_DEFINITION.sub(" ", markdown)
    markdown = LINK_TARGET.sub(r"\1", markdown)
    return HTML_TAG.sub(" ", URL.sub(" ", markdown))


def term_pattern(term):
    """`term` as a whole word, any case; a word boundary is any character that is
    not an ASCII letter, digit, '_' or '-' (Chinese characters are boundaries)."""
    words = r"[\s\-]+".join(re.escape(word) for word in re.split(r"[\s-]+", term))
    return re.compile(rf"(?<![A-Za-z0-9_-]){words}(?![A-Za-z0-9_-])", re.I)


def english_forms(text, glossary):
    """(term, match) of each glossary term's English form in `text` (prose), the
    longest terms first, so that a phrase is read as itself and not as its words;
    a term kept in English (its Chinese form is the English) is left out."""
    taken = [False] * len(text)
    for term in sorted(glossary, key=len, reverse=True):
        for match in term_pattern(term).finditer(text):
            start, end = match.span()
            if any(taken[start:end]):
                continue
            taken[start:end] = [True] * (end - start)
            if glossary[term].lower() != term.lower():
                yield term, match


def glossary_problems(markdown, glossary):
    """Each place where a glossary term's English form stands in the translated
    prose: 'term' in '...context...'. Allowed: a term kept in English
    (Transformer, softmax, ...), and a gloss in full-width parentheses right after a
    Chinese term when the term it glosses is written in Chinese in the same
    sentence: 束搜索（beam search）."""
    text, found = prose(markdown), []
    for term, match in english_forms(text, glossary):
        start, end = match.span()
        if not glossed(text, start, end, glossary[term]):
            context = text[max(0, start - 20) : end + 20].replace("\n", " ")
            found.append(
                f"{match.group(0)!r} (glossary: {glossary[term]}) in {context!r}"
            )
    return found


def glossed(text, start, end, chinese):
    """Whether text[start:end] is inside a full-width parenthesis that directly
    follows a Chinese character, with `chinese` in the sentence before it."""
    for gloss in GLOSS.finditer(text):
        if gloss.start() < start and end <= gloss.end():
            before = text[: gloss.start()].rstrip("*_")  # after *emphasis*, too
            if not before or not CJK.match(before[-1]):
                return False
            stops = list(SENTENCE_END.finditer(before))
            sentence = before[stops[-1].end() if stops else 0 :]
            return chinese in sentence
    return False


def rendering_problems(english, translated, glossary):
    """Each glossary term of the English cell's prose (english_forms: a phrase
    read as itself) whose one Chinese form is not in the translation's prose: the
    same English term, the same Chinese term, in every cell."""
    theirs = prose(translated)
    used = dict.fromkeys(term for term, _ in english_forms(prose(english), glossary))
    return [
        f"{term!r} in the English, but not {glossary[term]} in the translation"
        for term in used
        if glossary[term] not in theirs
    ]


def gloss_problems(cells, glossary, core):
    """The first-use rule over the translated cells [(key, markdown)], in the
    book's order: a term's Chinese form glossed with its English at most once, in
    the first cell that uses the form (one of two characters or more), and each
    core term glossed."""
    first, glossed_in = {}, {}
    for key, markdown in cells:
        text = prose(markdown)
        for chinese in glossary.values():
            if chinese in text:
                first.setdefault(chinese, key)
        for term, _ in english_forms(text, glossary):
            glossed_in.setdefault(glossary[term], []).append(key)
    problems = [
        f"{chinese} glossed in {keys[0]!r}, first used in {first.get(chinese)!r}"
        if len(keys) == 1
        else f"{chinese} glossed {len(keys)} times: {keys}"
        for chinese, keys in glossed_in.items()
        if len(keys) > 1 or len(chinese) > 1 and keys[0] != first.get(chinese)
    ]
    unglossed = [t for t in core if glossary[t] not in glossed_in]
    return problems + [f"{glossary[t]} ({t}) is never glossed" for t in unglossed]


def entry_problems(english, translated, lang):
    """What is wrong with one translated cell: its headings, and its glossary (a
    term's English form in the prose, or another rendering of it)."""
    problems = heading_problems(english, translated)
    path = glossary_path(lang)
    if path.is_file():
        glossary = read_glossary(path)
        found = glossary_problems(translated, glossary)
        found += rendering_problems(english, translated, glossary)
        problems += [f"{lang} glossary: {p}" for p in found]
    return problems


# ---------------------------------------------------------------------------
# build: the catalogue into the LANG notebook


class MissingTranslations(TranslationError):
    """Markdown cells without a current translation; `keys` names them."""

    def __init__(self, message, keys):
        super().__init__(message)
        self.keys = keys


def cell_id(cell, seen):
    """A cell id that stays put while the cell's English does: from its English."""
    digest = hashlib.sha1(f"{cell.cell_type}\n{cell.source}".encode()).hexdigest()[:8]
    seen[digest] = seen.get(digest, 0) + 1
    return digest if seen[digest] == 1 else f"{digest}-{seen[digest]}"


def stable_ids(path):
    """Give the notebook at `path` cell ids from its cells' text (cell_id), in place:
    jupytext draws random ones, and a rebuild would change every line that holds one."""
    notebook = nbformat.read(path, as_version=4)
    seen = {}
    for cell in notebook.cells:
        cell.id = cell_id(cell, seen)
    nbformat.write(notebook, path)


def translated_notebook(lang, book=BOOK, catalogue=None, allow_missing=False):
    """The LANG notebook as a NotebookNode, and the keys of the cells it left in
    English (only with allow_missing; otherwise MissingTranslations)."""
    if lang not in LANGUAGES:
        raise TranslationError(f"no language {lang!r}; one of {sorted(LANGUAGES)}")
    path = Path(catalogue or catalogue_path(lang))
    if not path.is_file():
        raise TranslationError(
            f"no catalogue {path}: run `python -m tools.translation extract {lang}`"
        )
    entries = polib.pofile(str(path))
    by_key = {(e.msgctxt, e.msgid): e for e in entries if not e.obsolete}
    by_place = {e.msgctxt: e for e in entries if not e.obsolete}
    english = jupytext.read(book)
    keys = iter(keyed_cells(english.cells))

    pairs, missing, why = [], [], []
    for cell in english.cells:
        if cell.cell_type != "markdown":
            continue
        key, source = next(keys)
        entry = by_key.get((key, source))
        if entry is not None and current(entry):
            pairs.append((key, source, entry.msgstr))
            continue
        missing.append(key)
        if entry is not None and entry.msgstr:
            why.append(f"  {key!r}: fuzzy (its English changed, or it is marked so)")
        elif entry is not None:
            why.append(f"  {key!r}: not translated")
        elif key in by_place:
            why.append(f"  {key!r}: the catalogue has older English here (extract)")
        else:
            why.append(f"  {key!r}: not in the catalogue (extract)")
        pairs.append((key, source, None))
    if missing and not allow_missing:
        raise MissingTranslations(
            f"{shown(path)}: {len(missing)} of {len(pairs)} markdown cells have no "
            "current translation:\n"
            + "\n".join(why)
            + "\nRun `make translations`, translate those entries (and drop their "
            "fuzzy flag), then build again; `--allow-missing` (make ... "
            "ALLOW_MISSING=1) keeps their English for now.",
            missing,
        )

    # The cells left in English keep their headings, and the links to them.
    mapping = anchor_map([(k, s, t) for k, s, t in pairs if t is not None])
    translated = iter(pairs)
    cells, seen = [], {}
    for index, cell in enumerate(english.cells):
        if cell.cell_type == "markdown":
            _, source, text = next(translated)
            if text is None:
                text = relink(source, mapping)
            else:
                text = relink(text, mapping)
                text = title_cell(text, lang) if index == 0 else text
            made = nbformat.v4.new_markdown_cell(text, metadata=cell.metadata)
        else:
            made = nbformat.v4.new_code_cell(cell.source, metadata=cell.metadata)
        made.id = cell_id(cell, seen)
        cells.append(made)
    metadata = {"kernelspec": english.metadata["kernelspec"]}
    return nbformat.v4.new_notebook(cells=cells, metadata=metadata), missing


def title_cell(text, lang):
    """The translated title cell: its Colab link opens the LANG notebook, and a line
    under the title links to the English edition."""
    english, ours = colab_url(ENGLISH_NOTEBOOK), colab_url(notebook_name(lang))
    text = text.replace(english, ours)
    line = LANGUAGES[lang].edition_line.format(english=blob_url(ENGLISH_NOTEBOOK))
    title, _, rest = text.partition("\n")
    if not title.startswith("# "):
        return f"{line}\n\n{text}"
    rest = rest.lstrip("\n")
    return f"{title}\n\n{line}\n\n{rest}" if rest else f"{title}\n\n{line}"


def build(lang, book=BOOK, catalogue=None, out=None, allow_missing=False):
    """Write the LANG notebook (notebooks/the_annotated_transformer.LANG.ipynb, or
    `out`); return (its path, the keys of cells left in English)."""
    notebook, missing = translated_notebook(lang, book, catalogue, allow_missing)
    out = Path(out or REPO_ROOT / notebook_name(lang))
    out.parent.mkdir(parents=True, exist_ok=True)
    text = nbformat.writes(notebook) + "\n"
    if not out.is_file() or out.read_text(encoding="utf-8") != text:
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
    return out, missing


# ---------------------------------------------------------------------------
# check: the catalogue's state, as the tests see it


def untranslated_cells(lang, book=BOOK, catalogue=None):
    """(msgctxt, why) of each markdown cell of the book without a current
    translation in the LANG catalogue: not extracted, untranslated, or fuzzy."""
    path = Path(catalogue or catalogue_path(lang))
    entries = polib.pofile(str(path)) if path.is_file() else []
    by_key = {(e.msgctxt, e.msgid): e for e in entries if not e.obsolete}
    out = []
    for key, source in english_cells(book):
        entry = by_key.get((key, source))
        if entry is None:
            out.append((key, "not extracted"))
        elif not entry.msgstr:
            out.append((key, "untranslated"))
        elif not current(entry):
            out.append((key, "fuzzy"))
    return out


def catalogue_problems(lang, book=BOOK, catalogue=None):
    """Every cell of the book without a current translation, every current
    translation with headings or glossary terms out of place, and every break of
    the glossary's first-use rule (gloss_problems)."""
    path = Path(catalogue or catalogue_path(lang))
    problems = [f"{k!r}: {why}" for k, why in untranslated_cells(lang, book, path)]
    entries = polib.pofile(str(path)) if path.is_file() else []
    by_key = {(e.msgctxt, e.msgid): e for e in entries if current(e)}
    translated = []
    for key, source in english_cells(book):
        entry = by_key.get((key, source))
        if entry is not None:
            found = entry_problems(source, entry.msgstr, lang)
            problems += [f"{key!r}: {problem}" for problem in found]
            translated.append((key, entry.msgstr))
    glossary = glossary_path(lang)
    if glossary.is_file():
        terms, core = read_glossary(glossary), core_terms(glossary)
        found = gloss_problems(translated, terms, core)
        problems += [f"{lang} glossary: {problem}" for problem in found]
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tools.translation", description=__doc__.partition("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    languages = sorted(LANGUAGES)
    for name in ("extract", "build", "check"):
        command = commands.add_parser(name)
        command.add_argument("lang", nargs="?", default="zh", choices=languages)
        if name == "build":
            command.add_argument(
                "--allow-missing",
                action="store_true",
                help="keep the English of cells without a current translation",
            )
    ids = commands.add_parser("ids", help="give a notebook cell ids from its text")
    ids.add_argument("notebook", type=Path)
    merging = commands.add_parser("merge")
    merging.add_argument("files", nargs="+", type=Path)
    merging.add_argument("--lang", default="zh", choices=languages)
    merging.add_argument("--dry-run", action="store_true", help="report, write nothing")
    args = parser.parse_args(argv)

    try:
        if args.command == "extract":
            catalogue = extract(args.lang)
            print(progress(catalogue, catalogue_path(args.lang)))
        elif args.command == "ids":
            stable_ids(args.notebook)
        elif args.command == "merge":
            print("\n".join(merge(args.files, args.lang, dry_run=args.dry_run)))
        elif args.command == "build":
            out, missing = build(args.lang, allow_missing=args.allow_missing)
            print(f"wrote {out.relative_to(REPO_ROOT)}", end="")
            print(f" ({len(missing)} cells left in English)" if missing else "")
        else:
            problems = catalogue_problems(args.lang)
            print(
                "\n".join(problems) or "every cell translated, current and on-glossary"
            )
            return 1 if problems else 0
    except TranslationError as error:
        sys.exit(f"translation: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
