"""workshop/kv_cache.py: DecodingCache, the key/value cache written in place, against
the book's decoding (greedy_decode without a cache, and with its KVCache): the same
log-probabilities up to float rounding, the same tokens, on random and trained
models, pre- and post-norm, the book's and the fused attention, batches of one and
of several ragged sentences; reorder for beam search; and a control that a
perturbed weight is caught. The searches that use it (workshop.translation) are
tested in tests/test_workshop_translation.py and tests/test_part5_decoding.py."""

import copy

import pytest
import test_devices
import torch
from conftest import trained_copy_task
from test_part5_decoding import step_log_probs  # the same prefixes, stacked

import the_annotated_transformer as tat
from workshop import fast, translation
from workshop.kv_cache import DecodingCache

# Results depend on the CPU kernels torch picks: `make check` runs these again on
# the plain code path.
pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_cpu_thread")]

VOCAB, PAD = 13, 2


def random_model(norm_first=True, fused=False, seed=3):
    torch.manual_seed(seed)
    model = tat.make_model(
        VOCAB, VOCAB, N=2, d_model=32, d_ff=64, h=4, norm_first=norm_first
    )
    return (fast.use_fused_attention(model) if fused else model).eval()


def ragged_sources(lengths=(7, 4, 6, 1, 7), seed=5):
    """Random sources of the given lengths, padded with PAD into one batch."""
    rng = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), PAD)
    for row, n in enumerate(lengths):
        src[row, :n] = torch.randint(3, VOCAB, (n,), generator=rng)
    return src, (src != PAD).unsqueeze(-2)


def tolerance(model, log_probs, dtype=torch.float32):
    """How far DecodingCache's log-probabilities may lie from the book's.

    Both compute the same function in a different order: the cache runs one new
    position against the held ones where the book runs the whole prefix (so the
    products sum in another order), adds each output projection's bias after the
    residual instead of before, and scales the scores by a rounded 1 / sqrt(d_k)
    instead of dividing. tests/test_part5_decoding.py's float32_tolerance counts 16
    sequential roundings per decoder layer and 3 in the generator for the book's
    cache; the bias and the scale add 4 a layer. To first order each rounding moves
    the result by at most eps of the dtype times the largest magnitude reaching the
    output, the largest |log-probability|; the bound holds for any summation order.
    """
    steps = 20 * len(model.decoder.layers) + 3
    return steps * torch.finfo(dtype).eps * log_probs.abs().max().item()


MODELS = {
    "pre-norm": dict(),
    "post-norm": dict(norm_first=False),
    "fused attention": dict(fused=True),
}


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("lengths", [(6,), (7, 4, 6, 1, 7)], ids=["one", "ragged"])
def test_each_step_gives_the_books_log_probabilities_to_float32_rounding(kind, lengths):
    model = random_model(**MODELS[kind])
    src, src_mask = ragged_sources(lengths)
    ys = tat.greedy_decode(model, src, src_mask, 10, 0)
    cache = DecodingCache(model, 10)
    cached = step_log_probs(model, src, src_mask, ys, cache)
    plain = step_log_probs(model, src, src_mask, ys)
    book = step_log_probs(model, src, src_mask, ys, tat.KVCache(model))
    assert cache.length == ys.size(1) - 1
    limit = tolerance(model, plain)
    torch.testing.assert_close(cached, plain, atol=limit, rtol=0)
    torch.testing.assert_close(cached, book, atol=limit, rtol=0)


def test_in_bfloat16_too_to_bfloat16_rounding():
    """The buffers and the padding's bias take the model's dtype; the bound is the
    float32 one with bfloat16's eps (2**-8)."""
    model = random_model().to(torch.bfloat16)
    src, src_mask = ragged_sources()
    ys = tat.greedy_decode(model, src, src_mask, 8, 0)
    cached = step_log_probs(model, src, src_mask, ys, DecodingCache(model))
    plain = step_log_probs(model, src, src_mask, ys)
    assert cached.dtype == torch.bfloat16
    limit = tolerance(model, plain.float(), torch.bfloat16)
    torch.testing.assert_close(cached.float(), plain.float(), atol=limit, rtol=0)


def compare_tokens(model, src, src_mask, max_len, start, end=None):
    """Assert that greedy decoding with DecodingCache, the workshop's greedy_decode,
    the book's uncached greedy_decode and its cached_greedy_decode choose the same
    tokens, each row up to its first near tie; returns how many steps were
    compared (so that a test can ask that ties were rare)."""
    kwargs = dict(end_symbol=end, pad_symbol=PAD if end is not None else None)
    plain = tat.greedy_decode(model, src, src_mask, max_len, start, **kwargs)
    found = [
        tat.greedy_decode(
            model, src, src_mask, max_len, start, cache=DecodingCache(model), **kwargs
        ),
        translation.greedy_decode(model, src, src_mask, max_len, start, **kwargs),
        tat.cached_greedy_decode(model, src, src_mask, max_len, start, **kwargs),
    ]
    # Where the book's top two tokens lie within twice the tolerance, rounding may
    # choose either: each row is compared up to its first such step.
    steps = step_log_probs(model, src, src_mask, plain)  # (step, batch, vocab)
    top2 = steps.topk(2, dim=-1).values
    tied = (top2[..., 0] - top2[..., 1]) <= 2 * tolerance(model, steps)
    compared = 0
    for row in range(plain.size(0)):
        ties = tied[:, row].nonzero()
        length = 1 + (int(ties[0]) if len(ties) else tied.size(0))
        for ids in found:
            assert ids.size(0) == plain.size(0)
            assert torch.equal(ids[row, :length], plain[row, :length]), row
        compared += length - 1
    return compared, tied.numel()


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("lengths", [(6,), (7, 4, 6, 1, 7)], ids=["one", "ragged"])
def test_greedy_decoding_with_it_chooses_the_books_tokens(kind, lengths):
    model = random_model(**MODELS[kind])
    src, src_mask = ragged_sources(lengths)
    compared, steps = compare_tokens(model, src, src_mask, 12, 0, end=1)
    assert compared >= steps // 2  # near ties are rare


@pytest.mark.slow
def test_the_trained_copy_model_copies_the_same_with_it():
    model = trained_copy_task(1)[0]
    rng = torch.Generator().manual_seed(11)
    batch = next(tat.data_gen(11, 6, 1, generator=rng))
    src = batch.src.clone()
    src[2, 6:] = tat.COPY_PAD  # ragged: two shorter sources
    src[4, 3:] = tat.COPY_PAD
    src_mask = (src != tat.COPY_PAD).unsqueeze(-2)
    compared, steps = compare_tokens(model, src, src_mask, 10, tat.COPY_START)
    assert compared == steps  # a trained model has no near ties here


def test_a_trained_translator_gives_the_same_translations_with_it(translator):
    """The smoke run's model (fused attention, as translate loads it) on Multi30k
    sentences of different lengths, one and several at a time."""
    sentences = [
        "Ein Hund läuft über die Wiese.",
        "Zwei Männer spielen Fußball im Park.",
        "Eine Frau liest.",
    ]
    ids = translator.encode(sentences)
    for rows in ([ids[0]], ids):
        batch = tat.collate_batch([(s, [tat.BOS, tat.EOS]) for s in rows])
        compared, steps = compare_tokens(
            translator.model, batch.src, batch.src_mask, 20, tat.BOS, tat.EOS
        )
        assert compared >= steps // 2


# ---------------------------------------------------------------------------
# The control: every weight the decoder reads is read


def read_parameters(model):
    """The names of the parameters a decoding step reads and that can change its
    output: the target embedding, every decoder weight (the source keys' and
    values' too) and the generator, except the keys' biases, which add the same
    number to every score of a query (softmax takes no notice)."""
    return [
        f"{prefix}.{name}"
        for prefix in ("tgt_embed", "decoder", "generator")
        for name, _ in getattr(model, prefix).named_parameters()
        if not name.endswith("attn.linears.1.bias")
    ]


def test_a_perturbed_weight_is_caught_by_the_comparison():
    """The comparison above, with the cache run on a copy of the model with one
    entry of one parameter changed by 0.5: for every parameter it reads, the
    log-probabilities leave the tolerance (a cache that read a wrong or stale
    weight would fail)."""
    model = random_model()
    src, src_mask = ragged_sources()
    ys = tat.greedy_decode(model, src, src_mask, 8, 0)
    plain = step_log_probs(model, src, src_mask, ys)
    limit = tolerance(model, plain)
    caught = []
    for name in read_parameters(model):
        changed = copy.deepcopy(model)
        with torch.no_grad():
            changed.get_parameter(name).view(-1)[0] += 0.5
            memory = changed.encode(src, src_mask)
            cache = DecodingCache(changed)
            cached = torch.stack(
                [
                    tat.decode_step(changed, memory, src_mask, ys[:, :t], cache)
                    for t in range(1, ys.size(1))
                ]
            )
        if (cached - plain).abs().max() > limit:
            caught.append(name)
    # 2 layers of 24 (two attentions of 7, feed-forward 4, three norms of 2), the
    # final norm's 2, the embedding and the generator's 2
    assert caught == read_parameters(model) and len(caught) == 2 * 24 + 2 + 1 + 2


# ---------------------------------------------------------------------------
# reorder, growth, and what it refuses


def test_a_reordered_cache_continues_the_rows_it_keeps():
    """Beam search keeps, drops and repeats rows; the next step matches decoding the
    chosen prefixes from scratch."""
    model = random_model()
    src, src_mask = ragged_sources()
    ys = tat.greedy_decode(model, src, src_mask, 6, 0)
    rows = torch.tensor([4, 1, 1, 0])  # a reordering, a repeat, dropped rows
    cache = DecodingCache(model)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        for t in range(1, ys.size(1)):
            tat.decode_step(model, memory, src_mask, ys[:, :t], cache)
        cache.reorder(rows)
        memory, src_mask, ys = memory[rows], src_mask[rows], ys[rows]
        longer = torch.cat([ys, ys[:, -1:]], dim=1)
        cached = tat.decode_step(model, memory, src_mask, longer, cache)
        plain = tat.decode_step(model, memory, src_mask, longer)
    assert cache.length == longer.size(1)
    torch.testing.assert_close(cached, plain, atol=tolerance(model, plain), rtol=0)


def test_groups_of_rows_share_a_memory_row_and_sources_drop_sentences():
    """Three hypotheses per sentence over one memory row each (beam search's
    layout), then reorder within sentences and drop a sentence: each step matches
    the book's decoding with the memory repeated for every row."""
    model = random_model()
    src, src_mask = ragged_sources((7, 4, 6))
    k, torch_rng = 3, torch.Generator().manual_seed(0)
    ys = torch.randint(3, VOCAB, (3 * k, 5), generator=torch_rng)
    cache = DecodingCache(model)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        for t in range(1, 4):
            cached = tat.decode_step(model, memory, src_mask, ys[:, :t], cache)
        rows_memory = memory.repeat_interleave(k, 0)
        rows_mask = src_mask.repeat_interleave(k, 0)
        plain = tat.decode_step(model, rows_memory, rows_mask, ys[:, :3])
        torch.testing.assert_close(cached, plain, atol=tolerance(model, plain), rtol=0)
        # Sentence 1 is done; sentence 0's rows are shuffled, sentence 2's repeated.
        rows = torch.tensor([2, 0, 1, 6, 6, 8])
        sentences = torch.tensor([0, 2])
        cache.reorder(rows, sentences)
        ys = ys[rows]
        cached = tat.decode_step(
            model, memory[sentences], src_mask[sentences], ys[:, :4], cache
        )
        plain = tat.decode_step(model, rows_memory[rows], rows_mask[rows], ys[:, :4])
    torch.testing.assert_close(cached, plain, atol=tolerance(model, plain), rtol=0)


def test_a_cache_too_small_grows_and_gives_the_same_log_probabilities():
    model = random_model()
    src, src_mask = ragged_sources()
    ys = tat.greedy_decode(model, src, src_mask, 10, 0)
    small = DecodingCache(model, max_len=2)
    grown = step_log_probs(model, src, src_mask, ys, small)
    sized = step_log_probs(model, src, src_mask, ys, DecodingCache(model, 10))
    assert small.capacity >= ys.size(1) - 1 > 2
    # The held keys and values are copied bit for bit; only the summation order of
    # products over a differently laid-out buffer may differ.
    torch.testing.assert_close(grown, sized, atol=tolerance(model, sized), rtol=0)


def test_it_refuses_a_training_model_another_model_and_an_unknown_layer():
    model = random_model()
    src, src_mask = ragged_sources()
    ys = torch.zeros(src.size(0), 1, dtype=torch.long)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
    cache = DecodingCache(model)
    with pytest.raises(ValueError, match="eval mode"):
        cache.step(model.train(), memory, src_mask, ys)
    model.eval()
    with pytest.raises(ValueError, match="the model it was made for"):
        cache.step(random_model(), memory, src_mask, ys)
    cache.step(model, memory, src_mask, ys)  # the control: this one runs
    with pytest.raises(ValueError, match="at least one new position"):
        cache.step(model, memory, src_mask, ys)
    model.decoder.layers[1].feed_forward = torch.nn.Identity()
    with pytest.raises(ValueError, match="DecoderLayer, .*Identity"):
        DecodingCache(model)


# ---------------------------------------------------------------------------
# On a GPU: checked on the CPU as tests/test_devices.py checks the book's cache


def test_it_runs_on_the_device_of_the_model_and_waits_for_no_value():
    """On `meta` (which refuses a tensor of another device, as CUDA does) every
    buffer is made on the model's device; on the CPU, greedy decoding with it reads
    once a step (has every sentence ended?) and once before (encode's mask check),
    as the book's cached greedy decoding does: the cache itself reads nothing."""
    meta_model = test_devices.cpu_model().to(test_devices.META)
    src = test_devices.meta_ids(3, 7)
    mask = tat.padding_mask(src, test_devices.PAD)
    out = translation.greedy_decode(meta_model, src, mask, 6, test_devices.START)
    assert out.device == test_devices.META and out.shape == (3, 6)
    model = test_devices.cpu_model().eval()
    src = torch.randint(2, test_devices.VOCAB, (3, 7))
    mask = tat.padding_mask(src, test_devices.PAD)
    never = test_devices.VOCAB + 1  # an end symbol no token is: every step runs
    with test_devices.FactoryAudit() as audit, test_devices.HostReads() as reads:
        out = translation.greedy_decode(
            model, src, mask, 6, test_devices.START, end_symbol=never
        )
    assert audit.calls == set() and reads.copies == 0
    assert out.size(1) == 6 and reads.reads == 1 + 5  # 5 steps
