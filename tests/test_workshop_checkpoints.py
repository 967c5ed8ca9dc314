"""Checkpoint and vocabulary files (workshop.run.checkpoints): vocabularies saved and
read back, checkpoints saved without the positional tables, and averaging the
checkpoints of one run."""

import json

import pytest
import torch
from conftest import (
    names_in,
    tiny_checkpoint,
)

import the_annotated_transformer as tat
from workshop.errors import DataError
from workshop.run import checkpoints

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# ---------------------------------------------------------------------------
# Vocabulary files


def test_a_word_vocabulary_is_saved_as_its_tokens_in_json(tmp_path):
    vocab = tat.Vocab.build([["Männer", "Ufer", "Männer", "Ufer", "."]] * 2)
    path = tmp_path / "vocab.json"
    checkpoints.save_vocab(vocab, path)
    assert json.loads(path.read_text(encoding="utf-8")) == {"itos": vocab.itos}
    assert "Männer" in path.read_text(encoding="utf-8")  # UTF-8, not escaped
    assert names_in(tmp_path) == ["vocab.json"]  # no temporary file left


def test_a_subword_vocabulary_is_saved_as_its_tokenizer_and_read_back(bpe, tmp_path):
    path = tmp_path / "bpe.json"
    checkpoints.save_vocab(bpe, path)
    assert names_in(tmp_path) == ["bpe.json"]  # no temporary file left
    assert path.read_text(encoding="utf-8") == bpe.tokenizer.to_str()
    config = {"vocab": "bpe"}
    src, tgt = checkpoints.vocabs_from_checkpoint(
        {"config": config, "bpe": bpe.tokenizer.to_str()}
    )
    text = "Zwei Männer stehen am Ufer."
    assert src is tgt and src.encode(text) == bpe.encode(text)
    assert src.get_itos() == bpe.get_itos()


@pytest.mark.parametrize("text", ["not json", '{"model": {"type": "BPE"}}'])
def test_a_checkpoint_whose_subword_vocabulary_is_damaged_raises_data_error(text):
    with pytest.raises(DataError, match="vocabulary is unreadable"):
        checkpoints.vocabs_from_checkpoint({"config": {"vocab": "bpe"}, "bpe": text})


# ---------------------------------------------------------------------------
# Averaging checkpoints


def test_average_checkpoints_saves_the_mean_in_the_epoch_checkpoint_format(tmp_path):
    first = tiny_checkpoint(tmp_path / "epoch_004.pt", seed=1, epoch=3)
    second = tiny_checkpoint(tmp_path / "epoch_005.pt", seed=2, epoch=4)
    paths = [tmp_path / "epoch_004.pt", tmp_path / "epoch_005.pt"]
    model = checkpoints.average_checkpoints(paths, tmp_path / "average.pt")
    saved = checkpoints.load_checkpoint(tmp_path / "average.pt")
    assert saved["config"] == first["config"] and saved["epoch"] == 4
    assert saved["vocab_src"] == saved["vocab_tgt"] == first["vocab_src"]
    assert set(saved["model"]) == set(first["model"])  # no .pe tables stored
    for name, tensor in saved["model"].items():
        mean = (first["model"][name] + second["model"][name]) / 2
        # Averaged in float64, where the sum of two float32 numbers is exact (their
        # exponents lie within 29 bits), halved exactly and rounded once to float32;
        # here float32 rounds the sum once and halves exactly: bit for bit the same.
        assert torch.equal(tensor, mean), name
        assert torch.equal(model.state_dict()[name], tensor), name
    rebuilt, *_ = checkpoints.model_from_checkpoint(saved)
    assert torch.equal(rebuilt.generator.proj.weight, model.generator.proj.weight)
    assert not list(tmp_path.glob(".*tmp*"))  # the atomic write left nothing behind


def test_average_checkpoints_accepts_a_run_resumed_with_more_epochs(tmp_path):
    tiny_checkpoint(tmp_path / "a.pt", seed=1, epochs=3)
    tiny_checkpoint(tmp_path / "b.pt", seed=2, epochs=5)
    checkpoints.average_checkpoints(
        [tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "m.pt"
    )
    assert (tmp_path / "m.pt").is_file()


def test_average_checkpoints_refuses_checkpoints_with_different_settings(tmp_path):
    tiny_checkpoint(tmp_path / "a.pt", seed=1)
    tiny_checkpoint(tmp_path / "b.pt", seed=2, d_ff=128)
    with pytest.raises(DataError, match=r"d_ff=64 vs 128"):
        checkpoints.average_checkpoints(
            [tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "m.pt"
        )
    assert not (tmp_path / "m.pt").exists()


def test_average_checkpoints_refuses_checkpoints_with_different_vocabularies(tmp_path):
    tiny_checkpoint(tmp_path / "a.pt", seed=1)
    tiny_checkpoint(tmp_path / "b.pt", seed=2, words=["a", "cat", "runs", "."])
    with pytest.raises(DataError, match="vocab_src vocabularies"):
        checkpoints.average_checkpoints(
            [tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "m.pt"
        )
