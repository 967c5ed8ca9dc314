"""Performance figures of the book's examples, printed as a table (never a test).

Run with `make bench` (or `PYTHONPATH=. .venv/bin/python benchmarks/bench.py`).
Every figure of issue #6 is a ratio against a reference measured in this same run
on this same machine, after a warm-up, as the median of several repeats: the
machines are shared and absolute times drift. The table says which machine it came from.

    benchmarks/bench.py                      every figure (several minutes on 2 cores)
    benchmarks/bench.py --quick              a fast smoke: smaller sizes, one repeat
    benchmarks/bench.py --only decoding,beam selected figures (names: see --help)
    benchmarks/bench.py --json out.json      where to write the figures as JSON

A full run writes benchmarks/results.json; a `--quick` or `--only` run writes JSON
only when `--json` is given, so it never overwrites the full figures.
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

# The book and workshop/ are found through PYTHONPATH, which `make bench` sets to the
# repository root (PYTHONPATH=. .venv/bin/python benchmarks/bench.py by hand).
import the_annotated_transformer as tat
from workshop import fast
from workshop.runs import (
    RunConfig,
    bf16_matmul_speedup,
    loss_compute_for_run,
    models_for_run,
)

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_JSON = "benchmarks/results.json"
MAX_SENTENCE = 24  # issue #6: ragged sentences of up to 24 tokens
TRAIN_BATCH = 32  # sentences per synthetic training batch
ORIGINAL_BATCH, ORIGINAL_PADDING = 32, 72  # the 2018 notebook's Multi30k recipe
TRANSLATE_BATCH = 64  # Translator.translate's default batch_size
NEVER = -1  # an end symbol no token id equals: decoding runs to max_len


# ---------------------------------------------------------------------------------
# Settings


@dataclass(frozen=True)
class Sizes:
    """Model sizes; the vocabulary is used for both source and target."""

    N: int
    d_model: int
    d_ff: int
    h: int
    vocab: int = 8000

    @property
    def label(self):
        return f"N={self.N} d_model={self.d_model} h={self.h} d_ff={self.d_ff}"

    def make_model(self, seed=0):
        """The book's model at these sizes, initialised from `seed`, with the dropout
        and the fused attention that training runs use (workshop.fast)."""
        torch.manual_seed(seed)
        model = tat.make_model(
            self.vocab, self.vocab, self.N, self.d_model, self.d_ff, self.h
        )
        return fast.use_fused_attention(fast.use_fast_dropout(model))


def quick_profile_sizes(vocab=8000):
    """The sizes of TrainConfig's "quick" profile (3 layers, d_model=128)."""
    config = RunConfig.from_profile("quick")
    return Sizes(config.N, config.d_model, config.d_ff, config.h, vocab)


BASE = Sizes(N=6, d_model=512, d_ff=2048, h=8)
SMALL = Sizes(N=2, d_model=256, d_ff=1024, h=4)  # --quick's stand-in for BASE


@dataclass(frozen=True)
class Settings:
    """How much work each figure does; `--quick` swaps in QUICK."""

    repeats: int = 3  # timed repeats per measurement (the median is reported)
    warmup: int = 1  # untimed calls before them
    train_sizes: Sizes = BASE  # figures 1, 3 and 6
    train_batches: int = 1  # batches in one timed training repeat
    loss_steps: int = 100  # figure 1's bf16 loss check; mean over the last 10
    pipeline_batches: int = 50
    decode_sizes: Sizes = BASE  # figure 4's cache comparison
    decode_tokens: int = 40
    sentences: int = 1000  # figure 4: translated batched ...
    one_at_a_time: int = 100  # ... and this many one at a time (extrapolated)
    mm_size: int = 2048  # side of the square matrices of the matmul peak
    copy_epochs: int | None = None  # None: the copy task's own schedule
    copy_seeds: tuple = tuple(range(10))  # each trained, then 200 sequences decoded


QUICK = Settings(
    repeats=1,
    train_sizes=SMALL,
    loss_steps=12,
    pipeline_batches=3,
    decode_sizes=SMALL,
    decode_tokens=10,
    sentences=64,
    one_at_a_time=2,
    mm_size=1024,
    copy_epochs=2,
    copy_seeds=(0,),
)


# ---------------------------------------------------------------------------------
# One row of the table


def number(x, unit=""):
    """`x` with a sensible number of digits, and its unit."""
    if x is None:
        return "-"
    digits = f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return f"{digits} {unit}".strip() if unit != "%" else f"{digits}%"


@dataclass(frozen=True)
class Goal:
    """Issue #6's target for a row: its `ratio` (or its `value`) `op` `limit`."""

    op: str  # ">=", "<=" or "<"
    limit: float
    on: str = "ratio"

    def met(self, row):
        x = getattr(row, self.on)
        return {">=": x >= self.limit, "<=": x <= self.limit, "<": x < self.limit}[
            self.op
        ]

    def text(self, unit):
        if self.on == "ratio":
            return f"{self.op} {self.limit:g}x"
        return f"{self.op} {number(self.limit, unit)}"


@dataclass
class Row:
    """One figure: its value, the reference measured beside it, and the ratio."""

    key: str  # the name in the JSON file
    figure: str
    value: float | None  # None: skipped (the note says why)
    unit: str = ""
    reference: str = ""  # what the value is compared with
    ref_value: float | None = None
    ratio: float | None = None  # the direction is stated in `figure`
    goal: Goal | None = None
    ok: bool = True  # a condition besides the goal (e.g. the copy was exact)
    note: str = ""
    ref_unit: str | None = None  # the reference's unit; None: the value's

    @property
    def met(self):
        """Whether the goal is met (None: no goal, or skipped)."""
        if self.goal is None or self.value is None:
            return None
        return self.ok and self.goal.met(self)

    def to_json(self):
        values = asdict(self)
        values["goal"] = self.goal.text(self.unit) if self.goal else None
        values["met"] = self.met
        return values


def skipped(key, figure, reason):
    """A row for a figure that could not be measured here."""
    return Row(key, figure, None, note=f"skipped: {reason}")


# ---------------------------------------------------------------------------------
# Timing


def median_times(fns, repeats, warmup):
    """Median seconds of each function in the dict `fns`, called interleaved.

    Each round calls every function once, so drift in the machine's speed hits them
    all alike; `warmup` untimed rounds come first.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def median_time(fn, repeats, warmup):
    """Median seconds of `fn()` over `repeats` calls, after `warmup` untimed ones."""
    return median_times({"fn": fn}, repeats, warmup)["fn"]


def fresh_process_time(code):
    """Seconds to run `python -c code` in a new process from the project root."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------
# The machine


@functools.cache
def cpu_info():
    """(model name, set of flags) of the first CPU in /proc/cpuinfo."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return name, flags
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name != value.strip():
            name = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break
    return name, flags


def has_amx_bf16():
    """Whether this CPU has AMX bfloat16 matrix instructions (`amx_bf16`)."""
    return "amx_bf16" in cpu_info()[1]


def machine():
    """A one-line description of this machine."""
    name, _ = cpu_info()
    return (
        f"{name}, {os.cpu_count()} cores, amx_bf16: "
        f"{'yes' if has_amx_bf16() else 'no'}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )


# ---------------------------------------------------------------------------------
# Synthetic data and models


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


def synthetic_batches(n, vocab, batch_size=TRAIN_BATCH, seed=0):
    """`n` Batches of `batch_size` ragged sentence pairs, padded with the book's PAD."""
    pairs = synthetic_pairs(n * batch_size, vocab, seed=seed)
    return [tat.collate_batch(chunk) for chunk in chunks(pairs, batch_size)]


def fixed_length_batch(examples, length, pad=tat.PAD):
    """A Batch of (src_ids, tgt_ids) pairs, every sentence padded to `length` ids."""

    def padded(side):
        ids = torch.full((len(examples), length), pad, dtype=torch.long)
        for row, example in enumerate(examples):
            ids[row, : len(example[side])] = torch.tensor(example[side][:length])
        return ids

    return tat.Batch(padded(0), padded(1), pad)


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
        future = ~tat.subsequent_mask(tgt.size(1))[0]  # (tgt_len, tgt_len)
        return self.transformer(
            self.src_embed(src),
            self.tgt_embed(tgt),
            tgt_mask=future.to(tgt.device),
            src_key_padding_mask=src_padding,
            tgt_key_padding_mask=tgt_padding,
            memory_key_padding_mask=src_padding,
            tgt_is_causal=True,
        )


def trainer(model, amp_dtype=None, smoothing=0.1, warmup=4000):
    """A function that trains `model` on a list of Batches as the book's training does.

    LabelSmoothing (workshop.fast's, as training runs use) + SimpleLossCompute +
    make_optimizer, through run_epoch; the function returns run_epoch's mean loss per
    target token. A bfloat16 amp_dtype wraps the model and the loss as training runs
    do (workshop.runs' Autocast and AutocastLossCompute).
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


def target_tokens(batches):
    """Non-padding target tokens in `batches`."""
    return sum(b.ntokens for b in batches)


# ---------------------------------------------------------------------------------
# Figure 1 and 3: training throughput, shared by several rows

TRAINING_VARIANTS = {
    "ours fp32": lambda sizes: (sizes.make_model(), None),
    "nn.Transformer fp32": lambda sizes: (TorchTransformer(sizes), None),
    "ours bf16": lambda sizes: (sizes.make_model(), torch.bfloat16),
}


@dataclass
class TrainingRuns:
    """The training variants' timings over the same batches."""

    batches: list  # the Batches of one pass
    seconds: dict  # variant -> median seconds of one pass
    parameters: dict  # variant -> trainable parameters

    def tokens_per_s(self, variant):
        return target_tokens(self.batches) / self.seconds[variant]


def measure_training(settings, variants):
    """Time one training pass over the same batches for each variant, interleaved."""
    sizes = settings.train_sizes
    batches = synthetic_batches(settings.train_batches, sizes.vocab)
    fns, parameters = {}, {}
    for name in variants:
        model, amp_dtype = TRAINING_VARIANTS[name](sizes)
        parameters[name] = tat.count_parameters(model)
        fns[name] = functools.partial(trainer(model, amp_dtype), batches)
    seconds = median_times(fns, settings.repeats, settings.warmup)
    return TrainingRuns(batches, seconds, parameters)


def loss_after(sizes, batches, amp_dtype, window=10):
    """Mean training loss over the last `window` of len(batches) steps.

    The model starts from the same initialisation (seed 0) and dropout draws (seed 1)
    whatever `amp_dtype` is, and uses the quick profile's warm-up so that the learning
    rate is large enough for the loss to move within a hundred steps.
    """
    model = sizes.make_model(seed=0)
    train = trainer(model, amp_dtype, warmup=RunConfig.from_profile("quick").warmup)
    torch.manual_seed(1)
    train(batches[:-window])
    return train(batches[-window:])  # run_epoch: mean loss per token of the window


def training_flops(model, batches):
    """Useful FLOPs of one training pass of `model` over `batches`.

    Per sentence with s source and t target tokens (padding excluded: it is work, but
    not useful work), over N layers of width d:

        6 * (P_enc * s + (P_dec + P_gen) * t)      matrix multiplies by the weights
      + 12 * N * d * (s^2 + t^2 + s*t)             attention scores and mixing

    P_enc, P_dec, P_gen are the weight-matrix parameters of the encoder, decoder and
    generator (embedding lookups are not multiplies). A forward pass multiplies and
    adds once per weight per token (2 FLOPs); the backward pass costs twice that,
    hence 6. Each attention layer forms Q K^T and weights V, 2 * L_q * L_k * d FLOPs
    each forward, 3 times that with backward: 12 * L_q * L_k * d, for encoder self-
    attention (s * s), decoder self-attention (t * t, the causal half included) and
    cross-attention (t * s).
    """

    def matrices(module):
        return sum(p.numel() for p in module.parameters() if p.dim() == 2)

    p_enc, p_dec = matrices(model.encoder), matrices(model.decoder)
    p_gen = matrices(model.generator)
    n_layers, d_model = len(model.encoder.layers), model.generator.proj.in_features
    flops = 0
    for batch in batches:
        s = batch.src_mask[:, 0].sum(-1).double()  # (batch,) real source tokens
        t = (batch.tgt_y != tat.PAD).sum(-1).double()  # (batch,) real target tokens
        matmuls = 6 * (p_enc * s + (p_dec + p_gen) * t)
        attention = 12 * n_layers * d_model * (s * s + t * t + s * t)
        flops += float((matmuls + attention).sum())
    return flops


def matmul_peak(size, dtype, repeats, warmup):
    """FLOP/s of a square torch.mm of side `size` in `dtype` (median of repeats)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    seconds = median_time(lambda: torch.mm(a, b), max(repeats, 5), max(warmup, 1))
    return 2 * size**3 / seconds


class Context:
    """What the figures share: the settings, the data folder and the training runs."""

    def __init__(self, settings, data_dir, training_variants):
        self.settings = settings
        self.data_dir = data_dir
        self.training_variants = training_variants

    @functools.cached_property
    def bf16_speedup(self):
        """The book's probe: one float32 matrix product's time over a bfloat16 one's."""
        return bf16_matmul_speedup("cpu")

    @property
    def bf16_pays(self):
        """Whether bfloat16 is worth measuring here (the rule `train --bf16` uses)."""
        return self.bf16_speedup >= 1.0

    def bf16_skipped(self, key, figure):
        """The row for a bf16 figure on a CPU where the probe found bf16 hopeless."""
        return skipped(
            key,
            figure,
            f"a bfloat16 matrix product runs at {self.bf16_speedup:.2f}x float32 "
            "on this CPU, so `train --bf16` trains in float32 here; not measured",
        )

    @functools.cached_property
    def training(self):
        """The TrainingRuns of the variants the figures need, measured on demand."""
        variants = self.training_variants
        if "ours bf16" in variants and not self.bf16_pays:
            variants = tuple(v for v in variants if v != "ours bf16")
        return measure_training(self.settings, variants)


def figure_training(ctx):
    """Our training step against torch.nn.Transformer, same sizes and batches."""
    sizes = ctx.settings.train_sizes
    runs = ctx.training
    ours, ref = runs.tokens_per_s("ours fp32"), runs.tokens_per_s("nn.Transformer fp32")
    same = runs.parameters["ours fp32"] == runs.parameters["nn.Transformer fp32"]
    return [
        Row(
            "training_fp32",
            f"training, {sizes.label}, fp32: target tokens/s",
            ours,
            "tok/s",
            "torch.nn.Transformer",
            ref,
            ours / ref,
            Goal(">=", 1.0),
            note=(
                f"batches of {TRAIN_BATCH} ragged sentences <= {MAX_SENTENCE} "
                f"tokens, vocabularies {sizes.vocab}; parameter counts "
                f"{'equal' if same else 'DIFFER'}"
            ),
        )
    ]


def figure_bf16(ctx):
    """bf16 autocast against fp32 (speed), and the loss after 100 steps of each."""
    sizes, settings = ctx.settings.train_sizes, ctx.settings
    if not ctx.bf16_pays:
        return [
            ctx.bf16_skipped(
                "training_bf16", f"training, {sizes.label}, bf16 autocast"
            ),
            ctx.bf16_skipped("loss_bf16_vs_fp32", "bf16 loss against fp32"),
        ]
    fp32 = ctx.training.tokens_per_s("ours fp32")
    bf16 = ctx.training.tokens_per_s("ours bf16")
    amx = has_amx_bf16()
    loss_sizes = quick_profile_sizes()
    batches = synthetic_batches(settings.loss_steps, loss_sizes.vocab, seed=1)
    loss32 = loss_after(loss_sizes, batches, None)
    loss16 = loss_after(loss_sizes, batches, torch.bfloat16)
    steps = settings.loss_steps
    return [
        Row(
            "training_bf16",
            f"training, {sizes.label}, bf16 autocast: target tokens/s",
            bf16,
            "tok/s",
            "ours, fp32",
            fp32,
            bf16 / fp32,
            Goal(">=", 1.5) if amx else None,
            note="" if amx else "no goal here: this CPU has no amx_bf16 (AMX)",
        ),
        Row(
            "loss_bf16_vs_fp32",
            f"bf16 loss, steps {steps - 9}-{steps}: |bf16 - fp32| / fp32",
            100 * abs(loss16 - loss32) / loss32,
            "%",
            "fp32 loss",
            loss32,
            ref_unit="",
            goal=Goal("<=", 2.0, on="value"),
            note=(
                f"sizes {loss_sizes.label} (quick profile; base sizes take too "
                f"long here), vocabularies {loss_sizes.vocab}, same init and "
                f"batches; losses {loss32:.4f} fp32, {loss16:.4f} bf16"
            ),
        ),
    ]


def figure_mfu(ctx):
    """Useful training FLOP/s over a matrix-multiply peak of the same dtype."""
    settings, sizes = ctx.settings, ctx.settings.train_sizes
    runs = ctx.training
    flops = training_flops(sizes.make_model(), runs.batches)
    rows = []
    for variant, dtype in (("ours fp32", torch.float32), ("ours bf16", torch.bfloat16)):
        name = "fp32" if dtype == torch.float32 else "bf16"
        if variant not in runs.seconds:
            figure = f"model FLOP utilisation, {sizes.label}, {name}"
            rows.append(ctx.bf16_skipped(f"mfu_{name}", figure))
            continue
        achieved = flops / runs.seconds[variant]
        peak = matmul_peak(settings.mm_size, dtype, settings.repeats, settings.warmup)
        rows.append(
            Row(
                f"mfu_{name}",
                f"model FLOP utilisation, {sizes.label}, {name}",
                achieved / 1e9,
                "GFLOP/s",
                f"torch.mm {settings.mm_size}^2 {name}",
                peak / 1e9,
                achieved / peak,
                note="useful FLOPs: see training_flops in benchmarks/bench.py",
            )
        )
    return rows


# ---------------------------------------------------------------------------------
# Figure 2: the real-data pipeline


def figure_pipeline(ctx):
    """Token-budget batches against the original recipe on Multi30k, same model."""
    figure = "Multi30k pipeline: non-padding target tokens/s"
    if ctx.data_dir is None:
        return [
            skipped(
                "pipeline",
                figure,
                "no data: set ANNOTATED_TRANSFORMER_DATA or pass --data",
            )
        ]
    if not Path(ctx.data_dir).is_dir():
        return [skipped("pipeline", figure, f"{ctx.data_dir} is not a folder")]
    settings, config = ctx.settings, RunConfig.from_profile("quick")
    n = settings.pipeline_batches
    data = tat.prepare_data(
        ctx.data_dir,
        splits=("train",),
        max_len=config.max_len,
        min_freq=config.min_freq,
    )
    sampler = tat.TokenBudgetBatchSampler(
        data.lengths("train"), config.max_tokens, seed=config.seed
    )
    recipes = {
        "token budget": list(itertools.islice(data.batches("train", sampler), n)),
        "original": [
            fixed_length_batch(chunk, ORIGINAL_PADDING)
            for chunk in chunks(
                data.splits["train"][: n * ORIGINAL_BATCH], ORIGINAL_BATCH
            )
        ],
    }
    fns = {}
    for name, batches in recipes.items():
        torch.manual_seed(config.seed)
        model = config.make_model(len(data.vocab_src), len(data.vocab_tgt))
        train = trainer(model, smoothing=config.label_smoothing, warmup=config.warmup)
        train(batches[: settings.warmup])  # warm-up: a batch, not the whole pass
        fns[name] = functools.partial(train, batches)
    seconds = median_times(fns, settings.repeats, warmup=0)
    speed = {name: target_tokens(recipes[name]) / seconds[name] for name in recipes}
    padding = {name: tat.padding_fraction(b) for name, b in recipes.items()}
    note = (
        f"first {n} training batches, quick-profile model; token budget "
        f"{config.max_tokens}; original: {ORIGINAL_BATCH} pairs a batch in corpus "
        f"order, padded to {ORIGINAL_PADDING}"
    )
    return [
        Row(
            "pipeline",
            figure,
            speed["token budget"],
            "tok/s",
            "original recipe",
            speed["original"],
            speed["token budget"] / speed["original"],
            Goal(">=", 3.0),
            note=note,
        ),
        Row(
            "pipeline_padding",
            "Multi30k pipeline: padding fraction of target positions",
            100 * padding["token budget"],
            "%",
            "original recipe",
            100 * padding["original"],
        ),
    ]


# ---------------------------------------------------------------------------------
# Figure 4: decoding


def random_memory(model, batch, src_len=20, seed=0):
    """The encoder's memory of `batch` random sources: (memory, src_mask)."""
    rng = torch.Generator().manual_seed(seed)
    vocab = len(model.src_embed[0])
    src = torch.randint(4, vocab, (batch, src_len), generator=rng)
    src_mask = torch.ones(batch, 1, src_len, dtype=torch.bool)
    with torch.no_grad():
        return model.encode(src, src_mask), src_mask


def time_decoding(model, memory, src_mask, steps, cache=None):
    """Seconds to greedily generate `steps` tokens (with `cache`, if given)."""
    ys = torch.zeros(memory.size(0), 1, dtype=torch.long, device=memory.device)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            log_probs = tat.decode_step(model, memory, src_mask, ys, cache)
            ys = torch.cat([ys, log_probs.argmax(-1, keepdim=True)], dim=1)
    return time.perf_counter() - start


def figure_decoding(ctx):
    """Greedy decoding with the key/value cache against without."""
    settings, sizes = ctx.settings, ctx.settings.decode_sizes
    steps = settings.decode_tokens
    model = sizes.make_model().eval()
    rows = []
    for batch, goal in ((1, Goal(">=", 3.0)), (64, None)):
        memory, src_mask = random_memory(model, batch)

        def timed(cached, steps, memory=memory, src_mask=src_mask):
            cache = tat.KVCache(model) if cached else None  # fresh for every call
            return time_decoding(model, memory, src_mask, steps, cache)

        for cached in (False, True):  # warm-up: a few steps, not the whole length
            timed(cached, 2)
        seconds = median_times(
            {
                cached: functools.partial(timed, cached, steps)
                for cached in (False, True)
            },
            settings.repeats,
            warmup=0,
        )
        rows.append(
            Row(
                f"greedy_cache_batch{batch}",
                f"greedy, {steps} tokens, {sizes.label}, batch {batch}: speed-up",
                seconds[True],
                "s",
                "without the cache",
                seconds[False],
                seconds[False] / seconds[True],
                goal,
                note="value: seconds with the cache",
            )
        )
    return rows


def source_batches(sentences, batch_size):
    """Batches of source id lists, as the book's decode_ids collates them."""
    return [
        tat.collate_batch([(ids, [tat.BOS, tat.EOS]) for ids in chunk])
        for chunk in chunks(sentences, batch_size)
    ]


def greedy_all(model, batches, max_len):
    """Greedy-decode every batch to exactly `max_len` ids (no end symbol)."""
    for batch in batches:
        tat.cached_greedy_decode(model, batch.src, batch.src_mask, max_len, tat.BOS)


def figure_batching(ctx):
    """Translating many sentences in batches against one sentence at a time."""
    settings = ctx.settings
    sizes, n, k = quick_profile_sizes(), settings.sentences, settings.one_at_a_time
    model = sizes.make_model().eval()  # random weights: only the time matters
    sentences = [src for src, _ in synthetic_pairs(n, sizes.vocab)]
    max_len = settings.decode_tokens + 1  # the start symbol, then the tokens
    batched = source_batches(sentences, TRANSLATE_BATCH)
    single = source_batches(sentences[:k], 1)
    seconds = median_times(
        {
            "batched": functools.partial(greedy_all, model, batched, max_len),
            "single": functools.partial(greedy_all, model, single, max_len),
        },
        settings.repeats,
        settings.warmup,
    )
    one_by_one = seconds["single"] / k * n  # extrapolated from k sentences
    return [
        Row(
            "translate_batched",
            f"translate {n} sentences, {settings.decode_tokens} tokens each, "
            f"batches of {TRANSLATE_BATCH}: speed-up",
            seconds["batched"],
            "s",
            "one at a time",
            one_by_one,
            one_by_one / seconds["batched"],
            Goal(">=", 5.0),
            note=(
                f"quick-profile sizes, random weights, greedy with the cache; one at "
                f"a time timed on {k} sentences and extrapolated to {n}"
            ),
        )
    ]


def figure_beam(ctx):
    """Beam search (k = 4) against greedy decoding, same sentences and length."""
    settings = ctx.settings
    sizes = quick_profile_sizes()
    model = sizes.make_model().eval()
    max_len = settings.decode_tokens + 1
    sentences = [src for src, _ in synthetic_pairs(TRANSLATE_BATCH, sizes.vocab)]
    rows = []
    for batch_size in (1, TRANSLATE_BATCH):
        (batch,) = source_batches(sentences[:batch_size], batch_size)
        args = (model, batch.src, batch.src_mask, max_len, tat.BOS)
        seconds = median_times(
            {
                "greedy": functools.partial(tat.cached_greedy_decode, *args),
                "beam": functools.partial(
                    fast.beam_search, *args, NEVER, beam_size=4, pad_symbol=tat.PAD
                ),
            },
            settings.repeats,
            settings.warmup,
        )
        rows.append(
            Row(
                f"beam4_batch{batch_size}",
                f"beam 4, {settings.decode_tokens} tokens, batch {batch_size}: "
                "time / greedy's",
                seconds["beam"],
                "s",
                "greedy",
                seconds["greedy"],
                seconds["beam"] / seconds["greedy"],
                Goal("<=", 3.0),
                note="quick-profile sizes, random weights; no end symbol: full length",
            )
        )
    return rows


# ---------------------------------------------------------------------------------
# Figure 5: start-up


def figure_startup(ctx):
    """Import time against importing torch alone; the copy task's wall time."""
    settings = ctx.settings
    seconds = median_times(
        {
            module: functools.partial(fresh_process_time, f"import {module}")
            for module in ("torch", "the_annotated_transformer")
        },
        settings.repeats,
        settings.warmup,
    )
    copies, copy_seconds = copy_task_by_seed(settings)
    exact = all(n == 200 for n in copies.values())
    config = tat.CopyTaskConfig()
    epochs = config.epochs if settings.copy_epochs is None else settings.copy_epochs
    seeds = f"seeds {min(copies)}-{max(copies)}" if len(copies) > 1 else "seed 0"
    return [
        Row(
            "import",
            "import the_annotated_transformer (fresh process)",
            seconds["the_annotated_transformer"],
            "s",
            "import torch",
            seconds["torch"],
            seconds["the_annotated_transformer"] / seconds["torch"],
        ),
        Row(
            "copy_task",
            f"copy task, {epochs} epochs: train + decode 200 sequences (seed 0)",
            copy_seconds[min(copies)],
            "s",
            goal=Goal("<", 60.0, on="value"),
            ok=exact,
            note=f"exact copy: {'yes' if exact else 'NO'} for every seed",
        ),
        Row(
            "copy_task_exact",
            f"copy task, {seeds}: sequences of 200 copied exactly, fewest",
            float(min(copies.values())),
            note="per seed: "
            + ", ".join(f"{seed}: {n}/200" for seed, n in copies.items()),
        ),
    ]


def copy_task_by_seed(settings):
    """Per seed: how many of 200 held-out sequences come back exactly, and seconds."""
    copies, seconds = {}, {}
    for seed in settings.copy_seeds:
        config = tat.CopyTaskConfig(seed=seed)
        if settings.copy_epochs is not None:
            config = tat.CopyTaskConfig(epochs=settings.copy_epochs, seed=seed)
        start = time.perf_counter()
        model, _ = tat.train_copy_task(config, quiet=True, device="cpu")
        src, out = tat.copy_examples(model, config, n=200)
        seconds[seed] = time.perf_counter() - start
        copies[seed] = int((src == out).all(dim=1).sum())
        print(f"  copy task, seed {seed}: {copies[seed]}/200 exact", file=sys.stderr)
    return copies, seconds


# ---------------------------------------------------------------------------------
# Figure 6: memory


def max_rss_mib():
    """This process's peak resident memory so far, in MiB.

    Linux's VmHWM first: ru_maxrss survives exec, so a probe started from a process
    that had already used gigabytes would report the parent's peak.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_probe(spec):
    """Run in a fresh process: peak RSS after import, and after two training steps."""
    sizes = Sizes(**spec["sizes"])
    baseline = max_rss_mib()
    batches = synthetic_batches(1, sizes.vocab, batch_size=spec["batch_size"])
    train = trainer(sizes.make_model())
    train(batches)
    train(batches)  # the second step: the optimizer's state exists by now
    print(json.dumps({"baseline_mib": baseline, "peak_mib": max_rss_mib()}))


def measure_memory(sizes, batch_size):
    """{"baseline_mib", "peak_mib"} of a training step, from a fresh process."""
    spec = json.dumps({"sizes": asdict(sizes), "batch_size": batch_size})
    result = subprocess.run(
        [sys.executable, __file__, "--memory-probe", spec],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(result.stdout.splitlines()[-1])


def figure_memory(ctx):
    """Peak resident memory of a base-size and of a quick-profile training step."""
    quick = RunConfig.from_profile("quick")
    cases = (
        ("memory_base", ctx.settings.train_sizes, TRAIN_BATCH, "figure 1's batches"),
        (
            "memory_quick",
            quick_profile_sizes(),
            quick.max_tokens // MAX_SENTENCE,
            f"a batch of the profile's {quick.max_tokens}-token budget",
        ),
    )
    rows = []
    for key, sizes, batch_size, batch_text in cases:
        rss = measure_memory(sizes, batch_size)
        rows.append(
            Row(
                key,
                f"peak resident memory, training step, {sizes.label}",
                rss["peak_mib"],
                "MiB",
                "after import",
                rss["baseline_mib"],
                note=(
                    f"{rss['peak_mib'] - rss['baseline_mib']:,.0f} MiB over the "
                    f"baseline; {batch_size} sentences <= {MAX_SENTENCE} tokens "
                    f"({batch_text}), vocabularies {sizes.vocab}, Adam"
                ),
            )
        )
    return rows


# ---------------------------------------------------------------------------------
# The table

FIGURES = {
    "training": figure_training,
    "bf16": figure_bf16,
    "mfu": figure_mfu,
    "pipeline": figure_pipeline,
    "decoding": figure_decoding,
    "batching": figure_batching,
    "beam": figure_beam,
    "startup": figure_startup,
    "memory": figure_memory,
}
FIGURE_NEEDS = {  # the training variants each figure reads from Context.training
    "training": ("ours fp32", "nn.Transformer fp32"),
    "bf16": ("ours fp32", "ours bf16"),
    "mfu": ("ours fp32", "ours bf16"),
}


def print_table(rows):
    """Print the rows: figure, value, reference, ratio, goal and whether it is met."""
    print(f"{'figure':66s} {'value':>14s}  {'reference':34s} {'ratio':>7s}  goal")
    for row in rows:
        if row.value is None:
            print(f"{row.figure:66s} {'skipped':>14s}")
        else:
            ref_unit = row.unit if row.ref_unit is None else row.ref_unit
            reference = (
                f"{row.reference} {number(row.ref_value, ref_unit)}"
                if row.reference
                else ""
            )
            ratio = f"{row.ratio:.2f}x" if row.ratio is not None else ""
            goal = row.goal.text(row.unit) if row.goal else ""
            verdict = {True: " (met)", False: " (NOT met)", None: ""}[row.met]
            print(
                f"{row.figure:66s} {number(row.value, row.unit):>14s}  "
                f"{reference:34s} {ratio:>7s}  {goal}{verdict}"
            )
        if row.note:
            print(f"    {row.note}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fast smoke run")
    parser.add_argument(
        "--only", help=f"comma-separated figures to run, of: {', '.join(FIGURES)}"
    )
    parser.add_argument(
        "--json",
        help=f"write the figures here (default for a full run: {DEFAULT_JSON})",
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=tat.data_dir_from_env(),
        help=f"the Multi30k folder (default: ${tat.DATA_ENV})",
    )
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(FIGURES)
    unknown = [name for name in names if name not in FIGURES]
    if unknown:
        parser.error(f"unknown figure(s) {unknown}; choose from {list(FIGURES)}")
    args.names = names
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.memory_probe:
        return memory_probe(json.loads(args.memory_probe))
    settings = QUICK if args.quick else Settings()
    variants = tuple(
        dict.fromkeys(v for name in args.names for v in FIGURE_NEEDS.get(name, ()))
    )
    ctx = Context(settings, args.data, variants)
    print(f"machine: {machine()}", flush=True)
    if args.quick:
        print(
            "--quick: a smoke run (smaller sizes, one repeat); not figures to quote",
            flush=True,
        )
    rows = []
    for name in args.names:
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        rows.extend(FIGURES[name](ctx))
    print_table(rows)
    full = not args.quick and args.only is None
    path = args.json or (DEFAULT_JSON if full else None)
    if path:
        results = {
            "machine": machine(),
            "amx_bf16": has_amx_bf16(),
            "settings": asdict(settings) | {"quick": args.quick},
            "figures": {row.key: row.to_json() for row in rows},
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
