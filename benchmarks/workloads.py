"""What the figures run: the book's model and torch.nn.Transformer at given sizes,
synthetic sentences, the book's training and decoding, and a FLOP count. Models and
batches are made on the CPU (from seeded host generators) and moved once to the
bench's device, before anything is timed.

Every name the benchmark takes from workshop/ is imported here, and only here;
bf16_pays(device) is the workshop's rule for whether bfloat16 pays (on a GPU: its
bfloat16 hardware; on the CPU: a timed matrix product), re-exported for the figures,
parse_device(text), the command line's check of --device, re-exported for bench.py,
training_flops, the workshop's count of useful FLOPs, with memory_projections,
the layers it counts per source token, for the figures, and cpu_info(), the
workshop's reading of /proc/cpuinfo (model name and flags), for timing.py.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

# The book and workshop/ are found through PYTHONPATH, which `make bench` sets to the
# repository root (PYTHONPATH=. .venv/bin/python benchmarks/bench.py by hand).
import the_annotated_transformer as tat
from workshop import fast
from workshop.distributed import parse_device as parse_device  # re-exported
from workshop.flops import memory_projections as memory_projections  # re-exported
from workshop.flops import training_flops as training_flops  # re-exported
from workshop.precision import bf16_pays as bf16_pays  # re-exported, see above
from workshop.provenance import cpu_info as cpu_info  # re-exported, see above
from workshop.settings import RunConfig
from workshop.training import loss_compute_for_run, make_run_model, models_for_run
from workshop.translation import beam_search

# isort: split
# This folder's modules (bench.py runs as a script, so benchmarks/ is on sys.path).
from bench_settings import MAX_SENTENCE, NEVER, TRAIN_BATCH, Sizes


def quick_profile():
    """The settings of a training run's "quick" profile (RunConfig)."""
    return RunConfig.from_profile("quick")


def quick_profile_sizes(vocab=8000):
    """The quick profile's model sizes (3 layers, d_model=128)."""
    config = quick_profile()
    return Sizes(config.N, config.d_model, config.d_ff, config.h, vocab)


def book_model(sizes, seed=0, device="cpu"):
    """The model a training run trains (workshop.training's make_run_model: the
    book's model with workshop.fast's dropout and fused attention) at `sizes`, with
    the run's other settings at their defaults, initialised from `seed` (on the CPU,
    so the same weights on every device), on `device`."""
    config = RunConfig(N=sizes.N, d_model=sizes.d_model, d_ff=sizes.d_ff, h=sizes.h)
    torch.manual_seed(seed)
    return make_run_model(config, sizes.vocab, sizes.vocab).to(device)


class TorchTransformer(nn.Module):
    """torch.nn.Transformer between the book's embeddings and generator.

    It takes the book's arguments (ids and boolean "may attend" masks) so that the
    book's run_epoch, SimpleLossCompute and make_optimizer drive it unchanged.
    """

    def __init__(self, sizes, dropout=0.1):
        super().__init__()
        d_model, vocab = sizes.d_model, sizes.vocab
        embed = nn.Sequential(
            tat.Embeddings(d_model, vocab), tat.PositionalEncoding(d_model, dropout)
        )
        self.src_embed, self.tgt_embed = embed, copy.deepcopy(embed)
        with warnings.catch_warnings():  # "enable_nested_tensor ... norm_first"
            warnings.simplefilter("ignore", UserWarning)
            self.transformer = nn.Transformer(
                d_model,
                sizes.h,
                sizes.N,
                sizes.N,
                sizes.d_ff,
                dropout,
                activation="relu",
                batch_first=True,
                norm_first=True,  # as make_model's default
            )
        self.generator = tat.Generator(d_model, vocab)
        for p in self.parameters():  # Xavier, as make_model initialises
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src, tgt, src_mask, tgt_mask):
        src_padding = ~src_mask[:, 0]  # (batch, src_len), True where padding
        tgt_padding = ~tgt_mask[:, -1]  # the last row of the mask only hides padding
        future = ~tat.subsequent_mask(tgt.size(1), tgt.device)[0]  # (tgt, tgt)
        return self.transformer(
            self.src_embed(src),
            self.tgt_embed(tgt),
            tgt_mask=future,
            src_key_padding_mask=src_padding,
            tgt_key_padding_mask=tgt_padding,
            memory_key_padding_mask=src_padding,
            tgt_is_causal=True,
        )


def chunks(items, size):
    """Consecutive slices of `items` of `size` (the last may be shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def zipf_ids(n, vocab, generator):
    """`n` word ids in 4..vocab-1, drawn with probability 1/rank as words in text."""
    weights = 1.0 / torch.arange(1, vocab - 3, dtype=torch.float)
    return (4 + torch.multinomial(weights, n, True, generator=generator)).tolist()


def synthetic_pairs(n, vocab, max_len=MAX_SENTENCE, seed=0):
    """`n` (source, target) id lists, <s> words </s>, of random lengths 3..max_len."""
    rng = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        src_len, tgt_len = torch.randint(3, max_len + 1, (2,), generator=rng).tolist()
        pairs.append(
            tuple(
                [tat.BOS, *zipf_ids(length - 2, vocab, rng), tat.EOS]
                for length in (src_len, tgt_len)
            )
        )
    return pairs


def synthetic_batches(n, vocab, batch_size=TRAIN_BATCH, seed=0, device="cpu"):
    """`n` Batches of `batch_size` ragged sentence pairs, padded with the book's PAD,
    on `device`."""
    pairs = synthetic_pairs(n * batch_size, vocab, seed=seed)
    return [tat.collate_batch(c).to(device) for c in chunks(pairs, batch_size)]


def fixed_length_batch(examples, length, pad=tat.PAD):
    """A Batch of (src_ids, tgt_ids) pairs, every sentence padded to `length` ids."""

    def padded(side):
        ids = torch.full((len(examples), length), pad, dtype=torch.long)
        for row, example in enumerate(examples):
            ids[row, : len(example[side])] = torch.tensor(example[side][:length])
        return ids

    return tat.Batch(padded(0), padded(1), pad)


def target_tokens(batches):
    """Non-padding target tokens in `batches`."""
    return sum(b.ntokens for b in batches)


def padding_share(batches):
    """The share of target positions in `batches` that are padding."""
    return 1.0 - target_tokens(batches) / sum(b.tgt_y.numel() for b in batches)


def trainer(model, amp_dtype=None, smoothing=0.1, warmup=4000):
    """A function that trains `model` on a list of Batches as the book's training does.

    LabelSmoothing (workshop.fast's, as training runs use) + SimpleLossCompute +
    make_optimizer, through run_epoch; the function returns run_epoch's mean loss per
    target token. A bfloat16 amp_dtype wraps the model and the loss as training runs
    do (the workshop's Autocast and AutocastLossCompute).
    """
    d_model, vocab = model.generator.proj.in_features, model.generator.proj.out_features
    criterion = fast.LabelSmoothing(vocab, tat.PAD, smoothing)
    loss_compute = loss_compute_for_run(model.generator, criterion, amp_dtype)
    trained, _ = models_for_run(model, amp_dtype)
    optimizer, scheduler = tat.make_optimizer(model, model_size=d_model, warmup=warmup)

    def train(batches):
        loss, _ = tat.run_epoch(
            iter(batches), trained, loss_compute, optimizer, scheduler, mode="train"
        )
        return loss

    return train


def source_batches(sentences, batch_size, device="cpu"):
    """Batches of source id lists on `device`, as the book's decode_ids makes them."""
    return [
        tat.collate_batch([(ids, [tat.BOS, tat.EOS]) for ids in chunk]).to(device)
        for chunk in chunks(sentences, batch_size)
    ]


def greedy(model, batch, max_len):
    """The book's greedy decoding with the cache, to exactly `max_len` ids."""
    return tat.cached_greedy_decode(model, batch.src, batch.src_mask, max_len, tat.BOS)


def beam(model, batch, max_len, beam_size=4):
    """The workshop's batched beam search, every hypothesis to `max_len` ids."""
    args = (model, batch.src, batch.src_mask, max_len, tat.BOS, NEVER)
    return beam_search(*args, beam_size=beam_size, pad_symbol=tat.PAD)
