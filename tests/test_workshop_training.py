"""Training runs (workshop.run.training): a run killed and resumed, a run that
learns, trains what the book's recipe trains, spends a FLOP budget, stops at its
time limit, trains in bfloat16 and records what it did. The runs find Multi30k
through $ANNOTATED_TRANSFORMER_DATA: without it they are skipped on a laptop, but
fail in CI (CI=true)."""

import dataclasses
import math
import os
import platform
import shutil
import signal
import subprocess
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO_ROOT, smoke_config
from torch.multiprocessing import ProcessExitedException, spawn
from torch.optim.optimizer import register_optimizer_step_post_hook

import the_annotated_transformer as tat
from workshop.run import precision, run_lock, run_setup, training
from workshop.run.checkpoints import load_checkpoint, save_checkpoint
from workshop.run.provenance import describe_machine

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def load(folder, name="last.pt"):
    return load_checkpoint(folder / name)


def killed_run(rank, step, config, data_dir, out_dir):
    """A new run in a process of its own, on hardware said to lack bfloat16, killed
    (kill -9) at its optimizer step `step`."""
    torch.set_num_threads(1)
    precision.hardware_bf16 = lambda device: (False, "it lacks")
    steps = []

    def at_step(*args):
        steps.append(1)
        if len(steps) == step:
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_post_hook(at_step)
    training.train_model(config, data_dir, out_dir, quiet=True)


@pytest.fixture(scope="module")
def runs(one_cpu_thread, smoke_run, multi30k_dir, tmp_path_factory):
    """A new run trained straight through, and the same run killed in the middle of
    its second epoch, then resumed. Both are given a FLOP budget of two and a half
    epochs (of the session's smoke run, the same model on the same data), a
    cooldown, and precision "auto" on hardware said to lack bfloat16; the resumed
    run's hardware is never asked. Here, before it writes an epoch, each checks
    that it holds its folder."""
    flops = smoke_run.history[0]["training_flops"]
    budget = dict(flop_budget=2.5 * flops, cooldown=0.5, precision="auto")
    config = smoke_config(epochs=7, **budget)
    whole, killed = (tmp_path_factory.mktemp(name) for name in ("whole", "killed"))
    held, save_epoch = [], training.save_epoch

    def holding_save_epoch(out_dir, *args):
        with pytest.raises(run_lock.FolderInUseError):
            run_lock.refuse_if_held(out_dir)
        held.append(out_dir)
        return save_epoch(out_dir, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training, "save_epoch", holding_save_epoch)
        patch.setattr(precision, "hardware_bf16", lambda device: (False, "it lacks"))
        history = training.train_model(config, multi30k_dir, whole, quiet=True)
        step = load(whole)["train_state"]["accum_step"] * 3 // 4  # in epoch 2 of 2
        with pytest.raises(ProcessExitedException, match="signal SIGKILL"):
            spawn(killed_run, (step, config, multi30k_dir, killed))
        epoch_at_kill = load(killed)["epoch"]
        patch.setattr(precision, "hardware_bf16", None)  # asking it would fail
        training.train_model(None, multi30k_dir, killed, resume=True, quiet=True)
    return SimpleNamespace(**locals())


@pytest.mark.slow
def test_a_run_killed_mid_epoch_resumes_to_the_weights_of_an_uninterrupted_run(runs):
    """A run holds its folder whenever it writes (each checked it here), and one
    killed lets go of it for its --resume. Exact, not close: on one thread the
    resumed epoch redoes the same float operations in the same order (the batches
    and dropout masks of epoch_seed, in either process; the weights, Adam's moments
    and the schedule restored from float32 tensors), so any difference is a state
    the checkpoint failed to carry."""
    assert runs.held == [runs.whole, runs.whole, runs.killed]
    assert runs.epoch_at_kill == 0  # last.pt held the first epoch
    whole, resumed = load(runs.whole), load(runs.killed)
    assert resumed["model"].keys() == whole["model"].keys() and resumed["epoch"] == 1
    assert all(torch.equal(resumed["model"][k], w) for k, w in whole["model"].items())
    assert resumed["train_state"] == whole["train_state"]


@pytest.mark.slow
def test_a_flop_budget_buys_the_whole_epochs_it_pays_for(runs):
    assert [epoch["training_flops"] for epoch in runs.history] == [runs.flops] * 2


@pytest.mark.slow
def test_a_cooldown_brings_the_rate_to_zero_at_the_runs_last_step(runs):
    for folder in (runs.whole, runs.killed):
        assert load(folder)["optimizer"]["param_groups"][0]["lr"] == 0.0


@pytest.mark.slow
def test_a_run_records_its_precision_and_where_it_ran_and_a_resume_keeps_both(runs):
    """precision "auto" asks and the hardware decides; the checkpoints record what
    was used, with torch's and Python's versions, the commit and the machine. The
    resumed run keeps the precision without asking, and adds its own record."""
    whole, epoch = load(runs.whole), load(runs.whole, "epoch_002.pt")
    resumed = load(runs.killed)
    assert whole["config"]["precision"] == "auto"  # what was asked
    assert whole["precision"] == epoch["precision"] == resumed["precision"] == "float32"
    (first,) = epoch["provenance"]
    ran = (first["torch"], first["python"], first["machine"], first["device"])
    machine = describe_machine("cpu")  # on the run's one thread
    assert ran == (torch.__version__, platform.python_version(), machine, "cpu")
    git = ["git", "rev-parse", "HEAD"]
    head = subprocess.run(git, cwd=REPO_ROOT, capture_output=True, text=True).stdout
    assert first["commit"] == (head.strip() or None) and whole["provenance"] == [first]
    assert [run["first_epoch"] for run in resumed["provenance"]] == [1, 2]


@pytest.mark.slow
def test_a_bf16_run_trains_under_autocast_and_its_time_limit_stops_it_saying_so(
    multi30k_dir, tmp_path, monkeypatch, capsys
):
    """A new run's first epoch always runs (nothing says yet how long it takes);
    the next would pass the limit. The run says so, marks last.pt, and records the
    precision it trained in, its weights kept in float32."""
    made, models_for_run = [], run_setup.models_for_run

    def recording(*args):
        made.append(models_for_run(*args))
        return made[-1]

    monkeypatch.setattr(run_setup, "models_for_run", recording)
    config = smoke_config(epochs=3, time_limit=1e-6, precision="bf16")  # minutes
    history = training.train_model(config, multi30k_dir, tmp_path)
    said, last = capsys.readouterr().out, load(tmp_path)
    assert len(history) == 1 and last["stopped"] in said
    assert "stopped after 1 of the 3 epochs" in last["stopped"] and last["epoch"] == 0
    assert "precision: bfloat16 (--precision bf16)" in said
    assert [type(model) for model in made[0]] == [precision.Autocast] * 2
    assert last["precision"] == "bfloat16"
    assert all(weight.dtype == torch.float32 for weight in last["model"].values())


def test_a_resume_reads_last_pt_once_and_starts_no_epoch_its_time_limit_cannot_hold(
    smoke_run, multi30k_dir, tmp_path, monkeypatch
):
    """The run's last epoch is recorded as a minute long and the limit is a minute:
    the resume sets itself up from one read of last.pt, then stops before an
    epoch and marks last.pt."""
    run = shutil.copytree(smoke_run.out, tmp_path / "run")
    last = load(run)
    last["history"][-1]["seconds"] = 60.0
    save_checkpoint(run / "last.pt", last)
    reads, torch_load = [], torch.load
    monkeypatch.setattr(
        torch, "load", lambda f, **kw: reads.append(f) or torch_load(f, **kw)
    )
    limit = {"epochs": 3, "time_limit": 1}
    training.train_model(
        None, multi30k_dir, run, resume=True, changes=limit, quiet=True
    )
    assert reads == [run / "last.pt"]
    assert "stopped after 2 of the 3 epochs" in load(run)["stopped"]


def test_a_run_lowers_the_validation_nll_by_a_third_from_an_untrained_models(
    smoke_run,
):
    """An untrained model's logits hardly depend on the target word, so its NLL is
    at least about log |V| (a log-sum-exp is at least the mean plus log |V|); the
    session's smoke run, 34 steps, takes it from there to under two thirds."""
    after = smoke_run.history[-1]["val_nll"]
    assert after < 2 / 3 * math.log(len(load(smoke_run.out)["vocab_tgt"]))
    assert smoke_run.history[-1]["val_ppl"] == math.exp(after)


@pytest.mark.slow
def test_a_run_without_dropout_trains_exactly_what_the_books_recipe_trains(
    multi30k_dir, tmp_path
):
    """train_model is tat.train_translator plus what a long run needs: the book's
    model, loss and loop, and a dropout that, off, draws nothing. In float32 both
    runs do the same float operations in the same order on the same batches, so
    the weights and the losses agree bit for bit."""
    config = smoke_config(epochs=1, dropout=0.0)
    history = training.train_model(config, multi30k_dir, tmp_path, quiet=True)
    fields = dataclasses.fields(tat.TrainConfig)
    book = tat.TrainConfig(**{f.name: getattr(config, f.name) for f in fields})
    data = tat.prepare_data(multi30k_dir, max_train_pairs=config.max_train_pairs)
    model, book_history = tat.train_translator(book, data, device="cpu", quiet=True)
    weights = model.state_dict()
    assert all(torch.equal(weights[k], w) for k, w in load(tmp_path)["model"].items())
    losses = [(r["train_loss_smoothed"], r["val_nll"]) for r in history]
    assert losses == [(r["train_loss_smoothed"], r["val_nll"]) for r in book_history]
