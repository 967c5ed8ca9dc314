"""One process's part of a training run, set up (Run): its data, the book's model
and label-smoothed loss composed with what a run adds, each where the run has it
(a cheaper dropout on a CPU, bfloat16 autocast from workshop.run.precision,
several processes from workshop.run.distributed), the optimizer and schedule, and
where the run stands, new or restored from its last.pt."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from the_annotated_transformer import (
    PAD,
    LabelSmoothing,
    SimpleLossCompute,
    TokenBudgetBatchSampler,
    TrainState,
    count_parameters,
    load_weights,
    make_optimizer,
)
from workshop.run.checkpoints import load_checkpoint, vocabs_from_checkpoint
from workshop.run.distributed import (
    DistributedLossCompute,
    GroupSyncDDP,
    ShardedBatchSampler,
)
from workshop.run.flops import epochs_for_budget, training_flops
from workshop.run.precision import PRECISIONS, Autocast, run_precision, use_tf32
from workshop.run.provenance import invocation
from workshop.run.run_data import data_for_run


class Dropout(nn.Dropout):
    """nn.Dropout, drawing its mask from 16 random bits per element on a CPU.

    nn.Dropout draws one random float per element; on a CPU the generator is then a
    large share of a small model's training step. This draws 64 random bits at a
    time and cuts them into four 16-bit numbers, one per element: the same coin with
    p rounded to a multiple of 1/65536, for a quarter of the generator's work.
    Elsewhere it is nn.Dropout unchanged. (The book's attention in training mode
    hands its dropout's p to PyTorch's fused kernel, which draws its own mask.)
    """

    def forward(self, x):
        if not self.training or not 0.0 < self.p < 1.0 or x.device.type != "cpu":
            return super().forward(x)
        return x * dropout_keep_mask(x, self.p)


def dropout_keep_mask(x, p):
    """A mask like x: 0 with probability p, else 1 / (1 - p) (p in 1/65536 steps)."""
    n = x.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64)
    words.random_(-(2**63), 2**63 - 1)  # uniform over (almost) every int64
    draws = words.view(torch.int16)[:n].view(x.shape)  # uniform in [-32768, 32767]
    dropped = round(p * 65536)  # how many of the 65536 values mean "drop"
    keep = draws >= dropped - 32768
    return keep.to(x.dtype).mul_(65536 / (65536 - dropped))


def make_run_model(config, src_vocab, tgt_vocab):
    """The book's model for `config`, every nn.Dropout in it this module's Dropout
    (same p)."""
    model = config.make_model(src_vocab, tgt_vocab)
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                setattr(module, name, Dropout(child.p, child.inplace))
    return model


def models_for_run(module, amp_dtype=None, distributed=False, device=None):
    """(the model run_epoch trains, the model it evaluates) around the book's
    `module`: under Autocast for a bfloat16 amp_dtype, and the trained one in a
    GroupSyncDDP when `distributed`."""
    evaluated = module if amp_dtype is None else Autocast(module, amp_dtype)
    if not distributed:
        return evaluated, evaluated
    device = torch.device(device or next(module.parameters()).device)
    ids = [device.index] if device.type == "cuda" else None
    # The only buffers are the positional-encoding tables, which never change:
    # nothing to send before each forward pass (DDP still checks them at start).
    trained = GroupSyncDDP(evaluated, device_ids=ids, forward_sync_buffers=False)
    return trained, evaluated


def loss_compute_for_run(generator, criterion, amp_dtype=None, distributed=False):
    """The book's SimpleLossCompute of `generator` and `criterion`, with the
    generator under Autocast for a bfloat16 amp_dtype (the book's loss and NLL
    add their sums in float32), and each micro-batch's norm the mean of the
    processes' when `distributed` (DistributedLossCompute)."""
    if amp_dtype is not None:
        generator = Autocast(generator, amp_dtype)
    loss_compute = SimpleLossCompute(generator, criterion)
    return DistributedLossCompute(loss_compute) if distributed else loss_compute


class Run:
    """One process's part of a run, set up from its Job, new or resumed (from
    job.checkpoint, or from last.pt read here in a spawned process), saying what it
    sets up: its settings (with the epochs a FLOP budget buys), data, model (the
    book's, `module`, whose weights are saved; `model` trains it and `evaluated`
    evaluates it), loss computation, optimizer and schedule, and where the run
    stands."""

    def __init__(self, job):
        config, say, device, checkpoint = job.config, job.say, job.device, None
        if job.resume:  # a spawned process reads its own
            checkpoint = job.checkpoint or load_checkpoint(job.out_dir / "last.pt")
        self.checkpoint = checkpoint  # last.pt as the run resumed from it
        vocabs = checkpoint and vocabs_from_checkpoint(checkpoint)
        self.data = data = data_for_run(job, vocabs or job.vocabs)
        torch.manual_seed(config.seed)
        sizes = len(data.vocab_src), len(data.vocab_tgt)
        self.module = module = make_run_model(config, *sizes).to(device)
        train, budget = data.lengths("train"), config.max_tokens
        whole = TokenBudgetBatchSampler(train, budget, shuffle=False)
        self.epoch_flops = training_flops(module, data.batches("train", whole))
        if config.flop_budget is not None and checkpoint is None:
            epochs = epochs_for_budget(config.flop_budget, self.epoch_flops)
            cost = f"one epoch costs {self.epoch_flops:,.0f}, so {epochs} epochs"
            say(f"training FLOP budget {config.flop_budget:,.0f}: {cost}")
            config = replace(config, epochs=epochs)
        self.config = config
        shard = dict(num_replicas=job.world_size, rank=job.rank, seed=config.seed)
        self.sampler = ShardedBatchSampler(train, budget, **shard)
        val = data.lengths("val")
        self.val_sampler = TokenBudgetBatchSampler(val, budget, shuffle=False)
        steps = config.epochs * math.ceil(len(self.sampler) / config.accum_iter)
        rate = (config.base_lr, config.d_model, config.factor, config.warmup)
        self.optimizer, self.scheduler = make_optimizer(
            module, *rate, total_steps=steps, cooldown=config.cooldown
        )
        self.train_state, self.history = TrainState(), []
        self.start_epoch, self.spent = 0, 0.0  # seconds of earlier invocations
        if checkpoint is not None:  # read_last checked that it holds all this
            load_weights(module, checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.scheduler.load_state_dict(checkpoint["scheduler"])
            self.train_state = TrainState(**checkpoint["train_state"])
            self.start_epoch = checkpoint["epoch"] + 1
            self.history = list(checkpoint["history"])
            self.spent = checkpoint.get("elapsed", 0.0)
            say(
                f"resuming {job.out_dir / 'last.pt'} (profile {config.profile}): "
                f"{self.start_epoch} of {config.epochs} epochs done, "
                f"{self.spent / 60:.1f} min spent"
            )
        say(f"model: {count_parameters(module):,} parameters")
        recorded = None if checkpoint is None else checkpoint.get("precision")
        precision = run_precision(
            config.precision, device, say, job.distributed, recorded
        )
        use_tf32(device, say)
        amp, distributed = PRECISIONS[precision], job.distributed
        self.model, self.evaluated = models_for_run(module, amp, distributed, device)
        criterion = LabelSmoothing(sizes[1], PAD, config.label_smoothing)
        self.loss_compute = loss_compute_for_run(
            module.generator, criterion, amp, distributed
        )
        self.did = None  # what the run did, for the checkpoints rank 0 writes
        if job.rank == 0:
            earlier = [] if checkpoint is None else checkpoint.get("provenance", [])
            this = invocation(device, self.start_epoch + 1)
            self.did = {"precision": precision, "provenance": [*earlier, this]}
