"""The command line: `python -m workshop COMMAND ...`.

Errors and help first, then each command: download (from a local server), translate,
train (one folder, one run; resuming), average, evaluate, attention and reproduce.
The commands that need Multi30k find it through $ANNOTATED_TRANSFORMER_DATA: without
it they are skipped on a laptop, but fail in CI (CI=true). The figures command's
drawings are checked in tests/test_workshop_figures.py.
"""

import builtins
import contextlib
import errno
import io
import json
import math
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    HANDMADE_PAIRS,
    PNG_SIGNATURE,
    SENTENCE,
    free_port,
    names_in,
    smoke_config,
    tiny_checkpoint,
    trained_copy_task,
    write_split,
)

import the_annotated_transformer as tat
from workshop import cli, commands, errors, multi30k
from workshop.report import reproduce
from workshop.run import (
    checkpoints,
    distributed,
    run_folders,
    run_lock,
    settings,
    training,
)
from workshop.translate import scoring, translation

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

REPO_ROOT = Path(__file__).resolve().parent.parent
BOOK = REPO_ROOT / "the_annotated_transformer.py"


@pytest.fixture
def run_cli(capsys):
    """`python -m workshop ARGS` run by its main in this process: returns the exit
    status and what it printed, as a finished subprocess would."""

    def run(*args):
        try:
            status = cli.main(list(args))
        except SystemExit as exit:  # argparse's own exits: errors and --help
            status = exit.code
        printed = capsys.readouterr()
        return SimpleNamespace(
            returncode=status, stdout=printed.out, stderr=printed.err
        )

    return run


@pytest.fixture
def no_progress(monkeypatch):
    """translate says no progress, however slow a busy machine makes it: stderr
    holds only what a test is about."""
    monkeypatch.setattr(translation, "PROGRESS_EVERY_S", math.inf)


def run_script(*args, timeout=120):
    """Run `python -m workshop ARGS`; returns the CompletedProcess (text mode)."""
    return subprocess.run(
        [sys.executable, "-m", "workshop", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_figures_command_with_an_unknown_name_exits_2_and_writes_nothing(
    tmp_path, capsys
):
    out = tmp_path / "figures"
    assert cli.main(["figures", "--out", str(out), "no_such_chart"]) == 2
    err = capsys.readouterr().err
    assert "no_such_chart" in err and "unknown" in err
    assert "learning_rate" in err  # it lists the names to choose from
    assert not out.exists() or not any(out.iterdir())


def assert_one_line_error(result, *expected, status=2):
    """Exit status `status` (2: the command line is wrong; 1: it failed as it ran),
    nothing but one line on stderr, naming each of `expected`."""
    assert result.returncode == status, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("error: ") or status == 130  # 130: "interrupted; ..."
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "argv, option",
    [
        (["copy", "--epochs", "0"], "--epochs"),
        (
            ["train", "--data-dir", "d", "--out", "o", "--max-tokens", "0"],
            "--max-tokens",
        ),
        (
            ["train", "--data-dir", "d", "--out", "o", "--accum-iter", "0"],
            "--accum-iter",
        ),
        (["train", "--data-dir", "d", "--out", "o", "--nprocs", "0"], "--nprocs"),
        (["train", "--data-dir", "d", "--out", "o", "--epochs", "-3"], "--epochs"),
        (["evaluate", "--checkpoint", "c.pt", "--batch-size", "0"], "--batch-size"),
        (["evaluate", "--checkpoint", "c.pt", "--beam", "0"], "--beam"),
        (["reproduce", "--beam", "0"], "--beam"),
    ],
)
def test_a_count_below_one_exits_2_with_one_line_naming_the_option(
    argv, option, run_cli
):
    assert_one_line_error(run_cli(*argv), option, "at least 1")


@pytest.mark.parametrize(
    "device, expected",
    [
        ("tpu", "'tpu' is not cpu, cuda, cuda:N or mps"),
        ("cuda", "CUDA is not available"),
        ("mps", "MPS (the GPU of Apple silicon"),
    ],
)
@pytest.mark.parametrize(
    "command", ["copy", "train", "translate", "evaluate", "attention", "reproduce"]
)
def test_a_device_this_machine_lacks_exits_2_in_one_line(
    command, device, expected, tmp_path, monkeypatch, run_cli
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # even on a GPU
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    argv = {
        "copy": [],
        "train": ["--out", str(tmp_path / "run")],
        "translate": ["--checkpoint", "c.pt"],
        "evaluate": ["--checkpoint", "c.pt"],
        "attention": ["--checkpoint", "c.pt", "Ein Hund."],
        "reproduce": ["--out", str(tmp_path / "run")],
    }
    result = run_cli(command, *argv[command], "--device", device)
    assert_one_line_error(result, "--device", expected)
    assert not (tmp_path / "run").exists()


def test_more_processes_than_this_machine_has_exits_2_saying_how_many_it_has(
    tmp_path, run_cli
):
    argv = ["train", "--data-dir", str(tmp_path), "--out", str(tmp_path / "run")]
    result = run_cli(*argv, "--nprocs", "100000")
    assert_one_line_error(result, "--nprocs 100000", "at most")
    assert not (tmp_path / "run").exists()


def tiny_checkpoint_state():
    """A checkpoint as `train` writes it, of a tiny untrained model (no data)."""
    config = settings.RunConfig.from_profile("smoke")
    itos = [*tat.SPECIALS, "ein", "hund", "a", "dog"]
    torch.manual_seed(0)
    model = config.make_model(len(itos), len(itos))
    return {
        "model": checkpoints.without_positional_tables(model.state_dict()),
        "config": config.to_dict(),
        "vocab_src": itos,
        "vocab_tgt": itos,
        "epoch": 0,
    }


@pytest.mark.slow
def test_translate_with_a_checkpoint_of_the_right_form_prints_a_line(tmp_path, run_cli):
    """The control for the damaged checkpoints below: the intact one translates."""
    path = tmp_path / "tiny.pt"
    torch.save(tiny_checkpoint_state(), path)
    result = run_cli("translate", "--checkpoint", str(path), "ein hund")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1


def no_config(checkpoint):
    del checkpoint["config"]
    return checkpoint


def wrong_shape(checkpoint):
    checkpoint["model"]["generator.proj.weight"] = torch.zeros(3, 32)
    return checkpoint


@pytest.mark.parametrize(
    "damage, expected",
    [
        (no_config, "lacks ['config']"),
        (wrong_shape, "generator.proj.weight"),
        (lambda checkpoint: checkpoint["model"], "lacks"),  # a bare state dict
        (None, "not a readable checkpoint"),  # not a torch file at all
    ],
)
def test_translate_with_a_damaged_checkpoint_exits_1_with_one_line_naming_it(
    damage, expected, tmp_path, run_cli
):
    path = tmp_path / "damaged.pt"
    if damage is None:
        path.write_text("these are not the weights you are looking for")
    else:
        torch.save(damage(tiny_checkpoint_state()), path)
    result = run_cli("translate", "--checkpoint", str(path), "ein hund")
    assert_one_line_error(result, "damaged.pt", expected, status=1)


def test_translate_with_no_sentences_and_empty_input_exits_2_saying_what_to_pass(
    tmp_path, monkeypatch, run_cli
):
    path = tmp_path / "tiny.pt"
    torch.save(tiny_checkpoint_state(), path)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))
    line = assert_one_line_error(run_cli("translate", "--checkpoint", str(path)))
    assert line.startswith("error: no sentences given: pass them as arguments")


@pytest.mark.parametrize(
    "argv, help",
    [
        (["translate", "--checkpoint", "c.pt", "--beam", "0"], "workshop translate"),
        (["translate", "--checkpoint", "c.pt", "--n-be", "2"], "workshop"),
        (["transl"], "workshop"),
    ],
)
def test_a_command_line_argparse_refuses_is_one_error_line_pointing_to_the_help(
    argv, help, run_cli
):
    """argparse's errors start as every other failure does, with `error: `, and
    end naming the help to read."""
    line = assert_one_line_error(run_cli(*argv))
    assert line.endswith(f"(see python -m {help} --help)"), line


def without_module(monkeypatch, name):
    """Make the command line's import of workshop.commands (torch, the book, the
    rest of the workshop) fail as it does where the module `name` is missing."""
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
    line = assert_one_line_error(run_cli("figures"), status=1)
    assert line.startswith(f"error: torch is not installed for {sys.executable}: ")
    assert "run .venv/bin/python -m workshop (after `make setup`)" in line
    assert f"{sys.executable} -m pip install -r requirements.txt" in line
    assert "unexpected" not in line and "report it" not in line
    # The control: a module of the workshop's own is a bug, not a missing package.
    without_module(monkeypatch, "workshop.nothing")
    line = assert_one_line_error(run_cli("figures"), status=1)
    assert line.startswith("error: ModuleNotFoundError: ") and "report it" in line


@pytest.mark.parametrize(
    "bug",
    [
        KeyError("a bug"),
        TypeError("unsupported operand"),
        ValueError("Expected input batch_size (2) to match target batch_size (5)."),
    ],
    ids=[
        "KeyError",
        "TypeError, not taken for a user error",
        "ValueError, which is not a UsageError",
    ],
)
def test_an_unexpected_failure_is_one_line_that_says_how_to_see_the_traceback(
    bug, monkeypatch, capsys
):
    def broken(args):
        raise bug

    monkeypatch.setattr(commands, "run", broken)
    assert cli.main(["figures"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{type(bug).__name__}: " in err[0]
    assert "ANNOTATED_TRANSFORMER_DEBUG=1" in err[0] and "report it" in err[0]
    monkeypatch.setenv("ANNOTATED_TRANSFORMER_DEBUG", "1")
    with pytest.raises(type(bug)):
        cli.main(["figures"])


@pytest.mark.slow
def test_copy_trains_on_the_device_it_is_given_and_prints_the_copies(
    monkeypatch, run_cli
):
    """The copy command hands --device to the book's train_copy_task (here standing
    in with the copy model trained once a session, the one Part 2's and Part 5's
    tests use), then prints the book's copies."""
    model, history, _ = trained_copy_task(1)  # the default settings, seed 1
    handed = []

    def train_copy_task(config, *, quiet, device):
        handed.append((config, device))
        return model, history

    # The command runs the book's example_simple_model, which calls this.
    monkeypatch.setattr(tat, "train_copy_task", train_copy_task)
    result = run_cli("copy", "--device", "cpu", "--quiet")
    assert result.returncode == 0, result.stderr
    assert handed == [(tat.CopyTaskConfig(), torch.device("cpu"))]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("source") and len(lines) == 7  # 5 copies
    assert "exact copy: yes" in lines[-1] and "(differs)" not in result.stdout


def test_every_help_answers_without_importing_torch():
    """`python -m workshop --help`, and COMMAND --help for every command, parse
    before they import anything heavy: torch, the book and the workshop's own
    modules wait for a command to run (the bench times `train --help`, once the
    slowest: benchmarks/figures_footprint.py's cli_help row)."""
    code = (
        "import contextlib, io, json, sys\n"
        "from workshop.cli import build_parser, main\n"
        "names, shown = build_parser().command_names, []\n"
        "for argv in [[], *([name] for name in names)]:\n"
        "    out = io.StringIO()\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out):\n"
        "        main([*argv, '--help'])\n"
        "    shown.append(out.getvalue())\n"
        "print(json.dumps([names, shown, sorted(sys.modules)]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    names, shown, loaded = json.loads(result.stdout)
    assert "train" in names and "reproduce" in names and len(shown) == len(names) + 1
    for argv, text in zip([[], *([name] for name in names)], shown, strict=True):
        assert text.startswith(" ".join(["usage: python -m workshop", *argv])), text
    assert "settings: smoke, quick, multi30k, base" in shown[1 + names.index("train")]
    assert "argparse" in loaded and "workshop.cli" in loaded  # the control
    heavy = ("torch", "numpy", "the_annotated_transformer", "workshop.commands")
    assert [name for name in heavy if name in loaded] == []


def test_the_command_lines_data_variable_is_the_books():
    assert cli.DATA_ENV == tat.DATA_ENV


def test_the_command_lines_profile_names_are_the_settings_profiles():
    assert cli.PROFILE_NAMES == tuple(settings.TRAIN_PROFILES)


@pytest.mark.parametrize("command", ["translate", "evaluate"])
@pytest.mark.parametrize("alpha", ["nan", "-2", "inf", "x"])
def test_an_alpha_that_is_no_finite_number_of_at_least_0_exits_2_in_one_line(
    command, alpha, run_cli
):
    argv = [command, "--checkpoint", "c.pt", "--beam", "4", f"--alpha={alpha}"]
    assert_one_line_error(run_cli(*argv), "--alpha", "finite number >= 0", repr(alpha))


def test_the_books_own_check_of_a_users_setting_is_a_usage_error():
    """The book's check_positive_int raises a plain ValueError, which alone would be
    unexpected (exit 1); on a setting the user passed, the workshop raises it as a
    UsageError (exit 2), with the book's message."""
    with pytest.raises(ValueError) as plain:
        tat.check_positive_int(d_model=0)
    assert errors.exit_status(plain.value) == 1
    with pytest.raises(errors.UsageError, match="d_model must be a positive") as usage:
        settings.RunConfig.from_profile("smoke", d_model=0)
    assert errors.exit_status(usage.value) == 2


def test_no_command_exits_2_in_one_line_listing_the_commands():
    result = run_script()
    assert_one_line_error(result, "python -m workshop", "name a command", "download")
    assert result.stdout == ""  # nothing ran (the book's script is the copy task)


@pytest.mark.slow
def test_the_book_run_as_a_script_trains_the_copy_task_and_exits_0():
    # The book alone (`make run`): it imports nothing from the workshop.
    result = subprocess.run(
        [sys.executable, "-X", "importtime", str(BOOK)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "exact copy: yes" in result.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]
    assert not [name for name in imported if name.startswith("workshop")]


# ---------------------------------------------------------------------------
# download


def test_download_command_fetches_the_files_and_returns_0(
    multi30k_server, tmp_path, monkeypatch, capsys
):
    target = tmp_path / "data"
    url = ["--base-url", multi30k_server.url]
    assert cli.main(["download", "--data-dir", str(target), *url]) == 0
    assert names_in(target) == sorted(multi30k.MULTI30K_SHA256)
    assert "verified" in capsys.readouterr().out


def test_download_command_returns_1_naming_a_file_it_could_not_fetch(
    multi30k_server, tmp_path, monkeypatch, capsys
):
    (multi30k_server.folder / "train.en.gz").unlink()
    url = ["--base-url", multi30k_server.url]
    assert cli.main(["download", "--data-dir", str(tmp_path / "data"), *url]) == 1
    assert "train.en.gz" in capsys.readouterr().err


def test_download_command_cut_off_mid_file_exits_1_in_one_line_and_keeps_nothing(
    multi30k_server, tmp_path, monkeypatch, capsys
):
    multi30k_server.cut.add("train.de.gz")
    target = tmp_path / "data"
    url = ["--base-url", multi30k_server.url]
    assert cli.main(["download", "--data-dir", str(target), *url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.de.gz" in err[0]
    assert "train.de.gz" in multi30k_server.requested
    assert not target.exists()  # the first file: nothing kept, not even the folder


# ---------------------------------------------------------------------------
# translate


@pytest.mark.slow
def test_translate_command_names_a_sentence_longer_than_the_models_positions(
    translator, monkeypatch, capsys, no_progress
):
    """Past the positional encoding's table a sentence must be cut: it is, aloud."""
    config = translator.config
    short = tat.make_model(
        len(translator.vocab_src),
        len(translator.vocab_tgt),
        N=config.N,
        d_model=config.d_model,
        d_ff=config.d_ff,
        h=config.h,
        max_len=30,
    )
    checkpoints.load_weights(
        short, checkpoints.without_positional_tables(translator.model.state_dict())
    )
    limited = translation.Translator(
        short.eval(), translator.vocab_src, translator.vocab_tgt, config
    )
    monkeypatch.setattr(commands, "load_translator", lambda path, device=None: limited)
    long = " ".join(["Hund"] * 40)  # 42 ids with <s> and </s>
    assert cli.main(["translate", "--checkpoint", "x.pt", "Ein Hund.", long]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2
    assert err.strip() == (
        "warning: sentence 2 has 42 tokens, more than the model's 30 positions: "
        "the first 30 are read."
    )


def test_translate_command_prints_one_line_per_sentence(smoke_run, capsys):
    path = str(smoke_run.out / "last.pt")
    assert cli.main(["translate", "--checkpoint", path, "Ein Hund läuft."]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_translate_command_with_a_missing_checkpoint_returns_1(tmp_path, capsys):
    path = tmp_path / "missing.pt"
    assert cli.main(["translate", "--checkpoint", str(path), "Ein Hund."]) == 1
    assert "missing.pt" in capsys.readouterr().err


def test_translate_prints_each_window_as_it_ends_and_an_interrupt_keeps_them(
    tmp_path, monkeypatch, run_cli, no_progress
):
    """translate decodes its input in windows of WINDOW_BATCHES batches, in input
    order, and prints a window's lines as it ends: Ctrl-C in the second window
    leaves the first window's lines printed, in input order (each window sorted by
    length to decode), and exits 130."""
    tiny_checkpoint(tmp_path / "tiny.pt", seed=0, words=["a", "dog", "runs", "cat"])
    decoded = []

    def echo_then_interrupt(model, src, *args, **options):
        if len(decoded) == translation.WINDOW_BATCHES:  # the second window's first
            raise KeyboardInterrupt
        decoded.append(src.size(0))
        return src

    monkeypatch.setattr(tat, "greedy_decode", echo_then_interrupt)
    window = translation.WINDOW_BATCHES * 64  # translate's batches hold 64
    sentences = ["a cat runs", "dog", "a dog runs", "runs"]
    lines = [sentences[i % 4] for i in range(window + 10)]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    result = run_cli("translate", "--checkpoint", str(tmp_path / "tiny.pt"))
    assert (result.returncode, result.stderr) == (130, "interrupted\n")
    assert decoded == [64] * translation.WINDOW_BATCHES
    assert result.stdout.splitlines() == lines[:window]


@pytest.mark.parametrize(
    "argv, why",
    [
        (["translate", "--checkpoint", "c.pt", "--alpha", "1", "x"], "--beam K"),
        (["translate", "--checkpoint", "c.pt", "--beam", "1", "--alpha", "0", "x"], ""),
        (["translate", "--checkpoint", "c.pt", "--sample", "--alpha", "1", "x"], ""),
        (["evaluate", "--checkpoint", "c.pt", "--alpha", "1"], "--beam K"),
        (["evaluate", "--checkpoint", "c.pt", "--beam", "1", "--alpha", "2"], ""),
    ],
)
def test_an_alpha_without_a_beam_exits_2_in_one_line_before_any_work(
    argv, why, monkeypatch, run_cli
):
    """--alpha changes only a beam search, as --temperature only a sample: given
    to greedy decoding or to sampling it is refused, before a model is loaded."""
    monkeypatch.setattr(commands, "load_translator", never_run)
    monkeypatch.setattr(commands, "evaluate", never_run)
    penalty = "--alpha: the length penalty takes effect only in a beam search"
    assert_one_line_error(run_cli(*argv), penalty, why)


def test_alpha_is_0_6_unless_given_and_a_beam_takes_any_of_at_least_0(monkeypatch):
    """The control for the refusals above: a beam (--beam K, or the one --n-best
    K implies) searches with --alpha, 0 included, else with 0.6; evaluate hands
    --alpha on as given (None: scoring's decode_options uses 0.6)."""
    parser = cli.build_parser()
    for given, alpha in [
        (["--beam", "4"], 0.6),
        (["--beam", "3", "--alpha", "1.5"], 1.5),
        (["--n-best", "2", "--alpha", "0"], 0.0),
    ]:
        args = parser.parse_args(["translate", "--checkpoint", "c.pt", *given])
        assert commands.translate_options(args)["alpha"] == alpha, given
    assert f"(default: {translation.ALPHA})" in cli.ALPHA_HELP  # said without torch
    handed = []
    monkeypatch.setattr(commands, "evaluate", lambda *a, **k: handed.append(k))
    for given in (["--beam", "4"], ["--beam", "4", "--alpha", "0"]):
        commands.run(parser.parse_args(["evaluate", "--checkpoint", "c.pt", *given]))
    assert [options["alpha"] for options in handed] == [None, 0.0]


# ---------------------------------------------------------------------------
# train


def test_train_command_with_a_folder_without_data_names_the_missing_file(
    tmp_path, capsys
):
    argv = ["train", "--data-dir", str(tmp_path / "no_data"), "--out", str(tmp_path)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "train.de.gz" in err and "download" in err


def test_train_command_with_resume_but_no_last_checkpoint_returns_1(tmp_path, capsys):
    argv = ["train", "--data-dir", str(tmp_path), "--out", str(tmp_path), "--resume"]
    assert cli.main(argv) == 1
    assert "last.pt" in capsys.readouterr().err


@pytest.mark.slow
def test_train_command_trains_the_smoke_profile_and_saves_a_checkpoint(
    multi30k_dir, tmp_path
):
    argv = ["train", "--data-dir", str(multi30k_dir), "--out", str(tmp_path)]
    argv += ["--profile", "smoke", "--epochs", "1", "--max-tokens", "800", "--quiet"]
    assert cli.main(argv) == 0
    last = checkpoints.load_checkpoint(tmp_path / "last.pt")
    assert last["config"]["profile"] == "smoke"
    assert (last["config"]["epochs"], last["config"]["max_tokens"]) == (1, 800)
    assert [r["epoch"] for r in last["history"]] == [1]


def test_train_command_passes_vocab_size_and_sharing_to_the_config(
    monkeypatch, tmp_path
):
    calls = []
    monkeypatch.setattr(
        commands, "train_model", lambda config, *args, **kwargs: calls.append(config)
    )
    argv = ["train", "--data-dir", str(tmp_path), "--out", str(tmp_path)]
    argv += ["--profile", "smoke", "--vocab", "bpe", "--bpe-vocab-size", "2000"]
    assert cli.main([*argv, "--share-embeddings"]) == 0
    assert cli.main(argv) == 0
    shared, unshared = calls
    assert (shared.vocab, shared.bpe_vocab_size) == ("bpe", 2000)
    assert shared.share_embeddings and shared.tie_generator
    assert unshared.vocab == "bpe" and not unshared.share_embeddings


def test_train_takes_a_precision_and_bf16_is_its_alias(run_cli):
    """--precision fp32|bf16|auto reaches the run's settings as `precision`;
    --bf16 is --precision bf16; without either the profile's holds (auto), as
    --help says."""
    parser = cli.build_parser()
    train = ["train", "--out", "o"]
    for given, precision in [
        ([], None),
        (["--precision", "fp32"], "fp32"),
        (["--precision", "auto"], "auto"),
        (["--bf16"], "bf16"),
        (["--precision", "fp32", "--bf16"], "bf16"),  # the last one given
    ]:
        args = parser.parse_args([*train, *given])
        assert commands.train_changes(args).get("precision") == precision, given
    help_text = " ".join(run_cli("train", "--help").stdout.split())
    assert (
        "--precision {fp32,bf16,auto}" in help_text
        and "(default: the profile's, auto)" in help_text
    )
    assert "--bf16 the same as --precision bf16" in help_text
    profiles = {settings.RunConfig.from_profile(p).precision for p in cli.PROFILE_NAMES}
    assert profiles == {"auto"}  # what the help says: every profile's
    bad = run_cli(*train, "--precision", "fp16")
    assert_one_line_error(bad, "--precision", "invalid choice: 'fp16'")


def test_train_command_sharing_embeddings_of_word_vocabularies_returns_2(
    tmp_path, capsys
):
    argv = ["train", "--data-dir", str(tmp_path), "--out", str(tmp_path)]
    assert cli.main([*argv, "--share-embeddings"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --share-embeddings needs --vocab bpe"), err
    # multi30k's vocabulary is bpe: it shares without --vocab (the data is missing)
    assert cli.main([*argv, "--share-embeddings", "--profile", "multi30k"]) == 1
    assert "train.de.gz" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# train: one folder, one run (refusing to mix runs, resuming)


def copy_of(run_folder, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(run_folder, target)
    return target


def train_argv(multi30k_dir, out, *more):
    return ["train", "--data-dir", str(multi30k_dir), "--out", str(out), *more]


def test_train_into_a_folder_holding_a_run_exits_2_and_leaves_the_run_alone(
    smoke_run, multi30k_dir, tmp_path, capsys
):
    run = copy_of(smoke_run.out, tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    argv = train_argv(multi30k_dir, run, "--profile", "smoke", "--epochs", "1")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert str(run) in err[0] and "--resume" in err[0] and "--out" in err[0]
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


@pytest.mark.slow
def test_resume_takes_the_runs_settings_and_extends_only_its_epochs(
    smoke_run, multi30k_dir, tmp_path, capsys
):
    run = copy_of(smoke_run.out, tmp_path)
    assert cli.main(train_argv(multi30k_dir, run, "--resume", "--epochs", "3")) == 0
    printed = capsys.readouterr().out
    assert f"resuming {run / 'last.pt'} (profile smoke): 2 of 3 epochs done" in printed
    last = checkpoints.load_checkpoint(run / "last.pt")
    assert last["config"] == smoke_config(epochs=3).to_dict()  # not quick's settings
    assert [r["epoch"] for r in last["history"]] == [1, 2, 3]
    assert last["history"][:2] == smoke_run.history
    assert run_folders.epoch_files(run) == [run / "epoch_003.pt"]  # keep_checkpoints=1


@pytest.mark.parametrize(
    "more, expected",
    [
        ([], "has finished its 2 epochs"),
        (["--epochs", "2"], "has finished its 2 epochs"),
        (["--max-tokens", "500"], "max_tokens=500 (the run has 300)"),
        (["--profile", "quick"], "profile='quick' (the run has 'smoke')"),
        (["--epochs", "3", "--bf16"], "precision='bf16' (the run has "),
    ],
)
def test_resume_refuses_to_change_a_runs_settings_or_to_train_nothing(
    smoke_run, multi30k_dir, tmp_path, capsys, more, expected
):
    run = copy_of(smoke_run.out, tmp_path)
    before = (run / "last.pt").read_bytes()
    assert cli.main(train_argv(multi30k_dir, run, "--resume", *more)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert (run / "last.pt").read_bytes() == before


@pytest.mark.slow
def test_a_run_stopped_by_its_time_limit_finishes_with_the_command_it_prints(
    multi30k_dir, tmp_path, capsys, run_cli
):
    """The time limit guards one invocation, not the run: the command the stop
    line gives, a plain --resume, trains the run to its end. --resume --time-limit
    sets a limit for that invocation alone; one shorter than the run's last epoch
    would start no epoch, and is refused saying so, with last.pt left alone."""
    run = tmp_path / "run"
    # Minutes: one epoch is longer. Three epoch files kept, for the average below.
    config = smoke_config(epochs=3, time_limit=1e-3, keep_checkpoints=3)
    training.train_model(config, multi30k_dir, run)
    printed = capsys.readouterr().out
    stopped = checkpoints.load_checkpoint(run / "last.pt")
    assert stopped["epoch"] == 0 and "stopped after 1 of the 3" in stopped["stopped"]
    # The run's limit is not kept: a resume has none unless it is given one.
    assert run_folders.resume_config(run).time_limit is None
    assert run_folders.resume_config(run, time_limit=30.0).time_limit == 30.0
    before = (run / "last.pt").read_bytes()
    too_short = train_argv(multi30k_dir, run, "--resume", "--time-limit", "1e-5")
    assert_one_line_error(run_cli(*too_short), "would start no epoch", "--time-limit")
    assert (run / "last.pt").read_bytes() == before
    (advice,) = re.findall(r"Continue with `([^`]+)`", printed)
    python, *argv = shlex.split(advice)
    assert python == "python" and argv[:3] == ["-m", "workshop", "train"]
    assert "--time-limit" not in argv
    resumed = run_cli(*argv[2:])  # the command as printed, after `python -m workshop`
    assert resumed.returncode == 0, resumed.stderr
    assert "1 of 3 epochs done" in resumed.stdout
    finished = checkpoints.load_checkpoint(run / "last.pt")
    assert [r["epoch"] for r in finished["history"]] == [1, 2, 3]
    assert finished["epoch"] == 2 and "stopped" not in finished
    # Its epochs, saved under different time limits, still average together: the
    # limit is no setting of the model.
    epochs = [str(path) for path in run_folders.epoch_files(run)]
    assert len(epochs) == 3
    assert cli.main(["average", *epochs, "--out", str(tmp_path / "mean.pt")]) == 0


# ---------------------------------------------------------------------------
# average


def test_average_command_writes_the_averaged_checkpoint_and_returns_0(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "a.pt", seed=1)
    tiny_checkpoint(tmp_path / "b.pt", seed=2)
    argv = ["average", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]
    assert cli.main([*argv, "--out", str(tmp_path / "m.pt")]) == 0
    assert "averaged 2 checkpoints" in capsys.readouterr().out
    assert set(checkpoints.load_checkpoint(tmp_path / "m.pt")) >= set(
        checkpoints.CHECKPOINT_KEYS
    )


def test_average_command_returns_1_naming_a_missing_or_mismatched_checkpoint(
    tmp_path, capsys
):
    tiny_checkpoint(tmp_path / "a.pt", seed=1)
    out = ["--out", str(tmp_path / "m.pt")]
    assert (
        cli.main(["average", str(tmp_path / "a.pt"), str(tmp_path / "x.pt"), *out]) == 1
    )
    assert "x.pt" in capsys.readouterr().err
    tiny_checkpoint(tmp_path / "b.pt", seed=2, h=4)
    assert (
        cli.main(["average", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), *out]) == 1
    )
    # The files and their values in one order, the order they were named in.
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    assert f"{a} and {b} have different settings (h=2 vs 4)" in capsys.readouterr().err
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.parametrize(
    "out", ["run/last.pt", "run/epoch_002.pt", "elsewhere/last.pt", "run/a.pt"]
)
def test_average_refuses_to_write_over_a_runs_own_checkpoints(out, tmp_path, run_cli):
    run = tmp_path / "run"
    run.mkdir()
    tiny_checkpoint(run / "a.pt", seed=1)
    tiny_checkpoint(run / "epoch_002.pt", seed=2)
    shutil.copyfile(run / "epoch_002.pt", run / "last.pt")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    argv = ["average", str(run / "a.pt"), str(run / "epoch_002.pt")]
    result = run_cli(*argv, "--out", str(tmp_path / out))
    assert_one_line_error(result, str(tmp_path / out), "another file")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert not (tmp_path / "elsewhere").exists()


def test_resuming_a_last_pt_without_progress_names_what_it_lacks_before_the_data(
    smoke_run, tmp_path, run_cli
):
    """An epoch checkpoint put in last.pt's place holds weights only: --resume
    says what is missing, before it reads (here: fails to find) any data."""
    run = copy_of(smoke_run.out, tmp_path)
    shutil.copyfile(run / "epoch_002.pt", run / "last.pt")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    argv = train_argv(tmp_path / "no_data", run, "--resume", "--epochs", "3")
    result = run_cli(*argv)
    assert_one_line_error(result, "last.pt", "optimizer", "scheduler", status=1)
    assert "train.de.gz" not in result.stderr  # the data was never read
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


# ---------------------------------------------------------------------------
# evaluate


def test_evaluate_command_returns_0_and_writes_one_line_per_sentence(
    trained_checkpoint, mini_split, tmp_path, capsys
):
    folder, pairs = mini_split
    output = tmp_path / "hyp.en"
    argv = ["evaluate", "--checkpoint", str(trained_checkpoint), "--data-dir"]
    argv += [str(folder), "--split", "mini", "--output", str(output)]
    assert cli.main(argv) == 0
    assert len(output.read_text(encoding="utf-8").splitlines()) == len(pairs)
    printed = capsys.readouterr().out
    assert "mini: 20 sentences translated (greedy)" in printed
    assert "tok:13a" in printed


def test_evaluate_command_with_a_missing_checkpoint_returns_2_naming_it(
    tmp_path, capsys
):
    write_split(tmp_path, "handmade", HANDMADE_PAIRS)
    argv = ["evaluate", "--checkpoint", str(tmp_path / "missing.pt")]
    assert cli.main([*argv, "--data-dir", str(tmp_path), "--split", "handmade"]) == 1
    assert "missing.pt" in capsys.readouterr().err


def test_evaluate_command_without_a_data_folder_says_what_to_pass(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv(tat.DATA_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # the default folder, data/multi30k here, is empty
    assert cli.main(["evaluate", "--checkpoint", str(tmp_path / "c.pt")]) == 1
    assert "--data-dir" in capsys.readouterr().err


def never_run(*args, **kwargs):
    """Stands in for what a command runs, which must not start: its inputs are
    refused first."""
    raise AssertionError("started before its inputs were checked")


class NoTranslator:
    """A Translator that must not translate: its output is refused first."""

    translate = staticmethod(never_run)


@pytest.mark.parametrize(
    "output, expected",
    [
        ("notes.txt/test.en", "notes.txt is a file, not a folder"),
        ("notes.txt/deeper/test.en", "notes.txt is a file, not a folder"),
        (".", "is a folder"),
    ],
)
def test_evaluate_with_an_output_it_cannot_write_refuses_before_translating(
    output, expected, tmp_path, monkeypatch, run_cli
):
    """Through the command line (before torch is imported) and through the library
    (before a sentence is translated): one line, exit 2, nothing written."""
    (tmp_path / "notes.txt").write_text("mine")
    write_split(tmp_path, "handmade", HANDMADE_PAIRS)
    monkeypatch.setattr(commands, "evaluate", never_run)
    target = str(tmp_path / output)
    argv = ["evaluate", "--checkpoint", "c.pt", "--output", target]
    assert_one_line_error(run_cli(*argv), "--output", expected, "name another")
    with pytest.raises(errors.UsageError, match=expected):
        scoring.evaluate(NoTranslator(), tmp_path, "handmade", output=target)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_evaluate_makes_the_missing_folders_of_its_output(
    trained_checkpoint, mini_split, tmp_path, run_cli
):
    folder, pairs = mini_split
    output = tmp_path / "new" / "folders" / "hyp.en"
    argv = ["evaluate", "--checkpoint", str(trained_checkpoint), "--data-dir"]
    result = run_cli(*argv, str(folder), "--split", "mini", "--output", str(output))
    assert result.returncode == 0, result.stderr
    assert len(output.read_text(encoding="utf-8").splitlines()) == len(pairs)


def test_train_into_an_existing_file_refuses_before_reading_data(
    tmp_path, monkeypatch, run_cli
):
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setattr(commands, "train_model", never_run)
    argv = ["train", "--data-dir", str(tmp_path / "no_data")]
    result = run_cli(*argv, "--out", str(tmp_path / "notes.txt"))
    assert_one_line_error(result, "--out", "is a file", "name another")
    monkeypatch.undo()
    config = settings.RunConfig.from_profile("smoke")
    with pytest.raises(errors.UsageError, match="is a file"):  # the data unread
        training.train_model(config, tmp_path / "no_data", tmp_path / "notes.txt")
    assert names_in(tmp_path) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------------------
# attention


def attention_argv(checkpoint, out):
    """The attention command's arguments up to the heads and the sentence."""
    return ["attention", "--checkpoint", str(checkpoint), "--out", str(out)]


@pytest.mark.slow
def test_attention_command_writes_the_three_maps_as_png(trained_checkpoint, tmp_path):
    argv = attention_argv(trained_checkpoint, tmp_path)
    assert cli.main([*argv, "--head", "0", "--head", "1", SENTENCE]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    kinds = ["decoder_self", "decoder_source", "encoder_self"]
    assert names == [f"{kind}_attention.png" for kind in kinds]
    for path in tmp_path.iterdir():
        assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_attention_command_with_a_head_that_does_not_exist_returns_2(
    trained_checkpoint, tmp_path, capsys
):
    argv = attention_argv(trained_checkpoint, tmp_path)
    assert cli.main([*argv, "--head", "5", SENTENCE]) == 2
    assert "--head must be in 0..1, got [5]" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_attention_with_a_layer_the_model_lacks_names_the_option_and_its_range(
    trained_checkpoint, tmp_path, run_cli
):
    """The smoke model has one layer: 0, or -1 counted back from the last."""
    argv = attention_argv(trained_checkpoint, tmp_path)
    result = run_cli(*argv, "--layer", "5", SENTENCE)
    assert_one_line_error(result, "--layer must be in 0..0 (or -1..-1 from the last)")
    assert "got 5" in result.stderr and not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------
# reproduce


def reproduce_again(reproduced, name, *options):
    """`reproduce --no-train` on the smoke run of `reproduced`, writing into a new
    folder `name` beside it; returns (exit status, that folder)."""
    root, _ = reproduced
    out = root / name
    argv = ["reproduce", "--profile", "smoke", "--out", str(root / "run"), "--no-train"]
    argv += ["--results", str(out), "--images", str(out)]
    argv += ["--data-dir", str(tat.data_dir_from_env()), *options]
    return cli.main(argv), out


@pytest.mark.slow
def test_reproduce_command_reports_on_an_existing_run(reproduced, capsys):
    code, out = reproduce_again(reproduced, "again", "--limit", "10", "--alphas", "0.6")
    assert code == 0
    assert (out / "smoke.md").is_file() and (out / "training_curve_smoke.png").is_file()
    assert "| `smoke` |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag, value", [("--alphas", "0.6,x"), ("--beam", "4,0"), ("--average", "")]
)
def test_reproduce_rejects_bad_lists_of_choices(tmp_path, run_cli, flag, value):
    result = run_cli("reproduce", "--data-dir", str(tmp_path), flag, value)
    expected = f"argument {flag}: must be numbers separated by commas, each a"
    assert_one_line_error(result, expected, f"got {value!r}")


def test_reproduce_takes_alphas_of_0_as_translate_does(tmp_path, monkeypatch, run_cli):
    handed = {}
    monkeypatch.setattr(commands, "reproduce", lambda *args, **k: handed.update(k))
    assert run_cli("reproduce", "--data-dir", "d", "--alphas", "0,0.6").returncode == 0
    assert handed["alphas"] == (0.0, 0.6)
    # The library goes past its check of the alphas to the run it lacks.
    with pytest.raises(FileNotFoundError, match="no trained run"):
        reproduce.reproduce("smoke", tmp_path, tmp_path, None, alphas=(0,), train=False)


def test_reproduce_without_a_trained_run_says_so(tmp_path, run_cli):
    with pytest.raises(FileNotFoundError, match="no trained run"):
        reproduce.reproduce("smoke", tmp_path, tmp_path / "empty", None, train=False)
    argv = ["reproduce", "--no-train", "--out", str(tmp_path / "empty")]
    result = run_cli(*argv, "--results", str(tmp_path / "results"))
    line = assert_one_line_error(result, "no trained run", "drop --no-train", status=1)
    assert "train=True" not in line  # the command line's words, not the library's
    assert names_in(tmp_path) == []


def test_reproduce_into_a_folder_holding_a_run_exits_2_and_trains_nothing(
    reproduced, multi30k_dir, capsys
):
    root, _ = reproduced
    before = {p.name: p.stat().st_mtime_ns for p in (root / "run").iterdir()}
    argv = ["reproduce", "--profile", "smoke", "--out", str(root / "run")]
    argv += ["--data-dir", str(multi30k_dir), "--results", str(root / "unused")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a training run" in err[0]
    assert "--no-train" in err[0]
    assert {p.name: p.stat().st_mtime_ns for p in (root / "run").iterdir()} == before
    assert not (root / "unused").exists()


@pytest.mark.slow
def test_reproduce_command_on_an_ascii_console_still_prints_the_row(
    reproduced, monkeypatch
):
    root, _ = reproduced
    out = root / "ascii"
    argv = ["reproduce", "--profile", "smoke", "--out", str(root / "run")]
    argv += ["--no-train", "--results", str(out), "--images", str(out)]
    argv += ["--limit", "5", "--alphas", "0.6", "--data-dir"]
    argv += [str(tat.data_dir_from_env())]
    console = io.BytesIO()  # a console that can show ASCII alone
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(console, encoding="ascii"))
    assert cli.main(argv) == 0
    sys.stdout.flush()
    assert b"\\u03b1" in console.getvalue()  # α, escaped
    assert (out / "smoke.json").is_file()


def test_download_command_from_a_given_address_exits_0_with_the_six_files(
    multi30k_server, tmp_path, run_cli
):
    target = tmp_path / "data"
    result = run_cli(
        "download", "--data-dir", str(target), "--base-url", multi30k_server.url
    )
    assert result.returncode == 0, result.stderr
    assert names_in(target) == sorted(multi30k.MULTI30K_SHA256)  # nothing else


def test_download_command_without_network_exits_1_in_one_line_and_keeps_nothing(
    tmp_path, run_cli
):
    closed = f"http://127.0.0.1:{free_port()}/"  # nothing listens: as if offline
    target = tmp_path / "data"
    result = run_cli("download", "--data-dir", str(target), "--base-url", closed)
    assert_one_line_error(
        result, "train.de.gz", "could not download", "--data-dir", status=1
    )
    assert f"${tat.DATA_ENV}" in result.stderr
    assert not target.exists()  # nothing partial, not even the folder it made


@pytest.mark.parametrize("base_url", ["notaurl", "ftp://example.org/multi30k/"])
def test_download_command_from_no_address_exits_2_in_one_line(
    base_url, tmp_path, run_cli
):
    target = tmp_path / "data"
    result = run_cli("download", "--data-dir", str(target), "--base-url", base_url)
    assert_one_line_error(result, repr(base_url), "http://, https:// or file://")
    assert not target.exists()


def test_download_command_into_a_file_exits_1_in_one_line(tmp_path, run_cli):
    (tmp_path / "afile").write_text("mine")
    result = run_cli("download", "--data-dir", str(tmp_path / "afile"))
    assert_one_line_error(result, "afile", "not a folder", "--data-dir DIR", status=1)
    assert (tmp_path / "afile").read_text() == "mine"


def copy_of_the_checkout(tmp_path):
    """A copy of the checkout's Makefile, workshop and book (no data, no results)."""
    checkout = tmp_path / "checkout"
    checkout.mkdir(exist_ok=True)
    for name in ("Makefile", "the_annotated_transformer.py", "requirements.txt"):
        shutil.copy2(REPO_ROOT / name, checkout / name)
    shutil.copy2(REPO_ROOT / "requirements-dev.txt", checkout)
    shutil.copytree(REPO_ROOT / "workshop", checkout / "workshop", dirs_exist_ok=True)
    return checkout


def make_in_a_copy(tmp_path, *targets, **variables):
    """Run make TARGETS in a copy of the checkout (copy_of_the_checkout), with the
    project's .venv; returns the CompletedProcess."""
    checkout = copy_of_the_checkout(tmp_path)
    # The project's .venv, whose stamp is newer than the copied requirements (copied
    # with their times): make installs nothing.
    venv = REPO_ROOT / ".venv"
    options = [f"VENV={venv}", *(f"{k}={v}" for k, v in variables.items())]
    # Not the variables of a make that runs this test: its DATA_DIR would win.
    outer = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "DATA_DIR", tat.DATA_ENV)
    env = {k: v for k, v in os.environ.items() if k not in outer}
    return subprocess.run(
        ["make", "--no-print-directory", *targets, *options],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def committed_log(tmp_path, profile):
    """results/PROFILE.log in the copy of the checkout, as if committed."""
    log = tmp_path / "checkout" / "results" / f"{profile}.log"
    log.parent.mkdir(parents=True)
    log.write_text("the committed log\n", encoding="utf-8")
    return log


def stand_in_python(folder, version):
    """A `python` that reports `version` to make's check of the version, and makes
    a venv as an empty folder with an empty bin/python (no install)."""
    path = folder / f"python{version}"
    major, minor = version.split(".")
    path.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ]; then mkdir -p "$3/bin" && touch "$3/bin/python"; '
        "exit; fi\n"
        f'exec {sys.executable} -c "import sys; '
        f'sys.version_info = ({major}, {minor}, 0); exec(sys.argv[2])" "$@"\n'
    )
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("version", ["3.11", "3.12", "3.13"])
def test_make_makes_the_venv_with_python_3_11_to_3_13(version, tmp_path):
    checkout = copy_of_the_checkout(tmp_path)
    python = stand_in_python(tmp_path, version)
    result = subprocess.run(
        ["make", "--no-print-directory", "venv/bin/python", f"PYTHON={python}"]
        + ["VENV=venv"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert (checkout / "venv" / "bin" / "python").is_file()


@pytest.mark.parametrize("version", ["3.10", "3.14"])
def test_make_refuses_to_make_the_venv_with_another_python(version, tmp_path):
    """The requirements are pinned for Python 3.11 to 3.13: make says so in one line
    and makes no .venv with another."""
    checkout = copy_of_the_checkout(tmp_path)
    python = stand_in_python(tmp_path, version)
    result = subprocess.run(
        ["make", "--no-print-directory", "run", f"PYTHON={python}", "VENV=venv"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert f"is Python {version}" in result.stderr
    assert "3.11, 3.12, 3.13" in result.stderr
    assert not (checkout / "venv").exists()


@pytest.mark.slow
def test_make_data_fills_the_default_folder_and_checks_it(multi30k_server, tmp_path):
    result = make_in_a_copy(tmp_path, "data", DATA_URL=multi30k_server.url)
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "checkout" / "data" / "multi30k"
    assert names_in(folder) == sorted(multi30k.MULTI30K_SHA256)
    assert "Multi30k is in data/multi30k" in result.stdout.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["data", "multi30k"])
def test_make_data_without_network_fails_in_one_line(target, tmp_path):
    # DATA_DIR from the Makefile's default: `make data` must fetch, and cannot (the
    # address is a closed port on this machine, as the real one is without network).
    # `make multi30k` runs it first, and stops there.
    log = committed_log(tmp_path, "multi30k")
    closed = f"http://127.0.0.1:{free_port()}/"
    result = make_in_a_copy(tmp_path, target, DATA_URL=closed)
    assert result.returncode != 0
    error, make_says = result.stderr.splitlines()  # the error, and make's own line
    assert error.startswith("error: train.de.gz: could not download it from " + closed)
    assert make_says.startswith("make: *** [Makefile:") and "data] Error 1" in make_says
    assert not (tmp_path / "checkout" / "data").exists()  # nothing partial
    assert log.read_text(encoding="utf-8") == "the committed log\n"
    assert names_in(log.parent) == ["multi30k.log"]


@pytest.mark.slow
def test_a_failed_results_run_leaves_the_committed_log_untouched(tmp_path):
    log = committed_log(tmp_path, "smoke")
    empty = tmp_path / "no_data"  # named, so nothing is fetched; it holds no files
    empty.mkdir()
    result = make_in_a_copy(tmp_path, "results-smoke", DATA_DIR=empty)
    assert result.returncode != 0
    assert "train.de.gz" in result.stdout + result.stderr  # the one-line error
    assert log.read_text(encoding="utf-8") == "the committed log\n"
    assert names_in(log.parent) == ["smoke.log"]


@pytest.mark.parametrize("status", [0, 1])
def test_a_results_log_replaces_the_committed_one_only_when_the_run_succeeds(
    status, tmp_path
):
    # A stand-in for the venv's python: prints its arguments, then a line on stderr,
    # and exits with `status`, as reproduce would after a run.
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "ran: $*"\necho "on stderr" >&2\nexit {status}\n')
    fake.chmod(0o755)
    log = committed_log(tmp_path, "quick")
    data = tmp_path / "named"
    result = make_in_a_copy(tmp_path, "results-quick", DATA_DIR=data, VENV_PYTHON=fake)
    assert names_in(log.parent) == ["quick.log"]  # no partial log left either way
    if status:
        assert result.returncode != 0
        assert log.read_text(encoding="utf-8") == "the committed log\n"
    else:
        assert result.returncode == 0, result.stderr
        ran = f"ran: -m workshop reproduce --profile quick --data-dir {data} "
        assert log.read_text(encoding="utf-8") == (
            f"{ran}--out runs/quick --results results --images images\non stderr\n"
        )


# ---------------------------------------------------------------------------
# One atomic write; error paths of the command line


def test_a_write_that_fails_half_way_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path,
):
    from workshop import files

    path = tmp_path / "results.json"
    files.atomic_write_text(path, "old")

    def half_then_fail(f):
        f.write(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.atomic_write(path, half_then_fail)
    assert path.read_text() == "old"
    assert names_in(tmp_path) == ["results.json"]
    files.atomic_write_text(path, "new")
    assert path.read_text() == "new" and names_in(tmp_path) == ["results.json"]


def test_a_written_file_gets_the_umasks_mode_or_keeps_the_one_it_replaces(tmp_path):
    from workshop import files

    old_umask = os.umask(0o022)
    try:
        new = files.atomic_write_text(tmp_path / "new.txt", "x")
        assert stat.S_IMODE(new.stat().st_mode) == 0o644
        shared = tmp_path / "shared.txt"
        shared.write_text("old")
        shared.chmod(0o664)
        files.atomic_write_text(shared, "new")
        assert stat.S_IMODE(shared.stat().st_mode) == 0o664
    finally:
        os.umask(old_umask)


@pytest.mark.parametrize(
    "argv, saves",
    [
        (["figures"], False),
        (["average", "a.pt", "--out", "b.pt"], False),
        (["train", "--out", "run"], True),
        (["reproduce", "--no-train"], True),
    ],
)
def test_ctrl_c_mentions_saved_epochs_only_for_commands_that_save_them(
    monkeypatch, capsys, argv, saves
):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "run", interrupted)
    assert cli.main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("interrupted")
    assert ("--out" in err[0]) == saves


def test_translate_into_a_closed_pipe_exits_quietly(monkeypatch, capsys):
    class Translator:
        def translations(self, sentences, **options):
            return (s.upper() for s in sentences)

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr(
        commands, "load_translator", lambda path, device=None: Translator()
    )
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert cli.main(["translate", "--checkpoint", "x.pt", "ein hund"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_translate_piped_into_a_reader_that_left_ends_without_an_error(smoke_run):
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head -1` once head has its line
    try:
        writer = subprocess.run(
            [sys.executable, "-m", "workshop", "translate", "--checkpoint"]
            + [str(smoke_run.out / "last.pt"), SENTENCE, SENTENCE],
            cwd=REPO_ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert writer.returncode == 0, writer.stderr
    # Nothing but progress, which a busy machine's 5 s bring (none on a quiet one).
    said = writer.stderr.splitlines()
    assert [line for line in said if not line.startswith("translating: ")] == []


@pytest.mark.parametrize("keep", [0, -1])
def test_keep_checkpoints_below_one_is_refused_in_one_line(keep):
    with pytest.raises(ValueError, match="keep_checkpoints") as error:
        settings.RunConfig.from_profile("smoke", keep_checkpoints=keep).validate()
    assert "\n" not in str(error.value) and repr(keep) in str(error.value)


def test_train_with_processes_checks_the_data_before_spawning_them(
    tmp_path, monkeypatch, capsys
):
    import torch.multiprocessing as mp

    def spawn(*args, **kwargs):
        raise AssertionError("spawned before the data was checked")

    monkeypatch.setattr(mp, "spawn", spawn)
    monkeypatch.setattr(distributed.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: False)
    argv = ["train", "--data-dir", str(tmp_path / "no_data"), "--out", str(tmp_path)]
    assert cli.main([*argv, "--nprocs", "2", "--profile", "smoke"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.de.gz" in err[0]


def test_train_with_processes_builds_the_vocabularies_once_for_every_rank(
    multi30k_dir, tmp_path, monkeypatch
):
    import torch.multiprocessing as mp

    spawned = {}

    def spawn(worker, nprocs, args):
        spawned.update(worker=worker, nprocs=nprocs, args=args)
        raise KeyboardInterrupt  # stop here: what matters is what they are handed

    monkeypatch.setattr(mp, "spawn", spawn)
    monkeypatch.setattr(distributed.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: False)
    config = settings.RunConfig.from_profile("smoke", max_train_pairs=200)
    with pytest.raises(KeyboardInterrupt):
        training.train_model(
            config, multi30k_dir, tmp_path / "run", nprocs=2, quiet=True
        )
    worker, world_size, (job,), on_cpu = spawned["args"]
    assert worker is training.train_worker and world_size == 2 and on_cpu
    vocab_src, vocab_tgt = job.vocabs
    assert spawned["nprocs"] == 2 and len(vocab_src) > 4 and len(vocab_tgt) > 4


def test_each_spawned_cpu_process_gets_its_share_of_the_cores(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(distributed.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: False)

    def worker(rank, world_size, *args):
        return rank, world_size, args, torch.get_num_threads()

    try:
        seen = [distributed.start_process(rank, worker, 2, ("job",)) for rank in (0, 1)]
    finally:
        torch.set_num_threads(before)
    assert seen == [(0, 2, ("job",), 2), (1, 2, ("job",), 2)]


@pytest.mark.slow
def test_reproduce_names_the_averaging_windows_it_drops(reproduced, capsys):
    options = ["--limit", "5", "--average", "2,4,7", "--beam", "2", "--alphas", "0.6"]
    code, _ = reproduce_again(reproduced, "windows", *options)
    assert code == 0
    err = capsys.readouterr().err.strip().splitlines()
    warnings = [line for line in err if line.startswith("warning:")]
    assert len(warnings) == 1 and "the last 4, 7 epochs" in warnings[0]
    assert warnings[0].endswith("dropped: the run trained only 2 epochs.")


@pytest.mark.slow
def test_reproduce_names_the_pruning_that_dropped_its_averages(
    smoke_run, multi30k_dir, tmp_path, run_cli
):
    """The smoke run kept 1 of its 2 epoch checkpoints: the warning says so, with
    the run's keep_checkpoints and the option that keeps more."""
    run = copy_of(smoke_run.out, tmp_path)
    argv = ["reproduce", "--profile", "smoke", "--out", str(run), "--no-train"]
    argv += ["--data-dir", str(multi30k_dir), "--limit", "3", "--average", "2"]
    argv += ["--beam", "2", "--alphas", "0.6"]
    result = run_cli(*argv, "--results", str(tmp_path / "scores"))
    assert result.returncode == 0, result.stderr
    (warning,) = [x for x in result.stderr.splitlines() if x.startswith("warning")]
    assert warning.endswith(
        f"dropped: {run} holds only its newest 1 epoch checkpoints of 2 (train "
        "--keep-checkpoints N keeps N; this run's is 1)."
    )


@pytest.mark.slow
def test_a_failing_cell_makes_the_site_build_fail_in_one_line(tmp_path):
    import nbformat

    from tools import build_site

    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("x = 1"),
            nbformat.v4.new_code_cell("y = x / 0  # divide\nprint(y)"),
        ]
    )
    with pytest.raises(build_site.BuildError) as error:
        build_site.execute(notebook, tmp_path)
    message = str(error.value)
    assert "\n" not in message and "y = x / 0" in message
    assert "ZeroDivisionError: division by zero" in message


# ---------------------------------------------------------------------------
# Bad input, through the command line: one clear line, no traceback, nothing lost


def test_train_with_a_mistyped_data_folder_creates_no_run_folder(tmp_path, run_cli):
    out = tmp_path / "new_run"
    result = run_cli("train", "--data-dir", str(tmp_path / "typo"), "--out", str(out))
    assert_one_line_error(result, "train.de.gz", status=1)
    assert not out.exists()


@pytest.mark.slow
def test_reproduce_writes_into_its_run_folder_and_never_a_limit_into_results(
    reproduced, multi30k_dir, tmp_path, monkeypatch, run_cli
):
    """reproduce's results and curve go to its run folder unless --results and
    --images name others: no default is a folder of the checkout; a score on a few
    sentences is refused the checkout's results/, and the record keeps the limit."""
    root, _ = reproduced
    run = copy_of(root / "run", tmp_path)
    monkeypatch.chdir(tmp_path)  # where results/ and images/ were written before
    argv = ["reproduce", "--profile", "smoke", "--out", str(run), "--no-train"]
    argv += ["--data-dir", str(multi30k_dir), "--limit", "5"]
    argv += ["--beam", "2", "--alphas", "0.6", "--average", "2"]
    committed = REPO_ROOT / "results"
    before = {p.name: p.stat().st_mtime_ns for p in committed.iterdir()}
    refused = run_cli(*argv, "--results", str(committed))
    assert_one_line_error(refused, "limit=5", "no result to write into")
    assert {p.name: p.stat().st_mtime_ns for p in committed.iterdir()} == before
    assert run_cli(*argv).returncode == 0
    assert names_in(tmp_path) == ["run"]
    assert {"smoke.json", "smoke.md", "training_curve_smoke.png"} <= set(names_in(run))
    record = json.loads((run / "smoke.json").read_text())
    assert record["limit"] == 5 and record["test_greedy"]["n"] == 5


def test_out_of_memory_gets_its_own_line_saying_what_to_lower(
    smoke_run, monkeypatch, run_cli
):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
            "capacity of 7.6 GiB of which 1.1 GiB is free."
        )

    monkeypatch.setattr(translation.Translator, "translations", out_of_memory)
    argv = ["translate", "--checkpoint", str(smoke_run.out / "last.pt"), "Ein Hund."]
    line = assert_one_line_error(run_cli(*argv), "out of memory", "--beam", status=1)
    assert "Tried to allocate 2.00 GiB" in line and "report it" not in line


@pytest.mark.slow
def test_translate_searches_with_the_beam_and_alpha_it_is_given(
    translator, smoke_run, monkeypatch, run_cli
):
    """--beam 3 --alpha 1.5 runs the beam search with those (recorded as it runs),
    and prints what it finds; without --beam, no beam search runs."""
    searched, search = [], tat.beam_search

    def recorded_search(*args, **options):
        searched.append((options["beam_size"], options["alpha"]))
        return search(*args, **options)

    monkeypatch.setattr(tat, "beam_search", recorded_search)
    sentences = [SENTENCE, "Zwei Männer spielen Fußball."]
    checkpoint = str(smoke_run.out / "last.pt")
    argv = ["translate", "--checkpoint", checkpoint, "--device", "cpu", *sentences]
    result = run_cli(*argv, "--beam", "3", "--alpha", "1.5")
    assert result.returncode == 0, result.stderr
    assert searched == [(3, 1.5)]  # one batch of both sentences
    beam = translator.translate(sentences, **translation.decode_options(3, 1.5))
    assert result.stdout.splitlines() == beam
    searched.clear()
    greedy = run_cli(*argv).stdout.splitlines()
    assert searched == []
    assert greedy == translator.translate(sentences, **translation.decode_options())


def full_disk_at_the_first_save(monkeypatch):
    """Make torch.save into a file meet a full disk after 1,000 bytes, as a real
    one does: torch's writer turns the file's OSError(ENOSPC) into a RuntimeError."""
    real_save = torch.save

    class FullDisk:
        def __init__(self, f):
            self.f, self.room = f, 1000

        def write(self, data):
            if len(data) > self.room:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.room -= len(data)
            return self.f.write(data)

    def save(obj, f, *args, **kwargs):
        # a file, not the buffer that measures a checkpoint's size
        target = f if isinstance(f, io.BytesIO) else FullDisk(f)
        return real_save(obj, target, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def torch_fails_in_the_first_epoch(monkeypatch):
    """Make a run's first epoch raise the ValueError torch raises for a loss over
    tensors of mismatched shapes: a failure inside a run, not the user's input."""

    def run_epoch(*args, **kwargs):
        logits, targets = torch.zeros(2, 3), torch.zeros(5, dtype=torch.long)
        return torch.nn.functional.cross_entropy(logits, targets)

    monkeypatch.setattr(training, "run_epoch", run_epoch)


def raise_in(monkeypatch, name, error):
    """Make commands.NAME (what a command runs) raise `error`."""

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(commands, name, fail)


# Each case: (how to set it up, given `it` (its run folder, data and tmp folders,
# monkeypatch and a stack of contexts) it returns the command line), the exit
# status, and what its one line must say.
BAD_INPUT = {
    "a resume whose limit is shorter than an epoch": (
        lambda it: [*it.train, "--resume", "--epochs", "3", "--time-limit", "1e-5"],
        2,
        ["would start no epoch and train nothing", "--time-limit"],
    ),
    "an average over a run's last.pt": (
        lambda it: ["average", str(it.run / "epoch_002.pt"), "--out", str(it.last)],
        2,
        ["last.pt", "another file"],
    ),
    "a resume from an averaged last.pt": (
        lambda it: (
            checkpoints.average_checkpoints([it.run / "epoch_002.pt"], it.tmp / "a.pt"),
            shutil.copyfile(it.tmp / "a.pt", it.last),
            [*it.train, "--resume", "--epochs", "3"],
        )[-1],
        1,
        ["cannot be resumed", "optimizer"],
    ),
    "a mistyped data folder": (
        lambda it: ["train", "--data-dir", str(it.tmp / "typo"), "--out", it.new],
        1,
        ["typo", "train.de.gz"],
    ),
    "reproduce --limit into results/": (
        lambda it: (
            ["reproduce", "--no-train", "--out", str(it.run), "--limit", "5"]
            + ["--results", str(REPO_ROOT / "results")]
        ),
        2,
        ["limit=5", "no result to write into", "results"],
    ),
    "a ValueError of torch's inside a run": (
        lambda it: (
            torch_fails_in_the_first_epoch(it.monkeypatch),
            [*it.train, "--resume", "--epochs", "3", "--quiet"],
        )[-1],
        1,
        ["ValueError: Expected input batch_size (2)", "report it"],
    ),
    "out of memory while training": (
        lambda it: (
            raise_in(it.monkeypatch, "train_model", torch.OutOfMemoryError("CUDA")),
            ["train", "--out", it.new],
        )[-1],
        1,
        ["out of memory", "--max-tokens"],
    ),
    "translate with a beam of 0": (
        lambda it: ["translate", "--checkpoint", str(it.last), "--beam", "0", "x"],
        2,
        ["--beam", "at least 1"],
    ),
    "translate with an alpha that is no number": (
        lambda it: ["translate", "--checkpoint", str(it.last), "--alpha", "nan", "x"],
        2,
        ["--alpha", "finite number >= 0", "'nan'"],
    ),
    "evaluate with a negative alpha": (
        lambda it: ["evaluate", "--checkpoint", str(it.last), "--alpha", "-2"],
        2,
        ["--alpha", "finite number >= 0", "'-2'"],
    ),
    "copy on a device this machine lacks": (
        lambda it: (
            it.monkeypatch.setattr(torch.cuda, "is_available", lambda: False),
            ["copy", "--device", "cuda"],
        )[-1],
        2,
        ["--device", "CUDA is not available", "--device cpu"],
    ),
    "evaluate --output inside a file": (
        lambda it: (
            (it.tmp / "notes.txt").write_text("mine"),
            ["evaluate", "--checkpoint", str(it.last), "--output"]
            + [str(it.tmp / "notes.txt" / "test.en")],
        )[-1],
        2,
        ["--output", "notes.txt is a file, not a folder"],
    ),
    "evaluate --output a folder": (
        lambda it: ["evaluate", "--checkpoint", str(it.last), "--output", str(it.run)],
        2,
        ["--output", "run is a folder"],
    ),
    "train --out an existing file": (
        lambda it: (
            (it.tmp / "notes.txt").write_text("mine"),
            ["train", "--out", str(it.tmp / "notes.txt")],
        )[-1],
        2,
        ["--out", "notes.txt is a file"],
    ),
    "a device this machine lacks": (
        lambda it: (
            it.monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False),
            ["evaluate", "--checkpoint", str(it.last), "--device", "mps"],
        )[-1],
        2,
        ["--device", "MPS", "--device cpu"],
    ),
    "a download that waits for nothing": (
        lambda it: ["download", "--data-dir", it.new, "--timeout", "0"],
        2,
        ["--timeout", "above 0"],
    ),
    "a download address that is none": (
        lambda it: ["download", "--data-dir", it.new, "--base-url", "notaurl"],
        2,
        ["'notaurl'", "http://, https:// or file://"],
    ),
    "a second writer into a run's folder": (
        lambda it: (
            it.stack.enter_context(run_lock.hold_run_folder(it.run)),
            [*it.train, "--resume", "--epochs", "3"],
        )[-1],
        1,
        ["is in use", "another process is writing a run there"],
    ),
    "a full disk": (
        lambda it: (
            full_disk_at_the_first_save(it.monkeypatch),
            [*it.train, "--resume", "--epochs", "3", "--quiet"],
        )[-1],
        1,
        ["no space left on the device", "free there", "is as it was before"],
    ),
    "reproduce --no-train where there is no run": (
        lambda it: ["reproduce", "--no-train", "--out", it.new],
        1,
        ["no trained run", "drop --no-train"],
    ),
    "a resume that changes a setting": (
        lambda it: [*it.train, "--resume", "--epochs", "3", "--max-tokens", "500"],
        2,
        ["max_tokens=500 (the run has 300)"],
    ),
    "a resume of a finished run": (
        lambda it: [*it.train, "--resume"],
        2,
        ["has finished its 2 epochs", "--epochs N"],
    ),
    "a resume with nothing to resume": (
        lambda it: ["train", "--data-dir", it.data, "--out", it.new, "--resume"],
        1,
        ["no ", "last.pt to continue from"],
    ),
    "a new run into a run's folder": (
        lambda it: it.train,
        2,
        ["already holds a training run", "--resume"],
    ),
    "a truncated last.pt": (
        lambda it: (
            it.last.write_bytes(it.last.read_bytes()[:1000]),
            [*it.train, "--resume", "--epochs", "3"],
        )[-1],
        1,
        ["last.pt is not a readable checkpoint"],
    ),
    "a truncated checkpoint": (
        lambda it: (
            (it.tmp / "cut.pt").write_bytes(it.last.read_bytes()[:1000]),
            ["translate", "--checkpoint", str(it.tmp / "cut.pt"), "Ein Hund."],
        )[-1],
        1,
        ["cut.pt", "not a readable checkpoint"],
    ),
    "a missing checkpoint": (
        lambda it: ["evaluate", "--checkpoint", str(it.tmp / "none.pt")],
        1,
        ["none.pt", "not found"],
    ),
    "a split that is not there": (
        lambda it: ["evaluate", "--checkpoint", str(it.last), "--split", "test_2099"],
        1,
        ["test_2099.de.gz not found"],
    ),
    "a split that make data does not fetch": (
        lambda it: (
            ["evaluate", "--checkpoint", str(it.last), "--split"] + ["test_2017_flickr"]
        ),
        1,
        [
            "test_2017_flickr.de.gz not found",
            "Put test_2017_flickr.de.gz and test_2017_flickr.en.gz",
        ],
    ),
    "averaging a checkpoint the run pruned": (
        lambda it: (
            ["average", str(it.run / "epoch_001.pt")]
            + [str(it.run / "epoch_002.pt"), "--out", str(it.tmp / "a.pt")]
        ),
        1,
        ["epoch_001.pt not found"],
    ),
    "a sentence beyond the hard limit": (
        lambda it: [
            "translate",
            "--checkpoint",
            str(it.last),
            "Ein Hund.",
            "x" * 100_001,
        ],
        2,
        ["sentence 2 has 100,001 characters", "one sentence a line"],
    ),
    "sampling's options without --sample": (
        lambda it: (
            ["translate", "--checkpoint", str(it.last), "--top-k", "5"]
            + ["--seed", "1", "x"]
        ),
        2,
        ["--top-k, --seed", "only with --sample"],
    ),
    "sampling with a beam": (
        lambda it: (
            ["translate", "--checkpoint", str(it.last), "--sample", "--beam"]
            + ["4", "x"]
        ),
        2,
        ["--sample", "--beam 4", "choose one"],
    ),
    "more of the n best than the beam holds": (
        lambda it: (
            ["translate", "--checkpoint", str(it.last), "--beam", "2"]
            + ["--n-best", "3", "x"]
        ),
        2,
        ["--n-best 3 needs a beam of at least 3"],
    ),
    "a top-p that is no probability": (
        lambda it: (
            ["translate", "--checkpoint", str(it.last), "--sample"]
            + ["--top-p", "1.5", "x"]
        ),
        2,
        ["--top-p", "above 0 and at most 1", "'1.5'"],
    ),
    "a temperature of 0": (
        lambda it: (
            ["translate", "--checkpoint", str(it.last), "--sample"]
            + ["--temperature", "0", "x"]
        ),
        2,
        ["--temperature", "finite number above 0"],
    ),
    "an option abbreviated": (
        lambda it: ["translate", "--checkpoint", str(it.last), "--n-be", "2", "x"],
        2,
        ["unrecognized arguments: --n-be"],
    ),
    "keeping no checkpoint": (
        lambda it: ["train", "--out", it.new, "--keep-checkpoints", "0"],
        2,
        ["--keep-checkpoints", "at least 1"],
    ),
    "an unknown profile": (
        lambda it: ["train", "--out", it.new, "--profile", "huge"],
        2,
        ["invalid choice: 'huge'", "smoke"],
    ),
    "more processes than cores": (
        lambda it: ["train", "--out", it.new, "--nprocs", "100000", "--device", "cpu"],
        2,
        ["--nprocs 100000", "at most"],
    ),
    "a head the model lacks": (
        lambda it: ["attention", "--checkpoint", str(it.last), "--head", "9", "x"],
        2,
        ["--head must be in 0..1"],
    ),
    "Ctrl-C during a run": (
        lambda it: (
            raise_in(it.monkeypatch, "train_model", KeyboardInterrupt()),
            [*it.train, "--resume", "--epochs", "3"],
        )[-1],
        130,
        ["interrupted", "finished epochs are saved"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_clear_line_and_loses_nothing(
    case, smoke_run, multi30k_dir, tmp_path, monkeypatch, run_cli
):
    setup, status, expected = BAD_INPUT[case]
    run = copy_of(smoke_run.out, tmp_path)
    monkeypatch.chdir(tmp_path)  # what a command writes by default lands here
    monkeypatch.setenv(tat.DATA_ENV, str(multi30k_dir))
    with contextlib.ExitStack() as stack:
        it = SimpleNamespace(
            run=run,
            last=run / "last.pt",
            data=str(multi30k_dir),
            tmp=tmp_path,
            new=str(tmp_path / "new"),
            train=["train", "--data-dir", str(multi30k_dir), "--out", str(run)],
            monkeypatch=monkeypatch,
            stack=stack,
        )
        argv = setup(it)
        before = {p.name: p.read_bytes() for p in run.iterdir()}
        outside = names_in(tmp_path)
        result = run_cli(*argv)
        after = {p.name: p.read_bytes() for p in run.iterdir()}
    line = assert_one_line_error(result, *expected, status=status)
    assert len(line) < 500, line  # one clear line, not a dump
    assert after == before
    assert names_in(tmp_path) == outside  # no folder, file or partial file left


# ---------------------------------------------------------------------------
# A student's path: translate line for line, n-best and sampling, checkpoints kept,
# defaults outside the checkout's tracked folders, the training log


def echo(model, src, src_mask, max_len, start_symbol, **options):
    """Stands in for greedy decoding: answers each source with itself, so that an
    answer shows which line it answers."""
    return src


def test_translate_answers_each_line_with_one_line_a_blank_with_a_blank(
    tmp_path, monkeypatch, run_cli
):
    tiny_checkpoint(tmp_path / "tiny.pt", seed=0, words=["a", "dog", "runs", "cat"])
    monkeypatch.setattr(tat, "greedy_decode", echo)
    argv = ["translate", "--checkpoint", str(tmp_path / "tiny.pt")]
    lines = ["a dog", "", "runs", "  ", "a cat runs", "", "dog"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    result = run_cli(*argv)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n") == [
        *["a dog", "", "runs", "", "a cat runs", "", "dog"],
        "",  # the newline that ends the last line
    ]
    arguments = run_cli(*argv, "a dog", "", "runs")  # a blank argument too
    assert arguments.stdout.splitlines() == ["a dog", "", "runs"]


def test_translate_warns_of_a_sentence_longer_than_training_and_translates_it_whole(
    translator, smoke_run, run_cli, no_progress
):
    """The smoke run was trained on sentences of at most max_len ids: a longer one
    is translated whole (as the book's decode_ids translates its ids), and said to
    be; one of max_len ids is not."""
    max_len = translator.config.max_len
    fits = " ".join(["Hund"] * (max_len - 2))  # max_len ids with <s> and </s>
    long = " ".join(["Hund"] * (max_len + 8))
    argv = ["translate", "--checkpoint", str(smoke_run.out / "last.pt"), fits, long]
    result = run_cli(*argv)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"warning: sentence 2 has {max_len + 10} tokens, more than the {max_len} it "
        "trained on: its output may be short."
    ]
    whole = tat.decode_ids(translator.model, translator.encode([fits, long]))
    assert result.stdout.splitlines() == [translator.text(ids) for ids in whole]


def test_translate_shows_its_progress_on_long_input(smoke_run, monkeypatch, run_cli):
    """More than a batch of sentences (64), progress said at every chance (the
    interval set to 0): the batches done, and the words of each batch."""
    monkeypatch.setattr(translation, "PROGRESS_EVERY_S", 0.0)
    sentences = [f"Ein Hund läuft {i} Mal." for i in range(65)]
    argv = ["translate", "--checkpoint", str(smoke_run.out / "last.pt"), *sentences]
    result = run_cli(*argv)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 65
    said = result.stderr.splitlines()
    assert all(line.startswith("translating: ") for line in said), said
    assert any(line.startswith("translating: 64 of 65 sentences done") for line in said)
    assert any("sentences 1 to 64 of 65: word 1 of at most" in line for line in said)
    assert any("sentences 65 to 65 of 65: word 1 of at most" in line for line in said)
    assert said[-1].startswith("translating: 65 of 65 sentences done, ")


def test_translate_n_best_lists_the_books_beam_hypotheses_with_their_scores(
    translator, smoke_run, run_cli
):
    """--n-best 3 prints each sentence's 3 best as LINE<tab>SCORE<tab>TEXT: the
    book's own beam search's finished hypotheses for the sentence, best first
    (a beam of 3, as --n-best 3 alone asks); a blank line has none."""
    sentences = ["Ein Hund läuft.", "", "Zwei Männer spielen Fußball."]
    argv = ["translate", "--checkpoint", str(smoke_run.out / "last.pt")]
    result = run_cli(*argv, "--n-best", "3", *sentences)
    assert result.returncode == 0, result.stderr
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert [row[0] for row in rows] == ["1", "1", "1", "3", "3", "3"]
    model = translator.model
    for number in (1, 3):
        (ids,) = translator.encode([sentences[number - 1]])
        src = torch.tensor([ids])
        src_mask = tat.padding_mask(src, tat.PAD)
        max_len, ends = src.size(1) + 50, (tat.BOS, tat.EOS, 3)
        (book,) = tat.beam_search(model, src, src_mask, max_len, *ends, n_best=3)
        printed = [row[1:] for row in rows if row[0] == str(number)]
        expected = [(s, translator.text(translation._inner(i))) for i, s in book]
        assert [text for _, text in printed] == [text for _, text in expected]
        # Printed to 4 decimals (5e-5 at most off); the batch of two pads the
        # shorter sentence, which moves float32 sums of ~60 log-probabilities
        # (each below 20) by at most 60 * 20 * eps = 1.4e-4.
        tolerance = 5e-5 + 60 * 20 * torch.finfo(torch.float32).eps
        for (score, _), (book_score, _) in zip(printed, expected, strict=True):
            assert float(score) == pytest.approx(book_score, abs=tolerance)
    beam = run_cli(*argv, "--beam", "3", *sentences).stdout.splitlines()
    assert [rows[0][2], rows[3][2]] == [beam[0], beam[2]]  # the best is --beam 3's


@pytest.mark.slow
def test_translate_samples_again_what_a_seed_drew(smoke_run, run_cli, no_progress):
    """--sample without --seed draws from a fresh seed and names it; that seed
    draws the same again, and another seed something else."""
    argv = ["translate", "--checkpoint", str(smoke_run.out / "last.pt"), "--sample"]
    sentences = ["Ein Hund läuft.", "Zwei Männer spielen Fußball."] * 3
    first = run_cli(*argv, *sentences)
    assert first.returncode == 0, first.stderr
    (said,) = first.stderr.splitlines()
    seed = re.fullmatch(
        r"sampling with --seed (\d+) \(pass it to draw the same .*", said
    )
    assert seed, said
    again = run_cli(*argv, "--seed", seed.group(1), *sentences)
    assert again.stdout == first.stdout and again.stderr == ""
    other = run_cli(*argv, "--seed", str(int(seed.group(1)) + 1), *sentences)
    assert other.stdout != first.stdout
    n_best = run_cli(*argv, "--seed", "1", "--n-best", "2", "--top-k", "3", *sentences)
    rows = [line.split("\t") for line in n_best.stdout.splitlines()]
    assert [int(row[0]) for row in rows] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    scores = [float(row[1]) for row in rows]
    assert all(a >= b for a, b in zip(scores[::2], scores[1::2], strict=True))


@pytest.mark.slow
def test_keep_checkpoints_prunes_a_runs_epochs_logs_steps_and_names_what_it_saved(
    multi30k_dir, tmp_path, run_cli
):
    """--keep-checkpoints 2: of 3 epochs, the last 2 files stay; resuming may
    change it. The log has the book's step lines; the run ends naming the model it
    saved."""
    out = tmp_path / "run"
    argv = ["train", "--data-dir", str(multi30k_dir), "--out", str(out)]
    argv += ["--profile", "smoke", "--epochs", "3"]
    result = run_cli(*argv, "--keep-checkpoints", "2")
    assert result.returncode == 0, result.stderr
    assert names_in(out) == [
        *["epoch_002.pt", "epoch_003.pt", "last.pt"],
        *["vocab_src.json", "vocab_tgt.json"],
    ]
    assert (
        checkpoints.load_checkpoint(out / "last.pt")["config"]["keep_checkpoints"] == 2
    )
    steps = [line for line in result.stdout.splitlines() if "| optimizer steps" in line]
    lr = r" \| loss \(smoothed\) +\d+\.\d{4} \| lr \d\.\d\de[-+]\d\d"
    assert steps and all(re.search(lr + "$", line) for line in steps), steps
    saved, score = result.stdout.splitlines()[-2:]
    assert saved.startswith(f"saved {out / 'last.pt'} (epoch 3; this invocation ")
    assert saved.endswith(f'translate --checkpoint {out / "last.pt"} "Ein Satz."')
    evaluate = f"python -m workshop evaluate --checkpoint {out / 'last.pt'}"
    assert score == f"score it: {evaluate}"
    resumed = run_cli(*argv[:-1], "4", "--resume", "--keep-checkpoints", "1", "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert [p.name for p in checkpoints.epoch_files(out)] == ["epoch_004.pt"]
    assert resumed.stdout.startswith(f"saved {out / 'last.pt'} (epoch 4;")


def test_the_help_gives_keep_checkpoints_default_and_meaning(run_cli):
    text = " ".join(run_cli("train", "--help").stdout.split())
    keep = {
        settings.RunConfig.from_profile(p).keep_checkpoints for p in cli.PROFILE_NAMES
    }
    assert keep == {5}  # what the help says: every profile's
    assert (
        "--keep-checkpoints N keep the newest N epoch_NNN.pt files and delete older "
        "ones as each epoch ends (last.pt is always kept; default: the profile's, 5)"
    ) in text


def test_every_option_that_takes_a_value_says_its_default_in_the_help():
    """Each option of each command that takes a value and may be left out says in
    its --help what holds without it: the default argparse is given (added to the
    help by the command line's parser), or, where that is None, what None means
    (the profile's, every word, none written, ...)."""
    parser = cli.build_parser()
    silent = []
    for name in parser.command_names:
        command = parser.commands[name]
        # Read only: argparse lists a parser's options and groups no other way.
        groups = command._mutually_exclusive_groups
        one_of = [a for group in groups if group.required for a in group._group_actions]
        for action in command._actions:
            takes = action.option_strings and action.nargs != 0
            if not takes or action.required or action in one_of:
                continue
            formatter = command.formatter_class(prog=command.prog)
            formatter.add_argument(action)
            shown = " ".join(formatter.format_help().split())
            if "default" not in shown:
                silent.append(f"{name} {shown}")
    assert silent == []


def test_every_option_of_every_command_says_what_it_does(run_cli):
    """Each option's line in each --help has a description (--quiet had none)."""
    parser = cli.build_parser()
    bare = []
    for name in parser.command_names:
        lines = parser.commands[name].format_help().splitlines()
        for i, line in enumerate(lines):
            option = re.match(r"  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
            if option and not option.group(2):
                described = i + 1 < len(lines) and lines[i + 1].startswith(" " * 8)
                if not described:
                    bare.append(f"{name} {option.group(1)}")
    assert bare == []


def test_attention_draws_the_last_layers_every_head_into_runs_by_default(
    monkeypatch, tmp_path, run_cli
):
    drawn = []

    def save_attention_maps(checkpoint, sentence, out, layer, heads, **where):
        drawn.append((str(out), layer, heads))
        return []

    monkeypatch.setattr(commands, "save_attention_maps", save_attention_maps)
    monkeypatch.chdir(tmp_path)
    assert run_cli("attention", "--checkpoint", "c.pt", "Ein Hund.").returncode == 0
    assert drawn == [("runs/attention", -1, None)]
    help_text = " ".join(run_cli("attention", "--help").stdout.split())
    assert "-1: the last (default: -1)" in help_text
    assert "repeat the option for several (default: all)" in help_text


def is_ignored_by_git(path):
    """Whether git ignores `path` (relative to the checkout): a folder nothing of
    which is tracked."""
    result = subprocess.run(
        ["git", "check-ignore", "-q", "--no-index", str(path)],
        cwd=REPO_ROOT,
        check=False,
    )
    return result.returncode == 0


def test_no_command_writes_into_a_tracked_folder_by_default(monkeypatch, run_cli):
    """The folders each command writes when no option names one: each is one git
    ignores (runs/...), never images/ or results/, which hold the checkout's
    figures and results under the same names."""
    written = {}

    def recording(name):
        def record(*args, **kwargs):
            written[name] = [str(a) for a in args]
            return []  # the paths written

        return record

    for name in ("save_attention_maps", "save_figures", "reproduce"):
        monkeypatch.setattr(commands, name, recording(name))
    assert run_cli("attention", "--checkpoint", "c.pt", "Ein Hund.").returncode == 0
    assert run_cli("figures").returncode == 0
    assert run_cli("reproduce", "--profile", "quick", "--data-dir", "d").returncode == 0
    folders = {
        "attention": written["save_attention_maps"][2],
        "figures": written["save_figures"][0],
        "reproduce --out": written["reproduce"][2],
        "reproduce --results": written["reproduce"][3],
        "reproduce --images": written["reproduce"][4],
    }
    assert folders == {
        "attention": "runs/attention",
        "figures": "runs/figures",
        "reproduce --out": "runs/quick",
        "reproduce --results": "runs/quick",
        "reproduce --images": "runs/quick",
    }
    assert {name for name, f in folders.items() if not is_ignored_by_git(f)} == set()
    assert not is_ignored_by_git("images") and not is_ignored_by_git("results")
