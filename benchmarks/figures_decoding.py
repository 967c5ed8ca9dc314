"""Figure 4: greedy decoding with the key/value cache against without (the book's
KVCache and the workshop's DecodingCache, which translation uses), translating in
batches against one sentence at a time, and beam search against greedy."""

from __future__ import annotations

import functools

import torch

import the_annotated_transformer as tat

# isort: split
# This folder's modules (bench.py runs as a script, so benchmarks/ is on sys.path).
from bench_settings import TRANSLATE_BATCH
from table import Goal, Row
from timing import median_times
from workloads import (
    DecodingCache,
    beam,
    book_model,
    memory_projections,
    quick_profile_sizes,
    source_batches,
    synthetic_pairs,
    workshop_greedy,
)


def random_memory(model, batch, src_len=20, seed=0):
    """The encoder's memory of `batch` random sources, on the model's device:
    (memory, src_mask). The sources are drawn on the CPU, the same on every device."""
    rng, device = torch.Generator().manual_seed(seed), next(model.parameters()).device
    vocab = len(model.src_embed[0])
    src = torch.randint(4, vocab, (batch, src_len), generator=rng).to(device)
    src_mask = torch.ones(batch, 1, src_len, dtype=torch.bool, device=device)
    with torch.no_grad():
        return model.encode(src, src_mask), src_mask


def greedy_steps(model, memory, src_mask, steps, cache=None):
    """Greedily generate `steps` tokens after a start symbol (through `cache`, if
    given, else recomputing every position at every step); returns the ids."""
    ys = torch.zeros(memory.size(0), 1, dtype=torch.long, device=memory.device)
    with torch.no_grad():
        for _ in range(steps):
            log_probs = tat.decode_step(model, memory, src_mask, ys, cache)
            ys = torch.cat([ys, log_probs.argmax(-1, keepdim=True)], dim=1)
    return ys


def weight_reads(model, steps):
    """What any cached greedy step must do at batch 1, `steps` times: multiply one
    vector by every weight matrix of the decoder and the generator (cross-attention's
    keys and values excepted: the cache computes them once). At batch 1 these are
    matrix-vector products, bound by reading the weights from memory, so their time
    is the floor under a cached step, and recomputation's time over it is the most a
    cache can gain."""
    cached_once = {id(p) for m in memory_projections(model) for p in m.parameters()}
    modules = [model.decoder, model.generator]
    weights = [
        p
        for m in modules
        for p in m.parameters()
        if p.dim() == 2 and id(p) not in cached_once
    ]
    device = weights[0].device
    vectors = {w.size(1): torch.randn(1, w.size(1), device=device) for w in weights}

    def run():
        with torch.no_grad():
            for _ in range(steps):
                for w in weights:
                    vectors[w.size(1)] @ w.t()

    return run


# The caches figure_decoding compares: a fresh one for every call.
CACHES = {
    "book": lambda model, steps: tat.KVCache(model),
    "workshop": lambda model, steps: DecodingCache(model, steps + 1),
}


def figure_decoding(ctx):
    """Greedy decoding with each key/value cache against without."""
    settings, sizes = ctx.settings, ctx.settings.decode_sizes
    steps = settings.decode_tokens
    model = book_model(sizes, device=ctx.device).eval()
    rows = []
    for batch in (1, 64):
        memory, src_mask = random_memory(model, batch)

        def generate(kind, memory=memory, src_mask=src_mask):
            cache = CACHES[kind](model, steps) if kind else None
            return greedy_steps(model, memory, src_mask, steps, cache)

        fns = {kind: functools.partial(generate, kind) for kind in (None, *CACHES)}
        if batch == 1:
            fns["floor"] = weight_reads(model, steps)
        seconds = median_times(
            fns, settings.repeats, min_run_time=settings.min_run_time
        )
        rows += cache_rows(seconds, batch, steps, sizes.label)
    return rows


def cache_rows(seconds, batch, steps, sizes_label):
    """figure_decoding's rows for one batch size, from the median seconds of
    greedy decoding without a cache (None), with each cache and (batch 1) of the
    floor: each cache's speed-up; at batch 1 also the most a cache can gain and the
    share of it the workshop's cache gets."""
    figures = {  # the book's row keeps its figure from before the workshop's cache
        "book": f"greedy, {steps} tokens, {sizes_label}, batch {batch}: speed-up",
        "workshop": f"greedy, {steps} tokens, batch {batch}: DecodingCache's speed-up",
    }
    keys = {"book": f"greedy_cache_batch{batch}"}
    keys["workshop"] = f"greedy_workshop_cache_batch{batch}"
    notes = {
        "book": "value: seconds with the book's KVCache",
        "workshop": "value: seconds with the workshop's DecodingCache (translation's)",
    }
    rows = [
        Row(
            keys[kind],
            figures[kind],
            seconds[kind],
            "s",
            "without the cache",
            seconds[None],
            seconds[None] / seconds[kind],
            Goal(">=", 3.0) if batch == 1 else None,
            note=notes[kind],
        )
        for kind in figures
    ]
    if batch > 1:
        return rows
    floor, bound = seconds["floor"], seconds[None] / seconds["floor"]
    rows.append(
        Row(
            "greedy_cache_bound_batch1",
            f"greedy, {steps} tokens, batch 1: most a cache can gain",
            floor,
            "s",
            "without the cache",
            seconds[None],
            bound,
            None,
            note=(
                "value: seconds of the matrix-vector products every cached step must "
                "do (reading each decoder and generator weight once a token); the "
                "cache's speed-up cannot exceed the ratio"
            ),
        )
    )
    # A cache's speed-up over the most it can gain: the floor's seconds over its own.
    rows.append(
        Row(
            "greedy_cache_share_of_bound_batch1",
            f"greedy, {steps} tokens, batch 1: DecodingCache's share of the most",
            100 * floor / seconds["workshop"],
            "%",
            "the book's KVCache",
            100 * floor / seconds["book"],
            None,
            Goal(">=", 90.0, on="value"),
            note=(
                "value: DecodingCache's speed-up over the most a cache can gain, in %"
            ),
        )
    )
    return rows


def greedy_all(model, batches, max_len):
    """Greedy-decode every batch as translation does, to exactly `max_len` ids."""
    for batch in batches:
        workshop_greedy(model, batch, max_len)


def figure_batching(ctx):
    """Translating many sentences in batches against one sentence at a time."""
    settings = ctx.settings
    sizes, n, k = quick_profile_sizes(), settings.sentences, settings.one_at_a_time
    model = book_model(sizes, device=ctx.device).eval()  # random weights: only time
    sentences = [src for src, _ in synthetic_pairs(n, sizes.vocab)]
    max_len = settings.decode_tokens + 1  # the start symbol, then the tokens
    batched = source_batches(sentences, TRANSLATE_BATCH, ctx.device)
    single = source_batches(sentences[:k], 1, ctx.device)
    seconds = median_times(
        {
            "batched": functools.partial(greedy_all, model, batched, max_len),
            "single": functools.partial(greedy_all, model, single, max_len),
        },
        settings.repeats,
        settings.warmup,
        device=ctx.device,
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
                f"quick-profile sizes, random weights, greedy with the workshop's "
                f"cache; one at a time timed on {k} sentences and extrapolated to {n}"
            ),
        )
    ]


def figure_beam(ctx):
    """The workshop's beam search (k = 4) against its greedy decoding (the same
    cache), same sentences and length."""
    settings = ctx.settings
    sizes = quick_profile_sizes()
    model = book_model(sizes, device=ctx.device).eval()
    max_len = settings.decode_tokens + 1
    sentences = [src for src, _ in synthetic_pairs(TRANSLATE_BATCH, sizes.vocab)]
    rows = []
    for batch_size in (1, TRANSLATE_BATCH):
        (batch,) = source_batches(sentences[:batch_size], batch_size, ctx.device)
        fns = {
            "greedy": functools.partial(workshop_greedy, model, batch, max_len),
            "beam": functools.partial(beam, model, batch, max_len),
        }
        seconds = median_times(
            fns, settings.repeats, min_run_time=settings.min_run_time
        )
        rows.append(
            Row(
                f"beam4_batch{batch_size}",
                f"beam 4, {settings.decode_tokens} tokens, batch {batch_size}: "
                "time / greedy's",
                seconds["beam"],
                "s",
                "greedy (the workshop's)",
                seconds["greedy"],
                seconds["beam"] / seconds["greedy"],
                Goal("<=", 3.0),
                note="quick-profile sizes, random weights; no end symbol: full length",
            )
        )
    return rows
