"""The training rows: the `multi30k` profile's training step and the step at the
paper's base sizes, each against torch.nn.Transformer built to the same sizes and
trained on the same batches with the same loss and optimizer, in fp32 and in bf16
autocast; and the base step's FLOP utilisation.

A step is what a training run does per batch: the forward pass and the book's
label-smoothed loss (SimpleLossCompute, LabelSmoothing) under autocast where bf16,
the backward pass, and the book's take_step with make_optimizer's Adam and `rate`.
The batches are cut as a run cuts them, by the book's TokenBudgetBatchSampler at the
profile's token budget, from Multi30k's training pairs in joint subwords when the data
is there, else from synthetic pairs of the same lengths.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import the_annotated_transformer as tat
from benchmarks.harness import Row, cpu_info, median_seconds, native_bf16
from workshop.run.settings import RunConfig

MULTI30K = RunConfig.from_profile("multi30k")
# Multi30k's 29,000 training pairs in the profile's 8,000 joint subwords, <s> and
# </s> included: the target has 16.3 ids on average (standard deviation 4.75), the
# source 0.54 more (standard deviation of the difference 2.73).
TARGET_LENGTH, SOURCE_EXCESS, PAIRS = (16.3, 4.75), (0.54, 2.73), 29_000
PRECISIONS = {torch.float32: "fp32", torch.bfloat16: "bf16 autocast"}
UTILISATION = "FLOP utilisation, base step, {}"
SHARED = ("share_embeddings", "tie_generator")  # make_model's options of sharing


class TorchTransformer(nn.Module):
    """torch.nn.Transformer between the book's embeddings and generator, called as
    the book's model is (ids, and masks that are True where attending is allowed),
    with make_model's sizes, pre-norm layers, shared matrices and initialisation, so
    that both have the same parameters and the same loss and optimizer train both."""

    def __init__(
        self, src_vocab, tgt_vocab, N, d_model, d_ff, h, dropout=0.1, **shared
    ):
        super().__init__()
        self.src_embed, self.tgt_embed = (
            nn.Sequential(
                tat.Embeddings(d_model, vocab), tat.PositionalEncoding(d_model, dropout)
            )
            for vocab in (src_vocab, tgt_vocab)
        )
        with warnings.catch_warnings():  # "enable_nested_tensor ... norm_first"
            warnings.simplefilter("ignore", UserWarning)
            layout = dict(layer_norm_eps=1e-6, batch_first=True, norm_first=True)
            self.transformer = nn.Transformer(d_model, h, N, N, d_ff, dropout, **layout)
        self.generator = tat.Generator(d_model, tgt_vocab)
        if shared.get("share_embeddings"):
            self.src_embed[0].lut.weight = self.tgt_embed[0].lut.weight
        if shared.get("tie_generator"):
            self.generator.proj.weight = self.tgt_embed[0].lut.weight
        tat.initialize(self)

    def forward(self, src, tgt, src_mask, tgt_mask):
        src_padding = ~src_mask[:, 0]  # (batch, src_len), True at padding
        tgt_padding = ~tgt_mask[:, -1]  # the mask's last row hides padding alone
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


def describe(sizes):
    """The sizes in words: "N=3 d_model=256 d_ff=512 h=4, shared embeddings"."""
    words = " ".join(f"{key}={sizes[key]}" for key in ("N", "d_model", "d_ff", "h"))
    shared = [what.replace("_", " ") for what in SHARED if sizes.get(what)]
    return ", ".join([words, *shared])


def model_sizes(settings):
    """{"multi30k": the profile's sizes and shared matrices, "base": the paper's
    base sizes}; settings.sizes replaces the sizes of both (not the sharing)."""
    profile = {key: getattr(MULTI30K, key) for key in ("N", "d_model", "d_ff", "h")}
    shared = {key: getattr(MULTI30K, key) for key in ("dropout", *SHARED)}
    return {
        "multi30k": {**profile, **shared, **(settings.sizes or {})},
        "base": settings.sizes or tat.BASE,
    }


def training_pairs(settings, data_dir, seed=0):
    """(id pairs, vocabulary size, where they come from): Multi30k's training pairs
    in a joint subword vocabulary learned from them, as the profile trains on, when
    `data_dir` is given; else synthetic pairs of the same lengths."""
    vocab = settings.vocab or MULTI30K.bpe_vocab_size
    if data_dir is not None:
        train = tat.read_split(data_dir, "train")[: settings.train_pairs]
        subwords = tat.SubwordVocab.build((text for p in train for text in p), vocab)
        pairs = [
            tuple(tat.encode_text(text, subwords, None, MULTI30K.max_len) for text in p)
            for p in train
        ]
        return pairs, len(subwords), f"Multi30k's training pairs in {data_dir}"
    rng = torch.Generator().manual_seed(seed)
    n, longest = settings.train_pairs or PAIRS, MULTI30K.max_len
    tgt = torch.normal(*TARGET_LENGTH, (n,), generator=rng)
    src = tgt + torch.normal(*SOURCE_EXCESS, (n,), generator=rng)
    lengths = torch.stack([src, tgt], 1).round().clamp(4, longest).int().tolist()
    ids = torch.randint(4, vocab, (n, 2, longest), generator=rng).tolist()
    pairs = [
        tuple(
            [tat.BOS, *row[: size - 2], tat.EOS]
            for row, size in zip(*pair, strict=True)
        )
        for pair in zip(ids, lengths, strict=True)
    ]
    return pairs, vocab, "synthetic pairs of Multi30k's subword lengths (no data)"


def budget_batches(pairs, max_tokens, n, device):
    """n Batches that the book's TokenBudgetBatchSampler cuts from `pairs` at
    `max_tokens` padded ids a side, spread evenly from the shortest sentences to the
    longest (so that their mix of lengths is the epoch's), on `device`."""
    lengths = [max(len(src), len(tgt)) for src, tgt in pairs]
    cut = tat.TokenBudgetBatchSampler(lengths, max_tokens, shuffle=False).all_batches()
    chosen = [cut[(2 * i + 1) * len(cut) // (2 * n)] for i in range(n)]
    return [tat.collate_batch([pairs[i] for i in c]).to(device) for c in chosen]


def trainer(model, vocab, dtype, device):
    """A function that takes one training step of `model` per Batch of a list (the
    module docstring says what a step is), in `dtype` (bf16: autocast)."""
    criterion = tat.LabelSmoothing(vocab, tat.PAD, MULTI30K.label_smoothing)
    loss_compute = tat.SimpleLossCompute(model.generator, criterion)
    optimizer, scheduler = tat.make_optimizer(model, warmup=MULTI30K.warmup)
    state, amp = tat.TrainState(), dtype == torch.bfloat16

    def train(batches):
        model.train()
        for batch in batches:
            with torch.autocast(device.type, torch.bfloat16, enabled=amp):
                out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
                _, loss = loss_compute(out, batch.tgt_y, batch.ntokens)
            loss.backward()
            state.count(batch)
            tat.take_step(optimizer, scheduler, state)

    return train


def step_flops(model, vocab, batches):
    """The FLOPs of the matrix products of a step's forward and backward passes
    over `batches`, as torch.utils.flop_counter counts them. Counted in eval mode:
    there the book's attention runs as plain products, which the counter sees (it
    does not count the CPU's fused attention kernel of training mode); the products
    are the same, and dropout does none."""
    criterion = tat.LabelSmoothing(vocab, tat.PAD, MULTI30K.label_smoothing)
    loss_compute = tat.SimpleLossCompute(model.generator, criterion)
    with FlopCounterMode(display=False) as counter, tat.evaluating(model):
        for batch in batches:
            out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
            loss_compute(out, batch.tgt_y, batch.ntokens)[1].backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def time_steps(sizes, vocab, batches, dtype, settings, device):
    """({"ours", "torch"}: median seconds of a step on every batch, the book's model
    and TorchTransformer, same initial seed), and the FLOPs of our step (step_flops,
    every matrix product, attention's included, forward and backward)."""
    fns = {}
    for name, make in (("ours", tat.make_model), ("torch", TorchTransformer)):
        torch.manual_seed(0)
        model = make(vocab, vocab, **sizes).to(device)
        if name == "ours":
            flops = step_flops(model, vocab, batches)
        fns[name] = functools.partial(trainer(model, vocab, dtype, device), batches)
    return median_seconds(fns, settings), flops


def matmul_peak(side, dtype, settings, device):
    """FLOP/s of one torch.mm of two (side, side) matrices in `dtype` on `device`."""
    a, b = (torch.randn(side, side, device=device, dtype=dtype) for _ in range(2))
    return 2 * side**3 / median_seconds({"mm": lambda: torch.mm(a, b)}, settings)["mm"]


def utilisation_goal(dtype, device):
    """(the FLOP utilisation goal for `dtype` on `device`, or None, and why none):
    fp32 0.5; bf16 0.25 with AMX, 0.45 with AVX-512 bf16; set for CPUs alone."""
    if device.type != "cpu":
        return None, "the utilisation goals are a CPU's"
    flags = cpu_info()[1]
    if dtype == torch.float32 or "amx_bf16" in flags:
        return (0.5 if dtype == torch.float32 else 0.25), ""
    return (0.45, "") if "avx512_bf16" in flags else (None, native_bf16(device)[1])


def utilisation_row(flops, seconds, dtype, settings, device, why):
    """Achieved FLOP/s of our base step over the peak of one big torch.mm."""
    side = settings.mm_side or (2048 if device.type == "cpu" else 8192)
    peak, achieved = matmul_peak(side, dtype, settings, device), flops / seconds
    limit, no_goal = utilisation_goal(dtype, device)
    return Row(
        UTILISATION.format(PRECISIONS[dtype]),
        achieved / peak,
        ">=",
        limit,
        "",
        f"{achieved / 1e9:,.1f} GFLOP/s of the step's matrix products (counted by "
        f"torch's FlopCounterMode) over torch.mm {side}^2's {peak / 1e9:,.1f}",
        why or no_goal,
    )


def training_rows(settings, device, pairs, vocab, source):
    """Yield the training rows, each as soon as it is measured."""
    has_bf16, no_bf16 = native_bf16(device)
    max_tokens = settings.max_tokens or MULTI30K.max_tokens
    steps = {
        "multi30k": (1.2, settings.step_batches),
        "base": (1.5, settings.base_batches),
    }
    for label, sizes in model_sizes(settings).items():
        goal, n = steps[label]
        batches = budget_batches(pairs, max_tokens, n, device)
        tokens = sum(batch.ntokens for batch in batches)
        padding = 1 - tokens / sum(batch.tgt_y.numel() for batch in batches)
        for dtype, precision in PRECISIONS.items():
            name = f"{label} step, {precision}: tokens/s over torch.nn.Transformer"
            why = "" if has_bf16 or dtype == torch.float32 else no_bf16
            if why and not settings.smoke:  # --smoke runs it anyway: the code runs
                yield Row(name, None, ">=", goal, "x", why=why)
                if label == "base":
                    yield Row(
                        UTILISATION.format(precision), None, ">=", None, "", why=why
                    )
                continue
            seconds, flops = time_steps(sizes, vocab, batches, dtype, settings, device)
            yield Row(
                name,
                seconds["torch"] / seconds["ours"],
                ">=",
                goal,
                "x",
                f"{tokens / seconds['ours']:,.0f} against "
                f"{tokens / seconds['torch']:,.0f} target tokens/s; {describe(sizes)}; "
                f"batches cut at {max_tokens} ids a side: {n} ({padding:.1%} padding), "
                f"from {source}",
                why,
            )
            if label == "base":
                yield utilisation_row(
                    flops, seconds["ours"], dtype, settings, device, why
                )
