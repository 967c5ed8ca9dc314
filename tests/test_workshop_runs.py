"""Training runs (workshop.training) and what they are made of: settings and profiles
(workshop.settings), checkpoint and vocabulary files (workshop.checkpoints), run
folders (workshop.run_folders), bf16 (workshop.precision) and several processes
(workshop.processes).

Profiles and settings (word and subword vocabularies), a run's data, checkpoints and
resuming (state dicts without the positional tables), time limits, averaging
checkpoints, data-parallel training (the loss's norm over processes, gradients
exchanged once per optimizer step, two processes end to end), learning, subword runs
end to end, and bf16 (the probe, the autocast wrappers around the book's model and
loss). The tests that train find Multi30k through $ANNOTATED_TRANSFORMER_DATA:
without it they are skipped on a laptop, but fail in CI (CI=true).
"""

import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import (
    REPO_ROOT,
    free_port,
    names_in,
    smoke_config,
    texts_of,
    tiny_checkpoint,
    train_run,
)

import the_annotated_transformer as tat
from workshop import (
    checkpoints,
    precision,
    processes,
    run_folders,
    settings,
    training,
    translation,
)
from workshop.multi30k import DataError

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

NEW_FIELDS = ("vocab", "bpe_vocab_size", "share_embeddings", "tie_generator")
MARKERS = ("Ġ", "▁", "<s>", "</s>", "<blank>", "<unk>")


# ---------------------------------------------------------------------------
# Vocabulary files


def test_vocab_round_trips_through_a_json_file(tmp_path):
    vocab = tat.Vocab.build([["Männer", "Ufer", "Männer", "Ufer", "."]] * 2)
    path = tmp_path / "vocab.json"
    checkpoints.save_vocab(vocab, path)
    assert json.loads(path.read_text(encoding="utf-8")) == {"itos": vocab.itos}
    loaded = checkpoints.load_vocab(path)
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
    with pytest.raises(DataError, match="vocab.json"):
        checkpoints.load_vocab(path)


def test_loading_a_missing_vocab_file_raises_data_error(tmp_path):
    with pytest.raises(DataError, match="nowhere.json"):
        checkpoints.load_vocab(tmp_path / "nowhere.json")


def test_subword_vocab_round_trips_through_a_json_file(bpe, tmp_path):
    path = tmp_path / "bpe.json"
    checkpoints.save_vocab(bpe, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe.json"]  # no temp file
    loaded = checkpoints.load_vocab(path)
    assert loaded.tokenizer.to_str() == bpe.tokenizer.to_str()
    assert loaded.get_itos() == bpe.get_itos()
    text = "Zwei Männer stehen am Ufer."
    assert loaded.encode(text) == bpe.encode(text)
    assert checkpoints.subword_vocab_from_json(bpe.tokenizer.to_str()).encode(
        text
    ) == bpe.encode(text)


@pytest.mark.parametrize("text", ["not json", '{"model": {"type": "BPE"}}'])
def test_loading_a_file_that_is_not_a_saved_subword_vocab_raises_data_error(
    tmp_path, text
):
    path = tmp_path / "bpe.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DataError, match="bpe.json"):
        checkpoints.load_vocab(path)
    with pytest.raises(DataError, match="missing.json"):
        checkpoints.load_vocab(tmp_path / "missing.json")


# ---------------------------------------------------------------------------
# Training configuration


def test_from_profile_applies_overrides_over_the_profile():
    config = settings.RunConfig.from_profile("smoke", epochs=3, max_train_pairs=300)
    assert (config.profile, config.N, config.d_model) == ("smoke", 1, 32)
    assert (config.epochs, config.max_train_pairs) == (3, 300)
    assert settings.RunConfig.from_dict(config.to_dict()) == config


def test_base_profile_is_the_papers_base_model():
    config = settings.RunConfig.from_profile("base")
    assert (config.N, config.d_model, config.d_ff, config.h) == (6, 512, 2048, 8)
    assert config.dropout == 0.1 and config.label_smoothing == 0.1


def test_the_books_profile_names_mean_the_same_settings_in_a_run():
    assert set(tat.PROFILES) <= set(settings.TRAIN_PROFILES)
    assert settings.TRAIN_PROFILES["smoke"] == {
        **tat.PROFILES["smoke"],
        "log_every": 10,
    }
    for name in ("quick", "base"):
        assert settings.TRAIN_PROFILES[name] == tat.PROFILES[name], name
    quick = settings.RunConfig.from_profile("quick")
    assert (quick.epochs, quick.max_train_pairs) == (4, None)
    book = {f.name for f in dataclasses.fields(tat.TrainConfig)}
    run = quick.to_dict()
    assert {k: run[k] for k in book} == dataclasses.asdict(
        tat.TrainConfig(**tat.PROFILES["quick"])
    )


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
        settings.RunConfig.from_profile("smoke", **overrides)


def test_from_profile_rejects_an_unknown_profile_listing_the_known_ones():
    with pytest.raises(ValueError, match="smoke"):
        settings.RunConfig.from_profile("huge")


def test_word_vocabularies_without_sharing_stay_the_default():
    config = settings.RunConfig()
    assert (config.vocab, config.bpe_vocab_size) == ("word", 8000)
    assert not config.share_embeddings and not config.tie_generator
    for profile in settings.TRAIN_PROFILES:
        assert settings.RunConfig.from_profile(profile).vocab == "word"


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
        settings.RunConfig.from_profile("smoke", **overrides)


def test_a_word_vocabulary_may_still_tie_the_generator_to_the_target_embedding():
    config = settings.RunConfig.from_profile("smoke", tie_generator=True)
    model = config.make_model(11, 13)
    target = model.tgt_embed[0].lut.weight
    assert model.generator.proj.weight is target  # one matrix, not a copy
    assert model.src_embed[0].lut.weight is not target  # the vocabularies differ
    assert target.shape == (13, config.d_model)
    untied = settings.RunConfig.from_profile("smoke").make_model(11, 13)
    assert untied.generator.proj.weight is not untied.tgt_embed[0].lut.weight


def old_style_config():
    """A config dict as saved before the subword fields existed."""
    values = settings.RunConfig.from_profile("smoke").to_dict()
    for name in NEW_FIELDS:
        del values[name]
    return values


def test_old_config_dicts_without_the_subword_fields_load_with_the_defaults():
    config = settings.RunConfig.from_dict(old_style_config())
    assert config == settings.RunConfig.from_profile("smoke")
    assert config.vocab == "word" and not config.share_embeddings


def test_an_old_style_word_checkpoint_still_rebuilds_its_model(tmp_path):
    itos = [*tat.SPECIALS, "a", "dog"]
    torch.manual_seed(0)
    model = tat.make_model(len(itos), len(itos), N=1, d_model=32, d_ff=64, h=2)
    path = tmp_path / "old.pt"
    checkpoints.save_checkpoint(
        path,
        {
            "model": checkpoints.without_positional_tables(model.state_dict()),
            "config": old_style_config(),
            "epoch": 0,
            "vocab_src": itos,
            "vocab_tgt": itos,
        },
    )
    rebuilt, vocab_src, vocab_tgt, config = checkpoints.model_from_checkpoint(
        checkpoints.load_checkpoint(path)
    )
    assert isinstance(vocab_src, tat.Vocab) and vocab_src.get_itos() == itos
    assert vocab_tgt is not vocab_src and config.vocab == "word"
    projection = rebuilt.generator.proj.weight
    assert torch.equal(projection, model.generator.proj.weight)
    assert projection.data_ptr() != rebuilt.tgt_embed[0].lut.weight.data_ptr()


def saved_smoke_model(path, seed=0):
    """A smoke-profile model saved as training saves it: without the `*.pe` tables."""
    config = settings.RunConfig.from_profile("smoke")
    itos = [*tat.SPECIALS, "a", "dog", "runs", "."]
    torch.manual_seed(seed)
    model = config.make_model(len(itos), len(itos)).eval()
    weights = checkpoints.without_positional_tables(model.state_dict())
    checkpoint = {"model": weights, "config": config.to_dict(), "epoch": 0}
    checkpoints.save_checkpoint(
        path, checkpoint | {"vocab_src": itos, "vocab_tgt": itos}
    )
    return model


def test_a_checkpoint_without_positional_tables_gives_the_saving_models_outputs(
    tmp_path,
):
    model = saved_smoke_model(tmp_path / "epoch_001.pt")
    checkpoint = checkpoints.load_checkpoint(tmp_path / "epoch_001.pt")
    tables = [k for k in model.state_dict() if k.endswith(".pe")]
    assert tables and not any(k.endswith(".pe") for k in checkpoint["model"])
    rebuilt, *_ = checkpoints.model_from_checkpoint(checkpoint)
    src = torch.tensor([[0, 4, 5, 6, 1], [0, 7, 1, 2, 2]])
    tgt = torch.tensor([[0, 5, 4], [0, 6, 2]])
    masks = tat.padding_mask(src, tat.PAD), tat.subsequent_mask(3)
    with torch.no_grad():  # the same weights and the same arithmetic: equal bits
        want = model.generator(model(src, tgt, *masks))
        got = rebuilt.generator(rebuilt(src, tgt, *masks))
    assert torch.equal(got, want)
    for name in tables:  # the tables were filled from the rebuilt model itself
        assert torch.equal(rebuilt.state_dict()[name], model.state_dict()[name])


@pytest.mark.parametrize("change", ["drop a weight", "add a weight"])
def test_filling_the_positional_tables_leaves_loading_strict(tmp_path, change):
    saved_smoke_model(tmp_path / "epoch_001.pt")
    checkpoint = checkpoints.load_checkpoint(tmp_path / "epoch_001.pt")
    if change == "drop a weight":
        del checkpoint["model"]["generator.proj.bias"]
    else:
        checkpoint["model"]["generator.extra"] = torch.zeros(3)
    with pytest.raises(DataError, match="do not fit"):
        checkpoints.model_from_checkpoint(checkpoint)


def test_with_positional_tables_keeps_the_tables_a_state_dict_has():
    model = settings.RunConfig.from_profile("smoke").make_model(11, 11)
    state = model.state_dict()
    name = next(k for k in state if k.endswith(".pe"))
    marked = {name: torch.zeros_like(state[name])}
    filled = checkpoints.with_positional_tables(marked, model)
    assert torch.equal(filled[name], marked[name])
    tables = {k for k in state if k.endswith(".pe")}
    assert set(filled) == tables
    assert not tables & set(checkpoints.without_positional_tables(state))


def test_a_bpe_checkpoint_without_its_vocabulary_raises_data_error():
    config = settings.RunConfig.from_profile("smoke", vocab="bpe").to_dict()
    with pytest.raises(DataError, match="'bpe'"):
        checkpoints.vocabs_from_checkpoint(
            {"config": config, "vocab_src": [], "model": {}}
        )


# ---------------------------------------------------------------------------
# A run's data with a joint subword vocabulary


def bpe_data_config(**overrides):
    """A run's settings for a 1,000-token joint vocabulary learned from 300 pairs."""
    changes = dict(vocab="bpe", bpe_vocab_size=1000, max_train_pairs=300)
    return settings.RunConfig.from_profile("smoke", **{**changes, **overrides})


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
    data = training.prepare_run_data(bpe_data_config(), multi30k_dir)
    assert seen == [texts_of(train_pairs[:300])]
    assert data.vocab_src is data.vocab_tgt
    monkeypatch.undo()
    again = tat.SubwordVocab.build(texts_of(train_pairs[:300]), 1000)
    assert (
        data.vocab_src.tokenizer.to_str() == again.tokenizer.to_str()
    )  # learning is deterministic


def test_a_runs_data_encodes_both_sides_with_the_one_subword_vocabulary(
    multi30k_dir,
):
    data = training.prepare_run_data(bpe_data_config(), multi30k_dir)
    vocab = data.vocab_src
    assert isinstance(vocab, tat.SubwordVocab) and data.vocab_tgt is vocab
    assert len(data.splits["train"]) == 300 and len(data.splits["val"]) == 1014
    for (de, en), (src, tgt) in zip(
        data.raw["val"][:20], data.splits["val"][:20], strict=True
    ):
        assert src == [tat.BOS, *vocab.encode(de), tat.EOS]
        assert tgt == [tat.BOS, *vocab.encode(en), tat.EOS]


# ---------------------------------------------------------------------------
# Checkpoints and resuming


def model_weights(path):
    return checkpoints.load_checkpoint(path)["model"]


def test_training_saves_last_and_the_newest_epoch_checkpoints(smoke_run):
    assert names_in(smoke_run.out) == [
        "epoch_002.pt",
        "last.pt",
        "vocab_src.json",
        "vocab_tgt.json",
    ]
    last = checkpoints.load_checkpoint(smoke_run.out / "last.pt")
    assert last["epoch"] == 1
    assert last["config"] == smoke_config().to_dict()
    assert {"optimizer", "scheduler", "train_state", "history"} <= set(last)
    assert last["history"] == smoke_run.history
    assert [r["epoch"] for r in smoke_run.history] == [1, 2]
    vocab_tgt = checkpoints.load_vocab(smoke_run.out / "vocab_tgt.json")
    assert vocab_tgt.get_itos() == last["vocab_tgt"]


def test_time_limit_stops_before_an_epoch_that_would_end_too_late_and_says_so(
    multi30k_dir, tmp_path, capsys
):
    config = smoke_config(epochs=3, time_limit=1e-6)  # minutes: one epoch is longer
    history = training.train_model(config, multi30k_dir, tmp_path)
    assert [r["epoch"] for r in history] == [1]  # the first epoch always runs
    assert "stopped after 1 of the 3 epochs" in capsys.readouterr().out
    last = checkpoints.load_checkpoint(tmp_path / "last.pt")
    assert last["epoch"] == 0 and "stopped after 1 of the 3 epochs" in last["stopped"]


def test_a_run_within_its_time_limit_trains_its_whole_budget_unmarked(smoke_run):
    assert len(smoke_run.history) == smoke_config().epochs
    assert "stopped" not in checkpoints.load_checkpoint(smoke_run.out / "last.pt")


def test_an_epoch_checkpoint_rebuilds_the_trained_model(smoke_run):
    model, vocab_src, vocab_tgt, config = checkpoints.model_from_checkpoint(
        checkpoints.load_checkpoint(smoke_run.out / "epoch_002.pt")
    )
    assert config == smoke_config()
    assert not model.training
    weights = model.state_dict()
    for name, tensor in model_weights(smoke_run.out / "last.pt").items():
        assert torch.equal(weights[name], tensor), name
    assert len(vocab_src) == model.src_embed[0].lut.num_embeddings
    assert len(vocab_tgt) == model.generator.proj.out_features


def test_a_run_resumed_after_epoch_1_ends_where_an_uninterrupted_run_ends(
    multi30k_dir, tmp_path
):
    # The uninterrupted run is trained here, not taken from the session's smoke_run:
    # a session fixture is set up before the function-scoped one_cpu_thread, so
    # smoke_run trains on torch's default thread count, whose other blocking of the
    # matrix products rounds differently (0.02 apart after two epochs).
    whole, part = tmp_path / "whole", tmp_path / "part"
    uninterrupted = training.train_model(
        smoke_config(), multi30k_dir, whole, quiet=True
    )
    first = training.train_model(smoke_config(epochs=1), multi30k_dir, part, quiet=True)
    assert len(first) == 1
    assert checkpoints.load_checkpoint(part / "last.pt")["epoch"] == 0
    resumed = training.train_model(
        smoke_config(epochs=2), multi30k_dir, part, resume=True, quiet=True
    )
    assert [r["epoch"] for r in resumed] == [1, 2]
    # Exact, not close: on one thread the resumed epoch does the same float
    # operations in the same order as the uninterrupted one (the same batches and
    # dropout masks from epoch_seed; weights, Adam moments and scheduler restored
    # bit for bit from float32 tensors), so any difference is a state the
    # checkpoint failed to carry.
    ours = checkpoints.load_checkpoint(part / "last.pt")
    theirs = checkpoints.load_checkpoint(whole / "last.pt")
    assert ours["model"].keys() == theirs["model"].keys()
    for name, tensor in ours["model"].items():
        assert torch.equal(tensor, theirs["model"][name]), name
    assert ours["train_state"] == theirs["train_state"]
    assert ours["config"]["epochs"] == 2
    assert resumed[1]["val_nll"] == uninterrupted[1]["val_nll"]


def test_a_checkpoint_write_that_dies_part_way_keeps_the_previous_one(
    tmp_path, monkeypatch
):
    path = tmp_path / "last.pt"
    before = {"model": {"w": torch.arange(6.0)}, "epoch": 0}
    checkpoints.save_checkpoint(path, before)

    def dies_part_way(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 the first bytes of a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", dies_part_way)
    with pytest.raises(OSError, match="No space"):
        checkpoints.save_checkpoint(path, {"model": {"w": torch.zeros(6)}, "epoch": 1})
    monkeypatch.undo()
    after = checkpoints.load_checkpoint(path)
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
    with pytest.raises(DataError, match="evil.pt"):
        checkpoints.load_checkpoint(path)
    assert not marker.exists()
    # The control: an unrestricted load would have run the payload.
    torch.load(path, weights_only=False)["payload"].close()
    assert marker.exists()


def test_load_checkpoint_of_a_truncated_file_raises_data_error(smoke_run, tmp_path):
    whole = (smoke_run.out / "last.pt").read_bytes()
    (tmp_path / "last.pt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match="not a readable checkpoint"):
        checkpoints.load_checkpoint(tmp_path / "last.pt")


def test_load_checkpoint_of_a_missing_file_says_how_to_train_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m workshop train"):
        checkpoints.load_checkpoint(tmp_path / "missing.pt")


def test_epoch_files_are_ordered_by_epoch_number_not_by_name(tmp_path):
    for name in ("epoch_1000.pt", "epoch_999.pt", "epoch_002.pt", "epoch_x.pt"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in run_folders.epoch_files(tmp_path)] == [
        "epoch_002.pt",
        "epoch_999.pt",
        "epoch_1000.pt",
    ]


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
        torch.testing.assert_close(tensor, mean, rtol=0, atol=1e-7)
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


# ---------------------------------------------------------------------------
# Data-parallel training: the loss's norm, one gradient exchange per step

DDP_VOCAB = 13


def ddp_test_model():
    """A one-layer float64 Transformer, seeded, without dropout."""
    torch.manual_seed(0)
    tiny = dict(N=1, d_model=16, d_ff=32, h=2, dropout=0.0)
    return tat.make_model(DDP_VOCAB, DDP_VOCAB, **tiny).double()


def ddp_halves():
    """Two Batches, the halves of one global batch: the second holds two short
    sentences, so the halves have different numbers of target tokens."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(4, DDP_VOCAB, (5, 9), generator=gen)
    tgt = torch.randint(4, DDP_VOCAB, (5, 9), generator=gen)
    src[:, 0] = tgt[:, 0] = tat.BOS
    for row, length in ((3, 3), (4, 5)):
        src[row, length:] = tat.PAD
        tgt[row, length - 1] = tat.EOS
        tgt[row, length:] = tat.PAD
    halves = (slice(0, 3), slice(3, 5))
    return [tat.Batch(src[rows], tgt[rows], tat.PAD) for rows in halves]


def ddp_criterion():
    return tat.LabelSmoothing(DDP_VOCAB, tat.PAD, 0.1)


def sgd_epoch(model, module, loss_compute, batches, accum_iter=1):
    """The book's run_epoch with plain SGD; returns the module's state dict."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    tat.run_epoch(batches, model, loss_compute, optimizer, accum_iter=accum_iter)
    return module.state_dict()


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of this process alone (world size 1), destroyed after."""
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    torch.distributed.init_process_group(
        "gloo", init_method=rendezvous, rank=0, world_size=1
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    "n_batches, synced, steps",
    [(4, [False, True, False, True], 2), (3, [False, True, True], 2)],
)
def test_micro_batches_that_do_not_end_a_group_run_without_gradient_exchange(
    one_process_group, n_batches, synced, steps
):
    """GroupSyncDDP turns DDP's gradient exchange off for every forward pass of a
    micro-batch that does not end its group (every accum_iter batches, and the
    epoch's last), as the 2018/2022 notebook's loop did with no_sync()."""
    batches = [ddp_halves()[0]] * n_batches
    module = ddp_test_model()
    model = processes.GroupSyncDDP(module)
    seen = []  # DDP's public switch, as each forward pass of the module finds it
    module.register_forward_pre_hook(
        lambda *_: seen.append(model.require_backward_grad_sync)
    )
    model.plan_epoch(n_batches, accum_iter=2)
    loss_compute = processes.DistributedLossCompute(module.generator, ddp_criterion())
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    _, state = tat.run_epoch(batches, model, loss_compute, optimizer, accum_iter=2)
    assert seen == synced
    assert state.accum_step == steps
    # Alone in its group, the process exchanges with nobody: the gradients kept
    # without exchange still reach each step, and the run equals the plain model's
    # exactly (DDP divides by a world size of 1).
    plain = ddp_test_model()
    simple = tat.SimpleLossCompute(plain.generator, ddp_criterion())
    want = sgd_epoch(plain, plain, simple, batches, accum_iter=2)
    got = module.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    seen.clear()  # evaluation counts no micro-batch, and leaves the switch as it is
    tat.run_epoch(batches, model, loss_compute, mode="eval")
    assert seen == [True] * n_batches


def test_ddp_without_a_plan_exchanges_gradients_after_every_micro_batch(
    one_process_group,
):
    module = ddp_test_model()
    model = processes.GroupSyncDDP(module)
    seen = []
    module.register_forward_pre_hook(
        lambda *_: seen.append(model.require_backward_grad_sync)
    )
    loss_compute = processes.DistributedLossCompute(module.generator, ddp_criterion())
    sgd_epoch(model, module, loss_compute, ddp_halves() * 2, accum_iter=2)
    assert seen == [True] * 4


def test_the_distributed_norm_is_the_mean_token_count_over_processes_as_a_tensor(
    one_process_group,
):
    mean = processes.mean_over_processes(37, torch.device("cpu"))
    assert torch.is_tensor(mean) and mean.dtype == torch.float32
    assert mean.item() == 37.0  # one process: its own count, exactly
    module = ddp_test_model()
    batch = ddp_halves()[0]
    out = module(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    ours = processes.DistributedLossCompute(module.generator, ddp_criterion())
    book = tat.SimpleLossCompute(module.generator, ddp_criterion())
    loss, node = ours(out, batch.tgt_y, 37)
    book_loss, book_node = book(out, batch.tgt_y, 37)
    # The same summed loss, divided by 37 as a float32 tensor or as an int: both
    # hold 37 exactly, so the quotients are the same float64 number.
    assert torch.equal(loss, book_loss) and torch.equal(node, book_node)


def two_process_worker(rank, rendezvous, result_path):
    """One of two processes: one SGD step on its half of the global batch, with the
    run's DDP model and loss compute."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=2
    )
    try:
        module = ddp_test_model()
        model, _ = training.models_for_run(module, distributed=True)
        model.plan_epoch(1, accum_iter=1)
        loss_compute = training.loss_compute_for_run(
            module.generator, ddp_criterion(), distributed=True
        )
        state = sgd_epoch(model, module, loss_compute, [ddp_halves()[rank]])
        if rank == 0:
            torch.save(state, result_path)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.timeout(300)
def test_two_processes_on_halves_of_a_batch_take_the_one_process_step(tmp_path):
    """The run's DistributedLossCompute divides each process's loss by the mean of
    the processes' token counts: with DDP's mean over processes, the step is the
    mean over every token of the global batch, however unevenly they fall.

    One process running both halves as two micro-batches of one group gets the
    same gradient: each half's summed-loss gradient over all the tokens, added.
    The two processes compute each half's gradient divided by half the token
    count, and DDP halves it again: scalings by powers of two, exact in floating
    point. Adding two numbers does not depend on their order, so the two runs
    agree to the last bit."""
    halves = ddp_halves()
    assert halves[0].ntokens != halves[1].ntokens  # token counts differ by rank
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    result_path = tmp_path / "rank0.pt"
    torch.multiprocessing.spawn(
        two_process_worker, args=(rendezvous, str(result_path)), nprocs=2
    )
    two_processes = torch.load(result_path, weights_only=True)
    whole = ddp_test_model()
    simple = tat.SimpleLossCompute(whole.generator, ddp_criterion())
    one_process = sgd_epoch(whole, whole, simple, halves, accum_iter=2)
    assert all(torch.equal(two_processes[k], one_process[k]) for k in one_process)
    # The control: each process dividing by its own token count (the book's loss
    # compute under DDP) averages two per-half means, which weights the half with
    # fewer tokens too much: a different step.
    steps = []
    for half in halves:
        model = ddp_test_model()
        book = tat.SimpleLossCompute(model.generator, ddp_criterion())
        steps.append(sgd_epoch(model, model, book, [half]))
    initial = ddp_test_model().state_dict()
    gap = max(
        ((steps[0][k] + steps[1][k]) / 2 - one_process[k]).abs().max().item()
        for k in initial
    )
    moved = max((one_process[k] - initial[k]).abs().max().item() for k in initial)
    assert gap > moved / 100 > 0


# ---------------------------------------------------------------------------
# Data-parallel training in two processes


def test_epoch_seeds_differ_by_rank_and_epoch_and_repeat_for_the_same_ones():
    seeds = {processes.epoch_seed(0, e, r) for e in range(3) for r in range(4)}
    assert len(seeds) == 12
    assert processes.epoch_seed(1, 0, 0) != processes.epoch_seed(
        0, 1, 0
    )  # not seed + epoch
    # A resumed run draws its epoch's seed in another process: the seed must not
    # depend on the global random state nor on Python's per-process string hashing.
    here = [processes.epoch_seed(0, 1, 1), processes.epoch_seed(7, 2, 0)]
    torch.rand(3), np.random.rand(3), random.random()  # move every global generator
    assert [processes.epoch_seed(0, 1, 1), processes.epoch_seed(7, 2, 0)] == here
    code = (
        "from workshop import processes\n"
        "print(processes.epoch_seed(0, 1, 1), processes.epoch_seed(7, 2, 0))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert [int(word) for word in out.split()] == here


@pytest.mark.timeout(300)
def test_two_processes_train_an_epoch_to_the_end_without_hanging(
    multi30k_dir, tmp_path, monkeypatch
):
    """Two processes share an epoch whose batches cannot be split evenly (25 pairs,
    one a batch) in groups of two micro-batches, the last one short."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    config = smoke_config(epochs=1, accum_iter=2, max_tokens=1, max_train_pairs=25)
    history = training.train_model(
        config, multi30k_dir, tmp_path, nprocs=2, quiet=True, device="cpu"
    )  # gloo on the CPU, GPUs or not
    assert [r["epoch"] for r in history] == [1]
    state = checkpoints.load_checkpoint(tmp_path / "last.pt")["train_state"]
    data = tat.prepare_data(
        multi30k_dir, splits=("train",), max_train_pairs=config.max_train_pairs
    )
    shares = [
        list(
            processes.ShardedBatchSampler(
                data.lengths("train"), config.max_tokens, num_replicas=2, rank=r
            )
        )
        for r in range(2)
    ]
    # Each process trains its own share: the main one's state counts its batches
    # and its pairs, and together the shares cover every pair (one of them twice,
    # so that each process gets 13 batches: 7 optimizer steps).
    assert len(shares[0]) == len(shares[1]) == state["step"]
    assert state["accum_step"] == math.ceil(state["step"] / config.accum_iter)
    assert (state["step"], state["accum_step"]) == (13, 7)
    assert state["samples"] == sum(len(batch) for batch in shares[0])
    covered = sorted(i for share in shares for batch in share for i in batch)
    assert set(covered) == set(range(config.max_train_pairs))


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
    config = settings.RunConfig.from_profile(
        "quick", max_train_pairs=1500, epochs=3, max_tokens=300
    )
    data = tat.prepare_data(multi30k_dir, max_train_pairs=1500)
    before = untrained_val_nll(config, data)
    assert before == pytest.approx(math.log(len(data.vocab_tgt)), abs=1.0)
    history = training.train_model(config, multi30k_dir, tmp_path, quiet=True)
    steps = checkpoints.load_checkpoint(tmp_path / "last.pt")["train_state"][
        "accum_step"
    ]
    assert steps >= 200
    after = history[-1]["val_nll"]
    assert after < before * 2 / 3, (before, [r["val_nll"] for r in history])
    assert history[-1]["val_ppl"] == pytest.approx(math.exp(after))


def test_a_run_without_dropout_trains_exactly_what_the_books_recipe_trains(
    multi30k_dir, tmp_path, monkeypatch
):
    """training.train_model is tat.train_translator plus what a long run needs, and the
    CPU tricks of workshop.fast. Their loss has the book's gradient (-q) and, with
    dropout off, their dropout draws nothing: both runs end with the same weights.
    The fused attention is left out here: it computes the same function in another
    order of rounding (tests/test_part1_model.py compares the two)."""
    monkeypatch.setattr(training.fast, "use_fused_attention", lambda model: model)
    config = smoke_config(epochs=1, dropout=0.0)
    history = training.train_model(config, multi30k_dir, tmp_path, quiet=True)
    book_config = tat.TrainConfig(
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(tat.TrainConfig)}
    )
    data = tat.prepare_data(multi30k_dir, max_train_pairs=config.max_train_pairs)
    model, book_history = tat.train_translator(
        book_config, data, device="cpu", quiet=True
    )
    weights = model.state_dict()
    # Exact: without dropout and the fused attention both runs do the same float
    # operations in the same order on the same batches, so the weights agree bit
    # for bit (the tricks of workshop.fast change where work is done, not its sums).
    saved = model_weights(tmp_path / "last.pt")
    assert saved.keys() <= weights.keys()
    for name, tensor in saved.items():
        assert torch.equal(weights[name], tensor), name
    assert [r["epoch"] for r in book_history] == [r["epoch"] for r in history] == [1]
    for key in ("train_loss_smoothed", "val_nll"):  # summed in other orders
        assert book_history[0][key] == pytest.approx(history[0][key], rel=1e-5)


# ---------------------------------------------------------------------------
# Subword runs end to end


def bpe_smoke_config(**overrides):
    changes = dict(
        vocab="bpe",
        bpe_vocab_size=1000,
        share_embeddings=True,
        tie_generator=True,
        max_train_pairs=300,
        keep_checkpoints=1,
    )
    return settings.RunConfig.from_profile("smoke", **{**changes, **overrides})


@pytest.fixture(scope="module")
def bpe_run(multi30k_dir, tmp_path_factory):
    """A one-epoch smoke-profile run with the joint vocabulary and tied matrices."""
    return train_run(bpe_smoke_config(), multi30k_dir, tmp_path_factory, "bpe_run")


def test_a_bpe_run_saves_its_vocabulary_in_the_checkpoint_and_as_json(bpe_run):
    assert sorted(p.name for p in bpe_run.out.iterdir()) == [
        "bpe.json",
        "epoch_001.pt",
        "last.pt",
    ]
    last = torch.load(bpe_run.out / "last.pt", map_location="cpu", weights_only=True)
    assert last["config"] == bpe_smoke_config().to_dict()
    assert isinstance(last["bpe"], str)
    vocab = checkpoints.load_vocab(bpe_run.out / "bpe.json")
    assert vocab.tokenizer.to_str() == last["bpe"]
    assert last["vocab_src"] == last["vocab_tgt"] == vocab.get_itos()
    assert len(vocab) <= 1000
    epoch = torch.load(bpe_run.out / "epoch_001.pt", weights_only=True)
    assert epoch["bpe"] == last["bpe"]


def test_a_bpe_checkpoint_rebuilds_a_model_with_one_shared_matrix(bpe_run):
    checkpoint = checkpoints.load_checkpoint(bpe_run.out / "epoch_001.pt")
    model, vocab_src, vocab_tgt, config = checkpoints.model_from_checkpoint(checkpoint)
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
    translator = translation.load_translator(bpe_run.out / "last.pt", device="cpu")
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
    history = training.train_model(
        bpe_smoke_config(epochs=2), multi30k_dir, tmp_path, resume=True, quiet=True
    )
    assert [r["epoch"] for r in history] == [1, 2]
    assert history[0] == bpe_run.history[0]
    assert (tmp_path / "bpe.json").read_text(encoding="utf-8") == before
    assert checkpoints.load_checkpoint(tmp_path / "last.pt")["bpe"] == before


# ---------------------------------------------------------------------------
# bf16 only where it pays


@pytest.mark.parametrize(
    "speedup, expected",
    [(0.03, None), (0.999, None), (1.0, torch.bfloat16), (1.7, torch.bfloat16)],
)
def test_bf16_is_used_only_where_a_measured_matmul_says_it_pays(
    speedup, expected, monkeypatch, capsys
):
    monkeypatch.setattr(precision, "bf16_matmul_speedup", lambda device: speedup)
    assert precision.amp_dtype_for(True, torch.device("cpu")) == expected
    said = capsys.readouterr().out.strip().splitlines()
    if expected is None:
        assert len(said) == 1 and "--bf16 ignored" in said[0]
        assert f"{speedup:.2f}x" in said[0]
    else:
        assert said == []


def test_bf16_not_asked_for_is_not_even_measured(monkeypatch):
    def never(device):
        raise AssertionError("measured without --bf16")

    monkeypatch.setattr(precision, "bf16_matmul_speedup", never)
    assert precision.amp_dtype_for(False, torch.device("cpu")) is None


def test_bf16_is_decided_on_this_cpus_real_measurement(monkeypatch, capsys):
    """The decision on a real timing of real products (smaller than a run's, to
    be quick): bfloat16 exactly when the measured speedup is at least 1, and a
    refusal that reports the number measured."""
    measured, measure = [], precision.bf16_matmul_speedup

    def real_speedup(device):
        measured.append(measure(device, tokens=128, d_model=64))
        return measured[-1]

    monkeypatch.setattr(precision, "bf16_matmul_speedup", real_speedup)
    dtype = precision.amp_dtype_for(True, torch.device("cpu"))
    assert len(measured) == 1
    speedup = measured[0]
    assert math.isfinite(speedup) and speedup > 0
    assert dtype == (torch.bfloat16 if speedup >= 1.0 else None)
    said = capsys.readouterr().out
    assert (f"{speedup:.2f}x" in said) == (dtype is None)


# ---------------------------------------------------------------------------
# bf16: autocast around the book's model and loss

COPY_VOCAB = 11


def copy_batches(n=4, batch_size=16, seed=1):
    """The book's copy-task batches (padding COPY_PAD)."""
    gen = torch.Generator().manual_seed(seed)
    return list(tat.data_gen(COPY_VOCAB, batch_size, n, generator=gen))


def test_autocast_runs_the_wrapped_models_forward_in_bfloat16_on_the_cpu():
    torch.manual_seed(0)
    model = tat.make_model(COPY_VOCAB, COPY_VOCAB, N=2, d_model=32, d_ff=64, h=4)
    wrapped = precision.Autocast(model).eval()
    assert wrapped.dtype == torch.bfloat16
    seen = []  # what a linear layer inside the model computes in, and whether
    layer = model.encoder.layers[0].feed_forward.w_1
    layer.register_forward_hook(
        lambda module, inputs, output: seen.append(
            (output.dtype, torch.is_autocast_enabled("cpu"))
        )
    )
    b = copy_batches(n=1)[0]
    args = b.src, b.tgt, b.src_mask, b.tgt_mask
    with torch.no_grad():
        ours = wrapped(*args)
        plain = model(*args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            direct = model(*args)
    assert seen == [  # wrapped; plain; under autocast by hand
        (torch.bfloat16, True),
        (torch.float32, False),
        (torch.bfloat16, True),
    ]
    assert not torch.is_autocast_enabled("cpu")  # switched off again after
    assert torch.equal(ours, direct)  # the same computation as autocast by hand
    assert not torch.equal(ours, plain)  # ... and not the float32 one
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert list(wrapped.state_dict()) == [f"model.{k}" for k in model.state_dict()]


def test_a_bf16_model_and_loss_train_through_the_books_run_epoch():
    torch.manual_seed(0)
    model = tat.make_model(
        COPY_VOCAB, COPY_VOCAB, N=2, d_model=32, d_ff=64, h=4, dropout=0.0
    )
    trained, evaluated = training.models_for_run(model, torch.bfloat16)
    assert type(trained) is precision.Autocast and evaluated is trained
    assert trained.model is model
    criterion = tat.LabelSmoothing(COPY_VOCAB, tat.COPY_PAD, 0.0)
    loss_compute = training.loss_compute_for_run(
        model.generator, criterion, torch.bfloat16
    )
    assert type(loss_compute) is precision.AutocastLossCompute
    scores = []  # the dtype of the generator's output, in training and evaluation
    model.generator.proj.register_forward_hook(
        lambda module, inputs, output: scores.append(output.dtype)
    )
    batches = copy_batches()
    before, _ = tat.run_epoch(batches, evaluated, loss_compute, mode="eval")
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    state = tat.TrainState()
    for _ in range(10):
        tat.run_epoch(batches, trained, loss_compute, optimizer, train_state=state)
    after, _ = tat.run_epoch(batches, evaluated, loss_compute, mode="eval")
    assert scores == [torch.bfloat16] * len(batches) * 12
    assert state.step == 40 and math.isfinite(after)
    assert after < before / 2  # the untrained NLL is about log(11) = 2.4
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_run_picks_the_model_and_loss_wrappers_for_its_precision():
    model = settings.RunConfig.from_profile("smoke").make_model(11, 11)
    criterion = tat.LabelSmoothing(11, tat.PAD, 0.1)
    assert training.models_for_run(model) == (model, model)
    plain = training.loss_compute_for_run(model.generator, criterion)
    assert type(plain) is tat.SimpleLossCompute
    both = training.loss_compute_for_run(
        model.generator, criterion, torch.bfloat16, True
    )
    assert type(both) is processes.DistributedAutocastLossCompute
    assert isinstance(both, processes.DistributedLossCompute)
    assert (
        isinstance(both, precision.AutocastLossCompute) and both.dtype == torch.bfloat16
    )


def test_a_bf16_run_trains_and_evaluates_under_autocast(
    smoke_run, multi30k_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(precision, "bf16_matmul_speedup", lambda device: 2.0)  # it pays
    made, models_for_run = [], training.models_for_run

    def recording_models_for_run(*args, **kwargs):
        made.append(models_for_run(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(training, "models_for_run", recording_models_for_run)
    history = training.train_model(
        smoke_config(epochs=1, bf16=True), multi30k_dir, tmp_path, quiet=True
    )
    [(trained, evaluated)] = made
    assert type(trained) is type(evaluated) is precision.Autocast
    assert math.isfinite(history[0]["val_nll"])
    # The float32 run of the same settings computed in another precision.
    assert history[0]["val_nll"] != smoke_run.history[0]["val_nll"]
    weights = checkpoints.load_checkpoint(tmp_path / "last.pt")["model"]
    assert all(w.dtype == torch.float32 for w in weights.values())


# ---------------------------------------------------------------------------
# Sharing the batches among data-parallel processes


def padded_size(batch, lengths):
    return len(batch) * max(lengths[i] for i in batch)


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
        processes.ShardedBatchSampler(lengths, budget, seed=2, num_replicas=2, rank=r)
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
        processes.ShardedBatchSampler([3, 4], 10, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="cannot be shared"):
        processes.ShardedBatchSampler([3], 10, num_replicas=2, rank=0)


@pytest.mark.parametrize("n, replicas", [(5, 2), (7, 3), (9, 4), (2, 2)])
def test_every_process_gets_as_many_batches_when_each_batch_holds_one_pair(n, replicas):
    shares = [
        list(processes.ShardedBatchSampler([10] * n, 1, num_replicas=replicas, rank=r))
        for r in range(replicas)
    ]
    assert len({len(share) for share in shares}) == 1
    seen = Counter(i for share in shares for batch in share for i in batch)
    assert set(seen) == set(range(n))  # every pair at least once
    assert sum(seen.values()) - n < replicas  # fewer than one round repeated
