"""Checkpoint and vocabulary files (workshop.run.checkpoints): vocabularies saved and
read back, checkpoints saved without the positional tables and loaded safely, the
errors of a checkpoint this code cannot use, and averaging one run's checkpoints."""

import json

import pytest
import torch
from conftest import names_in

import the_annotated_transformer as tat
from workshop.errors import DataError
from workshop.run import checkpoints
from workshop.run.settings import RunConfig
from workshop.translate import translation

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

WORDS = [*tat.SPECIALS, "a", "dog", "runs", "."]


def saved(path, seed=0, epoch=0, words=WORDS, **overrides):
    """A random smoke-profile model saved as a run saves its epoch_NNN.pt (without
    the positional tables): (model, checkpoint)."""
    config = RunConfig.from_profile("smoke", **overrides)
    torch.manual_seed(seed)
    model = config.make_model(len(words), len(words)).eval()
    weights = checkpoints.without_positional_tables(model.state_dict())
    checkpoint = dict(model=weights, config=config.to_dict(), epoch=epoch)
    checkpoint |= dict(vocab_src=words, vocab_tgt=words)
    checkpoints.save_checkpoint(path, checkpoint)
    return model, checkpoint


def test_a_word_vocabulary_is_saved_as_its_tokens_in_utf8_json(tmp_path):
    vocab = tat.Vocab.build([["Männer", "Ufer", "Männer", "Ufer", "."]] * 2)
    checkpoints.save_vocab(vocab, tmp_path / "vocab.json")
    text = (tmp_path / "vocab.json").read_text(encoding="utf-8")
    assert json.loads(text) == {"itos": vocab.itos} and "Männer" in text
    assert names_in(tmp_path) == ["vocab.json"]  # no temporary file left


def test_a_subword_checkpoint_rebuilds_its_vocabulary_and_one_shared_matrix(tmp_path):
    """Its vocabulary, saved as the tokenizer's JSON, comes back as one for both
    sides; its one matrix as the embeddings and the generator; its positional
    tables, which it does not hold, from its sizes: the saving model's outputs, bit
    for bit. The translator it makes answers plain text, without subword markers."""
    bpe = tat.SubwordVocab.build(["Zwei Männer stehen am Ufer.", "A dog runs."], 300)
    checkpoints.save_vocab(bpe, tmp_path / "bpe.json")
    config = dict(vocab="bpe", share_embeddings=True, tie_generator=True)
    saving, checkpoint = saved(tmp_path / "bpe.pt", words=bpe.get_itos(), **config)
    assert not [name for name in checkpoint["model"] if name.endswith(".pe")]
    checkpoint["bpe"] = (tmp_path / "bpe.json").read_text(encoding="utf-8")
    checkpoints.save_checkpoint(tmp_path / "bpe.pt", checkpoint)
    loaded = checkpoints.load_checkpoint(tmp_path / "bpe.pt")
    model, src, tgt, _ = checkpoints.model_from_checkpoint(loaded)
    ids = torch.tensor([[tat.BOS, *bpe.encode("Männer am Ufer."), tat.EOS]])
    assert src is tgt and src.encode("Männer am Ufer.") == ids[0, 1:-1].tolist()
    lut = model.src_embed[0].lut.weight
    assert lut is model.tgt_embed[0].lut.weight is model.generator.proj.weight
    masks = tat.padding_mask(ids, tat.PAD), tat.subsequent_mask(ids.shape[1])
    with torch.no_grad():  # the same weights and the same arithmetic: equal bits
        assert torch.equal(model(ids, ids, *masks), saving(ids, ids, *masks))
    translator = translation.load_translator(tmp_path / "bpe.pt", device="cpu")
    (output,) = translator.translate(["Ein Hund läuft."])
    assert translator.spacy_de is None and output == output.strip()
    assert not any(mark in output for mark in ("Ġ", "▁", "<s>", "</s>", "<unk>"))


@pytest.mark.parametrize(
    "write, error, message",
    [
        (None, FileNotFoundError, "train one with `python -m workshop train`"),
        (lambda path: path.write_bytes(b"PK\x03\x04 cut"), DataError, "not a readable"),
        (lambda path: torch.save({"code": print}, path), DataError, "not a readable"),
    ],
    ids=["missing", "cut short", "holding code"],
)
def test_load_checkpoint_refuses_a_missing_cut_or_unsafe_file(
    write, error, message, tmp_path
):
    if write:
        write(tmp_path / "x.pt")
    with pytest.raises(error, match=message):
        checkpoints.load_checkpoint(tmp_path / "x.pt")


DAMAGE = {
    "a weight too many": (lambda c: c["model"].update(x=torch.zeros(3)), "not fit"),
    "no weights": (lambda c: c.pop("model"), r"lacks \['model'\]"),
    "an unknown setting": (lambda c: c["config"].update(dimension=3), "cannot use"),
    "no subword vocabulary": (lambda c: c["config"].update(vocab="bpe"), "unreadable"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_checkpoint_this_code_cannot_use_raises_a_data_error_saying_why(
    damage, tmp_path
):
    _, checkpoint = saved(tmp_path / "x.pt")
    change, message = DAMAGE[damage]
    change(checkpoint)
    with pytest.raises(DataError, match=message):
        checkpoints.model_from_checkpoint(checkpoint)


def test_a_runs_epoch_files_are_ordered_by_epoch_number_not_by_name(tmp_path):
    for name in ("epoch_1000.pt", "epoch_999.pt", "epoch_002.pt", "epoch_x.pt"):
        (tmp_path / name).touch()
    names = [path.name for path in checkpoints.epoch_files(tmp_path)]
    assert names == ["epoch_002.pt", "epoch_999.pt", "epoch_1000.pt"]


def test_averaging_saves_the_mean_of_one_runs_checkpoints_as_an_epoch_checkpoint(
    tmp_path,
):
    """Two checkpoints of one run, the second resumed with more epochs."""
    paths = [tmp_path / "epoch_004.pt", tmp_path / "epoch_005.pt"]
    _, first = saved(paths[0], seed=1, epoch=3)
    _, second = saved(paths[1], seed=2, epoch=4, epochs=5)
    model = checkpoints.average_checkpoints(paths, tmp_path / "average.pt")
    averaged = checkpoints.load_checkpoint(tmp_path / "average.pt")
    assert averaged["config"] == second["config"] and averaged["epoch"] == 4
    assert averaged["vocab_tgt"] == WORDS and averaged.keys() >= first.keys()
    assert averaged["model"].keys() == first["model"].keys()  # no positional tables
    for name, tensor in averaged["model"].items():
        # Averaged in float64, where the sum of two float32 numbers is exact (their
        # exponents lie within 29 bits), halved exactly and rounded once to float32;
        # here float32 rounds the sum once and halves exactly: bit for bit the same.
        assert torch.equal(tensor, (first["model"][name] + second["model"][name]) / 2)
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    "other, message",
    [({"d_ff": 128}, "d_ff=64 vs 128"), ({"words": WORDS[:5]}, "vocab_src vocab")],
)
def test_averaging_refuses_the_checkpoints_of_different_runs(other, message, tmp_path):
    saved(tmp_path / "a.pt", seed=1)
    saved(tmp_path / "b.pt", seed=2, **other)
    with pytest.raises(DataError, match=message):
        checkpoints.average_checkpoints(
            [tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "m.pt"
        )
    assert not (tmp_path / "m.pt").exists()
