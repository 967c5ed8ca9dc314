"""What each command of `python -m workshop` runs, once workshop/cli.py has parsed
its arguments: one function per command, each handed the parsed arguments. Unlike
cli.py, this module imports torch, the book and the rest of the workshop."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import the_annotated_transformer as tat
from workshop.errors import require
from workshop.multi30k import download_multi30k
from workshop.report.figures import save_attention_maps, save_figures
from workshop.report.reproduce import reproduce
from workshop.run.checkpoints import average_checkpoints
from workshop.run.settings import RunConfig
from workshop.run.training import train_model
from workshop.translate import translation
from workshop.translate.scoring import evaluate
from workshop.translate.translation import load_translator


def run(args):
    """Run the parsed command `args`; returns the exit status."""
    return RUNNERS[args.command](args) or 0


def data_dir_of(args):
    """--data-dir, else $ANNOTATED_TRANSFORMER_DATA, else the book's default folder
    (data/multi30k in the checkout, which `make data` fills)."""
    return Path(args.data_dir or tat.data_dir_from_env() or tat.default_data_dir())


def copy(args):
    """The book's copy task, as its example_simple_model runs it, on --device."""
    given = dict(epochs=args.epochs, seed=args.seed)
    config = tat.CopyTaskConfig(**{k: v for k, v in given.items() if v is not None})
    _, exact = tat.example_simple_model(config, quiet=args.quiet, device=args.device)
    return 0 if exact else 1


def download(args):
    url, data_dir = args.base_url or tat.MULTI30K_URL, data_dir_of(args)
    download_multi30k(data_dir, base_url=url, timeout=args.timeout)


def train_changes(args):
    """The settings the train command's options change."""
    names = "epochs max_tokens accum_iter precision time_limit vocab bpe_vocab_size"
    names = (*names.split(), "keep_checkpoints")
    changes = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.share_embeddings:
        changes["share_embeddings"] = changes["tie_generator"] = True
    if args.resume and args.profile is not None:
        changes["profile"] = args.profile  # refused unless it is the run's own
    return changes


def train(args):
    if args.share_embeddings and not args.resume:  # a resumed run keeps its own
        vocab = args.vocab or RunConfig.from_profile(args.profile or "quick").vocab
        bpe = "--share-embeddings needs --vocab bpe (one vocabulary for both "
        require(vocab == "bpe", bpe + f"languages); this run's would be {vocab}.")
    changes, options = train_changes(args), vars(args)
    options = {k: options[k] for k in ("nprocs", "quiet", "device")}
    config = None  # resuming: the run's own settings; only RESUMABLE ones change
    if args.resume:
        options.update(resume=True, changes=changes)
    else:
        if args.epochs is not None:
            changes["flop_budget"] = None  # the epochs asked for, not the budget's
        config = RunConfig.from_profile(args.profile or "quick", **changes)
    train_model(config, data_dir_of(args), args.out, **options)


def sentences_to_translate(arguments):
    """The sentences given on the command line, else the lines of stdin: one
    sentence each, blank ones kept (each gets a blank line in answer)."""
    if not arguments and sys.stdin.isatty():
        print("German sentences, one per line; end with Ctrl-D:", file=sys.stderr)
    sentences = [s.strip() for s in arguments or sys.stdin]
    no = "no sentences given: pass them as arguments, or one per line on "
    require(any(sentences), no + "standard input.")
    return sentences


def translate_options(args):
    """Translator.translate's decoding options for translate's arguments (a beam
    of K for --n-best K unless --beam says otherwise); a sample without --seed gets
    a fresh seed, said on stderr so that it can be drawn again."""
    beam = args.beam or (1 if args.sample else args.n_best)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    sampling |= dict(sample=args.sample, seed=args.seed, flags=True)
    options = translation.decode_options(beam, args.alpha, **sampling)
    translation.check_n_best(args.n_best, options, flags=True)
    if args.sample and args.seed is None:
        options["seed"] = secrets.randbits(31)
        again = "pass it to draw the same translations again"
        print(f"sampling with --seed {options['seed']} ({again})", file=sys.stderr)
    return options


def translate(args):
    """Each sentence's line (or n-best lines) printed as soon as it and the ones
    before it are translated: an interrupted job keeps what it printed."""
    options = translate_options(args)
    translator = translator_of(args)
    sentences = sentences_to_translate(args.sentences)
    options.update(n_best=args.n_best, progress=translation.Progress())
    found = translator.translations(sentences, **options)
    for number, answer in enumerate(found, 1):
        lines = [answer] if args.n_best == 1 else answer
        for line in lines:
            text = line if args.n_best == 1 else f"{number}\t{line[1]:.4f}\t{line[0]}"
            print(text, flush=True)


def figures(args):
    save_figures(args.out, args.names)


def translator_of(args):
    """The Translator of --checkpoint, or of --pretrained."""
    if args.pretrained:
        return translation.load_pretrained(args.pretrained, args.device)
    return load_translator(args.checkpoint, args.device)


def evaluate_command(args):
    translation.decode_options(args.beam, args.alpha, flags=True)  # before any work
    model = translator_of(args) if args.pretrained else args.checkpoint
    where = (model, data_dir_of(args), args.split, args.beam, args.output)
    evaluate(*where, args.batch_size, alpha=args.alpha, device=args.device)


def reproduce_command(args):
    out = args.out or Path("runs") / args.profile
    results = args.results or out
    folders = (data_dir_of(args), out, results, args.images or results)
    searches = dict(windows=args.average, beam_sizes=args.beam, alphas=args.alphas)
    run = dict(train=not args.no_train, limit=args.limit, device=args.device)
    reproduce(args.profile, *folders, **searches, **run)


def average(args):
    average_checkpoints(args.checkpoints, args.out)
    print(f"averaged {len(args.checkpoints)} checkpoints into {args.out}")


def attention(args):
    drawn = (args.checkpoint, args.sentence, args.out, args.layer, args.heads)
    for path in save_attention_maps(*drawn, device=args.device, flags=True):
        print(f"wrote {path}")


RUNNERS = dict(copy=copy, download=download, train=train, translate=translate)
RUNNERS |= dict(evaluate=evaluate_command, average=average, attention=attention)
RUNNERS |= dict(reproduce=reproduce_command, figures=figures)
