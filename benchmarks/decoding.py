"""The decoding rows: greedy decoding with the book's KVCache at batch 1 as a share of
its bound (weight_floor: at batch 1 a step is matrix-vector products, bound by reading
the weights from memory), and beam search (beam 4) against greedy decoding at batch
64. Models have random weights (the time of a step does not depend on them), and
no output ends early: the end symbol is one no id equals, so every output has max_len
ids."""

from __future__ import annotations

import torch

import the_annotated_transformer as tat
from benchmarks.harness import Row, median_seconds
from benchmarks.training import describe, model_sizes

NEVER = -1  # an end symbol no token id equals
BEAM, BEAM_BATCH = 4, 64


def sources(pairs, n, device):
    """A Batch of the source sides of the first n pairs, on `device`."""
    examples = [(src, [tat.BOS, tat.EOS]) for src, _ in pairs[:n]]
    return tat.collate_batch(examples).to(device)


def greedy(model, batch, max_len):
    """The book's greedy decoding with a KVCache, to exactly max_len ids."""
    cache = tat.KVCache(model, max_len)
    return tat.greedy_decode(
        model, batch.src, batch.src_mask, max_len, tat.BOS, cache=cache
    )


def weight_floor(model, rows, steps):
    """A function multiplying `rows` vectors by every weight matrix of the decoder
    and the generator `steps` times (cross-attention's keys and values excepted: they
    are computed once): the weight reads that bound a batch-1 step from below."""
    layers = model.decoder.layers
    once = {id(layer.src_attn.linears[i].weight) for layer in layers for i in (1, 2)}
    weights = [
        p
        for p in (*model.decoder.parameters(), *model.generator.parameters())
        if p.dim() == 2 and id(p) not in once
    ]
    vectors = {
        w.size(1): torch.randn(rows, w.size(1), device=w.device) for w in weights
    }

    def run():
        with torch.no_grad():
            for _ in range(steps):
                for w in weights:
                    vectors[w.size(1)] @ w.t()

    return run


def random_model(sizes, vocab, device):
    """The book's model at `sizes` for `vocab` subwords, random, in eval mode."""
    torch.manual_seed(0)
    return tat.make_model(vocab, vocab, **sizes).to(device).eval()


def decoding_rows(settings, device, pairs, vocab):
    """Yield the decoding rows, each as soon as it is measured."""
    sizes, steps = model_sizes(settings), settings.decode_steps
    max_len = steps + 1  # <s>, then the decoded tokens
    model, one = random_model(sizes["base"], vocab, device), sources(pairs, 1, device)
    seconds = median_seconds(
        {
            "greedy": lambda: greedy(model, one, max_len),
            "floor": weight_floor(model, 1, steps),
        },
        settings,
    )
    yield Row(
        "greedy decoding with KVCache, batch 1: share of its bound",
        100 * seconds["floor"] / seconds["greedy"],
        ">=",
        90.0,
        "%",
        f"{steps} tokens, {describe(sizes['base'])}: {seconds['greedy']:.3g} s; "
        f"the bound, reading every decoder and generator weight once a token, "
        f"{seconds['floor']:.3g} s",
    )
    model = random_model(sizes["multi30k"], vocab, device)
    batch = sources(pairs, BEAM_BATCH, device)

    def beam():
        args = (model, batch.src, batch.src_mask, max_len, tat.BOS, NEVER)
        return tat.beam_search(*args, beam_size=BEAM, pad_symbol=tat.PAD)

    seconds = median_seconds(
        {"greedy": lambda: greedy(model, batch, max_len), "beam": beam}, settings
    )
    yield Row(
        f"beam search (beam {BEAM}), batch {BEAM_BATCH}: time over greedy's",
        seconds["beam"] / seconds["greedy"],
        "<=",
        3.0,
        "x",
        f"{steps} tokens each, {describe(sizes['multi30k'])}: {seconds['beam']:.3g} s "
        f"against {seconds['greedy']:.3g} s on the same {BEAM_BATCH} sentences",
    )
