"""The documented command lines: every `python -m workshop ...` of README.md and
docs/*.md, checked against the program itself, so the docs and the program cannot
drift apart.

Each line is taken from the Markdown (a code block's line, `\\` continuations
joined, or an inline code span) and parsed with the command line's own parser
(workshop.cli.build_parser), options spelled in full: a flag renamed in the program
fails here. Placeholders in capitals (DIR, K, P) stand for any value the option
takes; `a|b|c` must parse as each of a, b and c; a line cut short with `...` and a
fragment such as `train --time-limit MINUTES` or `--beam K --alpha A` must name
options the command (or some command) has. A checkpoint a line reads must be one an
earlier line of the same page writes (`train --out DIR` writes DIR/last.pt and the
epoch_NNN.pt files its run keeps; `average --out F` writes F). Then the short ones
(translate, average, attention, --help; on this machine's CPU) run, with the
session's smoke run standing in for each run a page trains (runs/quick), and so
does the Python of translating.md's "From Python".
"""

import contextlib
import functools
import io
import itertools
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import the_annotated_transformer as tat
from workshop import cli
from workshop.run import checkpoints, settings

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

# The interpreter before `-m workshop`: python, .venv/bin/python, torchrun [options].
COMMAND_LINE = re.compile(
    r"(?:^|\s)(?:\S*python3?|torchrun(?:\s+-{1,2}\S+)*)\s+-m\s+workshop(?=\s|$)(.*)"
)
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")
ELLIPSIS = ("...", "…")
SHELL_STOPS = ("|", "||", "&&", ";")
RUNNABLE = ("translate", "average", "attention")  # seconds on a smoke-sized run
# What a documented stdin file holds when the page does not write it: three lines,
# the middle one blank, so that the answer can be checked line for line.
STDIN_LINES = ["Zwei Hunde spielen im Schnee.", "", "Ein Mann fährt Fahrrad."]


@dataclass
class Documented:
    """One documented use of the command line."""

    doc: str  # the page, relative to the repository
    line: int  # where it starts
    text: str  # as written
    words: list  # the words after `-m workshop` (a fragment: all its words)
    whole: bool  # a command line (True) or a fragment of one (False)
    stdin: str | None = None  # `< FILE`
    stdout: str | None = None  # `> FILE`
    elided: bool = False  # cut short with ...

    def where(self):
        return f"{self.doc}:{self.line}: `{self.text}`"


@dataclass
class Page:
    """A page's documented uses, in order, and its blocks of Python."""

    uses: list = field(default_factory=list)
    python: list = field(default_factory=list)


def shell_words(text):
    """The words of a shell command, its redirections taken out: (words, stdin,
    stdout); it ends at a pipe or a command separator."""
    words, stdin, stdout = [], None, None
    tokens = iter(shlex.split(text, comments=True))
    for token in tokens:
        if token in SHELL_STOPS:
            break
        if token == "<":
            stdin = next(tokens)
        elif token in (">", ">>"):
            stdout = next(tokens)
        elif not re.fullmatch(r"\d?>&\d", token):
            words.append(token)
    return words, stdin, stdout


def command_use(doc, line, text):
    """The documented use in `text` (a code line or an inline span), or None."""
    found = COMMAND_LINE.search(text)
    if found:
        words, stdin, stdout = shell_words(found.group(1))
        elided = any(word in ELLIPSIS for word in words)
        words = list(itertools.takewhile(lambda w: w not in ELLIPSIS, words))
        return Documented(doc, line, text, words, True, stdin, stdout, elided)
    words = text.split()
    names = command_names()
    starts = words and (words[0] in names or words[0].startswith("--"))
    if starts and any(word.startswith("--") for word in words):
        return Documented(doc, line, text, words, False)
    return None


def read_page(path, root=REPO_ROOT):
    """Every documented use of the command line on the page at `path` (of the
    book, its Markdown cells: the comment lines, `# ` taken off)."""
    doc = str(path.relative_to(root))
    page, fence, block, paragraph = Page(), None, [], []
    lines = path.read_text(encoding="utf-8").splitlines() + [""]
    if path.suffix == ".py":
        lines = [
            re.sub(r"^# ?", "", line) if line.startswith("#") else "" for line in lines
        ]

    def spans(paragraph):
        start, text = paragraph[0][0], " ".join(line for _, line in paragraph)
        for span in re.findall(r"`([^`]+)`", text):
            use = command_use(doc, start, span)
            if use:
                page.uses.append(use)

    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            if fence is None:
                if paragraph:
                    spans(paragraph)
                fence, block, paragraph = line.strip()[3:].strip(), [], []
                continue
            if fence == "python":
                page.python.append("\n".join(text for _, text in block))
            else:
                joined = []
                for start, text in block:
                    if joined and joined[-1][1].endswith("\\"):
                        continued = joined[-1][1][:-1].rstrip() + " " + text.strip()
                        joined[-1] = (joined[-1][0], continued)
                    else:
                        joined.append((start, text))
                for start, text in joined:
                    use = command_use(doc, start, text.strip())
                    if use:
                        page.uses.append(use)
            fence = None
            continue
        if fence is not None:
            block.append((number, line))
        elif line.strip():
            paragraph.append((number, line))
        elif paragraph:
            spans(paragraph)
            paragraph = []
    return page


def build_parser():
    return cli.build_parser()


@functools.cache
def command_names():
    """The commands' names, from one parser: the pages are read when this file is
    collected, and a parser for each of their thousand spans took seconds."""
    return build_parser().command_names


@contextlib.contextmanager
def every_device():
    """A machine with CUDA (8 GPUs) and MPS, as the pages' GPU lines are for: the
    parser checks --device against the machine."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "device_count", lambda: 8)
        patch.setattr(torch.backends.mps, "is_available", lambda: True)
        yield


HELP = "help"  # what parse returns for --help, which prints and exits 0


def parse(parser, words):
    """(the parsed arguments, None), or (None, argparse's message); for --help,
    (HELP, None)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            with every_device():
                return parser.parse_args(words), None
    except SystemExit as exit:
        if exit.code == 0:
            return HELP, None
        return None, err.getvalue().strip() or f"exit {exit.code}"


def readings(words):
    """The ways to read documented words: each `a|b|c` as each of a, b and c (a
    capital letter in it, as in cuda:N, as 1), each placeholder as 1, quick or x."""
    choices = []
    for word in words:
        if "|" in word and not word.startswith("-"):
            choices.append([re.sub(r"\b[A-Z]\b", "1", a) for a in word.split("|")])
        elif PLACEHOLDER.fullmatch(word) and word != "COMMAND":
            choices.append(["1", "quick", "x"])
        else:
            choices.append([word])
    alternatives = [i for i, c in enumerate(choices) if "|" in words[i]]
    return choices, alternatives


def options_of(parser, command=None):
    """The option strings of one command, or of every command (and the program)."""
    commands = [command] if command else list(parser.commands)
    usages = [parser.commands[c].format_usage() for c in commands]
    if command is None:
        usages.append(parser.format_usage())
    flags = {flag for usage in usages for flag in re.findall(r"--[a-z0-9-]+", usage)}
    return flags | {"--help"}  # every parser's, shown as [-h] in its usage


def check_fragment(parser, use):
    """Problems of a fragment or a cut-short line: options its command lacks."""
    words = use.words
    command = words[0] if words and words[0] in parser.commands else None
    known = options_of(parser, command)
    flags = [w.split("=")[0] for w in words if w.startswith("--")]
    who = f"`{command}`" if command else "any command"
    return [
        f"{use.where()}: {flag} is no option of {who}"
        for flag in flags
        if flag not in known
    ]


def check_use(parser, use):
    """(problems, (words, parsed arguments) of each reading that parses) of a
    documented use."""
    if not use.whole or use.elided:
        return check_fragment(parser, use), []
    words = use.words
    if len(words) == 1 and not words[0].startswith("-"):  # a command named alone
        named = words[0] in parser.commands or words[0] == "COMMAND"
        return ([] if named else [f"{use.where()}: no command {words[0]}"]), []
    choices, alternatives = readings(words)
    problems, parsed = [], []
    if alternatives:  # every alternative must parse, the rest as written
        tries = [
            [c[0] if i != j else a for i, c in enumerate(choices)]
            for j in alternatives
            for a in choices[j]
        ]
    else:
        tries = [list(t) for t in itertools.product(*choices)]
    messages = []
    for argv in tries:
        args, message = parse(parser, argv)
        if message is None:
            parsed.append((argv, args))
            if not alternatives:
                break
        else:
            messages.append(message)
    if alternatives and messages or not alternatives and not parsed:
        problems.append(f"{use.where()}: {messages[-1]}")
    return problems, parsed


def run_epochs(args):
    """The epochs of the run `train ARGS` makes, and how many of their files it
    keeps (epochs None: a budget of FLOPs decides)."""
    config = settings.RunConfig.from_profile(args.profile or "quick")
    epochs = args.epochs or (None if config.flop_budget else config.epochs)
    keep = getattr(args, "keep_checkpoints", None)  # (a control renames it)
    return epochs, keep or config.keep_checkpoints


def written_files(args, made):
    """Record in `made` what the parsed command writes: a train run's checkpoints
    (path -> the epochs kept, or None for last.pt) and average's file."""
    if args.command == "train":
        made[Path(args.out) / "last.pt"] = None
        made[Path(args.out)] = run_epochs(args)
    elif args.command == "average":
        made[Path(args.out)] = None


def read_files(args):
    """The checkpoints a parsed command reads."""
    if args.command == "average":
        return [Path(p) for p in args.checkpoints]
    path = getattr(args, "checkpoint", None)
    return [] if path is None else [Path(path)]


def missing_file(use, path, made):
    """Why a checkpoint a documented line reads is not one an earlier line writes
    (None when it is)."""
    if PLACEHOLDER.fullmatch(path.name) or path in made:
        return None
    number = checkpoints.epoch_number(path)
    run = made.get(path.parent) if path.parent != Path(".") else None
    if number is not None and run is not None:
        epochs, keep = run
        if epochs is None or epochs - keep < number <= epochs:
            return None
        return (
            f"{use.where()}: {path} is no checkpoint of the run in {path.parent}, "
            f"which keeps epochs {max(epochs - keep + 1, 1)} to {epochs}"
        )
    return f"{use.where()}: {path} is written by no earlier line of {use.doc}"


def check_page(parser, page):
    """Every problem of a page's documented uses; and the runnable ones, as
    (use, the words that parsed, parsed arguments or HELP)."""
    problems, runnable, made = [], [], {}
    for use in page.uses:
        found, parsed = check_use(parser, use)
        problems += found
        for argv, args in parsed[:1]:
            if args is HELP:
                runnable.append((use, argv, args))
                continue
            missing = [missing_file(use, p, made) for p in read_files(args)]
            problems += [m for m in missing if m]
            here = getattr(args, "device", None) in (None, torch.device("cpu"))
            # --pretrained names a model on the hub: the network, which no test uses
            # (tests/test_pretrained.py runs the option on a folder it makes)
            here = here and not getattr(args, "pretrained", None)
            if not any(missing) and args.command in RUNNABLE and here:
                runnable.append((use, argv, args))
            written_files(args, made)
    return problems, runnable


PAGES = {str(path.relative_to(REPO_ROOT)): read_page(path) for path in DOCS}
BOOK = read_page(REPO_ROOT / "the_annotated_transformer.py")


def test_the_pages_hold_the_command_lines_this_test_reads():
    """The extraction's control: the lines it must find are found (a code block's
    continued line, an inline one, a fragment, a cut-short one)."""
    texts = {(doc, use.text) for doc, page in PAGES.items() for use in page.uses}
    translating = {text for doc, text in texts if doc == "docs/translating.md"}
    assert any("average runs/quick/epoch_003.pt" in t for t in translating)
    assert any(t.startswith("torchrun") and "..." in t for t in translating)
    assert "--beam K --alpha A" in translating
    assert ("docs/results.md", "python -m workshop reproduce --profile P") in texts
    assert any(doc == "README.md" and "translate" in t for doc, t in texts)
    whole = [u for p in PAGES.values() for u in p.uses if u.whole and not u.elided]
    assert len(whole) >= 20


def test_every_documented_command_line_parses_and_reads_only_what_the_docs_write():
    parser = build_parser()
    problems = [p for page in PAGES.values() for p in check_page(parser, page)[0]]
    assert problems == []


def test_the_books_command_lines_parse():
    """The book's lines too (its Markdown): their options and values. Its lines
    name runs the reader trains elsewhere, so their files are not checked."""
    parser = build_parser()
    assert len(BOOK.uses) >= 4  # the control: average, evaluate, attention, --help
    assert [p for use in BOOK.uses for p in check_use(parser, use)[0]] == []


def renamed_option(monkeypatch, old, new):
    """Rename an option of the program (as a developer might), for the controls."""
    add_argument = cli._Parser.add_argument

    def renaming(self, *names, **options):
        return add_argument(self, *(new if n == old else n for n in names), **options)

    monkeypatch.setattr(cli._Parser, "add_argument", renaming)


@pytest.mark.parametrize(
    "old, new",
    [("--n-best", "--nbest"), ("--keep-checkpoints", "--keep"), ("--beam", "--beams")],
)
def test_a_documented_option_renamed_in_the_program_fails_the_check(
    old, new, monkeypatch
):
    renamed_option(monkeypatch, old, new)
    parser = build_parser()
    assert new in options_of(parser) and old not in options_of(parser)
    problems = [p for page in PAGES.values() for p in check_page(parser, page)[0]]
    named = [p for p in problems if old in p]
    assert named, problems
    assert all(old in p for p in problems), problems  # and nothing else


def test_a_checkpoint_no_documented_line_writes_fails_the_check(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```sh\n"
        "python -m workshop train --out runs/quick --keep-checkpoints 2\n"
        "python -m workshop average runs/quick/epoch_003.pt \\\n"
        "    runs/quick/epoch_004.pt --out runs/quick/a.pt\n"
        "python -m workshop average runs/quick/epoch_001.pt \\\n"
        "    runs/quick/epoch_002.pt --out runs/quick/b.pt\n"
        "python -m workshop translate --checkpoint runs/other/last.pt x\n"
        "python -m workshop translate --checkpoint runs/quick/a.pt x\n"
        "```\n",
        encoding="utf-8",
    )
    problems, _ = check_page(build_parser(), read_page(page, root=tmp_path))
    assert len(problems) == 3, problems
    assert "epoch_001.pt is no checkpoint of the run in runs/quick" in problems[0]
    assert "which keeps epochs 3 to 4" in problems[0] and "epoch_002" in problems[1]
    assert "runs/other/last.pt is written by no earlier line" in problems[2]


@pytest.fixture(scope="module")
def documented_run(smoke_run, tmp_path_factory):
    """What runs/quick holds for the pages' lines, from the session's smoke run:
    its last.pt, and its last epoch's weights as epoch_001.pt to epoch_004.pt (the
    quick profile's four epochs, all kept)."""
    folder = tmp_path_factory.mktemp("documented") / "quick"
    shutil.copytree(smoke_run.out, folder)
    (last_epoch,) = checkpoints.epoch_files(folder)
    weights = last_epoch.read_bytes()
    for epoch in range(1, 5):
        (folder / f"epoch_{epoch:03d}.pt").write_bytes(weights)
    return folder


def run_documented(use, argv, capsys, folder):
    """Run a documented line (as the words `argv`) with `python -m workshop`'s
    main, in `folder`; returns (exit status, stdout, stderr)."""
    if use.stdin is not None and not (folder / use.stdin).exists():
        (folder / use.stdin).write_text("\n".join(STDIN_LINES) + "\n", encoding="utf-8")
    stdin = io.StringIO(
        (folder / use.stdin).read_text(encoding="utf-8") if use.stdin else ""
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stdin", stdin)
        try:
            status = cli.main(argv)
        except SystemExit as exit:  # --help
            status = exit.code
    out, err = capsys.readouterr()
    if use.stdout is not None:
        (folder / use.stdout).write_text(out, encoding="utf-8")
    return status, out, err


@pytest.mark.slow
def test_the_short_documented_commands_run_as_written(
    documented_run, multi30k_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(tat.DATA_ENV, str(multi30k_dir))
    parser = build_parser()
    ran = []
    for page in PAGES.values():
        folders = {
            args.out
            for use in page.uses
            for _, args in check_use(parser, use)[1][:1]
            if args is not HELP and args.command == "train"
        }
        for folder in folders:  # each run the page trains, as the stand-in
            shutil.rmtree(tmp_path / folder, ignore_errors=True)
            shutil.copytree(documented_run, tmp_path / folder)
        for use, argv, args in check_page(parser, page)[1]:
            status, out, err = run_documented(use, argv, capsys, tmp_path)
            assert status == 0, f"{use.where()}:\n{err}"
            if use.stdout is not None and use.stdin is not None:
                lines = (tmp_path / use.stdout).read_text(encoding="utf-8")
                written = lines.splitlines()
                assert len(written) == len(STDIN_LINES), use.where()
                assert [w == "" for w in written] == [s == "" for s in STDIN_LINES]
            command = "--help" if args is HELP else args.command
            if command == "average":
                assert Path(args.out).is_file()
            if command == "attention":
                assert len(list(Path(args.out).glob("*.png"))) == 3
            ran.append((use.doc, command))
    commands = {command for _, command in ran}
    assert {"translate", "average", "attention", "--help"} <= commands, ran


def test_translatings_python_runs_as_written(
    documented_run, tmp_path, monkeypatch, capsys
):
    """The "From Python" block, run where runs/quick is the smoke-sized run."""
    (block,) = PAGES["docs/translating.md"].python
    shutil.copytree(documented_run, tmp_path / "runs" / "quick")
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/translating.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 + 3 + 1  # greedy, beam, three n-best lists, a sample
    greedy = eval(printed[0])  # a list of three strings, the middle one ""
    assert len(greedy) == 3 and greedy[1] == "" and all(greedy[::2])
    assert eval(printed[3]) == []  # the blank sentence's n-best list
    best = eval(printed[2])
    assert len(best) == 3 and all(isinstance(score, float) for _, score in best)
