"""Tests for the book's subword vocabularies shared by both languages (Part 4).

A joint byte-level BPE vocabulary learned from the training split, its use in Part 3's
pipeline (data, encoding), and one matrix for both embeddings and the generator. The
workshop's side (a run's subword data, vocabulary files, settings, checkpoints, runs
end to end, the command-line switches) is tested in tests/test_workshop_settings.py,
tests/test_workshop_training.py and tests/test_cli.py. Like Part 3's tests, they find
Multi30k through $ANNOTATED_TRANSFORMER_DATA: skipped on a laptop without it, failing
in CI.
"""

import unicodedata
from pathlib import Path

import pytest
import torch
from conftest import texts_of

import the_annotated_transformer as tat
from workshop.run import settings

BOOK = Path(__file__).resolve().parent.parent / "the_annotated_transformer.py"

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

SMALL = dict(N=1, d_model=32, d_ff=64, h=2, dropout=0.0)


# ---------------------------------------------------------------------------
# Learning the vocabulary


@pytest.mark.slow
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
    # All 740 here; a byte-level BPE may also learn pieces that end inside a
    # character, which a tenth allows, while the check below still covers the rest.
    assert len(whole) > 0.9 * len(learned)
    assert all(piece in slice_text for piece in whole)
    # Text from further on in the split is not in the slice's vocabulary.
    later = "\n".join(texts_of(train_pairs[300:]))
    assert "Zimmermann" in later and "Zimmermann" not in slice_text
    assert len(vocab.encode("Zimmermann")) > 1


@pytest.mark.slow
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
    # As the notebook calls it: the multi30k profile's sizes, d_model 256.
    assert tat.example_shared_embeddings(500) == 2 * 500 * 256
    saved = 2 * 500 * 256
    assert f"saved: {saved:,}; 2 x 500 x 256 = {saved:,}" in capsys.readouterr().out


def test_tying_alone_takes_the_multi30k_model_from_10_1_to_6_0_million(capsys):
    """Part 5 says tying takes the multi30k run's model (8,000 subwords) from 10.1 M
    parameters to 6.0 M, and docs/results.md that the earlier recipe's model, on
    word vocabularies of 8,012 German and 6,190 English words, had 9.2 M: count
    them, with the sizes of the workshop's multi30k profile."""
    run = settings.TRAIN_PROFILES["multi30k"]
    sizes = {k: run[k] for k in ("N", "d_model", "d_ff", "h")}
    config = tat.TrainConfig(**sizes)
    assert config == tat.TrainConfig(d_model=256)  # what the book's cell counts
    tied = dict(share_embeddings=True, tie_generator=True)
    with torch.device("meta"):
        untied = tat.count_parameters(config.make_model(8000, 8000))
        one_matrix = tat.count_parameters(config.make_model(8000, 8000, **tied))
        words = tat.count_parameters(config.make_model(8012, 6190))
    millions = [f"{n / 1e6:.1f} M" for n in (untied, one_matrix, words)]
    assert millions == ["10.1 M", "6.0 M", "9.2 M"]
    book = BOOK.read_text(encoding="utf-8")
    assert "from 10.1 M parameters to 6.0 M" in book
    results = (BOOK.parent / "docs" / "results.md").read_text(encoding="utf-8")
    assert "10.1 M" in results and "9.2 M" in results
    tat.example_shared_embeddings()
    shown = f"{untied:,} parameters with three matrices, {one_matrix:,} with one"
    assert shown in capsys.readouterr().out


# ---------------------------------------------------------------------------
# How the shared matrix starts

# The standard deviation of 4,000 x 32 draws estimates its own value to about
# 1/sqrt(2 * 128,000) = 0.2 % (one standard error, for normal draws; less for
# Glorot's uniform ones): 4 standard errors, which chance exceeds about 6 times in
# 100,000.
STD_RTOL = 4 / (2 * 4000 * SMALL["d_model"]) ** 0.5


def embedding_std(model):
    """The standard deviation of each distinct embedding matrix's entries."""
    luts = model.src_embed[0].lut.weight, model.tgt_embed[0].lut.weight
    return [w.std().item() for w in {id(w): w for w in luts}.values()]


@pytest.mark.parametrize(
    "tying",
    [dict(share_embeddings=True, tie_generator=True), dict(tie_generator=True)],
    ids=["all three", "generator only"],
)
def test_tied_embeddings_start_from_a_normal_of_variance_1_over_d_model(tying):
    """With a matrix tied, make_model draws the embeddings from N(0, 1/d_model), so
    that each starts at about unit size after the sqrt(d_model) scale (each to
    STD_RTOL). Glorot's spread for a 4,000 x 32 matrix is sqrt(2 / 4,032) = 0.022,
    an eighth of 32 ** -0.5 = 0.177."""
    torch.manual_seed(0)
    d = SMALL["d_model"]
    model = tat.make_model(4000, 4000, **SMALL, **tying)
    stds = embedding_std(model)
    assert stds == pytest.approx([d**-0.5] * len(stds), rel=STD_RTOL)
    scaled = model.src_embed[0](torch.arange(4000))
    assert scaled.std().item() == pytest.approx(1.0, rel=STD_RTOL)
    glorot = tat.make_model(4000, 4000, **SMALL, **tying, embedding_init="glorot")
    stds = embedding_std(glorot)
    assert stds == pytest.approx([(2 / (4000 + d)) ** 0.5] * len(stds), rel=STD_RTOL)


def test_untied_embeddings_keep_the_original_notebooks_glorot_start():
    """No matrix shared: every matrix from Glorot, as the 2018/2022 notebook drew
    them, the embeddings included (to STD_RTOL, as above)."""
    torch.manual_seed(0)
    d = SMALL["d_model"]
    model = tat.make_model(4000, 4000, **SMALL)
    assert embedding_std(model) == pytest.approx(
        [(2 / (4000 + d)) ** 0.5] * 2, rel=STD_RTOL
    )
    normal = tat.make_model(4000, 4000, **SMALL, embedding_init="normal")
    assert embedding_std(normal) == pytest.approx([d**-0.5] * 2, rel=STD_RTOL)


def test_the_books_embedding_start_cell_prints_both_starts(capsys):
    torch.manual_seed(0)  # two decimals of a 128,000-sample estimate: fixed draws
    tat.example_embedding_start(vocab_size=2000, d_model=64)
    printed = capsys.readouterr().out
    glorot = (2 / 2064) ** 0.5 * 64**0.5  # Glorot's spread, times sqrt(d_model)
    assert (
        f"glorot start: scaled embeddings have standard deviation {glorot:.2f}"
        in printed
    )
    assert "normal start: scaled embeddings have standard deviation 1.00" in printed
    assert "positional codes: root mean square 0.71" in printed  # sqrt(1/2)


def test_make_model_refuses_an_unknown_embedding_start_in_one_line():
    with pytest.raises(ValueError, match="embedding_init must be 'glorot' or 'normal'"):
        tat.make_model(11, 11, **SMALL, embedding_init="xavier")
