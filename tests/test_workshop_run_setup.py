"""A run's model (workshop.run.run_setup): the book's, with a dropout that draws its
coin more cheaply on a CPU. How a run composes its model and loss for bfloat16 and
for several processes is tested in test_workshop_precision.py and
test_workshop_distributed.py; a run set up, new or resumed, in
test_workshop_training.py."""

import pytest
import torch
from torch import nn

import the_annotated_transformer as tat
from workshop.run import run_setup
from workshop.run.settings import RunConfig

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_the_cheaper_dropout_drops_each_element_alone_with_probability_p():
    torch.manual_seed(0)
    x = torch.ones(400_000, requires_grad=True)
    y = run_setup.Dropout(0.25).train()(x)
    kept = y != 0
    # Shares of n = 400,000 draws: one element kept has a standard deviation of
    # sqrt(0.75 * 0.25 / n) = 0.0007; two neighbours kept, sqrt((0.246 + 2 *
    # 0.105) / n) = 0.0011 (its variance, and the covariance of overlapping pairs).
    # 0.007 is over 6 of either: a wrong p or shared bits are far beyond it.
    assert abs(kept.float().mean().item() - 0.75) < 0.007
    assert abs((kept[:-1] & kept[1:]).float().mean().item() - 0.75**2) < 0.007
    assert torch.equal(y[kept], torch.full_like(y[kept], 4 / 3))  # 1 / (1 - p)
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # the gradient goes through the same mask
    torch.manual_seed(0)
    assert torch.equal(run_setup.Dropout(0.25).train()(x), y)  # seeded, the same
    assert torch.equal(run_setup.Dropout(0.25).eval()(x), x)
    assert torch.equal(run_setup.Dropout(0.0).train()(x), x)


def test_a_runs_model_is_the_books_with_every_dropout_the_cheaper_one_of_its_p():
    """The same weights from the same seed; every dropout (the attention layers'
    too, whose p the book hands to the fused kernel) the cheaper one with its p;
    in eval mode, where dropout is off, the same function bit for bit."""
    config = RunConfig.from_profile("smoke", dropout=0.37)
    torch.manual_seed(0)
    book = config.make_model(11, 13)
    torch.manual_seed(0)
    run = run_setup.make_run_model(config, 11, 13)
    ours = [m for m in run.modules() if isinstance(m, nn.Dropout)]
    assert {(type(m), m.p) for m in ours} == {(run_setup.Dropout, 0.37)}
    attention = [m for m in run.modules() if isinstance(m, tat.MultiHeadedAttention)]
    assert attention and all(type(m.dropout) is run_setup.Dropout for m in attention)
    src, tgt = torch.randint(4, 11, (2, 5)), torch.randint(4, 13, (2, 4))
    masks = tat.padding_mask(src, tat.PAD), tat.subsequent_mask(4)
    with torch.no_grad():
        assert torch.equal(run.eval()(src, tgt, *masks), book.eval()(src, tgt, *masks))
