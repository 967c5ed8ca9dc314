"""The command line of `python -m workshop COMMAND`: its arguments, and how a
failure ends.

The arguments are parsed first, with the standard library alone (`--help` and a
mistyped option answer at once); torch, the book and the rest of the workshop are
imported only then, to run the command (workshop/commands.py). Every failure ends
as one line on stderr, `error: ` and what was wrong, and an exit status: 2 for a
command line that cannot work, 1 for a failure while it ran, 130 when interrupted
(workshop/errors.py says which is which).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

from workshop.errors import exit_status, is_expected, is_out_of_memory
from workshop.files import why_unwritable

# The book's DATA_ENV and the names of workshop.run.settings.TRAIN_PROFILES, in its
# order (tests/test_workshop_cli.py holds each equal to its source): named here so
# that the help is written, and a profile's name checked, without importing torch.
DATA_ENV = "ANNOTATED_TRANSFORMER_DATA"
PROFILE_NAMES = ("smoke", "quick", "multi30k", "base")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, without the usage block, and
    which takes options only as spelled in full (no abbreviations: a renamed option
    is an error, not a prefix of its new name). Each option's help shows its
    default, where it has one its help does not already name."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def add_argument(self, *args, **kwargs):
        help, default = kwargs.get("help"), kwargs.get("default")
        if (
            help
            and default not in (None, False, argparse.SUPPRESS)
            and "default" not in help
        ):
            kwargs["help"] = f"{help} (default: %(default)s)"
        return super().add_argument(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _number(kind, holds, what, many=False):
    """An argparse type: a number kind(text) for which holds(number) (many=True: a
    tuple of them, separated by commas), else an error saying it must be `what`."""
    what = f"numbers separated by commas, each {what}" if many else what

    def parse(text):
        try:
            values = tuple(kind(part) for part in (text.split(",") if many else [text]))
        except ValueError:
            values = (math.nan,)
        if not all(holds(value) for value in values):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return values if many else values[0]

    return parse


def _device(text):
    """An argparse type: a device this machine has ("cpu", "cuda", "cuda:1", "mps");
    torch is imported to ask, only when the option is given."""
    from workshop.run.distributed import parse_device

    try:
        return parse_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _writable(folder):
    """An argparse type: a path this user can write as a folder (or a file), checked
    before any work, so that a long command does not fail at its end."""

    def parse(text):
        if reason := why_unwritable(text, folder):
            kind = "a folder" if folder else "a file"
            why = f"{reason}, so it cannot be written as {kind}; name another"
            raise argparse.ArgumentTypeError(why)
        return text

    return parse


ONE, NO_LESS = (lambda n: n >= 1), (lambda a: math.isfinite(a) and a >= 0)
COUNT = _number(int, ONE, "a whole number of at least 1")
COUNTS = _number(int, ONE, "a whole number of at least 1", many=True)
ALPHA, ALPHAS = (_number(float, NO_LESS, "a finite number >= 0", m) for m in (0, 1))
POSITIVE = _number(float, lambda x: x > 0, "a number above 0")
FINITE = _number(float, lambda x: math.isfinite(x) and x > 0, "a finite number above 0")
PROBABILITY = _number(float, lambda p: 0 < p <= 1, "a number above 0 and at most 1")
FOLDER, FILE = _writable(True), _writable(False)
DATA_DIR = f"the Multi30k folder (default: ${DATA_ENV}, else data/multi30k)"
DEVICE_HELP = "cpu, cuda, cuda:N or mps (default: the GPUs, if any)"
PRETRAINED_HELP = "a published Marian model instead of a checkpoint: its Hugging Face "
PRETRAINED_HELP += "hub name (Helsinki-NLP/opus-mt-de-en) or a folder of its files"
ALPHA_HELP = "beam search's length penalty α, with a beam of at least 2 (default: 0.6)"
PROFILES = "(default: the profile's; resuming, the run's)"


def _command(commands, name, help, *common, **kwargs):
    """A command's parser, with the `common` options: data, device, checkpoint,
    pretrained (a checkpoint or a published model); returns its add_argument."""
    parser = commands.add_parser(name, help=help, **kwargs)
    add = parser.add_argument
    if "checkpoint" in common:
        add("--checkpoint", required=True, help="a .pt from train")
    if "pretrained" in common:  # a checkpoint, or a published model instead
        model = parser.add_mutually_exclusive_group(required=True)
        model.add_argument("--checkpoint", help="a .pt from train")
        model.add_argument("--pretrained", metavar="NAME", help=PRETRAINED_HELP)
    if "data" in common:
        add("--data-dir", help=DATA_DIR)
    if "device" in common:
        add("--device", type=_device, help=DEVICE_HELP)
    return add


def build_parser():
    """The command-line interface's argument parser."""
    parser = _Parser(
        prog="python -m workshop",
        description="The Annotated Transformer: examples and tools from the book.",
    )
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_Parser
    )
    add = _command(commands, "copy", "train the copy task and show copies", "device")
    add("--epochs", type=COUNT, help="epochs (default: the book's CopyTaskConfig)")
    add("--seed", type=int, help="the random seed (default: the book's)")
    add("--quiet", action="store_true", help="no per-epoch lines")
    add = _command(commands, "download", "fetch and verify Multi30k", "data")
    add("--base-url", help="a folder holding the six files (default: Multi30k's)")
    add("--timeout", type=POSITIVE, default=60.0, help="seconds to wait for an answer")
    add = _command(commands, "train", "train a German->English model", "data", "device")
    add("--out", type=FOLDER, required=True, help="folder for checkpoints")
    profile = "settings: %(choices)s (default: quick)"
    add("--profile", choices=PROFILE_NAMES, metavar="NAME", help=profile)
    add("--resume", action="store_true", help="continue the run in --out")
    epochs = "epochs to train (instead of a FLOP budget), or more to resume"
    add("--epochs", type=COUNT, help=f"{epochs} {PROFILES}")
    add("--max-tokens", type=COUNT, help=f"tokens per batch {PROFILES}")
    add("--accum-iter", type=COUNT, help=f"micro-batches a step {PROFILES}")
    precision = "fp32, bf16 (autocast) or auto: bf16 where the hardware reports it "
    precision += "(default: the profile's, auto)"
    add("--precision", choices=("fp32", "bf16", "auto"), help=precision)
    bf16 = dict(action="store_const", const="bf16", dest="precision")
    add("--bf16", **bf16, help="the same as --precision bf16")
    limit = "minutes this invocation may train: it starts no epoch that would end "
    limit += "later (default: the profile's, none but multi30k's 90; resuming, none)"
    add("--time-limit", type=POSITIVE, help=limit)
    vocab = "words, or joint subwords (default: the profile's, word but multi30k's "
    add("--vocab", choices=("word", "bpe"), help=vocab + "bpe; resuming, the run's)")
    add("--bpe-vocab-size", type=COUNT, help=f"subword vocabulary size {PROFILES}")
    share = "one matrix for both embeddings and the output (needs --vocab bpe)"
    add("--share-embeddings", action="store_true", help=share)
    keep = "keep the newest N epoch_NNN.pt files and delete older ones as each epoch "
    keep += "ends (last.pt is always kept; default: the profile's, 5)"
    add("--keep-checkpoints", type=COUNT, metavar="N", help=keep)
    add("--nprocs", type=COUNT, default=1, help="spawn K processes")
    quiet = "no progress lines (warnings, errors and the path saved still show)"
    add("--quiet", action="store_true", help=quiet)
    what = "Translate German sentences, one answer per sentence: each argument, or "
    what += "each line of standard input (a blank line gets a blank line)."
    common, name = ("pretrained", "device"), "translate German sentences"
    add = _command(commands, "translate", name, *common, description=what)
    add("--beam", type=COUNT, help="beam size (default: 1, greedy; with --n-best K, K)")
    add("--alpha", type=ALPHA, help=ALPHA_HELP)
    n_best = "print each sentence's K best, best first, as LINE<tab>SCORE<tab>TEXT "
    n_best += "(SCORE: the search's log-probability); 1: the translation alone"
    add("--n-best", type=COUNT, default=1, metavar="K", help=n_best)
    sample = "draw each word from the model's distribution, not the likeliest"
    add("--sample", action="store_true", help=sample)
    t = "with --sample: below 1 sharpens the distribution, above 1 flattens it"
    add("--temperature", type=FINITE, default=1.0, help=t)
    only = "with --sample: draw only from the"
    k = f"{only} K most likely words (default: every word)"
    add("--top-k", type=COUNT, metavar="K", help=k)
    p = f"{only} fewest most likely words that hold probability P together "
    p += "(default: 1, every word)"
    add("--top-p", type=PROBABILITY, metavar="P", help=p)
    seed = "with --sample: the same seed draws the same again (default: a fresh one)"
    add("--seed", type=int, help=seed)
    add("sentences", nargs="*", help="sentences (default: stdin, one per line)")
    add = _command(commands, "figures", "write the book's figures as PNG")
    add("--out", type=FOLDER, default="runs/figures", help="output folder")
    add("names", nargs="*", help="only these figures (default: all)")
    common = ("pretrained", "data", "device")
    add = _command(commands, "evaluate", "BLEU of a model", *common)
    add("--split", default="test_2016_flickr", help="NAME of NAME.de.gz, NAME.en.gz")
    add("--beam", type=COUNT, default=1, help="beam size (1: greedy)")
    output = "write the translations to this file (default: none written)"
    add("--output", type=FILE, help=output)
    add("--batch-size", type=COUNT, default=64, help="sentences translated at once")
    add("--alpha", type=ALPHA, help=ALPHA_HELP)
    repro = "train, average, choose on val, score test: a Results row"
    add = _command(commands, "reproduce", repro, "data", "device")
    profile = dict(choices=PROFILE_NAMES, metavar="NAME", help="settings: %(choices)s")
    add("--profile", default="multi30k", **profile)
    add("--out", type=FOLDER, help="checkpoint folder (default runs/PROFILE)")
    results = "folder for PROFILE.json and .md (default: the --out folder; never "
    add("--results", type=FOLDER, help=results + "results/ with --limit)")
    images = "folder for the training curve (default: the --results folder)"
    add("--images", type=FOLDER, help=images)
    add("--average", type=COUNTS, default="2,3,4,5", help="averages of last K epochs")
    add("--beam", type=COUNTS, default="4,6", help="beam sizes to try on val")
    add("--alphas", type=ALPHAS, default="0.6,1,1.5,2,2.5,3", help="α's to try on val")
    limit = "score only the first N sentences of each split (default: all)"
    add("--limit", type=COUNT, help=limit)
    add("--no-train", action="store_true", help="report on the run already in --out")
    add = _command(commands, "average", "average checkpoints of a run")
    add("checkpoints", nargs="+", help="epoch_NNN.pt files")
    add("--out", type=FILE, required=True, help="the averaged checkpoint")
    add = _command(commands, "attention", "draw attention maps", "checkpoint", "device")
    add("--out", type=FOLDER, default="runs/attention", help="output folder")
    add("--layer", type=int, default=-1, help="the layer to draw, from 0; -1: the last")
    heads = "a head to draw, from 0; repeat the option for several (default: all)"
    add("--head", type=int, action="append", dest="heads", metavar="H", help=heads)
    add("sentence", help="a German sentence")
    parser.commands = dict(commands.choices)  # each command's own parser, by name
    parser.command_names = list(parser.commands)
    return parser


TRAINING = ("train", "reproduce")  # the commands that save epochs as they go
OWN_MODULES = ("workshop", "the_annotated_transformer", "tools")  # not requirements
# What to lower, per command, when the device runs out of memory.
OUT_OF_MEMORY_ADVICE = {
    "train": "lower --max-tokens (and raise --accum-iter), or ",
    "reproduce": "train with a lower --max-tokens, then reproduce --no-train, or ",
    "evaluate": "lower --batch-size or --beam, or ",
    "translate": "translate fewer or shorter sentences at once, lower --beam, or ",
    "attention": "use a shorter sentence, or ",
}


def main(argv=None):
    """Entry point of `python -m workshop ...`; returns the exit status.

    Every failure ends as one line on stderr that says what was wrong (set
    ANNOTATED_TRANSFORMER_DEBUG=1 to see the traceback instead).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error(f"name a command: {', '.join(parser.commands)}")
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # progress shows up in log files, and a
            # console that cannot show a character (say, α) gets an escape instead
            stream.reconfigure(line_buffering=True, errors="backslashreplace")
    try:
        from workshop import commands  # torch, the book and the workshop

        return commands.run(args)
    except KeyboardInterrupt as error:
        saved = "; finished epochs are saved in --out" * (args.command in TRAINING)
        print(f"interrupted{saved}", file=sys.stderr)
        return exit_status(error)
    except BrokenPipeError:  # the reader left (`... | head -1`): stop quietly,
        # stdout to devnull, so that flushing it at exit raises nothing more (unless
        # it is no real file: captured, say)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as error:
        if os.environ.get("ANNOTATED_TRANSFORMER_DEBUG"):
            raise
        print(f"error: {_one_line(error, args.command)}", file=sys.stderr)
        return exit_status(error)


def _one_line(error, command):
    """An exception as one line: which Python to use for a package it lacks (torch,
    when run outside the project's environment), what to do for an out-of-memory
    error, the message of an expected one, and its type too for an unexpected one."""
    text = " ".join(str(error).split()) or type(error).__name__
    missing = isinstance(error, ModuleNotFoundError) and (error.name or "")
    missing = missing and missing.split(".")[0]  # the package
    if missing and missing not in OWN_MODULES:  # run by another Python than .venv's
        venv = ".venv/bin/python -m workshop (after `make setup`)"
        pip = f"{sys.executable} -m pip install -r requirements.txt"
        where = f"{missing} is not installed for {sys.executable}: run {venv}"
        return f"{where}, or install the project's requirements: {pip}"
    if is_out_of_memory(error):
        advice = OUT_OF_MEMORY_ADVICE.get(command, "")
        what = ". ".join(text.split(". ")[:3]).rstrip(".")  # what, how much, room
        return f"out of memory ({what}): {advice}use another --device."
    if is_expected(error):  # the message says it all
        return text
    debug = "set ANNOTATED_TRANSFORMER_DEBUG=1 for the traceback and report it"
    return f"{type(error).__name__}: {text} (unexpected: {debug})"
