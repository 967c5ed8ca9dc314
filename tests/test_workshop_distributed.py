"""Several processes (workshop.run.distributed): one gradient exchange per optimizer
step, the loss normalised by every process's tokens, two processes end to end, and
the batches and seeds shared among them."""

from collections import Counter

import pytest
import torch
from conftest import smoke_config

import the_annotated_transformer as tat
from workshop.run import checkpoints, distributed, run_setup, training

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

VOCAB, LAYERS = 13, dict(N=1, d_model=16, d_ff=32, h=2, dropout=0.0)


def tiny_model():
    """A one-layer float64 Transformer, seeded, without dropout."""
    torch.manual_seed(0)
    return tat.make_model(VOCAB, VOCAB, **LAYERS).double()


def halves():
    """Two Batches, the halves of one global batch: the second holds two short
    sentences, so the halves have different numbers of target tokens."""
    gen = torch.Generator().manual_seed(1)
    src, tgt = (torch.randint(4, VOCAB, (5, 9), generator=gen) for _ in "st")
    src[:, 0] = tgt[:, 0] = tat.BOS
    for row, length in ((3, 3), (4, 5)):
        src[row, length:] = tgt[row, length:] = tat.PAD
        tgt[row, length - 1] = tat.EOS
    return [tat.Batch(src[r], tgt[r], tat.PAD) for r in (slice(0, 3), slice(3, 5))]


def sgd_epoch(model, module, batches, distributed=False, accum_iter=1):
    """The book's run_epoch with plain SGD and the run's loss computation (for one
    of several processes when `distributed`); returns the module's weights."""
    criterion = tat.LabelSmoothing(VOCAB, tat.PAD, 0.1)
    loss = run_setup.loss_compute_for_run(
        module.generator, criterion, None, distributed
    )
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    tat.run_epoch(batches, model, loss, optimizer, accum_iter=accum_iter)
    return module.state_dict()


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of this process alone (world size 1), destroyed after."""
    meet = f"file://{tmp_path / 'meet'}"
    torch.distributed.init_process_group("gloo", init_method=meet, rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


@pytest.mark.filterwarnings("error::FutureWarning")  # none from DDP's options
@pytest.mark.parametrize(
    "n_batches, plan, exchanges", [(4, True, 2), (3, True, 2), (4, False, 4)]
)
def test_gradients_are_exchanged_once_per_optimizer_step(
    one_process_group, n_batches, plan, exchanges
):
    """Micro-batches in groups of two: with a plan, only the one that ends its group
    (every second, and the epoch's last) exchanges its gradients (DDP's no_sync
    keeps the others'); without one, every one does. Alone in its group, the
    process steps exactly as the plain model does (DDP divides by 1)."""
    module = tiny_model()
    model, _ = run_setup.models_for_run(module, distributed=True)
    seen = []

    def counted_exchange(state, bucket):
        seen.append(bucket.index())
        done = torch.distributed.all_reduce(bucket.buffer(), async_op=True)
        return done.get_future().then(lambda future: future.value()[0])

    model.register_comm_hook(None, counted_exchange)
    if plan:
        model.plan_epoch(n_batches, accum_iter=2)
    batches = [halves()[0]] * n_batches
    got = sgd_epoch(model, module, batches, distributed=True, accum_iter=2)
    assert seen == [0] * exchanges  # the model's one bucket
    want = sgd_epoch(plain := tiny_model(), plain, batches, accum_iter=2)
    assert all(torch.equal(got[name], want[name]) for name in want)


def two_process_worker(rank, meet, result):
    """One of two processes: one SGD step on its half of the global batch, with the
    run's model and loss computation for several processes."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=meet, rank=rank, world_size=2
    )
    module = tiny_model()
    model, _ = run_setup.models_for_run(module, distributed=True)
    state = sgd_epoch(model, module, [halves()[rank]], distributed=True)
    if rank == 0:
        torch.save(state, result)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_on_halves_of_a_batch_take_the_one_process_step(tmp_path):
    """Each process divides its summed loss by the mean of the processes' token
    counts and DDP averages the gradients: the step is the mean over every token of
    the global batch, however unevenly the tokens fall (here 24 and 6; dividing by
    its own count, each would weight its half 1/2 instead of 0.8 and 0.2).

    One process running both halves as two micro-batches of one group gets the
    same gradient: each half's summed-loss gradient over all the tokens, added.
    The two processes compute each half's gradient divided by half the token
    count, and DDP halves it again: scalings by powers of two, exact in floating
    point. Adding two numbers does not depend on their order, so the two runs
    agree to the last bit."""
    assert halves()[0].ntokens != halves()[1].ntokens
    meet, result = f"file://{tmp_path / 'meet'}", tmp_path / "rank0.pt"
    torch.multiprocessing.spawn(two_process_worker, args=(meet, result), nprocs=2)
    two_processes = torch.load(result, weights_only=True)
    one_process = sgd_epoch(whole := tiny_model(), whole, halves(), accum_iter=2)
    assert all(torch.equal(two_processes[k], one_process[k]) for k in one_process)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_train_an_epoch_that_cannot_be_split_evenly_to_its_end(
    multi30k_dir, tmp_path
):
    """25 pairs, one a batch, in groups of two micro-batches: each process takes 13
    batches (one pair is repeated) and, the last one short, 7 optimizer steps."""
    config = smoke_config(epochs=1, accum_iter=2, max_tokens=1, max_train_pairs=25)
    processes = dict(nprocs=2, quiet=True, device="cpu")  # gloo, GPUs or not
    history = training.train_model(config, multi30k_dir, tmp_path, **processes)
    state = checkpoints.load_checkpoint(tmp_path / "last.pt")["train_state"]
    assert len(history) == 1 and (state["step"], state["accum_step"]) == (13, 7)


LENGTHS = torch.randint(3, 40, (300,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "lengths, budget, processes, repeated",
    [
        (LENGTHS.tolist(), 420, 2, 0),
        ([9] * 5, 1, 2, 1),
        ([9] * 7, 1, 3, 2),
        ([9] * 9, 1, 4, 3),
    ],
)
def test_processes_get_as_many_batches_within_the_budget_covering_the_epoch(
    lengths, budget, processes, repeated
):
    """The book's batches do not divide evenly among the processes: one is split
    or, where each batch holds one pair, a few pairs are repeated."""
    assert len(tat.TokenBudgetBatchSampler(lengths, budget).all_batches()) % processes
    samplers = [
        distributed.ShardedBatchSampler(lengths, budget, num_replicas=processes, rank=r)
        for r in range(processes)
    ]
    shares = [list(sampler) for sampler in samplers]
    assert {len(share) for share in shares} == {len(samplers[0])}
    batches = [batch for share in shares for batch in share]
    seen = Counter(i for batch in batches for i in batch)
    assert sorted(seen) == list(range(len(lengths)))
    assert sum(seen.values()) - len(lengths) == repeated
    padded = [len(batch) * max(lengths[i] for i in batch) for batch in batches]
    assert all(size <= budget for size in padded) or budget == 1


def test_the_processes_must_be_no_more_than_the_examples():
    with pytest.raises(ValueError, match="1 examples: fewer than 2 processes"):
        distributed.ShardedBatchSampler([3], 10, num_replicas=2, rank=0)


def test_each_process_draws_each_epoch_from_a_seed_of_its_own():
    triples = [(seed, e, rank) for seed in (0, 1) for e in (0, 1, 2) for rank in (0, 1)]
    assert len({distributed.epoch_seed(*triple) for triple in triples}) == 12


@pytest.mark.parametrize("cpus, world, share", [(8, 2, 4), (2, 2, 1), (1, 4, 1)])
def test_a_spawned_cpu_process_takes_its_share_of_the_cores(
    monkeypatch, cpus, world, share
):
    """On a CPU each process runs on cores // processes threads (at least one), so
    that two processes on two cores do not take turns; on a GPU torch's default
    stands."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(distributed.os, "cpu_count", lambda: cpus)
    seen = []

    def worker(rank, world_size, tag):
        seen.append((rank, world_size, tag, torch.get_num_threads()))
        return tag

    try:
        assert distributed.start_process(1, worker, world, ("job",)) == "job"
        torch.set_num_threads(7)
        distributed.start_process(0, worker, world, ("gpu",), on_cpu=False)
    finally:
        torch.set_num_threads(threads)
    assert seen == [(1, world, "job", share), (0, world, "gpu", 7)]
