"""Tests for Part 3 of the book: German to English on Multi30k.

They follow the order of the book: reading the data, tokenizers, vocabularies,
batching with a token budget, translating, the reader's run and its data folder. The
workshop package's side of Part 3 (downloads, training runs, checkpoints, the command
line) is tested in tests/test_workshop_multi30k.py, tests/test_workshop_training.py,
tests/test_workshop_checkpoints.py and tests/test_cli.py.

The Multi30k files are found through $ANNOTATED_TRANSFORMER_DATA (`make test` sets
it). Without it these tests are skipped on a laptop, but fail in CI (CI=true), so
that nothing is skipped there unnoticed.
"""

import functools
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import data_dir_or_skip, names_in, point_data_at
from torch import nn

import the_annotated_transformer as tat

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

FIRST_TRAIN_PAIR = (
    "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
    "Two young, White males are outside near many bushes.",
)


# ---------------------------------------------------------------------------
# Shared setup


@pytest.fixture(scope="module")
def train_counts(train_pairs, tokenizers):
    """Token counts of the German and English training sentences."""
    spacy_de, spacy_en = tokenizers
    de = Counter(t for src, _ in train_pairs for t in tat.tokenize(src, spacy_de))
    en = Counter(t for _, tgt in train_pairs for t in tat.tokenize(tgt, spacy_en))
    return de, en


def test_data_fixture_skips_locally_but_fails_in_ci_when_the_variable_is_unset():
    with pytest.raises(pytest.skip.Exception):
        data_dir_or_skip({})
    with pytest.raises(pytest.fail.Exception, match=tat.DATA_ENV):
        data_dir_or_skip({"CI": "true"})
    assert data_dir_or_skip({tat.DATA_ENV: "/data/m30k"}) == Path("/data/m30k")


# ---------------------------------------------------------------------------
# Reading a split


@pytest.mark.parametrize(
    "split, size", [("train", 29000), ("val", 1014), ("test_2016_flickr", 1000)]
)
def test_read_split_returns_every_pair_of_the_split(multi30k_dir, split, size):
    pairs = tat.read_split(multi30k_dir, split)
    assert len(pairs) == size
    assert all(de.strip() and en.strip() for de, en in pairs)


def test_read_split_pairs_each_german_line_with_its_english_line(train_pairs):
    assert train_pairs[0] == FIRST_TRAIN_PAIR


def test_data_dir_from_env_reads_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(tat.DATA_ENV, str(tmp_path))
    assert tat.data_dir_from_env() == tmp_path
    monkeypatch.delenv(tat.DATA_ENV)
    assert tat.data_dir_from_env() is None


# ---------------------------------------------------------------------------
# Tokenizers


def test_tokenizers_are_blank_spacy_pipelines_that_load_no_model(monkeypatch):
    import spacy

    def no_trained_model(*args, **kwargs):
        raise AssertionError("load_tokenizers must not load a trained spaCy model")

    monkeypatch.setattr(spacy, "load", no_trained_model)
    spacy_de, spacy_en = tat.load_tokenizers()
    assert (spacy_de.lang, spacy_en.lang) == ("de", "en")
    assert spacy_de.pipe_names == [] and spacy_en.pipe_names == []


def test_tokenize_splits_german_words_and_punctuation(tokenizers):
    spacy_de, _ = tokenizers
    tokens = tat.tokenize("Zwei Männer stehen am Ufer.", spacy_de)
    assert tokens == ["Zwei", "Männer", "stehen", "am", "Ufer", "."]


def test_tokenize_splits_english_contractions_and_drops_whitespace(tokenizers):
    spacy_de, spacy_en = tokenizers
    tokens = tat.tokenize("A man's dog doesn't run.", spacy_en)
    assert tokens == ["A", "man", "'s", "dog", "does", "n't", "run", "."]
    spaced = tat.tokenize("Zwei  Hunde \n rennen.", spacy_de)
    assert spaced == ["Zwei", "Hunde", "rennen", "."]


# ---------------------------------------------------------------------------
# Vocabulary


def test_vocab_puts_the_four_specials_first_with_the_books_ids():
    vocab = tat.Vocab.build([["ein", "Hund"], ["ein", "Hund"]])
    assert vocab.get_itos()[:4] == ["<s>", "</s>", "<blank>", "<unk>"]
    assert (tat.BOS, tat.EOS, tat.PAD, tat.UNK) == (0, 1, 2, 3)
    assert [vocab[s] for s in tat.SPECIALS] == [0, 1, 2, 3]


def test_vocab_keeps_words_seen_min_freq_times_most_frequent_first():
    sentences = [["b", "a", "c"], ["a", "b", "d"], ["d", "d", "e"]]
    assert tat.Vocab.build(sentences, min_freq=2).get_itos()[4:] == ["d", "a", "b"]
    assert tat.Vocab.build(sentences, min_freq=3).get_itos()[4:] == ["d"]
    every_word = tat.Vocab.build(sentences, min_freq=1).get_itos()[4:]
    assert every_word == ["d", "a", "b", "c", "e"]


def test_vocab_maps_an_unseen_word_to_unk():
    vocab = tat.Vocab.build([["Hund", "Hund"]])
    assert vocab["Katze"] == tat.UNK == 3
    assert vocab(["Hund", "Katze"]) == [4, 3]
    assert "Katze" not in vocab and "Hund" in vocab


def test_vocab_offers_the_torchtext_calls_the_original_used():
    vocab = tat.Vocab(["<s>", "</s>", "<blank>", "<unk>", "Hund", "Katze"])
    assert len(vocab) == 6
    tokens = vocab.lookup_tokens(torch.tensor([0, 5, 4, 1]))
    assert tokens == ["<s>", "Katze", "Hund", "</s>"]
    stoi = vocab.get_stoi()
    assert stoi == {token: i for i, token in enumerate(vocab.get_itos())}
    assert (stoi["Hund"], stoi["Katze"]) == (4, 5)
    stoi["Maus"] = 6
    vocab.get_itos().append("Maus")
    assert "Maus" not in vocab and len(vocab) == 6  # the copies are the caller's


def test_vocab_rejects_a_list_without_the_specials_or_with_a_repeated_token():
    with pytest.raises(ValueError, match="specials"):
        tat.Vocab(["Hund", "<s>", "</s>", "<blank>", "<unk>"])
    with pytest.raises(ValueError, match="no repeats"):
        tat.Vocab([*tat.SPECIALS, "Hund", "Hund"])


@pytest.mark.slow
def test_vocabulary_holds_exactly_the_training_words_seen_at_least_twice(
    vocabs, train_counts
):
    for vocab, counts in zip(vocabs, train_counts, strict=True):
        kept = {token for token, n in counts.items() if n >= 2}
        assert set(vocab.get_itos()[4:]) == kept - set(tat.SPECIALS)
        assert len(vocab) == len(set(vocab.get_itos()))
        once = min(token for token, n in counts.items() if n == 1)
        assert vocab[once] == tat.UNK


def test_vocabulary_maps_a_word_seen_only_in_the_test_split_to_unk(
    multi30k_dir, tokenizers, vocabs, train_counts
):
    test_pairs = tat.read_split(multi30k_dir, "test_2016_flickr")
    for side, (spacy_nlp, vocab, counts) in enumerate(
        zip(tokenizers, vocabs, train_counts, strict=True)
    ):
        test_counts = Counter(
            token
            for pair in test_pairs
            for token in tat.tokenize(pair[side], spacy_nlp)
        )
        test_only = sorted(token for token in test_counts if token not in counts)
        assert test_only, "expected words that occur in the test split only"
        for token in test_only:
            assert token not in vocab
            assert vocab[token] == tat.UNK


# ---------------------------------------------------------------------------
# Batching


def test_encode_text_wraps_the_ids_in_start_and_end_symbols(tokenizers):
    vocab = tat.Vocab([*tat.SPECIALS, "Ein", "Hund", "."])
    assert tat.encode_text("Ein Hund bellt.", vocab, tokenizers[0], 72) == [
        tat.BOS,
        4,
        5,
        tat.UNK,
        6,
        tat.EOS,
    ]


@pytest.mark.parametrize("max_len", [3, 4, 10])
def test_encode_text_cuts_to_max_len_and_keeps_the_end_symbol(max_len, tokenizers):
    vocab = tat.Vocab([*tat.SPECIALS, *(f"w{i}" for i in range(100))])
    text = " ".join(f"w{i}" for i in range(100))
    ids = tat.encode_text(text, vocab, tokenizers[0], max_len)
    assert len(ids) == max_len
    assert ids[0] == tat.BOS and ids[-1] == tat.EOS
    assert ids[1:-1] == list(range(4, 4 + max_len - 2))


def test_collate_batch_pads_only_to_the_longest_sentence_of_the_batch():
    examples = [([0, 5, 6, 1], [0, 7, 1]), ([0, 5, 1], [0, 7, 8, 9, 10, 1])]
    batch = tat.collate_batch(examples)
    assert batch.src.tolist() == [[0, 5, 6, 1], [0, 5, 1, tat.PAD]]
    assert batch.tgt.tolist() == [[0, 7, 1, tat.PAD, tat.PAD], [0, 7, 8, 9, 10]]
    assert batch.tgt_y.tolist() == [[7, 1, tat.PAD, tat.PAD, tat.PAD], [7, 8, 9, 10, 1]]
    assert batch.ntokens == 2 + 5
    assert batch.src_mask.tolist() == [[[True] * 4], [[True] * 3 + [False]]]


def padded_size(batch, lengths):
    return len(batch) * max(lengths[i] for i in batch)


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [200, 2000])
def test_sampler_keeps_every_batch_within_the_token_budget(train_data, max_tokens):
    lengths = train_data.lengths("train")
    sampler = tat.TokenBudgetBatchSampler(lengths, max_tokens)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert all(padded_size(b, lengths) <= max_tokens for b in batches)


def test_sampler_puts_an_example_longer_than_the_budget_in_a_batch_alone():
    lengths = [5] * 20 + [50] + [5] * 5
    batches = tat.TokenBudgetBatchSampler(lengths, 40, seed=3).all_batches()
    assert [20] in batches
    assert all(padded_size(b, lengths) <= 40 for b in batches if b != [20])


def test_sampler_yields_every_training_pair_exactly_once_per_epoch(train_data):
    lengths = train_data.lengths("train")
    sampler = tat.TokenBudgetBatchSampler(lengths, 2000, seed=5)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        assert sorted(i for batch in sampler for i in batch) == list(range(29000))


def test_sampler_order_changes_between_epochs_but_repeats_for_the_same_epoch(
    train_data,
):
    lengths = train_data.lengths("train")
    first = tat.TokenBudgetBatchSampler(lengths, 2000, seed=7)
    again = tat.TokenBudgetBatchSampler(lengths, 2000, seed=7)
    first.set_epoch(1)
    again.set_epoch(1)
    epoch_1 = list(first)
    assert list(again) == epoch_1
    first.set_epoch(2)
    assert list(first) != epoch_1
    assert list(tat.TokenBudgetBatchSampler(lengths, 2000, seed=8)) != list(
        tat.TokenBudgetBatchSampler(lengths, 2000, seed=7)
    )


def test_sampler_without_shuffle_yields_the_same_batches_every_epoch(train_data):
    lengths = train_data.lengths("train")
    sampler = tat.TokenBudgetBatchSampler(lengths, 900, seed=1, shuffle=False)
    epoch_0 = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) == epoch_0


def share_of_pad(batches):
    """The share of the padded target sequences of `batches` (Batches, each holding
    them as tgt = all but the last and tgt_y = all but the first) that is <blank>."""
    targets = [torch.cat([b.tgt[:, :1], b.tgt_y], dim=1) for b in batches]
    return sum(int((t == tat.PAD).sum()) for t in targets) / sum(
        t.numel() for t in targets
    )


def test_padding_share_is_the_share_of_pad_in_the_collated_targets():
    examples = [([0, 4, 1], [0, 4, 5, 1]), ([0, 4, 1], [0, 1])]
    batch = tat.collate_batch(examples)  # targets: 4 + 2 ids in 2 x 4 positions
    lengths = [len(tgt) for _, tgt in examples]
    assert tat.padding_share(lengths, [[0, 1]]) == share_of_pad([batch]) == 2 / 8
    assert tat.padding_share(lengths, [[0], [1]]) == 0.0  # each batch alone
    assert tat.padding_share(lengths, [[0, 1]], width=8) == 1 - 6 / 16


def original_batches(pairs, batch_size=32, width=72):
    """The 2018 notebook's batching: 32 pairs, every sentence padded to 72 ids."""
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        src, tgt = (
            torch.tensor([ids + [tat.PAD] * (width - len(ids)) for ids in side])
            for side in zip(*chunk, strict=True)
        )
        yield tat.Batch(src, tgt, tat.PAD)


@pytest.mark.slow
def test_example_batches_prints_the_padding_the_training_batches_hold(
    train_data, multi30k_dir, capsys
):
    pairs = train_data.splits["train"]
    assert max(len(ids) for pair in pairs for ids in pair) <= 72
    chart = tat.example_batches(multi30k_dir)
    printed = capsys.readouterr().out.splitlines()
    shares = [float(line.split(": ")[1].split("%")[0]) / 100 for line in printed]
    sampler = tat.TokenBudgetBatchSampler(train_data.lengths("train"), 2000)
    ours = share_of_pad(train_data.batches("train", sampler))
    original = share_of_pad(original_batches(pairs))
    assert len(printed) == 3 and printed[0].startswith("token budget 2000:")
    assert shares[0] == pytest.approx(ours, abs=0.0005)  # printed to 0.1 %
    assert shares[2] == pytest.approx(original, abs=0.0005)
    assert shares[0] < shares[1] < shares[2]
    # Measured on Multi30k's training split: 3.6 %, 41.3 % and 79.0 %.
    assert ours < 0.1 < 0.7 < original
    assert len(chart.to_dict()["hconcat"]) == 2  # file order, token budget


def panels(chart):
    """Each panel of an hconcat chart: (title, its rows of data)."""
    spec = chart.to_dict()
    return [(p["title"], spec["datasets"][p["data"]["name"]]) for p in spec["hconcat"]]


def test_chart_batches_draws_each_sentence_as_tokens_then_its_batchs_padding():
    lengths = [5, 2, 9, 3, 3, 7, 2, 8]
    (one_title, one), (budget_title, budget) = panels(tat.chart_batches(lengths, 16))
    expected = tat.TokenBudgetBatchSampler(lengths, 16, shuffle=False).all_batches()
    for title, cells, batches in (
        (one_title, one, [list(range(8))]),
        (budget_title, budget, expected),
    ):
        assert [c["sentence"] for c in cells if c["position"] == 0] == sum(batches, [])
        for number, batch in enumerate(batches):
            width = max(lengths[i] for i in batch)
            for i in batch:
                row = [c["cell"] for c in cells if c["sentence"] == i]
                assert {c["batch"] for c in cells if c["sentence"] == i} == {number}
                assert row == ["token"] * lengths[i] + ["padding"] * (
                    width - lengths[i]
                )
            assert len(batch) * width <= 16 or len(batches) == 1
        share = tat.padding_share(lengths, batches)
        assert title.endswith(f": {share:.0%} padding")
    assert len(expected) > 1 and one_title.startswith("one batch")
    rows = [c["row"] for c in budget if c["position"] == 0]
    first = [sum(map(len, expected[:k])) + k for k in range(len(expected))]
    assert rows == [  # a blank row after each batch
        first[k] + j for k, batch in enumerate(expected) for j in range(len(batch))
    ]


def test_prepare_data_encodes_each_sentence_as_its_tokens_between_bos_and_eos(
    multi30k_dir,
):
    data = tat.prepare_data(multi30k_dir, max_train_pairs=200)
    assert len(data.raw["train"]) == len(data.splits["train"]) == 200
    assert len(data.splits["val"]) == 1014
    raw, encoded = data.raw["val"][:20], data.splits["val"][:20]
    for (de, en), (src, tgt) in zip(raw, encoded, strict=True):
        de_ids = data.vocab_src(tat.tokenize(de, data.spacy_de))
        en_ids = data.vocab_tgt(tat.tokenize(en, data.spacy_en))
        assert src == [tat.BOS, *de_ids, tat.EOS]
        assert tgt == [tat.BOS, *en_ids, tat.EOS]
    assert data.lengths("val")[0] == max(len(s) for s in data.splits["val"][0])


@pytest.mark.slow
def test_prepare_data_builds_vocabularies_from_the_sliced_train_split_for_any_splits(
    multi30k_dir,
):
    with_train = tat.prepare_data(multi30k_dir, max_train_pairs=200)
    val_only = tat.prepare_data(multi30k_dir, splits=("val",), max_train_pairs=200)
    assert val_only.vocab_src.get_itos() == with_train.vocab_src.get_itos()
    assert val_only.vocab_tgt.get_itos() == with_train.vocab_tgt.get_itos()


# ---------------------------------------------------------------------------
# Translating


def test_detokenize_joins_tokens_with_english_spacing():
    tokens = ["A", "man", "'s", "dog", ",", "running", "."]
    assert tat.detokenize(tokens) == "A man's dog, running."
    assert tat.detokenize(["It", "does", "n't", "(", "really", ")", "run"]) == (
        "It doesn't (really) run"
    )
    assert tat.detokenize([]) == ""


def test_translate_returns_one_english_string_per_german_sentence(translator):
    sentences = ["Ein Hund läuft.", "Zwei Männer stehen am Ufer.", "Eine Frau."]
    outputs = translator.translate(sentences, batch_size=2)
    assert len(outputs) == 3 and all(isinstance(s, str) for s in outputs)
    assert not any("</s>" in s or "<s>" in s for s in outputs)
    assert translator.translate("Ein Hund läuft.") == outputs[:1]  # one sentence


def test_a_sentence_longer_than_training_max_len_is_translated_whole(translator):
    words = " ".join(["Hund"] * 100)  # 100 words: more than max_len = 72 ids
    assert translator.config.max_len < 102
    assert translator.encode([words])[0] == [
        tat.BOS,
        *[translator.vocab_src["Hund"]] * 100,
        tat.EOS,
    ]


def test_a_sentence_longer_than_the_models_positions_gets_one_clear_error(translator):
    limit = translator.model.tgt_embed[1].max_len
    too_long = [[tat.BOS, *[5] * limit, tat.EOS]]  # limit + 2 ids
    with pytest.raises(ValueError, match=f"{limit + 2} tokens.*{limit} positions"):
        tat.decode_ids(translator.model, too_long)


def test_decode_ids_stops_each_sentence_at_its_end_symbol(translator):
    src_ids = translator.encode(["Ein Hund läuft.", "Zwei Männer."])
    longest = max(len(ids) for ids in src_ids)
    for out in tat.decode_ids(translator.model, src_ids, max_extra=5):
        assert tat.EOS not in out
        assert len(out) <= longest + 5


def test_decode_ids_passes_its_options_to_the_search_it_is_given(translator):
    calls = []

    def recording_beam_search(*args, **options):
        calls.append(options)
        return tat.beam_search(*args, **options)

    src_ids = translator.encode(["Ein Hund läuft.", "Zwei Männer."])
    found = tat.decode_ids(
        translator.model, src_ids, decode=recording_beam_search, beam_size=2, alpha=1
    )
    assert [(c["beam_size"], c["alpha"], c["end_symbol"]) for c in calls] == [
        (2, 1, tat.EOS)
    ]
    assert len(found) == 2 and all(tat.EOS not in ids for ids in found)


def test_check_outputs_pairs_sources_references_and_translations(
    translator, multi30k_dir, capsys
):
    pairs = tat.read_split(multi30k_dir, "val")
    rows = tat.check_outputs(translator, pairs, n_examples=2)
    assert [(de, en) for de, en, _ in rows] == pairs[:2]
    printed = capsys.readouterr().out
    assert "Example 1" in printed and pairs[1][1] in printed


def test_example_multi30k_prints_validation_sentences_beside_the_models(
    translator, multi30k_dir, capsys
):
    rows = tat.example_multi30k(translator, multi30k_dir)
    assert [(de, en) for de, en, _ in rows] == tat.read_split(multi30k_dir, "val")[:5]
    assert capsys.readouterr().out.count("  model:     ") == 5


@pytest.mark.slow
def test_example_train_translator_trains_the_profile_in_memory_with_the_books_model(
    multi30k_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(tat, "PROFILE", "smoke")
    monkeypatch.chdir(tmp_path)
    translator = tat.example_train_translator(multi30k_dir)
    printed = capsys.readouterr().out
    assert printed.count("validation perplexity") == 1  # the smoke profile's one epoch
    assert isinstance(translator, tat.Translator)
    assert translator.config == tat.TrainConfig(**tat.PROFILES["smoke"])
    smoke_pairs = tat.read_split(multi30k_dir, "train")[:1000]  # the profile's
    vocab_src, _ = tat.build_vocabulary(smoke_pairs, *tat.load_tokenizers())
    assert translator.vocab_src.get_itos() == vocab_src.get_itos()
    dropouts = [m for m in translator.model.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and all(type(m) is nn.Dropout for m in dropouts)
    assert len(translator.translate(["Ein Hund läuft."])) == 1
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no run folder


@pytest.mark.parametrize("folder", [None, "empty"])
def test_the_run_without_data_says_what_to_set_in_one_line_and_trains_nothing(
    folder, tmp_path, monkeypatch, capsys
):
    """The notebook's Part 3 cells, in order, without Multi30k: they skip."""
    point_data_at(folder, tmp_path, monkeypatch)

    def no_training(*args, **kwargs):
        raise AssertionError("trained without data")

    monkeypatch.setattr(tat, "train_translator", no_training)
    data_dir = tat.notebook_data_dir()
    translator = tat.example_train_translator(data_dir)
    assert data_dir is translator is None
    assert tat.example_batches(data_dir) is None
    assert tat.example_multi30k(translator, data_dir) is None
    said = capsys.readouterr().out
    assert tat.DATA_ENV in said and said.count("\n") == 1  # one line


# ---------------------------------------------------------------------------
# The notebook's data folder: fetched on first use (from a local server here)


def fetching_from(server, folder, monkeypatch):
    """No $ANNOTATED_TRANSFORMER_DATA, the default folder at `folder`, and the book's
    download pointed at the local `server`."""
    monkeypatch.delenv(tat.DATA_ENV, raising=False)
    monkeypatch.setattr(tat, "default_data_dir", lambda: folder)
    local = functools.partial(tat.fetch_multi30k, base_url=server.url)
    monkeypatch.setattr(tat, "fetch_multi30k", local)


def test_the_notebook_fetches_multi30k_into_the_default_folder_once(
    multi30k_server, multi30k_dir, tmp_path, monkeypatch
):
    folder = tmp_path / "data" / "multi30k"
    fetching_from(multi30k_server, folder, monkeypatch)
    assert tat.notebook_data_dir() == folder
    assert names_in(folder) == sorted(tat.MULTI30K_SHA256)  # nothing half-written
    for name in tat.MULTI30K_SHA256:
        assert (folder / name).read_bytes() == (multi30k_dir / name).read_bytes()
    assert sorted(multi30k_server.requested) == sorted(tat.MULTI30K_SHA256)
    assert tat.notebook_data_dir() == folder  # the second time: nothing is asked
    assert len(multi30k_server.requested) == 6


def test_the_notebook_keeps_no_file_whose_digest_differs_and_says_so_in_one_line(
    multi30k_server, tmp_path, monkeypatch, capsys
):
    served = multi30k_server.folder / "val.de.gz"
    served.write_bytes(served.read_bytes()[:-100])  # not the published file
    folder = tmp_path / "data" / "multi30k"
    fetching_from(multi30k_server, folder, monkeypatch)
    assert tat.notebook_data_dir() is None
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and "val.de.gz" in said and "SHA-256" in said
    assert tat.DATA_ENV in said
    assert not [name for name in names_in(folder) if name.startswith("val.de")]


# ---------------------------------------------------------------------------
# The size the book states for the data


def test_the_size_the_docs_state_is_the_size_of_the_six_verified_files(multi30k_dir):
    """The six files are fixed by their SHA-256 digests, so their size is too; every
    page that tells a reader what `make data` fetches states it, rounded."""
    total = sum((multi30k_dir / name).stat().st_size for name in tat.MULTI30K_SHA256)
    assert total == 1_296_271
    stated = f"{total / 1e6:.1f} MB"
    root = Path(__file__).resolve().parent.parent
    for page in ("the_annotated_transformer.py", "README.md", "docs/translating.md"):
        text = (root / page).read_text(encoding="utf-8")
        assert stated in text, page
        assert "1.7 MB" not in text, page
