"""bfloat16 (workshop.precision): the probe that decides where it pays, and the
autocast wrappers around the book's model and loss."""

import math

import pytest
import torch
from conftest import (
    smoke_config,
)

import the_annotated_transformer as tat
from workshop import (
    checkpoints,
    distributed,
    precision,
    settings,
    training,
)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# ---------------------------------------------------------------------------
# bf16 only where it pays


@pytest.mark.parametrize(
    "speedup, expected",
    [(0.03, None), (0.999, None), (1.0, torch.bfloat16), (1.7, torch.bfloat16)],
)
def test_bf16_is_used_only_where_a_measured_matmul_says_it_pays(
    speedup, expected, monkeypatch, capsys
):
    monkeypatch.setattr(precision, "bf16_matmul_speedup", lambda device: speedup)
    assert precision.amp_dtype_for(True, torch.device("cpu")) == expected
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and f"{speedup:.2f}x" in said[0]  # the run's log says why
    if expected is None:
        assert "--bf16 ignored" in said[0]
    else:
        assert said[0].startswith("bfloat16 autocast: ")


def test_bf16_not_asked_for_is_not_even_measured(monkeypatch):
    def never(device):
        raise AssertionError("measured without --bf16")

    monkeypatch.setattr(precision, "bf16_matmul_speedup", never)
    assert precision.amp_dtype_for(False, torch.device("cpu")) is None


# ---------------------------------------------------------------------------
# bf16: autocast around the book's model and loss

COPY_VOCAB = 11


def copy_batches(n=4, batch_size=16, seed=1):
    """The book's copy-task batches (padding COPY_PAD)."""
    gen = torch.Generator().manual_seed(seed)
    return list(tat.data_gen(COPY_VOCAB, batch_size, n, generator=gen))


def test_autocast_runs_the_wrapped_models_forward_in_bfloat16_on_the_cpu():
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
    assert torch.equal(ours, direct)  # the same computation as autocast by hand
    assert not torch.equal(ours, plain)  # ... and not the float32 one
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert list(wrapped.state_dict()) == [f"model.{k}" for k in model.state_dict()]


@pytest.mark.slow
def test_a_bf16_model_and_loss_train_through_the_books_run_epoch():
    torch.manual_seed(0)
    model = tat.make_model(
        COPY_VOCAB, COPY_VOCAB, N=2, d_model=32, d_ff=64, h=4, dropout=0.0
    )
    trained, evaluated = training.models_for_run(model, torch.bfloat16)
    assert type(trained) is precision.Autocast and evaluated is trained
    assert trained.model is model
    criterion = tat.LabelSmoothing(COPY_VOCAB, tat.COPY_PAD, 0.0)
    loss_compute = training.loss_compute_for_run(
        model.generator, criterion, torch.bfloat16
    )
    assert type(loss_compute) is precision.AutocastLossCompute
    scores = []  # the dtype of the generator's output, in training and evaluation
    model.generator.proj.register_forward_hook(
        lambda module, inputs, output: scores.append(output.dtype)
    )
    batches = copy_batches()
    before, _ = tat.run_epoch(batches, evaluated, loss_compute, mode="eval")
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    state = tat.TrainState()
    for _ in range(10):
        tat.run_epoch(batches, trained, loss_compute, optimizer, train_state=state)
    after, _ = tat.run_epoch(batches, evaluated, loss_compute, mode="eval")
    assert scores == [torch.bfloat16] * len(batches) * 12
    assert state.step == 40 and math.isfinite(after)
    assert after < before / 2  # the untrained NLL is about log(11) = 2.4
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_run_picks_the_model_and_loss_wrappers_for_its_precision():
    model = settings.RunConfig.from_profile("smoke").make_model(11, 11)
    criterion = tat.LabelSmoothing(11, tat.PAD, 0.1)
    assert training.models_for_run(model) == (model, model)
    plain = training.loss_compute_for_run(model.generator, criterion)
    assert type(plain) is tat.SimpleLossCompute
    both = training.loss_compute_for_run(
        model.generator, criterion, torch.bfloat16, True
    )
    assert type(both) is distributed.DistributedAutocastLossCompute
    assert isinstance(both, distributed.DistributedLossCompute)
    assert (
        isinstance(both, precision.AutocastLossCompute) and both.dtype == torch.bfloat16
    )


@pytest.mark.slow
def test_a_bf16_run_trains_and_evaluates_under_autocast(
    smoke_run, multi30k_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(precision, "bf16_matmul_speedup", lambda device: 2.0)  # it pays
    made, models_for_run = [], training.models_for_run

    def recording_models_for_run(*args, **kwargs):
        made.append(models_for_run(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(training, "models_for_run", recording_models_for_run)
    history = training.train_model(
        smoke_config(epochs=1, bf16=True), multi30k_dir, tmp_path, quiet=True
    )
    [(trained, evaluated)] = made
    assert type(trained) is type(evaluated) is precision.Autocast
    assert math.isfinite(history[0]["val_nll"])
    weights = checkpoints.load_checkpoint(tmp_path / "last.pt")["model"]
    assert all(w.dtype == torch.float32 for w in weights.values())
