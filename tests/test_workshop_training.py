"""Training runs (workshop.run.training, run_setup, run_data, run_folders): a run's
data and model, checkpoints every epoch, resuming, time limits, learning, and
subword runs end to end. The tests that train find Multi30k through
$ANNOTATED_TRANSFORMER_DATA: without it they are skipped on a laptop, but fail in
CI (CI=true)."""

import dataclasses
import errno
import json
import math
import platform
import shutil
import subprocess

import pytest
import torch
from conftest import (
    REPO_ROOT,
    names_in,
    smoke_config,
    texts_of,
    train_run,
)
from torch import nn

import the_annotated_transformer as tat
from workshop import cli, files
from workshop.errors import DataError
from workshop.run import (
    checkpoints,
    precision,
    provenance,
    run_data,
    run_folders,
    run_setup,
    settings,
    training,
)
from workshop.translate import translation

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

MARKERS = ("Ġ", "▁", "<s>", "</s>", "<blank>", "<unk>")


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
    data = run_data.prepare_run_data(bpe_data_config(), multi30k_dir)
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
    data = run_data.prepare_run_data(bpe_data_config(), multi30k_dir)
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
    saved = json.loads((smoke_run.out / "vocab_tgt.json").read_text(encoding="utf-8"))
    assert saved == {"itos": last["vocab_tgt"]}


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_cooldown_brings_the_rate_to_zero_at_the_runs_last_step(
    smoke_run, multi30k_dir, tmp_path_factory
):
    """cooldown=0.5: the rate falls linearly to 0 over the second half of the run's
    steps, so after the last one it is exactly 0; without it, the paper's rate is
    still well above 0."""
    cooled = train_run(smoke_config(cooldown=0.5), multi30k_dir, tmp_path_factory, "c")

    def last_rate(run):
        state = checkpoints.load_checkpoint(run.out / "last.pt")["optimizer"]
        return state["param_groups"][0]["lr"]

    assert last_rate(cooled) == 0.0
    assert last_rate(smoke_run) > 0.0


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


@pytest.mark.slow
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


def test_a_resume_reads_last_pt_once(smoke_run, multi30k_dir, tmp_path, monkeypatch):
    """`train --resume` reads last.pt once: its settings, vocabularies, weights,
    optimizer, schedule and record all come from that one read. (The run's last
    epoch is recorded as one minute and the limit is one minute, so the resume
    goes through all its set-up, then stops before an epoch.)"""
    run = tmp_path / "run"
    shutil.copytree(smoke_run.out, run)
    last = checkpoints.load_checkpoint(run / "last.pt")
    last["history"][-1]["seconds"] = 60.0
    checkpoints.save_checkpoint(run / "last.pt", last)
    real_load, reads = torch.load, []

    def counting_load(f, *args, **kwargs):
        if str(f) == str(run / "last.pt"):
            reads.append(f)
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    argv = ["train", "--data-dir", str(multi30k_dir), "--out", str(run), "--resume"]
    assert cli.main([*argv, "--epochs", "3", "--time-limit", "1", "--quiet"]) == 0
    assert len(reads) == 1
    monkeypatch.undo()
    assert (
        "stopped after 2 of the 3"
        in checkpoints.load_checkpoint(run / "last.pt")["stopped"]
    )


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
    with pytest.raises(files.DiskFullError, match="no space left on the device of"):
        checkpoints.save_checkpoint(path, {"model": {"w": torch.zeros(6)}, "epoch": 1})
    monkeypatch.undo()
    after = checkpoints.load_checkpoint(path)
    assert after["epoch"] == 0
    assert torch.equal(after["model"]["w"], before["model"]["w"])
    assert names_in(tmp_path) == ["last.pt"]


class FullDisk:
    """A file object over `f` that takes `room` more bytes, then fails as the write
    of a full disk does, with OSError(ENOSPC)."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            self.f.write(bytes(data[: self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)


def fill_the_disk_at_save(monkeypatch, number, wrapped):
    """Make the `number`-th torch.save from now on (1: the first) meet a full disk
    after 1,000 bytes: through torch's own writer, which wraps the OSError in a
    RuntimeError (wrapped=True), or raised as it is (wrapped=False)."""
    real_save, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) != number or not hasattr(f, "fileno"):  # not a file: a size
            return real_save(obj, f, *args, **kwargs)
        if wrapped:
            return real_save(obj, FullDisk(f, 1000), *args, **kwargs)
        f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", save)


def test_torchs_writer_wraps_the_full_disks_oserror_in_a_runtime_error(tmp_path):
    """The control for the test below: what torch.save raises on a full disk."""
    with open(tmp_path / "x.pt", "wb") as f, pytest.raises(RuntimeError) as error:
        torch.save({"w": torch.zeros(10_000)}, FullDisk(f, 1000))
    assert not isinstance(error.value, OSError)
    assert error.value.__context__.errno == errno.ENOSPC


@pytest.mark.slow
@pytest.mark.parametrize("wrapped", [True, False], ids=["torch wraps it", "as it is"])
@pytest.mark.parametrize("failing", [1, 2], ids=["epoch_003.pt", "last.pt"])
def test_a_full_disk_says_so_in_one_line_and_keeps_the_previous_epoch_whole(
    failing, wrapped, smoke_run, multi30k_dir, tmp_path, monkeypatch, capsys
):
    """A resumed run's third epoch finds the disk full while it writes epoch_003.pt
    (the first save) or last.pt (the second): one line that says so, last.pt as it
    was (epoch 2), no temporary file and no epoch_003.pt (an epoch is kept whole or
    not at all); with room again, the same --resume trains the epoch."""
    run = tmp_path / "run"
    shutil.copytree(smoke_run.out, run)
    before = (run / "last.pt").read_bytes()
    fill_the_disk_at_save(monkeypatch, failing, wrapped)
    argv = ["train", "--data-dir", str(multi30k_dir), "--out", str(run)]
    assert cli.main([*argv, "--resume", "--epochs", "3", "--quiet"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: no space left on the device of {run}")
    assert "Traceback" not in line
    assert (run / "last.pt").read_bytes() == before
    kept = ["epoch_002.pt", "last.pt", "vocab_src.json", "vocab_tgt.json"]
    assert names_in(run) == kept
    monkeypatch.undo()
    assert cli.main([*argv, "--resume", "--epochs", "3", "--quiet"]) == 0
    assert checkpoints.load_checkpoint(run / "last.pt")["epoch"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("failing", [1, 2], ids=["epoch_001.pt", "last.pt"])
def test_a_full_disk_in_the_first_epoch_leaves_a_folder_that_trains_again(
    failing, multi30k_dir, tmp_path, monkeypatch
):
    """A new run's first epoch finds the disk full while it writes epoch_001.pt or,
    once that is written, last.pt: the folder holds no checkpoint, so the same run,
    once there is room, trains (an epoch file without a last.pt would be taken for
    a run, which --resume could not continue)."""
    run, config = tmp_path / "run", smoke_config(epochs=1)
    fill_the_disk_at_save(monkeypatch, failing, wrapped=True)
    with pytest.raises(files.DiskFullError, match="no space left on the device"):
        training.train_model(config, multi30k_dir, run, quiet=True)
    assert names_in(run) == []  # no checkpoint, no temporary file
    monkeypatch.undo()
    history = training.train_model(config, multi30k_dir, run, quiet=True)
    assert [r["epoch"] for r in history] == [1]
    assert names_in(run) == [
        "epoch_001.pt",
        "last.pt",
        "vocab_src.json",
        "vocab_tgt.json",
    ]


def git_head():
    """The commit of this checkout, asked of git here; None outside a checkout."""
    result = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    return result.stdout.strip() if result.returncode == 0 else None


@pytest.mark.slow
def test_a_run_records_what_it_did_and_a_resumed_run_keeps_its_precision(
    multi30k_dir, tmp_path, monkeypatch
):
    """precision="auto" asks; the hardware decides (here: it has no bfloat16), and
    the checkpoints record what was used, with torch's and Python's versions, the
    commit and the machine. Resumed where the hardware would say yes, the run keeps
    its precision without asking, and adds the new invocation to the record."""
    monkeypatch.setattr(precision, "hardware_bf16", lambda device: (False, "no"))
    config = smoke_config(epochs=1, precision="auto")
    training.train_model(config, multi30k_dir, tmp_path, quiet=True)
    last = checkpoints.load_checkpoint(tmp_path / "last.pt")
    epoch = checkpoints.load_checkpoint(tmp_path / "epoch_001.pt")
    assert last["config"]["precision"] == "auto"  # what was asked
    assert last["precision"] == epoch["precision"] == "float32"  # what was used
    (first,) = last["provenance"]
    assert epoch["provenance"] == [first]
    assert first["torch"] == torch.__version__
    assert first["python"] == platform.python_version()
    assert first["commit"] == git_head()
    assert first["machine"] == provenance.describe_machine("cpu")
    assert (first["first_epoch"], first["device"]) == (1, "cpu")

    def never(device):
        raise AssertionError("a resumed run chose its precision again")

    monkeypatch.setattr(precision, "hardware_bf16", never)
    training.train_model(
        smoke_config(epochs=2, precision="auto"), multi30k_dir, tmp_path, resume=True
    )
    last = checkpoints.load_checkpoint(tmp_path / "last.pt")
    assert last["precision"] == "float32"
    assert [part["first_epoch"] for part in last["provenance"]] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [True, False])
def test_a_run_saved_with_the_older_settings_resumes_with_todays(
    bf16, smoke_run, multi30k_dir, tmp_path
):
    """Runs saved before `precision` replaced `bf16`, and while `fast_step` chose
    between two ways to compute one step, resume: bf16 reads as "auto" (bfloat16
    where it paid) or "fp32", fast_step is dropped, and the run keeps the precision
    its last.pt records."""
    last = torch.load(smoke_run.out / "last.pt", weights_only=True)
    older = {k: v for k, v in last["config"].items() if k != "precision"}
    last["config"] = older | {"bf16": bf16, "fast_step": True}
    torch.save(last, tmp_path / "last.pt")
    history = training.train_model(
        None, multi30k_dir, tmp_path, resume=True, changes={"epochs": 3}, quiet=True
    )
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert math.isfinite(history[-1]["val_nll"])
    resumed = checkpoints.load_checkpoint(tmp_path / "last.pt")
    assert resumed["config"]["precision"] == ("auto" if bf16 else "fp32")
    assert "bf16" not in resumed["config"] and "fast_step" not in resumed["config"]
    assert resumed["precision"] == last["precision"] == "float32"


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
    # Untrained, the model is near uniform over the words: its logits spread with a
    # standard deviation of about 0.5 (0.48 measured for seed 0), which puts the NLL
    # about sigma^2 / 2 = 0.1 nat above log |V| (+0.03 measured). One nat leaves room
    # for any seed and is still under half of the third (2.3 nats) training removes.
    assert before == pytest.approx(math.log(len(data.vocab_tgt)), abs=1.0)
    history = training.train_model(config, multi30k_dir, tmp_path, quiet=True)
    steps = checkpoints.load_checkpoint(tmp_path / "last.pt")["train_state"][
        "accum_step"
    ]
    assert steps >= 200
    after = history[-1]["val_nll"]
    assert after < before * 2 / 3, (before, [r["val_nll"] for r in history])
    assert history[-1]["val_ppl"] == math.exp(after)  # the same float64 exp


@pytest.mark.slow
def test_a_run_without_dropout_trains_exactly_what_the_books_recipe_trains(
    multi30k_dir, tmp_path
):
    """training.train_model is tat.train_translator plus what a long run needs: the
    book's model, loss and loop, and a dropout that, off, draws nothing. In float32
    both runs do the same float operations in the same order on the same batches,
    so the weights and the losses agree bit for bit."""
    config = smoke_config(epochs=1, dropout=0.0)
    assert config.precision == "fp32"
    history = training.train_model(config, multi30k_dir, tmp_path, quiet=True)
    book_config = tat.TrainConfig(
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(tat.TrainConfig)}
    )
    data = tat.prepare_data(multi30k_dir, max_train_pairs=config.max_train_pairs)
    model, book_history = tat.train_translator(
        book_config, data, device="cpu", quiet=True
    )
    weights = model.state_dict()
    saved = model_weights(tmp_path / "last.pt")
    assert saved.keys() <= weights.keys()
    for name, tensor in saved.items():
        assert torch.equal(weights[name], tensor), name
    assert [r["epoch"] for r in book_history] == [r["epoch"] for r in history] == [1]
    for key in ("train_loss_smoothed", "val_nll"):
        assert book_history[0][key] == history[0][key]


# ---------------------------------------------------------------------------
# A run's model: the book's, with a dropout that draws its coin more cheaply


def test_fast_dropout_keeps_each_element_with_probability_1_minus_p_and_rescales():
    torch.manual_seed(0)
    drop = run_setup.Dropout(0.1).train()
    x = torch.ones(400_000)
    y = drop(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.9) < 0.003  # 6 standard deviations
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.9))
    assert abs(y.mean().item() - 1.0) < 0.004  # unbiased
    pairs = kept[:-1] & kept[1:]  # neighbours are independent (no shared bits)
    assert abs(pairs.float().mean().item() - 0.81) < 0.004


def test_fast_dropout_gradient_is_the_same_mask_and_eval_mode_is_identity():
    drop = run_setup.Dropout(0.3).train()
    x = torch.randn(50, 40, requires_grad=True)
    y = drop(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (y / x).detach())
    drop.eval()
    assert torch.equal(drop(x), x)
    assert torch.equal(run_setup.Dropout(0.0).train()(x), x)


def test_fast_dropout_mask_is_reproducible_and_matches_nn_dropout_statistics():
    torch.manual_seed(3)
    first = run_setup.dropout_keep_mask(torch.empty(1001), 0.25)
    torch.manual_seed(3)
    assert torch.equal(first, run_setup.dropout_keep_mask(torch.empty(1001), 0.25))
    assert first.shape == (1001,)
    assert torch.allclose(first.unique(), torch.tensor([0.0, 4 / 3]))
    torch.manual_seed(3)
    reference = torch.nn.functional.dropout(torch.ones(200_000), 0.25, training=True)
    ours = run_setup.dropout_keep_mask(torch.empty(200_000), 0.25)
    # Each share of zeros is a binomial mean: standard deviation sqrt(0.25 * 0.75 /
    # 200,000) = 0.00097, so the difference of the two has 0.00137, and 0.01 is 7.3 of
    # those: a wrong rate (0.2 or 0.3) is 36 of them away, a right one never fails.
    assert abs((ours == 0).float().mean() - (reference == 0).float().mean()) < 0.01


def dropouts(model):
    return [m for m in model.modules() if isinstance(m, nn.Dropout)]


@pytest.mark.parametrize("p", [0.0, 0.37])
def test_a_runs_model_is_the_books_with_every_dropout_swapped_keeping_its_p(p):
    """The same weights from the same seed, every dropout (the attention layers'
    too, whose p the book hands to the fused kernel) the cheaper one with its p,
    and in eval mode, where dropout is off, the same function bit for bit."""
    config = settings.RunConfig.from_profile("smoke", dropout=p)
    torch.manual_seed(0)
    book = config.make_model(11, 13)
    before = [(type(m), m.p) for m in dropouts(book)]
    torch.manual_seed(0)
    run = run_setup.make_run_model(config, 11, 13)
    assert before and all(kind is nn.Dropout for kind, _ in before)
    after = dropouts(run)
    assert [type(m) for m in after] == [run_setup.Dropout] * len(before)
    assert [m.p for m in after] == [p for _, p in before]
    attention = [m for m in run.modules() if isinstance(m, tat.MultiHeadedAttention)]
    assert attention and all(type(m.dropout) is run_setup.Dropout for m in attention)
    book_state, run_state = book.state_dict(), run.state_dict()
    assert book_state.keys() == run_state.keys()
    assert all(torch.equal(book_state[k], run_state[k]) for k in book_state)
    src = torch.randint(4, 11, (2, 5))
    tgt = torch.randint(4, 13, (2, 4))
    masks = tat.padding_mask(src, tat.PAD), tat.subsequent_mask(4)
    with torch.no_grad():
        assert torch.equal(run.eval()(src, tgt, *masks), book.eval()(src, tgt, *masks))


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


@pytest.mark.slow
def test_a_bpe_run_saves_its_vocabulary_in_the_checkpoint_and_as_json(bpe_run):
    assert sorted(p.name for p in bpe_run.out.iterdir()) == [
        "bpe.json",
        "epoch_001.pt",
        "last.pt",
    ]
    last = torch.load(bpe_run.out / "last.pt", map_location="cpu", weights_only=True)
    assert last["config"] == bpe_smoke_config().to_dict()
    assert isinstance(last["bpe"], str)
    assert (bpe_run.out / "bpe.json").read_text(encoding="utf-8") == last["bpe"]
    vocab = checkpoints.vocabs_from_checkpoint(last)[0]
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


@pytest.mark.slow
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
