"""Tests for Part 3 of the book: German to English on Multi30k.

They follow the order of the book: reading the data, tokenizers, vocabularies,
batching with a token budget, translating, the reader's run and its data folder
(and every data cell of the notebook without data). The workshop package's side of
Part 3 is tested in the tests/test_workshop_*.py files.

The Multi30k files are found through $ANNOTATED_TRANSFORMER_DATA (`make test` sets
it). Without it these tests are skipped on a laptop, but fail in CI (CI=true).
"""

import functools
from collections import Counter
from pathlib import Path

import pytest
import spacy
import torch
from conftest import data_dir_or_skip, names_in, point_data_at
from torch import nn

import the_annotated_transformer as tat

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
BOS, EOS, PAD, UNK = tat.BOS, tat.EOS, tat.PAD, tat.UNK


def test_data_fixture_skips_locally_but_fails_in_ci_when_the_variable_is_unset():
    with pytest.raises(pytest.skip.Exception):
        data_dir_or_skip({})
    with pytest.raises(pytest.fail.Exception, match=tat.DATA_ENV):
        data_dir_or_skip({"CI": "true"})
    assert data_dir_or_skip({tat.DATA_ENV: "/data/m30k"}) == Path("/data/m30k")


# ---------------------------------------------------------------------------
# Pairs, tokens and vocabularies

FIRST_PAIR = (
    "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
    "Two young, White males are outside near many bushes.",
)


@pytest.mark.parametrize(
    "split, size", [("train", 29000), ("val", 1014), ("test_2016_flickr", 1000)]
)
def test_read_split_pairs_german_and_english_lines(multi30k_dir, split, size):
    pairs = tat.read_split(multi30k_dir, split)
    assert len(pairs) == size and all(de.strip() and en.strip() for de, en in pairs)
    assert split != "train" or pairs[0] == FIRST_PAIR


def test_blank_spacy_tokenizers_split_words_and_punctuation(monkeypatch):
    monkeypatch.setattr(spacy, "load", None)  # loading a trained model would fail
    de, en = tat.load_tokenizers()
    assert de.pipe_names == en.pipe_names == []
    words = tat.tokenize("Zwei  Männer \n stehen am Ufer.", de)
    assert words == ["Zwei", "Männer", "stehen", "am", "Ufer", "."]
    words = tat.tokenize("A man's dog doesn't run.", en)
    assert words == ["A", "man", "'s", "dog", "does", "n't", "run", "."]


def test_vocab_puts_the_specials_first_maps_unseen_words_to_unk_as_torchtext_did():
    vocab = tat.Vocab.build([["ein", "Hund"], ["ein", "Hund"]])
    assert vocab.get_itos()[:4] == list(tat.SPECIALS)
    assert [vocab[s] for s in tat.SPECIALS] == [BOS, EOS, PAD, UNK]
    assert vocab(["Hund", "Katze"]) == [vocab["Hund"], UNK] and len(vocab) == 6
    assert "Katze" not in vocab and "Hund" in vocab
    stoi = vocab.get_stoi()
    assert stoi == {token: i for i, token in enumerate(vocab.get_itos())}
    stoi["Maus"] = 6
    vocab.get_itos().append("Maus")
    assert "Maus" not in vocab and len(vocab) == 6  # the copies are the caller's
    wrong = [(["a", *tat.SPECIALS], "specials"), ([*tat.SPECIALS, "a", "a"], "repeats")]
    for itos, error in wrong:
        with pytest.raises(ValueError, match=error):
            tat.Vocab(itos)


def test_vocab_keeps_words_seen_min_freq_times_most_frequent_first():
    sentences = [["b", "a", "c"], ["a", "b", "d"], ["d", "d", "e"]]
    kept = [tat.Vocab.build(sentences, min_freq=n).get_itos()[4:] for n in (1, 2, 3)]
    assert kept == [["d", "a", "b", "c", "e"], ["d", "a", "b"], ["d"]]


@pytest.mark.slow
def test_vocabulary_is_the_training_words_seen_twice(vocabs, train_pairs, tokenizers):
    for side, (vocab, nlp) in enumerate(zip(vocabs, tokenizers, strict=True)):
        counts = Counter(t for p in train_pairs for t in tat.tokenize(p[side], nlp))
        kept = {token for token, n in counts.items() if n >= 2}
        assert set(vocab.get_itos()[4:]) == kept - set(tat.SPECIALS)
        assert len(vocab) == len(set(vocab.get_itos()))


# ---------------------------------------------------------------------------
# Batches


@pytest.mark.parametrize("max_len, ids", [(72, [4, 5, UNK, 6]), (4, [4, 5]), (3, [4])])
def test_encode_text_wraps_ids_in_bos_eos_within_max_len(tokenizers, max_len, ids):
    vocab = tat.Vocab([*tat.SPECIALS, "Ein", "Hund", "."])
    encoded = tat.encode_text("Ein Hund bellt.", vocab, tokenizers[0], max_len)
    assert encoded == [BOS, *ids, EOS]


def test_collate_batch_pads_to_the_longest_sentence_as_padding_share_counts():
    examples = [([0, 5, 6, 1], [0, 7, 1]), ([0, 5, 1], [0, 7, 8, 1])]
    batch = tat.collate_batch(examples)
    assert batch.src.tolist() == [[0, 5, 6, 1], [0, 5, 1, PAD]]
    assert batch.tgt.tolist() == [[0, 7, 1], [0, 7, 8]]
    assert batch.tgt_y.tolist() == [[7, 1, PAD], [7, 8, 1]]
    assert batch.ntokens == 2 + 3
    assert batch.src_mask.tolist() == [[[True] * 4], [[True] * 3 + [False]]]
    targets = torch.cat([batch.tgt[:, :1], batch.tgt_y], dim=1)  # the collated ones
    lengths = [len(tgt) for _, tgt in examples]
    assert tat.padding_share(lengths, [[0, 1]]) == (targets == PAD).float().mean()
    assert tat.padding_share(lengths, [[0], [1]]) == 0.0  # each batch alone
    assert tat.padding_share(lengths, [[0, 1]], width=8) == 1 - 7 / 16


def padded_size(batch, lengths):
    return len(batch) * max(lengths[i] for i in batch)


def test_sampler_puts_an_example_longer_than_the_budget_in_a_batch_alone():
    lengths = [5] * 20 + [50] + [5] * 5
    batches = tat.TokenBudgetBatchSampler(lengths, 40, seed=3).all_batches()
    assert [20] in batches
    assert all(padded_size(b, lengths) <= 40 for b in batches if b != [20])


def test_sampler_batches_each_pair_once_within_budget_in_a_seeded_order(train_data):
    """Seed and epoch fix the order (without shuffling, every epoch's is alike)."""
    lengths, orders = train_data.lengths("train"), []
    for seed, epoch, shuffle in [(7, 1, 1), (7, 1, 1), (7, 2, 1), (9, 1, 1), (7, 2, 0)]:
        sampler = tat.TokenBudgetBatchSampler(lengths, 900, seed=seed, shuffle=shuffle)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
        assert sorted(i for b in orders[-1] for i in b) == list(range(29000))
        assert all(padded_size(b, lengths) <= 900 for b in orders[-1])  # the budget
        assert len(sampler) == len(orders[-1])
    sampler.set_epoch(0)
    assert orders[0] == orders[1] and orders[4] == list(sampler)
    assert len({str(order) for order in orders}) == 4


@pytest.mark.slow
def test_example_batches_prints_their_padding(train_data, multi30k_dir, capsys):
    tat.example_batches(multi30k_dir)
    printed = capsys.readouterr().out.splitlines()
    shares = [float(line.split(": ")[1].split("%")[0]) / 100 for line in printed]
    lengths = [len(tgt) for _, tgt in train_data.splits["train"]]
    budget = tat.TokenBudgetBatchSampler(train_data.lengths("train"), 2000)
    fixed = [range(i, min(i + 32, 29000)) for i in range(0, 29000, 32)]
    expected = [tat.padding_share(lengths, budget.all_batches())]
    expected += [tat.padding_share(lengths, fixed, width) for width in (None, 72)]
    assert shares == pytest.approx(expected, abs=0.0005)  # printed to 0.1 %
    assert shares[0] < 0.1 < 0.7 < shares[2]  # 3.6 %, 41.3 % and 79.0 %


def test_chart_batches_draws_each_sentence_as_tokens_then_its_batchs_padding():
    lengths = [5, 2, 9, 3, 3, 7, 2, 8]
    spec = tat.chart_batches(lengths, 16).to_dict()
    budget = tat.TokenBudgetBatchSampler(lengths, 16, shuffle=False).all_batches()
    for panel, batches in zip(spec["hconcat"], [[[*range(8)]], budget], strict=True):
        cells, row = spec["datasets"][panel["data"]["name"]], 0
        for number, batch in enumerate(batches):
            for i in batch:
                drawn = [c for c in cells if c["sentence"] == i]
                assert {(c["batch"], c["row"]) for c in drawn} == {(number, row)}
                pad = max(lengths[j] for j in batch) - lengths[i]
                kinds = ["token"] * lengths[i] + ["padding"] * pad
                assert [c["cell"] for c in drawn] == kinds
                row += 1
            row += 1  # a blank row after each batch
        share = tat.padding_share(lengths, batches)
        assert panel["title"].endswith(f": {share:.0%} padding") and len(budget) > 1


def test_prepare_data_encodes_tokens_between_bos_and_eos(multi30k_dir):
    data = tat.prepare_data(multi30k_dir, max_train_pairs=200)
    assert len(data.raw["train"]) == len(data.splits["train"]) == 200
    assert len(data.splits["val"]) == 1014
    raw, encoded = data.raw["val"][:20], data.splits["val"][:20]
    for (de, en), (src, tgt) in zip(raw, encoded, strict=True):
        assert src == [BOS, *data.vocab_src(tat.tokenize(de, data.spacy_de)), EOS]
        assert tgt == [BOS, *data.vocab_tgt(tat.tokenize(en, data.spacy_en)), EOS]
    assert data.lengths("val")[0] == max(len(s) for s in data.splits["val"][0])


@pytest.mark.slow
def test_prepare_data_vocabularies_come_from_the_sliced_train_split(multi30k_dir):
    both = tat.prepare_data(multi30k_dir, max_train_pairs=200)
    val = tat.prepare_data(multi30k_dir, splits=("val",), max_train_pairs=200)
    assert val.vocab_src.get_itos() == both.vocab_src.get_itos()
    assert val.vocab_tgt.get_itos() == both.vocab_tgt.get_itos()


# ---------------------------------------------------------------------------
# Translating


def test_detokenize_joins_tokens_with_english_spacing():
    tokens = ["A", "man", "'s", "dog", ",", "does", "n't", "(", "run", ")", "."]
    assert tat.detokenize(tokens) == "A man's dog, doesn't (run)."
    assert tat.detokenize([]) == ""


def test_translate_returns_one_english_string_per_german_sentence(translator):
    sentences = ["Ein Hund läuft.", "Zwei Männer stehen am Ufer.", "Eine Frau."]
    outputs = translator.translate(sentences, batch_size=2)
    assert len(outputs) == 3 and all(isinstance(s, str) for s in outputs)
    assert not any("</s>" in s or "<s>" in s for s in outputs)
    assert translator.translate("Ein Hund läuft.") == outputs[:1]  # one sentence


def test_long_sentences_are_kept_whole_up_to_the_models_positions(translator):
    hund = translator.vocab_src["Hund"]
    words = " ".join(["Hund"] * 100)  # 100 words: more than max_len = 72 ids
    assert translator.encode([words])[0] == [BOS, *[hund] * 100, EOS]
    limit = translator.model.tgt_embed[1].max_len
    too_long = [[BOS, *[5] * limit, EOS]]  # limit + 2 ids
    with pytest.raises(ValueError, match=f"{limit + 2} tokens.*{limit} positions"):
        tat.decode_ids(translator.model, too_long)


def test_decode_ids_stops_at_eos_and_passes_options_to_its_search(translator):
    src_ids = translator.encode(["Ein Hund läuft.", "Zwei Männer."])
    longest = max(len(ids) for ids in src_ids)
    for out in tat.decode_ids(translator.model, src_ids, max_extra=5):
        assert EOS not in out and len(out) <= longest + 5
    calls = []
    search = dict(decode=lambda *a, **o: calls.append(o) or tat.beam_search(*a, **o))
    found = tat.decode_ids(translator.model, src_ids, **search, beam_size=2, alpha=1)
    seen = [(c["beam_size"], c["alpha"], c["end_symbol"]) for c in calls]
    assert seen == [(2, 1, EOS)] and len(found) == 2
    assert all(EOS not in ids for ids in found)


def test_example_multi30k_shows_validation_pairs(translator, multi30k_dir, capsys):
    pairs = tat.read_split(multi30k_dir, "val")
    rows = tat.example_multi30k(translator, multi30k_dir)
    assert [(de, en) for de, en, _ in rows] == pairs[:5]
    printed = capsys.readouterr().out
    assert printed.count("  model:     ") == 5 and pairs[1][1] in printed


@pytest.mark.slow
def test_example_train_translator_trains_the_profile_in_memory_with_the_books_model(
    multi30k_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(tat, "PROFILE", "smoke")
    monkeypatch.chdir(tmp_path)
    translator = tat.example_train_translator(multi30k_dir)
    assert capsys.readouterr().out.count("validation perplexity") == 1  # one epoch
    assert translator.config == tat.TrainConfig(**tat.PROFILES["smoke"])
    pairs = tat.read_split(multi30k_dir, "train")[:1000]  # the profile's
    vocab_src, _ = tat.build_vocabulary(pairs, *tat.load_tokenizers())
    assert translator.vocab_src.get_itos() == vocab_src.get_itos()
    dropouts = [m for m in translator.model.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and all(type(m) is nn.Dropout for m in dropouts)
    assert len(translator.translate(["Ein Hund läuft."])) == 1
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no run folder


# ---------------------------------------------------------------------------
# The notebook's data folder: named, or fetched on first use (from a local server)


@pytest.mark.parametrize("folder", [None, "empty"])
def test_the_notebook_without_data_says_what_to_set_in_one_line_and_trains_nothing(
    folder, tmp_path, monkeypatch, capsys
):
    """The notebook's data cells (Parts 3 to 5), in order, with $ANNOTATED_..._DATA
    unset and nothing to fetch, or naming an empty folder."""
    point_data_at(folder, tmp_path, monkeypatch)
    monkeypatch.setattr(tat, "train_translator", None)  # calling it would fail
    data_dir = tat.notebook_data_dir()
    translator = tat.example_train_translator(data_dir)
    assert data_dir is translator is None
    assert tat.example_batches(data_dir) is tat.example_subwords(data_dir) is None
    for example in ("multi30k", "cache", "beam_search", "beam_tree", "results"):
        assert getattr(tat, f"example_{example}")(translator, data_dir) is None
    assert tat.example_attention_heads(None) is tat.example_attention_maps(None) is None
    said = capsys.readouterr().out
    assert tat.DATA_ENV in said and said.count("\n") == 1  # one line
    assert folder is None or str(tmp_path) in said  # the folder it named


def test_the_notebook_fetches_multi30k_once(multi30k_server, tmp_path, monkeypatch):
    """Without $ANNOTATED_TRANSFORMER_DATA, from a local server here. (What a damaged
    download leaves is tested in tests/test_workshop_multi30k.py.)"""
    folder = tmp_path / "data" / "multi30k"
    monkeypatch.delenv(tat.DATA_ENV, raising=False)
    monkeypatch.setattr(tat, "default_data_dir", lambda: folder)
    local = functools.partial(tat.fetch_multi30k, base_url=multi30k_server.url)
    monkeypatch.setattr(tat, "fetch_multi30k", local)
    assert tat.notebook_data_dir() == folder == tat.notebook_data_dir()
    fetched = sorted(multi30k_server.requested)  # once: the second call asks nothing
    assert names_in(folder) == fetched == sorted(tat.MULTI30K_SHA256)


def test_the_size_the_docs_state_is_the_size_of_the_six_verified_files(multi30k_dir):
    """The six files are fixed by their SHA-256 digests, so their size is too; every
    page that tells a reader what `make data` fetches states it, rounded."""
    total = sum((multi30k_dir / name).stat().st_size for name in tat.MULTI30K_SHA256)
    root = Path(__file__).resolve().parent.parent
    for page in ("the_annotated_transformer.py", "README.md", "docs/translating.md"):
        assert f"{total / 1e6:.1f} MB" in (root / page).read_text("utf-8"), page
