"""The decoding rows: greedy decoding with the book's KVCache at batch 1 as a share of
its bound (weight_floor: at batch 1 a step is matrix-vector products, bound by reading
the weights from memory), and beam search (beam 4) against greedy decoding at batch
64. Models have random weights (the time of a step does not depend on them), and
no output ends early: the end symbol is one no id equals, so every output has max_len
ids. The peer row times the same decoding against Hugging Face transformers'
`generate` on the same random weights, a Marian model of OPUS-MT's sizes that the
book's from_marian loads (transformers: a test and bench dependency only)."""

from __future__ import annotations

import itertools

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


OPUS_MT_SIZES = tat.TINY_MARIAN | dict(  # Helsinki-NLP/opus-mt-de-en's config.json
    vocab_size=58101, d_model=512, encoder_layers=6, decoder_layers=6,
    encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
    decoder_ffn_dim=2048, max_position_embeddings=512, pad_token_id=58100,
    decoder_start_token_id=58100,
)  # fmt: skip


def peer_models(settings, device):
    """A random MarianMTModel (OPUS-MT's sizes; --smoke: the book's TINY_MARIAN)
    and the book's make_model holding its weights, both in eval mode."""
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(0)
    sizes = tat.TINY_MARIAN if settings.smoke else OPUS_MT_SIZES
    theirs = MarianMTModel(MarianConfig(**sizes)).eval()
    config = theirs.config.to_dict()
    ours = tat.from_marian(theirs.state_dict(), config, tat.marian_order(config))
    return theirs.to(device), ours.to(device)


def peer_batches(pairs, n, config, device, batch_size=64):
    """n sources of the lengths of the first n pairs' German sides, random ids of
    the Marian `config`'s below its <pad> (the last) ending in </s> (0), in batches
    of batch_size of similar length: (Marian's ids, the book's ids, mask)."""
    vocab_size, generator = config["vocab_size"], torch.Generator().manual_seed(0)
    to_ours = tat.marian_ids(tat.marian_order(config))
    lengths = sorted(len(src) for src, _ in itertools.islice(itertools.cycle(pairs), n))
    batches = []
    for start in range(0, n, batch_size):
        rows = lengths[start : start + batch_size]
        ids = torch.full((len(rows), max(rows)), vocab_size - 1)  # <pad>
        for i, length in enumerate(rows):
            ids[i, : length - 1] = torch.randint(
                2, vocab_size - 1, (length - 1,), generator=generator
            )
            ids[i, length - 1] = 0
        mask = ids != vocab_size - 1
        batches.append((ids.to(device), to_ours[ids].to(device), mask.to(device)))
    return batches


def peer_rows(settings, device, pairs):
    """Yield the peer rows: the book's cached greedy decoding and its beam search
    (beam 4) of settings.peer_sentences sentences, each to exactly decode_steps
    tokens, against transformers' generate on the same weights."""
    theirs, ours = peer_models(settings, device)
    steps, n = settings.decode_steps, settings.peer_sentences
    n = n or (1000 if device.type == "cuda" else 64)  # 1,000 take 15 min on 2 cores
    batches = peer_batches(pairs, n, theirs.config.to_dict(), device)
    fixed = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False)

    def book(beam):
        with torch.no_grad():
            for _, ids, mask in batches:
                mask, end = mask.unsqueeze(1), dict(end_symbol=NEVER)
                if beam == 1:
                    cache = tat.KVCache(ours, steps + 1)
                    tat.greedy_decode(
                        ours, ids, mask, steps + 1, tat.BOS, cache=cache, **end
                    )
                else:
                    tat.beam_search(
                        ours,
                        ids,
                        mask,
                        steps + 1,
                        tat.BOS,
                        NEVER,
                        beam_size=beam,
                        pad_symbol=tat.PAD,
                    )

    def generate(beam):
        with torch.no_grad():
            for ids, _, mask in batches:
                theirs.generate(ids, attention_mask=mask, num_beams=beam, **fixed)

    what = "TINY_MARIAN's sizes" if settings.smoke else "OPUS-MT's sizes"
    for beam in (1, BEAM):
        seconds = median_seconds(
            {"book": lambda b=beam: book(b), "generate": lambda b=beam: generate(b)},
            settings,
        )
        search = "greedy, cached" if beam == 1 else f"beam {beam}"
        yield Row(
            f"{n:,} sentences ({search}): speed over transformers' generate",
            seconds["generate"] / seconds["book"],
            ">=",
            1.0,
            "x",
            f"{steps} tokens each, {what}, random weights: "
            f"{seconds['book']:.3g} s against {seconds['generate']:.3g} s",
        )
