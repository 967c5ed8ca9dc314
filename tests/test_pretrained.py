"""Tests for "The same classes, trained by others": Part 1's classes running a Marian
model (OPUS-MT's architecture), checked against Hugging Face transformers' own
MarianMTModel and MarianTokenizer. Offline: the models are small and random, the
SentencePiece model is trained here on a few sentences, and the hub is never asked
(tests/conftest.py sets HF_HUB_OFFLINE and an empty cache)."""

import io
import json
import shutil
import sys

import pytest
import sentencepiece
import torch
from tolerance import rounding_tolerance
from transformers import MarianConfig, MarianMTModel, MarianTokenizer

import the_annotated_transformer as tat
from workshop import cli

pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")

# The float64 logits' steps: a sum of n terms in another order moves by n roundings;
# the longest sums are the feed-forward layer's d_ff terms, and a logit has passed
# 2 sub-layers per encoder layer, 3 per decoder layer and the output layer, with
# every LayerNorm bringing values back to about unit size.
N, D_FF = tat.TINY_MARIAN["encoder_layers"], tat.TINY_MARIAN["encoder_ffn_dim"]
LOGIT_STEPS = (5 * N + 1) * D_FF
PAD = tat.TINY_MARIAN["pad_token_id"]
SOURCES = torch.tensor([[5, 6, 7, 8, 9, 0], [10, 11, 12, 0, PAD, PAD]])  # 0: </s>
# Greedy, and never <pad>, as OPUS-MT's generation_config.json says.
GREEDY = dict(num_beams=1, do_sample=False, forced_eos_token_id=None)
SENTENCES = ["Ein Mann fährt mit dem Fahrrad durch die Stadt.", "Zwei Kinder spielen."]
SENTENCES += ["A man rides a bicycle through the city.", "Two children play."]


def random_marian(seed=0, **changes):
    """A random MarianMTModel (float32, eval) of TINY_MARIAN's sizes and `changes`,
    its weights but the sinusoid tables scaled up from transformers' init (normal,
    std 0.02) so that the logits are of order 1 to 10 and greedy decoding's choices
    are not near-ties that rounding alone could flip."""
    torch.manual_seed(seed)
    model = MarianMTModel(MarianConfig(**(tat.TINY_MARIAN | changes))).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            weight.mul_(1 if "embed_positions" in name else 3)
    return model


def twins(tables=True, seed=0):
    """A random Marian model and make_model holding its weights, in float64, with
    the Marian id -> book id table. tables=False: the book's model keeps its own
    positional tables (as from saved files, which hold none), and Marian's model is
    given the same table in its own feature order."""
    theirs = random_marian(seed)
    weights, config = theirs.state_dict(), theirs.config.to_dict()
    if not tables:
        weights = {k: v for k, v in weights.items() if "embed_positions" not in k}
    order = tat.marian_order(config)
    ours = tat.from_marian(weights, config, order).double()
    P = torch.arange(config["d_model"]).view(2, -1).t().flatten()
    for side in [] if tables else (theirs.model.encoder, theirs.model.decoder):
        side.embed_positions.weight.data[:, P] = ours.src_embed[1].pe[0].float()
    return theirs.double(), ours, tat.marian_ids(order)


def logit_gap(theirs, ours, ours_of):
    """The largest |difference| of the two models' logits on a padded batch
    (Marian's id order; <pad>'s column left out, as the book's model never gives
    it), and its float64 tolerance."""
    tgt = torch.tensor([[PAD, 13, 14, 15], [PAD, 16, 17, 18]])  # from <pad>: start
    mask, keep = SOURCES != PAD, torch.arange(theirs.config.vocab_size) != PAD
    with torch.no_grad():
        logits = theirs(SOURCES, mask, decoder_input_ids=tgt).logits[..., keep]
        memory = ours.encode(ours_of[SOURCES], mask.unsqueeze(1))
        future = tat.subsequent_mask(tgt.size(1))
        hidden = ours.decode(memory, mask.unsqueeze(1), ours_of[tgt], future)
        mine = ours.generator.proj(hidden)[..., ours_of][..., keep]
    assert logits.abs().max() > 1  # the comparison is not one of tiny numbers
    tolerance = rounding_tolerance(LOGIT_STEPS, logits.abs().max(), torch.double)
    return (mine - logits).abs().max(), tolerance


@pytest.mark.parametrize("tables", [True, False], ids=["marians tables", "the books"])
def test_the_books_model_gives_marians_logits_to_float64_rounding(tables):
    theirs, ours, ours_of = twins(tables)
    gap, tolerance = logit_gap(theirs, ours, ours_of)
    assert gap <= tolerance
    with torch.no_grad():  # the control: one weight of ours moved by 1e-6
        ours.encoder.layers[0].feed_forward.w_1.weight[0, 0] += 1e-6
    gap, tolerance = logit_gap(theirs, ours, ours_of)
    assert gap > 100 * tolerance


def test_with_the_books_own_sinusoids_the_features_must_be_reordered(monkeypatch):
    """The control of the test above: loaded without reordering the features,
    the book's interleaved table meets weights in Marian's order."""
    monkeypatch.setattr(tat, "marian_layout", lambda name, weight, d_model: weight)
    gap, tolerance = logit_gap(*twins(tables=False))
    assert gap > 100 * tolerance


def test_the_books_sinusoids_reordered_are_marians_to_float32_rounding():
    theirs = random_marian()
    d, length = theirs.config.d_model, theirs.config.max_position_embeddings
    P = torch.arange(d).view(2, -1).t().flatten()
    ours = tat.PositionalEncoding(d, 0.0, max_len=length).pe[0]
    marian = theirs.model.encoder.embed_positions.weight
    # Marian rounds its float64 table to float32 once; the book's angle pos * w is
    # off by about 3 pos roundings (w to a few, the product one more) and its sine
    # by one more: (3 pos + 2) u in all, within 2 pos + 1 steps counted twice.
    tolerance = rounding_tolerance(2 * (length - 1) + 1, 1.0)
    assert (ours - marian[:, P]).abs().max() <= tolerance
    assert (ours - marian).abs().max() > 0.5  # not reordered: another table


def test_the_books_own_parity_check_finds_the_same_logits_and_words():
    gap, same_words = tat.marian_parity(seed=2)  # unscaled: its logits are below 10
    assert gap <= rounding_tolerance(LOGIT_STEPS, 10, torch.double) and same_words


# ---------------------------------------------------------------------------
# A folder of a model's files, as OPUS-MT ships them


@pytest.fixture(scope="module")
def marian_folder(tmp_path_factory):
    """A folder as OPUS-MT ships one (config.json, vocab.json, source.spm,
    target.spm, model.safetensors), of a random Marian model whose SentencePiece
    model is trained here; returns (folder, the MarianMTModel)."""
    folder, spm = tmp_path_factory.mktemp("marian"), io.BytesIO()
    options = dict(vocab_size=60, hard_vocab_limit=False, character_coverage=1.0)
    options |= dict(bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0)
    train = sentencepiece.SentencePieceTrainer.train
    train(sentence_iterator=iter(SENTENCES * 3), model_writer=spm, **options)
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


def test_a_folder_of_files_translates_as_transformers_does(marian_folder):
    folder, theirs = marian_folder
    tokenizer = MarianTokenizer.from_pretrained(folder)
    ours_of = tat.marian_ids(tat.marian_order(theirs.config.to_dict()))
    translator = tat.load_marian(folder, device="cpu")
    never = [[theirs.config.pad_token_id]]
    for sentence in ("Ein Mann liest ein Buch.", "Zwei Hunde spielen im Garten."):
        src = tokenizer(sentence, return_tensors="pt").input_ids
        assert translator.encode([sentence]) == [ours_of[src[0]].tolist()]
        steps = src.size(1) + 10 - 1  # decode_ids: the source's length + max_extra
        out = theirs.generate(src, max_new_tokens=steps, bad_words_ids=never, **GREEDY)
        expected = tokenizer.decode(out[0], skip_special_tokens=True)
        decode = tat.cached_greedy_decode  # greedy_decode: the parity check's
        assert translator.translate(sentence, decode=decode, max_extra=10) == [expected]
    for sentence in SENTENCES:  # SentencePiece's pieces give each sentence back
        ids = translator.vocab_src.encode(sentence)
        tokens = translator.vocab_src.lookup_tokens(ids)
        assert tat.UNK not in ids
        assert translator.vocab_src.detokenize(tokens) == sentence


def test_weights_in_pytorch_model_bin_load_as_safetensors_do(marian_folder, tmp_path):
    folder, theirs = marian_folder
    other = shutil.copytree(folder, tmp_path / "bin")
    (other / "model.safetensors").unlink()
    torch.save(theirs.state_dict(), other / "pytorch_model.bin")
    a, b = (tat.load_marian(f, "cpu").model.state_dict() for f in (folder, other))
    for name, x in a.items():  # the .bin holds the positional tables too
        assert torch.equal(x, b[name]) or name.endswith(".pe")


def with_config(folder, tmp_path, **changes):
    """A copy of the model folder with config.json changed."""
    other = shutil.copytree(folder, tmp_path / "changed")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | changes))
    return other


CANNOT_LOAD = [  # (config.json's change, or the file or package gone; the error)
    (dict(activation_function="tanh"), ValueError, "activation_function is 'tanh'"),
    (dict(model_type="bart"), ValueError, "model_type is 'bart'"),
    (dict(normalize_before=True), ValueError, "normalize_before is True"),  # pre-norm
    (dict(share_encoder_decoder_embeddings=False), ValueError, "share_encoder_decoder"),
    (dict(decoder_layers=3), ValueError, "encoder_layers 2 and decoder_layers 3 "),
    (dict(d_model=None), ValueError, "config.json has no d_model"),
    (dict(encoder_ffn_dim=64, decoder_ffn_dim=64), ValueError, "Marian model's weig"),
    ("source.spm", FileNotFoundError, "has no source.spm: a model's folder holds"),
    ("vocab.json", FileNotFoundError, "has no vocab.json: a model's folder holds"),
    ("model.safetensors", FileNotFoundError, "has no model.safetensors: a model's"),
    ("sentencepiece", ImportError, "needs sentencepiece: pip install"),
    (tat.OPUS_MT, OSError, "no connection, and it is not in the cache.*name a folder"),
]


@pytest.mark.parametrize("change, error, said", CANNOT_LOAD)
def test_a_model_it_cannot_load_is_refused_in_one_line_saying_why(
    marian_folder, tmp_path, monkeypatch, change, error, said
):
    """Another architecture (the config or the weights' sizes), a file missing, an
    optional package missing, a hub name without a connection."""
    changes = change if isinstance(change, dict) else {}
    folder = with_config(marian_folder[0], tmp_path, **changes)
    if change == "sentencepiece":
        monkeypatch.setitem(sys.modules, change, None)  # its import fails
    elif change == tat.OPUS_MT:
        folder = change
    elif isinstance(change, str):
        (folder / change).unlink()
    with pytest.raises(error, match=said) as raised:
        tat.load_marian(folder, device="cpu")
    assert "\n" not in str(raised.value)


# ---------------------------------------------------------------------------
# The command line's --pretrained


def run_cli(capsys, *args):
    """`python -m workshop ARGS` run by its main here: (status, stdout, stderr)."""
    status = cli.main(list(args))
    printed = capsys.readouterr()
    return status, printed.out, printed.err


def test_evaluate_with_pretrained_scores_a_split(marian_folder, mini_split, capsys):
    argv = ["evaluate", "--pretrained", str(marian_folder[0]), "--device", "cpu"]
    argv += ["--data-dir", str(mini_split[0]), "--split", "mini"]
    status, out, _ = run_cli(capsys, *argv)
    assert status == 0 and "20 sentences translated (greedy)" in out
    assert "sacreBLEU: BLEU = " in out


@pytest.mark.parametrize(
    "status, said", [(0, ""), (1, "has no config.json"), (2, "activation_function")]
)
def test_translate_pretrained_prints_the_translations_or_one_line_why_not(
    marian_folder, tmp_path, capsys, status, said
):
    """A folder of the model's files (its options, --beam and others, work as with
    --checkpoint: tests/test_workshop_cli.py), one without config.json (exit 1), one of
    another architecture (exit 2)."""
    tanh = with_config(marian_folder[0], tmp_path, activation_function="tanh")
    folder = str([marian_folder[0], tmp_path, tanh][status])  # tmp_path: no config
    sentences = ["Ein Mann liest.", "Zwei Kinder spielen."]
    code, out, err = run_cli(capsys, "translate", "--pretrained", folder, *sentences)
    translator = tat.load_marian(marian_folder[0], "cpu")
    translated = translator.translate(sentences) if status == 0 else []
    assert code == status and out.splitlines() == translated
    assert status == 0 or (len(err.strip().splitlines()) == 1 and said in err)
