"""A run's precision (workshop.run.precision): "auto" decides from what the hardware
reports, a resumed run keeps what it began in, and bfloat16 is autocast around the
book's model and generator, composed into the run's loss computation."""

import math

import pytest
import torch
from conftest import smoke_config

import the_annotated_transformer as tat
from workshop.errors import DataError
from workshop.run import checkpoints, distributed, precision, run_setup, training

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------
# fp32, bf16 or auto: what the hardware reports, never a timing


def cpu_with_flags(monkeypatch, *flags):
    """Make /proc/cpuinfo's flags read as `flags` (and a few common others)."""
    every = frozenset({"sse2", "avx2", "avx512f", *flags})
    monkeypatch.setattr(precision, "cpu_info", lambda: ("a CPU", every))


@pytest.mark.parametrize(
    "flags, expected",
    [
        ((), "float32"),
        (("avx512_bf16",), "bfloat16"),
        (("amx_bf16",), "bfloat16"),
        (("avx512_bf16", "amx_bf16"), "bfloat16"),
    ],
)
def test_auto_trains_in_bf16_where_the_cpu_reports_bf16_instructions(
    flags, expected, monkeypatch
):
    cpu_with_flags(monkeypatch, *flags)
    said = []
    assert precision.run_precision("auto", CPU, said.append) == expected
    (line,) = said  # one line, with the choice and why
    assert line.startswith(f"precision: {expected} (auto: this CPU ")
    for flag in flags:
        assert flag in line
    if not flags:
        assert "neither the avx512_bf16 nor the amx_bf16" in line


@pytest.mark.parametrize("setting", ["fp32", "bf16"])
def test_fp32_and_bf16_are_what_they_say_without_asking_the_hardware(
    setting, monkeypatch
):
    def never(device):
        raise AssertionError("asked the hardware for a precision set by hand")

    monkeypatch.setattr(precision, "hardware_bf16", never)
    said = []
    name = precision.run_precision(setting, CPU, said.append)
    assert name == {"fp32": "float32", "bf16": "bfloat16"}[setting]
    assert said == [f"precision: {name} (--precision {setting})"]


@pytest.mark.parametrize("has_bf16", [True, False])
def test_on_a_gpu_auto_is_the_gpus_answer(has_bf16, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: has_bf16)
    said = []
    name = precision.run_precision("auto", torch.device("cuda", 0), said.append)
    assert name == ("bfloat16" if has_bf16 else "float32")
    assert ("lacks bfloat16" in said[0]) == (not has_bf16)


@pytest.mark.parametrize("setting", ["auto", "bf16"])
def test_a_run_on_mps_trains_in_float32(setting):
    said = []
    assert precision.run_precision(setting, "mps", said.append) == "float32"
    auto = "auto: " if setting == "auto" else ""
    assert said == [f"precision: float32 ({auto}runs on Apple's MPS train in float32)"]


def test_this_machines_answer_is_its_cpuinfo_flags():
    """The control for the mocked tests above: on this machine "auto" follows the
    flags /proc/cpuinfo lists (none where it cannot be read)."""
    _, flags = precision.cpu_info()
    has = bool(flags & {"avx512_bf16", "amx_bf16"})
    assert precision.hardware_bf16(CPU)[0] == has
    assert precision.run_precision("auto", CPU, lambda line: None) == (
        "bfloat16" if has else "float32"
    )


def test_a_resumed_run_keeps_the_precision_it_began_in(monkeypatch):
    def never(device):
        raise AssertionError("a resumed run chose its precision again")

    monkeypatch.setattr(precision, "hardware_bf16", never)
    said = []
    for recorded in ("float32", "bfloat16"):
        assert precision.run_precision("auto", CPU, said.append, recorded=recorded)
        assert precision.run_precision("fp32", CPU, said.append, recorded=recorded)
    assert said == [
        f"precision: {name}, as this run began (a resumed run keeps it)"
        for name in ("float32", "float32", "bfloat16", "bfloat16")
    ]
    with pytest.raises(DataError, match="records the precision 'float8'"):
        precision.run_precision("auto", CPU, said.append, recorded="float8")


class OneOtherProcess:
    """Stands in for torch.distributed in a group of two processes, the other of
    which votes `other`: all_reduce(MIN) takes the smaller vote."""

    def __init__(self, monkeypatch, other):
        self.other, self.votes = other, []
        monkeypatch.setattr(torch.distributed, "all_reduce", self.all_reduce)

    def all_reduce(self, tensor, op=None):
        assert op == torch.distributed.ReduceOp.MIN
        self.votes.append(tensor.item())
        tensor.fill_(min(tensor.item(), self.other))


@pytest.mark.parametrize("other", [0.0, 1.0])
def test_several_processes_train_in_bf16_only_if_every_one_has_it(other, monkeypatch):
    cpu_with_flags(monkeypatch, "avx512_bf16")
    group, said = OneOtherProcess(monkeypatch, other), []
    name = precision.run_precision("auto", CPU, said.append, distributed=True)
    assert group.votes == [1.0]
    assert name == ("bfloat16" if other else "float32")
    if not other:
        assert said == [
            "precision: float32 (auto: another process's device lacks bfloat16)"
        ]


# ---------------------------------------------------------------------------
# bf16: autocast around the book's model and generator

COPY_VOCAB = 11


def copy_batches(n=4, batch_size=16, seed=1):
    """The book's copy-task batches (padding COPY_PAD)."""
    gen = torch.Generator().manual_seed(seed)
    return list(tat.data_gen(COPY_VOCAB, batch_size, n, generator=gen))


def test_autocast_runs_the_wrapped_forward_in_bfloat16():
    torch.manual_seed(0)
    model = tat.make_model(COPY_VOCAB, COPY_VOCAB, N=2, d_model=32, d_ff=64, h=4)
    wrapped = precision.Autocast(model).eval()
    assert wrapped.dtype == torch.bfloat16
    seen = []  # what a linear layer inside the model computes in, and whether
    layer = model.encoder.layers[0].feed_forward.w_1
    layer.register_forward_hook(
        lambda module, inputs, output: seen.append(
            (output.dtype, torch.is_autocast_enabled("cpu"))
        )
    )
    b = copy_batches(n=1)[0]
    args = b.src, b.tgt, b.src_mask, b.tgt_mask
    with torch.no_grad():
        ours = wrapped(*args)
        plain = model(*args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            direct = model(*args)
    assert seen == [  # wrapped; plain; under autocast by hand
        (torch.bfloat16, True),
        (torch.float32, False),
        (torch.bfloat16, True),
    ]
    assert not torch.is_autocast_enabled("cpu")  # switched off again after
    assert ours.dtype == direct.dtype  # the dtype autocast gives the last layer
    assert torch.equal(ours, direct)  # autocast by hand
    assert not torch.equal(ours, plain)  # ... and not the float32 computation
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert list(wrapped.state_dict()) == [f"model.{k}" for k in model.state_dict()]


def test_a_runs_loss_is_the_books_composed_with_its_precision_and_processes():
    model = smoke_config().make_model(11, 11)
    criterion = tat.LabelSmoothing(11, tat.PAD, 0.1)
    plain = run_setup.loss_compute_for_run(model.generator, criterion)
    assert type(plain) is tat.SimpleLossCompute
    assert plain.generator is model.generator and plain.criterion is criterion
    bf16 = run_setup.loss_compute_for_run(model.generator, criterion, torch.bfloat16)
    assert type(bf16) is tat.SimpleLossCompute
    assert type(bf16.generator) is precision.Autocast
    assert bf16.generator.model is model.generator
    both = run_setup.loss_compute_for_run(
        model.generator, criterion, torch.bfloat16, distributed=True
    )
    assert type(both) is distributed.DistributedLossCompute
    assert type(both.loss_compute.generator) is precision.Autocast
    assert both.criterion is criterion


def test_a_runs_model_is_wrapped_for_its_precision_alone():
    model = smoke_config().make_model(11, 11)
    assert run_setup.models_for_run(model) == (model, model)
    trained, evaluated = run_setup.models_for_run(model, torch.bfloat16)
    assert trained is evaluated and type(trained) is precision.Autocast
    assert trained.model is model


@pytest.mark.slow
def test_a_bf16_model_and_loss_train_through_the_books_run_epoch():
    torch.manual_seed(0)
    model = tat.make_model(
        COPY_VOCAB, COPY_VOCAB, N=2, d_model=32, d_ff=64, h=4, dropout=0.0
    )
    trained, evaluated = run_setup.models_for_run(model, torch.bfloat16)
    criterion = tat.LabelSmoothing(COPY_VOCAB, tat.COPY_PAD, 0.0)
    loss_compute = run_setup.loss_compute_for_run(
        model.generator, criterion, torch.bfloat16
    )
    scores, log_probs = [], []  # the generator's products, and what the loss gets
    losses = []  # the label-smoothed loss's sums
    model.generator.proj.register_forward_hook(
        lambda module, inputs, output: scores.append(output.dtype)
    )
    loss_compute.generator.register_forward_hook(
        lambda module, inputs, output: log_probs.append(output.dtype)
    )
    criterion.register_forward_hook(
        lambda module, inputs, output: losses.append(output.dtype)
    )
    batches = copy_batches()
    before, _ = tat.run_epoch(batches, evaluated, loss_compute, mode="eval")
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    state = tat.TrainState()
    for _ in range(10):
        tat.run_epoch(batches, trained, loss_compute, optimizer, train_state=state)
    after, _ = tat.run_epoch(batches, evaluated, loss_compute, mode="eval")
    assert scores == [torch.bfloat16] * len(batches) * 12
    assert log_probs == [torch.bfloat16] * len(batches) * 12
    assert losses == [torch.float32] * len(batches) * 10  # summed in float32
    assert state.step == 40 and math.isfinite(after)
    assert after < before / 2  # the untrained NLL is about log(11) = 2.4
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.slow
def test_a_bf16_run_says_so_trains_under_autocast_and_records_it(
    multi30k_dir, tmp_path, monkeypatch, capsys
):
    made, models_for_run = [], run_setup.models_for_run

    def recording_models_for_run(*args, **kwargs):
        made.append(models_for_run(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(run_setup, "models_for_run", recording_models_for_run)
    config = smoke_config(epochs=1, precision="bf16")
    history = training.train_model(config, multi30k_dir, tmp_path)
    assert "precision: bfloat16 (--precision bf16)" in capsys.readouterr().out
    [(trained, evaluated)] = made
    assert type(trained) is type(evaluated) is precision.Autocast
    assert math.isfinite(history[0]["val_nll"])
    last = checkpoints.load_checkpoint(tmp_path / "last.pt")
    assert last["precision"] == "bfloat16" and last["config"]["precision"] == "bf16"
    assert all(w.dtype == torch.float32 for w in last["model"].values())
