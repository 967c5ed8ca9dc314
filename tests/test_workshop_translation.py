"""workshop/translate/translation.py from Python: the Translator that `load_translator`
gives (one answer per sentence, blank ones too; n-best lists from the book's beam
search; the hard limit; progress, told by the book's key/value cache extended), and
sampling (filter_log_probs, sample_decode, seeds). The command line's translate is
tested in tests/test_cli.py; the book's searches and its cache in
tests/test_part4_decoding.py.
"""

import io
import math
import re

import pytest
import test_devices
import torch
from conftest import tiny_checkpoint

import the_annotated_transformer as tat
from workshop.errors import UsageError
from workshop.translate import translation

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

SENTENCES = ["Ein Hund läuft über die Wiese.", "", "Zwei Männer spielen Fußball."]


# ---------------------------------------------------------------------------
# One answer per sentence


def echo(model, src, src_mask, max_len, start_symbol, **options):
    """A decode function (the book's protocol) that answers each source with
    itself: a translation that shows which sentence it answers."""
    return src


@pytest.fixture
def echoing(tmp_path):
    """A Translator whose two vocabularies are one, so that echo's answers are the
    sentences' own words."""
    tiny_checkpoint(tmp_path / "tiny.pt", seed=0, words=["a", "dog", "runs", "cat"])
    return translation.load_translator(tmp_path / "tiny.pt", device="cpu")


def test_translate_answers_each_sentence_in_its_place_a_blank_one_with_nothing(
    echoing,
):
    sentences = ["a dog", "", "runs", "   ", "a cat runs", "dog"]
    answers = echoing.translate(sentences, batch_size=2, decode=echo)
    assert answers == ["a dog", "", "runs", "", "a cat runs", "dog"]


def test_translations_hands_out_the_first_answers_before_the_last_window_is_decoded(
    echoing,
):
    """The input is decoded in windows of WINDOW_BATCHES batches, in input order:
    the first answers come once the first window is decoded, though the sentence
    that starts the input is the longest of its window (decoded last in it). The
    answers, blank ones included, are translate's, in input order."""
    decoded = []

    def recording(model, src, *args, **options):
        decoded.append(src.size(0))
        return src

    window = translation.WINDOW_BATCHES  # sentences, in batches of 1
    sentences = ["a cat runs", "dog", "", "a dog", *["runs", ""] * window]
    answers = echoing.translations(sentences, batch_size=1, decode=recording)
    assert decoded == []  # an iterator: nothing is decoded before it is asked
    first = next(answers)
    assert first == "a cat runs" and decoded == [1] * window
    rest = list(answers)
    assert len(decoded) == len([s for s in sentences if s]) == window + 3
    assert [first, *rest] == [s.strip() for s in sentences]
    assert echoing.translate(sentences, batch_size=1, decode=echo) == [first, *rest]


def test_translations_checks_its_arguments_before_it_is_iterated(echoing):
    with pytest.raises(UsageError, match="n_best 2 needs a beam of at least 2"):
        echoing.translations(["a dog"], n_best=2)
    blank = echoing.translations(["", " "], n_best=2, beam_size=2)  # all blank
    assert list(blank) == [[], []]


def test_the_batches_translate_the_blank_sentences_not(echoing):
    seen = []

    def recording(model, src, *args, **options):
        seen.append(src.size(0))
        return src

    echoing.translate(["a dog", "", "runs", "   "], decode=recording)
    assert seen == [2]


def test_a_sentence_beyond_the_hard_limit_is_refused_before_any_work(
    translator, monkeypatch
):
    def never(*args, **kwargs):
        raise AssertionError("tokenized a sentence that should have been refused")

    monkeypatch.setattr(translator, "encode", never)
    limit = translation.MAX_SENTENCE_CHARACTERS
    with pytest.raises(UsageError, match=f"sentence 2 has {limit + 1:,} characters"):
        translator.translate(["Ein Hund.", "x" * (limit + 1)])
    translation.check_sentence(1, "x" * limit)  # the control: at the limit, read


def test_translate_takes_sentences_as_strings_only(translator):
    with pytest.raises(UsageError, match="sentence 1 is a int"):
        translator.translate([42])


# ---------------------------------------------------------------------------
# n-best


def test_n_best_answers_each_sentence_with_the_beams_best_first(translator):
    found = translator.translate(SENTENCES, beam_size=3, n_best=3)
    best = translator.translate(SENTENCES, beam_size=3)
    assert found[1] == []  # the blank sentence has none
    for hypotheses, one in zip(found[::2], best[::2], strict=True):
        assert len(hypotheses) == 3 and hypotheses[0][0] == one
        scores = [score for _, score in hypotheses]
        assert scores == sorted(scores, reverse=True)
        assert all(isinstance(text, str) for text, _ in hypotheses)


def test_n_best_scores_are_the_books_beam_scores(translator):
    """Each (translation, score) is one of the book's beam search's finished
    hypotheses for the sentence alone, score for score: log P over the length
    penalty. The translator searches it beside a longer sentence, in a padded
    batch, so the scores agree to float32 rounding of a sum of ~20
    log-probabilities (each below 50)."""
    model, k, alpha = translator.model, 3, 0.6
    sentences = [SENTENCES[0], SENTENCES[2] + " " + SENTENCES[2]]
    found = translator.translate(sentences, beam_size=k, alpha=alpha, n_best=k)
    (src_ids,) = translator.encode(sentences[:1])
    src = torch.tensor([src_ids])
    src_mask = tat.padding_mask(src, tat.PAD)
    max_len = min(src.size(1) + 50, translation.positions(model))
    ends = dict(pad_symbol=tat.PAD, n_best=k, alpha=alpha)
    (book,) = tat.beam_search(
        model, src, src_mask, max_len, tat.BOS, tat.EOS, k, **ends
    )
    expected = [(translator.text(translation._inner(ids)), s) for ids, s in book]
    assert [text for text, _ in found[0]] == [text for text, _ in expected]
    tolerance = 20 * 50 * torch.finfo(torch.float32).eps  # 20 terms of size <= 50
    for (_, score), (_, book_score) in zip(found[0], expected, strict=True):
        assert score == pytest.approx(book_score, abs=tolerance)


def test_n_best_without_a_beam_that_large_is_refused_saying_what_to_pass(
    translator,
):
    with pytest.raises(UsageError, match=r"beam_size 3 or more; it has 1"):
        translator.translate(SENTENCES, n_best=3)
    with pytest.raises(UsageError, match=r"it has 2"):
        translator.translate(SENTENCES, n_best=3, beam_size=2)


# ---------------------------------------------------------------------------
# Sampling


def test_an_alpha_without_a_beam_is_refused_and_a_beam_without_one_takes_0_6():
    """alpha changes only a beam search: given to greedy decoding or sampling it
    is refused, as sampling's options are without sample=True."""
    with pytest.raises(UsageError, match=r"^alpha: .* only in a beam search \(beam_"):
        translation.decode_options(alpha=1.0)
    with pytest.raises(UsageError, match="beam search, and sample draws"):
        translation.decode_options(alpha=0.6, sample=True)
    assert translation.decode_options(4)["alpha"] == translation.ALPHA == 0.6
    assert translation.decode_options(4, 0)["alpha"] == 0


def test_filter_log_probs_keeps_the_top_k_and_the_fewest_that_hold_top_p():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    log_probs = probs.log()
    kept = translation.filter_log_probs(log_probs, top_k=2).isfinite()
    assert kept.tolist() == [[False, True, False, True]]
    # Ranked 0.4, 0.3, 0.2, 0.1: before 0.3 lies 0.4 < 0.5 (kept); before 0.2 lies
    # 0.7 >= 0.5 (dropped).
    kept = translation.filter_log_probs(log_probs, top_p=0.5).isfinite()
    assert kept.tolist() == [[False, True, False, True]]
    kept = translation.filter_log_probs(log_probs, top_p=0.4).isfinite()
    assert kept.tolist() == [[False, True, False, False]]  # 0.4 alone holds 0.4
    assert translation.filter_log_probs(log_probs, top_p=1.0).isfinite().all()


def test_a_temperature_raises_each_probability_to_the_power_one_over_t():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]], dtype=torch.float64)
    for t in (0.5, 2.0):
        drawn = translation.filter_log_probs(probs.log(), temperature=t).softmax(-1)
        expected = probs ** (1 / t) / (probs ** (1 / t)).sum()
        torch.testing.assert_close(drawn, expected.float())


def test_sampling_draws_the_first_word_from_the_filtered_distribution(translator):
    """n rows of one sentence, one step: each word's share of the draws is its
    probability after the temperature and top-k, within 5 standard errors
    sqrt(p (1 - p) / n) (a false alarm about once in 1.7 million per word)."""
    model, n = translator.model, 4000
    (ids,) = translator.encode(SENTENCES[:1])
    src = torch.tensor([ids] * n)
    src_mask = tat.padding_mask(src, tat.PAD)
    options = dict(temperature=0.7, top_k=5)
    generator = torch.Generator().manual_seed(0)
    out = translation.sample_decode(
        model, src, src_mask, 2, tat.BOS, generator=generator, **options
    )
    with torch.no_grad():
        log_probs = tat.decode_step(
            model, model.encode(src[:1], src_mask[:1]), src_mask[:1], src[:1, :1]
        )
    expected = translation.filter_log_probs(log_probs, **options).softmax(-1)[0]
    counts = torch.bincount(out[:, 1], minlength=expected.numel()).double() / n
    assert int((counts > 0).sum()) <= 5  # nothing beyond the top 5 is drawn
    error = (expected * (1 - expected) / n).sqrt().double()
    assert ((counts - expected.double()).abs() <= 5 * error + 1e-12).all()


def test_top_k_1_sampling_is_greedy_decoding(translator):
    greedy = translator.translate(SENTENCES)
    assert translator.translate(SENTENCES, sample=True, top_k=1, seed=3) == greedy
    assert translator.translate(SENTENCES, sample=True, top_p=1e-6, seed=4) == greedy


def test_a_seed_draws_the_same_sample_again_and_another_seed_another(translator):
    sentences = [SENTENCES[0], SENTENCES[2]] * 3
    first = translator.translate(sentences, sample=True, seed=1)
    assert translator.translate(sentences, sample=True, seed=1) == first
    assert translator.translate(sentences, sample=True, seed=2) != first


def test_a_samples_score_is_its_log_probability_under_the_model(translator):
    """n_best samples come with log P of their ids: the sum, over their words, of
    the model's log-probability, recomputed here without the cache, one prefix at
    a time, in float64 (the two computations then differ by rounding alone)."""
    model = translator.model.double()
    try:
        (ids,) = translator.encode(SENTENCES[:1])
        src = torch.tensor([ids])
        src_mask = tat.padding_mask(src, tat.PAD)
        ends = dict(end_symbol=tat.EOS, pad_symbol=tat.PAD, n_best=4)
        generator = torch.Generator().manual_seed(0)
        found = translation.sample_decode(
            model, src, src_mask, 30, tat.BOS, generator=generator, **ends
        )[0]
        assert [s for _, s in found] == sorted((s for _, s in found), reverse=True)
        with torch.no_grad():
            memory = model.encode(src, src_mask)
            for drawn, score in found:
                end = drawn.index(tat.EOS) + 1 if tat.EOS in drawn else len(drawn)
                total = 0.0
                for t in range(1, end):
                    prefix = torch.tensor([drawn[:t]])
                    step = tat.decode_step(model, memory, src_mask, prefix)
                    total += float(step[0, drawn[t]])
                assert score == pytest.approx(total, abs=1e-9)
    finally:
        translator.model.float()


def test_sampling_options_without_sampling_or_with_a_beam_are_refused():
    with pytest.raises(UsageError, match="top_k, seed: sampling's options take"):
        translation.decode_options(top_k=5, seed=1)
    with pytest.raises(UsageError, match="sample draws and beam_size 3 searches"):
        translation.decode_options(3, sample=True)
    with pytest.raises(UsageError, match="--top-k: .* only with --sample"):
        translation.decode_options(top_k=5, flags=True)
    bad = dict(temperature=0), dict(temperature=math.inf), dict(top_p=1.5)
    for options in (*bad, dict(top_k=2.0), dict(seed=True)):
        (name,) = options
        with pytest.raises(UsageError, match=f"{name} must be"):
            translation.decode_options(sample=True, **options)
    translation.decode_options(sample=True, temperature=2, top_k=1, top_p=1, seed=0)


# ---------------------------------------------------------------------------
# Progress


class Clock:
    """A clock that tells the time it is set to."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_progress_says_what_is_done_and_estimates_the_rest_at_its_pace():
    clock, stream = Clock(), io.StringIO()
    progress = translation.Progress(stream, every=5, clock=clock)
    clock.now = 4.0  # sooner than `every`: nothing said
    progress.say("1 of 4 sentences done", 1 / 4)
    clock.now = 10.0
    progress.say("2 of 4 sentences done", 2 / 4)  # in 10 s: 10 s more at that pace
    clock.now = 12.0
    progress.say("sentences 3 to 4 of 4: word 7")  # 2 s after the last line: nothing
    clock.now = 15.0
    progress.say("sentences 3 to 4 of 4: word 8", 3 / 4)  # in 15 s: 5 s more
    clock.now = 21.0
    progress.say("sentences 3 to 4 of 4: word 9")  # no share: no estimate
    clock.now = 26.0
    progress.say("4 of 4 sentences done", 1.0, now=True)  # the end, said at once
    assert stream.getvalue().splitlines() == [
        "translating: 2 of 4 sentences done, 0:00:10 so far, about 0:00:10 left",
        "translating: sentences 3 to 4 of 4: word 8, 0:00:15 so far, about 0:00:05 "
        "left",
        "translating: sentences 3 to 4 of 4: word 9, 0:00:21 so far",
        "translating: 4 of 4 sentences done, 0:00:26 so far",
    ]
    assert progress.said


def test_short_work_says_nothing():
    clock, stream = Clock(), io.StringIO()
    progress = translation.Progress(stream, every=5, clock=clock)
    clock.now = 4.9
    progress.say("sentences 1 to 2 of 2: word 3")
    progress.say("1 of 2 sentences done", 1 / 2)
    assert stream.getvalue() == "" and not progress.said


def test_the_progress_cache_is_the_books_cache_telling_each_step():
    """It computes what the book's KVCache computes (it is one), and calls on_step
    with the positions it holds after each step."""
    model = test_devices.cpu_model().eval()
    src = torch.randint(2, test_devices.VOCAB, (3, 7))
    mask = tat.padding_mask(src, test_devices.PAD)
    told = []
    cache = translation.ProgressCache(model, 6, told.append)
    found = tat.greedy_decode(model, src, mask, 6, test_devices.START, cache=cache)
    book = tat.cached_greedy_decode(model, src, mask, 6, test_devices.START)
    assert torch.equal(found, book) and told == [1, 2, 3, 4, 5]


def test_inside_a_batch_the_estimate_counts_the_share_of_its_words_done(echoing):
    """Halfway through the words of the first batch (2 of 4 sentences), after
    10 s, the work done is 2 * 1/2 of 4 sentences: a quarter, so 30 s are left."""
    clock, stream = Clock(), io.StringIO()
    progress = translation.Progress(stream, every=0, clock=clock)

    def halfway(model, src, src_mask, max_len, start_symbol, cache, **options):
        clock.now += 10.0
        cache.on_step((max_len - 1) // 2)  # of at most max_len - 1 words
        return src

    sentences = ["a dog runs", "a cat runs"] * 2  # 5 ids: 54 words at most, even
    echoing.translate(sentences, batch_size=2, progress=progress, decode=halfway)
    first = stream.getvalue().splitlines()[0]
    said = re.fullmatch(
        r"translating: sentences 1 to 2 of 4: word (\d+) of at most "
        r"(\d+), 0:00:10 so far, about 0:00:30 left",
        first,
    )
    assert said and 2 * int(said[1]) == int(said[2]), first


def test_translate_tells_progress_each_batch_and_each_word(translator):
    stream = io.StringIO()
    progress = translation.Progress(stream, every=0)
    sentences = [SENTENCES[0], SENTENCES[2], "", "Eine Frau liest."]
    answers = translator.translate(sentences, batch_size=2, progress=progress)
    lines = stream.getvalue().splitlines()
    assert answers == translator.translate(sentences, batch_size=2)
    assert any(line.startswith("translating: 2 of 3 sentences done") for line in lines)
    assert any("sentences 1 to 2 of 3: word 1 of at most" in line for line in lines)
    assert any("sentences 3 to 3 of 3: word 1 of at most" in line for line in lines)
    assert lines[-1].startswith("translating: 3 of 3 sentences done, ")


# ---------------------------------------------------------------------------
# Sampling on a GPU: checked on the CPU as tests/test_devices.py checks the rest


def test_sampling_runs_on_the_device_of_the_model_and_its_sources():
    """On `meta`, which refuses a tensor of another device as CUDA does (no end
    symbol: meta tensors have no values to ask whether a sentence ended)."""
    meta_model = test_devices.cpu_model().to(test_devices.META)
    src = test_devices.meta_ids(3, 7)
    mask = tat.padding_mask(src, test_devices.PAD)
    out = translation.sample_decode(
        meta_model, src, mask, 6, test_devices.START, top_k=3, top_p=0.9
    )
    assert out.device == test_devices.META and out.shape == (3, 6)


def test_sampling_makes_no_tensor_on_the_host_and_waits_once_a_step():
    """The same audits as greedy decoding's: no tensor made without a device, one
    read a step (whether every sentence has ended) and one before the first
    (encode checks the source mask), and for n-best one more at the end."""
    model = test_devices.cpu_model().eval()
    src = torch.randint(2, test_devices.VOCAB, (3, 7))
    mask = tat.padding_mask(src, test_devices.PAD)
    never = test_devices.VOCAB + 1  # an end symbol no token is: every step runs
    options = dict(top_k=4, top_p=0.9, generator=torch.Generator().manual_seed(0))
    with test_devices.FactoryAudit() as audit, test_devices.HostReads() as reads:
        out = translation.sample_decode(
            model, src, mask, 6, test_devices.START, end_symbol=never, **options
        )
    assert audit.calls == set() and reads.copies == 0
    assert out.size(1) == 6 and reads.reads == 1 + 5  # 5 steps
    with test_devices.HostReads() as reads:
        translation.sample_decode(
            model,
            src,
            mask,
            6,
            test_devices.START,
            end_symbol=never,
            n_best=2,
            **options,
        )
    assert reads.reads == 1 + 5 + 2  # and the ids and scores, read once
