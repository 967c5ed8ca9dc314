"""Figures 1 to 3: training throughput against torch.nn.Transformer, the multi30k
profile's step against the step before issue 43, bf16 against fp32, model FLOP
utilisation, and the Multi30k pipeline against the original recipe.

Context, which every figure receives, holds the device every figure measures on and
measures the training runs that figures 1 and 3 share once, on first use. Our
variants train as a run with fast_step does (workshop.fast's packed step); the
reference, torch.nn.Transformer, gets the same packed loss computation and the same
fused Adam, so that the ratio is the two models' own.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

import the_annotated_transformer as tat

# isort: split
# This folder's modules (bench.py runs as a script, so benchmarks/ is on sys.path).
from bench_settings import (
    MAX_SENTENCE,
    ORIGINAL_BATCH,
    ORIGINAL_PADDING,
    QUICK,
    TRAIN_BATCH,
)
from table import Goal, Row, skipped
from timing import CPU, has_amx_bf16, median_times
from workloads import (
    TorchTransformer,
    bf16_pays,
    book_model,
    budget_batches,
    chunks,
    cpu_info,
    fixed_length_batch,
    multi30k_profile,
    padding_share,
    quick_profile,
    quick_profile_sizes,
    run_model,
    run_step_options,
    synthetic_batches,
    target_tokens,
    trainer,
    training_flops,
)

TRAINING_VARIANTS = {  # name -> (sizes, device) -> (the model on device, amp_dtype)
    "ours fp32": lambda s, device: (book_model(s, device=device), None),
    "nn.Transformer fp32": lambda s, device: (TorchTransformer(s).to(device), None),
    "ours bf16": lambda s, device: (book_model(s, device=device), torch.bfloat16),
}
PACKED_VARIANTS = ("ours fp32", "ours bf16")  # computed on their tokens alone
MULTI30K_BATCHES = 2  # batches of the multi30k figure's timed call
QUICK_MULTI30K_TOKENS = 200  # --quick's token budget for it (the profile's: 2,000)


@dataclass
class TrainingRuns:
    """The training variants' timings over the same batches."""

    batches: list  # the Batches of one pass
    seconds: dict  # variant -> median seconds of one pass
    parameters: dict  # variant -> trainable parameters

    def tokens_per_s(self, variant):
        return target_tokens(self.batches) / self.seconds[variant]


def measure_training(settings, variants, device=CPU):
    """Time one training pass over the same batches for each variant, interleaved."""
    sizes = settings.train_sizes
    batches = synthetic_batches(settings.train_batches, sizes.vocab, device=device)
    fns, parameters = {}, {}
    for name in variants:
        model, amp_dtype = TRAINING_VARIANTS[name](sizes, device)
        parameters[name] = tat.count_parameters(model)
        packed = name in PACKED_VARIANTS
        train = trainer(model, amp_dtype, packed=packed, packed_loss=True)
        fns[name] = functools.partial(train, batches)
    seconds = median_times(fns, settings.repeats, settings.warmup, device=device)
    return TrainingRuns(batches, seconds, parameters)


class Context:
    """What the figures share: the settings, the data folder, the training variants
    they need, the device (torch.device) they measure on, and the training runs."""

    def __init__(self, settings, data_dir, training_variants, device=CPU):
        self.settings = settings
        self.data_dir = data_dir
        self.training_variants = training_variants
        self.device = device

    @functools.cached_property
    def bf16(self):
        """(whether bfloat16 is worth measuring on the device, why): the rule
        `train --bf16` uses (workshop.precision.bf16_pays)."""
        return bf16_pays(self.device)

    @property
    def bf16_pays(self):
        """Whether the bf16 figures are measured."""
        return self.bf16[0]

    def bf16_skipped(self, key, figure):
        """The row for a bf16 figure on a device where bfloat16 does not pay."""
        return skipped(
            key,
            figure,
            f"{self.bf16[1]}, so `train --bf16` trains in float32 here; not measured",
        )

    @functools.cached_property
    def training(self):
        """The TrainingRuns of the variants the figures need, measured on demand."""
        variants = self.training_variants
        if "ours bf16" in variants and not self.bf16_pays:
            variants = tuple(v for v in variants if v != "ours bf16")
        return measure_training(self.settings, variants, self.device)


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
            Goal(">=", 1.5),  # issues 28 and 43: half as fast again as PyTorch's
            note=(
                f"batches of {TRAIN_BATCH} ragged sentences <= {MAX_SENTENCE} "
                f"tokens, vocabularies {sizes.vocab}; parameter counts "
                f"{'equal' if same else 'DIFFER'}; ours computes its tokens alone "
                "(fast_step), both take the packed loss and fused Adam"
            ),
        ),
        multi30k_step_row(ctx),
    ]


def multi30k_trainers(ctx, amp_dtype):
    """{path: trainer} for the multi30k profile's step: "fast" as a run with
    fast_step trains, "before" as runs trained before issue 43 (fast_step=False:
    every padded position computed, Q, K and V projected one by one, the book's
    loss computation over a log-softmax of every row). The same weights (the
    profile's seed), schedule and precision."""
    config, vocab = multi30k_profile(), multi30k_profile().bpe_vocab_size
    trainers = {}
    for path, fast_step in (("fast", True), ("before", False)):
        path_config = dataclasses.replace(config, fast_step=fast_step)
        model = run_model(path_config, vocab, seed=config.seed, device=ctx.device)
        trainers[path] = trainer(model, amp_dtype, **run_step_options(path_config))
    return trainers


def multi30k_step_row(ctx):
    """The multi30k profile's training step (issue 43's goal: twice the tokens/s of
    the step before it, on the same machine), both timed in this run."""
    figure = "multi30k step: target tokens/s, against today's eager path"
    config = multi30k_profile()
    quick = ctx.settings == QUICK
    tokens = QUICK_MULTI30K_TOKENS if quick else config.max_tokens
    amp_dtype = torch.bfloat16 if config.bf16 and ctx.bf16_pays else None
    batches = budget_batches(
        MULTI30K_BATCHES, config.bpe_vocab_size, tokens, device=ctx.device
    )
    trainers = multi30k_trainers(ctx, amp_dtype)
    for train in trainers.values():  # warm-up: one batch, not the whole call
        train(batches[:1])
    fns = {path: functools.partial(train, batches) for path, train in trainers.items()}
    seconds = median_times(fns, ctx.settings.repeats, device=ctx.device)
    speed = {path: target_tokens(batches) / s for path, s in seconds.items()}
    precision = "bf16 autocast" if amp_dtype is not None else "fp32"
    why = "" if amp_dtype is not None or not config.bf16 else f" ({ctx.bf16[1]})"
    return Row(
        "multi30k_step",
        figure,
        speed["fast"],
        "tok/s",
        "before issue 43 (fast_step=False)",
        speed["before"],
        speed["fast"] / speed["before"],
        Goal(">=", 2.0),  # issue 43
        note=(
            f"the multi30k profile's model (N={config.N} d_model={config.d_model}, "
            f"{config.bpe_vocab_size} shared subwords) in {precision}{why}; "
            f"{MULTI30K_BATCHES} synthetic batches of <= {tokens} padded ids a side "
            f"({target_tokens(batches):,} target tokens)"
        ),
    )


def loss_after(sizes, batches, amp_dtype, window=10, device=CPU):
    """Mean training loss over the last `window` of len(batches) steps.

    The model starts from the same initialisation (seed 0) and dropout draws (seed 1)
    whatever `amp_dtype` is, and uses the quick profile's warm-up so that the learning
    rate is large enough for the loss to move within a hundred steps.
    """
    model = book_model(sizes, seed=0, device=device)
    warmup = quick_profile().warmup
    train = trainer(model, amp_dtype, warmup=warmup, packed=True, packed_loss=True)
    torch.manual_seed(1)
    train(batches[:-window])
    return train(batches[-window:])  # run_epoch: mean loss per token of the window


def figure_bf16(ctx):
    """bf16 autocast against fp32 (speed), and the loss after 100 steps of each."""
    sizes, settings, device = ctx.settings.train_sizes, ctx.settings, ctx.device
    if not ctx.bf16_pays:
        return [
            ctx.bf16_skipped(
                "training_bf16", f"training, {sizes.label}, bf16 autocast"
            ),
            ctx.bf16_skipped("loss_bf16_vs_fp32", "bf16 loss against fp32"),
        ]
    fp32 = ctx.training.tokens_per_s("ours fp32")
    bf16 = ctx.training.tokens_per_s("ours bf16")
    hardware = device.type == "cuda" or has_amx_bf16()  # bf16_pays: a GPU has it
    loss_sizes = quick_profile_sizes()
    batches = synthetic_batches(
        settings.loss_steps, loss_sizes.vocab, seed=1, device=device
    )
    loss32 = loss_after(loss_sizes, batches, None, device=device)
    loss16 = loss_after(loss_sizes, batches, torch.bfloat16, device=device)
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
            Goal(">=", 1.5) if hardware else None,
            note="" if hardware else "no goal here: this CPU has no amx_bf16 (AMX)",
        ),
        Row(
            "loss_bf16_vs_fp32",
            f"bf16 loss, steps {steps - 9}-{steps}: |bf16 - fp32| / fp32",
            100 * abs(loss16 - loss32) / loss32,
            "%",
            "fp32 loss",
            loss32,
            loss16 / loss32,
            ref_unit="",
            goal=Goal("<=", 2.0, on="value"),
            note=(
                f"sizes {loss_sizes.label} (quick profile; base sizes take too "
                f"long here), vocabularies {loss_sizes.vocab}, same init and "
                f"batches; losses {loss32:.4f} fp32, {loss16:.4f} bf16"
            ),
        ),
    ]


def matmul_peak(size, dtype, settings, device=CPU):
    """FLOP/s of a square torch.mm of side `size` in `dtype` on `device` (median)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    fns = {"mm": lambda: torch.mm(a, b)}
    seconds = median_times(fns, settings.repeats, min_run_time=settings.min_run_time)
    return 2 * size**3 / seconds["mm"]


def mfu_goal(name, device):
    """Issue 43's goal for the FLOP utilisation in `name` ("fp32" or "bf16") on
    `device`, and why there is none: fp32 0.5 on a CPU; bf16 0.25 on a CPU with AMX
    and 0.45 on one with AVX-512 bf16; none on a GPU, or a CPU with neither."""
    if device.type != "cpu":
        return None, "no goal on a GPU"
    if name == "fp32":
        return Goal(">=", 0.5), ""
    if has_amx_bf16():
        return Goal(">=", 0.25), ""
    if "avx512_bf16" in cpu_info()[1]:
        return Goal(">=", 0.45), ""
    return None, "no goal: this CPU has neither AMX nor AVX-512 bf16"


def figure_mfu(ctx):
    """Useful training FLOP/s over a matrix-multiply peak of the same dtype."""
    settings, sizes = ctx.settings, ctx.settings.train_sizes
    runs = ctx.training
    flops = training_flops(book_model(sizes), runs.batches)
    rows = []
    for variant, dtype in (("ours fp32", torch.float32), ("ours bf16", torch.bfloat16)):
        name = "fp32" if dtype == torch.float32 else "bf16"
        figure = f"model FLOP utilisation, {sizes.label}, {name}"
        if variant not in runs.seconds:
            rows.append(ctx.bf16_skipped(f"mfu_{name}", figure))
            continue
        achieved = flops / runs.seconds[variant]
        side = settings.mm_size if ctx.device.type == "cpu" else settings.gpu_mm_size
        peak = matmul_peak(side, dtype, settings, ctx.device)
        goal, why = mfu_goal(name, ctx.device)
        note = "useful FLOPs: see training_flops in workshop/flops.py"
        rows.append(
            Row(
                f"mfu_{name}",
                figure,
                achieved / 1e9,
                "GFLOP/s",
                f"torch.mm {side}^2 {name}",
                peak / 1e9,
                achieved / peak,
                goal,
                note=f"{note}; {why}" if why else note,
            )
        )
    return rows


def pipeline_recipes(data, config, n):
    """The first `n` training batches of the token budget and of the original
    recipe (ORIGINAL_BATCH pairs in corpus order, padded to ORIGINAL_PADDING)."""
    sampler = tat.TokenBudgetBatchSampler(
        data.lengths("train"), config.max_tokens, seed=config.seed
    )
    pairs = data.splits["train"][: n * ORIGINAL_BATCH]
    return {
        "token budget": list(itertools.islice(data.batches("train", sampler), n)),
        "original": [
            fixed_length_batch(chunk, ORIGINAL_PADDING)
            for chunk in chunks(pairs, ORIGINAL_BATCH)
        ],
    }


def figure_pipeline(ctx):
    """Token-budget batches against the original recipe on Multi30k, same model."""
    figure = "Multi30k pipeline: non-padding target tokens/s"
    if ctx.data_dir is None:
        reason = "no data: set ANNOTATED_TRANSFORMER_DATA or pass --data"
        return [skipped("pipeline", figure, reason)]
    if not Path(ctx.data_dir).is_dir():
        return [skipped("pipeline", figure, f"{ctx.data_dir} is not a folder")]
    settings, config = ctx.settings, quick_profile()
    n = settings.pipeline_batches
    data = tat.prepare_data(
        ctx.data_dir,
        splits=("train",),
        max_len=config.max_len,
        min_freq=config.min_freq,
    )
    recipes = {  # moved to the device once, before anything is timed
        name: [batch.to(ctx.device) for batch in batches]
        for name, batches in pipeline_recipes(data, config, n).items()
    }
    fns = {}
    for name, batches in recipes.items():
        torch.manual_seed(config.seed)
        vocabs = len(data.vocab_src), len(data.vocab_tgt)
        model = config.make_model(*vocabs).to(ctx.device)
        train = trainer(model, smoothing=config.label_smoothing, warmup=config.warmup)
        train(batches[: settings.warmup])  # warm-up: a batch, not the whole pass
        fns[name] = functools.partial(train, batches)
    seconds = median_times(fns, settings.repeats, device=ctx.device)
    speed = {name: target_tokens(recipes[name]) / seconds[name] for name in recipes}
    padding = {name: 100 * padding_share(b) for name, b in recipes.items()}
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
            note=(
                f"first {n} training batches, quick-profile model; token budget "
                f"{config.max_tokens}; original: {ORIGINAL_BATCH} pairs a batch in "
                f"corpus order, padded to {ORIGINAL_PADDING}"
            ),
        ),
        Row(
            "pipeline_padding",
            "Multi30k pipeline: padding fraction of target positions",
            padding["token budget"],
            "%",
            "original recipe",
            padding["original"],
            padding["token budget"] / padding["original"],
        ),
    ]
