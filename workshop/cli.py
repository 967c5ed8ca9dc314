"""The command line of `python -m workshop COMMAND`: its arguments, and how a
failure ends.

The arguments are parsed first, with the standard library alone (`--help` and a
mistyped option answer at once); torch, the book and the rest of the workshop are
imported only then, to run the command (workshop/commands.py). Every failure ends
as one line on stderr that says what was wrong, and an exit status: 2 for a
command line that cannot work, 1 for a failure while it ran, 130 when interrupted
(workshop/errors.py says which is which).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from workshop.errors import exit_status, is_expected, is_out_of_memory
from workshop.files import why_unwritable

# The book's DATA_ENV and the names of workshop.settings.TRAIN_PROFILES, in its
# order (tests/test_cli.py holds each equal to its source): named here so that the
# help is written, and a profile's name checked, without importing the book or the
# settings, and with them torch.
DATA_ENV = "ANNOTATED_TRANSFORMER_DATA"
PROFILE_NAMES = ("smoke", "quick", "multi30k", "base")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, without the usage block, and
    which takes options only as spelled in full (no abbreviations: `--beam` stays
    `--beam` when a longer option is added, and a renamed option is an error, not a
    prefix of its new name)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _number(kind, holds, what):
    """An argparse type: `kind(text)` when `holds` of it, else an error saying that
    the value must be `what` (text that is no number at all fails the same way)."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not holds(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


_positive_int = _number(int, lambda n: n >= 1, "a whole number of at least 1")
_positive_float = _number(float, lambda x: x > 0, "a number above 0")
_finite_positive = _number(
    float, lambda x: math.isfinite(x) and x > 0, "a finite number above 0"
)
_probability = _number(float, lambda p: 0 < p <= 1, "a number above 0 and at most 1")
# Beam search's length-penalty exponent.
_alpha = _number(float, lambda a: math.isfinite(a) and a >= 0, "a finite number >= 0")


def _device(text):
    """argparse type: a device this machine has ("cpu", "cuda", "cuda:1", "mps");
    torch is imported to ask, only when the option is given."""
    from workshop.distributed import parse_device

    try:
        return parse_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


DEVICE_HELP = "cpu, cuda, cuda:N or mps (default: the GPUs where there are any)"
DATA_DIR_HELP = f"the Multi30k folder (default: ${DATA_ENV}, else data/multi30k)"
PROFILE_HELP = "settings: %(choices)s"


def _add_device(command):
    command.add_argument("--device", type=_device, help=DEVICE_HELP)


def build_parser():
    """The command-line interface's argument parser."""
    parser = _Parser(
        prog="python -m workshop",
        description="The Annotated Transformer: examples and tools from the book.",
    )
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_Parser
    )
    copy_cmd = commands.add_parser("copy", help="train the copy task and show copies")
    copy_cmd.add_argument(
        "--epochs", type=_positive_int, help="(default: the book's CopyTaskConfig)"
    )
    copy_cmd.add_argument("--seed", type=int, help="(default: the book's)")
    copy_cmd.add_argument("--quiet", action="store_true", help="no per-epoch lines")
    _add_device(copy_cmd)
    download = commands.add_parser("download", help="fetch and verify Multi30k")
    download.add_argument("--data-dir", help=DATA_DIR_HELP)
    download.add_argument(
        "--base-url",
        help="the address of a folder (or a mirror) that holds the six files "
        "(default: the Multi30k project's repository)",
    )
    download.add_argument(
        "--timeout",
        type=_positive_float,
        default=60.0,
        help="seconds to wait for each answer of the server (default: 60)",
    )
    _add_train_command(commands)
    _add_translate_command(commands)
    figures = commands.add_parser("figures", help="write the book's charts as PNG")
    figures.add_argument(
        "--out",
        default="runs/figures",
        help="output folder (default: runs/figures; `make figures` writes images/)",
    )
    figures.add_argument("names", nargs="*", help="only these charts (default: all)")
    _add_results_commands(commands)
    parser.command_names = list(commands.choices)
    parser.commands = dict(commands.choices)  # each command's own parser, by name
    return parser


def _add_translate_command(commands):
    """The translate command's options."""
    trans = commands.add_parser(
        "translate",
        help="translate German sentences",
        description="Translate German sentences, one answer per sentence: each "
        "argument, or each line of standard input (a blank line gets a blank line).",
    )
    trans.add_argument("--checkpoint", required=True, help="a .pt from train")
    trans.add_argument(
        "--beam",
        type=_positive_int,
        help="beam size (default: 1, greedy; with --n-best K, K)",
    )
    trans.add_argument(
        "--alpha", type=_alpha, default=0.6, help="beam's length penalty α (0.6)"
    )
    trans.add_argument(
        "--n-best",
        type=_positive_int,
        default=1,
        metavar="K",
        help="print the K best translations of each sentence, best first, each "
        "as LINE<tab>SCORE<tab>TRANSLATION (LINE: the sentence's number, from 1; "
        "SCORE: beam search's log-probability over its length penalty, or a "
        "sample's log-probability); default 1: the translation alone",
    )
    trans.add_argument(
        "--sample",
        action="store_true",
        help="draw each word from the model's distribution instead of searching "
        "for the most likely translation (varied, less faithful)",
    )
    trans.add_argument(
        "--temperature",
        type=_finite_positive,
        help="with --sample: below 1 sharpens the distribution, above 1 "
        "flattens it (default: 1)",
    )
    trans.add_argument(
        "--top-k",
        type=_positive_int,
        metavar="K",
        help="with --sample: draw only from the K most likely words",
    )
    trans.add_argument(
        "--top-p",
        type=_probability,
        metavar="P",
        help="with --sample: draw only from the fewest most likely words that "
        "hold probability P together (0 < P <= 1)",
    )
    trans.add_argument(
        "--seed",
        type=int,
        help="with --sample: the same seed, sentences and options draw the same "
        "translations (default: a fresh seed, printed on stderr)",
    )
    _add_device(trans)
    trans.add_argument(
        "sentences", nargs="*", help="sentences (default: stdin, one per line)"
    )


def _add_train_command(commands):
    """The train command's options."""
    train = commands.add_parser("train", help="train a German->English model")
    train.add_argument("--data-dir", help=DATA_DIR_HELP)
    train.add_argument("--out", required=True, help="folder for checkpoints")
    train.add_argument(
        "--profile",
        choices=PROFILE_NAMES,
        metavar="NAME",
        help=PROFILE_HELP + " (default: quick)",
    )
    train.add_argument(
        "--resume", action="store_true", help="continue the run in --out"
    )
    train.add_argument(
        "--epochs",
        type=_positive_int,
        help="epochs to train (instead of a FLOP budget), or more to resume",
    )
    train.add_argument("--max-tokens", type=_positive_int, help="tokens per batch")
    train.add_argument("--accum-iter", type=_positive_int, help="micro-batches a step")
    train.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    train.add_argument(
        "--time-limit",
        type=_positive_float,
        help="minutes this invocation may train: it starts no epoch that would end "
        "later (a guard of this invocation alone: --resume trains to the end "
        "without one)",
    )
    train.add_argument(
        "--vocab", choices=("word", "bpe"), help="words (default) or joint subwords"
    )
    train.add_argument(
        "--bpe-vocab-size", type=_positive_int, help="subword vocabulary size"
    )
    train.add_argument(
        "--share-embeddings",
        action="store_true",
        help="one matrix for both embeddings and the output (needs --vocab bpe)",
    )
    train.add_argument(
        "--keep-checkpoints",
        type=_positive_int,
        metavar="N",
        help="keep the newest N epoch_NNN.pt files and delete older ones as each "
        "epoch ends (last.pt is always kept; default: the profile's, 5)",
    )
    train.add_argument(
        "--nprocs", type=_positive_int, default=1, help="spawn K processes"
    )
    _add_device(train)
    train.add_argument(
        "--quiet",
        action="store_true",
        help="no progress lines (warnings, errors and the path saved still show)",
    )


def _add_results_commands(commands):
    """The evaluate, reproduce, average and attention commands (Part 5 and the
    results)."""
    evaluate_cmd = commands.add_parser("evaluate", help="BLEU of a checkpoint")
    evaluate_cmd.add_argument("--checkpoint", required=True, help="a .pt from train")
    evaluate_cmd.add_argument("--data-dir", help=DATA_DIR_HELP)
    evaluate_cmd.add_argument(
        "--split", default="test_2016_flickr", help="NAME of NAME.de.gz, NAME.en.gz"
    )
    evaluate_cmd.add_argument(
        "--beam", type=_positive_int, default=1, help="1: greedy (default)"
    )
    evaluate_cmd.add_argument("--output", help="write the translations to this file")
    evaluate_cmd.add_argument(
        "--batch-size",
        type=_positive_int,
        default=64,
        help="sentences translated at once (64)",
    )
    evaluate_cmd.add_argument("--alpha", type=_alpha, default=0.6, help="beam's α")
    _add_device(evaluate_cmd)
    repro = commands.add_parser(
        "reproduce", help="train, average, choose on val, score test: a Results row"
    )
    repro.add_argument(
        "--profile",
        default="multi30k",
        choices=PROFILE_NAMES,
        metavar="NAME",
        help=PROFILE_HELP + " (default: multi30k)",
    )
    repro.add_argument("--data-dir", help=DATA_DIR_HELP)
    repro.add_argument("--out", help="checkpoint folder (default runs/PROFILE)")
    repro.add_argument(
        "--results",
        help="folder for PROFILE.json and .md (default: the --out folder; `make "
        "results-PROFILE` writes results/; never results/ with --limit, whose "
        "scores are no results)",
    )
    repro.add_argument(
        "--images",
        help="folder for the training curve (default: the --results folder; `make "
        "results-PROFILE` writes images/)",
    )
    repro.add_argument(
        "--average",
        default="2,3,4,5",
        help="averages of the last K epochs to try on val",
    )
    repro.add_argument("--beam", default="4,6", help="beam sizes to try on val")
    repro.add_argument(
        "--alphas",
        default="0.6,1.0,1.5,2.0,2.5,3.0",
        help="length-penalty exponents to try on val",
    )
    repro.add_argument(
        "--limit", type=_positive_int, help="score only the first N sentences"
    )
    repro.add_argument(
        "--no-train", action="store_true", help="report on the run already in --out"
    )
    _add_device(repro)
    average_cmd = commands.add_parser("average", help="average checkpoints of a run")
    average_cmd.add_argument("checkpoints", nargs="+", help="epoch_NNN.pt files")
    average_cmd.add_argument("--out", required=True, help="the averaged checkpoint")
    attention = commands.add_parser("attention", help="draw attention maps as PNG")
    attention.add_argument("--checkpoint", required=True, help="a .pt from train")
    attention.add_argument(
        "--out",
        default="runs/attention",
        help="output folder (default: runs/attention)",
    )
    attention.add_argument(
        "--layer",
        type=int,
        default=-1,
        help="the layer to draw, counted from 0; -1, the default, is the last",
    )
    attention.add_argument(
        "--head",
        type=int,
        action="append",
        dest="heads",
        metavar="H",
        help="a head to draw, counted from 0; repeat the option for several "
        "(default: every head)",
    )
    _add_device(attention)
    attention.add_argument("sentence", help="a German sentence")


# The paths each command writes, by option: (the attribute, whether it names a
# folder). Each is checked before any work (check_combinations).
WRITTEN = {
    "train": [("out", True)],
    "evaluate": [("output", False)],
    "reproduce": [("out", True), ("results", True), ("images", True)],
    "average": [("out", False)],
    "attention": [("out", True)],
    "figures": [("out", True)],
}


def check_combinations(parser, args):
    """Refuse, as argparse refuses a bad option, combinations of options that
    cannot work together, and a path the command would fail to write at its end."""
    if args.command == "translate":
        check_translate_options(parser, args)
    for name, folder in WRITTEN.get(args.command, ()):
        path = getattr(args, name)
        reason = None if path is None else why_unwritable(path, folder)
        if reason:
            kind = "a folder" if folder else "a file"
            parser.error(
                f"{args.command} --{name} {path}: {reason}, so it cannot be written "
                f"as {kind}; name another"
            )


# translate's options that take effect only with --sample.
SAMPLING = ("temperature", "top_k", "top_p", "seed")


def check_translate_options(parser, args):
    """Refuse translate's options that do not go together: sampling's without
    --sample, --sample with a beam, and --n-best beyond the beam asked for."""
    flag = {name: "--" + name.replace("_", "-") for name in SAMPLING}
    given = [flag[name] for name in SAMPLING if getattr(args, name) is not None]
    if given and not args.sample:
        parser.error(
            f"translate {' '.join(given)}: sampling's options take effect only with "
            "--sample; add it, or drop them"
        )
    if args.sample and args.beam is not None and args.beam > 1:
        parser.error(
            f"translate --sample draws each word and --beam {args.beam} searches: "
            "choose one"
        )
    beam = args.beam or 1
    if not args.sample and args.beam is not None and args.n_best > beam:
        parser.error(
            f"translate --n-best {args.n_best} needs a beam of at least "
            f"{args.n_best}: raise --beam {args.beam} or drop it (--n-best K "
            "alone searches with a beam of K)"
        )


# What to lower, per command, when the device runs out of memory.
OUT_OF_MEMORY_ADVICE = {
    "train": "lower --max-tokens (raise --accum-iter to keep the tokens of each "
    "step), or train on another --device",
    "reproduce": "train the run with `train --max-tokens N --accum-iter K`, then "
    "report on it with `reproduce --no-train`, or use another --device",
    "evaluate": "lower --batch-size or --beam, or use another --device",
    "translate": "translate fewer or shorter sentences at once, lower --beam, or "
    "use another --device",
    "attention": "use a shorter sentence, or another --device",
}


def main(argv=None):
    """Entry point of `python -m workshop ...`; returns the exit status.

    Every failure ends as one line on stderr that says what was wrong (set
    ANNOTATED_TRANSFORMER_DEBUG=1 to see the traceback instead).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        names = ", ".join(parser.command_names)
        parser.error(f"name a command: {names}")
    check_combinations(parser, args)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # progress shows up in log files, and a
            # console that cannot show a character (say, α) gets an escape instead
            stream.reconfigure(line_buffering=True, errors="backslashreplace")
    try:
        from workshop import commands  # torch, the book and the workshop

        return commands.run(args)
    except KeyboardInterrupt as error:
        saves = args.command in ("train", "reproduce")
        note = "; finished epochs are saved in --out" if saves else ""
        print(f"interrupted{note}", file=sys.stderr)
        return exit_status(error)
    except BrokenPipeError:  # the reader left (`... | head -1`): stop quietly
        _quiet_stdout()
        return 0
    except Exception as error:
        if os.environ.get("ANNOTATED_TRANSFORMER_DEBUG"):
            raise
        print(f"error: {_one_line(error, args.command)}", file=sys.stderr)
        return exit_status(error)


def _quiet_stdout():
    """Point stdout at devnull, so that flushing it at exit raises nothing more."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real file (say, captured)
        pass


def _one_line(error, command):
    """An exception as one line: what to do for an out-of-memory error, the message
    of an expected one, and its type too for an unexpected one."""
    text = " ".join(str(error).split()) or type(error).__name__
    if is_out_of_memory(error):
        advice = OUT_OF_MEMORY_ADVICE.get(command, "use another --device")
        what = ". ".join(text.split(". ")[:3]).rstrip(".")  # what, how much, room
        return f"out of memory ({what}): {advice}."
    if is_expected(error):  # the message says it all
        return text
    return (
        f"{type(error).__name__}: {text} (unexpected: set "
        "ANNOTATED_TRANSFORMER_DEBUG=1 for the traceback and report it)"
    )
