"""What the figures run: the book's model and torch.nn.Transformer at given sizes,
synthetic sentences, the book's training and decoding, and a FLOP count. Models and
batches are made on the CPU (from seeded host generators) and moved once to the
bench's device, before anything is timed. Training goes through the workshop's
pieces (training_parts), by the book's run_epoch (trainer) or one step at a time
with the loss and the optimizer marked for torch.profiler (train_step).

Every name the benchmark takes from workshop/ is imported here, and only here;
bf16_pays(device) is the workshop's rule for whether bfloat16 pays (on a GPU: its
bfloat16 hardware; on the CPU: a timed matrix product), re-exported for the figures,
parse_device(text), the command line's check of --device, re-exported for bench.py,
training_flops, the workshop's count of useful FLOPs, with memory_projections,
the layers it counts per source token, for the figures, cpu_info(), the
workshop's reading of /proc/cpuinfo (model name and flags), for timing.py, and
DecodingCache, the workshop's decoding cache, for the decoding figures.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.profiler import record_function

# The book and workshop/ are found through PYTHONPATH, which `make bench` sets to the
# repository root (PYTHONPATH=. .venv/bin/python benchmarks/bench.py by hand).
import the_annotated_transformer as tat
from workshop import fast
from workshop.distributed import parse_device as parse_device  # re-exported
from workshop.flops import memory_projections as memory_projections  # re-exported
from workshop.flops import training_flops as training_flops  # re-exported
from workshop.kv_cache import DecodingCache as DecodingCache  # re-exported
from workshop.precision import bf16_pays as bf16_pays  # re-exported, see above
from workshop.provenance import cpu_info as cpu_info  # re-exported, see above
from workshop.settings import RunConfig
from workshop.training import loss_compute_for_run, make_run_model, models_for_run
from workshop.translation import beam_search, greedy_decode

# isort: split
# This folder's modules (bench.py runs as a script, so benchmarks/ is on sys.path).
from bench_settings import MAX_SENTENCE, NEVER, TRAIN_BATCH, Sizes

# What train_step names its loss and its optimizer step in a torch.profiler trace.
LOSS_MARK, OPTIMIZER_MARK = "bench: loss", "bench: optimizer step"


def quick_profile():
    """The settings of a training run's "quick" profile (RunConfig)."""
    return RunConfig.from_profile("quick")


def quick_profile_sizes(vocab=8000):
    """The quick profile's model sizes (3 layers, d_model=128)."""
    config = quick_profile()
    return Sizes(config.N, config.d_model, config.d_ff, config.h, vocab)


def multi30k_profile():
    """The settings of a training run's "multi30k" profile (RunConfig): 3 layers,
    d_model=256, 8,000 joint subwords with shared embeddings, 2,000-token batches."""
    return RunConfig.from_profile("multi30k")


def run_model(config, vocab, seed=0, device="cpu"):
    """The model a training run with `config` trains (workshop.training's
    make_run_model: the book's model with workshop.fast's dropout and fused
    attention), `vocab` words on each side, initialised from `seed` (on the CPU, so
    the same weights on every device), on `device`."""
    torch.manual_seed(seed)
    return make_run_model(config, vocab, vocab).to(device)


def run_step_options(config):
    """training_parts' options for the step a training run with `config` takes: its
    label smoothing and warm-up, and workshop.fast's packed step when fast_step."""
    return dict(
        smoothing=config.label_smoothing,
        warmup=config.warmup,
        packed=config.fast_step,
        packed_loss=config.fast_step,
    )


def book_model_step():
    """training_parts' options for book_model's model as a run trains it: the packed
    step, where fast_step is on (RunConfig's default)."""
    return dict(packed=RunConfig.fast_step, packed_loss=RunConfig.fast_step)


def book_model(sizes, seed=0, device="cpu"):
    """run_model at `sizes`, with the run's other settings at their defaults."""
    config = RunConfig(N=sizes.N, d_model=sizes.d_model, d_ff=sizes.d_ff, h=sizes.h)
    return run_model(config, sizes.vocab, seed, device)


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


def budget_batches(n, vocab, max_tokens, seed=0, device="cpu"):
    """`n` Batches as a training run cuts them: synthetic pairs whose two sides
    have the same random length (3..MAX_SENTENCE ids, as a sentence and its
    translation nearly do), cut by the book's TokenBudgetBatchSampler into batches
    of at most `max_tokens` padded ids a side; of those, n spread evenly from the
    shortest sentences to the longest (the middle one for n=1); on `device`."""
    rng = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range((n + 10) * max_tokens // 13):  # 13.5 ids on average: n + 10 batches
        length = int(torch.randint(3, MAX_SENTENCE + 1, (1,), generator=rng))
        words = [tat.BOS, *zipf_ids(length - 2, vocab, rng), tat.EOS]
        pairs.append((words, list(words)))
    lengths = [len(src) for src, _ in pairs]
    cut = list(tat.TokenBudgetBatchSampler(lengths, max_tokens, shuffle=False))
    chosen = [cut[(2 * i + 1) * len(cut) // (2 * n)] for i in range(n)]
    return [tat.collate_batch([pairs[i] for i in c]).to(device) for c in chosen]


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


def training_parts(
    model, amp_dtype=None, smoothing=0.1, warmup=4000, packed=False, packed_loss=False
):
    """(the model to train, the loss computation, the optimizer, the schedule) with
    which training runs train `model`: workshop.fast's LabelSmoothing in the book's
    SimpleLossCompute, and make_optimizer (its fused Adam). A bfloat16 amp_dtype
    wraps the model and the loss as training runs do (the workshop's Autocast and
    AutocastLossCompute). `packed`: the model computed on its tokens alone (a run's
    fast_step, which needs make_run_model's model of fast_step=True); `packed_loss`:
    the loss from the scores of the target tokens alone (any model can take it).
    With both, a run's step with fast_step; with neither, the step before issue 43
    (for a model of fast_step=False)."""
    d_model, vocab = model.generator.proj.in_features, model.generator.proj.out_features
    criterion = fast.LabelSmoothing(vocab, tat.PAD, smoothing)
    loss_compute = loss_compute_for_run(
        model.generator, criterion, amp_dtype, packed=packed_loss
    )
    trained, _ = models_for_run(model, amp_dtype, packed=packed)
    optimizer, scheduler = tat.make_optimizer(model, model_size=d_model, warmup=warmup)
    return trained, loss_compute, optimizer, scheduler


def trainer(model, amp_dtype=None, **options):
    """A function that trains `model` on a list of Batches as the book's training
    does: training_parts (its `options`), through run_epoch; the function returns
    run_epoch's mean loss per target token."""
    trained, loss_compute, optimizer, scheduler = training_parts(
        model, amp_dtype, **options
    )

    def train(batches):
        loss, _ = tat.run_epoch(
            iter(batches), trained, loss_compute, optimizer, scheduler, mode="train"
        )
        return loss

    return train


def train_step(model, amp_dtype=None, **options):
    """A function that takes one training step of `model` on a Batch, as trainer's
    run_epoch does with one micro-batch a step, and returns its summed loss.

    It is run_epoch's loop body written out so that a torch.profiler trace can tell
    the loss computation (generator, log-softmax, label smoothing: LOSS_MARK) and the
    optimizer's step with the schedule's (the book's take_step: OPTIMIZER_MARK) from
    the rest; the pieces are training_parts', so it profiles what trainer times.
    """
    trained, loss_compute, optimizer, scheduler = training_parts(
        model, amp_dtype, **options
    )
    state = tat.TrainState()

    def step(batch):
        trained.train()
        out = trained(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        with record_function(LOSS_MARK):
            loss, loss_node = loss_compute(out, batch.tgt_y, batch.ntokens)
        loss_node.backward()
        state.count(batch)
        with record_function(OPTIMIZER_MARK):
            tat.take_step(optimizer, scheduler, state)
        return loss

    return step


def source_batches(sentences, batch_size, device="cpu"):
    """Batches of source id lists on `device`, as the book's decode_ids makes them."""
    return [
        tat.collate_batch([(ids, [tat.BOS, tat.EOS]) for ids in chunk]).to(device)
        for chunk in chunks(sentences, batch_size)
    ]


def greedy(model, batch, max_len):
    """The book's greedy decoding with the cache, to exactly `max_len` ids."""
    return tat.cached_greedy_decode(model, batch.src, batch.src_mask, max_len, tat.BOS)


def workshop_greedy(model, batch, max_len):
    """The workshop's greedy decoding (translation's, with DecodingCache), to
    exactly `max_len` ids (no end symbol)."""
    return greedy_decode(model, batch.src, batch.src_mask, max_len, tat.BOS)


def beam(model, batch, max_len, beam_size=4):
    """The workshop's batched beam search, every hypothesis to `max_len` ids."""
    args = (model, batch.src, batch.src_mask, max_len, tat.BOS, NEVER)
    return beam_search(*args, beam_size=beam_size, pad_symbol=tat.PAD)
