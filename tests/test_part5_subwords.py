"""Tests for the book's subword vocabularies shared by both languages (Part 5).

A joint byte-level BPE vocabulary learned from the training split, its use in Part 3's
pipeline (data, encoding), and one matrix for both embeddings and the generator. The
workshop's side (a run's subword data, vocabulary files, settings, checkpoints, runs
end to end, the command-line switches) is tested in tests/test_workshop_settings.py,
tests/test_workshop_training.py and tests/test_cli.py. Like Part 3's tests, they find
Multi30k through $ANNOTATED_TRANSFORMER_DATA: skipped on a laptop without it, failing
in CI.
"""

import unicodedata

import pytest
from conftest import texts_of

import the_annotated_transformer as tat

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

SMALL = dict(N=1, d_model=32, d_ff=64, h=2, dropout=0.0)


# ---------------------------------------------------------------------------
# Learning the vocabulary


def test_subword_vocab_puts_the_four_specials_first_with_the_books_ids(bpe):
    assert bpe.lookup_tokens(range(4)) == list(tat.SPECIALS)
    assert [bpe[t] for t in tat.SPECIALS] == [tat.BOS, tat.EOS, tat.PAD, tat.UNK]
    assert len(bpe) == 8000 == len(bpe.get_itos()) == len(set(bpe.get_itos()))


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
# A tokenizer of one's own


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
    saved = 2 * 500 * quick.d_model
    assert f"saved: {saved:,}; 2 x 500 x {quick.d_model} = {saved:,}" in (
        capsys.readouterr().out
    )
