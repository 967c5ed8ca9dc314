"""Part 4: incremental decoding with a key/value cache, and beam search over a batch."""

import copy
import math
import re

import pytest
import torch
from conftest import trained_copy_task

import the_annotated_transformer as tat
from workshop.translate import translation

START, PAD = tat.COPY_START, tat.COPY_PAD


@pytest.fixture(scope="module")
def copy_model():
    """The copy-task model of seed 1, as Part 2's tests trained it."""
    return trained_copy_task(1)[0]


@pytest.fixture(scope="module")
def untrained_model():
    torch.manual_seed(3)
    return tat.make_model(13, 13, N=2, d_model=32, d_ff=64, h=4).eval()


def copy_sources(n=6, seed=11):
    rng = torch.Generator().manual_seed(seed)
    batch = next(tat.data_gen(11, n, 1, generator=rng))
    return batch.src, batch.src_mask


def untrained_sources():
    torch.manual_seed(5)
    src = torch.randint(3, 13, (5, 7))
    src[1, 4:] = 2  # one padded sentence
    return src, (src != 2).unsqueeze(-2)


@pytest.fixture(scope="module")
def untrained_post_norm_model():
    torch.manual_seed(4)
    return tat.make_model(13, 13, N=2, d_model=32, d_ff=64, h=4, norm_first=False)


# The trained copy model costs a minute of training on a 2-core CPU (unless Part 2's
# tests trained it first): its cases, and the tests that take it, are slow.
@pytest.fixture(
    params=[
        pytest.param("trained copy model", marks=pytest.mark.slow),
        "untrained model",
        "untrained post-norm model",
    ]
)
def case(request, untrained_model, untrained_post_norm_model):
    if request.param == "trained copy model":
        return (request.getfixturevalue("copy_model"), *copy_sources(), START, None)
    if request.param == "untrained model":
        return (untrained_model, *untrained_sources(), 0, 1)
    return (untrained_post_norm_model.eval(), *untrained_sources(), 0, 1)


def float32_tolerance(model, log_probs, through_encoder=False):
    """How far a cached and a full decoder step may differ in float32.

    Both compute the same function, but over differently shaped products (one new row
    against the whole prefix), so their sums are added in different orders and each
    rounding may land one unit in the last place (eps = 2**-23, relative) apart. To
    first order these differences add up along the path from input to output: about
    16 sequential float32 operations per decoder layer (a norm, four projections,
    two attention products and a softmax per attention sublayer, two feed-forward
    products, the residual adds) and 3 in the generator, each off by up to eps times
    the largest magnitude that reaches the output, the largest |log probability|.
    Where the two also encode differently shaped sources, the encoder's layers (about
    12 steps each) lie on the path too. A tolerance tuned to one CPU's kernels would
    be far smaller; this bound holds for any order of summation.
    """
    steps = 16 * len(model.decoder.layers) + 3
    if through_encoder:
        steps += 12 * len(model.encoder.layers)
    return steps * torch.finfo(torch.float32).eps * log_probs.abs().max().item()


def step_log_probs(model, src, src_mask, ys, cache=None):
    """The decoder's log-probabilities after each prefix of ys, stacked."""
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        return torch.stack(
            [
                tat.decode_step(model, memory, src_mask, ys[:, :t], cache)
                for t in range(1, ys.size(1))
            ]
        )


def test_cached_and_uncached_greedy_decoding_choose_the_same_tokens(case):
    model, src, src_mask, start, end = case
    kwargs = dict(end_symbol=end, pad_symbol=2 if end is not None else None)
    cached = tat.cached_greedy_decode(model, src, src_mask, 10, start, **kwargs)
    plain = tat.greedy_decode(model, src, src_mask, 10, start, **kwargs)
    assert cached.shape[0] == plain.shape[0]
    # An untrained model may nearly tie two tokens, and the cached step may round
    # up to float32_tolerance away from the full one: where the top two lie within
    # twice that, either choice is right, so each row is compared up to its first
    # such step (as the beam-search tests keep away from near ties).
    steps = step_log_probs(model, src, src_mask, plain)  # (step, batch, vocab)
    top2 = steps.topk(2, dim=-1).values
    tied = (top2[..., 0] - top2[..., 1]) <= 2 * float32_tolerance(model, steps)
    compared = 0
    for row in range(plain.size(0)):
        ties = tied[:, row].nonzero()
        length = 1 + (int(ties[0]) if len(ties) else tied.size(0))
        assert torch.equal(cached[row, :length], plain[row, :length]), row
        compared += length - 1
    assert compared >= tied.numel() // 2  # near-ties are rare


@pytest.mark.parametrize("capacity", [None, 2], ids=["default", "growing"])
def test_cached_step_log_probabilities_equal_uncached_ones_to_float32_rounding(
    case, capacity
):
    """With buffers of 2 positions the cache grows twice (to 4, then 8) on the way
    to 9 positions, and must keep every position it held."""
    model, src, src_mask, start, end = case
    ys = tat.greedy_decode(model, src, src_mask, 10, start)
    cache = tat.KVCache(model, capacity)
    cached = step_log_probs(model, src, src_mask, ys, cache)
    plain = step_log_probs(model, src, src_mask, ys)
    assert cache.length == ys.size(1) - 1 and cache.capacity >= cache.length
    tolerance = float32_tolerance(model, plain)
    torch.testing.assert_close(cached, plain, atol=tolerance, rtol=0)


class NoCache:
    """A stand-in for KVCache that recomputes every position at every step."""

    def step(self, model, memory, src_mask, ys):
        return tat.decode_step(model, memory, src_mask, ys)

    def reorder(self, rows):
        pass


def test_cached_and_uncached_beam_search_give_the_same_hypotheses_and_scores(case):
    model, src, src_mask, start, end = case
    end = 1 if end is None else end
    kwargs = dict(beam_size=4, pad_symbol=PAD, n_best=4)
    cached = tat.beam_search(model, src, src_mask, 10, start, end, **kwargs)
    plain = tat.beam_search(
        model, src, src_mask, 10, start, end, cache=NoCache(), **kwargs
    )
    # A score sums at most 9 step log-probabilities (each within the step tolerance)
    # and divides the sum by a length penalty of at least 1.
    ys = tat.greedy_decode(model, src, src_mask, 10, start)
    tolerance = 9 * float32_tolerance(model, step_log_probs(model, src, src_mask, ys))
    for hyps_cached, hyps_plain in zip(cached, plain, strict=True):
        assert [ids for ids, _ in hyps_cached] == [ids for ids, _ in hyps_plain]
        for (_, a), (_, b) in zip(hyps_cached, hyps_plain, strict=True):
            assert a == pytest.approx(b, abs=tolerance)


@pytest.mark.slow
def test_beam_search_on_a_padded_batch_gives_each_sentence_what_it_gets_alone(
    copy_model,
):
    rng = torch.Generator().manual_seed(7)
    lengths = [10, 6, 3, 8]
    src = torch.full((len(lengths), max(lengths)), PAD)
    for row, n in enumerate(lengths):
        src[row, 0] = START
        src[row, 1:n] = torch.randint(2, 11, (n - 1,), generator=rng)
    kwargs = dict(beam_size=3, pad_symbol=PAD, n_best=3)
    batched = tat.beam_search(
        copy_model, src, (src != PAD).unsqueeze(-2), 12, START, 1, **kwargs
    )
    for row, n in enumerate(lengths):
        alone_src = src[row : row + 1, :n]
        alone_mask = (alone_src != PAD).unsqueeze(-2)
        (alone,) = tat.beam_search(
            copy_model, alone_src, alone_mask, 12, START, 1, **kwargs
        )
        ys = tat.greedy_decode(copy_model, alone_src, alone_mask, 12, START)
        logp = step_log_probs(copy_model, alone_src, alone_mask, ys)
        # a score sums at most 11 step log-probabilities, over a length penalty >= 1
        tolerance = 11 * float32_tolerance(copy_model, logp, through_encoder=True)
        scores = [score for _, score in alone]
        gaps = [a - b for a, b in zip(scores, scores[1:], strict=False)]
        # Rounding can only reorder hypotheses whose scores lie within the tolerance;
        # these sources keep them further apart, so the order itself is compared.
        assert min(gaps) > 2 * tolerance, f"near tie in {scores}: choose other sources"
        assert [ids for ids, _ in batched[row]] == [ids for ids, _ in alone]
        for (_, a), (_, b) in zip(batched[row], alone, strict=True):
            assert a == pytest.approx(b, abs=tolerance)


def test_a_reordered_cache_continues_the_rows_it_keeps(untrained_model):
    """Beam search keeps, drops and repeats hypotheses; reorder does that to the
    cache, and the next step matches decoding the chosen prefixes from scratch."""
    model = untrained_model
    src, src_mask = untrained_sources()
    ys = tat.greedy_decode(model, src, src_mask, 6, 0)
    rows = torch.tensor([4, 1, 1, 0])  # a reordering, a repeat, dropped rows
    cache = tat.KVCache(model)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        for t in range(1, ys.size(1)):
            tat.decode_step(model, memory, src_mask, ys[:, :t], cache)
        cache.reorder(rows)
        memory, src_mask, ys = memory[rows], src_mask[rows], ys[rows]
        longer = torch.cat([ys, ys[:, -1:]], dim=1)  # one more token per row
        cached = tat.decode_step(model, memory, src_mask, longer, cache)
        plain = tat.decode_step(model, memory, src_mask, longer)
    assert cache.length == longer.size(1)
    tolerance = float32_tolerance(model, plain)
    torch.testing.assert_close(cached, plain, atol=tolerance, rtol=0)


def batch_of_sources(lengths, seed=7):
    """Copy-task sources of the given lengths, padded into one batch."""
    rng = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), PAD)
    for row, n in enumerate(lengths):
        src[row, 0] = START
        src[row, 1:n] = torch.randint(2, 11, (n - 1,), generator=rng)
    return src, (src != PAD).unsqueeze(-2)


@pytest.mark.slow
def test_the_books_beam_search_of_width_one_chooses_what_greedy_decoding_chooses(
    copy_model,
):
    src, src_mask = batch_of_sources([10, 7, 9])
    greedy = tat.greedy_decode(copy_model, src, src_mask, 10, START)
    beam = tat.beam_search(copy_model, src, src_mask, 10, START, 99, beam_size=1)
    assert torch.equal(beam, greedy)  # 99: no end symbol, so all run to max_len


# ---------------------------------------------------------------------------
# The cache, step by step


def test_the_cache_picture_computes_one_position_a_step_and_doubles_its_buffer(
    capsys,
):
    """The picture's cells come from a real KVCache with room for 2 positions: at
    step t it reads t - 1 positions, computes one, and its buffer has grown to the
    power of two (at least 2) that holds t."""
    spec = tat.chart_kv_cache(steps=8, capacity=2).to_dict()
    (cells,) = spec["datasets"].values()
    steps = {}
    for cell in sorted(cells, key=lambda cell: cell["slot"]):
        steps.setdefault(cell["step"], []).append(cell["held"])
    assert sorted(steps) == list(range(1, 9))
    for t, held in steps.items():
        capacity = 2 ** max(1, math.ceil(math.log2(t)))
        free = ["free"] * (capacity - t)
        assert held == ["read from the cache"] * (t - 1) + ["computed"] + free, t
    printed = capsys.readouterr().out
    assert "8 steps: 8 positions computed with the cache, 36 without" in printed


# ---------------------------------------------------------------------------
# A picture of beam search: beam_search(..., steps=[]) records every step's beam


def beam_steps(model, src_ids, k, alpha):
    """beam_search of one sentence, recording its steps: its k finished (score, ids),
    best first, and each step's beam, the live (ids, log P) rows, best first."""
    steps, src = [], torch.tensor([src_ids])
    ends = (len(src_ids) + 50, tat.BOS, tat.EOS)
    options = dict(alpha=alpha, n_best=k, steps=steps)
    (found,) = tat.beam_search(model, src, None, *ends, k, **options)
    beams = [
        [(ids, p) for ids, p in zip(ys, log_ps, strict=True) if p > -math.inf]
        for ys, log_ps in steps
    ]
    return [(score, ids) for ids, score in found], beams


@pytest.fixture(scope="module")
def smoke_translator(trained_checkpoint):
    """The smoke run's translator (decoding in eval mode keeps the weights)."""
    return translation.load_translator(trained_checkpoint, device="cpu")


@pytest.fixture(scope="module")
def val_ids(multi30k_dir, smoke_translator):
    """The source ids of the first four validation sentences."""
    pairs = tat.read_split(multi30k_dir, "val")[:4]
    return smoke_translator.encode([de for de, _ in pairs])


def test_a_search_that_records_its_steps_finds_what_beam_search_returns(
    smoke_translator, val_ids
):
    model = smoke_translator.model
    for ids in val_ids:
        for alpha in (0.6, 2.0):
            finished, _ = beam_steps(model, ids, 3, alpha)
            src = torch.tensor([ids])
            ends = (len(ids) + 50, tat.BOS, tat.EOS)  # as beam_steps searches
            options = dict(beam_size=3, alpha=alpha)
            out = tat.beam_search(
                model, src, tat.padding_mask(src, tat.PAD), *ends, **options
            )
            assert finished[0][1] == out[0].tolist()
            assert len(finished) == 3  # the search stops once k have finished


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


def test_beam_search_with_one_generator_weight_changed_returns_another_hypothesis(
    smoke_translator, val_ids
):
    """The control of the test above, whose comparison is exact: beam_search run on a
    copy whose best first word's logit after <s> is 10 nats lower returns another
    hypothesis than beam_steps found on the model itself. (No small step can show
    it: a search's output changes only where a step turns a decision. Here that
    word's log-probability after <s> falls from -0.4 to -9.3, below the k = 3 words
    then kept, -1.5 to -3.9 (measured): no hypothesis that begins with it survives
    the first step.)"""
    model = smoke_translator.model
    for ids in val_ids:
        finished, _ = beam_steps(model, ids, 3, 0.6)
        perturbed = with_first_logit_moved(model, ids, finished[0][1][1], -10.0)
        src = torch.tensor([ids])
        ends = (len(ids) + 50, tat.BOS, tat.EOS)
        options = dict(beam_size=3, alpha=0.6)
        out = tat.beam_search(
            perturbed, src, tat.padding_mask(src, tat.PAD), *ends, **options
        )
        assert finished[0][1] != out[0].tolist()


def test_each_step_keeps_at_most_k_live_hypotheses_each_extending_one_kept_before(
    smoke_translator, val_ids
):
    for ids in val_ids:
        finished, beams = beam_steps(smoke_translator.model, ids, 4, 0.6)
        kept = [[[tat.BOS]]] + [[h for h, _ in beam] for beam in beams]
        for step, beam in enumerate(kept[1:], start=1):
            assert 1 <= len(beam) <= 4
            assert all(len(h) == step + 1 and h[-1] != tat.EOS for h in beam)
            assert all(h[:-1] in kept[step - 1] for h in beam), step
        for _, hypothesis in finished:  # each ends a hypothesis kept a step before
            assert hypothesis[-1] == tat.EOS
            assert hypothesis[:-1] in kept[len(hypothesis) - 2]


def fresh_log_probs(model, src_ids, hypothesis):
    """The model's log-probability of each token of `hypothesis` (ids with <s>),
    decoded from scratch without the cache: (tokens, vocab)."""
    src, ys = torch.tensor([src_ids]), torch.tensor([hypothesis])
    with torch.no_grad():
        memory = model.encode(src, None)
        out = model.decode(
            memory, None, ys[:, :-1], tat.subsequent_mask(ys.size(1) - 1)
        )
        return model.generator(out)[0]


def test_each_kept_hypothesis_log_p_is_the_sum_of_its_tokens_log_probabilities(
    smoke_translator, val_ids
):
    """Each child's log P is its parent's plus its own token's log-probability,
    recomputed here from scratch."""
    model = smoke_translator.model.eval()
    ids = val_ids[0]
    _, beams = beam_steps(model, ids, 4, 0.6)
    for step, misses in enumerate(log_p_misses(model, ids, beams), start=1):
        for miss, tolerance, hypothesis in misses:
            assert miss <= tolerance, (step, hypothesis)


def log_p_misses(model, src_ids, beams, fresh_model=None):
    """Per step of the beam, each kept hypothesis's (|log P - the sum of its tokens'
    log-probabilities recomputed from scratch by fresh_model (default: model)|, the
    tolerance, the hypothesis)."""
    eps = torch.finfo(torch.float32).eps
    misses = []
    for step, beam in enumerate(beams, start=1):
        misses.append([])
        for hypothesis, log_p in beam:
            log_probs = fresh_log_probs(fresh_model or model, src_ids, hypothesis)
            tokens = torch.tensor(hypothesis[1:]).unsqueeze(1)
            fresh = log_probs.gather(1, tokens).double().sum().item()
            # The search's cached steps and these full ones differ per step by at
            # most float32_tolerance (see it); log P sums `step` of them, and its
            # float32 running sum rounds once per step, by eps * |log P| at most.
            tolerance = step * (float32_tolerance(model, log_probs) + eps * abs(fresh))
            misses[-1].append((abs(log_p - fresh), tolerance, hypothesis))
    return misses


# The control's step: the logit of the first beam's best word after <s> moves by
# 0.03 nats. Every hypothesis's first token is read after <s>, where the word (of
# probability p, about 0.67 here) gains 0.03 (1 - p) in log-probability and every
# other word loses 0.03 p: at least 0.03 min(p, 1 - p) ~ 0.01, which is 500 times
# the tolerance of a one-token hypothesis (2e-5) and still 40 times that of the
# longest, 11 tokens (2.5e-4). Measured, every kept hypothesis misses by 36 to 970
# times its tolerance (the unperturbed ones by at most 0.03 times). A logit moved by
# a few hundredths of a nat: a slip no rounding explains, not another model.
LOGIT_STEP = 0.03


def test_log_p_recomputed_with_one_generator_weight_changed_misses_beyond_tolerance(
    smoke_translator, val_ids
):
    """The control of the test above: the beam is the model's own, the recomputation
    a copy's with one generator weight changed (LOGIT_STEP), and the comparison
    fails; every hypothesis of the first beam, one token each, misses (the step's
    comment derives why), and so the equality test would fail."""
    model = smoke_translator.model.eval()
    ids = val_ids[0]
    _, beams = beam_steps(model, ids, 4, 0.6)
    perturbed = with_first_logit_moved(model, ids, beams[0][0][0][1], LOGIT_STEP)
    misses = log_p_misses(model, ids, beams, fresh_model=perturbed)
    assert all(miss > tolerance for miss, tolerance, _ in misses[0]), misses[0]


def test_alpha_ranks_the_same_finished_hypotheses_and_never_prefers_a_shorter_one(
    smoke_translator, val_ids
):
    model, picks = smoke_translator.model, []
    for ids in val_ids:
        small, large = (beam_steps(model, ids, 4, alpha) for alpha in (0.6, 2.0))
        assert small[1] == large[1]  # the same beam at every step: alpha is not used
        log_p = {}  # each finished hypothesis's log P, as each alpha's score gives it
        for alpha, (finished, _) in ((0.6, small), (2.0, large)):
            for score, h in finished:
                log_p.setdefault(tuple(h), []).append(
                    score * tat.length_penalty(len(h) - 1, alpha)
                )
        # Both searches finish the same hypotheses; a score times its penalty gives
        # back the same log P, up to the rounding of one division and one product.
        assert all(len(both) == 2 for both in log_p.values())
        for a, b in log_p.values():
            assert a == pytest.approx(b, rel=4 * torch.finfo(torch.float64).eps)
        rank = {
            a: [tuple(h) for _, h in f] for a, (f, _) in ((0.6, small), (2.0, large))
        }
        for shorter in rank[2.0]:
            for longer in rank[2.0]:
                if len(shorter) < len(longer) and (
                    rank[2.0].index(shorter) < rank[2.0].index(longer)
                ):
                    assert rank[0.6].index(shorter) < rank[0.6].index(longer)
        picks.append((len(rank[0.6][0]), len(rank[2.0][0])))
    assert all(small <= large for small, large in picks)
    # Not vacuous: on some sentence the larger alpha picks a longer hypothesis.
    assert any(small < large for small, large in picks), picks


def test_the_beam_tree_has_a_node_per_hypothesis_and_an_edge_to_its_parent(
    smoke_translator, val_ids, multi30k_dir, capsys
):
    tree = tat.example_beam_tree(smoke_translator, multi30k_dir, k=4, alphas=(0.6, 2.0))
    spec = tree.to_dict()  # the beam of validation sentence 0
    model, words = smoke_translator.model, smoke_translator.vocab_tgt.lookup_tokens
    searches = {a: beam_steps(model, val_ids[0], 4, a) for a in (0.6, 2.0)}
    finished, beams = searches[0.6]
    lines, dots, text = spec["layer"]
    nodes, edges = (spec["datasets"][layer["data"]["name"]] for layer in (dots, lines))
    assert text["data"] == dots["data"] and text["encoding"]["text"]["field"] == "label"
    assert dots["encoding"]["color"]["field"] == "log P"
    assert len(nodes) == 1 + sum(map(len, beams)) + len(finished)  # <s>, kept, ended
    for step, beam in enumerate(beams, start=1):
        for row, (ids, log_p) in enumerate(beam, start=1):
            node = dict(step=step, row=row, label=words(ids)[-1])
            node.update({"hypothesis": " ".join(words(ids)), "log P": log_p})
            assert node in nodes
    below = max(map(len, beams)) + 1
    for i, (score, ids) in enumerate(finished):  # below the beam, ranked, scored
        (node,) = [n for n in nodes if n["row"] == below + i]
        assert node["hypothesis"] == " ".join(words(ids))
        assert node["label"] == f"{words(ids)[-1]} {score:.2f}"
        lp = tat.length_penalty(len(ids) - 1, 0.6)
        assert node["log P"] == pytest.approx(score * lp, rel=1e-12)
    hypothesis = {(n["step"], n["row"]): n["hypothesis"] for n in nodes}
    assert len(edges) == len(nodes) - 1  # every node but <s> has one parent
    for edge in edges:
        child = hypothesis[edge["to_step"], edge["to_row"]]
        assert edge["to_step"] == edge["step"] + 1
        assert child.rsplit(" ", 1)[0] == hypothesis[edge["step"], edge["row"]]
    printed = capsys.readouterr().out
    for alpha, (found, _) in searches.items():
        assert f"α = {alpha} picks: {' '.join(words(found[0][1]))}\n" in printed


def test_the_decoding_examples_run_on_the_readers_translator(
    smoke_translator, multi30k_dir, capsys
):
    tat.example_cache(smoke_translator, multi30k_dir, n=10)
    tat.example_beam_search(smoke_translator, multi30k_dir, n=2)
    printed = capsys.readouterr().out
    assert re.search(r"^\d+ of 10 sentences translated identically", printed, re.M)
    assert re.search(r"s with the cache: [\d.]+x as fast$", printed, re.M)
    assert printed.count("\n  beam:      ") == 2
    examples = (tat.example_cache, tat.example_beam_search, tat.example_beam_tree)
    assert all(example(None, None) is None for example in examples)
    assert capsys.readouterr().out == ""  # without a translator: nothing to show
