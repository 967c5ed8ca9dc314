"""Tests for Part 3 of the book: German to English on Multi30k.

They follow the order of the book: downloading and reading the data, tokenizers,
vocabularies, batching with a token budget, the training configuration, checkpoints
and resuming, data-parallel training, learning, translating, and the command line.

The Multi30k files are found through $ANNOTATED_TRANSFORMER_DATA (`make test` sets
it). Without it these tests are skipped on a laptop, but fail in CI (CI=true), so
that nothing is skipped there unnoticed. Nothing here touches the network: the
download is served from 127.0.0.1.
"""

import contextlib
import dataclasses
import functools
import gzip
import http.server
import json
import math
import os
import shutil
import socket
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import data_dir_or_skip, point_data_at
from torch import nn

import the_annotated_transformer as tat
from workshop import cli, multi30k, runs

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

FIRST_TRAIN_PAIR = (
    "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
    "Two young, White males are outside near many bushes.",
)
PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY")
PROXY_VARIABLES += ("all_proxy", "ALL_PROXY")


# ---------------------------------------------------------------------------
# Shared setup


@pytest.fixture(scope="module")
def tokenizers():
    return tat.load_tokenizers()


@pytest.fixture(scope="module")
def train_pairs(multi30k_dir):
    return tat.read_split(multi30k_dir, "train")


@pytest.fixture(scope="module")
def train_counts(train_pairs, tokenizers):
    """Token counts of the German and English training sentences."""
    spacy_de, spacy_en = tokenizers
    de = Counter(t for src, _ in train_pairs for t in tat.tokenize(src, spacy_de))
    en = Counter(t for _, tgt in train_pairs for t in tat.tokenize(tgt, spacy_en))
    return de, en


@pytest.fixture(scope="module")
def vocabs(train_pairs, tokenizers):
    return tat.build_vocabulary(train_pairs, *tokenizers)


@pytest.fixture(scope="module")
def train_data(multi30k_dir, vocabs):
    """The whole training split, encoded with the training vocabularies."""
    return tat.prepare_data(multi30k_dir, splits=("train",), vocabs=vocabs)


def write_lines_gz(path, lines):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def test_data_fixture_skips_locally_but_fails_in_ci_when_the_variable_is_unset():
    with pytest.raises(pytest.skip.Exception):
        data_dir_or_skip({})
    with pytest.raises(pytest.fail.Exception, match=tat.DATA_ENV):
        data_dir_or_skip({"CI": "true"})
    assert data_dir_or_skip({tat.DATA_ENV: "/data/m30k"}) == Path("/data/m30k")


# ---------------------------------------------------------------------------
# Downloading Multi30k (from a local server)


class RecordingHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder and records the name of every file asked for; a file named
    in `server.cut` is announced whole but sent only half, then the connection
    closes (an interrupted download)."""

    def do_GET(self):
        name = self.path.lstrip("/")
        self.server.requested.append(name)
        if name not in self.server.cut:
            return super().do_GET()
        data = (Path(self.directory) / name).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, format, *args):  # keep the test output clean
        pass


@pytest.fixture
def multi30k_server(multi30k_dir, tmp_path, monkeypatch):
    """An HTTP server on 127.0.0.1 serving copies of the six Multi30k files."""
    for name in PROXY_VARIABLES:  # talk to 127.0.0.1 directly, never via a proxy
        monkeypatch.delenv(name, raising=False)
    folder = tmp_path / "served"
    folder.mkdir()
    for name in multi30k.MULTI30K_SHA256:
        shutil.copyfile(multi30k_dir / name, folder / name)
    handler = functools.partial(RecordingHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.requested, server.cut = [], set()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield SimpleNamespace(
            url=f"http://127.0.0.1:{server.server_port}/",
            folder=folder,
            requested=server.requested,
            cut=server.cut,
        )
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def names_in(folder):
    return sorted(p.name for p in Path(folder).iterdir())


def test_download_fetches_the_six_files_and_verifies_their_digests(
    multi30k_server, multi30k_dir, tmp_path
):
    target = tmp_path / "data"
    paths = multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert sorted(p.name for p in paths) == sorted(multi30k.MULTI30K_SHA256)
    assert names_in(target) == sorted(
        multi30k.MULTI30K_SHA256
    )  # no temporary files left
    for name, digest in multi30k.MULTI30K_SHA256.items():
        assert (target / name).read_bytes() == (multi30k_dir / name).read_bytes()
        assert multi30k.sha256_of(target / name) == digest
    assert sorted(multi30k_server.requested) == sorted(multi30k.MULTI30K_SHA256)


def test_download_again_reuses_verified_files_without_asking_the_server(
    multi30k_server, tmp_path
):
    target = tmp_path / "data"
    multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert len(multi30k_server.requested) == 6
    multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert len(multi30k_server.requested) == 6


def test_download_fetches_again_only_a_local_file_that_fails_its_digest(
    multi30k_server, tmp_path
):
    target = tmp_path / "data"
    multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    damaged = target / "val.de.gz"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    multi30k_server.requested.clear()
    multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert multi30k_server.requested == ["val.de.gz"]
    assert multi30k.sha256_of(damaged) == multi30k.MULTI30K_SHA256["val.de.gz"]


def test_download_with_a_wrong_digest_raises_and_leaves_nothing_for_that_file(
    multi30k_server, tmp_path
):
    served = multi30k_server.folder / "val.en.gz"
    served.write_bytes(b"corrupted" + served.read_bytes()[9:])
    target = tmp_path / "data"
    with pytest.raises(tat.DataError, match=r"val\.en\.gz") as error:
        multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert "SHA-256" in str(error.value)
    assert "val.en.gz" in multi30k_server.requested
    assert not [name for name in names_in(target) if "val.en.gz" in name]


def test_download_of_a_file_the_server_does_not_have_names_the_file(
    multi30k_server, tmp_path
):
    (multi30k_server.folder / "test_2016_flickr.en.gz").unlink()
    target = tmp_path / "data"
    with pytest.raises(tat.DataError, match=r"test_2016_flickr\.en\.gz") as error:
        multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert "404" in str(error.value)
    assert not [n for n in names_in(target) if "test_2016_flickr.en.gz" in n]


def test_download_command_fetches_the_files_and_returns_0(
    multi30k_server, tmp_path, monkeypatch, capsys
):
    local = functools.partial(multi30k.download_multi30k, base_url=multi30k_server.url)
    monkeypatch.setattr(cli, "download_multi30k", local)
    target = tmp_path / "data"
    assert cli.main(["download", "--data-dir", str(target)]) == 0
    assert names_in(target) == sorted(multi30k.MULTI30K_SHA256)
    assert "verified" in capsys.readouterr().out


def test_download_command_returns_2_naming_a_file_it_could_not_fetch(
    multi30k_server, tmp_path, monkeypatch, capsys
):
    (multi30k_server.folder / "train.en.gz").unlink()
    local = functools.partial(multi30k.download_multi30k, base_url=multi30k_server.url)
    monkeypatch.setattr(cli, "download_multi30k", local)
    assert cli.main(["download", "--data-dir", str(tmp_path / "data")]) == 2
    assert "train.en.gz" in capsys.readouterr().err


def test_download_command_cut_off_mid_file_exits_2_in_one_line_and_keeps_nothing(
    multi30k_server, tmp_path, monkeypatch, capsys
):
    multi30k_server.cut.add("train.de.gz")
    local = functools.partial(multi30k.download_multi30k, base_url=multi30k_server.url)
    monkeypatch.setattr(cli, "download_multi30k", local)
    target = tmp_path / "data"
    assert cli.main(["download", "--data-dir", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.de.gz" in err[0]
    assert "the connection closed after" in err[0]
    assert "train.de.gz" in multi30k_server.requested
    assert not [name for name in names_in(target) if "train.de" in name]


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


READERS = pytest.mark.parametrize(
    "read_split",
    [tat.read_split, multi30k.read_split],
    ids=["book's read_split", "multi30k.read_split"],
)


@READERS
def test_read_split_of_a_missing_file_names_it_and_says_how_to_download(
    read_split, tmp_path
):
    with pytest.raises(tat.DataError, match=r"train\.de\.gz") as error:
        read_split(tmp_path, "train")
    assert "download" in str(error.value)


@READERS
def test_read_split_rejects_a_truncated_copy_of_a_published_file(
    read_split, multi30k_dir, tmp_path
):
    whole = (multi30k_dir / "val.de.gz").read_bytes()
    (tmp_path / "val.de.gz").write_bytes(whole[: len(whole) // 2])
    shutil.copyfile(multi30k_dir / "val.en.gz", tmp_path / "val.en.gz")
    with pytest.raises(tat.DataError, match=r"val\.de\.gz"):
        read_split(tmp_path, "val")


def recompressed(source, target):
    """Write `source`'s text to `target` as another gzip stream: the same lines,
    other bytes (so another SHA-256)."""
    with gzip.open(source, "rb") as f:
        text = f.read()
    with gzip.GzipFile(target, "wb", compresslevel=1, mtime=12345) as f:
        f.write(text)
    assert target.read_bytes() != source.read_bytes()


def test_only_the_workshop_reader_refuses_a_file_whose_digest_differs(
    multi30k_dir, tmp_path
):
    recompressed(multi30k_dir / "val.de.gz", tmp_path / "val.de.gz")
    shutil.copyfile(multi30k_dir / "val.en.gz", tmp_path / "val.en.gz")
    # The book reads what the file says; the digest is the workshop's check.
    assert tat.read_split(tmp_path, "val") == tat.read_split(multi30k_dir, "val")
    for check in (multi30k.verify_split, multi30k.read_split):
        with pytest.raises(tat.DataError, match="SHA-256") as error:
            check(tmp_path, "val")
        assert "val.de.gz" in str(error.value) and "download" in str(error.value)
    multi30k.verify_split(multi30k_dir, "val")  # the published files pass


def test_verify_split_passes_a_split_without_a_published_digest(tmp_path):
    write_lines_gz(tmp_path / "mine.de.gz", ["Ein Hund."])
    write_lines_gz(tmp_path / "mine.en.gz", ["A dog."])
    multi30k.verify_split(tmp_path, "mine")
    assert multi30k.read_split(tmp_path, "mine") == [("Ein Hund.", "A dog.")]


def test_a_run_checks_the_digests_before_reading_the_data(multi30k_dir, tmp_path):
    recompressed(multi30k_dir / "train.de.gz", tmp_path / "train.de.gz")
    for name in ("train.en.gz", "val.de.gz", "val.en.gz"):
        shutil.copyfile(multi30k_dir / name, tmp_path / name)
    config = runs.RunConfig.from_profile("smoke")
    with pytest.raises(tat.DataError, match=r"train\.de\.gz .*SHA-256"):
        runs.prepare_run_data(config, tmp_path)


def test_read_split_rejects_a_damaged_gzip_of_a_split_without_a_digest(tmp_path):
    write_lines_gz(tmp_path / "mine.de.gz", ["Ein Hund."] * 200)
    whole = (tmp_path / "mine.de.gz").read_bytes()
    (tmp_path / "mine.de.gz").write_bytes(whole[: len(whole) // 2])
    write_lines_gz(tmp_path / "mine.en.gz", ["A dog."] * 200)
    with pytest.raises(tat.DataError, match=r"mine\.de\.gz"):
        tat.read_split(tmp_path, "mine")


def test_read_split_of_sides_with_different_line_counts_reports_both_counts(tmp_path):
    write_lines_gz(tmp_path / "mine.de.gz", ["Ein Hund.", "Eine Katze.", "Ein Pferd."])
    write_lines_gz(tmp_path / "mine.en.gz", ["A dog.", "A cat."])
    with pytest.raises(tat.DataError, match="line-aligned") as error:
        tat.read_split(tmp_path, "mine")
    assert "has 3 lines" in str(error.value)
    assert "has 2" in str(error.value)


@READERS
def test_read_split_reads_an_aligned_split_of_any_name(read_split, tmp_path):
    write_lines_gz(tmp_path / "mine.de.gz", ["Zwei Männer.", "Eine Frau läuft."])
    write_lines_gz(tmp_path / "mine.en.gz", ["Two men.", "A woman runs."])
    assert read_split(tmp_path, "mine") == [
        ("Zwei Männer.", "Two men."),
        ("Eine Frau läuft.", "A woman runs."),
    ]


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
    with pytest.raises(ValueError, match="twice"):
        tat.Vocab([*tat.SPECIALS, "Hund", "Hund"])


def test_vocab_round_trips_through_a_json_file(tmp_path):
    vocab = tat.Vocab.build([["Männer", "Ufer", "Männer", "Ufer", "."]] * 2)
    path = tmp_path / "vocab.json"
    runs.save_vocab(vocab, path)
    assert json.loads(path.read_text(encoding="utf-8")) == {"itos": vocab.itos}
    loaded = runs.load_vocab(path)
    assert loaded.get_itos() == vocab.get_itos()
    assert loaded.get_stoi() == vocab.get_stoi()
    assert names_in(tmp_path) == ["vocab.json"]  # no temporary file left


@pytest.mark.parametrize(
    "text",
    [
        '{"itos": ["<s>", "</s>"',  # cut short
        '{"words": ["<s>", "</s>", "<blank>", "<unk>"]}',  # no itos
        '{"itos": ["Hund"]}',  # no specials
        '["<s>", "</s>", "<blank>", "<unk>"]',  # not an object
    ],
)
def test_loading_a_file_that_is_not_a_saved_vocab_raises_data_error(tmp_path, text):
    path = tmp_path / "vocab.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(tat.DataError, match="vocab.json"):
        runs.load_vocab(path)


def test_loading_a_missing_vocab_file_raises_data_error(tmp_path):
    with pytest.raises(tat.DataError, match="nowhere.json"):
        runs.load_vocab(tmp_path / "nowhere.json")


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


def test_encode_sentence_wraps_the_ids_in_start_and_end_symbols():
    vocab = tat.Vocab([*tat.SPECIALS, "Ein", "Hund", "."])
    assert tat.encode_sentence(["Ein", "Hund", "bellt", "."], vocab, 72) == [
        tat.BOS,
        4,
        5,
        tat.UNK,
        6,
        tat.EOS,
    ]


@pytest.mark.parametrize("max_len", [3, 4, 10])
def test_encode_sentence_cuts_to_max_len_and_keeps_the_end_symbol(max_len):
    vocab = tat.Vocab([*tat.SPECIALS, *(f"w{i}" for i in range(100))])
    ids = tat.encode_sentence([f"w{i}" for i in range(100)], vocab, max_len)
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


def test_two_ranks_get_disjoint_equal_counts_of_batches_covering_the_epoch(
    train_data,
):
    lengths = train_data.lengths("train")
    # A budget that cuts the epoch into an odd number of batches, so that the
    # sampler has to split one to give both ranks the same count.
    budget = next(
        b
        for b in range(1000, 1200)
        if len(tat.TokenBudgetBatchSampler(lengths, b).all_batches()) % 2
    )
    ranks = [
        tat.TokenBudgetBatchSampler(lengths, budget, seed=2, num_replicas=2, rank=r)
        for r in (0, 1)
    ]
    for epoch in (0, 1):
        for sampler in ranks:
            sampler.set_epoch(epoch)
        rank_0, rank_1 = (list(sampler) for sampler in ranks)
        assert len(rank_0) == len(rank_1) == len(ranks[0]) == len(ranks[1])
        seen_0 = {i for batch in rank_0 for i in batch}
        seen_1 = {i for batch in rank_1 for i in batch}
        assert not seen_0 & seen_1
        every = sorted(i for batch in rank_0 + rank_1 for i in batch)
        assert every == list(range(len(lengths)))
        assert all(padded_size(b, lengths) <= budget for b in rank_0 + rank_1)


def test_sampler_rejects_a_rank_outside_the_replicas_and_too_few_examples():
    with pytest.raises(ValueError, match="rank"):
        tat.TokenBudgetBatchSampler([3, 4], 10, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="cannot be shared"):
        tat.TokenBudgetBatchSampler([3], 10, num_replicas=2, rank=0)


def test_padding_fraction_counts_the_padded_target_positions():
    examples = [([0, 4, 1], [0, 4, 5, 6, 1]), ([0, 4, 1], [0, 4, 1])]
    batch = tat.collate_batch(examples)  # tgt_y: 4 + 2 real of 2 x 4 positions
    assert tat.padding_fraction([batch]) == pytest.approx(2 / 8)


def original_batches(pairs, batch_size=32, width=72):
    """The 2018 notebook's batching: 32 pairs, every sentence padded to 72 ids."""
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        src, tgt = (
            torch.tensor([ids + [tat.PAD] * (width - len(ids)) for ids in side])
            for side in zip(*chunk, strict=True)
        )
        yield tat.Batch(src, tgt, tat.PAD)


def test_token_budget_batches_waste_far_less_on_padding_than_the_original(
    train_data,
):
    pairs = train_data.splits["train"]
    assert max(len(ids) for pair in pairs for ids in pair) <= 72
    sampler = tat.TokenBudgetBatchSampler(
        train_data.lengths("train"), tat.TrainConfig().max_tokens
    )
    ours = tat.padding_fraction(list(train_data.batches("train", sampler)))
    original = tat.padding_fraction(list(original_batches(pairs)))
    assert original > 0.7  # most of the original's positions were padding
    assert ours < 0.15
    assert ours < original / 3


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


def test_prepare_data_builds_vocabularies_from_the_sliced_train_split_for_any_splits(
    multi30k_dir,
):
    with_train = tat.prepare_data(multi30k_dir, max_train_pairs=200)
    val_only = tat.prepare_data(multi30k_dir, splits=("val",), max_train_pairs=200)
    assert val_only.vocab_src.get_itos() == with_train.vocab_src.get_itos()
    assert val_only.vocab_tgt.get_itos() == with_train.vocab_tgt.get_itos()


# ---------------------------------------------------------------------------
# Training configuration


def test_from_profile_applies_overrides_over_the_profile():
    config = runs.RunConfig.from_profile("smoke", epochs=3, max_train_pairs=300)
    assert (config.profile, config.N, config.d_model) == ("smoke", 1, 32)
    assert (config.epochs, config.max_train_pairs) == (3, 300)
    assert runs.RunConfig.from_dict(config.to_dict()) == config


def test_base_profile_is_the_papers_base_model():
    config = runs.RunConfig.from_profile("base")
    assert (config.N, config.d_model, config.d_ff, config.h) == (6, 512, 2048, 8)
    assert config.dropout == 0.1 and config.label_smoothing == 0.1


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"d_model": 30, "h": 4}, "divisible"),
        ({"max_len": 2}, "max_len"),
        ({"epochs": -1}, "epochs"),
        ({"dimension": 3}, "dimension"),
        ({"time_limit": 0}, "time_limit is in minutes"),
    ],
)
def test_train_config_rejects_bad_settings_with_a_clear_message(overrides, message):
    with pytest.raises(ValueError, match=message):
        runs.RunConfig.from_profile("smoke", **overrides)


def test_from_profile_rejects_an_unknown_profile_listing_the_known_ones():
    with pytest.raises(ValueError, match="smoke"):
        runs.RunConfig.from_profile("huge")


# ---------------------------------------------------------------------------
# Checkpoints and resuming


def smoke_config(**overrides):
    """The smoke profile on 300 pairs, small batches, two epochs."""
    settings = dict(max_train_pairs=300, epochs=2, max_tokens=300, keep_checkpoints=1)
    return runs.RunConfig.from_profile("smoke", **{**settings, **overrides})


@pytest.fixture(scope="module")
def smoke_run(multi30k_dir, tmp_path_factory):
    """A two-epoch smoke-profile run, uninterrupted."""
    out = tmp_path_factory.mktemp("smoke_run")
    history = runs.train_model(smoke_config(), multi30k_dir, out, quiet=True)
    return SimpleNamespace(out=out, history=history)


def model_weights(path):
    return runs.load_checkpoint(path)["model"]


def test_training_saves_last_and_the_newest_epoch_checkpoints(smoke_run):
    assert names_in(smoke_run.out) == [
        "epoch_002.pt",
        "last.pt",
        "vocab_src.json",
        "vocab_tgt.json",
    ]
    last = runs.load_checkpoint(smoke_run.out / "last.pt")
    assert last["epoch"] == 1
    assert last["config"] == smoke_config().to_dict()
    assert {"optimizer", "scheduler", "train_state", "history"} <= set(last)
    assert last["history"] == smoke_run.history
    assert [r["epoch"] for r in smoke_run.history] == [1, 2]
    vocab_tgt = runs.load_vocab(smoke_run.out / "vocab_tgt.json")
    assert vocab_tgt.get_itos() == last["vocab_tgt"]


def test_time_limit_stops_before_an_epoch_that_would_end_too_late_and_says_so(
    multi30k_dir, tmp_path, capsys
):
    config = smoke_config(epochs=3, time_limit=1e-6)  # minutes: one epoch is longer
    history = runs.train_model(config, multi30k_dir, tmp_path)
    assert [r["epoch"] for r in history] == [1]  # the first epoch always runs
    assert "stopped after 1 of the 3 epochs" in capsys.readouterr().out
    last = runs.load_checkpoint(tmp_path / "last.pt")
    assert last["epoch"] == 0 and "stopped after 1 of the 3 epochs" in last["stopped"]


def test_a_run_within_its_time_limit_trains_its_whole_budget_unmarked(smoke_run):
    assert len(smoke_run.history) == smoke_config().epochs
    assert "stopped" not in runs.load_checkpoint(smoke_run.out / "last.pt")


def test_an_epoch_checkpoint_rebuilds_the_trained_model(smoke_run):
    model, vocab_src, vocab_tgt, config = runs.model_from_checkpoint(
        runs.load_checkpoint(smoke_run.out / "epoch_002.pt")
    )
    assert config == smoke_config()
    assert not model.training
    weights = model.state_dict()
    for name, tensor in model_weights(smoke_run.out / "last.pt").items():
        assert torch.equal(weights[name], tensor), name
    assert len(vocab_src) == model.src_embed[0].lut.num_embeddings
    assert len(vocab_tgt) == model.generator.proj.out_features


def test_a_run_resumed_after_epoch_1_ends_where_an_uninterrupted_run_ends(
    smoke_run, multi30k_dir, tmp_path
):
    first = runs.train_model(smoke_config(epochs=1), multi30k_dir, tmp_path, quiet=True)
    assert len(first) == 1
    assert runs.load_checkpoint(tmp_path / "last.pt")["epoch"] == 0
    resumed = runs.train_model(
        smoke_config(epochs=2), multi30k_dir, tmp_path, resume=True, quiet=True
    )
    assert [r["epoch"] for r in resumed] == [1, 2]
    torch.testing.assert_close(
        model_weights(tmp_path / "last.pt"),
        model_weights(smoke_run.out / "last.pt"),
        rtol=0,
        atol=1e-6,
    )
    ours = runs.load_checkpoint(tmp_path / "last.pt")
    theirs = runs.load_checkpoint(smoke_run.out / "last.pt")
    assert ours["train_state"] == theirs["train_state"]
    assert ours["config"]["epochs"] == 2
    assert resumed[1]["val_nll"] == pytest.approx(smoke_run.history[1]["val_nll"])


def test_a_checkpoint_write_that_dies_part_way_keeps_the_previous_one(
    tmp_path, monkeypatch
):
    path = tmp_path / "last.pt"
    before = {"model": {"w": torch.arange(6.0)}, "epoch": 0}
    runs.save_checkpoint(path, before)

    def dies_part_way(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 the first bytes of a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", dies_part_way)
    with pytest.raises(OSError, match="No space"):
        runs.save_checkpoint(path, {"model": {"w": torch.zeros(6)}, "epoch": 1})
    monkeypatch.undo()
    after = runs.load_checkpoint(path)
    assert after["epoch"] == 0
    assert torch.equal(after["model"]["w"], before["model"]["w"])
    assert names_in(tmp_path) == ["last.pt"]


class RunsCodeWhenUnpickled:
    """Unpickling this creates a file: a stand-in for code hidden in a checkpoint."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_load_checkpoint_refuses_a_file_holding_arbitrary_python_objects(tmp_path):
    marker = tmp_path / "code_ran"
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": RunsCodeWhenUnpickled(marker)}, path)
    with pytest.raises(tat.DataError, match="evil.pt"):
        runs.load_checkpoint(path)
    assert not marker.exists()
    # The control: an unrestricted load would have run the payload.
    torch.load(path, weights_only=False)["payload"].close()
    assert marker.exists()


def test_load_checkpoint_of_a_truncated_file_raises_data_error(smoke_run, tmp_path):
    whole = (smoke_run.out / "last.pt").read_bytes()
    (tmp_path / "last.pt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(tat.DataError, match="not a readable checkpoint"):
        runs.load_checkpoint(tmp_path / "last.pt")


def test_load_checkpoint_of_a_missing_file_says_how_to_train_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="train --data-dir"):
        runs.load_checkpoint(tmp_path / "missing.pt")


# ---------------------------------------------------------------------------
# Data-parallel training and gradient accumulation

DDP_VOCAB = 13
DDP_HALVES = (slice(0, 3), slice(3, 5))  # rank 0 and rank 1's rows of the batch


def ddp_test_model():
    """A one-layer float64 Transformer, seeded, without dropout."""
    torch.manual_seed(0)
    tiny = dict(N=1, d_model=16, d_ff=32, h=2, dropout=0.0)
    return tat.make_model(DDP_VOCAB, DDP_VOCAB, **tiny).double()


def ddp_global_batch():
    """(src, tgt) ids of 5 sentences; the last two are short, so rank 1 has fewer
    tokens than rank 0."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(4, DDP_VOCAB, (5, 9), generator=gen)
    tgt = torch.randint(4, DDP_VOCAB, (5, 9), generator=gen)
    src[:, 0] = tgt[:, 0] = tat.BOS
    for row, length in ((3, 3), (4, 5)):
        src[row, length:] = tat.PAD
        tgt[row, length - 1] = tat.EOS
        tgt[row, length:] = tat.PAD
    return src, tgt


def sgd_step(model, module, batches):
    """run_epoch over `batches` with plain SGD, accum_iter=1; returns the state."""
    criterion = tat.LabelSmoothing(DDP_VOCAB, tat.PAD, 0.1)
    loss_compute = tat.SimpleLossCompute(module.generator, criterion)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    tat.run_epoch(batches, model, loss_compute, optimizer, quiet=True, accum_iter=1)
    return module.state_dict()


def ddp_worker(rank, world_size, port, result_path):
    """One process of the data-parallel test: a step on its half of the batch."""
    from torch.nn.parallel import DistributedDataParallel

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        module = ddp_test_model()
        src, tgt = ddp_global_batch()
        half = DDP_HALVES[rank]
        batch = tat.Batch(src[half], tgt[half], tat.PAD)
        state = sgd_step(DistributedDataParallel(module), module, [batch])
        if rank == 0:
            torch.save(state, result_path)
    finally:
        torch.distributed.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_on_halves_of_a_batch_take_the_one_process_step(tmp_path):
    src, tgt = ddp_global_batch()
    halves = [tat.Batch(src[h], tgt[h], tat.PAD) for h in DDP_HALVES]
    assert halves[0].ntokens != halves[1].ntokens  # token counts differ by rank
    result_path = tmp_path / "rank0.pt"
    torch.multiprocessing.spawn(
        ddp_worker, args=(2, free_port(), str(result_path)), nprocs=2
    )
    two_processes = torch.load(result_path, weights_only=True)

    whole = ddp_test_model()
    one_process = sgd_step(whole, whole, [tat.Batch(src, tgt, tat.PAD)])
    torch.testing.assert_close(two_processes, one_process, rtol=0, atol=1e-9)

    # The check can fail: averaging the two halves' steps (each the mean over its
    # own tokens) weights rank 1's fewer tokens too much, and differs.
    initial = ddp_test_model().state_dict()
    steps = []
    for batch in halves:
        model = ddp_test_model()
        steps.append(sgd_step(model, model, [batch]))
    gap = max(
        ((steps[0][k] + steps[1][k]) / 2 - two_processes[k]).abs().max().item()
        for k in initial
    )
    moved = max((one_process[k] - initial[k]).abs().max().item() for k in initial)
    assert gap > 1e-4 and moved > 1e-3


def test_train_model_in_two_processes_gives_each_its_share_of_the_batches(
    multi30k_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one thread for each process
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    config = smoke_config(epochs=1)
    history = runs.train_model(config, multi30k_dir, tmp_path, nprocs=2, quiet=True)
    assert [r["epoch"] for r in history] == [1]
    state = runs.load_checkpoint(tmp_path / "last.pt")["train_state"]
    data = tat.prepare_data(multi30k_dir, splits=("train",), max_train_pairs=300)
    rank_0 = list(
        tat.TokenBudgetBatchSampler(
            data.lengths("train"), config.max_tokens, num_replicas=2, rank=0
        )
    )
    assert state["step"] == state["accum_step"] == len(rank_0)
    assert state["samples"] == sum(len(batch) for batch in rank_0) < 300


class RecordsNoSync(nn.Module):
    """A model with DDP's no_sync(): records whether each forward ran inside it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.inside = False
        self.entries = 0
        self.forwards = []

    @contextlib.contextmanager
    def no_sync(self):
        self.entries += 1
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def forward(self, *args):
        self.forwards.append(self.inside)
        return self.inner(*args)


@pytest.mark.parametrize(
    "n_batches, inside, steps",
    [(4, [True, False, True, False], 2), (3, [True, False, False], 2)],
)
def test_micro_batches_that_do_not_step_run_under_no_sync(n_batches, inside, steps):
    src, tgt = ddp_global_batch()
    batches = [tat.Batch(src, tgt, tat.PAD) for _ in range(n_batches)]
    inner = ddp_test_model()
    model = RecordsNoSync(inner)
    criterion = tat.LabelSmoothing(DDP_VOCAB, tat.PAD, 0.1)
    loss_compute = tat.SimpleLossCompute(inner.generator, criterion)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, state = tat.run_epoch(
        batches, model, loss_compute, optimizer, accum_iter=2, quiet=True
    )
    assert model.forwards == inside
    assert model.entries == inside.count(True)
    assert state.accum_step == steps


# ---------------------------------------------------------------------------
# Learning


def untrained_val_nll(config, data):
    """Validation NLL per token of the model `_train` starts from."""
    torch.manual_seed(config.seed)
    model = config.make_model(len(data.vocab_src), len(data.vocab_tgt))
    criterion = tat.LabelSmoothing(len(data.vocab_tgt), tat.PAD, config.label_smoothing)
    loss_compute = tat.SimpleLossCompute(model.generator, criterion)
    sampler = tat.TokenBudgetBatchSampler(
        data.lengths("val"), config.max_tokens, shuffle=False
    )
    nll, _ = tat.run_epoch(
        data.batches("val", sampler), model, loss_compute, mode="eval"
    )
    return nll


@pytest.mark.slow
def test_quick_profile_lowers_the_validation_nll_by_a_third_in_a_few_hundred_steps(
    multi30k_dir, tmp_path
):
    config = runs.RunConfig.from_profile(
        "quick", max_train_pairs=1500, epochs=4, max_tokens=400
    )
    data = tat.prepare_data(multi30k_dir, max_train_pairs=1500)
    before = untrained_val_nll(config, data)
    assert before == pytest.approx(math.log(len(data.vocab_tgt)), abs=1.0)
    history = runs.train_model(config, multi30k_dir, tmp_path, quiet=True)
    steps = runs.load_checkpoint(tmp_path / "last.pt")["train_state"]["accum_step"]
    assert steps >= 200
    after = history[-1]["val_nll"]
    assert after < before * 2 / 3, (before, [r["val_nll"] for r in history])
    assert history[-1]["val_ppl"] == pytest.approx(math.exp(after))


def test_a_run_without_dropout_trains_exactly_what_the_books_recipe_trains(
    multi30k_dir, tmp_path
):
    """runs.train_model is tat.train_translator plus what a long run needs, and the
    CPU tricks of workshop.fast. Their loss has the book's gradient (-q) and, with
    dropout off, their dropout draws nothing: both runs end with the same weights."""
    config = smoke_config(epochs=1, dropout=0.0)
    history = runs.train_model(config, multi30k_dir, tmp_path, quiet=True)
    book_config = tat.TrainConfig(
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(tat.TrainConfig)}
    )
    data = tat.prepare_data(multi30k_dir, max_train_pairs=config.max_train_pairs)
    model, book_history = tat.train_translator(
        book_config, data, device="cpu", quiet=True
    )
    weights = model.state_dict()
    for name, tensor in model_weights(tmp_path / "last.pt").items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert [r["epoch"] for r in book_history] == [r["epoch"] for r in history] == [1]
    for key in ("train_loss_smoothed", "val_nll"):  # summed in other orders
        assert book_history[0][key] == pytest.approx(history[0][key], rel=1e-5)


# ---------------------------------------------------------------------------
# Translating


def test_detokenize_joins_tokens_with_english_spacing():
    tokens = ["A", "man", "'s", "dog", ",", "running", "."]
    assert tat.detokenize(tokens) == "A man's dog, running."
    assert tat.detokenize(["It", "does", "n't", "(", "really", ")", "run"]) == (
        "It doesn't (really) run"
    )
    assert tat.detokenize([]) == ""


@pytest.fixture(scope="module")
def translator(smoke_run):
    return runs.load_translator(smoke_run.out / "last.pt", device="cpu")


def test_translate_returns_one_english_string_per_german_sentence(translator):
    sentences = ["Ein Hund läuft.", "Zwei Männer stehen am Ufer.", "Eine Frau."]
    outputs = translator.translate(sentences, batch_size=2)
    assert len(outputs) == 3 and all(isinstance(s, str) for s in outputs)
    assert not any("</s>" in s or "<s>" in s for s in outputs)
    assert tat.translate(translator, "Ein Hund läuft.") == outputs[:1]


def test_a_sentence_longer_than_training_max_len_is_translated_whole(translator):
    words = " ".join(["Hund"] * 100)  # 100 words: more than max_len = 72 ids
    assert translator.config.max_len < 102
    assert translator.encode([words])[0] == [
        tat.BOS,
        *[translator.vocab_src["Hund"]] * 100,
        tat.EOS,
    ]


def test_translate_command_names_a_sentence_longer_than_the_models_positions(
    translator, monkeypatch, capsys
):
    """Past the positional encoding's table a sentence must be cut: it is, aloud."""
    config = translator.config
    short = tat.make_model(
        len(translator.vocab_src),
        len(translator.vocab_tgt),
        N=config.N,
        d_model=config.d_model,
        d_ff=config.d_ff,
        h=config.h,
        max_len=30,
    )
    short.load_state_dict(runs._weights_only(translator.model.state_dict()))
    limited = tat.Translator(
        short.eval(), translator.vocab_src, translator.vocab_tgt, config
    )
    monkeypatch.setattr(cli, "load_translator", lambda path, device=None: limited)
    long = " ".join(["Hund"] * 40)  # 42 ids with <s> and </s>
    assert cli.main(["translate", "--checkpoint", "x.pt", "Ein Hund.", long]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2
    assert err.strip() == (
        "warning: sentence 2 has 42 tokens, more than the model's 30 positions; "
        "only its first 30 are translated."
    )


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


@pytest.fixture
def fresh_notebook_run():
    """tat.notebook_run with its cache emptied before and after the test."""
    tat.notebook_run.cache_clear()
    yield tat.notebook_run
    tat.notebook_run.cache_clear()


def test_notebook_run_trains_the_profile_in_memory_once_with_the_books_model(
    fresh_notebook_run, multi30k_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(tat, "PROFILE", "smoke")
    monkeypatch.setenv(tat.DATA_ENV, str(multi30k_dir))
    monkeypatch.chdir(tmp_path)
    found = fresh_notebook_run()
    translator, data_dir, history = found
    assert data_dir == multi30k_dir
    assert [set(r) for r in history] == [{"epoch", "train_loss_smoothed", "val_nll"}]
    assert [r["epoch"] for r in history] == [1]  # the smoke profile's one epoch
    assert "validation perplexity" in capsys.readouterr().out
    assert translator.config == tat.TrainConfig(**tat.PROFILES["smoke"])
    dropouts = [m for m in translator.model.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and all(type(m) is nn.Dropout for m in dropouts)
    assert len(translator.translate(["Ein Hund läuft."])) == 1
    assert fresh_notebook_run() is found  # later examples reuse the model
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no run folder


@pytest.mark.parametrize("folder", [None, "empty"])
def test_notebook_run_without_data_says_what_to_set_and_trains_nothing(
    folder, fresh_notebook_run, tmp_path, monkeypatch, capsys
):
    point_data_at(folder, tmp_path, monkeypatch)

    def no_training(*args, **kwargs):
        raise AssertionError("notebook_run trained without data")

    monkeypatch.setattr(tat, "train_translator", no_training)
    assert fresh_notebook_run() is None
    said = capsys.readouterr().out
    assert tat.DATA_ENV in said and "download --data-dir" in said


def test_translate_command_prints_one_line_per_sentence(smoke_run, capsys):
    path = str(smoke_run.out / "last.pt")
    assert cli.main(["translate", "--checkpoint", path, "Ein Hund läuft."]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_translate_command_with_a_missing_checkpoint_returns_2(tmp_path, capsys):
    path = tmp_path / "missing.pt"
    assert cli.main(["translate", "--checkpoint", str(path), "Ein Hund."]) == 2
    assert "missing.pt" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# The train command


def test_train_command_with_a_folder_without_data_names_the_missing_file(
    tmp_path, capsys
):
    argv = ["train", "--data-dir", str(tmp_path / "no_data"), "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "train.de.gz" in err and "download" in err


def test_train_command_with_resume_but_no_last_checkpoint_returns_2(tmp_path, capsys):
    argv = ["train", "--data-dir", str(tmp_path), "--out", str(tmp_path), "--resume"]
    assert cli.main(argv) == 2
    assert "last.pt" in capsys.readouterr().err


def test_train_command_trains_the_smoke_profile_and_saves_a_checkpoint(
    multi30k_dir, tmp_path
):
    argv = ["train", "--data-dir", str(multi30k_dir), "--out", str(tmp_path)]
    argv += ["--profile", "smoke", "--epochs", "1", "--max-tokens", "800", "--quiet"]
    assert cli.main(argv) == 0
    last = runs.load_checkpoint(tmp_path / "last.pt")
    assert last["config"]["profile"] == "smoke"
    assert (last["config"]["epochs"], last["config"]["max_tokens"]) == (1, 800)
    assert [r["epoch"] for r in last["history"]] == [1]


# ---------------------------------------------------------------------------
# One folder, one run: refusing to mix runs, resuming, pruning


def copy_of(run_folder, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(run_folder, target)
    return target


def train_argv(multi30k_dir, out, *more):
    return ["train", "--data-dir", str(multi30k_dir), "--out", str(out), *more]


def test_train_into_a_folder_holding_a_run_exits_2_and_leaves_the_run_alone(
    smoke_run, multi30k_dir, tmp_path, capsys
):
    run = copy_of(smoke_run.out, tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    argv = train_argv(multi30k_dir, run, "--profile", "smoke", "--epochs", "1")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert str(run) in err[0] and "--resume" in err[0] and "--out" in err[0]
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_resume_takes_the_runs_settings_and_extends_only_its_epochs(
    smoke_run, multi30k_dir, tmp_path, capsys
):
    run = copy_of(smoke_run.out, tmp_path)
    assert cli.main(train_argv(multi30k_dir, run, "--resume", "--epochs", "3")) == 0
    printed = capsys.readouterr().out
    assert f"resuming {run / 'last.pt'} (profile smoke): 2 of 3 epochs done" in printed
    last = runs.load_checkpoint(run / "last.pt")
    assert last["config"] == smoke_config(epochs=3).to_dict()  # not quick's settings
    assert [r["epoch"] for r in last["history"]] == [1, 2, 3]
    assert last["history"][:2] == smoke_run.history
    assert runs.epoch_files(run) == [run / "epoch_003.pt"]  # keep_checkpoints=1


@pytest.mark.parametrize(
    "more, expected",
    [
        ([], "has finished its 2 epochs"),
        (["--epochs", "2"], "has finished its 2 epochs"),
        (["--max-tokens", "500"], "max_tokens=500 (the run has 300)"),
        (["--profile", "quick"], "profile='quick' (the run has 'smoke')"),
        (["--epochs", "3", "--bf16"], "bf16=True (the run has False)"),
    ],
)
def test_resume_refuses_to_change_a_runs_settings_or_to_train_nothing(
    smoke_run, multi30k_dir, tmp_path, capsys, more, expected
):
    run = copy_of(smoke_run.out, tmp_path)
    before = (run / "last.pt").read_bytes()
    assert cli.main(train_argv(multi30k_dir, run, "--resume", *more)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert (run / "last.pt").read_bytes() == before


def test_resume_counts_the_time_limit_from_the_time_the_run_has_spent(
    multi30k_dir, tmp_path, capsys
):
    config = smoke_config(epochs=1, time_limit=60.0)  # an hour: epoch 1 fits
    runs.train_model(config, multi30k_dir, tmp_path, quiet=True)
    last = runs.load_checkpoint(tmp_path / "last.pt")
    assert 0 < last["elapsed"] < 600  # measured: seconds, not an hour
    runs.save_checkpoint(tmp_path / "last.pt", last | {"elapsed": 3600.0})  # spent
    argv = train_argv(multi30k_dir, tmp_path, "--resume", "--epochs", "2")
    assert cli.main(argv) == 0
    assert "stopped after 1 of the 2 epochs" in capsys.readouterr().out
    again = runs.load_checkpoint(tmp_path / "last.pt")
    assert again["epoch"] == 0 and "stopped" in again["stopped"]


def test_epoch_files_are_ordered_by_epoch_number_not_by_name(tmp_path):
    for name in ("epoch_1000.pt", "epoch_999.pt", "epoch_002.pt", "epoch_x.pt"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in runs.epoch_files(tmp_path)] == [
        "epoch_002.pt",
        "epoch_999.pt",
        "epoch_1000.pt",
    ]


# ---------------------------------------------------------------------------
# Data-parallel training that cannot hang


def test_epoch_seeds_differ_by_rank_and_epoch_and_repeat_for_the_same_ones():
    seeds = {runs.epoch_seed(0, e, r) for e in range(3) for r in range(4)}
    assert len(seeds) == 12
    assert runs.epoch_seed(0, 1, 1) == runs.epoch_seed(0, 1, 1)
    assert runs.epoch_seed(1, 0, 0) != runs.epoch_seed(0, 1, 0)  # not seed + epoch


@pytest.mark.parametrize("n, replicas", [(5, 2), (7, 3), (9, 4), (2, 2)])
def test_every_process_gets_as_many_batches_when_each_batch_holds_one_pair(n, replicas):
    shares = [
        list(tat.TokenBudgetBatchSampler([10] * n, 1, num_replicas=replicas, rank=r))
        for r in range(replicas)
    ]
    assert len({len(share) for share in shares}) == 1
    seen = Counter(i for share in shares for batch in share for i in batch)
    assert set(seen) == set(range(n))  # every pair at least once
    assert sum(seen.values()) - n < replicas  # fewer than one round repeated


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "overrides",
    [
        {"accum_iter": 2},
        {"max_tokens": 1, "max_train_pairs": 25},  # one pair a batch, an odd count
    ],
    ids=["accum_iter=2", "one pair per batch, 25 pairs"],
)
def test_two_processes_train_an_epoch_to_the_end_without_hanging(
    multi30k_dir, tmp_path, monkeypatch, overrides
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    config = smoke_config(epochs=1, **overrides)
    history = runs.train_model(config, multi30k_dir, tmp_path, nprocs=2, quiet=True)
    assert [r["epoch"] for r in history] == [1]
    state = runs.load_checkpoint(tmp_path / "last.pt")["train_state"]
    data = tat.prepare_data(
        multi30k_dir, splits=("train",), max_train_pairs=config.max_train_pairs
    )
    shares = [
        list(
            tat.TokenBudgetBatchSampler(
                data.lengths("train"), config.max_tokens, num_replicas=2, rank=r
            )
        )
        for r in range(2)
    ]
    assert len(shares[0]) == len(shares[1]) == state["step"]
    assert state["accum_step"] == math.ceil(state["step"] / config.accum_iter)


# ---------------------------------------------------------------------------
# bf16 only where it pays


@pytest.mark.parametrize("speedup, expected", [(0.03, None), (1.7, torch.bfloat16)])
def test_bf16_is_used_only_where_a_measured_matmul_says_it_pays(
    speedup, expected, monkeypatch, capsys
):
    monkeypatch.setattr(runs, "bf16_matmul_speedup", lambda device: speedup)
    assert runs.amp_dtype_for(True, torch.device("cpu")) == expected
    said = capsys.readouterr().out.strip().splitlines()
    if expected is None:
        assert len(said) == 1 and "--bf16 ignored" in said[0] and "0.03x" in said[0]
    else:
        assert said == []


def test_bf16_not_asked_for_is_not_even_measured(monkeypatch):
    def never(device):
        raise AssertionError("measured without --bf16")

    monkeypatch.setattr(runs, "bf16_matmul_speedup", never)
    assert runs.amp_dtype_for(False, torch.device("cpu")) is None


def test_bf16_speedup_is_the_ratio_of_the_two_timed_products(monkeypatch):
    """float32 time / bfloat16 time, each the fastest of its repeats after one
    warm-up call (a fake clock makes every call's duration known)."""
    durations = iter([9.0, 2.0, 3.0, 50.0, 8.0, 6.0])  # fp32: 2, 3; bf16: 8, 6
    clock = [0.0]

    def fake_perf_counter():
        return clock[0]

    def fake_matmul(self, other):
        clock[0] += next(durations)
        return self

    monkeypatch.setattr(runs.time, "perf_counter", fake_perf_counter)
    monkeypatch.setattr(torch.Tensor, "__matmul__", fake_matmul)
    assert runs.bf16_matmul_speedup("cpu", tokens=4, d_model=2) == pytest.approx(2 / 6)
