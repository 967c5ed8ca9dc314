"""One writer per run folder (workshop.run.run_lock), and a run killed in the middle of
an epoch that --resume finishes as if nothing happened.

The runs here are real `python -m workshop train` processes (the smoke profile,
1,000 pairs), stopped at an optimizer step the test chooses: a small driver
registers torch's public optimizer-step hook, which at that step either pauses
the process (it holds its folder until the test kills it) or sends it SIGKILL.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO_ROOT, names_in

from workshop.run import checkpoints, run_lock, settings, training

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

# Run as `python -c DRIVER STEP ACTION MARKER ARGS...`: the command line ARGS, with
# optimizer step STEP either pausing the process (ACTION "pause": it writes the file
# MARKER, then sleeps until killed) or killing it (ACTION "kill").
DRIVER = """
import os, signal, sys, time
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
torch.set_num_threads(1)
stop_at, action, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3]
steps = 0
def at_step(optimizer, args, kwargs):
    global steps
    steps += 1
    if steps == stop_at and action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if steps == stop_at:
        open(marker, "w").close()
        while True:
            time.sleep(1)
register_optimizer_step_post_hook(at_step)
from workshop.cli import main
sys.exit(main(sys.argv[4:]))
"""

EPOCHS = 3


def smoke_argv(multi30k_dir, out, *more):
    return [
        "train",
        "--data-dir",
        str(multi30k_dir),
        "--out",
        str(out),
        "--profile",
        "smoke",
        "--epochs",
        str(EPOCHS),
        "--quiet",
        *more,
    ]


def start_stopping_at(step, action, marker, argv):
    """`python -m workshop ARGV` in a process of its own, stopped at `step`."""
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(step), action, str(marker), *argv],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(path, process, timeout=180):
    """Wait until `path` exists, while `process` runs."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def written(run):
    """What a run has written into its folder: checkpoints and vocabularies."""
    return [name for name in names_in(run) if name.endswith((".pt", ".json"))]


def run_script(*args):
    return subprocess.run(
        [sys.executable, "-m", "workshop", *args],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_error_line(result, status):
    assert result.returncode == status, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.slow
def test_a_second_run_into_a_held_folder_is_refused_naming_the_folder(
    multi30k_dir, tmp_path
):
    """The first run holds its folder from before its first write: a second run
    started a moment later (here: while the first trains its first epoch, before
    any checkpoint) is refused in one line naming the folder, and writes nothing.
    Killed, the first lets go: --resume then finds no checkpoint to continue from
    and says so, instead of naming a lock."""
    run, marker = tmp_path / "run", tmp_path / "paused"
    first = start_stopping_at(2, "pause", marker, smoke_argv(multi30k_dir, run))
    try:
        wait_for(marker, first)
        assert written(run) == []  # held, and nothing written yet
        second = run_script(*smoke_argv(multi30k_dir, run, "--max-tokens", "500"))
        line = one_error_line(second, 1)
        assert f"{run} is in use: another process is writing a run there" in line
        resumed = run_script(*smoke_argv(multi30k_dir, run, "--resume"))
        assert f"{run} is in use" in one_error_line(resumed, 1)
        assert written(run) == []
    finally:
        first.kill()
        first.communicate()
    assert first.returncode == -signal.SIGKILL
    after_kill = run_script(*smoke_argv(multi30k_dir, run, "--resume"))
    line = one_error_line(after_kill, 1)
    assert "no " in line and "last.pt to continue from" in line


@pytest.mark.slow
def test_a_run_killed_mid_epoch_resumes_to_the_weights_of_an_uninterrupted_run(
    multi30k_dir, tmp_path
):
    """kill -9 in the middle of epoch 2, then `train --resume`: the weights at the
    end are bit for bit those of the run that was never interrupted. Exact, not
    close: on one thread the resumed epoch redoes the same float operations in the
    same order (epoch_seed's batches and dropout masks; the weights, Adam's moments
    and the schedule restored from float32 tensors), so any difference is a state
    the checkpoint failed to carry."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    config = settings.RunConfig.from_profile("smoke", epochs=EPOCHS, flop_budget=None)
    training.train_model(config, multi30k_dir, whole, quiet=True)
    reference = checkpoints.load_checkpoint(whole / "last.pt")
    per_epoch = reference["train_state"]["accum_step"] // EPOCHS
    stop_at = per_epoch + per_epoch // 2  # the middle of epoch 2
    argv = smoke_argv(multi30k_dir, killed)
    process = start_stopping_at(stop_at, "kill", tmp_path / "unused", argv)
    process.communicate(timeout=300)
    assert process.returncode == -signal.SIGKILL
    assert checkpoints.load_checkpoint(killed / "last.pt")["epoch"] == 0  # epoch 1
    result = run_script(*smoke_argv(multi30k_dir, killed, "--resume"))
    assert result.returncode == 0, result.stderr
    resumed = checkpoints.load_checkpoint(killed / "last.pt")
    assert resumed["epoch"] == reference["epoch"] == EPOCHS - 1
    assert resumed["model"].keys() == reference["model"].keys()
    for name, tensor in reference["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name
    assert resumed["train_state"] == reference["train_state"]


def test_the_lock_is_held_only_while_the_block_runs(tmp_path):
    run_lock.refuse_if_held(tmp_path)  # free: nothing is made to say so
    assert names_in(tmp_path) == []
    with run_lock.hold_run_folder(tmp_path):
        with pytest.raises(run_lock.FolderInUseError, match="is in use"):
            run_lock.refuse_if_held(tmp_path)
        with pytest.raises(run_lock.FolderInUseError):
            with run_lock.hold_run_folder(tmp_path):
                pass
    run_lock.refuse_if_held(tmp_path)  # free again
    assert names_in(tmp_path) == []  # and its file gone
    with run_lock.hold_run_folder(tmp_path):
        pass
