"""A run's precision (workshop.run.precision): what it asks for, or with "auto" what
the hardware reports (never a timing); a resumed run keeps what it began in; and
bfloat16 is autocast around the book's model and generator. A whole run in
bfloat16 is tested with the runs of test_workshop_training.py."""

import pytest
import torch

import the_annotated_transformer as tat
from workshop.errors import DataError
from workshop.run import precision, run_setup

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

NO_FLAG = "this CPU reports neither the avx512_bf16 nor the amx_bf16 flag"


@pytest.mark.parametrize(
    "setting, device, flags, gpu_has_it, said",
    [
        ("auto", "cpu", "", 1, f"float32 (auto: {NO_FLAG})"),
        ("auto", "cpu", "amx_bf16", 0, "bfloat16 (auto: this CPU has the amx_bf16"),
        ("auto", "cuda", "amx_bf16", 0, "float32 (auto: this GPU lacks bfloat16"),
        ("fp32", "cpu", "avx512_bf16", 1, "float32 (--precision fp32)"),
        ("bf16", "cpu", "", 0, "bfloat16 (--precision bf16)"),
        ("bf16", "mps", "amx_bf16", 1, "float32 (runs on Apple's MPS train in"),
    ],
)
def test_a_run_trains_in_the_precision_it_asks_for_or_the_hardware_reports(
    setting, device, flags, gpu_has_it, said, monkeypatch
):
    """It says which, and why, in one line."""
    cpu = ("a CPU", frozenset(flags.split()))
    monkeypatch.setattr(precision, "cpu_info", lambda: cpu)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bool(gpu_has_it))
    lines = []
    assert precision.run_precision(setting, device, lines.append) == said.split()[0]
    assert len(lines) == 1 and lines[0].startswith(f"precision: {said}")


def test_a_resumed_run_keeps_the_precision_it_began_in_without_asking(monkeypatch):
    monkeypatch.setattr(precision, "hardware_bf16", None)  # asking it would fail
    for name in ("float32", "bfloat16"):
        assert precision.run_precision("fp32", "cpu", print, recorded=name) == name
    with pytest.raises(DataError, match="records the precision 'float8': unknown"):
        precision.run_precision("auto", "cpu", print, recorded="float8")


@pytest.mark.parametrize("other", [0.0, 1.0])
def test_processes_train_in_bfloat16_only_if_every_ones_device_has_it(
    other, monkeypatch
):
    """Each process votes; the other process here votes `other`."""
    monkeypatch.setattr(precision, "hardware_bf16", lambda device: (True, "it has"))
    votes = []

    def all_reduce(vote, op):
        assert op == torch.distributed.ReduceOp.MIN  # the smaller vote wins
        votes.append(vote.item())
        vote.fill_(min(vote.item(), other))

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    name = precision.run_precision("auto", "cpu", print, distributed=True)
    assert votes == [1.0] and name == ("bfloat16" if other else "float32")


def test_a_bfloat16_model_and_loss_train_under_autocast_with_float32_weights_and_sums():
    """The book's copy task through run_epoch: the model's and the generator's
    products in bfloat16, the label-smoothed loss summed in float32, the weights
    kept in float32, and the loss falls."""
    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2, dropout=0.0)
    trained, evaluated = run_setup.models_for_run(model, torch.bfloat16)
    criterion = tat.LabelSmoothing(11, tat.COPY_PAD, 0.0)
    loss = run_setup.loss_compute_for_run(model.generator, criterion, torch.bfloat16)
    products, sums = [], []
    for layer in (model.encoder.layers[0].feed_forward.w_1, model.generator.proj):
        layer.register_forward_hook(lambda m, i, output: products.append(output.dtype))
    criterion.register_forward_hook(lambda m, i, output: sums.append(output.dtype))
    batches = list(tat.data_gen(11, 8, 2, generator=torch.Generator().manual_seed(1)))
    before, _ = tat.run_epoch(batches, evaluated, loss, mode="eval")
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(3):
        tat.run_epoch(batches, trained, loss, optimizer)
    after, _ = tat.run_epoch(batches, evaluated, loss, mode="eval")
    assert set(products) == {torch.bfloat16} and set(sums) == {torch.float32}
    assert after < before and all(p.dtype == torch.float32 for p in model.parameters())
