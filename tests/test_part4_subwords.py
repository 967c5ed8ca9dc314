"""Tests for the book's subword vocabularies shared by both languages (Part 4).

A joint byte-level BPE vocabulary learned from the training split, its use in Part 3's
pipeline, one matrix for both embeddings and the generator, and how that matrix
starts. The workshop's side is tested in the tests/test_workshop_*.py files. Like
Part 3's tests, they find Multi30k through $ANNOTATED_TRANSFORMER_DATA: skipped on a
laptop without it, failing in CI.
"""

import unicodedata
from pathlib import Path

import pytest
import torch
from conftest import texts_of
from tokenizers import Tokenizer, models

import the_annotated_transformer as tat
from workshop.run import settings

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(N=1, d_model=32, d_ff=64, h=2, dropout=0.0)
TIED = dict(share_embeddings=True, tie_generator=True)
BOS, EOS, PAD, UNK = tat.BOS, tat.EOS, tat.PAD, tat.UNK

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_each_learned_token_is_a_piece_of_the_training_text(train_pairs):
    text = "\n".join(texts_of(train_pairs[:300]))
    vocab = tat.SubwordVocab.build(texts_of(train_pairs[:300]), 1000)
    learned = [vocab.decode([i]) for i in range(4 + 256, len(vocab))]
    whole = [piece for piece in learned if "\ufffd" not in piece]  # not part-UTF-8
    # All 740 here; a byte-level BPE may also learn pieces that end inside a
    # character, which a tenth allows, while the check below covers the rest.
    assert len(learned) > 500 and len(whole) > 0.9 * len(learned)
    assert all(piece in text for piece in whole)
    # A word from further on in the split is not in the slice's vocabulary.
    assert "Zimmermann" not in text and len(vocab.encode("Zimmermann")) > 1


def test_decoding_the_encoding_gives_back_the_nfc_text_without_unk(bpe, multi30k_dir):
    """The first 200 validation sentences, characters never seen in training (spelled
    out as their UTF-8 bytes), a decomposed letter, whitespace; the specials first."""
    texts = texts_of(tat.read_split(multi30k_dir, "val")[:200])
    texts += ["Ωmega: ein naïver Hund 🐕 läuft — schnell!", "Ma\u0308dchen", " a  b\tc"]
    for text in texts:
        ids = bpe.encode(text)
        assert UNK not in ids and bpe.decode(ids) == unicodedata.normalize("NFC", text)
    assert len(bpe.encode("🐕")) == 4 and bpe.decode(bpe.encode(texts[-2])) == "Mädchen"
    assert bpe.lookup_tokens(range(4)) == list(tat.SPECIALS) == bpe.get_itos()[:4]
    assert [bpe[t] for t in tat.SPECIALS] == [BOS, EOS, PAD, UNK]
    assert len(bpe) == 8000 == len(set(bpe.get_itos()))
    # Frequent training words are single tokens (words unseen in training cannot be:
    # every learned token is a piece of the training text, as the first test shows).
    assert all(len(bpe.encode(w)) == 1 for w in (" Hund", " dog", " Mann", " man"))


def test_pieces_show_the_cut_and_decode_and_detokenize_leave_out_the_specials(bpe):
    pieces, ids = bpe.pieces("Ein Hund läuft."), bpe.encode("A dog runs.")
    assert "".join(pieces) == "Ein Hund läuft." and " Hund" in pieces
    assert bpe.decode([BOS, *ids, PAD, EOS]) == "A dog runs."
    assert bpe.detokenize(bpe.lookup_tokens([*ids, UNK])) == "A dog runs."


def test_a_tokenizer_without_the_specials_first_is_rejected():
    words = {token: i for i, token in enumerate(["Hund", *tat.SPECIALS])}
    with pytest.raises(ValueError, match="specials"):
        tat.SubwordVocab(Tokenizer(models.WordLevel(words, unk_token="<unk>")))


# ---------------------------------------------------------------------------
# One matrix for both embeddings and the generator


def test_shared_embeddings_make_three_matrices_one_tensor():
    for tying, distinct in (({}, 3), (TIED, 1)):
        model = tat.make_model(50, 50, **SMALL, **tying)
        matrices = model.src_embed[0].lut, model.tgt_embed[0].lut, model.generator.proj
        assert len({id(matrix.weight) for matrix in matrices}) == distinct


def test_tying_alone_takes_the_multi30k_model_from_10_1_to_6_0_million(capsys):
    """Part 5 says tying takes the multi30k run's model (8,000 subwords) from 10.1 M
    parameters to 6.0 M, 2 x V x d_model fewer, and docs/results.md that the earlier
    recipe's model, on word vocabularies of 8,012 German and 6,190 English words,
    had 9.2 M: count them, with the sizes of the workshop's multi30k profile."""
    run = settings.TRAIN_PROFILES["multi30k"]
    config = tat.TrainConfig(**{k: run[k] for k in ("N", "d_model", "d_ff", "h")})
    assert config == tat.TrainConfig(d_model=256)  # what the book's cell counts
    with torch.device("meta"):
        sizes = [(8000, 8000, {}), (8000, 8000, TIED), (8012, 6190, {})]
        counts = [tat.count_parameters(config.make_model(*s, **t)) for *s, t in sizes]
    assert [f"{n / 1e6:.1f} M" for n in counts] == ["10.1 M", "6.0 M", "9.2 M"]
    book = (ROOT / "the_annotated_transformer.py").read_text(encoding="utf-8")
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert "from 10.1 M parameters to 6.0 M" in book
    assert "10.1 M" in results and "9.2 M" in results
    assert tat.example_shared_embeddings() == counts[0] - counts[1] == 2 * 8000 * 256
    shown = f"{counts[0]:,} parameters with three matrices, {counts[1]:,} with one"
    saved = f"saved: {2 * 8000 * 256:,}; 2 x 8,000 x 256 = {2 * 8000 * 256:,}"
    printed = capsys.readouterr().out
    assert shown in printed and saved in printed


# The standard deviation of 4,000 x 32 draws estimates its own value to about
# 1/sqrt(2 * 128,000) = 0.2 % (one standard error, for normal draws; less for
# Glorot's uniform ones): 4 standard errors, which chance exceeds about 6 times in
# 100,000.
STD_RTOL = 4 / (2 * 4000 * SMALL["d_model"]) ** 0.5
GLOROT, NORMAL = (2 / (4000 + SMALL["d_model"])) ** 0.5, SMALL["d_model"] ** -0.5


@pytest.mark.parametrize(
    "options, std",
    [
        (TIED, NORMAL),
        (dict(tie_generator=True), NORMAL),
        ({}, GLOROT),
        (dict(TIED, embedding_init="glorot"), GLOROT),
        (dict(embedding_init="normal"), NORMAL),
    ],
)
def test_tied_embeddings_start_from_n_0_1_over_d_model_untied_from_glorot(options, std):
    """With a matrix tied, make_model draws the embeddings from N(0, 1/d_model), so
    that each starts at about unit size after the sqrt(d_model) scale; untied, every
    matrix from Glorot, as the 2018/2022 notebook drew them; embedding_init chooses.
    Glorot's spread for a 4,000 x 32 matrix is an eighth of 32 ** -0.5."""
    torch.manual_seed(0)
    model = tat.make_model(4000, 4000, **SMALL, **options)
    luts = model.src_embed[0].lut.weight, model.tgt_embed[0].lut.weight
    assert [w.std().item() for w in luts] == pytest.approx([std, std], rel=STD_RTOL)


def test_the_books_embedding_start_cell_prints_both_starts(capsys):
    torch.manual_seed(0)  # two decimals of a 128,000-sample estimate: fixed draws
    tat.example_embedding_start(vocab_size=2000, d_model=64)
    glorot = (2 / 2064) ** 0.5 * 64**0.5  # Glorot's spread, times sqrt(d_model)
    printed, said = capsys.readouterr().out, "start: scaled embeddings have standard"
    assert f"glorot {said} deviation {glorot:.2f}" in printed
    assert f"normal {said} deviation 1.00" in printed
    assert "positional codes: root mean square 0.71" in printed  # sqrt(1/2)


def test_make_model_refuses_an_unknown_embedding_start_in_one_line():
    with pytest.raises(ValueError, match="embedding_init must be 'glorot' or 'normal'"):
        tat.make_model(11, 11, **SMALL, embedding_init="xavier")
