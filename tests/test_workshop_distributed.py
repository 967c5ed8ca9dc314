"""Several processes (workshop.run.distributed): the loss's norm over processes, one
gradient exchange per optimizer step, two processes end to end, and the batches
shared among them."""

import math
import os
import random
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import (
    REPO_ROOT,
    free_port,
    smoke_config,
)

import the_annotated_transformer as tat
from workshop.run import checkpoints, distributed, run_setup, training

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


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


def simple_loss(model):
    return tat.SimpleLossCompute(model.generator, ddp_criterion())


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
    model = distributed.GroupSyncDDP(module)
    seen = []  # DDP's public switch, as each forward pass of the module finds it
    module.register_forward_pre_hook(
        lambda *_: seen.append(model.require_backward_grad_sync)
    )
    model.plan_epoch(n_batches, accum_iter=2)
    loss_compute = distributed.DistributedLossCompute(simple_loss(module))
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


def counting_exchanges(model):
    """Count the gradient exchanges `model` (DDP) starts, through DDP's public
    communication hook; each does what DDP would do without the hook."""
    exchanges = []

    def hook(state, bucket):
        exchanges.append(bucket.index())
        return (
            torch.distributed.all_reduce(bucket.buffer(), async_op=True)
            .get_future()
            .then(lambda fut: fut.value()[0])
        )

    model.register_comm_hook(None, hook)
    return exchanges


@pytest.mark.parametrize("plan, exchanges", [(True, 2), (False, 4)])
def test_gradients_are_exchanged_once_per_optimizer_step(
    one_process_group, plan, exchanges
):
    """Four micro-batches in groups of two: with a plan, DDP's no_sync() keeps the
    first of each group's gradients to itself, so there are two exchanges (of the
    model's one bucket); without one, every backward pass exchanges."""
    module = ddp_test_model()
    model = distributed.GroupSyncDDP(module)
    seen = counting_exchanges(model)
    if plan:
        model.plan_epoch(4, accum_iter=2)
    loss_compute = distributed.DistributedLossCompute(simple_loss(module))
    sgd_epoch(model, module, loss_compute, ddp_halves() * 2, accum_iter=2)
    assert len(seen) == exchanges and set(seen) == {0}


def test_the_runs_ddp_model_is_built_without_a_deprecation_warning(
    one_process_group, recwarn
):
    """The run's DDP leaves its buffers (the positional tables, which never change)
    unsent before each forward pass through DDP's current option, not the
    `broadcast_buffers` that torch 2.13 deprecates with a FutureWarning that every
    process of a run would print."""
    model, _ = run_setup.models_for_run(ddp_test_model(), distributed=True)
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]
    assert model.forward_sync_buffers is False


def test_ddp_without_a_plan_exchanges_gradients_after_every_micro_batch(
    one_process_group,
):
    module = ddp_test_model()
    model = distributed.GroupSyncDDP(module)
    seen = []
    module.register_forward_pre_hook(
        lambda *_: seen.append(model.require_backward_grad_sync)
    )
    loss_compute = distributed.DistributedLossCompute(simple_loss(module))
    sgd_epoch(model, module, loss_compute, ddp_halves() * 2, accum_iter=2)
    assert seen == [True] * 4


def test_the_distributed_norm_is_the_mean_token_count_over_processes_as_a_tensor(
    one_process_group,
):
    mean = distributed.mean_over_processes(37, torch.device("cpu"))
    assert torch.is_tensor(mean) and mean.dtype == torch.float32
    assert mean.item() == 37.0  # one process: its own count, exactly
    module = ddp_test_model()
    batch = ddp_halves()[0]
    out = module(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    book = simple_loss(module)
    ours = distributed.DistributedLossCompute(book)
    assert ours.criterion is book.criterion  # run_epoch checks its padding id
    loss, node = ours(out, batch.tgt_y, 37)
    book_loss, book_node = book(out, batch.tgt_y, 37)
    # The same summed loss, divided by 37 as a float32 tensor or as an int: both
    # hold 37 exactly, so the quotients are the same float64 number.
    assert torch.equal(loss, book_loss) and torch.equal(node, book_node)
    # Evaluation exchanges nothing: the book's plain NLL.
    assert torch.equal(ours.nll(out, batch.tgt_y), book.nll(out, batch.tgt_y))


def two_process_worker(rank, rendezvous, result_path):
    """One of two processes: one SGD step on its half of the global batch, with the
    run's DDP model and loss compute."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=2
    )
    try:
        module = ddp_test_model()
        model, _ = run_setup.models_for_run(module, distributed=True)
        model.plan_epoch(1, accum_iter=1)
        loss_compute = run_setup.loss_compute_for_run(
            module.generator, ddp_criterion(), distributed=True
        )
        state = sgd_epoch(model, module, loss_compute, [ddp_halves()[rank]])
        if rank == 0:
            torch.save(state, result_path)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
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
    # The halves hold 24 and 6 target tokens: weighted 1/2 each instead of 0.8 and
    # 0.2, the step moves by 0.3 times the difference of the halves' mean gradients,
    # which two random halves make of the step's own order; a hundredth of the step
    # is far below that and far above float32 rounding (about 1e-7 of it).
    assert gap > moved / 100 > 0


# ---------------------------------------------------------------------------
# Data-parallel training in two processes


@pytest.mark.slow
def test_epoch_seeds_differ_by_rank_and_epoch_and_repeat_for_the_same_ones():
    seeds = {distributed.epoch_seed(0, e, r) for e in range(3) for r in range(4)}
    assert len(seeds) == 12
    assert distributed.epoch_seed(1, 0, 0) != distributed.epoch_seed(
        0, 1, 0
    )  # not seed + epoch
    # A resumed run draws its epoch's seed in another process: the seed must not
    # depend on the global random state nor on Python's per-process string hashing.
    here = [distributed.epoch_seed(0, 1, 1), distributed.epoch_seed(7, 2, 0)]
    torch.rand(3), np.random.rand(3), random.random()  # move every global generator
    assert [distributed.epoch_seed(0, 1, 1), distributed.epoch_seed(7, 2, 0)] == here
    code = (
        "from workshop.run import distributed\n"
        "print(distributed.epoch_seed(0, 1, 1), distributed.epoch_seed(7, 2, 0))"
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


@pytest.mark.slow
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
            distributed.ShardedBatchSampler(
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
        distributed.ShardedBatchSampler(lengths, budget, seed=2, num_replicas=2, rank=r)
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


def test_sampler_rejects_fewer_examples_than_processes():
    with pytest.raises(ValueError, match="1 examples: fewer than 2 processes"):
        distributed.ShardedBatchSampler([3], 10, num_replicas=2, rank=0)


@pytest.mark.parametrize("n, replicas", [(5, 2), (7, 3), (9, 4), (2, 2)])
def test_every_process_gets_as_many_batches_when_each_batch_holds_one_pair(n, replicas):
    shares = [
        list(
            distributed.ShardedBatchSampler([10] * n, 1, num_replicas=replicas, rank=r)
        )
        for r in range(replicas)
    ]
    assert len({len(share) for share in shares}) == 1
    seen = Counter(i for share in shares for batch in share for i in batch)
    assert set(seen) == set(range(n))  # every pair at least once
    assert sum(seen.values()) - n < replicas  # fewer than one round repeated
