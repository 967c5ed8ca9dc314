"""What each command of `python -m workshop` runs, once workshop/cli.py has parsed
its arguments: one function per command, each handed the parsed arguments. Unlike
cli.py, this module imports torch, the book and the rest of the workshop."""

from __future__ import annotations

import math
import secrets
import sys
from pathlib import Path

from the_annotated_transformer import (
    MULTI30K_URL,
    CopyTaskConfig,
    data_dir_from_env,
    default_data_dir,
    example_simple_model,
)
from workshop.checkpoints import average_checkpoints
from workshop.errors import UsageError
from workshop.figures import save_attention_maps, save_figures
from workshop.multi30k import download_multi30k
from workshop.reproduce import reproduce
from workshop.scoring import evaluate
from workshop.settings import RunConfig
from workshop.training import train_model
from workshop.translation import Progress, decode_options, load_translator


def run(args):
    """Run the parsed command `args`; returns the exit status."""
    return RUNNERS[args.command](args) or 0


def data_dir_of(args):
    """--data-dir, else $ANNOTATED_TRANSFORMER_DATA, else the book's default folder
    (data/multi30k in the checkout, which `make data` fills)."""
    return Path(args.data_dir or data_dir_from_env() or default_data_dir())


def numbers(text, flag, kind, example):
    """A comma-separated list of numbers from the command line, as a tuple."""
    try:
        values = tuple(kind(part) for part in text.split(","))
    except ValueError:
        values = ()
    whole = kind is int
    if not values or not all(
        value >= 1 if whole else math.isfinite(value) and value > 0 for value in values
    ):
        each = "at least 1" if whole else "a finite number above 0"
        raise UsageError(
            f"{flag} takes numbers separated by commas, each {each}, like {example}; "
            f"got {text!r}."
        )
    return values


def copy(args):
    """The book's copy task, as its example_simple_model runs it, on --device."""
    defaults = CopyTaskConfig()
    config = CopyTaskConfig(
        epochs=args.epochs or defaults.epochs,
        seed=defaults.seed if args.seed is None else args.seed,
    )
    _, exact = example_simple_model(config, quiet=args.quiet, device=args.device)
    return 0 if exact else 1


def download(args):
    download_multi30k(
        data_dir_of(args), base_url=args.base_url or MULTI30K_URL, timeout=args.timeout
    )


def train_changes(args):
    """The settings the train command's options change."""
    changes = {
        key: value
        for key, value in (
            ("epochs", args.epochs),
            ("max_tokens", args.max_tokens),
            ("accum_iter", args.accum_iter),
            ("time_limit", args.time_limit),
            ("vocab", args.vocab),
            ("bpe_vocab_size", args.bpe_vocab_size),
            ("keep_checkpoints", args.keep_checkpoints),
        )
        if value is not None
    }
    if args.bf16:
        changes["bf16"] = True
    if args.share_embeddings:
        changes["share_embeddings"] = changes["tie_generator"] = True
    if args.resume and args.profile is not None:
        changes["profile"] = args.profile  # refused unless it is the run's own
    return changes


def train(args):
    changes = train_changes(args)
    options = dict(nprocs=args.nprocs, quiet=args.quiet, device=args.device)
    if args.resume:  # the run's own settings; only RESUMABLE ones may change
        train_model(
            None, data_dir_of(args), args.out, resume=True, changes=changes, **options
        )
        return
    if args.epochs is not None:
        changes["flop_budget"] = None  # the epochs asked for, not the budget's
    config = RunConfig.from_profile(args.profile or "quick", **changes)
    train_model(config, data_dir_of(args), args.out, **options)


def sentences_to_translate(arguments):
    """The sentences given on the command line, else the lines of stdin: one
    sentence each, blank ones kept (each gets a blank line in answer)."""
    sentences = [s.strip() for s in arguments]
    if not sentences:
        if sys.stdin.isatty():
            print("German sentences, one per line; end with Ctrl-D:", file=sys.stderr)
        sentences = [line.strip() for line in sys.stdin]
    if not any(sentences):
        raise UsageError(
            "translate: no sentences given. Pass them as arguments, or one per line "
            "on standard input."
        )
    return sentences


def translate_options(args):
    """Translator.translate's decoding options for translate's arguments (a beam
    of K for --n-best K unless --beam says otherwise); a sample without --seed gets
    a fresh seed, said on stderr so that it can be drawn again."""
    seed = args.seed
    if args.sample and seed is None:
        seed = secrets.randbits(31)
        print(
            f"sampling with --seed {seed} (pass it to draw the same translations "
            "again)",
            file=sys.stderr,
        )
    beam = args.beam or (1 if args.sample else args.n_best)
    sampling = dict(temperature=args.temperature or 1.0, top_k=args.top_k)
    sampling |= dict(top_p=args.top_p, seed=seed)
    return decode_options(beam, args.alpha, sample=args.sample, **sampling)


def translate(args):
    options = translate_options(args)
    translator = load_translator(args.checkpoint, args.device)
    sentences = sentences_to_translate(args.sentences)
    found = translator.translate(
        sentences, n_best=args.n_best, progress=Progress(), **options
    )
    if args.n_best == 1:
        for line in found:
            print(line)
        return
    for number, hypotheses in enumerate(found, 1):
        for text, score in hypotheses:
            print(f"{number}\t{score:.4f}\t{text}")


def figures(args):
    save_figures(args.out, args.names)


def evaluate_command(args):
    evaluate(
        args.checkpoint,
        data_dir_of(args),
        args.split,
        args.beam,
        args.output,
        args.batch_size,
        alpha=args.alpha,
        device=args.device,
    )


def reproduce_command(args):
    out = args.out or Path("runs") / args.profile
    results = args.results or out
    reproduce(
        args.profile,
        data_dir_of(args),
        out,
        results,
        args.images or results,
        windows=numbers(args.average, "--average", int, "2,3,5"),
        beam_sizes=numbers(args.beam, "--beam", int, "4,6"),
        alphas=numbers(args.alphas, "--alphas", float, "0.6,1.0"),
        train=not args.no_train,
        limit=args.limit,
        device=args.device,
    )


def average(args):
    average_checkpoints(args.checkpoints, args.out)
    print(f"averaged {len(args.checkpoints)} checkpoints into {args.out}")


def attention(args):
    paths = save_attention_maps(
        args.checkpoint,
        args.sentence,
        args.out,
        args.layer,
        args.heads,
        device=args.device,
    )
    for path in paths:
        print(f"wrote {path}")


RUNNERS = {
    "copy": copy,
    "download": download,
    "train": train,
    "translate": translate,
    "figures": figures,
    "evaluate": evaluate_command,
    "reproduce": reproduce_command,
    "average": average,
    "attention": attention,
}
