"""Tests for the book's subword vocabularies shared by both languages (Part 5).

A joint byte-level BPE vocabulary learned from the training split, its use in Part 3's
pipeline (data, checkpoints, translation), one matrix for both embeddings and the
generator, and the command-line switches. Like Part 3's tests, they find Multi30k
through $ANNOTATED_TRANSFORMER_DATA: skipped on a laptop without it, failing in CI.
"""

import shutil
import unicodedata
from types import SimpleNamespace

import pytest
import torch
from conftest import data_dir_or_skip

import the_annotated_transformer as tat
from workshop import cli, runs

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

SMALL = dict(N=1, d_model=32, d_ff=64, h=2, dropout=0.0)
NEW_FIELDS = ("vocab", "bpe_vocab_size", "share_embeddings", "tie_generator")
MARKERS = ("Ġ", "▁", "<s>", "</s>", "<blank>", "<unk>")


# ---------------------------------------------------------------------------
# Shared setup


@pytest.fixture(scope="module")
def train_pairs(multi30k_dir):
    return tat.read_split(multi30k_dir, "train")


@pytest.fixture(scope="module")
def bpe(train_pairs):
    """The default 8,000-token joint vocabulary, from the whole training split."""
    return tat.SubwordVocab.build(text for pair in train_pairs for text in pair)


def texts_of(pairs):
    """German and English sentences of `pairs`, in the order prepare_data feeds them."""
    return [text for pair in pairs for text in pair]


def test_data_fixture_skips_locally_but_fails_in_ci_when_the_variable_is_unset():
    with pytest.raises(pytest.skip.Exception):
        data_dir_or_skip({})
    with pytest.raises(pytest.fail.Exception, match=tat.DATA_ENV):
        data_dir_or_skip({"CI": "true"})


# ---------------------------------------------------------------------------
# Learning the vocabulary


def test_subword_vocab_puts_the_four_specials_first_with_the_books_ids(bpe):
    assert bpe.lookup_tokens(range(4)) == list(tat.SPECIALS)
    assert [bpe[t] for t in tat.SPECIALS] == [tat.BOS, tat.EOS, tat.PAD, tat.UNK]
    assert len(bpe) == 8000 == len(bpe.get_itos()) == len(set(bpe.get_itos()))


def bpe_data_config(**overrides):
    """A run's settings for a 1,000-token joint vocabulary learned from 300 pairs."""
    settings = dict(vocab="bpe", bpe_vocab_size=1000, max_train_pairs=300)
    return runs.RunConfig.from_profile("smoke", **{**settings, **overrides})


def test_a_runs_data_learns_bpe_from_exactly_the_sliced_training_sentences(
    multi30k_dir, train_pairs, monkeypatch
):
    seen = []
    build = tat.SubwordVocab.build

    def recording_build(texts, vocab_size=8000):
        texts = list(texts)
        seen.append(texts)
        return build(texts, vocab_size)

    monkeypatch.setattr(tat.SubwordVocab, "build", recording_build)
    data = runs.prepare_run_data(bpe_data_config(), multi30k_dir)
    assert seen == [texts_of(train_pairs[:300])]
    assert data.vocab_src is data.vocab_tgt
    monkeypatch.undo()
    again = tat.SubwordVocab.build(texts_of(train_pairs[:300]), 1000)
    assert data.vocab_src.to_json() == again.to_json()  # learning is deterministic


def test_every_learned_token_is_a_piece_of_the_training_text_it_came_from(
    train_pairs,
):
    slice_text = "\n".join(texts_of(train_pairs[:300]))
    vocab = tat.SubwordVocab.build(texts_of(train_pairs[:300]), 1000)
    learned = [vocab.decode([i]) for i in range(4 + 256, len(vocab))]
    assert len(learned) > 500
    whole = [piece for piece in learned if "\ufffd" not in piece]  # not part-UTF-8
    assert len(whole) > 0.9 * len(learned)
    assert all(piece in slice_text for piece in whole)
    # Text from further on in the split is not in the slice's vocabulary.
    later = "\n".join(texts_of(train_pairs[300:]))
    assert "Zimmermann" in later and "Zimmermann" not in slice_text
    assert len(vocab.encode("Zimmermann")) > 1


def test_words_found_only_outside_the_training_split_are_cut_into_pieces(
    bpe, multi30k_dir, train_pairs
):
    train_text = "\n".join(texts_of(train_pairs))
    test_words = {
        word.strip(".,;:!?\"'()")
        for pair in tat.read_split(multi30k_dir, "test_2016_flickr")
        for text in pair
        for word in text.split()
    }
    unseen = sorted(w for w in test_words if w.isalpha() and w not in train_text)
    assert len(unseen) >= 20
    for word in unseen:
        assert len(bpe.encode(" " + word)) > 1, word
        assert len(bpe.encode(word)) > 1, word
    # Frequent training words, in contrast, are single tokens.
    for word in (" Hund", " dog", " Mann", " man"):
        assert len(bpe.encode(word)) == 1, word


# ---------------------------------------------------------------------------
# Encoding and decoding


def test_decoding_the_encoding_gives_back_the_first_200_validation_sentences(
    bpe, multi30k_dir
):
    val = tat.read_split(multi30k_dir, "val")[:200]
    for text in texts_of(val):
        ids = bpe.encode(text)
        assert tat.UNK not in ids
        assert bpe.decode(ids) == unicodedata.normalize("NFC", text)


def test_text_with_characters_never_seen_in_training_needs_no_unk(bpe):
    text = "Ωmega: ein naïver Hund 🐕 läuft — schnell!"
    ids = bpe.encode(text)
    assert tat.UNK not in ids
    assert bpe.decode(ids) == text
    # A character never seen in training is spelled out as its UTF-8 bytes.
    assert len(bpe.encode("🐕")) == len("🐕".encode()) == 4


def test_the_only_normalisation_is_nfc_and_whitespace_is_kept(bpe):
    decomposed = "Ma\u0308dchen"  # "a" + combining diaeresis
    assert bpe.decode(bpe.encode(decomposed)) == "Mädchen"
    spaced = "  zwei  Leerzeichen\tund ein Tab "
    assert bpe.decode(bpe.encode(spaced)) == spaced


def test_pieces_show_how_a_sentence_was_cut(bpe):
    pieces = bpe.pieces("Ein Hund läuft.")
    assert "".join(pieces) == "Ein Hund läuft."
    assert " Hund" in pieces and pieces[-1] == "."


def test_decode_and_detokenize_leave_out_the_specials(bpe):
    ids = bpe.encode("A dog runs.")
    assert bpe.decode([tat.BOS, *ids, tat.PAD, tat.EOS]) == "A dog runs."
    tokens = bpe.lookup_tokens([*ids, tat.UNK])
    assert bpe.detokenize(tokens) == "A dog runs."


def test_encode_text_wraps_subword_ids_in_start_and_end_symbols(bpe):
    ids = bpe.encode("Ein kleiner Hund läuft über die Wiese.")
    assert tat.encode_text("Ein kleiner Hund läuft über die Wiese.", bpe, None, 72) == [
        tat.BOS,
        *ids,
        tat.EOS,
    ]
    cut = tat.encode_text("Ein kleiner Hund läuft über die Wiese.", bpe, None, 4)
    assert cut == [tat.BOS, *ids[:2], tat.EOS]


def test_a_runs_data_encodes_both_sides_with_the_one_subword_vocabulary(
    multi30k_dir,
):
    data = runs.prepare_run_data(bpe_data_config(), multi30k_dir)
    vocab = data.vocab_src
    assert isinstance(vocab, tat.SubwordVocab) and data.vocab_tgt is vocab
    assert len(data.splits["train"]) == 300 and len(data.splits["val"]) == 1014
    for (de, en), (src, tgt) in zip(
        data.raw["val"][:20], data.splits["val"][:20], strict=True
    ):
        assert src == [tat.BOS, *vocab.encode(de), tat.EOS]
        assert tgt == [tat.BOS, *vocab.encode(en), tat.EOS]


def test_the_books_prepare_data_encodes_with_the_vocabularies_it_is_given(
    multi30k_dir, train_pairs
):
    vocab = tat.SubwordVocab.build(texts_of(train_pairs[:300]), 1000)
    data = tat.prepare_data(multi30k_dir, splits=("val",), vocabs=(vocab, vocab))
    assert data.vocab_src is data.vocab_tgt is vocab
    (de, en), (src, tgt) = data.raw["val"][0], data.splits["val"][0]
    assert src == [tat.BOS, *vocab.encode(de), tat.EOS]
    assert tgt == [tat.BOS, *vocab.encode(en), tat.EOS]


# ---------------------------------------------------------------------------
# Saving and loading


def test_subword_vocab_round_trips_through_a_json_file(bpe, tmp_path):
    path = tmp_path / "bpe.json"
    runs.save_vocab(bpe, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe.json"]  # no temp file
    loaded = runs.load_vocab(path)
    assert loaded.to_json() == bpe.to_json()
    assert loaded.get_itos() == bpe.get_itos()
    text = "Zwei Männer stehen am Ufer."
    assert loaded.encode(text) == bpe.encode(text)
    assert runs.subword_vocab_from_json(bpe.to_json()).encode(text) == bpe.encode(text)


@pytest.mark.parametrize("text", ["not json", '{"model": {"type": "BPE"}}'])
def test_loading_a_file_that_is_not_a_saved_subword_vocab_raises_data_error(
    tmp_path, text
):
    path = tmp_path / "bpe.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(tat.DataError, match="bpe.json"):
        runs.load_vocab(path)
    with pytest.raises(tat.DataError, match="missing.json"):
        runs.load_vocab(tmp_path / "missing.json")


def test_a_tokenizer_without_the_specials_first_is_rejected(train_pairs):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False)
    tokenizer.train_from_iterator(texts_of(train_pairs[:50]), trainer)
    with pytest.raises(ValueError, match="specials"):
        tat.SubwordVocab(tokenizer)


# ---------------------------------------------------------------------------
# One matrix for both embeddings and the generator


def test_shared_embeddings_make_three_matrices_one_tensor_saving_2_v_d_parameters(
    bpe,
):
    v, d = len(bpe), SMALL["d_model"]
    separate = tat.make_model(v, v, **SMALL)
    shared = tat.make_model(v, v, **SMALL, share_embeddings=True, tie_generator=True)
    matrices = (
        shared.src_embed[0].lut.weight,
        shared.tgt_embed[0].lut.weight,
        shared.generator.proj.weight,
    )
    assert len({m.data_ptr() for m in matrices}) == 1
    assert all(m is matrices[0] for m in matrices)
    assert matrices[0].shape == (v, d)
    apart = (
        separate.src_embed[0].lut.weight,
        separate.tgt_embed[0].lut.weight,
        separate.generator.proj.weight,
    )
    assert len({m.data_ptr() for m in apart}) == 3
    saved = tat.count_parameters(separate) - tat.count_parameters(shared)
    assert saved == 2 * v * d


def test_the_books_parameter_saving_cell_checks_2_v_d(capsys):
    config = tat.TrainConfig(**tat.PROFILES["smoke"])
    assert tat.example_shared_embeddings(500, config) == 2 * 500 * config.d_model
    # As the notebook calls it: the quick profile's sizes.
    quick = tat.TrainConfig(**tat.PROFILES["quick"])
    assert tat.example_shared_embeddings(500) == 2 * 500 * quick.d_model
    assert f"(2 x 500 x {quick.d_model})" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# Configuration


def test_word_vocabularies_without_sharing_stay_the_default():
    config = tat.TrainConfig()
    assert (config.vocab, config.bpe_vocab_size) == ("word", 8000)
    assert not config.share_embeddings and not config.tie_generator
    for profile in runs.TRAIN_PROFILES:
        assert runs.RunConfig.from_profile(profile).vocab == "word"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"share_embeddings": True}, "vocab='bpe'"),
        ({"vocab": "chars"}, "'word' or 'bpe'"),
        ({"vocab": "bpe", "bpe_vocab_size": 100}, "at least 260"),
        ({"bpe_vocab_size": 0}, "bpe_vocab_size"),
    ],
)
def test_train_config_rejects_bad_subword_settings_with_a_clear_message(
    overrides, message
):
    with pytest.raises(ValueError, match=message):
        runs.RunConfig.from_profile("smoke", **overrides)


def test_a_word_vocabulary_may_still_tie_the_generator_to_the_target_embedding():
    config = runs.RunConfig.from_profile("smoke", tie_generator=True)
    assert config.tie_generator and config.vocab == "word"


def old_style_config():
    """A config dict as saved before the subword fields existed."""
    values = runs.RunConfig.from_profile("smoke").to_dict()
    for name in NEW_FIELDS:
        del values[name]
    return values


def test_old_config_dicts_without_the_subword_fields_load_with_the_defaults():
    config = runs.RunConfig.from_dict(old_style_config())
    assert config == runs.RunConfig.from_profile("smoke")
    assert config.vocab == "word" and not config.share_embeddings


def test_an_old_style_word_checkpoint_still_rebuilds_its_model(tmp_path):
    itos = [*tat.SPECIALS, "a", "dog"]
    torch.manual_seed(0)
    model = tat.make_model(len(itos), len(itos), N=1, d_model=32, d_ff=64, h=2)
    path = tmp_path / "old.pt"
    runs.save_checkpoint(
        path,
        {
            "model": runs._weights_only(model.state_dict()),
            "config": old_style_config(),
            "epoch": 0,
            "vocab_src": itos,
            "vocab_tgt": itos,
        },
    )
    rebuilt, vocab_src, vocab_tgt, config = runs.model_from_checkpoint(
        runs.load_checkpoint(path)
    )
    assert isinstance(vocab_src, tat.Vocab) and vocab_src.get_itos() == itos
    assert vocab_tgt is not vocab_src and config.vocab == "word"
    projection = rebuilt.generator.proj.weight
    assert torch.equal(projection, model.generator.proj.weight)
    assert projection.data_ptr() != rebuilt.tgt_embed[0].lut.weight.data_ptr()


def test_a_bpe_checkpoint_without_its_vocabulary_raises_data_error():
    config = runs.RunConfig.from_profile("smoke", vocab="bpe").to_dict()
    with pytest.raises(tat.DataError, match="'bpe'"):
        runs.vocabs_from_checkpoint({"config": config, "vocab_src": [], "model": {}})


# ---------------------------------------------------------------------------
# Training and translating end to end


def bpe_smoke_config(**overrides):
    settings = dict(
        vocab="bpe",
        bpe_vocab_size=1000,
        share_embeddings=True,
        tie_generator=True,
        max_train_pairs=300,
        keep_checkpoints=1,
    )
    return runs.RunConfig.from_profile("smoke", **{**settings, **overrides})


@pytest.fixture(scope="module")
def bpe_run(multi30k_dir, tmp_path_factory):
    """A one-epoch smoke-profile run with the joint vocabulary and tied matrices."""
    out = tmp_path_factory.mktemp("bpe_run")
    history = runs.train_model(bpe_smoke_config(), multi30k_dir, out, quiet=True)
    return SimpleNamespace(out=out, history=history)


def test_a_bpe_run_saves_its_vocabulary_in_the_checkpoint_and_as_json(bpe_run):
    assert sorted(p.name for p in bpe_run.out.iterdir()) == [
        "bpe.json",
        "epoch_001.pt",
        "last.pt",
    ]
    last = torch.load(bpe_run.out / "last.pt", map_location="cpu", weights_only=True)
    assert last["config"] == bpe_smoke_config().to_dict()
    assert isinstance(last["bpe"], str)
    vocab = runs.load_vocab(bpe_run.out / "bpe.json")
    assert vocab.to_json() == last["bpe"]
    assert last["vocab_src"] == last["vocab_tgt"] == vocab.get_itos()
    assert len(vocab) <= 1000
    epoch = torch.load(bpe_run.out / "epoch_001.pt", weights_only=True)
    assert epoch["bpe"] == last["bpe"]


def test_a_bpe_checkpoint_rebuilds_a_model_with_one_shared_matrix(bpe_run):
    checkpoint = runs.load_checkpoint(bpe_run.out / "epoch_001.pt")
    model, vocab_src, vocab_tgt, config = runs.model_from_checkpoint(checkpoint)
    assert isinstance(vocab_src, tat.SubwordVocab) and vocab_tgt is vocab_src
    assert config.share_embeddings and config.tie_generator
    lut = model.src_embed[0].lut.weight
    assert lut.data_ptr() == model.tgt_embed[0].lut.weight.data_ptr()
    assert lut.data_ptr() == model.generator.proj.weight.data_ptr()
    assert lut.shape[0] == len(vocab_src)
    weights = model.state_dict()
    for name, tensor in checkpoint["model"].items():
        assert torch.equal(weights[name], tensor), name


def test_a_translator_from_a_bpe_checkpoint_returns_plain_text(bpe_run):
    translator = runs.load_translator(bpe_run.out / "last.pt", device="cpu")
    vocab = translator.vocab_src
    assert translator.encode(["Ein Hund läuft."]) == [
        [tat.BOS, *vocab.encode("Ein Hund läuft."), tat.EOS]
    ]
    assert translator.spacy_de is None  # subwords need no spaCy tokenizer
    outputs = translator.translate(["Ein Hund läuft."])
    assert len(outputs) == 1 and isinstance(outputs[0], str)
    assert not any(marker in outputs[0] for marker in MARKERS)
    assert outputs[0] == outputs[0].strip()
    tokens = vocab.lookup_tokens(vocab.encode("A dog runs."))
    assert any("Ġ" in token for token in tokens)
    assert translator.detokenize(tokens) == "A dog runs."


def test_a_bpe_run_resumes_with_the_vocabulary_it_saved(
    bpe_run, multi30k_dir, tmp_path
):
    shutil.copytree(bpe_run.out, tmp_path, dirs_exist_ok=True)
    before = (tmp_path / "bpe.json").read_text(encoding="utf-8")
    history = runs.train_model(
        bpe_smoke_config(epochs=2), multi30k_dir, tmp_path, resume=True, quiet=True
    )
    assert [r["epoch"] for r in history] == [1, 2]
    assert history[0] == bpe_run.history[0]
    assert (tmp_path / "bpe.json").read_text(encoding="utf-8") == before
    assert runs.load_checkpoint(tmp_path / "last.pt")["bpe"] == before


# ---------------------------------------------------------------------------
# The command line


def test_train_command_passes_vocab_size_and_sharing_to_the_config(
    monkeypatch, tmp_path
):
    calls = []
    monkeypatch.setattr(
        cli, "train_model", lambda config, *args, **kwargs: calls.append(config)
    )
    argv = ["train", "--data-dir", str(tmp_path), "--out", str(tmp_path)]
    argv += ["--profile", "smoke", "--vocab", "bpe", "--bpe-vocab-size", "2000"]
    assert cli.main([*argv, "--share-embeddings"]) == 0
    assert cli.main(argv) == 0
    shared, unshared = calls
    assert (shared.vocab, shared.bpe_vocab_size) == ("bpe", 2000)
    assert shared.share_embeddings and shared.tie_generator
    assert unshared.vocab == "bpe" and not unshared.share_embeddings


def test_train_command_sharing_embeddings_of_word_vocabularies_returns_2(
    tmp_path, capsys
):
    argv = ["train", "--data-dir", str(tmp_path), "--out", str(tmp_path)]
    assert cli.main([*argv, "--share-embeddings"]) == 2
    assert "vocab='bpe'" in capsys.readouterr().err
