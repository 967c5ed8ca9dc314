"""The command line, `python -m workshop COMMAND ...` (workshop/cli.py, commands.py,
errors.py), as its user sees it: what each command prints and writes, and how each
failure ends: one line on stderr, `error: ` and what to do, exit 2 for a command line
that cannot work, 1 for a failure while it ran, 130 when interrupted.

The commands run in this process through cli.main; a few tests start the process
where the process itself matters (--help before torch, a closed pipe). The commands
that need Multi30k find it through $ANNOTATED_TRANSFORMER_DATA (skipped without it
on a laptop, failed in CI).
"""

import builtins
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest
import torch
from conftest import free_port, names_in, point_data_at, run_python, tiny_checkpoint

import the_annotated_transformer as tat
from workshop import cli, commands, errors, multi30k
from workshop.run import checkpoints, distributed, run_lock, settings, training
from workshop.translate import scoring, translation

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """`python -m workshop ARGS` run by its main in this process, with no progress
    lines (however slow a busy machine): (exit status, stdout, stderr)."""
    monkeypatch.setattr(translation, "PROGRESS_EVERY_S", float("inf"))

    def run(*args):
        try:
            status = cli.main(list(args))
        except SystemExit as exit:  # argparse's own exits: errors and --help
            status = exit.code
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=status, stdout=out, stderr=err)

    return run


def one_line_error(result, *expected, status=2):
    """Exit `status` and one line on stderr, `error: ` (130: `interrupted`) and
    each of `expected`; returns the line."""
    assert result.returncode == status, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("interrupted" if status == 130 else "error: ")
    assert all(text in lines[0] for text in expected), lines[0]
    return lines[0]


def files_under(folder):
    return {p: p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def raising(error):
    def fail(*args, **kwargs):
        raise error

    return fail


def patch(owner, name, value):
    """A setup: owner.NAME is `value`."""
    return lambda it, monkeypatch: monkeypatch.setattr(owner, name, value)


def never_spawn(it, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "spawn", raising(AssertionError("spawned first")))
    monkeypatch.setattr(distributed.os, "cpu_count", lambda: 4)


OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1.1 GiB free."
MEMORY = torch.OutOfMemoryError(OOM)
SETUPS = {
    "notes": lambda it, _: (it.tmp / "notes.txt").write_text("mine"),
    "cut": lambda it, _: it.bad.write_bytes(it.last.read_bytes()[:1000]),
    "cut last.pt": lambda it, _: it.last.write_bytes(it.last.read_bytes()[:1000]),
    "epoch in last": lambda it, _: shutil.copyfile(it.run / "epoch_002.pt", it.last),
    "empty stdin": patch(sys, "stdin", io.StringIO("\n \n")),
    "no data variable": lambda it, mpatch: point_data_at(None, it.tmp, mpatch),
    "held": lambda it, _: it.stack.enter_context(run_lock.hold_run_folder(it.run)),
    "oom translate": patch(translation.Translator, "translations", raising(MEMORY)),
    "oom train": patch(commands, "train_model", raising(MEMORY)),
    "never spawn": never_spawn,
}
T, E = "translate --checkpoint c.pt ", "evaluate --checkpoint c.pt "
TL, D = "train --out {new} ", "download --data-dir {new} "
LAST, EL = "translate --checkpoint {last} ", "evaluate --checkpoint {last} "
RESUME, B = "{train} --resume --epochs 3", "translate --checkpoint bad.pt x"
AVERAGE = "average {run}/epoch_002.pt --out "
RP = "reproduce --profile smoke --out {run} "

# (command line, exit status, what its one line says separated by "|", a setup)
BAD_COMMAND_LINES = [
    ("copy --epochs 0", 2, "--epochs|at least 1"),
    (TL + "--max-tokens 0", 2, "--max-tokens|at least 1"),
    (TL + "--keep-checkpoints 0", 2, "--keep-checkpoints|at least 1"),
    (E + "--batch-size 0", 2, "--batch-size|at least 1"),
    ("reproduce --beam 0", 2, "--beam|at least 1"),
    (T + "--beam 0", 2, "--beam|at least 1|(see python -m workshop translate --help)"),
    ("transl", 2, "invalid choice: 'transl'|(see python -m workshop --help)"),
    (T + "--n-be 2 x", 2, "unrecognized arguments: --n-be"),  # no abbreviations
    (TL + "--profile huge", 2, "invalid choice: 'huge'|smoke"),
    (TL + "--precision fp16", 2, "--precision|invalid choice: 'fp16'"),
    ("reproduce --alphas 0.6,x", 2, "--alphas: must be numbers separated by commas"),
    ("reproduce --average ''", 2, "--average: must be numbers separated by|''"),
    (D + "--timeout 0", 2, "--timeout|above 0"),
    (D + "--base-url notaurl", 2, "'notaurl'|http://, https:// or file://"),
    (T + "--alpha nan --beam 4", 2, "--alpha|must be a finite number >= 0|'nan'"),
    (T + "--alpha=-2 --beam 4", 2, "--alpha|finite number >= 0|'-2'"),
    (E + "--alpha x --beam 4", 2, "--alpha|finite number >= 0|'x'"),
    # The length penalty changes only a beam search: refused before any work.
    (T + "--alpha 1 x", 2, "--alpha: the length penalty takes effect only|--beam K"),
    (T + "--sample --alpha 1 x", 2, "the length penalty takes effect only in a beam"),
    (E + "--beam 1 --alpha 2", 2, "the length penalty takes effect only in a beam"),
    (T + "--top-k 5 --seed 1 x", 2, "--top-k, --seed|only with --sample"),
    (T + "--sample --beam 4 x", 2, "--sample|--beam 4|choose one"),
    (T + "--beam 2 --n-best 3 x", 2, "--n-best 3 needs a beam of at least 3"),
    (T + "--sample --top-p 1.5 x", 2, "--top-p|above 0 and at most 1|'1.5'"),
    (T + "--sample --temperature 0", 2, "--temperature|finite number above 0"),
    ("copy --device tpu", 2, "--device|'tpu' is not cpu, cuda, cuda:N or mps"),
    (TL + "--device cuda", 2, "--device|CUDA is not available|--device cpu"),
    (T + "--device mps", 2, "--device|MPS (the GPU of Apple silicon"),
    ("reproduce --device mps", 2, "--device|MPS (the GPU of Apple silicon"),
    (TL + "--nprocs 100000 --device cpu", 2, "--nprocs 100000|at most"),
    ("figures --out {new} no_such", 2, "no_such|unknown|learning_rate"),
    (E + "--output .", 2, "--output|is a folder|name another"),
    (E + "--output notes.txt/b/c", 2, "notes.txt is a file, not a folder", "notes"),
    ("train --out notes.txt", 2, "--out|notes.txt is a file|name another", "notes"),
    (TL + "--share-embeddings", 2, "--share-embeddings needs --vocab bpe"),
    (LAST + "'Ein Hund.' {long}", 2, "sentence 2 has 100,001 characters"),
    (LAST, 2, "no sentences given: pass them as arguments", "empty stdin"),
    ("attention --checkpoint {last} --head 5 x", 2, "--head must be in 0..1, got [5]"),
    ("attention --checkpoint {last} --layer 5 x", 2, "--layer must be in 0..0|got 5"),
    (AVERAGE + "{last}", 2, "--out {last}|write it to another file"),
    (AVERAGE + "epoch_007.pt", 2, "write it to another file"),
    (AVERAGE + "{run}/epoch_002.pt", 2, "is one of the averaged checkpoints"),
    ("{train}", 2, "{run}|already holds a training run|--resume|--out"),
    ("{train} --resume", 2, "has finished its 2 epochs|--epochs N"),
    (RESUME + " --max-tokens 500", 2, "max_tokens=500 (the run has 300)"),
    (RESUME + " --profile quick", 2, "profile='quick' (the run has 'smoke')"),
    (RESUME + " --time-limit 1e-5", 2, "would start no epoch|--time-limit"),
    (RP, 2, "already holds a training run|--no-train"),
    (RP + "--no-train --limit 5 --results {repo}/results", 2, "limit=5|no result"),
    (B, 1, "bad.pt|not a readable checkpoint", "cut"),
    (T + "x", 1, "c.pt|not found"),
    (EL, 1, "--data-dir", "no data variable"),
    (EL + "--split test_2017_flickr", 1, "Put test_2017_flickr.de.gz and"),
    (TL + "--data-dir typo", 1, "typo|train.de.gz|download"),
    (TL + "--data-dir typo --profile multi30k --share-embeddings", 1, "train.de.gz"),
    (TL + "--data-dir typo --nprocs 2", 1, "train.de.gz", "never spawn"),
    (TL + "--resume", 1, "no |last.pt to continue from"),
    (RESUME + " --data-dir typo", 1, "last.pt|optimizer|scheduler", "epoch in last"),
    (RESUME, 1, "last.pt is not a readable checkpoint", "cut last.pt"),
    (RESUME, 1, "is in use|another process is writing a run there", "held"),
    (LAST + "x", 1, "out of memory|Tried to allocate 2.00 GiB|--beam", "oom translate"),
    (TL, 1, "out of memory|--max-tokens", "oom train"),
    ("average {run}/epoch_001.pt --out m.pt", 1, "epoch_001.pt not found"),
    (D + "--base-url {closed}", 1, "could not download|--data-dir|$ANNOTATED"),
    ("download --data-dir notes.txt", 1, "notes.txt|not a folder", "notes"),
    ("reproduce --no-train --out {new}", 1, "no trained run|drop --no-train"),
]


@pytest.fixture
def where(smoke_run, multi30k_dir, tmp_path, monkeypatch):
    """The folder a bad command line runs in (what it writes by default lands
    there), holding a copy of the smoke run; no GPU, even on one."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(tat.DATA_ENV, str(multi30k_dir))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    run = shutil.copytree(smoke_run.out, tmp_path / "run")
    paths = dict(run=run, last=run / "last.pt", tmp=tmp_path, new=tmp_path / "new")
    paths |= dict(data=multi30k_dir, repo=REPO_ROOT, long="x" * 100_001)
    paths |= dict(closed=f"http://127.0.0.1:{free_port()}/")  # as if offline
    paths["train"] = "train --data-dir {data} --out {run}".format(**paths)
    with contextlib.ExitStack() as stack:
        yield SimpleNamespace(**paths, bad=tmp_path / "bad.pt", stack=stack)


@pytest.mark.parametrize(
    "argv, status, expected, setup",
    [(*row, None)[:4] for row in BAD_COMMAND_LINES],
    ids=[" ".join(map(str, row[:1] + row[3:])) for row in BAD_COMMAND_LINES],
)
def test_a_bad_command_line_is_one_line_and_loses_nothing(
    argv, status, expected, setup, where, monkeypatch, run_cli
):
    """Each ends in one line, `error: ` and what to do, with its exit status, before
    any work it would spoil: no file changed, none left behind, not even a folder."""
    if setup:
        SETUPS[setup](where, monkeypatch)
    before = files_under(where.tmp)
    result = run_cli(*shlex.split(argv.format(**vars(where))))
    assert files_under(where.tmp) == before
    expected = expected.format(**vars(where)).split("|")
    assert len(one_line_error(result, *expected, status=status)) < 500  # no dump


# ---------------------------------------------------------------------------
# How a command line parses, and how a failure ends, whatever the command


def test_every_help_answers_before_torch_is_imported(run_cli):
    """`python -m workshop --help` and COMMAND --help for every command parse
    before torch, the book or workshop.commands are imported."""
    argvs = [[], *([name] for name in cli.build_parser().command_names)]
    for argv in argvs:
        usage = " ".join(["usage: python -m workshop", *argv])
        assert run_cli(*argv, "--help").stdout.startswith(usage), argv
    code = f"from workshop.cli import main\nfor argv in {argvs}:\n"
    code += "    try: main([*argv, '--help'])\n    except SystemExit: pass\n"
    code += "import sys; print(*sys.modules)"
    loaded = run_python(code).stdout.split()
    heavy = {"torch", "numpy", "the_annotated_transformer", "workshop.commands"}
    assert "workshop.cli" in loaded and not heavy & set(loaded)


def test_python_m_workshop_without_a_command_exits_2_listing_the_commands():
    result = run_python("import runpy; runpy.run_module('workshop')")
    one_line_error(result, "python -m workshop", "name a command", "download")
    assert result.stdout == ""


def test_the_names_the_command_line_knows_without_torch_are_the_books():
    assert cli.DATA_ENV == tat.DATA_ENV
    assert cli.PROFILE_NAMES == tuple(settings.TRAIN_PROFILES)


def test_every_option_says_what_it_does_and_what_holds_without_it():
    """Each option's --help line has a description, and one that takes a value
    and may be left out names its default, or what its absence means."""
    parser, silent = cli.build_parser(), []
    for name in parser.command_names:
        command = parser.commands[name]
        groups = command._mutually_exclusive_groups  # argparse lists them no other way
        one_of = [a for group in groups if group.required for a in group._group_actions]
        for action in command._actions:
            formatter = command.formatter_class(prog=command.prog)
            formatter.add_argument(action)
            shown = " ".join(formatter.format_help().split())
            takes = action.option_strings and action.nargs != 0
            optional = not (action.required or action in one_of)
            if not action.help or takes and optional and "default" not in shown:
                silent.append(f"{name} {shown}")
    assert silent == []


def test_the_defaults_the_help_names_are_the_ones_that_hold():
    train = " ".join(cli.build_parser().commands["train"].format_help().split())
    profiles = [settings.RunConfig.from_profile(p) for p in cli.PROFILE_NAMES]
    (keep,) = {config.keep_checkpoints for config in profiles}
    (precision,) = {config.precision for config in profiles}
    assert f"last.pt is always kept; default: the profile's, {keep})" in train
    assert f"(default: the profile's, {precision})" in train
    assert f"(default: {translation.ALPHA})" in cli.ALPHA_HELP


BUGS = [KeyError("a bug"), TypeError("unsupported operand"), ValueError("not ours")]


@pytest.mark.parametrize("bug", BUGS, ids=["KeyError", "TypeError", "ValueError"])
def test_an_unexpected_failure_is_one_line_that_says_how_to_see_the_traceback(
    bug, monkeypatch, run_cli
):
    """Any error but a UsageError, DataError or OSError is a bug to report; a
    ValueError, which torch raises deep in a run, is not taken for the user's."""
    monkeypatch.setattr(commands, "run", raising(bug))
    line = one_line_error(run_cli("figures"), f"{type(bug).__name__}: ", status=1)
    assert "ANNOTATED_TRANSFORMER_DEBUG=1" in line and "report it" in line
    monkeypatch.setenv("ANNOTATED_TRANSFORMER_DEBUG", "1")
    with pytest.raises(type(bug)):
        cli.main(["figures"])


def without_module(monkeypatch, name):
    """The command line's import of workshop.commands fails as it does where the
    module `name` is missing."""
    real_import = builtins.__import__

    def importing(module, globals=None, locals=None, fromlist=(), level=0):
        if module == "workshop" and "commands" in (fromlist or ()):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(module, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", importing)


def test_run_by_a_python_without_torch_says_in_one_line_which_python_to_use(
    monkeypatch, run_cli
):
    without_module(monkeypatch, "torch")
    line = one_line_error(run_cli("figures"), status=1)
    assert line.startswith(f"error: torch is not installed for {sys.executable}: ")
    assert "run .venv/bin/python -m workshop (after `make setup`)" in line
    assert f"{sys.executable} -m pip install -r requirements.txt" in line
    assert "report it" not in line
    without_module(monkeypatch, "workshop.nothing")  # the workshop's own: a bug
    line = one_line_error(run_cli("figures"), status=1)
    assert line.startswith("error: ModuleNotFoundError: ") and "report it" in line


@pytest.mark.parametrize("argv", ["figures", "train --out r", "reproduce"])
def test_ctrl_c_mentions_saved_epochs_only_for_commands_that_save_them(
    argv, monkeypatch, run_cli
):
    monkeypatch.setattr(commands, "run", raising(KeyboardInterrupt))
    line = one_line_error(run_cli(*argv.split()), status=130)
    assert ("--out" in line) == (argv.split()[0] in ("train", "reproduce"))


@pytest.mark.parametrize("name, value", [("d_model", 0), ("keep_checkpoints", -1)])
def test_a_bad_setting_given_to_the_library_is_a_usage_error_in_one_line(name, value):
    """The book's own check raises a plain ValueError (exit 1: unexpected); on a
    setting the user passed, the workshop raises it as a UsageError (exit 2)."""
    with pytest.raises(ValueError) as plain:
        tat.check_positive_int(**{name: value})
    with pytest.raises(errors.UsageError) as usage:
        settings.RunConfig.from_profile("smoke", **{name: value}).validate()
    assert [errors.exit_status(e.value) for e in (plain, usage)] == [1, 2]
    assert str(usage.value) == f"{name} must be a positive integer, got {value}."


def test_the_library_refuses_an_output_it_cannot_write_before_any_work(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(errors.UsageError, match="notes.txt is a file, not a folder"):
        scoring.evaluate(raising(AssertionError), tmp_path, "none", output=notes / "a")
    with pytest.raises(errors.UsageError, match="is a file"):  # before the data
        training.train_model(settings.RunConfig(), tmp_path / "no_data", notes)
    assert names_in(tmp_path) == ["notes.txt"]


# ---------------------------------------------------------------------------
# download


def test_download_fetches_and_verifies_the_six_files(
    multi30k_server, tmp_path, run_cli
):
    target, url = tmp_path / "data", multi30k_server.url
    result = run_cli("download", "--data-dir", str(target), "--base-url", url)
    assert result.returncode == 0 and "verified" in result.stdout, result.stderr
    assert names_in(target) == sorted(multi30k.MULTI30K_SHA256)


# ---------------------------------------------------------------------------
# translate


def test_translate_prints_a_line_for_each_as_its_window_ends_and_ctrl_c_keeps_them(
    tmp_path, monkeypatch, run_cli
):
    """Each sentence (argument or line of stdin) gets one line, a blank one a blank.
    Input is decoded in windows of WINDOW_BATCHES batches of 64, each window's
    lines printed, in input order, as it ends: Ctrl-C in the second window leaves
    the first window's lines, and exits 130."""
    tiny_checkpoint(tmp_path / "tiny.pt", seed=0, words=["a", "dog", "runs", "cat"])
    argv, decoded = ["translate", "--checkpoint", str(tmp_path / "tiny.pt")], []

    def echo_then_interrupt(model, src, *args, **options):  # answers with itself
        if len(decoded) == translation.WINDOW_BATCHES:  # the second window's first
            raise KeyboardInterrupt
        decoded.append(src.size(0))
        return src

    monkeypatch.setattr(tat, "greedy_decode", echo_then_interrupt)
    assert run_cli(*argv, "a dog", "", "  ", "runs").stdout == "a dog\n\n\nruns\n"
    window = translation.WINDOW_BATCHES * 64
    decoded.clear()
    lines = ["a cat runs", "dog", "a dog runs", "runs"] * (window // 4 + 3)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    result = run_cli(*argv)
    assert (result.returncode, result.stderr) == (130, "interrupted\n")
    assert decoded == [64] * translation.WINDOW_BATCHES
    assert result.stdout.splitlines() == lines[:window]


def test_translate_warns_of_a_sentence_longer_than_training_or_the_positions(
    translator, smoke_run, monkeypatch, run_cli
):
    """Longer than the sentences the model trained on: translated whole (as the
    book's decode_ids does), and said to be; longer than its positional encoding's
    table: cut, aloud."""
    n = translator.config.max_len
    fits, long = " ".join(["Hund"] * (n - 2)), " ".join(["Hund"] * (n + 8))
    result = run_cli(
        "translate", "--checkpoint", str(smoke_run.out / "last.pt"), fits, long
    )
    assert result.stderr == (
        f"warning: sentence 2 has {n + 10} tokens, more than the {n} it trained "
        "on: its output may be short.\n"
    )
    with contextlib.redirect_stderr(io.StringIO()):  # its warning, said again
        whole = tat.decode_ids(translator.model, translator.encode([fits, long]))
    assert result.stdout.splitlines() == [translator.text(ids) for ids in whole]
    config, vocabs = translator.config, (translator.vocab_src, translator.vocab_tgt)
    sizes = {name: getattr(config, name) for name in ("N", "d_model", "d_ff", "h")}
    short = tat.make_model(*map(len, vocabs), **sizes, max_len=30)
    weights = checkpoints.without_positional_tables(translator.model.state_dict())
    checkpoints.load_weights(short, weights)
    limited = translation.Translator(short.eval(), *vocabs, config)
    monkeypatch.setattr(commands, "load_translator", lambda path, device: limited)
    result = run_cli("translate", "--checkpoint", "x", "Ein Hund.", "Hund " * 40)
    assert len(result.stdout.splitlines()) == 2
    assert result.stderr == (
        "warning: sentence 2 has 42 tokens, more than the model's 30 positions: "
        "the first 30 are read.\n"
    )


def test_translate_prints_n_best_lists_beam_and_greedy_answers_and_its_progress(
    translator, smoke_run, monkeypatch, run_cli
):
    """--n-best 3 prints each sentence's 3 best (a beam of 3) as LINE<tab>SCORE
    <tab>TEXT, best first; a blank line has none. --beam 3 --alpha 1.5 searches
    with those and prints the best; without --beam, no beam search runs. Progress
    goes to stderr (the blank line is no sentence to translate)."""
    sentences = ["Ein Hund läuft.", "", "Zwei Männer spielen Fußball."]
    argv = ["translate", "--checkpoint", str(smoke_run.out / "last.pt"), *sentences]
    options = translation.decode_options(3)
    found = translator.translations(sentences, n_best=3, **options)
    rows = [(n, *row) for n, answer in enumerate(found, 1) for row in answer]
    assert [n for n, *_ in rows] == [1, 1, 1, 3, 3, 3]
    shown = "".join(f"{n}\t{score:.4f}\t{text}\n" for n, text, score in rows)
    assert run_cli(*argv, "--n-best", "3").stdout == shown
    beam = translator.translate(sentences, **translation.decode_options(3, 1.5))
    greedy, searched, search = translator.translate(sentences), [], tat.beam_search

    def recorded_search(*args, **options):
        searched.append((options["beam_size"], options["alpha"]))
        return search(*args, **options)

    monkeypatch.setattr(tat, "beam_search", recorded_search)
    assert run_cli(*argv, "--beam", "3", "--alpha", "1.5").stdout.splitlines() == beam
    assert searched == [(3, 1.5)]  # one batch of the sentences
    monkeypatch.setattr(translation, "PROGRESS_EVERY_S", 0.0)  # at every chance
    result = run_cli(*argv)
    assert result.stdout.splitlines() == greedy
    assert searched == [(3, 1.5)]  # greedy without --beam
    said = result.stderr.splitlines()
    assert all(line.startswith("translating: ") for line in said), said
    assert said[-1].startswith("translating: 2 of 2 sentences done, ")


def test_alpha_is_0_6_unless_given_and_a_beam_takes_any_of_at_least_0(monkeypatch):
    """A beam (--beam K, or the one --n-best K implies) searches with --alpha, 0
    included, else 0.6; evaluate hands --alpha on as given (None: scoring's 0.6)."""
    handed = []

    def parsed(command, options):
        return cli.build_parser().parse_args([command, "--checkpoint", "c", *options])

    for given, alpha in [
        (["--beam", "4"], 0.6),
        (["--n-best", "2", "--alpha", "0"], 0),
    ]:
        assert commands.translate_options(parsed("translate", given))["alpha"] == alpha
    monkeypatch.setattr(commands, "evaluate", lambda *a, **k: handed.append(k["alpha"]))
    for given in (["--beam", "4"], ["--beam", "4", "--alpha", "0"]):
        commands.run(parsed("evaluate", given))
    assert handed == [None, 0.0]


@pytest.mark.slow
def test_translate_samples_again_what_a_seed_drew(smoke_run, run_cli):
    """--sample without --seed draws from a fresh seed and names it; that seed
    draws the same again, another seed something else; --n-best K prints K
    samples a sentence, best first."""
    argv = ["translate", "--checkpoint", str(smoke_run.out / "last.pt"), "--sample"]
    argv += ["Ein Hund läuft.", "Zwei Männer spielen Fußball."] * 3
    first = run_cli(*argv)
    seed = re.fullmatch(r"sampling with --seed (\d+) \(pass it .*\n", first.stderr)[1]
    again = run_cli(*argv, "--seed", seed)
    assert (again.stdout, again.stderr) == (first.stdout, "")
    assert run_cli(*argv, "--seed", str(int(seed) + 1)).stdout != first.stdout
    n_best = run_cli(*argv, "--seed", "1", "--n-best", "2", "--top-k", "3")
    rows = [line.split("\t") for line in n_best.stdout.splitlines()]
    assert [int(row[0]) for row in rows] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    scores = [float(row[1]) for row in rows]
    assert all(a >= b for a, b in zip(scores[::2], scores[1::2], strict=True))


@pytest.mark.slow
def test_translate_piped_into_a_reader_that_left_ends_without_an_error(smoke_run):
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head -1` once head has its line
    argv = [
        sys.executable,
        "-m",
        "workshop",
        "translate",
        "Ein Hund läuft.",
        "Ein Hund läuft.",
    ]
    argv += ["--checkpoint", str(smoke_run.out / "last.pt")]
    run = subprocess.run(argv, stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    said = [x for x in run.stderr.splitlines() if not x.startswith("translating: ")]
    assert (run.returncode, said) == (0, [])  # progress (a busy machine's) alone


# ---------------------------------------------------------------------------
# train

BPE = dict(vocab="bpe", bpe_vocab_size=2000)
SHARED = dict(**BPE, share_embeddings=True, tie_generator=True)


@pytest.mark.parametrize(
    "options, expected",
    [
        ("--vocab bpe --bpe-vocab-size 2000", dict(**BPE, share_embeddings=False)),
        ("--vocab bpe --bpe-vocab-size 2000 --share-embeddings", SHARED),
        ("--precision fp32", dict(precision="fp32")),
        ("--precision fp32 --bf16", dict(precision="bf16")),  # the last one given
        ("--profile multi30k --epochs 3", dict(epochs=3, flop_budget=None)),
    ],
)
def test_train_hands_its_options_to_the_runs_settings(
    options, expected, tmp_path, monkeypatch, run_cli
):
    handed = []
    monkeypatch.setattr(commands, "train_model", lambda c, *a, **k: handed.append(c))
    argv = ["train", "--out", str(tmp_path), "--profile", "smoke", *options.split()]
    assert run_cli(*argv).returncode == 0
    assert {name: getattr(handed[0], name) for name in expected} == expected


@pytest.mark.slow
def test_train_keeps_the_newest_checkpoints_logs_its_steps_and_resumes_its_settings(
    multi30k_dir, tmp_path, run_cli
):
    """--keep-checkpoints 2: of 3 epochs the last 2 files stay; the log has the
    book's step lines; the run ends naming what it saved and how to use it. A
    resume keeps the run's settings (not the default profile's), trains the
    epochs asked for, and may change how many files it keeps."""
    out, last = tmp_path / "run", tmp_path / "run" / "last.pt"
    argv = ["train", "--data-dir", str(multi30k_dir), "--out", str(out)]
    new = "--profile smoke --epochs 3 --max-tokens 800 --keep-checkpoints 2"
    first = run_cli(*argv, *new.split())
    vocabs = ["vocab_src.json", "vocab_tgt.json"]
    assert names_in(out) == ["epoch_002.pt", "epoch_003.pt", "last.pt", *vocabs]
    config = checkpoints.load_checkpoint(last)["config"]
    assert (config["profile"], config["max_tokens"]) == ("smoke", 800)
    steps = [line for line in first.stdout.splitlines() if "| optimizer steps" in line]
    lr = r" \| loss \(smoothed\) +\d+\.\d{4} \| lr \d\.\d\de[-+]\d\d$"
    assert steps and all(re.search(lr, line) for line in steps), steps
    saved, score = first.stdout.splitlines()[-2:]
    assert saved.startswith(f"saved {last} (epoch 3; this invocation ")
    assert saved.endswith(f'translate --checkpoint {last} "Ein Satz."')
    assert score == f"score it: python -m workshop evaluate --checkpoint {last}"
    resumed = run_cli(*argv, "--resume", "--epochs", "4", "--keep-checkpoints", "1")
    assert f"resuming {last} (profile smoke): 3 of 4 epochs done" in resumed.stdout
    finished = checkpoints.load_checkpoint(last)
    assert finished["config"] == {**config, "epochs": 4, "keep_checkpoints": 1}
    assert [r["epoch"] for r in finished["history"]] == [1, 2, 3, 4]
    assert [p.name for p in checkpoints.epoch_files(out)] == ["epoch_004.pt"]


@pytest.mark.slow
def test_a_run_stopped_by_its_time_limit_finishes_with_the_command_it_prints(
    multi30k_dir, tmp_path, capsys, run_cli
):
    """The time limit guards one invocation: the command the stop line gives, a
    plain --resume, trains the run to its end; its epochs, saved under different
    limits, still average together."""
    run = tmp_path / "run"  # a limit shorter than an epoch (minutes); 3 files kept
    config = conftest.smoke_config(epochs=3, time_limit=1e-3, keep_checkpoints=3)
    training.train_model(config, multi30k_dir, run)
    (advice,) = re.findall(r"Continue with `([^`]+)`", capsys.readouterr().out)
    python, *argv = shlex.split(advice)
    assert [python, *argv[:3]] == ["python", "-m", "workshop", "train"]
    assert "1 of 3 epochs done" in run_cli(*argv[2:]).stdout
    finished = checkpoints.load_checkpoint(run / "last.pt")
    assert [r["epoch"] for r in finished["history"]] == [1, 2, 3]
    assert "stopped" not in finished
    epochs = [str(path) for path in checkpoints.epoch_files(run)]
    assert len(epochs) == 3
    assert run_cli("average", *epochs, "--out", str(tmp_path / "m.pt")).returncode == 0


# ---------------------------------------------------------------------------
# average, evaluate, attention, reproduce, figures, copy


def test_average_writes_the_averaged_checkpoint(tmp_path, run_cli):
    paths = [str(tmp_path / "1.pt"), str(tmp_path / "2.pt")]
    for seed, path in enumerate(paths):
        tiny_checkpoint(path, seed)
    result = run_cli("average", *paths, "--out", str(tmp_path / "m.pt"))
    assert "averaged 2 checkpoints" in result.stdout
    averaged = checkpoints.load_checkpoint(tmp_path / "m.pt")
    assert set(averaged) >= set(checkpoints.CHECKPOINT_KEYS)


def test_evaluate_prints_the_score_and_writes_a_line_per_sentence_making_its_folders(
    trained_checkpoint, mini_split, tmp_path, run_cli
):
    (folder, pairs), output = mini_split, tmp_path / "new" / "folders" / "hyp.en"
    argv = ["evaluate", "--checkpoint", str(trained_checkpoint), "--split", "mini"]
    result = run_cli(*argv, "--data-dir", str(folder), "--output", str(output))
    assert "mini: 20 sentences translated (greedy)" in result.stdout, result.stderr
    assert "tok:13a" in result.stdout
    assert len(output.read_text(encoding="utf-8").splitlines()) == len(pairs)


@pytest.mark.slow
def test_attention_draws_the_three_maps_as_png(trained_checkpoint, tmp_path, run_cli):
    argv = ["attention", "--checkpoint", str(trained_checkpoint), "Ein Hund läuft."]
    result = run_cli(*argv, "--out", str(tmp_path), "--head", "0", "--head", "1")
    assert result.returncode == 0, result.stderr
    kinds = ["decoder_self", "decoder_source", "encoder_self"]
    assert names_in(tmp_path) == [f"{kind}_attention.png" for kind in kinds]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in tmp_path.iterdir())


def test_no_command_writes_into_a_tracked_folder_by_default(monkeypatch, run_cli):
    """Where each command writes when no option names a folder: one git ignores
    (runs/...), never images/ or results/, the checkout's figures and results.
    attention draws the last layer's every head."""
    written = {}

    def recording(name):  # records the arguments; returns the paths written
        return lambda *args, **kwargs: written.update({name: (*args, kwargs)}) or []

    for name in ("save_attention_maps", "save_figures", "reproduce"):
        monkeypatch.setattr(commands, name, recording(name))
    assert run_cli("attention", "--checkpoint", "c.pt", "Ein Hund.").returncode == 0
    assert run_cli("figures").returncode == 0
    argv = ["reproduce", "--profile", "quick", "--data-dir", "d", "--alphas", "0,1"]
    assert run_cli(*argv).returncode == 0
    assert written["reproduce"][-1]["alphas"] == (0.0, 1.0)  # 0, as translate takes
    assert written["save_attention_maps"][2:5] == ("runs/attention", -1, None)
    folders = [written["save_figures"][0], *map(str, written["reproduce"][2:5])]
    assert folders == ["runs/figures", *["runs/quick"] * 3]
    for folder in ("runs/attention", *folders, "images", "results"):
        check = ["git", "check-ignore", "-q", "--no-index", folder]
        ignored = subprocess.run(check, cwd=REPO_ROOT).returncode == 0
        assert ignored == folder.startswith("runs/"), folder


@pytest.mark.slow
@pytest.mark.parametrize("kept", [1, 2])  # epoch files: the smoke run's 1, or both
def test_reproduce_reports_on_a_run_names_the_averages_it_drops_and_writes_beside_it(
    kept, smoke_run, multi30k_dir, tmp_path, monkeypatch, capsys
):
    """--no-train on the smoke run (2 epochs) prints the Results row on a console
    that shows ASCII alone; warns of the averaging windows it drops, and why (too
    few epochs, or too few kept); writes the record, page and curve in the run's
    folder, nowhere else."""
    run = shutil.copytree(smoke_run.out, tmp_path / "run")
    if kept == 2:
        shutil.copyfile(run / "epoch_002.pt", run / "epoch_001.pt")
    monkeypatch.chdir(tmp_path)
    argv = f"reproduce --profile smoke --out {run} --no-train --limit 5 --beam 2 "
    argv += f"--alphas 0.6 --average 2,4 --data-dir {multi30k_dir}"
    console = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(console, encoding="ascii"))
    assert cli.main(argv.split()) == 0
    sys.stdout.flush()
    assert b"| `smoke` |" in console.getvalue() and b"\\u03b1" in console.getvalue()
    whole = "4 epochs dropped: the run trained only 2 epochs."
    pruned = f"2, 4 epochs dropped: {run} holds only its newest 1 epoch checkpoints "
    pruned += "of 2 (train --keep-checkpoints N keeps N; this run's is 1)."
    warned = f"warning: averages of the last {whole if kept == 2 else pruned}\n"
    assert warned in capsys.readouterr().err
    assert names_in(tmp_path) == ["run"]
    assert {"smoke.json", "smoke.md", "training_curve_smoke.png"} <= set(names_in(run))
    record = json.loads((run / "smoke.json").read_text())
    assert record["limit"] == 5 and record["test_greedy"]["n"] == 5


def test_copy_trains_on_the_device_it_is_given_and_prints_the_copies(
    monkeypatch, run_cli
):
    """The copy command hands --device to the book's train_copy_task (standing in:
    an untrained model, which copies nothing), then prints the book's five copies,
    marks each that differs and says the copy is not exact."""
    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    history = [{"epoch": 0, "train loss": 2.4, "val nll": 2.4}]
    handed = []

    def train_copy_task(config, *, quiet, device):
        handed.append((config, device))
        return model, history

    monkeypatch.setattr(tat, "train_copy_task", train_copy_task)
    result = run_cli("copy", "--device", "cpu", "--quiet")
    assert handed == [(tat.CopyTaskConfig(), torch.device("cpu"))]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("source") and len(lines) == 7  # 5 copies
    assert all(line.endswith("(differs)") for line in lines[1:6])
    assert "validation NLL 2.4000; exact copy: NO" in lines[-1]
