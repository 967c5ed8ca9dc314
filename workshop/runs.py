"""Training runs on Multi30k: profiles, checkpoints written atomically, resuming, a
time limit, bfloat16 where it pays, and several processes (DistributedDataParallel).

The model, the loop and the loss are the book's; a run adds what an hour-long job
needs, and puts workshop.fast's CPU speed tricks into the model it trains. bfloat16
and several processes wrap the book's pieces without copying its loop: Autocast
around the model and AutocastLossCompute for its loss; GroupSyncDDP, which exchanges
gradients once per optimizer step, and DistributedLossCompute, whose norm makes the
gradient the mean over every process's tokens.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import the_annotated_transformer as tat
from the_annotated_transformer import (
    PAD,
    SPECIALS,
    SimpleLossCompute,
    SubwordVocab,
    TokenBudgetBatchSampler,
    TrainState,
    Vocab,
    average,
    check_positive_int,
    count_parameters,
    make_optimizer,
    prepare_data,
    run_epoch,
)
from workshop import fast, multi30k
from workshop.files import atomic_write, atomic_write_text
from workshop.multi30k import DataError


@dataclass
class RunConfig(tat.TrainConfig):
    """The book's TrainConfig, with what a long run adds: a profile name, bfloat16,
    checkpoints kept, logging, a time limit, and the subword vocabulary and shared
    embedding matrices of Part 4."""

    profile: str = "quick"
    bf16: bool = False
    keep_checkpoints: int = 5
    log_every: int = 50
    time_limit: float | None = None  # minutes: start no epoch that would end later
    vocab: str = "word"  # "word" (spaCy words) or "bpe" (joint subwords, Part 4)
    bpe_vocab_size: int = 8000
    share_embeddings: bool = False  # one matrix for both embeddings (needs "bpe")
    tie_generator: bool = False  # the generator reuses the target embedding

    def make_model(self, src_vocab, tgt_vocab):
        """The book's model for these settings, with Part 4's shared matrices."""
        tied = dict(
            share_embeddings=self.share_embeddings, tie_generator=self.tie_generator
        )
        return super().make_model(src_vocab, tgt_vocab, **tied)

    @classmethod
    def from_profile(cls, name="quick", **overrides):
        """The named profile, with some fields overridden."""
        if name not in TRAIN_PROFILES:
            raise ValueError(
                f"unknown profile {name!r}; choose one of {sorted(TRAIN_PROFILES)}."
            )
        return cls.from_dict({**TRAIN_PROFILES[name], "profile": name, **overrides})

    @classmethod
    def from_dict(cls, values):
        """Build from a dict, rejecting unknown keys with a clear message."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown TrainConfig field(s) {unknown}; known: {sorted(known)}."
            )
        config = cls(**values)
        config.validate()
        return config

    def to_dict(self):
        return asdict(self)

    def validate(self):
        check_positive_int(
            N=self.N,
            d_model=self.d_model,
            d_ff=self.d_ff,
            h=self.h,
            max_tokens=self.max_tokens,
            accum_iter=self.accum_iter,
            warmup=self.warmup,
            max_len=self.max_len,
            min_freq=self.min_freq,
        )
        if not isinstance(self.keep_checkpoints, int) or self.keep_checkpoints < 1:
            raise ValueError(
                "keep_checkpoints is how many epoch_NNN.pt files a run keeps and must "
                f"be a whole number of at least 1, got {self.keep_checkpoints!r}."
            )
        if self.max_len < 3:
            raise ValueError(
                f"max_len must be at least 3 (<s>, a word, </s>), got {self.max_len}."
            )
        if self.epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {self.epochs}.")
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(
                f"time_limit is in minutes and must be > 0 (or None), got "
                f"{self.time_limit!r}."
            )
        if self.d_model % self.h:
            raise ValueError(f"d_model={self.d_model} must be divisible by h={self.h}.")
        if self.vocab not in ("word", "bpe"):
            raise ValueError(f"vocab must be 'word' or 'bpe', got {self.vocab!r}.")
        check_positive_int(bpe_vocab_size=self.bpe_vocab_size)
        if self.bpe_vocab_size < len(SPECIALS) + 256:
            raise ValueError(
                f"bpe_vocab_size must be at least {len(SPECIALS) + 256} (the four "
                f"specials and the 256 bytes), got {self.bpe_vocab_size}."
            )
        if self.share_embeddings and self.vocab != "bpe":
            raise ValueError(
                "share_embeddings=True needs one vocabulary for German and English: "
                "set vocab='bpe' (a joint subword vocabulary), or leave "
                "share_embeddings off."
            )


TRAIN_PROFILES = {
    "smoke": {**tat.PROFILES["smoke"], "log_every": 10},
    "quick": tat.PROFILES["quick"],  # the book's: 4 epochs on every pair
    # The README's Results: a fixed budget of 10 epochs, under an hour on a 2-core
    # CPU at about 1,300 target tokens/s. The narrow feed-forward layer (512), 4
    # heads and 2,000-token batches (229 updates an epoch) train 1.3x the tokens a
    # second of d_ff 1,024 and 8 heads, so 10 epochs fit where 7 did, though each
    # epoch teaches a little less. The time limit only guards much slower machines;
    # a run it stops says so.
    "multi30k": dict(
        N=3,
        d_model=256,
        d_ff=512,
        h=4,
        dropout=0.1,
        max_tokens=2000,
        warmup=400,
        epochs=10,
        time_limit=90,
    ),
    "base": tat.PROFILES["base"],
}


def run_vocabs(config, data_dir, vocabs=None):
    """Check the train and val files against their published digests, and return
    `vocabs`, else the run's (vocab_src, vocab_tgt) built from the training split:
    one joint subword vocabulary when vocab is "bpe", the book's word ones else."""
    config.validate()
    for split in ("train", "val"):
        multi30k.verify_split(data_dir, split)
    if vocabs is not None:
        return vocabs
    train = tat.read_split(data_dir, "train")[: config.max_train_pairs]
    if config.vocab == "bpe":
        texts = (text for pair in train for text in pair)
        shared = SubwordVocab.build(texts, config.bpe_vocab_size)
        return shared, shared
    spacy_de, spacy_en = tat.load_tokenizers()
    return tat.build_vocabulary(train, spacy_de, spacy_en, config.min_freq)


def prepare_run_data(config, data_dir, vocabs=None):
    """The book's prepare_data for a run: the files checked against their published
    digests first, and one joint subword vocabulary learned when vocab is "bpe"."""
    config.validate()
    for split in ("train", "val"):
        multi30k.verify_split(data_dir, split)
    if vocabs is None and config.vocab == "bpe":
        vocabs = run_vocabs(config, data_dir)
    return prepare_data(
        data_dir,
        max_len=config.max_len,
        min_freq=config.min_freq,
        max_train_pairs=config.max_train_pairs,
        vocabs=vocabs,
    )


def make_run_model(config, src_vocab, tgt_vocab):
    """The book's model for `config`, with fast.py's CPU-friendly dropout and fused
    attention."""
    model = config.make_model(src_vocab, tgt_vocab)
    return fast.use_fused_attention(fast.use_fast_dropout(model))


class Translator(tat.Translator):
    """The book's Translator for text from the command line: a sentence longer than
    the model's positions is cut to fit, with a warning that names it."""

    def encode(self, sentences):
        encoded, limit = super().encode(sentences), self.model.src_embed[1].max_len
        for i, ids in enumerate(encoded):
            if len(ids) > limit:
                print(
                    f"warning: sentence {i + 1} has {len(ids)} tokens, more than the "
                    f"model's {limit} positions; only its first {limit} are "
                    "translated.",
                    file=sys.stderr,
                )
                encoded[i] = [*ids[: limit - 1], tat.EOS]
        return encoded


def load_translator(path, device=None, fused=True):
    """A Translator for a checkpoint written by `train` (or `average`); fused=False
    keeps the book's attention, which stores its weights for the attention maps."""
    model, vocab_src, vocab_tgt, config = model_from_checkpoint(
        load_checkpoint(path), device or tat.default_device(), path
    )
    if fused:
        fast.use_fused_attention(model)
    return Translator(model, vocab_src, vocab_tgt, config)


def decoding(beam_size=1, alpha=0.6):
    """Translator.translate's options for greedy (beam_size 1, with the key/value
    cache) or beam search of `beam_size` with length-penalty exponent `alpha`."""
    if beam_size > 1:
        return dict(decode=fast.beam_search, beam_size=beam_size, alpha=alpha)
    return dict(decode=tat.cached_greedy_decode)


def subword_vocab_from_json(text):
    """The SubwordVocab whose tokenizer `tokenizer.to_str()` wrote as `text`."""
    from tokenizers import Tokenizer

    try:
        return SubwordVocab(Tokenizer.from_str(text))
    except Exception as error:  # tokenizers raises a plain Exception
        raise DataError(f"not a saved SubwordVocab ({error}).") from error


def save_vocab(vocab, path):
    """Write a Vocab (its tokens) or a SubwordVocab (its tokenizer) as JSON."""
    if isinstance(vocab, SubwordVocab):
        atomic_write_text(path, vocab.tokenizer.to_str())
    else:
        itos = {"itos": vocab.get_itos()}
        atomic_write_text(path, json.dumps(itos, ensure_ascii=False))


def load_vocab(path):
    """A vocabulary written by save_vocab, of either kind."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text)
        if isinstance(data, dict) and "itos" in data:
            return Vocab(data["itos"])
        return subword_vocab_from_json(text)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{path} is not a saved vocabulary ({error}).") from error


def save_checkpoint(path, state):
    """torch.save `state` to `path` atomically (workshop.files.atomic_write)."""
    atomic_write(path, lambda f: torch.save(state, f))


def without_positional_tables(state_dict):
    """A state dict without the positional-encoding tables (the `*.pe` buffers):
    they are a fixed function of the model's sizes, so checkpoints leave them out."""
    return {k: v for k, v in state_dict.items() if not k.endswith(".pe")}


def with_positional_tables(state_dict, model):
    """`state_dict` with every `*.pe` table it lacks taken from `model`'s own state
    dict, for model.load_state_dict(..., strict=True): strictness then still catches
    every other missing or unexpected entry."""
    tables = {k: v for k, v in model.state_dict().items() if k.endswith(".pe")}
    return {**tables, **state_dict}


def load_weights(model, state_dict):
    """Load a checkpoint's state dict, saved with or without the positional tables,
    into `model` strictly; returns `model`."""
    model.load_state_dict(with_positional_tables(state_dict, model), strict=True)
    return model


def load_checkpoint(path, map_location="cpu"):
    """Load a checkpoint written by save_checkpoint (tensors and plain data only)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} not found. Train one with "
            "`python -m workshop train --out DIR`."
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # torch raises several types for a damaged file
        raise DataError(
            f"{path} is not a readable checkpoint: it is damaged, truncated or not "
            f"a file written by `train` (torch.load: {type(error).__name__}). Pass "
            "a .pt written by `train`."
        ) from None


def vocabs_from_checkpoint(checkpoint):
    """(vocab_src, vocab_tgt) of a loaded checkpoint; one SubwordVocab for "bpe"."""
    if checkpoint["config"].get("vocab", "word") == "bpe":
        if "bpe" not in checkpoint:
            raise DataError(
                "this checkpoint was trained with vocab='bpe' but holds no subword "
                "vocabulary (no 'bpe' entry); it is incomplete."
            )
        shared = subword_vocab_from_json(checkpoint["bpe"])
        return shared, shared
    return Vocab(checkpoint["vocab_src"]), Vocab(checkpoint["vocab_tgt"])


def model_from_checkpoint(checkpoint, device="cpu", path="the checkpoint"):
    """Rebuild (model, vocab_src, vocab_tgt, config) from a loaded checkpoint."""
    is_dict = isinstance(checkpoint, dict)
    missing = [k for k in ("model", "config") if not is_dict or k not in checkpoint]
    if missing:
        raise DataError(
            f"{path} is not a model checkpoint of this project (it lacks "
            f"{missing}); a bare state dict loads with "
            "model.load_state_dict in Python. Pass a .pt written by `train`."
        )
    try:
        config = RunConfig.from_dict(checkpoint["config"])
    except (ValueError, TypeError) as error:
        raise DataError(
            f"{path} holds settings this code cannot use: {error}"
        ) from None
    vocab_src, vocab_tgt = vocabs_from_checkpoint(checkpoint)
    model = config.make_model(len(vocab_src), len(vocab_tgt))
    try:
        load_weights(model, checkpoint["model"])
    except RuntimeError as error:
        first = str(error).strip().splitlines()[-1].strip()
        raise DataError(
            f"{path}: its weights do not fit the model its settings describe "
            f"({first}). The file is damaged or was edited; use another checkpoint."
        ) from None
    return model.to(device).eval(), vocab_src, vocab_tgt, config


def epoch_files(out_dir):
    """A run's `epoch_NNN.pt` files, ordered by their epoch number."""
    found = []
    for path in Path(out_dir).glob("epoch_*.pt"):
        number = path.stem.removeprefix("epoch_")
        if number.isdigit():
            found.append((int(number), path))
    return [path for _, path in sorted(found)]


def refuse_existing_run(out_dir, ways_on):
    """Raise a RunExistsError if `out_dir` already holds a training run."""
    out_dir = Path(out_dir)
    held = [p.name for p in [out_dir / "last.pt", *epoch_files(out_dir)] if p.exists()]
    if held:
        raise RunExistsError(
            f"{out_dir} already holds a training run ({', '.join(held[:3])}"
            f"{', ...' if len(held) > 3 else ''}); {ways_on}"
        )


class RunExistsError(ValueError):
    """A new run would write into the folder of an earlier one."""


def bf16_matmul_speedup(device="cpu", tokens=512, d_model=256, repeats=2):
    """Time of a float32 matrix product over that of a bfloat16 one on `device`.

    The product has a feed-forward layer's shape: (tokens, d_model) @ (d_model,
    2 * d_model), 134 million operations at the defaults.
    """
    device = torch.device(device)
    a = torch.randn(tokens, d_model, device=device)
    b = torch.randn(d_model, 2 * d_model, device=device)

    def fastest(x, y):
        times = []
        for _ in range(repeats + 1):  # the first call also pays one-time set-up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            x @ y
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    return fastest(a, b) / fastest(a.bfloat16(), b.bfloat16())


def amp_dtype_for(bf16, device, say=print, distributed=False):
    """torch.bfloat16 if bf16 autocast is asked for and pays on `device`, else None."""
    if not bf16:
        return None
    speedup = bf16_matmul_speedup(device)
    pays = torch.tensor(float(speedup >= 1.0))
    if distributed:  # every process must train in the same precision
        pays = pays.to(device)
        torch.distributed.all_reduce(pays, op=torch.distributed.ReduceOp.MIN)
    if bool(pays.item()):
        return torch.bfloat16
    say(
        f"--bf16 ignored: bfloat16 matrix products run at {speedup:.2f}x the float32 "
        f"speed on this {device.type.upper()} (no bfloat16 hardware), so this run "
        "trains in float32."
    )
    return None


# ---------------------------------------------------------------------------------
# bfloat16 and several processes, around the book's model, loss and loop


class Autocast(nn.Module):
    """The wrapped model, its forward pass run under torch.autocast to `dtype`
    (bfloat16 by default) on the device of the model's parameters. It holds no
    weights of its own: train and save the wrapped model."""

    def __init__(self, model, dtype=torch.bfloat16):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, *args, **kwargs):
        device_type = next(self.model.parameters()).device.type
        with torch.autocast(device_type, dtype=self.dtype):
            return self.model(*args, **kwargs)


class AutocastLossCompute(SimpleLossCompute):
    """The book's SimpleLossCompute with the generator and the criterion run under
    torch.autocast to `dtype`, as Autocast runs the model: in training (__call__)
    and in evaluation (nll)."""

    def __init__(self, generator, criterion, dtype=torch.bfloat16):
        super().__init__(generator, criterion)
        self.dtype = dtype

    def autocast(self, x):
        return torch.autocast(x.device.type, dtype=self.dtype)

    def __call__(self, x, y, norm):
        with self.autocast(x):
            return super().__call__(x, y, norm)

    def nll(self, x, y):
        with self.autocast(x):
            return super().nll(x, y)


def mean_over_processes(norm, device):
    """The mean of `norm` over the processes of the default group, as a tensor on
    `device` (no wait for the host: the division happens on the device)."""
    # float32 counts tokens exactly up to 2**24 (16 million) a group.
    total = torch.as_tensor(norm, dtype=torch.float32, device=device).clone()
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM)
    return total / torch.distributed.get_world_size()


class DistributedLossCompute(SimpleLossCompute):
    """The book's SimpleLossCompute for one of several data-parallel processes.

    The book's loop divides each micro-batch's summed loss by its group's target
    tokens, `norm`. DistributedDataParallel then averages the gradients over the
    world_size processes, so dividing by the mean of the processes' `norm`s instead
    makes the gradient the mean over every token of the global group, however the
    tokens fall among the processes. Every process calls this as often as the others
    (ShardedBatchSampler gives each the same number of batches), so the exchange of
    the counts never waits forever. Evaluation (nll) exchanges nothing.
    """

    def __call__(self, x, y, norm):
        return super().__call__(x, y, mean_over_processes(norm, x.device))


class DistributedAutocastLossCompute(DistributedLossCompute, AutocastLossCompute):
    """DistributedLossCompute's norm, with AutocastLossCompute's autocast."""


class GroupSyncDDP(DistributedDataParallel):
    """DistributedDataParallel that exchanges gradients once per optimizer step.

    The micro-batches of one group (every accum_iter batches, and the epoch's last,
    partial one) add up their gradients, and only the one that ends the group needs
    the exchange: before each forward pass in training mode this sets DDP's public
    `require_backward_grad_sync` (what DDP's no_sync() sets), False unless that
    micro-batch ends its group. Call plan_epoch before each epoch; without a plan
    every micro-batch exchanges, as in plain DDP.
    """

    def __init__(self, module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        self.n_batches, self.accum_iter, self.seen = None, 1, 0  # no plan yet

    def plan_epoch(self, n_batches, accum_iter):
        """Expect an epoch of `n_batches` micro-batches in groups of `accum_iter`."""
        check_positive_int(n_batches=n_batches, accum_iter=accum_iter)
        self.n_batches, self.accum_iter, self.seen = n_batches, accum_iter, 0

    def forward(self, *args, **kwargs):
        if self.training and self.n_batches is not None:
            self.seen += 1
            last = self.seen >= self.n_batches  # the epoch's last group may be short
            self.require_backward_grad_sync = self.seen % self.accum_iter == 0 or last
        return super().forward(*args, **kwargs)


def models_for_run(module, amp_dtype=None, distributed=False, device=None):
    """(the model run_epoch trains, the model it evaluates) around the book's
    `module`: under Autocast for a bfloat16 amp_dtype, and the trained one in a
    GroupSyncDDP when `distributed`."""
    evaluated = module if amp_dtype is None else Autocast(module, amp_dtype)
    trained = evaluated
    if distributed:
        device = torch.device(device or next(module.parameters()).device)
        ids = [device.index] if device.type == "cuda" else None
        # The only buffers are the positional-encoding tables, which never change:
        # nothing to broadcast before each forward pass.
        trained = GroupSyncDDP(evaluated, device_ids=ids, broadcast_buffers=False)
    return trained, evaluated


def loss_compute_for_run(generator, criterion, amp_dtype=None, distributed=False):
    """The book's SimpleLossCompute, or the subclass for autocast and/or several
    processes that models_for_run's models need."""
    if amp_dtype is None:
        kind = DistributedLossCompute if distributed else SimpleLossCompute
        return kind(generator, criterion)
    kind = DistributedAutocastLossCompute if distributed else AutocastLossCompute
    return kind(generator, criterion, amp_dtype)


def _device_for(rank, device=None):
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def train_worker(
    rank,
    world_size,
    config,
    data_dir,
    out_dir,
    *,
    resume=False,
    quiet=False,
    device=None,
    distributed=None,
    data=None,
    vocabs=None,
):
    """Train (one process of) a Multi30k model; returns the per-epoch history.

    `vocabs` (vocab_src, vocab_tgt), when given, are the run's vocabularies: built
    once before processes are spawned, so that every rank uses the same ones."""
    distributed = world_size > 1 if distributed is None else distributed
    device = _device_for(rank, device)
    is_main = rank == 0
    say = print if (is_main and not quiet) else (lambda *a, **k: None)
    if distributed:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        return _train(
            config,
            data_dir,
            Path(out_dir),
            resume,
            device,
            rank,
            world_size,
            distributed,
            is_main,
            say,
            data,
            vocabs,
        )
    finally:
        if distributed:
            torch.distributed.destroy_process_group()


def _data_fits(data, config, vocabs):
    """Whether prepared `data` uses the config's kind of vocabulary (and `vocabs`)."""
    if isinstance(data.vocab_src, Vocab) != (config.vocab == "word"):
        return False
    return vocabs is None or data.vocab_src.get_itos() == vocabs[0].get_itos()


def _train(
    config,
    data_dir,
    out_dir,
    resume,
    device,
    rank,
    world_size,
    distributed,
    is_main,
    say,
    data,
    vocabs=None,
):
    checkpoint = load_checkpoint(out_dir / "last.pt") if resume else None
    if checkpoint is not None:  # train_model has checked `config` against the run
        vocabs = vocabs_from_checkpoint(checkpoint)
    if data is not None and not _data_fits(data, config, vocabs):
        data = None  # prepared for another kind of vocabulary, or other words
    if data is None:
        say(f"reading and tokenizing Multi30k from {data_dir} ...")
        data = prepare_run_data(config, data_dir, vocabs)
    say(
        f"vocabularies: {len(data.vocab_src)} German, {len(data.vocab_tgt)} English "
        f"tokens; {len(data.splits['train'])} training pairs; device {device}"
        + (f"; {world_size} processes" if distributed else "")
    )
    for split, n in (data.cut or {}).items():
        if n:
            say(f"{split}: {n} pairs longer than max_len={config.max_len} ids were cut")
    torch.manual_seed(config.seed)
    sizes = len(data.vocab_src), len(data.vocab_tgt)
    module = make_run_model(config, *sizes).to(device)  # the book's model, trained
    optimizer, scheduler = make_optimizer(
        module, config.base_lr, config.d_model, config.factor, config.warmup
    )
    train_state, start_epoch, history, spent = TrainState(), 0, [], 0.0
    if checkpoint is not None:
        load_weights(module, checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        train_state = TrainState(**checkpoint["train_state"])
        start_epoch, history = checkpoint["epoch"] + 1, list(checkpoint["history"])
        spent = checkpoint.get("elapsed", 0.0)
        say(
            f"resuming {out_dir / 'last.pt'} (profile {config.profile}): "
            f"{start_epoch} of {config.epochs} epochs done, {spent / 60:.1f} min spent"
        )
    say(f"model: {count_parameters(module):,} parameters")
    amp = amp_dtype_for(config.bf16, device, say, distributed)
    model, evaluated = models_for_run(module, amp, distributed, device)
    criterion = fast.LabelSmoothing(len(data.vocab_tgt), PAD, config.label_smoothing)
    loss_compute = loss_compute_for_run(module.generator, criterion, amp, distributed)
    sampler = ShardedBatchSampler(
        data.lengths("train"),
        config.max_tokens,
        seed=config.seed,
        num_replicas=world_size,
        rank=rank,
    )
    val_sampler = TokenBudgetBatchSampler(
        data.lengths("val"), config.max_tokens, shuffle=False
    )
    began = time.perf_counter() - spent  # the run's clock, resumed runs included
    epoch_seconds = history[-1]["seconds"] if history else 0.0
    last = checkpoint  # what last.pt holds: marked if the time limit stops the run
    for epoch in range(start_epoch, config.epochs):
        if _out_of_time(config, began, epoch_seconds, device, distributed):
            stop = (
                f"time limit: {config.time_limit:g} minutes would pass during epoch "
                f"{epoch + 1}; stopped after {epoch} of the {config.epochs} epochs."
            )
            say(f"{stop} This run is shorter than its profile's budget.")
            if is_main and last is not None:
                save_checkpoint(out_dir / "last.pt", last | {"stopped": stop})
            break
        epoch_began = time.perf_counter()
        sampler.set_epoch(epoch)
        torch.manual_seed(epoch_seed(config.seed, epoch, rank))
        say(f"epoch {epoch + 1}/{config.epochs}: {len(sampler)} batches per process")
        start = time.perf_counter()
        tokens_before = train_state.tokens
        if distributed:
            model.plan_epoch(len(sampler), config.accum_iter)
        train_loss, train_state = run_epoch(
            tat.on_device(data.batches("train", sampler), device),
            model,
            loss_compute,
            optimizer,
            scheduler,
            mode="train+log" if say is print else "train",  # the main process logs
            accum_iter=config.accum_iter,
            train_state=train_state,
            log_every=config.log_every,
        )
        seconds = time.perf_counter() - start
        val_nll, _ = run_epoch(
            tat.on_device(data.batches("val", val_sampler), device),
            evaluated,
            loss_compute,
            mode="eval",
        )
        record = {
            "epoch": epoch + 1,
            "train_loss_smoothed": train_loss,
            "val_nll": val_nll,
            "val_ppl": math.exp(val_nll),
            "seconds": seconds,
            "tokens_per_s": (train_state.tokens - tokens_before) * world_size / seconds,
        }
        history.append(record)
        say(
            f"epoch {epoch + 1}: train loss (label-smoothed) {train_loss:.3f} | "
            f"validation NLL {val_nll:.3f}, perplexity {record['val_ppl']:.2f} | "
            f"{seconds:.0f} s, {record['tokens_per_s']:.0f} target tokens/s"
        )
        if is_main:
            last = _save_epoch(
                out_dir,
                config,
                data,
                module,
                optimizer,
                scheduler,
                train_state,
                epoch,
                history,
                elapsed=time.perf_counter() - began,
            )
        epoch_seconds = time.perf_counter() - epoch_began
    return history


def even_out(batches, num_replicas):
    """Make the number of batches a multiple of num_replicas: split the largest batch
    in two until it is; when every batch holds one pair, repeat the first few."""
    while len(batches) % num_replicas:
        biggest = max(range(len(batches)), key=lambda i: len(batches[i]))
        if len(batches[biggest]) < 2:  # one pair per batch: repeat a few
            short = num_replicas - len(batches) % num_replicas
            return batches + [list(b) for b in batches[:short]]
        half = len(batches[biggest]) // 2
        batch = batches[biggest]
        batches[biggest : biggest + 1] = [batch[:half], batch[half:]]
    return batches


class ShardedBatchSampler(TokenBudgetBatchSampler):
    """The book's token-budget batches, shared among `num_replicas` data-parallel
    processes: process `rank` takes every num_replicas-th batch of the epoch.

    Every process must get the same number of batches: each optimizer step ends in
    an exchange of gradients that waits for all of them, so a process with one batch
    more would wait forever. even_out splits batches until the count divides evenly;
    the processes together still cover every pair once, except when no batch can be
    split (each holds one pair) and a few are repeated, as PyTorch's
    DistributedSampler does.
    """

    def __init__(self, lengths, max_tokens, *, num_replicas=1, rank=0, **options):
        check_positive_int(num_replicas=num_replicas)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}.")
        if len(lengths) < num_replicas:
            raise ValueError(
                f"{len(lengths)} examples cannot be shared by {num_replicas} processes."
            )
        super().__init__(lengths, max_tokens, **options)
        self.num_replicas, self.rank = num_replicas, rank

    def all_batches(self):
        """Every process's batches for the current epoch, in order."""
        return even_out(super().all_batches(), self.num_replicas)

    def __iter__(self):
        return iter(self.all_batches()[self.rank :: self.num_replicas])

    def __len__(self):
        return len(self.all_batches()) // self.num_replicas


def epoch_seed(seed, epoch, rank=0):
    """The seed of one process's epoch: distinct for every (seed, epoch, rank)."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


def _out_of_time(config, began, epoch_seconds, device, distributed):
    """Would one more epoch, as long as the last, end after config.time_limit?

    The first epoch of a run always starts. Under DDP every process must
    agree, so the slowest one's answer counts.
    """
    if config.time_limit is None or epoch_seconds == 0:
        return False
    elapsed = time.perf_counter() - began
    late = torch.tensor(float(elapsed + epoch_seconds > 60 * config.time_limit))
    if distributed:
        late = late.to(device)
        torch.distributed.all_reduce(late, op=torch.distributed.ReduceOp.MAX)
    return bool(late.item())


def _save_epoch(
    out_dir,
    config,
    data,
    module,
    optimizer,
    scheduler,
    train_state,
    epoch,
    history,
    elapsed,
):
    """Write epoch_NNN.pt and last.pt, prune old epochs; returns last.pt's state."""
    from dataclasses import asdict

    weights = {
        "model": without_positional_tables(module.state_dict()),
        "config": config.to_dict(),
        "epoch": epoch,
        "vocab_src": data.vocab_src.get_itos(),
        "vocab_tgt": data.vocab_tgt.get_itos(),
    }
    if config.vocab == "bpe":
        weights["bpe"] = data.vocab_src.tokenizer.to_str()
    save_checkpoint(out_dir / f"epoch_{epoch + 1:03d}.pt", weights)
    last = {
        **weights,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "train_state": asdict(train_state),
        "history": history,
        "elapsed": elapsed,  # seconds of the run so far: the time limit's clock
    }
    save_checkpoint(out_dir / "last.pt", last)
    if config.vocab == "bpe":
        save_vocab(data.vocab_src, out_dir / "bpe.json")
    else:
        save_vocab(data.vocab_src, out_dir / "vocab_src.json")
        save_vocab(data.vocab_tgt, out_dir / "vocab_tgt.json")
    for path in epoch_files(out_dir)[: -config.keep_checkpoints]:
        path.unlink()
    return last


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_worker(
    rank, world_size, config, data_dir, out_dir, resume, quiet, vocabs=None
):
    if not torch.cuda.is_available():  # share the cores instead of oversubscribing
        threads = max(1, (os.cpu_count() or 1) // world_size)
        torch.set_num_threads(threads)
        if rank == 0 and not quiet:
            print(
                f"{world_size} CPU processes, {threads} thread(s) each",
                flush=True,
            )
    train_worker(
        rank,
        world_size,
        config,
        data_dir,
        out_dir,
        resume=resume,
        quiet=quiet,
        distributed=True,
        vocabs=vocabs,
    )


def resume_config(out_dir, **changes):
    """The settings of the run in `out_dir`, with more `epochs` if asked for.

    Any other change is refused: a resumed run continues the run it resumes.
    """
    path = Path(out_dir) / "last.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"--resume: there is no {path} to continue from. Train without --resume "
            "first, or point --out at an earlier run."
        )
    checkpoint = load_checkpoint(path)
    if not isinstance(checkpoint, dict) or "config" not in checkpoint:
        raise DataError(
            f"{path} holds no training settings: it is not a run's last.pt."
        )
    run = RunConfig.from_dict(checkpoint["config"]).to_dict()
    changed = {k: v for k, v in changes.items() if k != "epochs" and run.get(k) != v}
    if changed:
        listed = ", ".join(
            f"{k}={v!r} (the run has {run.get(k)!r})" for k, v in changed.items()
        )
        raise ValueError(
            f"--resume continues {out_dir} with its own settings, and these differ: "
            f"{listed}. Drop those options, or start a new run with another --out."
        )
    done = checkpoint.get("epoch", -1) + 1
    epochs = changes.get("epochs", run["epochs"])
    if epochs <= done:
        raise ValueError(
            f"--resume: {out_dir} has finished its {done} epochs; pass --epochs N "
            f"with N above {done} to train it further."
        )
    return RunConfig.from_dict({**run, "epochs": epochs})


def _check_nprocs(nprocs):
    """Refuse more processes than GPUs (or, without GPUs, than CPU cores)."""
    check_positive_int(nprocs=nprocs)
    if torch.cuda.is_available():
        have, what = torch.cuda.device_count(), "GPUs"
    else:
        have, what = os.cpu_count() or 1, "CPU cores"
    if nprocs > have:
        raise ValueError(
            f"--nprocs {nprocs}: this machine has {have} {what}; ask for at most "
            f"{have} processes."
        )


def train_model(config, data_dir, out_dir, *, resume=False, nprocs=1, quiet=False):
    """Train on Multi30k in this process, under torchrun, or in `nprocs` processes.

    A new run needs a folder that holds no run; `resume=True` continues the run in
    `out_dir` (config None: its own settings; otherwise only `epochs` may differ).
    """
    out_dir = Path(out_dir)
    _check_nprocs(nprocs)
    if resume:
        changes = {} if config is None else config.to_dict()
        config = resume_config(out_dir, **changes)
    else:
        config.validate()
        refuse_existing_run(
            out_dir,
            "continue it with --resume, or give another --out for a new run.",
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = _device_for(int(os.environ.get("LOCAL_RANK", rank)))
        return train_worker(
            rank,
            world,
            config,
            data_dir,
            out_dir,
            resume=resume,
            quiet=quiet,
            device=device,
            distributed=world > 1,
        )
    if nprocs > 1:
        import torch.multiprocessing as mp

        # Check the data and build the vocabularies here, once: a bad folder is
        # one line from this process, and every rank gets the same vocabularies.
        vocabs = None
        if resume:
            vocabs = vocabs_from_checkpoint(load_checkpoint(out_dir / "last.pt"))
        if not quiet:
            print(f"checking Multi30k in {data_dir} and building the vocabularies ...")
        vocabs = run_vocabs(config, data_dir, vocabs)

        rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        saved = {key: os.environ.get(key) for key in rendezvous}
        os.environ.update({k: v for k, v in rendezvous.items() if saved[k] is None})
        try:
            mp.spawn(
                _spawned_worker,
                nprocs=nprocs,
                args=(nprocs, config, data_dir, out_dir, resume, quiet, vocabs),
            )
        finally:  # leave the caller's environment as it was
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
        return load_checkpoint(out_dir / "last.pt")["history"]
    return train_worker(0, 1, config, data_dir, out_dir, resume=resume, quiet=quiet)


CHECKPOINT_KEYS = ("model", "config", "vocab_src", "vocab_tgt")


def _check_same_run(first_path, first, path, checkpoint):
    """Raise a DataError unless two checkpoints share settings and vocabularies."""
    a, b = first["config"], checkpoint["config"]
    keys = sorted((set(a) | set(b)) - {"epochs"})  # resuming may extend the epochs
    differ = [k for k in keys if a.get(k) != b.get(k)]
    if differ:
        listed = ", ".join(f"{k}={a.get(k)!r} vs {b.get(k)!r}" for k in differ)
        raise DataError(
            f"{path} and {first_path} have different settings ({listed}); only "
            "checkpoints of one training run can be averaged."
        )
    for side in ("vocab_src", "vocab_tgt", "bpe"):
        if first.get(side) != checkpoint.get(side):
            raise DataError(
                f"{path} and {first_path} have different {side} vocabularies; only "
                "checkpoints of one training run can be averaged."
            )


def average_checkpoints(paths, out):
    """Average checkpoints of one run into a new checkpoint `out`; returns the model."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("average: name at least one checkpoint to average.")
    checkpoints = [load_checkpoint(p) for p in paths]
    for path, checkpoint in zip(paths, checkpoints, strict=True):
        missing = [key for key in CHECKPOINT_KEYS if key not in checkpoint]
        if missing:
            raise DataError(f"{path} is not a model checkpoint (it lacks {missing}).")
        _check_same_run(paths[0], checkpoints[0], path, checkpoint)
    first = checkpoints[0]
    model = model_from_checkpoint(first, path=paths[0])[0]
    states = [with_positional_tables(c["model"], model) for c in checkpoints]
    average(model, states)
    averaged = {
        "model": without_positional_tables(model.state_dict()),
        "config": first["config"],
        "epoch": max(checkpoint.get("epoch", 0) for checkpoint in checkpoints),
        "vocab_src": first["vocab_src"],
        "vocab_tgt": first["vocab_tgt"],
        "averaged_from": [str(path) for path in paths],
    }
    if "bpe" in first:  # a subword run: keep its vocabulary
        averaged["bpe"] = first["bpe"]
    save_checkpoint(out, averaged)
    return model
