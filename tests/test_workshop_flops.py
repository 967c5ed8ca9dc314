"""workshop.run.flops: the training FLOPs a run spends, and the epochs a budget buys.
A run that spends a budget is tested with the runs of test_workshop_training.py."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import the_annotated_transformer as tat
from workshop.run import flops


def test_training_flops_are_what_torch_counts_for_a_step_and_leave_padding_out():
    """With no padding every token is useful, so the formula must equal what torch's
    FLOP counter sees in one forward and backward pass (matrix products only, as
    the formula counts them). Both are exact integer sums held in float64, far
    below 2^53, so they are compared exactly. The model runs in eval mode, where
    its attention is the book's `attention` (without dropout the same function as
    training mode's fused kernel, whose matrix products torch's counter does not
    see on a CPU); gradients flow in either mode."""
    torch.manual_seed(0)
    model = tat.make_model(11, 11, **tat.TINY, dropout=0.0).eval()
    src, tgt = torch.randint(4, 11, (3, 7)), torch.randint(4, 11, (3, 6))
    batch = tat.Batch(src, tgt, pad=tat.PAD)
    criterion = tat.LabelSmoothing(11, tat.PAD, 0.1)
    loss_compute = tat.SimpleLossCompute(model.generator, criterion)
    with FlopCounterMode(display=False) as counter:
        out = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        _, loss = loss_compute(out, batch.tgt_y, batch.ntokens)
        loss.backward()
    assert flops.training_flops(model, [batch]) == counter.get_total_flops()
    pads = torch.full((3, 2), tat.PAD)  # padding is work, but not useful work
    padded = tat.Batch(torch.cat([src, pads], 1), torch.cat([tgt, pads], 1), tat.PAD)
    assert flops.training_flops(model, [padded]) == counter.get_total_flops()


def test_a_budget_buys_whole_epochs_and_refuses_less_than_one():
    assert flops.epochs_for_budget(10.0, 4.0) == flops.epochs_for_budget(8.0, 4.0) == 2
    with pytest.raises(ValueError, match="does not pay for one epoch"):
        flops.epochs_for_budget(3.0, 4.0)
