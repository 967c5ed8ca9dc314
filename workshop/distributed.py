"""Several processes training one model (DistributedDataParallel), around the
book's loss and loop: each process takes its share of the batches
(ShardedBatchSampler), the loss is normalised by every process's tokens
(DistributedLossCompute), and gradients are exchanged once per optimizer step
(GroupSyncDDP). spawn starts the processes on one machine; torchrun works too."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from the_annotated_transformer import (
    SimpleLossCompute,
    TokenBudgetBatchSampler,
    check_positive_int,
)
from workshop.errors import UsageError, checking_input
from workshop.precision import AutocastLossCompute


def mean_over_processes(norm, device):
    """The mean of `norm` over the processes of the default group, as a tensor on
    `device` (no wait for the host: the division happens on the device)."""
    # float32 counts tokens exactly up to 2**24 (16 million) a group.
    total = torch.as_tensor(norm, dtype=torch.float32, device=device).clone()
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM)
    return total / torch.distributed.get_world_size()


class DistributedLossCompute(SimpleLossCompute):
    """The book's SimpleLossCompute for one of several data-parallel processes.

    The book's loop divides each micro-batch's summed loss by its group's target
    tokens, `norm`. DistributedDataParallel then averages the gradients over the
    world_size processes, so dividing by the mean of the processes' `norm`s instead
    makes the gradient the mean over every token of the global group, however the
    tokens fall among the processes. Every process calls this as often as the others
    (ShardedBatchSampler gives each the same number of batches), so the exchange of
    the counts never waits forever. Evaluation (nll) exchanges nothing.
    """

    def __call__(self, x, y, norm):
        return super().__call__(x, y, mean_over_processes(norm, x.device))


class DistributedAutocastLossCompute(DistributedLossCompute, AutocastLossCompute):
    """DistributedLossCompute's norm, with AutocastLossCompute's autocast."""


class GroupSyncDDP(DistributedDataParallel):
    """DistributedDataParallel that exchanges gradients once per optimizer step.

    The micro-batches of one group (every accum_iter batches, and the epoch's last,
    partial one) add up their gradients, and only the one that ends the group needs
    the exchange: the forward pass of every other micro-batch in training mode runs
    inside DDP's no_sync() (its backward pass, which run_epoch starts after the
    forward pass returns, then keeps its gradients to itself, as no_sync's
    documentation describes). Call plan_epoch before each epoch; without a plan
    every micro-batch exchanges, as in plain DDP.
    """

    def __init__(self, module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        self.n_batches, self.accum_iter, self.seen = None, 1, 0  # no plan yet

    def plan_epoch(self, n_batches, accum_iter):
        """Expect an epoch of `n_batches` micro-batches in groups of `accum_iter`."""
        check_positive_int(n_batches=n_batches, accum_iter=accum_iter)
        self.n_batches, self.accum_iter, self.seen = n_batches, accum_iter, 0

    def forward(self, *args, **kwargs):
        if self.training and self.n_batches is not None:
            self.seen += 1
            last = self.seen >= self.n_batches  # the epoch's last group may be short
            if not (self.seen % self.accum_iter == 0 or last):
                with self.no_sync():
                    return super().forward(*args, **kwargs)
        return super().forward(*args, **kwargs)


def even_out(batches, num_replicas):
    """Make the number of batches a multiple of num_replicas: split the largest batch
    in two until it is; when every batch holds one pair, repeat the first few."""
    while len(batches) % num_replicas:
        biggest = max(range(len(batches)), key=lambda i: len(batches[i]))
        if len(batches[biggest]) < 2:  # one pair per batch: repeat a few
            short = num_replicas - len(batches) % num_replicas
            return batches + [list(b) for b in batches[:short]]
        half = len(batches[biggest]) // 2
        batch = batches[biggest]
        batches[biggest : biggest + 1] = [batch[:half], batch[half:]]
    return batches


class ShardedBatchSampler(TokenBudgetBatchSampler):
    """The book's token-budget batches, shared among `num_replicas` data-parallel
    processes: process `rank` takes every num_replicas-th batch of the epoch.

    Every process must get the same number of batches: each optimizer step ends in
    an exchange of gradients that waits for all of them, so a process with one batch
    more would wait forever. even_out splits batches until the count divides evenly;
    the processes together still cover every pair once, except when no batch can be
    split (each holds one pair) and a few are repeated, as PyTorch's
    DistributedSampler does.
    """

    def __init__(self, lengths, max_tokens, *, num_replicas=1, rank=0, **options):
        check_positive_int(num_replicas=num_replicas)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}.")
        if len(lengths) < num_replicas:
            raise ValueError(
                f"{len(lengths)} examples cannot be shared by {num_replicas} processes."
            )
        super().__init__(lengths, max_tokens, **options)
        self.num_replicas, self.rank = num_replicas, rank

    def all_batches(self):
        """Every process's batches for the current epoch, in order."""
        return even_out(super().all_batches(), self.num_replicas)

    def __iter__(self):
        return iter(self.all_batches()[self.rank :: self.num_replicas])

    def __len__(self):
        return len(self.all_batches()) // self.num_replicas


def epoch_seed(seed, epoch, rank=0):
    """The seed of one process's epoch: distinct for every (seed, epoch, rank)."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


def parse_device(text):
    """`text` ("cpu", "cuda", "cuda:1", "mps") as a device this machine has; a
    UsageError that says what is wrong otherwise. MPS (Apple silicon's GPU) trains
    and translates in float32."""
    try:
        device = torch.device(text)
    except RuntimeError:  # not a device torch knows
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"{text!r} is not cpu, cuda, cuda:N or mps")
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise UsageError(
                "MPS (the GPU of Apple silicon, macOS 12.3 or later) is not "
                "available on this machine; use --device cpu"
            )
        return torch.device("mps")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and count == 0:
        raise UsageError("CUDA is not available on this machine; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= count:
        raise UsageError(f"this machine has cuda:0 to cuda:{count - 1}")
    return device


def device_for(rank, device=None):
    """The device of process `rank`: `device` as given ("cpu", "cuda:1"), a GPU of
    its own for "cuda" or, when none is named, the GPUs if there are any."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_nprocs(nprocs, device=None):
    """Refuse more processes than the GPUs of a run on GPUs (the default where there
    are any) or the cores of a run on the CPU."""
    with checking_input():
        check_positive_int(nprocs=nprocs)
    if device_for(0, device).type == "mps" and nprocs > 1:
        raise UsageError(
            f"--nprocs {nprocs}: several processes need CPU cores or CUDA GPUs; on "
            "MPS a run trains in one process (or use --device cpu)."
        )
    if device_for(0, device).type == "cuda":
        have, what, instead = torch.cuda.device_count(), "GPUs", " (or --device cpu)"
    else:
        have, what, instead = os.cpu_count() or 1, "CPU cores", ""
    if nprocs > have:
        raise UsageError(
            f"--nprocs {nprocs}: this machine has {have} {what}; ask for at most "
            f"{have} processes{instead}."
        )


def spawn(worker, nprocs, *args, on_cpu=True):
    """Run worker(rank, nprocs, *args) in `nprocs` new processes of this machine,
    which meet at a free local port, and wait for them all. Processes on the CPU
    share its cores."""
    import torch.multiprocessing as mp

    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    saved = {key: os.environ.get(key) for key in rendezvous}
    os.environ.update({k: v for k, v in rendezvous.items() if saved[k] is None})
    try:
        mp.spawn(start_process, nprocs=nprocs, args=(worker, nprocs, args, on_cpu))
    finally:  # leave the caller's environment as it was
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)


def start_process(rank, worker, world_size, args, on_cpu=True):
    """One spawned process: on a CPU, its share of the cores (processes with two
    threads each on two cores would take turns), then the worker."""
    if on_cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    return worker(rank, world_size, *args)
