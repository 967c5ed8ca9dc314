"""The command line of `python -m workshop COMMAND`.

Every failure ends as one line on stderr that says what was wrong, and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from the_annotated_transformer import (
    DATA_ENV,
    MULTI30K_URL,
    CopyTaskConfig,
    data_dir_from_env,
    default_data_dir,
    example_simple_model,
)
from workshop.checkpoints import average_checkpoints
from workshop.figures import save_attention_maps, save_figures
from workshop.multi30k import DataError, download_multi30k
from workshop.processes import parse_device
from workshop.results import evaluate, reproduce
from workshop.run_folders import resume_config
from workshop.settings import TRAIN_PROFILES, RunConfig
from workshop.training import train_model
from workshop.translation import decode_options, load_translator


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, without the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text):
    """argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of at least 1, got {text!r}"
        )
    return value


def _device(text):
    """argparse type: a device this machine has ("cpu", "cuda", "cuda:1")."""
    try:
        return parse_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


DEVICE_HELP = "cpu, cuda or cuda:N (default: the GPUs where there are any)"


def _numbers(text, flag, kind, example):
    """A comma-separated list of numbers from the command line, as a tuple."""
    try:
        values = tuple(kind(part) for part in text.split(","))
    except ValueError:
        values = ()
    whole = kind is int
    if not values or any(value < 1 if whole else value <= 0 for value in values):
        each = "at least 1" if whole else "above 0"
        raise ValueError(
            f"{flag} takes numbers separated by commas, each {each}, like {example}; "
            f"got {text!r}."
        )
    return values


DATA_DIR_HELP = f"the Multi30k folder (default: ${DATA_ENV}, else data/multi30k)"


def data_dir_of(args):
    """--data-dir, else $ANNOTATED_TRANSFORMER_DATA, else the book's default folder
    (data/multi30k in the checkout, which `make data` fills)."""
    return Path(args.data_dir or data_dir_from_env() or default_data_dir())


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
    copy_cmd.add_argument("--epochs", type=_positive_int, default=CopyTaskConfig.epochs)
    copy_cmd.add_argument("--seed", type=int, default=CopyTaskConfig.seed)
    copy_cmd.add_argument("--quiet", action="store_true", help="no per-epoch lines")
    download = commands.add_parser("download", help="fetch and verify Multi30k")
    download.add_argument("--data-dir", help=DATA_DIR_HELP)
    download.add_argument(
        "--base-url",
        default=MULTI30K_URL,
        help="the address of a folder (or a mirror) that holds the six files "
        "(default: the Multi30k project's repository)",
    )
    train = commands.add_parser("train", help="train a German->English model")
    train.add_argument("--data-dir", help=DATA_DIR_HELP)
    train.add_argument("--out", required=True, help="folder for checkpoints")
    train.add_argument(
        "--profile", choices=sorted(TRAIN_PROFILES), help="settings (default: quick)"
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
        "--time-limit", type=float, help="minutes: start no epoch that would end later"
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
        "--nprocs", type=_positive_int, default=1, help="spawn K processes"
    )
    train.add_argument("--device", type=_device, help=DEVICE_HELP)
    train.add_argument("--quiet", action="store_true")
    trans = commands.add_parser("translate", help="translate German sentences")
    trans.add_argument("--checkpoint", required=True, help="a .pt from train")
    trans.add_argument("--device", type=_device, help=DEVICE_HELP)
    trans.add_argument("sentences", nargs="*", help="sentences (default: stdin)")
    figures = commands.add_parser("figures", help="write the book's charts as PNG")
    figures.add_argument("--out", default="images", help="output folder (images/)")
    figures.add_argument("names", nargs="*", help="only these charts (default: all)")
    _add_results_commands(commands)
    parser.command_names = list(commands.choices)
    return parser


def _add_results_commands(commands):
    """The evaluate, average and attention commands (Part 5 and the results)."""
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
    evaluate_cmd.add_argument("--batch-size", type=_positive_int, default=64)
    evaluate_cmd.add_argument("--alpha", type=float, default=0.6, help="beam's α")
    repro = commands.add_parser(
        "reproduce", help="train, average, choose on val, score test: a Results row"
    )
    repro.add_argument("--profile", default="multi30k", choices=sorted(TRAIN_PROFILES))
    repro.add_argument("--data-dir", help=DATA_DIR_HELP)
    repro.add_argument("--out", help="checkpoint folder (default runs/PROFILE)")
    repro.add_argument("--results", default="results", help="for PROFILE.json, .md")
    repro.add_argument("--images", default="images", help="for the training curve")
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
    average_cmd = commands.add_parser("average", help="average checkpoints of a run")
    average_cmd.add_argument("checkpoints", nargs="+", help="epoch_NNN.pt files")
    average_cmd.add_argument("--out", required=True, help="the averaged checkpoint")
    attention = commands.add_parser("attention", help="draw attention maps as PNG")
    attention.add_argument("--checkpoint", required=True, help="a .pt from train")
    attention.add_argument("--out", default="images", help="output folder (images/)")
    attention.add_argument("--layer", type=int, default=0, help="-1: the last")
    attention.add_argument(
        "--head", type=int, action="append", dest="heads", metavar="H", help="repeat"
    )
    attention.add_argument("sentence", help="a German sentence")


def main(argv=None):
    """Entry point of `python -m workshop ...`.

    Every failure ends as one line on stderr that says what was wrong, and exit
    status 2 (set ANNOTATED_TRANSFORMER_DEBUG=1 to see the traceback instead).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        names = ", ".join(parser.command_names)
        parser.error(f"name a command: {names}")
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # progress shows up in log files, and a
            # console that cannot show a character (say, α) gets an escape instead
            stream.reconfigure(line_buffering=True, errors="backslashreplace")
    try:
        return _run_command(args)
    except KeyboardInterrupt:
        saves = args.command in ("train", "reproduce")
        note = "; finished epochs are saved in --out" if saves else ""
        print(f"interrupted{note}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`... | head -1`): stop quietly
        _quiet_stdout()
        return 0
    except Exception as error:
        if os.environ.get("ANNOTATED_TRANSFORMER_DEBUG"):
            raise
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 2


def _quiet_stdout():
    """Point stdout at devnull, so that flushing it at exit raises nothing more."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real file (say, captured)
        pass


def _one_line(error):
    """An exception as one line: its message, or its type for an unexpected one."""
    expected = (ValueError, OSError, DataError)
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, expected):
        return text
    return (
        f"{type(error).__name__}: {text} (unexpected: set "
        "ANNOTATED_TRANSFORMER_DEBUG=1 for the traceback and report it)"
    )


def _run_command(args):
    """Run the parsed command; returns the exit status."""
    if args.command == "copy":
        config = CopyTaskConfig(epochs=args.epochs, seed=args.seed)
        _, exact = example_simple_model(config, quiet=args.quiet)
        return 0 if exact else 1
    if args.command == "figures":
        save_figures(args.out, args.names)
    elif args.command == "download":
        download_multi30k(data_dir_of(args), base_url=args.base_url)
    elif args.command == "train":
        overrides = {
            key: value
            for key, value in (
                ("epochs", args.epochs),
                ("max_tokens", args.max_tokens),
                ("accum_iter", args.accum_iter),
                ("time_limit", args.time_limit),
            )
            if value is not None
        }
        if args.bf16:
            overrides["bf16"] = True
        if args.vocab is not None:
            overrides["vocab"] = args.vocab
        if args.bpe_vocab_size is not None:
            overrides["bpe_vocab_size"] = args.bpe_vocab_size
        if args.share_embeddings:
            overrides["share_embeddings"] = overrides["tie_generator"] = True
        if args.epochs is not None and not args.resume:
            overrides["flop_budget"] = None  # the epochs asked for, not the budget's
        if args.resume:  # the run's own settings; only --epochs may grow
            if args.profile is not None:
                overrides["profile"] = args.profile
            config = resume_config(args.out, **overrides)
        else:
            config = RunConfig.from_profile(args.profile or "quick", **overrides)
        train_model(
            config,
            data_dir_of(args),
            args.out,
            resume=args.resume,
            nprocs=args.nprocs,
            quiet=args.quiet,
            device=args.device,
        )
    elif args.command == "translate":
        translator = load_translator(args.checkpoint, args.device)
        sentences = _sentences_to_translate(args.sentences)
        for line in translator.translate(sentences, **decode_options()):
            print(line)
    elif args.command in ("evaluate", "average", "attention", "reproduce"):
        _run_results_command(args)
    return 0


def _sentences_to_translate(arguments):
    """The sentences given on the command line, else those read from stdin."""
    sentences = [s.strip() for s in arguments if s.strip()]
    if not sentences:
        if sys.stdin.isatty():
            print("German sentences, one per line; end with Ctrl-D:", file=sys.stderr)
        sentences = [line.strip() for line in sys.stdin if line.strip()]
    if not sentences:
        raise ValueError(
            "translate: no sentences given. Pass them as arguments, or one per line "
            "on standard input."
        )
    return sentences


def _run_results_command(args):
    """Run the evaluate, average, attention or reproduce command."""
    if args.command == "evaluate":
        split, beam, output = args.split, args.beam, args.output
        evaluate(
            args.checkpoint,
            data_dir_of(args),
            split,
            beam,
            output,
            args.batch_size,
            alpha=args.alpha,
        )
    elif args.command == "reproduce":
        reproduce(
            args.profile,
            data_dir_of(args),
            args.out or Path("runs") / args.profile,
            args.results,
            args.images,
            windows=_numbers(args.average, "--average", int, "2,3,5"),
            beam_sizes=_numbers(args.beam, "--beam", int, "4,6"),
            alphas=_numbers(args.alphas, "--alphas", float, "0.6,1.0"),
            train=not args.no_train,
            limit=args.limit,
        )
    elif args.command == "average":
        average_checkpoints(args.checkpoints, args.out)
        print(f"averaged {len(args.checkpoints)} checkpoints into {args.out}")
    else:
        paths = save_attention_maps(
            args.checkpoint, args.sentence, args.out, args.layer, args.heads
        )
        for path in paths:
            print(f"wrote {path}")
