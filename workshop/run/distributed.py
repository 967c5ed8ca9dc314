"""Several processes training one model (DistributedDataParallel), around the
book's loss and loop: each process takes its share of the batches
(ShardedBatchSampler), the loss is normalised by every process's tokens
(DistributedLossCompute), and gradients are exchanged once per optimizer step
(GroupSyncDDP). spawn starts the processes on one machine; torchrun works too."""

from __future__ import annotations

import contextlib
import os
import socket
from unittest import mock

import numpy as np
import torch
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from the_annotated_transformer import TokenBudgetBatchSampler, check_positive_int
from workshop.errors import UsageError, checking_input


def mean_over_processes(norm, device):
    """The mean of `norm` over the processes of the default group, as a tensor on
    `device` (no wait for the host: the division happens on the device)."""
    # float32 counts tokens exactly up to 2**24 (16 million) a group.
    total = torch.as_tensor(norm, dtype=torch.float32, device=device).clone()
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM)
    return total / torch.distributed.get_world_size()


class DistributedLossCompute:
    """A loss computation (the book's SimpleLossCompute, or one like it) for one of
    several data-parallel processes.

    The book's loop divides each micro-batch's summed loss by its group's target
    tokens, `norm`. DistributedDataParallel then averages the gradients over the
    world_size processes, so dividing by the mean of the processes' `norm`s instead
    makes the gradient the mean over every token of the global group, however the
    tokens fall among the processes. Every process calls this as often as the others
    (ShardedBatchSampler gives each the same number of batches), so the exchange of
    the counts never waits forever. Evaluation (nll) exchanges nothing.
    """

    def __init__(self, loss_compute):
        self.loss_compute, self.criterion = loss_compute, loss_compute.criterion
        self.nll = loss_compute.nll

    def __call__(self, x, y, norm):
        return self.loss_compute(x, y, mean_over_processes(norm, x.device))


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
        self.n_batches, self.accum_iter, self.seen = n_batches, accum_iter, 0

    def forward(self, *args, **kwargs):
        planned = self.training and self.n_batches is not None
        self.seen += planned
        # The epoch's last group may be short: its last micro-batch exchanges too.
        ends = not planned or self.seen % self.accum_iter == 0
        ends = ends or self.seen >= self.n_batches
        with contextlib.nullcontext() if ends else self.no_sync():
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
        if (n := len(lengths)) < num_replicas:
            raise ValueError(f"{n} examples: fewer than {num_replicas} processes.")
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
        device = torch.device("meta")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"{text!r} is not cpu, cuda, cuda:N or mps")
    if device.type == "mps" and not torch.backends.mps.is_available():
        gone = "MPS (the GPU of Apple silicon) is not available here"
        raise UsageError(f"{gone}; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= count:
        have = f"cuda:0 to cuda:{count - 1}" if count else "no CUDA GPU"
        raise UsageError(f"CUDA is not available as {text} ({have}); use --device cpu")
    return torch.device("mps") if device.type == "mps" else device


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
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_nprocs(nprocs, device=None):
    """Refuse more processes than the GPUs of a run on GPUs (the default where there
    are any), the cores of a run on the CPU, or one on MPS."""
    with checking_input():
        check_positive_int(nprocs=nprocs)
    have, what = {
        "cuda": (torch.cuda.device_count(), "GPUs (or use --device cpu)"),
        "mps": (1, "MPS device: on MPS a run trains in one process (or --device cpu)"),
    }.get(device_for(0, device).type, (os.cpu_count() or 1, "CPU cores"))
    if nprocs > have:
        ask = f"--nprocs {nprocs}: this machine has {have} {what}"
        raise UsageError(f"{ask}; ask for at most {have} processes.")


def spawn(worker, nprocs, *args, on_cpu=True):
    """Run worker(rank, nprocs, *args) in `nprocs` new processes of this machine,
    which meet at a free local port, and wait for them all."""
    meet = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    meet = {key: value for key, value in meet.items() if key not in os.environ}
    with mock.patch.dict(os.environ, meet):  # the caller's environment kept as it was
        mp.spawn(start_process, nprocs=nprocs, args=(worker, nprocs, args, on_cpu))


def start_process(rank, worker, world_size, args, on_cpu=True):
    """One spawned process: on a CPU, its share of the cores (processes with two
    threads each on two cores would take turns), then the worker."""
    if on_cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    return worker(rank, world_size, *args)
