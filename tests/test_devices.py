"""Device-agnostic code, proven without a GPU.

A GPU run differs from a CPU run in what it refuses: NCCL takes only tensors on the
process's GPU, and a CPU tensor mixed into a GPU computation raises. The `meta`
device refuses the same mixing on any machine (its tensors have shapes and no
values), so the model's forward and backward passes, decoding and the
label-smoothing loss run on it here; the collectives of several processes are
handed to a recorder that checks where each tensor lives. The CUDA and MPS queries
(how many GPUs, bfloat16 hardware, capability) are mocked. Tensors made on the host
inside decoding and training, and the host's reads of tensors (a wait on a GPU),
are counted on the CPU.
"""

import contextlib
import functools
import traceback
from contextlib import nullcontext

import pytest
import torch
from conftest import REPO_ROOT
from torch.overrides import TorchFunctionMode

import the_annotated_transformer as tat
from workshop import cli, commands
from workshop.run import distributed, precision, training

META = torch.device("meta")
BEAM_2 = functools.partial(tat.beam_search, beam_size=2)
VOCAB, PAD, START = 11, 0, 1


def cpu_model(N=1):
    torch.manual_seed(0)
    return tat.make_model(VOCAB, VOCAB, N=N, d_model=32, d_ff=64, h=4)


def meta_ids(rows, columns):
    return torch.randint(2, VOCAB, (rows, columns), device=META)


def test_training_and_decoding_run_on_the_device_of_the_model_and_its_batch():
    model, src, tgt = cpu_model(N=2).to(META), meta_ids(3, 7), meta_ids(3, 6)
    src_mask, tgt_mask = tat.padding_mask(src, PAD), tat.subsequent_mask(5, META)
    out = model(src, tgt[:, :-1], src_mask, tgt_mask)
    smoothing = tat.LabelSmoothing(VOCAB, PAD, 0.1)
    loss_compute = tat.SimpleLossCompute(model.generator, smoothing)
    loss, loss_node = loss_compute(out, tgt[:, 1:], 15)
    loss_node.backward()
    assert loss.device == loss_compute.nll(out.detach(), tgt[:, 1:]).device == META
    assert all(p.grad.device == META for p in model.parameters())
    for decode in (tat.greedy_decode, tat.cached_greedy_decode):
        assert decode(model, src, src_mask, 6, START).device == META


def time_limit_vote():
    config = training.RunConfig.from_profile("smoke", time_limit=1.0)
    job = training.Job(config, "data", "out", world_size=2, device=META)
    training.out_of_time(job, began=0.0, epoch_seconds=1.0)


@pytest.mark.parametrize(
    "exchange",
    [
        functools.partial(distributed.mean_over_processes, 42, META),
        time_limit_vote,
        functools.partial(precision.run_precision, "auto", META, distributed=True),
    ],
    ids=["loss norm", "time-limit vote", "bf16 vote"],
)
def test_what_processes_exchange_is_on_the_device(exchange, monkeypatch):
    """Each collective gets a tensor on the process's device, as NCCL needs."""
    devices = []
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    reduce = lambda tensor, op=None: devices.append(tensor.device)  # noqa: E731
    monkeypatch.setattr(torch.distributed, "all_reduce", reduce)
    monkeypatch.setattr(precision, "hardware_bf16", lambda device: (True, "it has"))
    with contextlib.suppress(RuntimeError, NotImplementedError):  # a meta value read
        exchange()
    assert devices == [META]


@pytest.fixture
def gpus(monkeypatch):
    """A machine with `count` GPUs (and four cores) or, with "mps", Apple's GPU."""

    def machine(count):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count != "mps")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: count == "mps")
        monkeypatch.setattr(distributed.os, "cpu_count", lambda: 4)

    return machine


@pytest.mark.parametrize(
    "count, nprocs, device, refused",
    [
        (1, 2, "cpu", None),  # the cores count, not the GPU
        (1, 4, torch.device("cpu"), None),
        (1, 2, None, "--nprocs 2: this machine has 1 GPUs.*--device cpu"),
        (1, 5, "cpu", "4 CPU cores"),
        ("mps", 1, "mps", None),
        ("mps", 2, "mps", "--nprocs 2: .* on MPS a run trains in one"),
    ],
)
def test_a_run_takes_as_many_processes_as_its_device_allows(
    gpus, count, nprocs, device, refused
):
    gpus(count)
    with pytest.raises(ValueError, match=refused) if refused else nullcontext():
        distributed.check_nprocs(nprocs, device)


@pytest.mark.parametrize(
    "command, owner, runner",
    [
        ("copy", tat, "train_copy_task"),  # through the book's example
        ("train --out run", commands, "train_model"),
        ("translate --checkpoint c.pt x", commands, "load_translator"),
        ("evaluate --checkpoint c.pt", commands, "evaluate"),
        ("attention --checkpoint c.pt x", commands, "save_attention_maps"),
        ("reproduce --out run", commands, "reproduce"),
    ],
)
def test_every_command_that_runs_a_model_hands_mps_on(
    gpus, command, owner, runner, monkeypatch
):
    gpus("mps")
    handed = []

    def stand_in(*args, **kwargs):
        handed.append(kwargs.get("device", args[1] if len(args) > 1 else None))
        raise KeyboardInterrupt  # what it was handed is what matters

    monkeypatch.setattr(owner, runner, stand_in)
    assert cli.main([*command.split(), "--device", "mps"]) == 130
    assert handed == [torch.device("mps")]


def test_each_process_of_a_gpu_run_takes_its_own_gpu(gpus):
    gpus(2)
    asked = [(0, None), (1, None), (2, None), (1, "cuda"), (1, "cuda:0"), (1, "cpu")]
    found = [str(distributed.device_for(rank, device)) for rank, device in asked]
    assert found == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0", "cpu"]


@pytest.mark.parametrize(
    "device, capability, used",
    [("cuda:0", (8, 0), True), ("cuda:0", (7, 5), False), ("cpu", None, False)],
    ids=["Ampere", "Turing", "CPU"],
)
def test_tf32_is_used_on_gpus_that_have_it(device, capability, used, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    set_to, said = [], []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", set_to.append)
    assert precision.use_tf32(device, said.append) == used
    assert set_to == ["high"] * used and len(said) == used


# ---------------------------------------------------------------------------
# Tensors made on the host inside decoding and training, and waits for the host

FACTORIES = {torch.ones, torch.zeros, torch.full, torch.arange, torch.tensor, torch.eye}
FACTORIES |= {torch.as_tensor, torch.empty, torch.rand, torch.randn, torch.randint}
# Made on the host on purpose: the best ids of beam search's sentences, gathered
# into one batch that moves to the device once; the copy task's sequences, drawn on
# the host so that every device trains on the same ones.
ALLOWED = {("beam_search", "tensor"), ("data_gen", "randint")}
PROJECT = (str(REPO_ROOT / "workshop"), str(REPO_ROOT / "the_annotated_transformer.py"))


class FactoryAudit(TorchFunctionMode):
    """Records each tensor factory called without a device, with the function of
    the project (the book or the workshop) that called it."""

    def __init__(self):
        super().__init__()
        self.calls = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            stack = traceback.extract_stack()[:-1]
            ours = [f.name for f in stack if f.filename.startswith(PROJECT)]
            self.calls.add((ours[-1] if ours else "?", func.__name__))
        return func(*args, **kwargs)


def test_decoding_and_training_make_no_tensor_on_the_host_but_the_allowed():
    """Decoding in every form, a training and an evaluation epoch, and the notebook's
    copy-task examples: what runs on a GPU in a long job (the model and the batches
    are made before, as a run makes them on its device)."""
    model, src = cpu_model(), torch.randint(2, VOCAB, (3, 7))
    mask = tat.padding_mask(src, PAD)
    batches = [tat.Batch(src, torch.randint(2, VOCAB, (3, 6)), pad=PAD)] * 2
    optimizer, scheduler = tat.make_optimizer(model, 1.0, 32, 1.0, 10)
    loss = tat.SimpleLossCompute(model.generator, tat.LabelSmoothing(VOCAB, PAD, 0.1))
    with FactoryAudit() as control:  # no device given: made on the host
        tat.subsequent_mask(3)
        tat.subsequent_mask(3, torch.device("cpu"))
    assert control.calls == {("subsequent_mask", "ones")}
    with FactoryAudit() as audit:
        for decode in (tat.greedy_decode, tat.cached_greedy_decode):
            decode(model, src, mask, 6, START, end_symbol=2)
        BEAM_2(model, src, mask, 6, START, end_symbol=2)
        tat.run_epoch(batches, model, loss, optimizer, scheduler, accum_iter=2)
        tat.run_epoch(batches, model, loss, mode="eval")
        # the notebook's copy-task cell: five sequences, then one step by step
        src, _ = tat.copy_examples(model, tat.CopyTaskConfig(), n=5)
        tat.print_decoding_steps(model, src[:1])
    assert audit.calls - ALLOWED == set()


class HostReads(TorchFunctionMode):
    """Counts the tensors the host reads (tolist, item, bool, int, float) and the
    tensors it makes from Python numbers (torch.tensor): on a GPU, a wait and a
    copy each."""

    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__}
    READS |= {torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        self.reads = self.copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += func in self.READS
        self.copies += func is torch.tensor
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "search, end_symbol, expected",
    [
        # one read for encode's check of the source mask, then one a step, to ask
        # whether every sentence has ended: none without an end symbol to look for
        (tat.greedy_decode, VOCAB + 1, (1 + 5, 0)),
        (tat.cached_greedy_decode, VOCAB + 1, (1 + 5, 0)),
        (tat.greedy_decode, None, (1, 0)),
        (tat.cached_greedy_decode, None, (1, 0)),
        # beam 2: a read of the candidates each step, and of each of the 3 * 2
        # hypotheses that end at the last step; a copy of the chosen rows back each
        # step but the last, and of the best ids at the end
        (BEAM_2, VOCAB + 1, (1 + 5 + 6, 4 + 1)),
    ],
)
def test_a_search_waits_for_the_device_once_a_step(search, end_symbol, expected):
    """(host reads, copies to the device) of a search of 5 steps, 3 sentences."""
    model, src = cpu_model().eval(), torch.randint(2, VOCAB, (3, 7))
    mask = tat.padding_mask(src, PAD)
    with HostReads() as host, torch.no_grad():
        search(model, src, mask, 6, START, end_symbol=end_symbol)
    assert (host.reads, host.copies) == expected
