"""Device-agnostic code, proven without a GPU.

A GPU run differs from a CPU run in what it refuses: NCCL takes only tensors on the
process's GPU, and a CPU tensor mixed into a GPU computation raises. The `meta`
device refuses the same mixing on any machine (its tensors have shapes and no
values), so the model's forward and backward passes, decoding and the
label-smoothing loss run on it here; the collectives of several processes are
handed to a recorder that checks where each tensor lives. The CUDA queries
(how many GPUs, bfloat16 hardware) are mocked.
"""

import traceback

import pytest
import torch
from conftest import REPO_ROOT
from torch.overrides import TorchFunctionMode

import the_annotated_transformer as tat
from workshop.run import distributed, precision, training

META = torch.device("meta")
VOCAB, PAD, START = 11, 0, 1


@pytest.fixture
def meta_model():
    torch.manual_seed(0)
    return tat.make_model(VOCAB, VOCAB, N=2, d_model=32, d_ff=64, h=4).to(META)


def meta_ids(rows, columns):
    return torch.randint(2, VOCAB, (rows, columns), device=META)


def test_a_cpu_tensor_mixed_into_a_meta_computation_raises(meta_model):
    """The control for the tests below: meta refuses a CPU tensor, as CUDA does."""
    src = meta_ids(3, 7)
    with pytest.raises(RuntimeError, match="device"):
        meta_model.encode(src, torch.ones(3, 1, 7, dtype=torch.bool))


def test_a_training_step_runs_on_the_device_of_the_model_and_its_batch(meta_model):
    criterion = tat.LabelSmoothing(VOCAB, PAD, 0.1)
    src, tgt = meta_ids(3, 7), meta_ids(3, 6)
    src_mask = tat.padding_mask(src, PAD)
    tgt_mask = tat.Batch.make_std_mask(tgt[:, :-1], PAD)
    out = meta_model(src, tgt[:, :-1], src_mask, tgt_mask)
    loss_compute = tat.SimpleLossCompute(meta_model.generator, criterion)
    loss, loss_node = loss_compute(out, tgt[:, 1:], 15)
    loss_node.backward()
    assert loss.device == loss_node.device == META
    assert all(p.grad.device == META for p in meta_model.parameters())
    nll = loss_compute.nll(out.detach(), tgt[:, 1:])
    assert nll.device == META


@pytest.mark.parametrize(
    "decode",
    [tat.greedy_decode, tat.cached_greedy_decode],
    ids=["greedy", "cached greedy"],
)
def test_decoding_runs_on_the_device_of_the_model_and_its_sources(meta_model, decode):
    src = meta_ids(3, 7)
    out = decode(meta_model, src, tat.padding_mask(src, PAD), 6, START)
    assert out.device == META and out.shape == (3, 6)


def test_the_key_value_cache_grows_on_the_models_device(meta_model):
    src = meta_ids(2, 5)
    src_mask = tat.padding_mask(src, PAD)
    cache = tat.KVCache(meta_model)
    with torch.no_grad():
        memory = meta_model.encode(src, src_mask)
        ys = torch.full((2, 1), START, device=META)
        for _ in range(3):
            log_probs = tat.decode_step(meta_model, memory, src_mask, ys, cache)
            ys = torch.cat([ys, log_probs.argmax(-1, keepdim=True)], dim=1)
        cache.reorder(torch.tensor([1, 0], device=META))
    assert cache.length == 3 and log_probs.device == META


# ---------------------------------------------------------------------------
# The collectives of several processes: every tensor on the process's device


class CollectiveRecorder:
    """Stands in for torch.distributed's all_reduce in a group of two processes:
    it records the device of every tensor handed to it and changes nothing."""

    def __init__(self, monkeypatch):
        self.devices = []
        monkeypatch.setattr(torch.distributed, "all_reduce", self.all_reduce)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)

    def all_reduce(self, tensor, op=None):
        self.devices.append(tensor.device)


def test_the_loss_norm_over_processes_is_exchanged_on_the_device(monkeypatch):
    recorder = CollectiveRecorder(monkeypatch)
    norm = distributed.mean_over_processes(42, META)
    assert recorder.devices == [META] and norm.device == META


def test_the_time_limit_vote_is_exchanged_on_the_device(monkeypatch):
    recorder = CollectiveRecorder(monkeypatch)
    config = training.RunConfig.from_profile("smoke", time_limit=1.0)
    job = training.Job(config, "data", "out", world_size=2, device=META)
    with pytest.raises((RuntimeError, NotImplementedError)):
        training.out_of_time(job, began=0.0, epoch_seconds=1.0)  # reads the vote
    assert recorder.devices == [META]  # ... after the exchange, which is checked


def test_the_bf16_vote_is_exchanged_on_the_device(monkeypatch):
    recorder = CollectiveRecorder(monkeypatch)
    monkeypatch.setattr(precision, "hardware_bf16", lambda device: (True, "it has"))
    with pytest.raises((RuntimeError, NotImplementedError)):
        precision.run_precision("auto", META, distributed=True)  # reads the vote
    assert recorder.devices == [META]


# ---------------------------------------------------------------------------
# GPUs, mocked: bfloat16 hardware, how many processes, which device


@pytest.fixture
def one_gpu_four_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(distributed.os, "cpu_count", lambda: 4)


def test_on_a_one_gpu_machine_two_cpu_processes_are_allowed(one_gpu_four_cores):
    distributed.check_nprocs(2, "cpu")  # the cores count, not the GPU
    distributed.check_nprocs(4, torch.device("cpu"))
    with pytest.raises(
        ValueError, match="--nprocs 2: this machine has 1 GPUs.*--device cpu"
    ):
        distributed.check_nprocs(2)  # the default device is the GPU
    with pytest.raises(ValueError, match="4 CPU cores"):
        distributed.check_nprocs(5, "cpu")


# ---------------------------------------------------------------------------
# Apple's MPS, mocked: accepted where torch says it is there, in float32, alone


@pytest.fixture
def apple_silicon(monkeypatch):
    """A machine whose torch reports MPS, and no CUDA."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_mps_is_a_device_where_torch_reports_it(apple_silicon):
    assert distributed.parse_device("mps") == torch.device("mps")
    assert distributed.device_for(0, "mps") == torch.device("mps")
    distributed.check_nprocs(1, "mps")


def test_mps_is_refused_in_one_line_where_torch_does_not_report_it(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match="MPS .* not available .*--device cpu"):
        distributed.parse_device("mps")


def test_a_run_on_mps_takes_one_process(apple_silicon):
    with pytest.raises(ValueError, match="--nprocs 2: .* on MPS a run trains in one"):
        distributed.check_nprocs(2, "mps")


@pytest.mark.parametrize(
    "command, argv, runner",
    [
        ("copy", [], "train_copy_task"),
        ("train", ["--out", "run"], "train_model"),
        ("translate", ["--checkpoint", "c.pt", "Ein Hund."], "load_translator"),
        ("evaluate", ["--checkpoint", "c.pt"], "evaluate"),
        ("attention", ["--checkpoint", "c.pt", "Ein Hund."], "save_attention_maps"),
        ("reproduce", ["--out", "run"], "reproduce"),
    ],
)
def test_every_command_that_runs_a_model_hands_mps_on(
    apple_silicon, command, argv, runner, monkeypatch
):
    from workshop import cli, commands

    handed = []

    def stand_in(*args, **kwargs):
        handed.append(kwargs.get("device", args[1] if len(args) > 1 else None))
        raise KeyboardInterrupt  # what it was handed is what matters

    # The copy command runs the book's example_simple_model, which trains through
    # the book's train_copy_task; the others call into workshop.commands' imports.
    owner = tat if runner == "train_copy_task" else commands
    monkeypatch.setattr(owner, runner, stand_in)
    assert cli.main([command, *argv, "--device", "mps"]) == 130
    assert handed == [torch.device("mps")]


def test_each_process_of_a_gpu_run_takes_its_own_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [distributed.device_for(rank) for rank in range(3)] == [
        torch.device("cuda", 0),
        torch.device("cuda", 1),
        torch.device("cuda", 0),
    ]
    assert distributed.device_for(1, "cuda") == torch.device("cuda", 1)
    assert distributed.device_for(1, "cuda:0") == torch.device("cuda", 0)
    assert distributed.device_for(1, "cpu") == torch.device("cpu")


def test_a_cpu_run_with_processes_on_a_gpu_machine_shares_the_cores(
    one_gpu_four_cores, tmp_path, monkeypatch
):
    import torch.multiprocessing as mp

    handed = {}

    def spawn(start, nprocs, args):
        handed.update(nprocs=nprocs, args=args)

    monkeypatch.setattr(mp, "spawn", spawn)
    monkeypatch.setattr(training, "check_run_data", lambda *args: None)
    monkeypatch.setattr(training, "build_vocabs", lambda *args: ("de", "en"))
    monkeypatch.setattr(training, "load_checkpoint", lambda path: {"history": []})
    config = training.RunConfig.from_profile("smoke")
    training.train_model(config, tmp_path, tmp_path / "run", nprocs=2, device="cpu")
    worker, world_size, (job,), on_cpu = handed["args"]
    assert worker is training.train_worker and world_size == handed["nprocs"] == 2
    assert job.device == "cpu" and on_cpu  # each process gets two of the four cores


# ---------------------------------------------------------------------------
# Tensors made on the host inside decoding and training, and waits for the host

FACTORIES = {
    torch.ones,
    torch.zeros,
    torch.full,
    torch.arange,
    torch.tensor,
    torch.as_tensor,
    torch.empty,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.eye,
}

# (function, where): each made on the host on purpose.
ALLOWED = {
    # After the book's search, each sentence's best ids are gathered into one batch,
    # which moves to the device once.
    ("beam_search", "tensor"),
    # The copy task's sequences are drawn by a generator on the host, so that every
    # device trains on the same ones; each batch moves to the device once.
    ("data_gen", "randint"),
}


class FactoryAudit(TorchFunctionMode):
    """Records each tensor factory called without a device, with the function of
    the project (the book or the workshop) that called it."""

    def __init__(self):
        super().__init__()
        self.calls = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            ours = [
                frame
                for frame in traceback.extract_stack()[:-1]
                if frame.filename.startswith(str(REPO_ROOT / "workshop"))
                or frame.filename == str(REPO_ROOT / "the_annotated_transformer.py")
            ]
            self.calls.add((ours[-1].name if ours else "?", func.__name__))
        return func(*args, **kwargs)


def test_the_factory_audit_sees_a_tensor_made_without_a_device():
    """The control for the test below."""
    with FactoryAudit() as audit:
        tat.subsequent_mask(3)  # no device given: made on the host
        tat.subsequent_mask(3, torch.device("cpu"))
    assert audit.calls == {("subsequent_mask", "ones")}


def cpu_model():
    torch.manual_seed(0)
    return tat.make_model(VOCAB, VOCAB, N=1, d_model=32, d_ff=64, h=4)


def test_decoding_and_training_make_no_tensor_on_the_host_but_the_allowed():
    """Decoding in every form, and a training and an evaluation epoch: what runs on
    a GPU in a long job (the model and the batches are made before, as a run makes
    them on its device)."""
    model, src = cpu_model(), torch.randint(2, VOCAB, (3, 7))
    mask = tat.padding_mask(src, PAD)
    batches = [tat.Batch(src, torch.randint(2, VOCAB, (3, 6)), pad=PAD)] * 2
    optimizer, scheduler = tat.make_optimizer(model, 1.0, 32, 1.0, 10)
    loss = tat.SimpleLossCompute(model.generator, tat.LabelSmoothing(VOCAB, PAD, 0.1))
    with FactoryAudit() as audit:
        for decode in (tat.greedy_decode, tat.cached_greedy_decode):
            decode(model, src, mask, 6, START, end_symbol=2)
        tat.beam_search(model, src, mask, 6, START, 2, beam_size=2)
        tat.run_epoch(batches, model, loss, optimizer, scheduler, accum_iter=2)
        tat.run_epoch(batches, model, loss, mode="eval")
    assert audit.calls - ALLOWED == set()


def test_the_notebooks_copy_task_examples_make_no_tensor_on_the_host(capsys):
    """The copy-task cell decodes five sequences and then one step by step: on a GPU,
    a source or a mask made on the host there would meet the model on the device."""
    config = tat.CopyTaskConfig(N=1, d_model=32, d_ff=64, h=4)
    model = tat.make_model(config.vocab, config.vocab, N=1, d_model=32, d_ff=64, h=4)
    with FactoryAudit() as audit:
        src, _ = tat.copy_examples(model, config, n=5)
        tat.print_decoding_steps(model, src[:1])
    assert audit.calls == {("data_gen", "randint")}  # allowed, as above
    assert capsys.readouterr().out.count("-> next") == config.seq_len - 1


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


@pytest.mark.parametrize("decode", [tat.greedy_decode, tat.cached_greedy_decode])
def test_greedy_decoding_waits_for_the_device_once_a_step(decode):
    """One wait a step, to ask whether every sentence has ended (none without an
    end symbol to look for), and one before the first, when encode checks the
    source mask's contents."""
    model, src = cpu_model().eval(), torch.randint(2, VOCAB, (3, 7))
    mask = tat.padding_mask(src, PAD)
    never = VOCAB + 1  # an end symbol no token is: every step runs
    with HostReads() as ended, torch.no_grad():
        out = decode(model, src, mask, 6, START, end_symbol=never)
    with HostReads() as endless, torch.no_grad():
        decode(model, src, mask, 6, START)
    assert out.size(1) == 6 and ended.reads == 1 + 5 and endless.reads == 1  # 5 steps
    assert ended.copies == endless.copies == 0


@pytest.mark.parametrize(
    "device, capability, expected",
    [
        ("cuda:0", (8, 0), "high"),
        ("cuda:0", (7, 5), "highest"),
        ("cpu", None, "highest"),
    ],
    ids=["Ampere", "Turing", "CPU"],
)
def test_tf32_is_used_on_gpus_that_have_it(device, capability, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    before = torch.get_float32_matmul_precision()
    said = []
    try:
        torch.set_float32_matmul_precision("highest")
        used = precision.use_tf32(device, said.append)
        assert torch.get_float32_matmul_precision() == expected
    finally:
        torch.set_float32_matmul_precision(before)
    assert used == (expected == "high") == (len(said) == 1)


def test_beam_search_reads_and_copies_once_a_step():
    """Each step reads its candidates once and copies the chosen ones back once;
    a hypothesis that ends is read once more, to keep its ids, and the best ids of
    every sentence go to the device in one copy at the end. encode reads once, to
    check the source mask."""
    model, src = cpu_model().eval(), torch.randint(2, VOCAB, (3, 7))
    mask = tat.padding_mask(src, PAD)
    never, k, steps = VOCAB + 1, 2, 5  # no hypothesis ends before the last step
    with HostReads() as host:
        tat.beam_search(model, src, mask, steps + 1, START, never, beam_size=k)
    ended = src.size(0) * k  # at the last step, every sentence's k hypotheses
    # Copies: each step but the last, where every sentence ends, sends its chosen
    # rows back; then the best ids, once.
    assert (host.reads, host.copies) == (1 + steps + ended, (steps - 1) + 1)
