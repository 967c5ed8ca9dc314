"""The profile (issue 43): where a training step's time goes, from torch.profiler.

For the base-size step and the `multi30k` profile's step, each in fp32 and in bf16
autocast, the bench warms a few steps up, times them, then profiles them again
(workloads.train_step: the workshop's training pieces, one step at a time) and sorts
every op's own time into the categories of CATEGORIES. Each category is a row: its
share of the step (the value), its milliseconds per step (the reference column) and
its op calls per step (the note). "Python/dispatch" is the step's wall time that no
op's own time accounts for: the interpreter, the dispatcher, autograd's bookkeeping
and the profiler's own cost (each step's first row puts the profiled step beside the
unprofiled one, which shows that cost). Where bfloat16 is emulated (a CPU without
bf16 instructions, where `train --bf16` trains in float32), a full run reports the
bf16 rows skipped, as a step takes tens of seconds; --quick profiles them at its
small sizes. The step profiled is the one a training run takes (workloads'
run_step_options: the packed step where fast_step is on), so each change to the
training path is judged by the same rows; docs/performance.md keeps the "before" of
issue 43 beside them.

How an op is judged (categorize): by its own name, its callers' names and, in the
backward pass, the names of the forward op whose gradient it computes and of that
op's callers (autograd gives both the same sequence number). Of the categories these
names match, the first in CATEGORIES wins: a cast inside a matrix product is a cast,
a matrix product inside attention is attention, the generator's matrix product
inside the loss is a matrix product. An op that matches nothing is "other", and its
note names the largest such ops. On a GPU an op's time is its kernels' time, and
Python/dispatch is the time the GPU waits for the host.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity

# isort: split
# This folder's modules (bench.py runs as a script, so benchmarks/ is on sys.path).
from bench_settings import QUICK, TRAIN_BATCH, Sizes
from table import Row, skipped
from timing import synchronize
from workloads import (
    LOSS_MARK,
    OPTIMIZER_MARK,
    book_model,
    book_model_step,
    budget_batches,
    multi30k_profile,
    run_model,
    run_step_options,
    synthetic_batches,
    train_step,
)

# What an op that changes a tensor's dtype is judged as, besides aten::_to_copy's own
# name: an aten::copy_ between two dtypes (the profiler's record of its arguments
# tells it from a plain copy, which is element-wise) and an aten::to that copies (one
# that returns its input unchanged has no aten::_to_copy inside).
CONVERSION = "a dtype conversion"


@dataclass(frozen=True)
class Category:
    """A row of the profile: its key in the JSON file, its name in the table, and
    the op names (fnmatch patterns, case-sensitive) that belong to it."""

    key: str
    name: str
    patterns: tuple = ()

    @functools.cached_property
    def regex(self):
        return re.compile("|".join(fnmatch.translate(p) for p in self.patterns))

    def matches(self, name):
        return bool(self.patterns) and self.regex.match(name) is not None


# The one table of names. An op belongs to the first category, in this order, that
# matches its own name, a caller's, or (backward) its forward op's or that op's
# callers'. The optimizer and the loss are marked by train_step (record_function).
CATEGORIES = (
    Category("optimizer", "optimizer", (OPTIMIZER_MARK,)),  # and the schedule's step
    Category("casts", "casts", ("aten::_to_copy", "aten::_autocast_to_*", CONVERSION)),
    Category(
        "attention",
        "attention",
        (
            "aten::scaled_dot_product_attention",
            "aten::_scaled_dot_product_*",
            "aten::_flash_attention_*",
            "aten::_efficient_attention_*",
        ),
    ),
    Category(
        "matmul",
        "matrix products",
        (
            *("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
            *("aten::matmul", "aten::linear", "aten::mv", "aten::addmv"),
        ),
    ),
    Category(
        "loss",
        "loss",
        (
            LOSS_MARK,  # the generator, log-softmax and label smoothing's forward
            *("aten::log_softmax", "aten::_log_softmax*", "aten::nll_loss*"),
            *("aten::cross_entropy_loss", "*SmoothedKL*"),  # workshop/fast.py's
        ),
    ),
    Category(
        "gather",
        "gathers and scatters",
        (  # tokens moved between tensors: workshop.fast's packed step, embeddings
            *("aten::index", "aten::index_put*", "aten::_index_put_impl_"),
            *("aten::index_select", "aten::index_add*", "aten::gather"),
            *("aten::scatter*", "aten::cat", "aten::embedding*"),
            *("aten::masked_select", "aten::masked_scatter*", "aten::nonzero"),
        ),
    ),
    Category(
        "elementwise",
        "element-wise",
        (  # arithmetic and comparisons
            *("aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::rsub"),
            *("aten::mul", "aten::mul_", "aten::div", "aten::div_", "aten::neg"),
            *("aten::pow", "aten::sqrt", "aten::rsqrt", "aten::exp", "aten::log"),
            *("aten::eq", "aten::ne", "aten::ge", "aten::gt", "aten::le", "aten::lt"),
            *("aten::logical_*", "aten::isneginf", "aten::where", "aten::clamp*"),
            "aten::masked_fill*",
            # activations, dropout, layer norm, softmax
            *("aten::relu*", "aten::threshold*", "aten::gelu*", "aten::random_"),
            *("aten::bernoulli*", "aten::native_dropout*", "aten::dropout"),
            *("aten::layer_norm", "aten::native_layer_norm*", "aten::softmax"),
            *("aten::_softmax*", "aten::_safe_softmax"),
            # fills, plain copies and reductions
            *("aten::fill_", "aten::zero_", "aten::zeros*", "aten::ones*"),
            *("aten::full*", "aten::copy_", "aten::clone", "aten::contiguous"),
            *("aten::sum", "aten::mean", "aten::any", "aten::all"),
        ),
    ),
)
OTHER = Category("other", "other")  # what no pattern matches: the note names it
PYTHON = Category("python", "Python/dispatch")  # the wall time no op accounts for
BY_KEY = {c.key: c for c in (*CATEGORIES, PYTHON, OTHER)}
ORDER = ("matmul", "attention", "gather", "elementwise", "casts", "loss", "optimizer")
ROWS = tuple(BY_KEY[key] for key in (*ORDER, "python", "other"))  # the table's
ENGINE = "autograd::engine::evaluate_function: "  # a backward node's wrapper


def op_name(event):
    """The name `event` is judged by: CONVERSION for an aten::copy_ between two
    dtypes or an aten::to that copies, else its own."""
    if event.name == "aten::copy_":  # dtypes: (destination, source, non_blocking)
        dtypes = getattr(event, "input_dtypes", None) or []  # torch >= 2.12 has them
        if len(dtypes) >= 2 and dtypes[0] != dtypes[1]:
            return CONVERSION
    if event.name == "aten::to":
        if any(child.name == "aten::_to_copy" for child in event.cpu_children):
            return CONVERSION
    return event.name


@functools.cache  # a step's few hundred names recur thousands of times
def name_rank(name):
    """The index in CATEGORIES of the first category `name` matches (len: none)."""
    found = (i for i, c in enumerate(CATEGORIES) if c.matches(name))
    return next(found, len(CATEGORIES))


def in_backward(event):
    """Whether `event` is a backward node's wrapper or runs inside one."""
    while event is not None:
        if event.name.startswith(ENGINE):
            return True
        event = event.cpu_parent
    return False


def forward_ops(events):
    """Sequence number -> the forward op that made that autograd node: the last op
    outside the backward pass to carry the number (the number moves on as soon as
    the node is made, so later ops carry the next one)."""
    made = {}
    for event in sorted(events, key=lambda e: e.time_range.start):
        if event.sequence_nr >= 0 and not in_backward(event):
            made[event.sequence_nr] = event
    return made


def categorize(events):
    """{event id: its Category} for `events` (one profile's CPU-side events)."""
    made, ranks = forward_ops(events), {}

    def rank(event):
        if event.id not in ranks:
            found = [name_rank(op_name(event))]
            if event.cpu_parent is not None:
                found.append(rank(event.cpu_parent))
            if event.name.startswith(ENGINE) and event.sequence_nr in made:
                found.append(rank(made[event.sequence_nr]))
            ranks[event.id] = min(found)
        return ranks[event.id]

    every = (*CATEGORIES, OTHER)
    return {event.id: every[rank(event)] for event in events}


@dataclass
class StepProfile:
    """Where the profiled steps' time went, per step: seconds and op calls by
    category key (PYTHON's included), and the seconds of the "other" ops by name."""

    seconds: dict
    calls: dict
    other_ops: dict
    step_seconds: float

    def share(self, key):
        return self.seconds[key] / self.step_seconds


def op_seconds(event, device):
    """The time `event` itself took: its kernels' on a GPU, its own CPU time else."""
    if device.type == "cuda":
        return event.self_device_time_total / 1e6
    return event.self_cpu_time_total / 1e6


def step_profile(events, wall, steps, device):
    """StepProfile of `steps` steps that took `wall` seconds, from their events.

    An op's calls count where its category is entered: an aten::linear with its
    aten::addmm inside is one call. A record_function mark is no op: its own time is
    Python's, except inside the optimizer's mark (the optimizer's Python is the
    optimizer's, as a per-tensor loop's would be)."""
    events = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    category = categorize(events)
    seconds = {c.key: 0.0 for c in (*CATEGORIES, OTHER)}
    calls, other = Counter(), Counter()
    for event in events:
        kind = category[event.id]
        if event.is_user_annotation:
            if kind.key == "optimizer" and device.type != "cuda":
                seconds[kind.key] += event.self_cpu_time_total / 1e6
            continue
        spent = op_seconds(event, device)
        seconds[kind.key] += spent
        caller = event.cpu_parent
        while caller is not None and caller.is_user_annotation:
            caller = caller.cpu_parent
        if caller is None or category[caller.id] is not kind:
            calls[kind.key] += 1
        if kind is OTHER:
            other[event.name] += spent
    seconds[PYTHON.key] = wall - sum(seconds.values())
    calls[PYTHON.key] = sum(not e.is_user_annotation for e in events)
    return StepProfile(
        {key: s / steps for key, s in seconds.items()},
        {key: n / steps for key, n in calls.items()},
        {name: s / steps for name, s in other.items()},
        wall / steps,
    )


def profile_steps(step, batches, device):
    """(the profiler's events, wall seconds) of step(batch) for each of `batches`;
    shapes are recorded, which tells a copy between dtypes from a plain one."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    synchronize(device)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        start = time.perf_counter()
        for batch in batches:
            step(batch)
        synchronize(device)
        wall = time.perf_counter() - start
    return prof.events(), wall


def timed_steps(step, batches, device):
    """Wall seconds of step(batch) for each of `batches`, without the profiler."""
    synchronize(device)
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    synchronize(device)
    return time.perf_counter() - start


@dataclass(frozen=True)
class ProfileSettings:
    """How much the profile runs: `steps` batches, stepped through in `warmup`
    untimed passes, then once timed and once profiled. Whether to profile bf16
    where it is emulated (a CPU without bfloat16 instructions, where `train --bf16`
    trains in float32 and a base-size bf16 step takes tens of seconds): then
    untimed. The base step's sizes and sentences a batch (None: the bench's training
    sizes), the multi30k step's token budget and vocabulary (None: the profile's
    own)."""

    warmup: int = 1
    steps: int = 3
    emulated_bf16: bool = False
    base_sizes: Sizes | None = None
    base_batch: int = TRAIN_BATCH
    multi30k_tokens: int | None = None
    multi30k_vocab: int | None = None


FULL = ProfileSettings()
# --quick: every row's code runs, at sizes whose numbers mean nothing.
QUICK_PROFILE = ProfileSettings(
    steps=1,
    emulated_bf16=True,  # small enough to run the bf16 path everywhere
    base_sizes=Sizes(N=2, d_model=64, d_ff=256, h=4, vocab=1000),
    base_batch=8,
    multi30k_tokens=64,
    multi30k_vocab=1000,
)


@dataclass(frozen=True)
class Workload:
    """A training step to profile: its name, a label of its sizes, and a function
    (n, device) -> (the model on device, its train_step settings, n Batches)."""

    name: str
    label: str
    make: object


def workloads(ctx, profile):
    """The base-size step (the bench's training sizes and ragged batches) and the
    multi30k profile's step (synthetic batches of its token budget)."""
    sizes = profile.base_sizes or ctx.settings.train_sizes
    config = multi30k_profile()
    tokens = profile.multi30k_tokens or config.max_tokens
    vocab = profile.multi30k_vocab or config.bpe_vocab_size  # joint subwords

    def base(n, device):
        batches = synthetic_batches(n, sizes.vocab, profile.base_batch, device=device)
        return book_model(sizes, device=device), book_model_step(), batches

    def multi30k(n, device):
        model = run_model(config, vocab, seed=config.seed, device=device)
        options = run_step_options(config)
        return model, options, budget_batches(n, vocab, tokens, device=device)

    return (
        Workload(
            "base",
            f"{sizes.label}, vocabularies {sizes.vocab}, batches of "
            f"{profile.base_batch} ragged sentences",
            base,
        ),
        Workload(
            "multi30k",
            f"the multi30k profile: N={config.N} d_model={config.d_model} "
            f"d_ff={config.d_ff} h={config.h}, {vocab} shared subwords, synthetic "
            f"batches of <= {tokens} padded ids a side",
            multi30k,
        ),
    )


def measure(workload, amp_dtype, steps, warmup, device, timed=True):
    """(StepProfile, unprofiled seconds per step or None, target tokens per step)
    of `workload`'s train_step over `steps` batches: `warmup` untimed passes over
    them (each batch's shapes seen once: a GPU library picks its kernels per shape
    on first sight), then one timed (if `timed`), then one profiled."""
    model, options, batches = workload.make(steps, device)
    step = train_step(model, amp_dtype, **options)
    for _ in range(warmup):
        timed_steps(step, batches, device)
    unprofiled = timed_steps(step, batches, device) / steps if timed else None
    events, wall = profile_steps(step, batches, device)
    tokens = sum(b.ntokens for b in batches) / steps
    return step_profile(events, wall, steps, device), unprofiled, tokens


def profile_rows(workload, precision, result, unprofiled, tokens, steps, note=""):
    """The rows of one profiled step: its time, then one row a category."""
    prefix = f"profile_{workload.name}_{precision}"
    figure = f"where the time goes, {workload.name} step, {precision}"
    rows = [
        Row(
            f"{prefix}_step",
            f"{figure}: time per step, profiled",
            1000 * result.step_seconds,
            "ms",
            "unprofiled" if unprofiled else "",
            unprofiled and 1000 * unprofiled,
            unprofiled and result.step_seconds / unprofiled,
            note=(
                f"{workload.label}; {tokens:,.0f} target tokens a step, mean of "
                f"{steps} profiled step(s){note}"
            ),
        )
    ]
    for category in ROWS:
        calls = f"{result.calls.get(category.key, 0):,.0f} op calls per step"
        if category is PYTHON:
            calls += " in all"
        if category is OTHER and result.other_ops:
            largest = Counter(result.other_ops).most_common(3)
            calls += "; largest: " + ", ".join(
                f"{name} {1000 * s:.3g} ms" for name, s in largest
            )
        rows.append(
            Row(
                f"{prefix}_{category.key}",
                f"{figure}: {category.name}",
                100 * result.share(category.key),
                "%",
                "per step",
                1000 * result.seconds[category.key],
                ref_unit="ms",
                note=calls,
            )
        )
    return rows


def figure_profile(ctx):
    """Where the base and multi30k training steps' time goes, fp32 and bf16."""
    profile = QUICK_PROFILE if ctx.settings == QUICK else FULL
    rows = []
    for workload in workloads(ctx, profile):
        for precision, amp_dtype in (("fp32", None), ("bf16", torch.bfloat16)):
            timed, note = True, ""
            if amp_dtype is not None and not ctx.bf16_pays:
                emulated = ctx.device.type == "cpu"
                if not (emulated and profile.emulated_bf16):
                    reason = ctx.bf16[1]
                    if emulated:
                        reason += " (emulated: a step takes tens of seconds)"
                    figure = f"where the time goes, {workload.name} step, bf16"
                    key = f"profile_{workload.name}_bf16_step"
                    rows.append(skipped(key, figure, reason))
                    continue
                timed, note = False, f"; bf16 emulated here: {ctx.bf16[1]}"
            result, unprofiled, tokens = measure(
                workload, amp_dtype, profile.steps, profile.warmup, ctx.device, timed
            )
            rows += profile_rows(
                workload, precision, result, unprofiled, tokens, profile.steps, note
            )
    return rows
