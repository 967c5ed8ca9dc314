"""Training runs on Multi30k: the book's model, loss and loop, run for an hour.

A run trains the book's model with workshop.fast's CPU speed tricks, in bfloat16
where it pays (workshop.precision), in one process or several
(workshop.distributed), and writes a checkpoint every epoch into its folder
(workshop.run_folders), which it holds for itself while it runs
(workshop.run_lock), stopping before its time limit would pass. Its checkpoints
record what it did (workshop.provenance). train_model is the entry; a Job is what
one process of a run needs to know.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

import the_annotated_transformer as tat
from the_annotated_transformer import (
    PAD,
    SimpleLossCompute,
    SubwordVocab,
    TokenBudgetBatchSampler,
    TrainState,
    count_parameters,
    make_optimizer,
    prepare_data,
    run_epoch,
)
from workshop import fast, multi30k
from workshop.checkpoints import (
    load_checkpoint,
    load_weights,
    save_checkpoint,
    vocabs_from_checkpoint,
)
from workshop.distributed import (
    DistributedAutocastLossCompute,
    DistributedLossCompute,
    GroupSyncDDP,
    ShardedBatchSampler,
    check_nprocs,
    device_for,
    epoch_seed,
    spawn,
)
from workshop.errors import DataError
from workshop.flops import epochs_for_budget, training_flops
from workshop.precision import (
    Autocast,
    AutocastLossCompute,
    amp_dtype_for,
    use_tf32,
)
from workshop.provenance import PRECISIONS, invocation, precision_name
from workshop.run_folders import (
    check_resumable,
    check_run_folder,
    last_checkpoint,
    last_epoch_seconds,
    read_last,
    refuse_existing_run,
    resume_config,
    save_epoch,
)
from workshop.run_lock import hold_run_folder, refuse_if_held
from workshop.settings import RunConfig


def check_run_data(config, data_dir):
    """Check the settings, and the train and val files against their published
    digests."""
    config.validate()
    for split in ("train", "val"):
        multi30k.verify_split(data_dir, split)


def build_vocabs(config, data_dir):
    """The run's (vocab_src, vocab_tgt), built from the training split: one joint
    subword vocabulary when vocab is "bpe", the book's word ones else."""
    train = tat.read_split(data_dir, "train")[: config.max_train_pairs]
    if config.vocab == "bpe":
        texts = (text for pair in train for text in pair)
        shared = SubwordVocab.build(texts, config.bpe_vocab_size)
        return shared, shared
    spacy_de, spacy_en = tat.load_tokenizers()
    return tat.build_vocabulary(train, spacy_de, spacy_en, config.min_freq)


@dataclass
class RunData(tat.TranslationData):
    """The book's TranslationData, and how many pairs of each split were cut."""

    cut: dict | None = None  # split name -> pairs longer than max_len ids


def prepare_run_data(config, data_dir, vocabs=None, check=True):
    """The book's prepare_data for a run: the files checked against their published
    digests first (check=False: the caller did), one joint subword vocabulary learned
    when vocab is "bpe", and each pair cut to max_len ids (its </s> kept), counting
    the pairs cut."""
    if check:
        check_run_data(config, data_dir)
    if vocabs is None and config.vocab == "bpe":
        vocabs = build_vocabs(config, data_dir)
    whole = prepare_data(
        data_dir,
        max_len=None,
        min_freq=config.min_freq,
        max_train_pairs=config.max_train_pairs,
        vocabs=vocabs,
    )
    limit = config.max_len

    def fit(ids):  # what the book's encode_text(..., max_len) keeps
        return ids if len(ids) <= limit else [*ids[: limit - 1], tat.EOS]

    splits = {
        split: [(fit(s), fit(t)) for s, t in pairs]
        for split, pairs in whole.splits.items()
    }
    cut = {
        split: sum(max(len(s), len(t)) > limit for s, t in pairs)
        for split, pairs in whole.splits.items()
    }
    return RunData(**{**vars(whole), "splits": splits}, cut=cut)


def make_run_model(config, src_vocab, tgt_vocab):
    """The book's model for `config`, with fast.py's CPU-friendly dropout and its
    packed attention (config.fast_step), or its fused attention (the step as it was
    before issue 43)."""
    model = fast.use_fast_dropout(config.make_model(src_vocab, tgt_vocab))
    if config.fast_step:
        return fast.use_packed_attention(model)
    return fast.use_fused_attention(model)


def models_for_run(
    module, amp_dtype=None, distributed=False, device=None, packed=False
):
    """(the model run_epoch trains, the model it evaluates) around the book's
    `module`: computed on its tokens alone (fast.Packed) when `packed` (a run's
    fast_step: make_run_model gave it packed attention), under Autocast for a
    bfloat16 amp_dtype, and the trained one in a GroupSyncDDP when `distributed`."""
    evaluated = fast.Packed(module) if packed else module
    if amp_dtype is not None:
        evaluated = Autocast(evaluated, amp_dtype)
    trained = evaluated
    if distributed:
        device = torch.device(device or next(module.parameters()).device)
        ids = [device.index] if device.type == "cuda" else None
        # The only buffers are the positional-encoding tables, which never change:
        # nothing to send before each forward pass (DDP still checks them at start).
        trained = GroupSyncDDP(evaluated, device_ids=ids, forward_sync_buffers=False)
    return trained, evaluated


class AutocastPackedLossCompute(AutocastLossCompute, fast.PackedLossCompute):
    """fast.PackedLossCompute under AutocastLossCompute's autocast."""


class DistributedPackedLossCompute(DistributedLossCompute, fast.PackedLossCompute):
    """fast.PackedLossCompute with DistributedLossCompute's norm."""


class DistributedAutocastPackedLossCompute(
    DistributedLossCompute, AutocastPackedLossCompute
):
    """fast.PackedLossCompute with DistributedLossCompute's norm, under autocast."""


LOSS_COMPUTES = {  # (distributed, autocast, packed) -> the class
    (False, False, False): SimpleLossCompute,
    (True, False, False): DistributedLossCompute,
    (False, True, False): AutocastLossCompute,
    (True, True, False): DistributedAutocastLossCompute,
    (False, False, True): fast.PackedLossCompute,
    (True, False, True): DistributedPackedLossCompute,
    (False, True, True): AutocastPackedLossCompute,
    (True, True, True): DistributedAutocastPackedLossCompute,
}


def loss_compute_for_run(
    generator, criterion, amp_dtype=None, distributed=False, packed=False
):
    """The loss computation of a run: the book's SimpleLossCompute, or the subclass
    for autocast and/or several processes that models_for_run's models need; with
    `packed` (a run's fast_step), fast.PackedLossCompute's loss from the scores of
    the tokens alone, else the book's over every row."""
    kind = LOSS_COMPUTES[distributed, amp_dtype is not None, packed]
    if amp_dtype is None:
        return kind(generator, criterion)
    return kind(generator, criterion, amp_dtype)


def duration(seconds):
    """Seconds as m:ss, or h:mm:ss from an hour on, for the training log."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class StepLog:
    """The loss computation of a run's main process, which also writes the training
    log: every log_every micro-batches, the book's step line (step, optimizer
    steps, loss, rate) with the time the epoch has run and an estimate of the time
    to its end (the epoch's batches so far, at their pace). Evaluation (nll) passes
    through. Call start(batches) as each epoch begins; `clock` is for tests."""

    def __init__(
        self, loss_compute, optimizer, train_state, log_every, say, clock=None
    ):
        self.loss_compute, self.criterion = loss_compute, loss_compute.criterion
        self.optimizer, self.state = optimizer, train_state
        self.log_every, self.say = log_every, say
        self.clock = clock or time.perf_counter
        self.start(0)

    def start(self, batches, train_state=None):
        """A new epoch of `batches` micro-batches begins now."""
        self.batches, self.done, self.began = batches, 0, self.clock()
        self.state = train_state or self.state

    def nll(self, x, y):
        return self.loss_compute.nll(x, y)

    def __call__(self, x, y, norm):
        loss, loss_node = self.loss_compute(x, y, norm)
        self.done += 1
        step = self.state.step + 1  # the book's count of this micro-batch, as it
        if step % self.log_every == 1 or self.log_every == 1:  # would print it
            tokens = int((y != self.criterion.padding_idx).sum())
            elapsed = self.clock() - self.began
            left = elapsed / self.done * (self.batches - self.done)
            self.say(
                f"  step {step:6d} | optimizer steps {self.state.accum_step:5d} | "
                f"loss (smoothed) {loss.item() / tokens:7.4f} | lr "
                f"{self.optimizer.param_groups[0]['lr']:.2e} | {duration(elapsed)} "
                f"into the epoch, about {duration(left)} to its end"
            )
        return loss, loss_node


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


def restore(checkpoint, module, optimizer, scheduler, path="last.pt"):
    """Load a run's last.pt into its model, optimizer and schedule; returns the
    (TrainState, first epoch to train, history, seconds spent) it holds. A DataError
    names what `checkpoint` lacks to be resumed, before anything is loaded."""
    check_resumable(checkpoint, path)
    load_weights(module, checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    history = list(checkpoint["history"])
    spent = checkpoint.get("elapsed", 0.0)
    return (
        TrainState(**checkpoint["train_state"]),
        checkpoint["epoch"] + 1,
        history,
        spent,
    )


@dataclass
class Run:
    """One process's part of a run, set up: its settings (with the epochs a FLOP
    budget buys), data, model and what trains it, and where the run stands."""

    config: RunConfig
    data: object  # prepare_run_data's
    module: torch.nn.Module  # the book's model, whose weights are saved
    model: torch.nn.Module  # what trains it (under DDP, autocast)
    evaluated: torch.nn.Module  # what evaluates it
    loss_compute: object  # a StepLog in the main process of a run that is not quiet
    optimizer: torch.optim.Optimizer
    scheduler: object
    sampler: ShardedBatchSampler  # this process's training batches
    val_sampler: TokenBudgetBatchSampler
    epoch_flops: float  # the training FLOPs of one epoch
    train_state: TrainState
    start_epoch: int  # the first epoch to train, 0-based
    history: list  # the per-epoch records, earlier invocations' first
    spent: float  # seconds the run's earlier invocations spent
    did: dict | None  # what the run did, for its checkpoints (written by rank 0)
    checkpoint: dict | None  # last.pt as the run resumed from it; None: a new run


def train(job):
    """One process's part of the run `job` describes; returns the history."""
    run = set_up(job)
    began = time.perf_counter()  # this invocation's clock, which the time limit reads
    # How long the next epoch is expected to take: for a new run nothing yet (its
    # first epoch always starts), for a resumed one the run's last epoch.
    epoch_seconds = last_epoch_seconds(run.history)
    last = run.checkpoint  # what last.pt holds: marked if the time limit stops the run
    for epoch in range(run.start_epoch, run.config.epochs):
        if out_of_time(job, began, epoch_seconds):
            stop_for_time(job, run.config, epoch, last)
            break
        last, epoch_seconds = train_epoch(job, run, epoch, began)
    if job.rank == 0 and last is not None:
        print(saved_line(job.out_dir, last, run.config.epochs, began))
    return run.history


def set_up(job):
    """Set up this process's part of the run `job` describes, new or resumed (from
    job.checkpoint, or from last.pt read here in a spawned process), saying what
    it sets up; returns the Run."""
    config, say, device = job.config, job.say, job.device
    checkpoint = job.checkpoint
    if job.resume and checkpoint is None:  # a spawned process reads its own
        checkpoint = load_checkpoint(job.out_dir / "last.pt")
    data = data_for_run(job, checkpoint)
    torch.manual_seed(config.seed)
    sizes = len(data.vocab_src), len(data.vocab_tgt)
    module = make_run_model(config, *sizes).to(device)  # the book's model, trained
    config, epoch_flops = budgeted_epochs(config, module, data, checkpoint, say)
    sampler = ShardedBatchSampler(
        data.lengths("train"),
        config.max_tokens,
        seed=config.seed,
        num_replicas=job.world_size,
        rank=job.rank,
    )
    optimizer, scheduler = optimizer_for_run(config, module, len(sampler))
    progress = progress_so_far(job, config, checkpoint, module, optimizer, scheduler)
    train_state, start_epoch, history, spent = progress
    say(f"model: {count_parameters(module):,} parameters")
    amp = run_precision(checkpoint, config, device, say, job.distributed)
    use_tf32(device, say)
    did = what_it_did(job, amp, checkpoint, start_epoch)
    model, evaluated = models_for_run(
        module, amp, job.distributed, device, packed=config.fast_step
    )
    loss_compute = logged_loss_compute(job, config, module, amp, optimizer, train_state)
    val_sampler = TokenBudgetBatchSampler(
        data.lengths("val"), config.max_tokens, shuffle=False
    )
    return Run(
        config=config,
        data=data,
        module=module,
        model=model,
        evaluated=evaluated,
        loss_compute=loss_compute,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        val_sampler=val_sampler,
        epoch_flops=epoch_flops,
        train_state=train_state,
        start_epoch=start_epoch,
        history=history,
        spent=spent,
        did=did,
        checkpoint=checkpoint,
    )


def data_for_run(job, checkpoint):
    """The run's data, with the vocabularies of `checkpoint` (a resumed run) or of
    the job (a new one: None builds them), saying what it holds and what was cut."""
    config, say, device = job.config, job.say, job.device
    vocabs = job.vocabs if checkpoint is None else vocabs_from_checkpoint(checkpoint)
    say(f"reading and tokenizing Multi30k from {job.data_dir} ...")
    data = prepare_run_data(config, job.data_dir, vocabs, check=False)
    say(
        f"vocabularies: {len(data.vocab_src)} German, {len(data.vocab_tgt)} English "
        f"tokens; {len(data.splits['train'])} training pairs; device {device}"
        + (f" ({torch.get_num_threads()} thread(s))" if device.type == "cpu" else "")
        + (f" in each of {job.world_size} processes" if job.distributed else "")
    )
    for split, n in (data.cut or {}).items():
        if n:
            say(f"{split}: {n} pairs longer than max_len={config.max_len} ids were cut")
    return data


def budgeted_epochs(config, module, data, checkpoint, say):
    """(config, the training FLOPs of one epoch): a new run with a FLOP budget
    gets the epochs it buys, said in one line; any other config is returned as it
    is."""
    epoch_flops = training_flops(
        module,
        data.batches(
            "train",
            TokenBudgetBatchSampler(
                data.lengths("train"), config.max_tokens, shuffle=False
            ),
        ),
    )
    if config.flop_budget is not None and checkpoint is None:
        epochs = epochs_for_budget(config.flop_budget, epoch_flops)
        say(
            f"training FLOP budget {config.flop_budget:,.0f}: one epoch costs "
            f"{epoch_flops:,.0f}, so {epochs} epochs, {epochs * epoch_flops:,.0f} FLOPs"
        )
        config = replace(config, epochs=epochs)
    return config, epoch_flops


def optimizer_for_run(config, module, batches):
    """The book's Adam and learning-rate schedule for `module`, the schedule
    planned over the run's optimizer steps (`batches` micro-batches an epoch)."""
    steps = config.epochs * math.ceil(batches / config.accum_iter)
    return make_optimizer(
        module,
        config.base_lr,
        config.d_model,
        config.factor,
        config.warmup,
        total_steps=steps,
        cooldown=config.cooldown,
    )


def progress_so_far(job, config, checkpoint, module, optimizer, scheduler):
    """(TrainState, first epoch to train, history, seconds spent): a new run's
    start, or, resuming, what `checkpoint` holds, restored into the model,
    optimizer and schedule and said in one line."""
    if checkpoint is None:
        return TrainState(), 0, [], 0.0
    progress = restore(
        checkpoint, module, optimizer, scheduler, job.out_dir / "last.pt"
    )
    _, start_epoch, _, spent = progress
    job.say(
        f"resuming {job.out_dir / 'last.pt'} (profile {config.profile}): "
        f"{start_epoch} of {config.epochs} epochs done, {spent / 60:.1f} min spent"
    )
    return progress


def logged_loss_compute(job, config, module, amp, optimizer, train_state):
    """The run's loss computation: the book's label-smoothed loss over the target
    vocabulary (under autocast and DDP where the run has them), in the StepLog
    that writes the training log in the main process of a run that is not quiet."""
    vocab_size = module.generator.proj.out_features
    criterion = fast.LabelSmoothing(vocab_size, PAD, config.label_smoothing)
    loss_compute = loss_compute_for_run(
        module.generator, criterion, amp, job.distributed, packed=config.fast_step
    )
    if job.rank == 0 and not job.quiet:  # the main process writes the log
        loss_compute = StepLog(
            loss_compute, optimizer, train_state, config.log_every, job.say
        )
    return loss_compute


def what_it_did(job, amp, checkpoint, start_epoch):
    """The record the run's checkpoints keep of what it did: its precision, and its
    invocations (those of `checkpoint`, and this one's from epoch start_epoch + 1).
    None outside the main process, which alone writes checkpoints."""
    if job.rank != 0:
        return None
    earlier = [] if checkpoint is None else checkpoint.get("provenance", [])
    return {
        "precision": precision_name(amp),
        "provenance": [*earlier, invocation(job.device, start_epoch + 1)],
    }


def stop_for_time(job, config, epoch, last):
    """Say that the time limit stops the run before epoch `epoch` (0-based), and
    how to continue it; the main process marks last.pt (`last`, what it holds, None
    when nothing was saved) with that line."""
    stop = (
        f"time limit: {config.time_limit:g} minutes would pass during epoch "
        f"{epoch + 1}; stopped after {epoch} of the {config.epochs} epochs."
    )
    resume = shlex.join(
        ["python", "-m", "workshop", "train", "--resume"]
        + ["--data-dir", str(job.data_dir), "--out", str(job.out_dir)]
    )
    job.say(
        f"{stop} Continue with `{resume}`: the limit guards one invocation, "
        "so it trains to the end (--time-limit MINUTES sets a limit of its "
        "own)."
    )
    if job.rank == 0 and last is not None:
        save_checkpoint(job.out_dir / "last.pt", last | {"stopped": stop})


def train_epoch(job, run, epoch, began):
    """Train epoch `epoch` (0-based), evaluate it and add its record to
    run.history; the main process saves it (save_epoch). Returns (what last.pt
    now holds, None outside the main process; the seconds all that took). `began`
    is when this invocation began."""
    config, device = run.config, job.device
    epoch_began = time.perf_counter()
    run.sampler.set_epoch(epoch)
    torch.manual_seed(epoch_seed(config.seed, epoch, job.rank))
    job.say(
        f"epoch {epoch + 1}/{config.epochs}: {len(run.sampler)} batches per process"
    )
    if isinstance(run.loss_compute, StepLog):
        run.loss_compute.start(len(run.sampler), run.train_state)
    tokens_before = run.train_state.tokens
    if job.distributed:
        run.model.plan_epoch(len(run.sampler), config.accum_iter)
    train_loss, run.train_state = run_epoch(
        tat.on_device(run.data.batches("train", run.sampler), device),
        run.model,
        run.loss_compute,
        run.optimizer,
        run.scheduler,
        mode="train",  # the main process's StepLog writes the log
        accum_iter=config.accum_iter,
        train_state=run.train_state,
        log_every=config.log_every,
    )
    seconds = time.perf_counter() - epoch_began
    val_nll, _ = run_epoch(
        tat.on_device(run.data.batches("val", run.val_sampler), device),
        run.evaluated,
        run.loss_compute,
        mode="eval",
    )
    tokens = (run.train_state.tokens - tokens_before) * job.world_size
    record = epoch_record(epoch, train_loss, val_nll, seconds, tokens, job.say)
    run.history.append(record | {"training_flops": run.epoch_flops})
    last = None
    if job.rank == 0:
        progress = progress_to_save(run, began)
        last = save_epoch(
            job.out_dir, config, run.data, run.module, epoch, progress, run.did
        )
    return last, time.perf_counter() - epoch_began


def progress_to_save(run, began):
    """What last.pt keeps besides the epoch's checkpoint, for a resume: the
    optimizer, the schedule, the loop's counters, the history and the seconds
    every invocation has spent (this one's since `began`)."""
    return {
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "train_state": asdict(run.train_state),
        "history": run.history,
        "elapsed": run.spent + time.perf_counter() - began,
    }


def saved_line(out_dir, last, epochs, began):
    """The run's last line: what it saved, where, and the command that uses it."""
    done = last["epoch"] + 1
    path = out_dir / "last.pt"
    which = "" if done == epochs else f" of {epochs}"
    use = shlex.join(["python", "-m", "workshop", "translate", "--checkpoint"])
    return (
        f"saved {path} (epoch {done}{which}; this invocation "
        f"{duration(time.perf_counter() - began)}); translate with it: "
        f'{use} {shlex.quote(str(path))} "Ein Satz."'
    )


def epoch_record(epoch, train_loss, val_nll, seconds, tokens, say):
    """The history's entry for one epoch (0-based `epoch`), said in one line."""
    record = {
        "epoch": epoch + 1,
        "train_loss_smoothed": train_loss,
        "val_nll": val_nll,
        "val_ppl": math.exp(val_nll),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }
    say(
        f"epoch {epoch + 1}: train loss (label-smoothed) {train_loss:.3f} | "
        f"validation NLL {val_nll:.3f}, perplexity {record['val_ppl']:.2f} | "
        f"{seconds:.0f} s, {record['tokens_per_s']:.0f} target tokens/s"
    )
    return record


def run_precision(checkpoint, config, device, say, distributed=False):
    """The run's autocast dtype (None: float32): for a new run, what config.bf16
    asks for where it pays (precision.amp_dtype_for); a resumed run keeps the
    precision its last.pt records, and never switches mid-run."""
    recorded = None if checkpoint is None else checkpoint.get("precision")
    if recorded is None:  # a new run (or one saved before runs recorded it)
        return amp_dtype_for(config.bf16, device, say, distributed)
    if recorded not in PRECISIONS:
        raise DataError(
            f"last.pt records the precision {recorded!r}, which this code does not "
            f"know (it knows {', '.join(PRECISIONS)})."
        )
    say(f"precision: {recorded}, as this run began (resumed runs keep it)")
    return PRECISIONS[recorded]


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
    (workshop.run_lock) until it ends.
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
    # Build the vocabularies here, once (the data was checked): every rank gets the
    # same ones. Each process reads last.pt itself: tensors sent to the processes
    # would be shared between them, one optimizer state updated by all.
    vocabs = None
    if job.checkpoint is not None:
        vocabs = vocabs_from_checkpoint(job.checkpoint)
    job.say(f"building the vocabularies from {job.data_dir} ...")
    vocabs = vocabs or build_vocabs(job.config, job.data_dir)
    job = replace(job, vocabs=vocabs, checkpoint=None)
    spawn(train_worker, nprocs, job, on_cpu=device_for(0, device).type == "cpu")
    return load_checkpoint(job.out_dir / "last.pt")["history"]
