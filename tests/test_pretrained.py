"""Tests for "The same classes, trained by others": Part 1's classes running a Marian
model (OPUS-MT's architecture), checked against Hugging Face transformers' own
MarianMTModel and MarianTokenizer. Offline: the models are small and random, the
SentencePiece model is trained here on a few sentences, and the hub is never asked
(tests/conftest.py sets HF_HUB_OFFLINE and an empty cache)."""

import io
import json
import math
import shutil
import sys

import pytest
import sentencepiece
import torch
from transformers import MarianConfig, MarianMTModel, MarianTokenizer

import the_annotated_transformer as tat
from workshop import cli

# The random models' weights, but for the sinusoid tables, are scaled up from
# transformers' init (normal, std 0.02) so that the logits are of order 1 to 10 and
# greedy decoding's choices are not near-ties that rounding alone could flip.
WEIGHT_SCALE = 3.0

# The float64 tolerance, relative to the largest logit, as in
# tests/test_part1_reference.py: a sum of n terms in another order differs by at
# most about n * u times the size of its terms (u = 2^-53, Higham's gamma_n); the
# longest sums are the feed-forward layer's d_ff terms; the logits have passed 2
# sub-layers per encoder layer, 3 per decoder layer and the output layer, whose
# errors add, with every LayerNorm bringing values back to about unit size.
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")

U = torch.finfo(torch.float64).eps / 2
N, D_FF = tat.TINY_MARIAN["encoder_layers"], tat.TINY_MARIAN["encoder_ffn_dim"]
RELATIVE_TOL = (5 * N + 1) * D_FF * U
DELTA = 1e-6  # the control's change to one weight

SENTENCES = [
    "Ein Mann fährt mit dem Fahrrad durch die Stadt.",
    "Zwei Kinder spielen im Garten.",
    "Eine Frau liest ein Buch auf einer Bank.",
    "Der Hund läuft über die Wiese.",
    "A man rides a bicycle through the city.",
    "Two children play in the garden.",
]


def random_marian(seed=0, **changes):
    """A random MarianMTModel (float32, eval) of TINY_MARIAN's sizes and `changes`,
    its weights scaled by WEIGHT_SCALE."""
    torch.manual_seed(seed)
    model = MarianMTModel(MarianConfig(**(tat.TINY_MARIAN | changes))).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "embed_positions" not in name:
                weight.mul_(WEIGHT_SCALE)
    return model


def book_twin(theirs, tables=True):
    """make_model holding `theirs`' weights, its positional tables too (tables=False:
    not, as in its saved files, so the book's own are used): the book's model in
    float64 and the Marian id -> book id table."""
    config, weights = theirs.config.to_dict(), theirs.state_dict()
    if not tables:
        weights = {k: v for k, v in weights.items() if "embed_positions" not in k}
    order = tat.marian_order(config)
    ours = tat.from_marian(weights, config, order).double()
    return ours, tat.marian_ids(order)


def logits_both_ways(theirs, ours, ours_of):
    """The raw logits of both models (Marian's id order; <pad>'s column left out, as
    the book's model never gives it) on a padded batch, in float64."""
    pad = theirs.config.pad_token_id
    src = torch.tensor([[5, 6, 7, 8, 9, 0], [10, 11, 12, 0, pad, pad]])  # 0: </s>
    tgt = torch.tensor([[pad, 13, 14, 15], [pad, 16, 17, 18]])  # from <pad>: start
    mask = src != pad
    with torch.no_grad():
        out = theirs.double()(input_ids=src, attention_mask=mask, decoder_input_ids=tgt)
        memory = ours.encode(ours_of[src], mask.unsqueeze(1))
        future = tat.subsequent_mask(tgt.size(1))
        hidden = ours.decode(memory, mask.unsqueeze(1), ours_of[tgt], future)
        mine = ours.generator.proj(hidden)[..., ours_of]
    keep = torch.arange(theirs.config.vocab_size) != pad
    return mine[..., keep], out.logits[..., keep]


def test_the_books_model_gives_transformers_marian_logits_to_float64_rounding():
    theirs = random_marian()
    ours, ours_of = book_twin(theirs)
    mine, logits = logits_both_ways(theirs, ours, ours_of)
    assert logits.abs().max() > 1  # the comparison is not one of tiny numbers
    tol = RELATIVE_TOL * logits.abs().max()
    assert (mine - logits).abs().max() <= tol
    # The control: one weight of ours moved by DELTA breaks the equality.
    with torch.no_grad():
        ours.encoder.layers[0].feed_forward.w_1.weight[0, 0] += DELTA
    mine, logits = logits_both_ways(theirs, ours, ours_of)
    assert (mine - logits).abs().max() > 100 * tol


def test_with_the_books_own_sinusoids_the_features_must_be_reordered(monkeypatch):
    # The saved files hold no positional table: the book's own, interleaved, is used.
    # Its float32 rounding differs from Marian's by up to 1.2e-5 (the test below),
    # which the model amplifies; far less than leaving the features in Marian's order.
    theirs = random_marian()
    mine, logits = logits_both_ways(theirs, *book_twin(theirs, tables=False))
    assert (mine - logits).abs().max() <= 1e-3 * logits.abs().max()
    monkeypatch.setattr(tat, "marian_layout", lambda name, weight, d_model: weight)
    mine, logits = logits_both_ways(theirs, *book_twin(theirs, tables=False))
    assert (mine - logits).abs().max() > 0.1 * logits.abs().max()


def test_the_books_sinusoids_reordered_are_marians_to_float32_rounding():
    # Marian computes its table in float64 and rounds it to float32 (one rounding,
    # u32 = 2^-24); the book computes in float32: 1/10000^(2i/d) to a few roundings,
    # the angle pos * that to one more, so the angle is off by about 3 u32 * pos and
    # its sine by that plus a rounding. Hence 4 u32 * the last position, plus 2 u32.
    theirs = random_marian()
    d, length = theirs.config.d_model, theirs.config.max_position_embeddings
    P = torch.arange(d).view(2, -1).t().flatten()
    ours = tat.PositionalEncoding(d, 0.0, max_len=length).pe[0]
    marian = theirs.model.encoder.embed_positions.weight[:, P]
    u32 = torch.finfo(torch.float32).eps / 2
    assert (ours - marian).abs().max() <= 4 * u32 * (length - 1) + 2 * u32
    assert (ours - theirs.model.encoder.embed_positions.weight).abs().max() > 0.5


@pytest.mark.parametrize("decode", [tat.greedy_decode, tat.cached_greedy_decode])
def test_greedy_decoding_picks_generates_words_token_for_token(decode):
    theirs = random_marian(seed=1)
    ours, ours_of = book_twin(theirs)
    pad = theirs.config.pad_token_id
    src = torch.tensor([[5, 6, 7, 8, 9, 0], [10, 11, 12, 0, pad, pad]])
    with torch.no_grad():
        expected = theirs.double().generate(
            src,
            attention_mask=src != pad,
            num_beams=1,
            do_sample=False,
            max_new_tokens=12,
            bad_words_ids=[[pad]],  # as OPUS-MT's generation_config.json
            forced_eos_token_id=None,
        )
        mask = tat.padding_mask(src, pad)
        ids = decode(ours, ours_of[src], mask, 13, tat.BOS, end_symbol=tat.EOS)
    order = torch.tensor(tat.marian_order(theirs.config.to_dict()))
    assert torch.equal(order[ids], expected)


def test_the_books_own_parity_check_finds_the_same_logits_and_words():
    gap, same_words = tat.marian_parity(seed=2)
    assert gap <= RELATIVE_TOL * 10 and same_words  # its logits are below 10


@pytest.fixture(scope="module")
def marian_folder(tmp_path_factory):
    """A folder as OPUS-MT ships one (config.json, vocab.json, source.spm,
    target.spm, model.safetensors), of a random Marian model whose SentencePiece
    model is trained here; returns (folder, the MarianMTModel)."""
    folder = tmp_path_factory.mktemp("marian")
    spm = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES * 3),
        model_writer=spm,
        vocab_size=60,
        hard_vocab_limit=False,
        character_coverage=1.0,
        **dict(bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0),
    )
    for side in ("source", "target"):
        (folder / f"{side}.spm").write_bytes(spm.getvalue())
    pieces = sentencepiece.SentencePieceProcessor(model_proto=spm.getvalue())
    vocab = {"</s>": 0, "<unk>": 1}  # as Marian numbers them, <pad> last
    vocab |= {pieces.id_to_piece(i): i + 1 for i in range(1, pieces.get_piece_size())}
    vocab["<pad>"] = pad = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    ids = dict(vocab_size=pad + 1, pad_token_id=pad, decoder_start_token_id=pad)
    theirs = random_marian(**ids)
    theirs.save_pretrained(folder)
    return folder, theirs


def test_a_folder_of_files_translates_word_for_word_as_transformers_does(
    marian_folder,
):
    folder, theirs = marian_folder
    tokenizer = MarianTokenizer.from_pretrained(folder)
    ours_of = tat.marian_ids(tat.marian_order(theirs.config.to_dict()))
    translator = tat.load_marian(folder, device="cpu")
    pad = theirs.config.pad_token_id
    for sentence in ("Ein Mann liest ein Buch.", "Zwei Hunde spielen im Garten."):
        src = tokenizer(sentence, return_tensors="pt").input_ids
        assert translator.encode([sentence]) == [ours_of[src[0]].tolist()]
        extra = 10  # decode_ids: the source's length + max_extra positions
        with torch.no_grad():
            out = theirs.generate(
                src,
                num_beams=1,
                do_sample=False,
                max_new_tokens=src.size(1) + extra - 1,
                bad_words_ids=[[pad]],
                forced_eos_token_id=None,
            )
        expected = tokenizer.decode(out[0], skip_special_tokens=True)
        assert translator.translate(sentence, max_extra=extra) == [expected]


def test_sentencepiece_pieces_give_each_sentence_back(marian_folder):
    vocab = tat.load_marian(marian_folder[0], device="cpu").vocab_src
    for sentence in SENTENCES:
        ids = vocab.encode(sentence)
        assert tat.UNK not in ids
        assert vocab.detokenize(vocab.lookup_tokens(ids)) == sentence


def test_weights_in_pytorch_model_bin_load_as_the_safetensors_do(
    marian_folder, tmp_path
):
    folder, theirs = marian_folder
    other = tmp_path / "bin"
    shutil.copytree(folder, other)
    (other / "model.safetensors").unlink()
    torch.save(theirs.state_dict(), other / "pytorch_model.bin")
    a, b = (tat.load_marian(f, device="cpu").model for f in (folder, other))
    # the .bin holds the positional tables too; the safetensors file does not
    b = b.state_dict()
    for name, x in a.state_dict().items():
        assert torch.equal(x, b[name]) or name.endswith(".pe")


def with_config(folder, tmp_path, **changes):
    """A copy of the model folder with config.json changed."""
    other = tmp_path / "changed"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | changes))
    return other


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(activation_function="tanh"), "activation_function is 'tanh'"),
        (dict(normalize_before=True), "normalize_before is True"),
        (dict(scale_embedding=False), "scale_embedding is False"),
        (dict(share_encoder_decoder_embeddings=False), "share_encoder_decoder"),
        (dict(model_type="bart"), "model_type is 'bart'"),
        (dict(decoder_layers=3), "encoder_layers 2 and decoder_layers 3 differ"),
        (dict(d_model=None), "config.json has no d_model"),
    ],
)
def test_a_model_of_another_architecture_is_refused_in_one_line(
    marian_folder, tmp_path, changes, named
):
    folder = with_config(marian_folder[0], tmp_path, **changes)
    with pytest.raises(ValueError) as error:
        tat.load_marian(folder, device="cpu")
    assert named in str(error.value) and "\n" not in str(error.value)


def test_weights_of_other_sizes_than_the_config_says_are_refused_naming_them(
    marian_folder, tmp_path
):
    folder = with_config(marian_folder[0], tmp_path, encoder_ffn_dim=64)
    folder = with_config(folder, tmp_path / "again", decoder_ffn_dim=64)
    with pytest.raises(ValueError, match="not a Marian model's weights.*w_1"):
        tat.load_marian(folder, device="cpu")


@pytest.mark.parametrize("missing", ["source.spm", "vocab.json", "model.safetensors"])
def test_a_folder_missing_a_file_is_refused_naming_it(marian_folder, tmp_path, missing):
    folder = tmp_path / "model"
    shutil.copytree(marian_folder[0], folder)
    (folder / missing).unlink()
    with pytest.raises(FileNotFoundError, match=f"has no {missing}: a model's folder"):
        tat.load_marian(folder, device="cpu")


def test_a_hub_name_without_a_connection_is_one_line_saying_what_to_do():
    with pytest.raises(OSError) as error:
        tat.load_marian("Helsinki-NLP/opus-mt-de-en")
    message = str(error.value)
    assert "no connection, and it is not in the cache" in message
    assert "name a folder holding its files" in message and "\n" not in message


def test_a_missing_optional_package_is_named_with_how_to_install_it(
    marian_folder, monkeypatch
):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import fails
    with pytest.raises(ImportError, match="needs sentencepiece: pip install"):
        tat.load_marian(marian_folder[0], device="cpu")


@pytest.fixture
def run_cli(capsys):
    """`python -m workshop ARGS` run by its main here: (status, stdout, stderr)."""

    def run(*args):
        status = cli.main(list(args))
        printed = capsys.readouterr()
        return status, printed.out, printed.err

    return run


def test_translate_with_pretrained_prints_what_the_translator_gives(
    marian_folder, run_cli
):
    folder = str(marian_folder[0])
    translator = tat.load_marian(folder, device="cpu")
    sentences = ["Ein Mann liest.", "Zwei Kinder spielen."]
    status, out, _ = run_cli("translate", "--pretrained", folder, *sentences)
    assert status == 0
    assert out.splitlines() == translator.translate(sentences)
    beam = dict(decode=tat.beam_search, beam_size=3, alpha=0.6)
    argv = ("translate", "--pretrained", folder, "--beam", "3", *sentences)
    status, out, _ = run_cli(*argv)
    assert out.splitlines() == translator.translate(sentences, **beam)


def test_evaluate_with_pretrained_scores_the_test_split(
    marian_folder, multi30k_dir, run_cli
):
    argv = ["evaluate", "--pretrained", str(marian_folder[0]), "--device", "cpu"]
    status, out, _ = run_cli(*argv, "--data-dir", str(multi30k_dir))
    assert status == 0 and "1000 sentences translated (greedy)" in out
    assert "sacreBLEU: BLEU = " in out


@pytest.mark.parametrize(
    "changes, status, named",
    [
        (dict(activation_function="tanh"), 2, "activation_function is 'tanh'"),
        (None, 1, "has no config.json"),
    ],
)
def test_translate_with_a_model_it_cannot_run_exits_in_one_line(
    marian_folder, tmp_path, run_cli, changes, status, named
):
    if changes is None:
        folder = tmp_path
    else:
        folder = with_config(marian_folder[0], tmp_path, **changes)
    code, out, err = run_cli("translate", "--pretrained", str(folder), "Ein Mann.")
    assert code == status and not out
    assert len(err.strip().splitlines()) == 1 and named in err


def test_the_hub_unreachable_exits_1_in_one_line(run_cli):
    name = "Helsinki-NLP/opus-mt-de-en"
    code, out, err = run_cli("translate", "--pretrained", name, "Ein Mann.")
    assert code == 1 and not out and len(err.strip().splitlines()) == 1
    assert math.isfinite(code) and "no connection" in err
