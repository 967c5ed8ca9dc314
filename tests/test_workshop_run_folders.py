"""A run's folder (workshop.run.run_folders): what each epoch leaves there, and an
epoch kept whole or not at all when the disk fills."""

import errno
from types import SimpleNamespace

import pytest
import torch
from conftest import names_in, smoke_config

import the_annotated_transformer as tat
from workshop import files
from workshop.run import checkpoints, run_folders
from workshop.run.settings import RunConfig

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_a_run_keeps_last_pt_its_newest_epochs_and_its_vocabularies(smoke_run):
    """keep_checkpoints=1: of two epochs, the second. last.pt holds what resuming
    needs; each checkpoint the weights, without the positional tables."""
    out = smoke_run.out
    kept = ["epoch_002.pt", "last.pt", "vocab_src.json", "vocab_tgt.json"]
    assert names_in(out) == kept
    last = checkpoints.load_checkpoint(out / "last.pt")
    assert set(run_folders.RESUME_KEYS) <= set(last) and "stopped" not in last
    assert last["history"] == smoke_run.history and last["epoch"] == 1
    epoch = checkpoints.load_checkpoint(out / "epoch_002.pt")
    model, *_, config = checkpoints.model_from_checkpoint(epoch)
    assert config == smoke_config() and not any(
        k.endswith(".pe") for k in epoch["model"]
    )
    assert all(torch.equal(model.state_dict()[k], w) for k, w in last["model"].items())


class FullDisk:
    """A file with room for 1,000 more bytes: then a write fails as a full disk's."""

    def __init__(self, f):
        self.f, self.room = f, 1000

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)


@pytest.mark.parametrize("wrapped", [True, False], ids=["in torch", "raised"])
@pytest.mark.parametrize("failing", [1, 2], ids=["epoch_002.pt", "last.pt"])
def test_a_full_disk_keeps_the_previous_epoch_whole(
    failing, wrapped, tmp_path, monkeypatch
):
    """A subword run's second epoch finds the disk full as it writes epoch_002.pt
    (its first write) or last.pt (its second), inside torch's writer (which wraps
    the OSError in a RuntimeError) or raised as it is: one error says so, and the
    folder holds the first epoch as it was, with no temporary file, for a resume
    to train the epoch again once there is room."""
    bpe = tat.SubwordVocab.build(["Zwei Männer stehen am Ufer.", "A dog runs."], 300)
    settings = dict(vocab="bpe", share_embeddings=True, tie_generator=True)
    config = RunConfig.from_profile("smoke", keep_checkpoints=1, **settings)
    data = SimpleNamespace(vocab_src=bpe, vocab_tgt=bpe)
    model = config.make_model(len(bpe), len(bpe))
    run_folders.save_epoch(tmp_path, config, data, model, 0, {})
    before, last = names_in(tmp_path), (tmp_path / "last.pt").read_bytes()
    assert before == ["bpe.json", "epoch_001.pt", "last.pt"]
    bpe_json = (tmp_path / "bpe.json").read_text(encoding="utf-8")
    assert bpe_json == checkpoints.load_checkpoint(tmp_path / "last.pt")["bpe"]
    real_save, saves = torch.save, []

    def save(obj, f, *args, **kwargs):
        saves.append(f)
        if len(saves) != failing:
            return real_save(obj, f, *args, **kwargs)
        if wrapped:
            return real_save(obj, FullDisk(f), *args, **kwargs)
        f.write(b"PK\x03\x04 the first bytes of a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(files.DiskFullError, match="no space left on the device of"):
        run_folders.save_epoch(tmp_path, config, data, model, 1, {})
    assert names_in(tmp_path) == before and (tmp_path / "last.pt").read_bytes() == last
