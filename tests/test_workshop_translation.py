"""workshop/translate/translation.py from Python: the Translator that `load_translator`
gives (one answer per sentence, blank ones too, in batches and windows; n-best lists
from the book's beam search; the hard limit; progress, told by the book's key/value
cache extended), and sampling (filter_log_probs, sample_decode, seeds). The models
are random and small: these tests need no data and train nothing.
"""

import io

import pytest
import torch
from conftest import tiny_checkpoint
from tolerance import rounding_tolerance

import the_annotated_transformer as tat
from workshop.errors import UsageError
from workshop.translate import translation

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

SENTENCES = ["a dog runs .", "", "a cat runs . a dog runs ."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A Translator of a random smoke-sized model whose two vocabularies are one
    (so that a decode function that answers with its sources answers in words)."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.pt"
    tiny_checkpoint(path, seed=0, words=["a", "dog", "runs", "cat", "."])
    return translation.load_translator(path, device="cpu")


def small_model(dtype=torch.float32):
    torch.manual_seed(0)
    return tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2).to(dtype).eval()


def test_translations_answers_each_window_in_input_order_once_it_is_decoded(tiny):
    """The input is decoded in windows of WINDOW_BATCHES batches: the first answer
    comes once the first window is decoded, though the sentence that starts the
    input is the longest of its window (decoded last in it). Blank sentences are
    answered with "" in their place, and decoded not."""
    batches, window = [], translation.WINDOW_BATCHES  # sentences, in batches of 1

    def echo(model, src, *args, **options):  # answers each source with itself
        batches.append(src.size(0))
        return src

    sentences = ["a cat runs", "dog", "", "a dog", *["runs", " "] * window]
    answers = tiny.translations(sentences, batch_size=1, decode=echo)
    assert batches == []  # an iterator: nothing is decoded before it is asked
    assert next(answers) == "a cat runs" and batches == [1] * window
    assert ["a cat runs", *answers] == [s.strip() for s in sentences]
    assert len(batches) == window + 3


def test_bad_arguments_are_refused_before_any_work(tiny, monkeypatch):
    assert list(tiny.translations(["", " "], n_best=2, beam_size=2)) == [[], []]
    monkeypatch.setattr(tiny, "encode", None)  # any work would fail
    limit = translation.MAX_SENTENCE_CHARACTERS
    with pytest.raises(UsageError, match=f"sentence 2 has {limit + 1:,} characters"):
        tiny.translations(["a dog", "x" * (limit + 1)])
    with pytest.raises(UsageError, match="sentence 1 is a int"):
        tiny.translations([42])
    with pytest.raises(UsageError, match=r"n_best 2 .* \(beam_size 2 or more; it has"):
        tiny.translations(["a dog"], n_best=2)
    translation.check_sentence(1, "x" * limit)  # at the limit: read


def test_n_best_lists_are_the_books_beam_search_for_each_sentence_alone(tiny):
    """Searched beside a longer sentence in a padded batch, the first sentence's
    (translation, score) pairs are the book's beam search's for it alone, best
    first; the 1-best is what translate answers with that beam."""
    k, alpha = 3, 0.6
    found = tiny.translate(SENTENCES, beam_size=k, alpha=alpha, n_best=k)
    src = torch.tensor(tiny.encode(SENTENCES[:1]))
    max_len = max(map(len, tiny.encode(SENTENCES))) + 50  # the batch's
    args = (tiny.model, src, tat.padding_mask(src, tat.PAD), max_len, tat.BOS)
    ends = dict(pad_symbol=tat.PAD, n_best=k, alpha=alpha)
    (book,) = tat.beam_search(*args, tat.EOS, k, **ends)
    expected = [tiny.text(translation._inner(ids)) for ids, _ in book]
    assert [text for text, _ in found[0]] == expected and found[1] == []
    assert found[0][0][0] == tiny.translate(SENTENCES, beam_size=k)[0]
    for (_, score), (_, book_score) in zip(found[0], book, strict=True):
        # A score sums at most max_len log-probabilities, each below 50 in size.
        assert score == pytest.approx(book_score, abs=rounding_tolerance(max_len, 50))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(alpha=1.0), r"^alpha: .* only in a beam search \(beam_size K"),
        (dict(alpha=0.6, sample=True), "beam search, and sample draws: leave alpha"),
        (dict(top_k=5, seed=1), "top_k, seed: sampling's options take effect only"),
        (dict(top_k=5, flags=True), "--top-k: .* only with --sample"),
        (dict(beam_size=3, sample=True), "sample draws and beam_size 3 searches"),
        (dict(sample=True, temperature=0), "temperature must be"),
        (dict(sample=True, top_p=1.5), "top_p must be"),
        (dict(sample=True, top_k=2.0), "top_k must be"),
        (dict(sample=True, seed=True), "seed must be"),
    ],
)
def test_decoding_options_that_do_not_go_together_are_refused(options, message):
    with pytest.raises(UsageError, match=message):
        translation.decode_options(**options)


def test_filter_log_probs_applies_the_temperature_then_top_k_then_top_p():
    log_probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]], dtype=torch.float64).log()

    def kept(**options):
        return translation.filter_log_probs(log_probs, **options).isfinite().tolist()

    assert kept(top_k=2) == kept(top_p=0.5) == [[False, True, False, True]]
    # Ranked 0.4, 0.3, 0.2, 0.1: above 0.3 lie 0.4 < 0.5 (kept), above 0.2 0.7.
    assert kept(top_p=0.4) == [[False, True, False, False]]  # 0.4 alone holds 0.4
    assert kept(top_p=1.0) == [[True] * 4]
    drawn = translation.filter_log_probs(log_probs, temperature=0.5).softmax(-1)
    squared = (2 * log_probs).softmax(-1)  # each probability to the power 1 / 0.5
    torch.testing.assert_close(drawn, squared.float())


@torch.no_grad()
def test_sampling_draws_the_first_word_from_the_filtered_distribution():
    """n rows of one sentence, one step: each word's share of the draws is its
    probability after the temperature and top-k, within 5 standard errors
    sqrt(p (1 - p) / n) (a false alarm about once in 1.7 million per word)."""
    model, n, options = small_model(), 4000, dict(temperature=0.7, top_k=5)
    src = torch.tensor([[0, 5, 6, 1]] * n)
    mask = tat.padding_mask(src, tat.PAD)
    out = translation.sample_decode(model, src, mask, 2, tat.BOS, **options)
    memory = model.encode(src[:1], mask[:1])
    log_probs = tat.decode_step(model, memory, mask[:1], src[:1, :1])
    expected = translation.filter_log_probs(log_probs, **options).softmax(-1)[0]
    shares = torch.bincount(out[:, 1], minlength=11).double() / n
    assert int((shares > 0).sum()) <= 5  # nothing beyond the top 5 is drawn
    error = (expected * (1 - expected) / n).sqrt().double()
    assert ((shares - expected.double()).abs() <= 5 * error + 1e-12).all()


def test_a_seed_repeats_a_sample_and_top_k_1_sampling_is_greedy(tiny):
    sentences = [SENTENCES[0], SENTENCES[2]] * 3
    first = tiny.translate(sentences, sample=True, seed=1)
    assert tiny.translate(sentences, sample=True, seed=1) == first
    assert tiny.translate(sentences, sample=True, seed=2) != first
    greedy = tiny.translate(sentences)
    assert tiny.translate(sentences, sample=True, top_k=1, seed=3) == greedy
    assert tiny.translate(sentences, sample=True, top_p=1e-6, seed=4) == greedy


@torch.no_grad()
def test_a_samples_score_is_its_log_probability_under_the_model():
    """n_best samples come with log P of their ids, most likely first: the sum of
    the model's log-probabilities of their words, recomputed here without the
    cache, one prefix at a time."""
    model, src = small_model(torch.float64), torch.tensor([[0, 5, 6, 1]])
    mask = tat.padding_mask(src, tat.PAD)
    ends = dict(end_symbol=tat.EOS, pad_symbol=tat.PAD, n_best=4)
    found = translation.sample_decode(model, src, mask, 12, tat.BOS, **ends)[0]
    assert [s for _, s in found] == sorted((s for _, s in found), reverse=True)
    memory = model.encode(src, mask)
    for ids, score in found:
        end = ids.index(tat.EOS) + 1 if tat.EOS in ids else len(ids)
        prefixes = [torch.tensor([ids[:t]]) for t in range(1, end)]
        steps = [tat.decode_step(model, memory, mask, ys)[0] for ys in prefixes]
        log_p = sum(float(s[w]) for s, w in zip(steps, ids[1:end], strict=True))
        # 12 words at most, each through about d_model + d_ff + vocab = 59 rounded
        # sums of terms below 50
        tolerance = rounding_tolerance(12 * 59, 50, torch.float64)
        assert score == pytest.approx(log_p, abs=tolerance)


def test_the_progress_cache_is_the_books_cache_telling_each_step(tiny):
    """It computes what the book's KVCache computes, and calls on_step with the
    positions it holds after each step; the Translator's greedy answers, decoded
    with it, are the book's Translator's."""
    model, src, told = small_model(), torch.randint(4, 11, (3, 7)), []
    args = (model, src, tat.padding_mask(src, tat.PAD), 6, tat.BOS)
    cache = translation.ProgressCache(model, 6, told.append)
    found = tat.greedy_decode(*args, cache=cache)
    assert torch.equal(found, tat.cached_greedy_decode(*args))
    assert told == [1, 2, 3, 4, 5]
    sentences = [SENTENCES[0], SENTENCES[2], "a cat ."]
    assert tiny.translate(sentences) == tat.Translator.translate(tiny, sentences)


def test_progress_says_at_most_every_few_seconds_how_far_translate_has_come(tiny):
    """Each batch of 2 sentences takes 10 s, and `say` is told halfway through its
    words: after 10 s, 2 * 1/2 of 4 sentences are done, a quarter, so 30 s are left;
    after 20 s, three quarters, so 7 s. The line after the first batch comes too
    soon to be said; the last is said at once. Work shorter than `every` says
    nothing."""
    now, stream = [0.0], io.StringIO()

    def clock():
        return now[0]

    def halfway(model, src, src_mask, max_len, start_symbol, cache, **options):
        now[0] += 10.0
        cache.on_step((max_len - 1) // 2)  # of at most max_len - 1 words
        return src

    sentences = ["a dog runs", "", "a cat runs", "dog runs .", "a dog ."]  # 5 ids
    tiny.translate(sentences, progress=translation.Progress(stream, clock=clock))
    assert stream.getvalue() == ""
    progress = translation.Progress(stream, every=5, clock=clock)
    tiny.translate(sentences, batch_size=2, progress=progress, decode=halfway)
    assert stream.getvalue().splitlines() == [
        "translating: sentences 1 to 2 of 4: word 27 of at most 54, 0:00:10 so far, "
        "about 0:00:30 left",
        "translating: sentences 3 to 4 of 4: word 27 of at most 54, 0:00:20 so far, "
        "about 0:00:07 left",
        "translating: 4 of 4 sentences done, 0:00:20 so far",
    ]
