"""Part 4: incremental decoding with a key/value cache, and beam search over a batch."""

import copy
import functools
import math
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import trained_copy_task
from tolerance import rounding_tolerance

import the_annotated_transformer as tat

START, PAD = tat.COPY_START, tat.COPY_PAD
LENGTHS = [10, 6, 3, 8]  # the copy model's padded batch


def padded_sources(lengths, start, pad, tokens, seed=7):
    """Random sources of `lengths` (ids in range(*tokens)) after `start`, padded."""
    rng = torch.Generator().manual_seed(seed)
    src = torch.randint(*tokens, (len(lengths), max(lengths)), generator=rng)
    src[:, 0] = start
    for row, n in enumerate(lengths):
        src[row, n:] = pad
    return src, (src != pad).unsqueeze(-2)


def untrained(norm_first=True):
    """(model, src, src_mask, start, end): a small untrained model and its sources."""
    torch.manual_seed(3)
    model = tat.make_model(13, 13, N=2, d_model=32, d_ff=64, h=4, norm_first=norm_first)
    return model.eval(), *padded_sources([7, 4, 7, 7, 7], 0, 2, (3, 13), seed=5), 0, 1


# The trained copy model costs a minute of training on a 2-core CPU (unless Part 2's
# tests trained it first): its cases, and the tests that take it, are slow.
@pytest.fixture(
    params=[pytest.param("trained copy", marks=pytest.mark.slow), "pre", "post"],
    ids=["trained copy model", "untrained pre-norm", "untrained post-norm"],
)
def case(request):
    if request.param != "trained copy":
        return untrained(norm_first=request.param == "pre")
    sources = padded_sources(LENGTHS, START, PAD, (2, 11))
    return trained_copy_task(1)[0], *sources, START, None


def float32_tolerance(model, log_probs, through_encoder=False):
    """How far a cached and a full decoder step may differ in float32: the same
    function over differently shaped products (one new row against the whole
    prefix), summed in other orders. Steps: about 16 rounded operations per decoder
    layer (a norm, four projections, two attention products and a softmax per
    attention sublayer, two feed-forward products, the residual adds), 3 in the
    generator, and 12 per encoder layer where the sources' shapes differ too; each
    of the size of the largest |log probability|."""
    steps = 16 * len(model.decoder.layers) + 3
    steps += 12 * len(model.encoder.layers) if through_encoder else 0
    return rounding_tolerance(steps, log_probs.abs().max())


def step_log_probs(model, src, src_mask, ys, cache=None):
    """The decoder's log-probabilities after each proper prefix of ys, stacked."""
    with torch.no_grad():
        step = functools.partial(tat.decode_step, model, model.encode(src, src_mask))
        prefixes = (ys[:, :t] for t in range(1, ys.size(1)))
        return torch.stack([step(src_mask, prefix, cache) for prefix in prefixes])


@pytest.mark.parametrize("capacity", [None, 2], ids=["default", "growing"])
def test_cached_steps_give_the_full_steps_log_probabilities_and_choices(case, capacity):
    """With buffers of 2 positions the cache grows twice (to 4, then 8) on the way
    to 9 positions, and must keep every position it held. Where the top two tokens
    lie within twice the tolerance, either choice is right: cached greedy decoding's
    rows are compared up to their first such near tie."""
    model, src, src_mask, start, end = case
    options = dict(end_symbol=end, pad_symbol=None if end is None else 2)
    ys = tat.greedy_decode(model, src, src_mask, 10, start, **options)
    cache = tat.KVCache(model, capacity)
    cached = step_log_probs(model, src, src_mask, ys, cache)
    plain = step_log_probs(model, src, src_mask, ys)  # (step, batch, vocab)
    assert cache.length == ys.size(1) - 1 and cache.capacity >= cache.length
    tolerance = float32_tolerance(model, plain)
    torch.testing.assert_close(cached, plain, atol=tolerance, rtol=0)
    chosen = tat.cached_greedy_decode(model, src, src_mask, 10, start, **options)
    top2 = plain.topk(2, dim=-1).values
    tied = (top2[..., 0] - top2[..., 1] <= 2 * tolerance).long()
    lengths = 1 + torch.where(tied.any(0), tied.argmax(0), tied.size(0))
    for row, length in enumerate(lengths.tolist()):
        assert torch.equal(chosen[row, :length], ys[row, :length]), row
    assert (lengths - 1).sum() >= tied.numel() // 2  # near ties are rare


def test_cached_and_uncached_beam_search_give_the_same_hypotheses_and_scores(case):
    model, src, src_mask, start, end = case
    search = (model, src, src_mask, 10, start, 1 if end is None else end)
    options = dict(beam_size=4, pad_symbol=PAD, n_best=4)
    cached = tat.beam_search(*search, **options)
    no_cache = SimpleNamespace(step=tat.decode_step, reorder=lambda rows: None)
    plain = tat.beam_search(*search, cache=no_cache, **options)  # every position anew
    # A score sums at most 9 step log-probabilities, over a length penalty >= 1.
    ys = tat.greedy_decode(model, src, src_mask, 10, start)
    tolerance = 9 * float32_tolerance(model, step_log_probs(model, src, src_mask, ys))
    for a, b in zip(cached, plain, strict=True):
        assert [ids for ids, _ in a] == [ids for ids, _ in b]
        assert [s for _, s in a] == pytest.approx([s for _, s in b], abs=tolerance)


@pytest.mark.slow
def test_beam_search_on_a_padded_batch_gives_each_sentence_what_it_gets_alone():
    model = trained_copy_task(1)[0]
    src, src_mask = padded_sources(LENGTHS, START, PAD, (2, 11))
    options = dict(beam_size=3, pad_symbol=PAD, n_best=3)
    batched = tat.beam_search(model, src, src_mask, 12, START, 1, **options)
    for row, n in enumerate(LENGTHS):
        alone = src[row : row + 1, :n], src_mask[row : row + 1, :, :n]
        (found,) = tat.beam_search(model, *alone, 12, START, 1, **options)
        ys = tat.greedy_decode(model, *alone, 12, START)
        logp = step_log_probs(model, *alone, ys)
        # a score sums at most 11 step log-probabilities, over a length penalty >= 1
        tolerance = 11 * float32_tolerance(model, logp, through_encoder=True)
        scores = [score for _, score in found]
        # Rounding can only reorder hypotheses whose scores lie within the tolerance;
        # these sources keep them further apart, so the order itself is compared.
        gaps = [a - b for a, b in zip(scores, scores[1:], strict=False)]
        assert min(gaps) > 2 * tolerance, f"near tie in {scores}: choose other sources"
        assert [ids for ids, _ in batched[row]] == [ids for ids, _ in found]
        assert [s for _, s in batched[row]] == pytest.approx(scores, abs=tolerance)
    # A beam of one chooses what greedy decoding chooses (99: no end, full length).
    greedy = tat.greedy_decode(model, src, src_mask, 10, START)
    assert torch.equal(tat.beam_search(model, src, src_mask, 10, START, 99, 1), greedy)


def test_a_reordered_cache_continues_the_rows_it_keeps():
    """Beam search keeps, drops and repeats hypotheses; reorder does that to the
    cache, and the next step matches decoding the chosen prefixes from scratch."""
    model, src, src_mask, *_ = untrained()
    ys = tat.greedy_decode(model, src, src_mask, 6, 0)
    cache, rows = tat.KVCache(model), torch.tensor([4, 1, 1, 0])  # a repeat, a drop
    step_log_probs(model, src, src_mask, ys, cache)
    cache.reorder(rows)
    src, src_mask, ys = src[rows], src_mask[rows], torch.cat([ys, ys[:, -1:]], 1)[rows]
    with torch.no_grad():
        step = functools.partial(tat.decode_step, model, model.encode(src, src_mask))
        cached, plain = step(src_mask, ys, cache), step(src_mask, ys)
    assert cache.length == ys.size(1)
    tolerance = float32_tolerance(model, plain)
    torch.testing.assert_close(cached, plain, atol=tolerance, rtol=0)


def test_the_cache_picture_computes_a_position_a_step_and_doubles_its_room(capsys):
    """The picture's cells come from a real KVCache with room for 2 positions: at
    step t it reads t - 1 positions, computes one, and its buffer has grown to the
    power of two (at least 2) that holds t."""
    (cells,) = tat.chart_kv_cache(steps=8, capacity=2).to_dict()["datasets"].values()
    assert {cell["step"] for cell in cells} == set(range(1, 9))
    cells = sorted(cells, key=lambda cell: cell["slot"])
    for t in range(1, 9):
        held = [cell["held"] for cell in cells if cell["step"] == t]
        free = ["free"] * (2 ** max(1, math.ceil(math.log2(t))) - t)
        assert held == ["read from the cache"] * (t - 1) + ["computed"] + free, t
    printed = capsys.readouterr().out
    assert "8 steps: 8 positions computed with the cache, 36 without" in printed


# ---------------------------------------------------------------------------
# A picture of beam search: beam_search(..., steps=[]) records every step's beam,
# here with the smoke run's translator (conftest's `translator`)


@pytest.fixture(scope="module")
def val_ids(multi30k_dir, translator):
    """The source ids of the first four validation sentences."""
    return translator.encode([de for de, _ in tat.read_split(multi30k_dir, "val")[:4]])


def beam_steps(model, src_ids, k, alpha=0.6):
    """beam_search of one sentence, recording its steps: its k finished (score, ids),
    best first, and each step's beam, the live (ids, log P) rows, best first."""
    steps, src = [], torch.tensor([src_ids])
    options, ends = dict(alpha=alpha, n_best=k, steps=steps), (tat.BOS, tat.EOS, k)
    (found,) = tat.beam_search(model, src, None, src.size(1) + 50, *ends, **options)
    beams = [[(h, p) for h, p in zip(*s, strict=True) if p > -math.inf] for s in steps]
    return [(score, ids) for ids, score in found], beams


def with_first_logit_moved(model, src_ids, token, nats):
    """A copy of `model` with one generator weight changed, W[token, j], so that the
    logit of `token` after <s> moves by `nats`: j is the feature of the decoder's
    output there with the largest magnitude |h_j|, so the weight moves by the
    least one weight can, nats / |h_j|. (Other positions' logits of `token` move by
    nats * h'_j / h_j, where h' is the decoder's output there.)"""
    with torch.no_grad():
        memory = model.encode(torch.tensor([src_ids]), None)
        start = torch.tensor([[tat.BOS]])
        h = model.decode(memory, None, start, tat.subsequent_mask(1))[0, 0]
        j = int(h.abs().argmax())
        perturbed = copy.deepcopy(model)
        perturbed.generator.proj.weight[token, j] += nats / h[j]
    return perturbed


def test_each_beam_extends_the_last_and_the_best_is_returned(translator, val_ids):
    """The recorded search is the one beam_search runs: its answer is the best
    finished hypothesis of the record. The control, whose comparison is exact: a copy
    whose best first word's logit after <s> is 10 nats lower answers otherwise. (No
    small step can show it: a search's output changes only where a step turns a
    decision. That word's log-probability after <s> falls from about -0.4 to -9.3,
    below the k words then kept: no hypothesis that begins with it survives.)"""
    model = translator.model
    for ids in val_ids:
        finished, beams = beam_steps(model, ids, 4)
        kept = [[[tat.BOS]]] + [[h for h, _ in beam] for beam in beams]
        for step, beam in enumerate(kept[1:], start=1):
            assert 1 <= len(beam) <= 4, step
            assert all(h[:-1] in kept[step - 1] and h[-1] != tat.EOS for h in beam)
        # Each finished hypothesis ends one kept a step before; k of them end it.
        assert len(finished) == 4
        assert all(h[-1] == tat.EOS and h[:-1] in kept[len(h) - 2] for _, h in finished)
        search = (torch.tensor([ids]), None, len(ids) + 50, tat.BOS, tat.EOS)
        best = finished[0][1]
        assert tat.beam_search(model, *search)[0].tolist() == best
        perturbed = with_first_logit_moved(model, ids, best[1], -10.0)
        assert tat.beam_search(perturbed, *search)[0].tolist() != best


def log_p_misses(model, src_ids, step, beam, fresh_model=None):
    """For each hypothesis of a step's beam: (|its log P - the sum of its tokens'
    log-probabilities decoded from scratch by fresh_model (default: model)|, the
    tolerance)."""
    fresh, ys = fresh_model or model, torch.tensor([h for h, _ in beam])
    with torch.no_grad():
        memory = fresh.encode(torch.tensor([src_ids] * len(beam)), None)
        out = fresh.decode(memory, None, ys[:, :-1], tat.subsequent_mask(step))
        log_probs = fresh.generator(out)  # (hypothesis, token, vocab)
    sums = log_probs.gather(-1, ys[:, 1:, None]).double().sum((1, 2)).tolist()
    # The search's cached steps and these full ones differ per step by at most
    # float32_tolerance; log P sums `step` of them in a float32 running sum, one
    # rounding a step, of at most |log P|.
    size = max(map(abs, sums))
    tol = step * (float32_tolerance(model, log_probs) + rounding_tolerance(1, size))
    return [(abs(log_p - s), tol) for (_, log_p), s in zip(beam, sums, strict=True)]


# The control's step: the logit of the first beam's best word after <s> moves by
# 0.03 nats. Every hypothesis's first token is read after <s>, where the word (of
# probability p, about 0.67 here) gains 0.03 (1 - p) in log-probability and every
# other word loses 0.03 p: at least 0.03 min(p, 1 - p) ~ 0.01, which is 500 times
# the tolerance of a one-token hypothesis (2e-5). A logit moved by a few hundredths
# of a nat: a slip no rounding explains, not another model.
LOGIT_STEP = 0.03


def test_a_kept_log_p_is_the_sum_of_its_tokens_log_probabilities(translator, val_ids):
    """Each child's log P is its parent's plus its own token's log-probability,
    recomputed here from scratch. The control recomputes the first beam with a copy
    whose one generator weight moved the first word's logit by LOGIT_STEP: every
    hypothesis misses, so the equality would fail."""
    model, ids = translator.model, val_ids[0]
    _, beams = beam_steps(model, ids, 4)
    for step, beam in enumerate(beams, start=1):
        misses = log_p_misses(model, ids, step, beam)
        assert all(miss <= tolerance for miss, tolerance in misses), (step, misses)
    perturbed = with_first_logit_moved(model, ids, beams[0][0][0][1], LOGIT_STEP)
    misses = log_p_misses(model, ids, 1, beams[0], perturbed)
    assert all(miss > tolerance for miss, tolerance in misses), misses


def test_alpha_ranks_the_same_hypotheses_never_a_shorter_first(translator, val_ids):
    picks = []
    for ids in val_ids:
        searches = [beam_steps(translator.model, ids, 4, a) for a in (0.6, 2.0)]
        (small, beams), (large, again) = searches
        assert beams == again  # the same beam at every step: alpha is not used
        # Both searches finish the same hypotheses; a score times its penalty gives
        # back the same log P, each through under 4 float64 roundings.
        log_p = [
            {tuple(h): s * tat.length_penalty(len(h) - 1, a) for s, h in found}
            for a, found in ((0.6, small), (2.0, large))
        ]
        assert log_p[0].keys() == log_p[1].keys()
        for h, value in log_p[0].items():
            tolerance = rounding_tolerance(4, abs(value), torch.double)
            assert value == pytest.approx(log_p[1][h], abs=tolerance)
        ranked_small, ranked_large = ([tuple(h) for _, h in f] for f in (small, large))
        for i, a in enumerate(ranked_large):  # a ranks above b with alpha 2.0
            for b in ranked_large[i + 1 :]:
                assert len(a) >= len(b) or ranked_small.index(a) < ranked_small.index(b)
        picks.append((len(small[0][1]), len(large[0][1])))
    assert all(s <= large for s, large in picks)
    # Not vacuous: on some sentence the larger alpha picks a longer hypothesis.
    assert any(s < large for s, large in picks), picks


def test_the_decoding_examples_and_the_beam_tree_show_the_readers_translator(
    translator, val_ids, multi30k_dir, capsys
):
    """The beam tree: a node per hypothesis kept (<s>, each step's beam, the
    finished ones below, ranked and scored) and an edge to its parent."""
    tat.example_cache(translator, multi30k_dir, n=10)
    tat.example_beam_search(translator, multi30k_dir, n=2)
    spec = tat.example_beam_tree(translator, multi30k_dir, 0, 4, (0.6, 2.0)).to_dict()
    words = translator.vocab_tgt.lookup_tokens
    searches = {a: beam_steps(translator.model, val_ids[0], 4, a) for a in (0.6, 2.0)}
    finished, beams = searches[0.6]
    lines, dots, _ = spec["layer"]
    nodes, edges = (spec["datasets"][layer["data"]["name"]] for layer in (dots, lines))
    assert len(nodes) == 1 + sum(map(len, beams)) + len(finished)
    for step, beam in enumerate(beams, start=1):
        for row, (ids, log_p) in enumerate(beam, start=1):
            text = dict(label=words(ids)[-1], hypothesis=" ".join(words(ids)))
            assert dict(step=step, row=row, **text, **{"log P": log_p}) in nodes
    below = max(map(len, beams)) + 1
    for i, (score, ids) in enumerate(finished):  # below the beam, ranked, scored
        (node,) = [n for n in nodes if n["row"] == below + i]
        assert node["label"] == f"{words(ids)[-1]} {score:.2f}"
        assert node["hypothesis"] == " ".join(words(ids))
    hypothesis = {(n["step"], n["row"]): n["hypothesis"] for n in nodes}
    assert len(edges) == len(nodes) - 1  # every node but <s> has one parent
    for e in edges:
        child = hypothesis[e["to_step"], e["to_row"]]
        assert e["to_step"] == e["step"] + 1
        assert child.rsplit(" ", 1)[0] == hypothesis[e["step"], e["row"]]
    printed = capsys.readouterr().out
    for alpha, (found, _) in searches.items():
        assert f"α = {alpha} picks: {' '.join(words(found[0][1]))}\n" in printed
    assert re.search(r"^\d+ of 10 sentences translated identically", printed, re.M)
    assert re.search(r"s with the cache: [\d.]+x as fast$", printed, re.M)
    assert printed.count("\n  beam:      ") == 2
