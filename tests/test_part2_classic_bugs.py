"""Tests for Part 2's section "What goes wrong: the classic bugs".

Each bug of the section is switched on by an argument or a subclass in the book's
example code. Each test shows the bug's symptom with the bug switched on, and its
absence on the book's own path, which is the control: were the book's path broken
the same way, the second half of the test would fail.
"""

import math
import re

import pytest
import torch
from torch.nn.utils import parameters_to_vector

import the_annotated_transformer as tat

# The trained runs depend on the CPU kernels: `make check` runs them on both paths.
pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_cpu_thread")]

VOCAB, PAD = 11, tat.COPY_PAD
SMALL = {"N": 1, "d_model": 64, "d_ff": 128, "h": 4}
U32 = 2.0**-24  # float32's unit roundoff: one rounding errs by at most this, relative


@pytest.fixture(scope="module")
def runs(one_cpu_thread):
    """The section's three short copy-task runs: (model, loss after each step)."""
    return {
        "future": tat.train_briefly(see_future=True),
        "cold": tat.train_briefly(warmup=1),
        "right": tat.train_briefly(),
    }


def copied(model):
    """The share of symbols greedy decoding copies right (the start symbol aside)."""
    src, out = tat.copy_examples(model, n=100)
    return (src[:, 1:] == out[:, 1:]).float().mean().item()


# ---------------------------------------------------------------------------------
# Two bugs of training
# ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_decoder_that_sees_the_future_reaches_a_low_loss_but_cannot_decode(runs):
    (leaky, leak), right = runs["future"], runs["right"][0]
    # A final loss of 0.1 nats means the right token gets e^-0.1 = 90% of the
    # probability (geometric mean) when the decoder is fed the target. Seeing the
    # future, the model gets there by reading the next input token...
    assert leak[-1] < 0.1
    # ...which greedy decoding does not have: it copies about as often as a uniform
    # guess among the 10 symbols (10%; we measured 8% to 13%, seeds 0 to 2).
    assert copied(leaky) < 0.4
    # The book's mask: the same steps give a loss that decoding lives up to (we
    # measured 96% to 98% copied); a book mask that leaked would fail here.
    assert copied(right) > 0.9


def test_the_noam_rate_without_warm_up_jumps_then_stalls_near_a_guess(runs):
    cold, ok = runs["cold"][1], runs["right"][1]
    assert cold[0] == ok[0]  # the same untrained model on the same first batch
    # The jump: in its first steps at the peak rate, the loss rises above its
    # untrained value, by 1.0 to 1.8 nats in our runs (seeds 0 to 2); warmed up,
    # by 0.01 at most.
    assert max(cold[:10]) > cold[0] + 0.5
    assert max(ok[:10]) < cold[0] + 0.5
    # The stall: 150 steps later it is still near ln 10 = 2.30, the loss of a
    # uniform guess among the 10 symbols (2.0 to 2.2 in our runs); warmed up,
    # below 0.3 (0.05 to 0.11).
    assert cold[-1] > 1.5
    assert ok[-1] < 0.3


# ---------------------------------------------------------------------------------
# Two fill values
# ---------------------------------------------------------------------------------


def test_a_fill_of_minus_1e4_puts_all_the_weight_on_hidden_keys():
    # Row 0: filled with -1e4, the hidden scores are 1,000 above the best visible
    # one (-11,000), so they get 1 - e^-1000 of the weight: 1.0 in float32. Row 1
    # hides every key; a constant fill makes it uniform, all on hidden keys.
    assert tat.hidden_weight(True) == [1.0, 1.0]
    # The book's attention gives hidden keys exactly zero weight.
    assert tat.hidden_weight(False) == [0.0, 0.0]


def test_a_fill_of_minus_1e9_raises_in_float16_where_the_books_attention_works():
    raised = tat.hidden_weight(True, -1e9, torch.half)
    assert re.match(r"RuntimeError: value cannot be converted .*overflow", raised)
    assert tat.hidden_weight(False, -1e9, torch.half) == [0.0, 0.0]


# ---------------------------------------------------------------------------------
# Two bugs in the loss
# ---------------------------------------------------------------------------------


def sgd_step(loss_class, batches, accum_iter):
    """The weight change of run_epoch's SGD steps (rate 1) over `batches`, in
    float64, so that rounding stays far below the size of any step."""
    torch.manual_seed(0)
    model = tat.make_model(VOCAB, VOCAB, **SMALL, dropout=0.0).double()
    start = parameters_to_vector(model.parameters()).detach()
    loss = loss_class(model.generator, tat.LabelSmoothing(VOCAB, PAD))
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    tat.run_epoch(batches, model, loss, sgd, accum_iter=accum_iter)
    return parameters_to_vector(model.parameters()).detach() - start


def test_accumulation_dividing_by_own_tokens_takes_a_k_times_longer_step():
    k = 4
    batches = list(
        tat.data_gen(VOCAB, 8, k, generator=torch.Generator().manual_seed(3))
    )
    src = torch.cat([b.src for b in batches])
    whole = sgd_step(tat.SimpleLossCompute, [tat.Batch(src, src, pad=PAD)], 1)
    # In float64 (u = 1.1e-16) the steps differ by the order of the gradient's sums
    # (32 tokens' terms, through sums of at most d_ff = 128 terms, all of size about
    # 1 or less: a few hundred u, about 3e-14) and by each side rounding its new
    # weights (|w| < 2; k times over in k * whole: 1e-15). 1e-12 allows terms 30
    # times that size; the bug moves steps of up to 0.26 by k - 1 times their size.
    close = {"rtol": 0, "atol": 1e-12}
    torch.testing.assert_close(
        sgd_step(tat.OwnTokensLoss, batches, k), k * whole, **close
    )
    torch.testing.assert_close(
        sgd_step(tat.SimpleLossCompute, batches, k), whole, **close
    )
    assert "= 4.0000" in tat.step_ratio(True) and "= 1.0000" in tat.step_ratio(False)


def printed_floor(bug):
    """The floor `loss_floor` prints, as a number."""
    return float(re.search(r"lowest loss ([0-9.]+) per token", tat.loss_floor(bug))[1])


# How far float32 may put the smoothed loss of 10 rows of 11 logits near its minimum
# from its exact value: log-softmax's log p is off by (2 |log p| + n + 3.4) u (n = 11;
# see tests/test_part1_model.py), 23.4u with |log p| <= 4.51 here; KL divergence rounds
# log q (4.51u) and each term's difference and product; weighted by q (summing to
# 1.01) a row is off by 30u at most, and the mean of 10 rows, each about 0.0112, adds
# little more: 32u = 1.9e-6.
LOSS_ROUNDING = 32 * U32


@pytest.mark.parametrize("bug", [True, False])
def test_smoothing_mass_on_the_padding_column_lifts_the_lowest_loss_above_zero(bug):
    eps = 0.1
    z = 1 + eps / (VOCAB - 2)  # the bug's q sums to z; the book's sums to 1
    floor = z * math.log(z) if bug else 0.0
    criterion = (tat.SmoothingOnPadding if bug else tat.LabelSmoothing)(VOCAB, PAD, eps)
    # Free logits, one row per target word, trained to the criterion's minimum.
    target = torch.arange(1, VOCAB)
    logits = torch.zeros(len(target), VOCAB, requires_grad=True)
    adam, losses = torch.optim.Adam([logits], lr=0.1), []
    for _ in range(500):
        adam.zero_grad()
        loss = criterion(logits.log_softmax(-1), target) / len(target)
        loss.backward()
        adam.step()
        losses.append(loss.item())
    if bug:
        # The loss settles on z ln z (0.0112) and never goes below it, but for its
        # float32 rounding, LOSS_ROUNDING: Adam at 0.1 reaches the minimum to within
        # that by step 200 (measured: 2.3e-7 or less from step 200 on, on the plain,
        # AVX2 and this CPU's code paths).
        assert min(losses) > floor - LOSS_ROUNDING
        assert losses[-1] == pytest.approx(floor, abs=LOSS_ROUNDING)
        assert floor > 0.011
    else:
        # The book's loss keeps falling toward 0 (padding's probability, 0 in q, can
        # only shrink toward 0: 500 steps leave about 3e-4), far below the bug's floor.
        assert losses[-1] < 1e-3
    # What the book prints: its float32 loss at the minimum, rounded to 4 places.
    assert printed_floor(bug) == pytest.approx(floor, abs=5e-5 + LOSS_ROUNDING)


# ---------------------------------------------------------------------------------
# Two bugs at inference
# ---------------------------------------------------------------------------------


def test_dropout_left_on_changes_a_second_pass_and_greedy_decoding_turns_it_off():
    torch.manual_seed(0)
    model = tat.make_model(VOCAB, VOCAB, **SMALL, dropout=0.1).train()
    src = torch.tensor([[1, 5, 3, 7, 9, 4]])
    with torch.no_grad():
        one, two = (model.encode(src, None) for _ in range(2))
    # Dropout draws new units on each pass, and the memory is layer-normalised (of
    # order 1): two passes in training mode differ by far more than rounding.
    assert (one - two).abs().max() > 0.1
    # The book's path: greedy_decode switches to eval mode, and restores the mode.
    src_mask = tat.padding_mask(src, PAD)
    decodes = [tat.greedy_decode(model, src, src_mask, 6, 1) for _ in range(2)]
    assert torch.equal(*decodes) and model.training


def test_padding_added_without_a_mask_moves_the_memory_and_with_it_does_not():
    torch.manual_seed(0)
    model = tat.make_model(VOCAB, VOCAB, **SMALL, dropout=0.0).double().eval()
    src = torch.tensor([[1, 5, 3, 7, 9, 4]])
    padded = torch.cat([src, torch.full((1, 4), PAD)], dim=1)
    with torch.no_grad():
        alone = model.encode(src, None)
        unmasked = model.encode(padded, None)[:, :6]
        masked = model.encode(padded, tat.padding_mask(padded, PAD))[:, :6]
    assert (unmasked - alone).abs().max() > 0.1  # memory of order 1 moves by order 1
    # With the mask the padded keys get weight exactly 0; what is left is float64
    # rounding (2.2e-16 on values of order 1) over sums of up to 128 terms, through
    # one layer's half-dozen steps: about 128 * 6 * 2.2e-16 = 1.7e-13.
    assert (masked - alone).abs().max() < 1e-12
