"""workshop.run.flops: the training FLOPs a run spends, and the epochs a budget buys."""

import pytest
import torch
from conftest import smoke_config, train_run
from torch.utils.flop_counter import FlopCounterMode

import the_annotated_transformer as tat
from workshop.run import flops
from workshop.run.settings import RunConfig


def test_training_flops_matches_what_torch_counts_for_a_training_step():
    """With no padding every token is useful, so the formula must equal what torch's
    FLOP counter sees in one forward and backward pass (matrix products only, as
    the formula counts them). Both are exact integer sums held in float64, far
    below 2^53, so they are compared exactly. The model runs in eval mode, where
    its attention is the book's `attention` (without dropout the same function as
    training mode's fused kernel, whose matrix products torch's counter does not
    see on a CPU); gradients flow in either mode."""
    torch.manual_seed(0)
    model = tat.make_model(11, 11, **tat.TINY, dropout=0.0).eval()
    src = torch.randint(4, 11, (3, 7))
    tgt = torch.randint(4, 11, (3, 6))
    batch = tat.Batch(src, tgt, pad=tat.PAD)
    criterion = tat.LabelSmoothing(11, tat.PAD, 0.1)
    loss_compute = tat.SimpleLossCompute(model.generator, criterion)
    with FlopCounterMode(display=False) as counter:
        out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        _, loss = loss_compute(out, batch.tgt_y, batch.ntokens)
        loss.backward()
    assert flops.training_flops(model, [batch]) == counter.get_total_flops()


def test_training_flops_leave_padding_out():
    model = tat.make_model(11, 11, **tat.TINY)
    short = tat.Batch(torch.tensor([[0, 5, 1]]), torch.tensor([[0, 6, 1]]), tat.PAD)
    padded = tat.Batch(
        torch.tensor([[0, 5, 1, tat.PAD, tat.PAD]]),
        torch.tensor([[0, 6, 1, tat.PAD]]),
        tat.PAD,
    )
    assert flops.training_flops(model, [padded]) == flops.training_flops(model, [short])


def test_a_budget_buys_whole_epochs_and_refuses_less_than_one():
    assert flops.epochs_for_budget(10.0, 4.0) == 2
    assert flops.epochs_for_budget(8.0, 4.0) == 2
    with pytest.raises(ValueError, match="does not pay for one epoch"):
        flops.epochs_for_budget(3.0, 4.0)


@pytest.mark.slow
def test_a_run_with_a_budget_trains_the_epochs_it_pays_for(
    smoke_run, multi30k_dir, tmp_path_factory
):
    """A run given a budget, not epochs, stops where the budget runs out: the
    division is tested above; this is the run honouring it. An epoch's FLOPs come
    from the session's smoke run, of the same settings but for the budget."""
    per_epoch = smoke_run.history[0]["training_flops"]
    assert per_epoch > 0
    budget = 2.5 * per_epoch  # two epochs and half of a third: two
    config = smoke_config(epochs=7, flop_budget=budget)
    run = train_run(config, multi30k_dir, tmp_path_factory, "budget")
    assert [r["training_flops"] for r in run.history] == [per_epoch] * 2


@pytest.mark.parametrize("budget", [0, -1.0, "1e14", True])
def test_a_bad_budget_is_refused_with_a_clear_message(budget):
    with pytest.raises(ValueError, match="flop_budget must be a number of training"):
        RunConfig.from_profile("smoke", flop_budget=budget)
