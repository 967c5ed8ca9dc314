"""workshop.fast: the CPU tricks compute what the book's plain versions compute.

Its dropout is nn.Dropout's coin with a cheaper random draw, and its fused
label-smoothing loss has the book's value and gradient.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import the_annotated_transformer as tat
from workshop import fast, settings, training

SMALL = {"N": 2, "d_model": 32, "d_ff": 64, "h": 4}


# ---------------------------------------------------------------------------
# fast.Dropout: nn.Dropout's coin from 16 random bits per element


def test_fast_dropout_keeps_each_element_with_probability_1_minus_p_and_rescales():
    torch.manual_seed(0)
    drop = fast.Dropout(0.1).train()
    x = torch.ones(400_000)
    y = drop(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.9) < 0.003  # 6 standard deviations
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.9))
    assert abs(y.mean().item() - 1.0) < 0.004  # unbiased
    pairs = kept[:-1] & kept[1:]  # neighbours are independent (no shared bits)
    assert abs(pairs.float().mean().item() - 0.81) < 0.004


def test_fast_dropout_gradient_is_the_same_mask_and_eval_mode_is_identity():
    drop = fast.Dropout(0.3).train()
    x = torch.randn(50, 40, requires_grad=True)
    y = drop(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (y / x).detach())
    drop.eval()
    assert torch.equal(drop(x), x)
    assert torch.equal(fast.Dropout(0.0).train()(x), x)


def test_fast_dropout_mask_is_reproducible_and_matches_nn_dropout_statistics():
    torch.manual_seed(3)
    first = fast.dropout_keep_mask(torch.empty(1001), 0.25)
    torch.manual_seed(3)
    assert torch.equal(first, fast.dropout_keep_mask(torch.empty(1001), 0.25))
    assert first.shape == (1001,)
    assert torch.allclose(first.unique(), torch.tensor([0.0, 4 / 3]))
    torch.manual_seed(3)
    reference = F.dropout(torch.ones(200_000), 0.25, training=True)
    ours = fast.dropout_keep_mask(torch.empty(200_000), 0.25)
    # Each share of zeros is a binomial mean: standard deviation sqrt(0.25 * 0.75 /
    # 200,000) = 0.00097, so the difference of the two has 0.00137, and 0.01 is 7.3 of
    # those: a wrong rate (0.2 or 0.3) is 36 of them away, a right one never fails.
    assert abs((ours == 0).float().mean() - (reference == 0).float().mean()) < 0.01


def dropouts(model):
    return [m for m in model.modules() if isinstance(m, nn.Dropout)]


@pytest.mark.parametrize("p", [0.0, 0.37])
def test_use_fast_dropout_swaps_every_dropout_of_a_book_model_keeping_its_p(p):
    torch.manual_seed(0)
    book = tat.make_model(11, 11, **SMALL, dropout=p)
    before = [(type(m), m.p) for m in dropouts(book)]
    assert before and all(kind is nn.Dropout for kind, _ in before)
    swapped = fast.use_fast_dropout(book)
    assert swapped is book
    after = dropouts(book)
    assert [type(m) for m in after] == [fast.Dropout] * len(before)
    assert [m.p for m in after] == [p for _, p in before]
    attention = [m for m in book.modules() if isinstance(m, tat.MultiHeadedAttention)]
    assert all(type(m.dropout) is fast.Dropout for m in attention)


def test_a_runs_model_is_the_books_model_with_fast_dropout_and_fused_attention():
    config = settings.RunConfig.from_profile("smoke", dropout=0.2)
    torch.manual_seed(0)
    book = config.make_model(11, 13)
    torch.manual_seed(0)
    run = training.make_run_model(config, 11, 13)
    assert {type(m) for m in dropouts(run)} == {fast.Dropout}
    assert all(m.p == 0.2 for m in dropouts(run))
    book_state, run_state = book.state_dict(), run.state_dict()
    assert book_state.keys() == run_state.keys()
    assert all(torch.equal(book_state[k], run_state[k]) for k in book_state)
    src = torch.randint(4, 11, (2, 5))
    tgt = torch.randint(4, 13, (2, 4))
    src_mask, tgt_mask = tat.padding_mask(src, tat.PAD), tat.subsequent_mask(4)
    with torch.no_grad():  # in eval mode dropout is off: the same function
        want = book.eval()(src, tgt, src_mask, tgt_mask)
        got = run.eval()(src, tgt, src_mask, tgt_mask)
    attention = [m for m in run.modules() if isinstance(m, tat.MultiHeadedAttention)]
    assert attention and all(type(m) is fast.FusedAttention for m in attention)
    # The fused kernel sums in its own order, so each float32 operation on the path
    # may round one unit in the last place differently: about 12 operations per
    # encoder layer and 16 per decoder layer, each off by up to eps times the
    # largest magnitude reaching the output.
    steps = 12 * config.N + 16 * config.N
    tolerance = steps * torch.finfo(torch.float32).eps * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance)


# ---------------------------------------------------------------------------
# fast.LabelSmoothing: the book's loss, fused


def label_smoothing_case(size=9, pad=2, n=12, seed=0):
    """float64 log-probabilities (a leaf) and targets, two of them padding."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, size, generator=gen, dtype=torch.float64).log_softmax(-1)
    target = torch.randint(0, size, (n,), generator=gen)
    target[[3, 7]] = pad
    return x.detach().requires_grad_(), target


def sum_rounding_bound(x):
    """How far two float64 sums of the same n * size terms may lie apart.

    Each loss is the sum over rows and classes of q_c * (log q_c - x_c), computed in a
    different order (the book's kl_div adds q log q - q x per element; the fused one
    regroups it as -confidence * x_target - spread * (the row's other x) plus a
    constant). A sum of N terms computed in any order is within (N - 1) * eps * (the
    sum of the terms' sizes) of the exact value; every |term| is at most |x_c| + 1/e
    (q <= 1, |q log q| <= 1/e), so both lie within that of the exact loss.
    """
    eps = torch.finfo(torch.float64).eps
    terms = x.numel()
    return 2 * terms * eps * (x.detach().abs().sum().item() + terms / math.e)


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.4])
def test_fast_label_smoothing_equals_the_books_in_value_and_gradient(smoothing):
    x, target = label_smoothing_case()
    book = tat.LabelSmoothing(9, 2, smoothing)(x, target)
    (book_grad,) = torch.autograd.grad(book, x)
    ours = fast.LabelSmoothing(9, 2, smoothing)(x, target)
    (our_grad,) = torch.autograd.grad(ours, x)
    assert ours.dtype == torch.float64
    assert abs(ours.item() - book.item()) <= sum_rounding_bound(x)
    # Both gradients are -q (zero rows for the padding targets), each element one
    # product with the incoming gradient 1: at most one rounding, of a number <= 1.
    eps = torch.finfo(torch.float64).eps
    torch.testing.assert_close(our_grad, book_grad, rtol=0, atol=eps)
    assert not our_grad[[3, 7]].any() and not our_grad[:, 2].any()


def test_fast_label_smoothing_scales_its_gradient_by_the_incoming_one():
    x, target = label_smoothing_case(seed=1)
    ours = fast.LabelSmoothing(9, 2, 0.1)(x, target)
    (scaled,) = torch.autograd.grad(ours / 7.0, x)
    crit = tat.LabelSmoothing(9, 2, 0.1)
    (book,) = torch.autograd.grad(crit(x, target) / 7.0, x)
    torch.testing.assert_close(scaled, book, rtol=0, atol=torch.finfo(x.dtype).eps)


def test_fast_label_smoothing_is_finite_where_the_padding_probability_is_zero():
    probs = torch.tensor([[0.0, 0.7, 0.1, 0.1, 0.1], [0.0, 0.0, 1.0, 0.0, 0.0]])
    x = tat.safe_log(probs.double()).requires_grad_()
    target = torch.tensor([1, 2])
    ours = fast.LabelSmoothing(5, 0, 0.1)(x, target)
    book = tat.LabelSmoothing(5, 0, 0.1)(x, target)
    assert torch.isfinite(ours)
    assert abs(ours.item() - book.item()) <= sum_rounding_bound(x)


def test_neg_entropy_is_the_sum_of_q_log_q_of_a_non_padding_row():
    for smoothing in (0.0, 0.1, 0.4):
        crit = tat.LabelSmoothing(9, 2, smoothing)
        q = crit.smoothed_targets(torch.tensor([5]), torch.float64)[0]
        expected = torch.special.xlogy(q, q).sum().item()  # 0 log 0 = 0
        assert fast.neg_entropy(crit) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_fast_label_smoothing_keeps_the_books_true_dist():
    crit = fast.LabelSmoothing(5, 0, 0.1)
    assert crit.true_dist is None and tat.LabelSmoothing(5, 0, 0.1).true_dist is None
    target = torch.tensor([1, 0, 3])
    crit(torch.zeros(3, 5).log_softmax(-1), target)
    torch.testing.assert_close(
        crit.true_dist, tat.LabelSmoothing(5, 0, 0.1).smoothed_targets(target)
    )
