"""Training runs on Multi30k: the book's model, loss and loop, run for an hour.

A run trains in one process or several (workshop.run.distributed), each process
set up by workshop.run.run_setup, and writes a checkpoint every epoch into its
folder (workshop.run.run_folders), which it holds for itself while it runs
(workshop.run.run_lock), stopping before its time limit would pass. train_model is
the entry; a Job is what one process of a run needs to know.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch

from the_annotated_transformer import on_device, run_epoch
from workshop.run.checkpoints import load_checkpoint, save_checkpoint
from workshop.run.distributed import check_nprocs, device_for, epoch_seed, spawn
from workshop.run.run_data import build_vocabs, check_run_data
from workshop.run.run_folders import (
    check_run_folder,
    last_checkpoint,
    read_last,
    refuse_existing_run,
    resume_config,
    save_epoch,
)
from workshop.run.run_lock import hold_run_folder, refuse_if_held
from workshop.run.run_setup import Run
from workshop.run.settings import RunConfig


def train_model(
    config,
    data_dir,
    out_dir,
    *,
    resume=False,
    nprocs=1,
    quiet=False,
    device=None,
    changes=None,
):
    """Train on Multi30k in this process, under torchrun, or in `nprocs` processes.

    A new run needs a folder that holds no run; `resume=True` continues the run in
    `out_dir` (config None: its own settings, with `changes`, a dict, applied where
    settings.RESUMABLE allows; a RunConfig: it may differ in those alone).
    `device` ("cpu", "cuda", "cuda:1", "mps") defaults to the GPUs where there are
    any; several processes on "cuda" take one GPU each.

    Everything is checked before anything is written, the folder made or held:
    the settings, the data, and the folder (no other run in it, or, resuming, a
    last.pt that can be resumed). Then the run holds the folder for itself
    (workshop.run.run_lock) until it ends.
    """
    out_dir, data_dir = Path(out_dir), Path(data_dir)
    check_run_folder(out_dir)
    check_nprocs(nprocs, device)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    writes = not torchrun or int(os.environ["RANK"]) == 0  # the others only read
    advice = "continue it with --resume, or give another --out for a new run."
    if writes:
        refuse_if_held(out_dir)  # said first: whatever the folder holds may change
    if resume:
        changes = config.to_dict() if config is not None else (changes or {})
        last_checkpoint(out_dir)  # there is one to resume, or say so
    else:
        config.validate()
        refuse_existing_run(out_dir, advice)
        check_run_data(config, data_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
    with hold_run_folder(out_dir) if writes else contextlib.nullcontext():
        checkpoint = None
        if resume:  # read under the lock: last.pt as no other run will change it
            checkpoint = read_last(out_dir)
            config = resume_config(out_dir, checkpoint, **changes)
            check_run_data(config, data_dir)
        else:
            refuse_existing_run(out_dir, advice)  # one begun since the check above
        job = Job(config, data_dir, out_dir, resume, checkpoint, quiet, device=device)
        return _train_processes(job, nprocs, torchrun)


def _train_processes(job, nprocs, torchrun):
    """Run `job` in this process (alone, or as one of torchrun's), or spawn
    `nprocs` processes for it; returns the history."""
    device = job.device
    if torchrun:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = device_for(int(os.environ.get("LOCAL_RANK", rank)), device)
        return train_worker(rank, world, replace(job, device=local))
    if nprocs == 1:
        return train_worker(0, 1, job)
    # A new run's vocabularies are built here once, for every rank. Each process
    # reads last.pt itself: tensors sent to the processes would be shared between
    # them, one optimizer state updated by all.
    vocabs = None if job.checkpoint else build_vocabs(job.config, job.data_dir)
    job = replace(job, checkpoint=None, vocabs=vocabs)
    spawn(train_worker, nprocs, job, on_cpu=device_for(0, device).type == "cpu")
    return load_checkpoint(job.out_dir / "last.pt")["history"]


@dataclass
class Job:
    """What one process of a training run needs to know: the run's settings and
    folders, and which of the run's processes it is."""

    config: RunConfig
    data_dir: Path
    out_dir: Path
    resume: bool = False  # continue the run in out_dir
    # last.pt as this process read it, resuming (None in a spawned process: it
    # reads its own)
    checkpoint: dict | None = None
    quiet: bool = False
    vocabs: tuple | None = None  # (vocab_src, vocab_tgt), built once for every rank
    rank: int = 0
    world_size: int = 1
    device: torch.device | None = None

    @property
    def distributed(self):
        return self.world_size > 1

    def say(self, *args):
        """print, in the main process of a run that is not quiet."""
        if self.rank == 0 and not self.quiet:
            print(*args)


def train_worker(rank, world_size, job):
    """Train process `rank` of `world_size` (joining the others when there are
    several); returns the per-epoch history."""
    device = device_for(rank, job.device)
    job = replace(job, rank=rank, world_size=world_size, device=device)
    if job.distributed:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        return train(job)
    finally:
        if job.distributed:
            torch.distributed.destroy_process_group()


def train(job):
    """One process's part of the run `job` describes; returns the history."""
    run = Run(job)
    config = run.config
    began = time.perf_counter()  # this invocation's clock, which the time limit reads
    # How long the next epoch is expected to take: for a new run nothing yet (its
    # first epoch always starts), for a resumed one the run's last epoch.
    seconds = run.history[-1]["seconds"] if run.history else 0.0
    last = run.checkpoint  # what last.pt holds: marked if the time limit stops the run
    for epoch in range(run.start_epoch, config.epochs):
        if out_of_time(job, began, seconds):
            stop = (
                f"time limit: {config.time_limit:g} minutes would pass during epoch "
                f"{epoch + 1}; stopped after {epoch} of the {config.epochs} epochs."
            )
            resume = ["python", "-m", "workshop", "train", "--resume", "--data-dir"]
            resume = [*resume, str(job.data_dir), "--out", str(job.out_dir)]
            job.say(
                f"{stop} Continue with `{shlex.join(resume)}` (it trains to the end)."
            )
            if job.rank == 0 and last is not None:
                save_checkpoint(job.out_dir / "last.pt", last | {"stopped": stop})
            break
        epoch_began = time.perf_counter()
        last = train_epoch(job, run, epoch, began)
        seconds = time.perf_counter() - epoch_began
    if job.rank == 0 and last is not None:
        done, path = last["epoch"] + 1, job.out_dir / "last.pt"
        which = "" if done == config.epochs else f" of {config.epochs}"
        spent = timedelta(seconds=round(time.perf_counter() - began))
        use = shlex.join(["python", "-m", "workshop", "translate", "--checkpoint"])
        print(
            f"saved {path} (epoch {done}{which}; this invocation {spent}); translate "
            f'with it: {use} {shlex.quote(str(path))} "Ein Satz."'
        )
        score = ["python", "-m", "workshop", "evaluate", "--checkpoint", str(path)]
        print(f"score it: {shlex.join(score)}")
    return run.history


def train_epoch(job, run, epoch, began):
    """Train epoch `epoch` (0-based), evaluate it and add its record to
    run.history, said in one line; the main process saves it (save_epoch) and
    returns what last.pt now holds (None elsewhere). `began` is when this
    invocation began."""
    config, device, epoch_began = run.config, job.device, time.perf_counter()
    run.sampler.set_epoch(epoch)
    torch.manual_seed(epoch_seed(config.seed, epoch, job.rank))
    job.say(
        f"epoch {epoch + 1}/{config.epochs}: {len(run.sampler)} batches per process"
    )
    tokens_before = run.train_state.tokens
    if job.distributed:
        run.model.plan_epoch(len(run.sampler), config.accum_iter)
    train_loss, run.train_state = run_epoch(
        on_device(run.data.batches("train", run.sampler), device),
        run.model,
        run.loss_compute,
        run.optimizer,
        run.scheduler,
        mode="train" if job.quiet or job.rank else "train+log",
        accum_iter=config.accum_iter,
        train_state=run.train_state,
        log_every=config.log_every,
    )
    seconds = time.perf_counter() - epoch_began
    val_nll, _ = run_epoch(
        on_device(run.data.batches("val", run.val_sampler), device),
        run.evaluated,
        run.loss_compute,
        mode="eval",
    )
    tokens = (run.train_state.tokens - tokens_before) * job.world_size
    record = dict(epoch=epoch + 1, train_loss_smoothed=train_loss, val_nll=val_nll)
    record |= dict(val_ppl=math.exp(val_nll), seconds=seconds)
    record |= dict(tokens_per_s=tokens / seconds, training_flops=run.epoch_flops)
    run.history.append(record)
    job.say(
        f"epoch {epoch + 1}: train loss (label-smoothed) {train_loss:.3f} | "
        f"validation NLL {val_nll:.3f}, perplexity {record['val_ppl']:.2f} | "
        f"{seconds:.0f} s, {record['tokens_per_s']:.0f} target tokens/s"
    )
    if job.rank != 0:
        return None
    progress = {  # what last.pt keeps besides the epoch's checkpoint
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "train_state": asdict(run.train_state),
        "history": run.history,
        "elapsed": run.spent + time.perf_counter() - began,  # every invocation's
    }
    return save_epoch(
        job.out_dir, config, run.data, run.module, epoch, progress, run.did
    )


def out_of_time(job, began, epoch_seconds):
    """Would one more epoch, as long as the last, end after the time limit?

    The time limit guards one invocation: `began` is when this one started, and
    `epoch_seconds` how long the last epoch took (for the first epoch of a resumed
    invocation, the run's last one, as recorded; resume_config refuses a resume
    that this would stop at once). A new run's first epoch always starts
    (epoch_seconds 0): nothing says yet how long it takes. Under DDP every process
    must agree, so the slowest one's answer counts.
    """
    if job.config.time_limit is None or epoch_seconds == 0:
        return False
    elapsed = time.perf_counter() - began
    late = torch.tensor(float(elapsed + epoch_seconds > 60 * job.config.time_limit))
    if job.distributed:
        late = late.to(job.device)
        torch.distributed.all_reduce(late, op=torch.distributed.ReduceOp.MAX)
    return bool(late.item())
