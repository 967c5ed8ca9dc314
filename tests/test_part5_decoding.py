"""Part 5: incremental decoding with a key/value cache, and beam search."""

import math

import pytest
import torch

import the_annotated_transformer as tat

START, PAD = tat.COPY_START, tat.COPY_PAD


@pytest.fixture(scope="module")
def copy_model():
    """A copy-task model trained briefly (enough to copy most sequences)."""
    config = tat.CopyTaskConfig(epochs=8)
    model, _ = tat.train_copy_task(config, quiet=True, device="cpu")
    return model.eval()


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


@pytest.fixture(params=["trained copy model", "untrained model"])
def case(request, copy_model, untrained_model):
    if request.param == "trained copy model":
        return (copy_model, *copy_sources(), START, None)
    return (untrained_model, *untrained_sources(), 0, 1)


def test_cached_and_uncached_greedy_decoding_choose_the_same_tokens(case):
    model, src, src_mask, start, end = case
    kwargs = dict(end_symbol=end, pad_symbol=2 if end is not None else None)
    cached = tat.greedy_decode(
        model, src, src_mask, 10, start, use_cache=True, **kwargs
    )
    plain = tat.greedy_decode(
        model, src, src_mask, 10, start, use_cache=False, **kwargs
    )
    assert torch.equal(cached, plain)


def test_cached_step_log_probabilities_equal_uncached_ones_to_1e_5(case):
    model, src, src_mask, start, end = case
    ys = tat.greedy_decode(model, src, src_mask, 10, start, use_cache=False)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        cache = tat.init_cache(model)
        for t in range(1, ys.size(1)):
            cached = tat.decode_step(model, memory, src_mask, ys[:, :t], cache)
            plain = tat.decode_step(model, memory, src_mask, ys[:, :t])
            assert tat.cache_length(cache) == t
            torch.testing.assert_close(cached, plain, atol=1e-5, rtol=0)


def test_cached_and_uncached_beam_search_give_the_same_hypotheses_and_scores(case):
    model, src, src_mask, start, end = case
    end = 1 if end is None else end
    kwargs = dict(beam_size=4, pad_symbol=PAD, n_best=4)
    cached = tat.beam_search(model, src, src_mask, 10, start, end, **kwargs)
    plain = tat.beam_search(
        model, src, src_mask, 10, start, end, use_cache=False, **kwargs
    )
    for hyps_cached, hyps_plain in zip(cached, plain, strict=True):
        assert [ids for ids, _ in hyps_cached] == [ids for ids, _ in hyps_plain]
        for (_, a), (_, b) in zip(hyps_cached, hyps_plain, strict=True):
            assert a == pytest.approx(b, abs=1e-5)


def test_beam_size_one_equals_greedy_decoding(case):
    model, src, src_mask, start, end = case
    end = 1 if end is None else end
    greedy = tat.greedy_decode(
        model, src, src_mask, 10, start, end_symbol=end, pad_symbol=PAD
    )
    beam = tat.beam_search(model, src, src_mask, 10, start, end, beam_size=1)
    beam = torch.nn.functional.pad(beam, (0, greedy.size(1) - beam.size(1)), value=PAD)
    # greedy pads after </s> with PAD; beam pads with </s> by default: compare up to it
    for g, b in zip(greedy.tolist(), beam.tolist(), strict=True):
        cut = g.index(end) + 1 if end in g else len(g)
        assert g[:cut] == b[:cut]


def test_n_best_lists_are_sorted_by_their_length_normalised_score(untrained_model):
    src, src_mask = untrained_sources()
    n_best = tat.beam_search(
        untrained_model, src, src_mask, 12, 0, 1, beam_size=4, n_best=4
    )
    assert len(n_best) == src.size(0)
    for hyps in n_best:
        assert len(hyps) == 4
        scores = [score for _, score in hyps]
        assert scores == sorted(scores, reverse=True)
        assert all(ids[0] == 0 for ids, _ in hyps)


def test_beam_score_is_log_probability_over_the_gnmt_length_penalty(untrained_model):
    src, src_mask = untrained_sources()
    hyps = tat.beam_search(untrained_model, src, src_mask, 6, 0, 1, n_best=2)
    ids, score = hyps[0][0]
    with torch.no_grad():  # rescore the hypothesis token by token
        memory = untrained_model.encode(src[:1], src_mask[:1])
        ys = torch.tensor([ids])
        log_prob = sum(
            tat.decode_step(untrained_model, memory, src_mask[:1], ys[:, :t])[
                0, ids[t]
            ].item()
            for t in range(1, len(ids))
        )
    generated = len(ids) - 1
    assert score == pytest.approx(log_prob / ((5 + generated) / 6) ** 0.6, abs=1e-4)
    assert tat.length_penalty(1, 0.6) == pytest.approx(1.0)
    assert tat.length_penalty(7, 0.0) == 1.0


@pytest.mark.parametrize("decoder", ["greedy", "beam"])
def test_a_sentence_that_ends_early_stops_growing_while_others_continue(
    copy_model, decoder
):
    # The copy model reproduces its input. Declare symbol 9 the end symbol: the first
    # sentence holds it at position 3, the second nowhere, so only the first ends.
    src = torch.tensor([[1, 4, 5, 9, 6, 7, 8, 5, 4, 3], [1, 2, 3, 4, 5, 6, 7, 8, 2, 3]])
    src_mask = torch.ones(2, 1, 10, dtype=torch.bool)
    if decoder == "greedy":
        out = tat.greedy_decode(copy_model, src, src_mask, 10, START, end_symbol=9)
    else:
        out = tat.beam_search(copy_model, src, src_mask, 10, START, 9, beam_size=3)
    assert out[0, :4].tolist() == [1, 4, 5, 9]
    assert set(out[0, 4:].tolist()) <= {9}  # nothing but padding after the end
    assert out.size(1) == 10
    assert out[1].tolist() == src[1].tolist()  # the other sentence kept going


def test_beam_search_stops_early_once_every_sentence_has_finished(copy_model):
    src = torch.tensor([[1, 4, 9, 5, 6, 7, 8, 5, 4, 3]])
    out = tat.beam_search(
        copy_model, src, torch.ones(1, 1, 10, dtype=torch.bool), 10, START, 9
    )
    assert out.size(1) < 10  # stopped before the maximum length
    assert out[0, :3].tolist() == [1, 4, 9]


def test_beam_search_restores_training_mode_and_rejects_bad_sizes(untrained_model):
    src, src_mask = untrained_sources()
    untrained_model.train()
    try:
        tat.beam_search(untrained_model, src, src_mask, 5, 0, 1, beam_size=2)
        assert untrained_model.training
    finally:
        untrained_model.eval()
    with pytest.raises(ValueError, match="beam_size"):
        tat.beam_search(untrained_model, src, src_mask, 5, 0, 1, beam_size=0)
    with pytest.raises(ValueError, match="n_best"):
        tat.beam_search(untrained_model, src, src_mask, 5, 0, 1, beam_size=2, n_best=3)


def test_positional_encoding_with_an_offset_matches_the_full_sequence():
    pe = tat.PositionalEncoding(16, 0.0, max_len=50)
    x = torch.randn(2, 12, 16)
    full = pe(x)
    assert torch.allclose(pe(x[:, 7:], start=7), full[:, 7:])
    with pytest.raises(ValueError, match="max_len"):
        pe(x[:, :5], start=48)


def test_time_decoding_reports_positive_durations(untrained_model):
    src, src_mask = untrained_sources()
    with torch.no_grad():
        memory = untrained_model.encode(src, src_mask)
    for use_cache in (True, False):
        seconds = tat.time_decoding(untrained_model, memory, src_mask, 3, use_cache)
        assert math.isfinite(seconds) and seconds > 0
