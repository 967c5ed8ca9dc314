"""workshop.fast: the CPU tricks compute what the book's plain versions compute.

Its dropout is nn.Dropout's coin with a cheaper random draw, its fused
label-smoothing loss has the book's value and gradient, and its packed training
step (issue 43: no work on padding, Q, K and V in one product, the loss from the
generator's scores) gives the book's outputs, loss and gradients.
"""

import copy
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import the_annotated_transformer as tat
from workshop import distributed, fast, precision, settings, training

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


@pytest.mark.parametrize(
    "fast_step, attention_kind",
    [(True, fast.PackedAttention), (False, fast.FusedAttention)],
    ids=["fast_step", "before_issue_43"],
)
def test_a_runs_model_is_the_books_model_with_fast_dropout_and_fused_attention(
    fast_step, attention_kind
):
    config = settings.RunConfig.from_profile("smoke", dropout=0.2, fast_step=fast_step)
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
    assert attention and all(type(m) is attention_kind for m in attention)
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


# ---------------------------------------------------------------------------
# The packed training step (issue 43): the book's outputs, loss and gradients

VOCAB = 50
TINY = {"N": 2, "d_model": 32, "d_ff": 64, "h": 4}
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24}
BF16_ULP = 2.0**-7  # bfloat16's 8-bit significand: neighbours differ by this, relative


def book_and_twin(dtype=torch.float32, seed=0):
    """(the book's model, its twin with the run's fast dropout and packed attention)
    in train mode without dropout, with the multi30k profile's shared and tied
    matrices, and non-zero biases (a swapped bias would show)."""
    torch.manual_seed(seed)
    book = tat.make_model(
        VOCAB, VOCAB, **TINY, dropout=0.0, share_embeddings=True, tie_generator=True
    ).to(dtype)
    with torch.no_grad():
        for p in book.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p), alpha=0.5)
    twin = fast.use_packed_attention(fast.use_fast_dropout(copy.deepcopy(book)))
    return book.train(), twin.train()


def ragged_batch(seed=0, pairs=6):
    """Pairs of 3 to 10 ids a side, padded: most rows of both sides end in padding."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(pairs):
        sides = []
        for n in torch.randint(3, 11, (2,), generator=gen).tolist():
            words = torch.randint(4, VOCAB, (n - 2,), generator=gen).tolist()
            sides.append([tat.BOS, *words, tat.EOS])
        examples.append(tuple(sides))
    return tat.collate_batch(examples)


@dataclass
class Step:
    """One training step's results: the decoder's output at the target positions
    that hold tokens, the summed loss, and every parameter's gradient by name."""

    out: torch.Tensor
    loss: torch.Tensor
    grads: dict


def take_step(model, trained, loss_compute, batch):
    out = trained(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    loss, node = loss_compute(out, batch.tgt_y, batch.ntokens)
    node.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return Step(out.detach()[batch.tgt != tat.PAD].float(), loss.float(), grads)


def book_step(book, batch, amp=None, smoothing=0.1):
    """The book's step: its model and SimpleLossCompute over log-probabilities
    (under the workshop's Autocast and AutocastLossCompute for bfloat16)."""
    criterion = tat.LabelSmoothing(VOCAB, tat.PAD, smoothing)
    if amp is None:
        return take_step(
            book, book, tat.SimpleLossCompute(book.generator, criterion), batch
        )
    loss_compute = precision.AutocastLossCompute(book.generator, criterion, amp)
    return take_step(book, precision.Autocast(book, amp), loss_compute, batch)


def run_step(twin, batch, amp=None, smoothing=0.1):
    """The run's step with fast_step: the models and loss computation that
    training.set_up builds for it."""
    trained, _ = training.models_for_run(twin, amp, packed=True)
    assert type(trained if amp is None else trained.model) is fast.Packed
    criterion = fast.LabelSmoothing(VOCAB, tat.PAD, smoothing)
    loss_compute = training.loss_compute_for_run(
        twin.generator, criterion, amp, packed=True
    )
    return take_step(twin, trained, loss_compute, batch)


def path_length(batch):
    """R: the reduction lengths of the products and norms on the path from the
    input to an output of the tiny model, added up.

    An encoder layer has two layer norms (d each), the Q, K, V projection (d), the
    scores (d_k), the weighted values (source length), W^O (d) and the feed-forward
    layer (d, then d_ff); a decoder layer a third norm and the source attention's
    four products; then the two final norms and the generator (d). A float sum of K
    terms, added in any order, lies within K u (the sum of its terms' sizes) of the
    exact sum (Higham's gamma_K, u the unit roundoff); the packed step adds the same
    terms as the book's in other orders (other row counts, the projections side by
    side), so to first order each of its outputs lies within R u times the size of
    the numbers carried of the book's, and the book's within as much of the exact.
    """
    d, d_k, d_ff, n = (
        TINY["d_model"],
        TINY["d_model"] // TINY["h"],
        TINY["d_ff"],
        TINY["N"],
    )
    src, tgt = batch.src.size(1), batch.tgt.size(1)
    attention = lambda keys: d + d_k + keys + d  # noqa: E731
    encoder = 2 * d + attention(src) + d + d_ff
    decoder = 3 * d + attention(tgt) + attention(src) + d + d_ff
    return n * (encoder + decoder) + 2 * d + d


def step_tolerances(book, batch, dtype):
    """(output, loss, gradient) tolerances of the comparison in `dtype`, from
    path_length: 2 R u times the size carried (both sides err, so twice). The
    backward pass runs the same path back, and adds the vocabulary's sums (V terms
    a row: the log-sum-exp and the gradient of the softmax) and the weight
    gradients' sums over the batch's tokens. The loss adds V terms a row over n
    rows, each of size at most |lse| + 2 max|z| (the scores z), and moves by at most
    2 max|dz| a row when the scores move by dz (its gradient, softmax - q, sums to
    at most 2 in size)."""
    u, reach = UNIT_ROUNDOFF[dtype], path_length(batch)
    with torch.no_grad():
        out = book(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        z = book.generator.proj(out[batch.tgt_y != tat.PAD])
    n, z_size = z.size(0), z.abs().max().item()
    lse = torch.logsumexp(z, -1).abs().max().item()
    out_tol = 2 * reach * u * out.abs().max().item()
    loss_tol = 2 * n * (VOCAB * u * (lse + 2 * z_size) + 2 * 2 * reach * u * z_size)
    backward_reach = 2 * reach + VOCAB + batch.tgt.numel() + batch.src.numel()
    return out_tol, loss_tol, 2 * backward_reach * u


def agreement(ours, book, out_tol, loss_tol, grad_tol):
    """Which of the step's results agree within the tolerances: {"out": bool,
    "loss": bool, "grads": bool}. Gradients are held to grad_tol times the largest
    gradient of the model (the sizes they carry; a mathematically zero one, as the
    key projection's bias, differs by rounding alone)."""
    scale = max(g.abs().max().item() for g in book.grads.values())
    return {
        "out": (ours.out - book.out).abs().max().item() <= out_tol,
        "loss": abs(ours.loss.item() - book.loss.item()) <= loss_tol,
        "grads": ours.grads.keys() == book.grads.keys()
        and all(
            (ours.grads[k] - g).abs().max().item() <= grad_tol * scale
            for k, g in book.grads.items()
        ),
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_the_packed_step_gives_the_books_outputs_loss_and_gradients(dtype):
    book, twin = book_and_twin(dtype)
    batch = ragged_batch()
    assert (batch.src == tat.PAD).any() and (batch.tgt == tat.PAD).any()
    tolerances = step_tolerances(book, batch, dtype)
    want = book_step(book, batch)
    got = run_step(twin, batch)
    every = {"out": True, "loss": True, "grads": True}
    assert agreement(got, want, *tolerances) == every
    # The comparison can fail: one weight of the first encoder layer moved by 4 (ten
    # times the largest Xavier weight here) changes every output, the loss and the
    # gradients by more than rounding can.
    with torch.no_grad():
        twin.encoder.layers[0].feed_forward.w_1.weight[0, 0] += 4.0
    moved = run_step(twin, batch)
    assert agreement(moved, want, *tolerances) == dict.fromkeys(every, False)


def test_the_packed_step_under_bfloat16_autocast_gives_the_books_under_autocast():
    """The run's bf16 step against the book's model under the same autocast.

    Both round the same float32 numbers to bfloat16 before every product and differ
    only in the float32 sums inside the products (by a few float32 ulps); rounded
    to bfloat16, such sums land on the same number or on neighbours one bf16 ulp
    (2^-7, relative) apart. Each of the P products on a path may so differ once
    and carry it on: P ulps of the size carried, to first order. The loss moves by
    at most 2 max|dz| a row when the scores move by dz; the gradients' path runs
    back through the same P products and the weight gradients' own (2 P).
    """
    book, twin = book_and_twin(torch.float32)
    batch = ragged_batch()
    want = book_step(book, batch, torch.bfloat16)
    got = run_step(twin, batch, torch.bfloat16)
    products = TINY["N"] * (6 + 10) + 1  # encoder 6, decoder 10, the generator
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = book(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        z = book.generator.proj(out[batch.tgt_y != tat.PAD]).float()
    out_tol = products * BF16_ULP * want.out.abs().max().item()
    loss_tol = 2 * z.size(0) * products * BF16_ULP * z.abs().max().item()
    grad_tol = 2 * products * BF16_ULP
    tolerances = out_tol, loss_tol, grad_tol
    every = {"out": True, "loss": True, "grads": True}
    assert agreement(got, want, *tolerances) == every
    assert all(g.dtype == torch.float32 for g in got.grads.values())
    # These bounds are loose (P ulps at once), so the weight moved here to show
    # that the comparison can fail is the decoder's last gain, by 2: the outputs
    # move by twice their normalised size. The loss and the gradients are held
    # closer in float32 (above) and the loss of bfloat16 scores below.
    with torch.no_grad():
        twin.decoder.norm.a_2[0] += 2.0
    moved = run_step(twin, batch, torch.bfloat16)
    assert not agreement(moved, want, *tolerances)["out"]


def test_a_fast_step_runs_bf16_model_is_packed_inside_its_autocast():
    config = settings.RunConfig.from_profile("smoke")
    module = training.make_run_model(config, 11, 11)
    trained, evaluated = training.models_for_run(module, torch.bfloat16, packed=True)
    assert type(trained) is precision.Autocast and evaluated is trained
    assert type(trained.model) is fast.Packed and trained.model.model is module
    # The run saves the book's module: no wrapper's prefix in its keys.
    assert list(module.state_dict()) == list(config.make_model(11, 11).state_dict())


def test_the_packed_step_runs_its_products_in_bfloat16_under_autocast():
    _, twin = book_and_twin(torch.float32)
    seen = []
    for linear in (twin.encoder.layers[0].feed_forward.w_1, twin.generator.proj):
        linear.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    run_step(twin, ragged_batch(), torch.bfloat16)
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in twin.parameters())


def scores_case(dtype=torch.float64, n=12, size=VOCAB, pad=tat.PAD, seed=0):
    """Scores of the generator's size (a leaf) and targets, two of them padding."""
    gen = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(n, size, generator=gen, dtype=torch.float64)
    target = torch.randint(0, size, (n,), generator=gen)
    target[[3, 7]] = pad
    return z.to(dtype).requires_grad_(), target


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.4])
def test_smoothed_cross_entropy_equals_the_books_loss_of_the_log_softmax(
    dtype, smoothing
):
    z, target = scores_case(dtype)
    crit = tat.LabelSmoothing(VOCAB, tat.PAD, smoothing)
    book = crit(F.log_softmax(z, -1), target)
    (book_grad,) = torch.autograd.grad(book, z)
    ours = fast.smoothed_cross_entropy(z, target, crit)
    (our_grad,) = torch.autograd.grad(ours, z)
    u = UNIT_ROUNDOFF[dtype]
    # Both sum the same n * V terms, each of size at most |z| + |lse| + 1/e, in other
    # orders: within n V u times their sizes' sum of the exact loss, each (gamma).
    lse = torch.logsumexp(z.detach(), -1).abs().max().item()
    sizes = z.numel() * (z.detach().abs().max().item() + lse + 1 / math.e)
    assert abs(ours.item() - book.item()) <= 2 * z.numel() * u * sizes
    # Both gradients are softmax(z) - q: exp of z - lse, with lse a sum of V terms
    # (V u, relative), z - lse one rounding more and exp one ulp: each element
    # within (V + |z - lse| + 2) u of softmax (relative), and q exact to an ulp.
    log_p = F.log_softmax(z.detach(), -1)
    slack = (VOCAB + log_p.abs() + 2) * u * log_p.exp() + u
    assert ((our_grad - book_grad).abs() <= 2 * slack).all()
    assert not our_grad[[3, 7]].any()
    # ... and can fail: one score moved by 0.1 moves its row's softmax by far more.
    moved = z.detach().clone()
    moved[0, 5] += 0.1
    moved.requires_grad_()
    (moved_grad,) = torch.autograd.grad(
        fast.smoothed_cross_entropy(moved, target, crit), moved
    )
    assert not ((moved_grad - book_grad).abs() <= 2 * slack).all()


def test_smoothed_cross_entropy_of_bfloat16_scores_sums_them_in_float32():
    """As autocast runs the book's log-softmax: in float32, from the bfloat16
    scores; the gradient is the float32 one, rounded to the scores' dtype."""
    z, target = scores_case(torch.bfloat16)
    crit = tat.LabelSmoothing(VOCAB, tat.PAD, 0.1)
    ours = fast.smoothed_cross_entropy(z, target, crit)
    (grad,) = torch.autograd.grad(ours, z)
    wide = z.detach().float().requires_grad_()
    expected = fast.smoothed_cross_entropy(wide, target, crit)
    (expected_grad,) = torch.autograd.grad(expected, wide)
    assert ours.dtype == torch.float32 and torch.equal(ours, expected)
    assert grad.dtype == torch.bfloat16
    assert torch.equal(grad, expected_grad.bfloat16())


def test_smoothed_cross_entropy_refuses_a_second_backward_pass():
    """Its backward pass writes the gradient over what the forward pass kept: a
    second pass (retain_graph) fails loudly instead of computing from it."""
    z, target = scores_case()
    loss = fast.smoothed_cross_entropy(z, target, tat.LabelSmoothing(VOCAB, 0, 0.1))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_the_packed_loss_computation_gives_the_books_nll_and_true_dist():
    book, twin = book_and_twin(torch.float64)
    batch = ragged_batch()
    with torch.no_grad():
        out = book(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        crit = fast.LabelSmoothing(VOCAB, tat.PAD, 0.1)
        want = tat.SimpleLossCompute(book.generator, crit).nll(out, batch.tgt_y)
        packed = fast.PackedLossCompute(book.generator, crit)
        got = packed.nll(out, batch.tgt_y)
    # The same n V-term sums in the same float64 kernels, on fewer rows.
    n = batch.ntokens
    assert abs(got.item() - want.item()) <= 2 * n * VOCAB * 2.0**-53 * want.item()
    torch.testing.assert_close(
        crit.true_dist, crit.smoothed_targets(batch.tgt_y.reshape(-1))
    )
    assert (
        packed.fused and not fast.PackedLossCompute(book.generator, nn.L1Loss()).fused
    )


def test_rows_pack_the_tokens_in_order_and_unpack_them_with_zeros_at_padding():
    keep = torch.tensor([[True, True, False], [True, False, False]])
    rows = fast.Rows.where(keep)
    assert rows.index.tolist() == [0, 1, 3]
    assert rows.batch.tolist() == [0, 0, 1] and rows.position.tolist() == [0, 1, 0]
    x = torch.arange(12.0).view(2, 3, 2)
    packed = rows.pack(x)
    assert packed.tolist() == [[0.0, 1.0], [2.0, 3.0], [6.0, 7.0]]
    back = rows.unpack(packed)
    assert torch.equal(back[keep], x[keep]) and not back[~keep].any()


def test_packed_takes_masks_of_any_dtype_as_the_book_does():
    book, twin = book_and_twin(torch.float64)
    batch = ragged_batch()
    packed = fast.Packed(twin.eval())
    with torch.no_grad():
        boolean = packed(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        ones = packed(
            batch.src, batch.tgt, batch.src_mask.double(), batch.tgt_mask.long()
        )
    assert torch.equal(boolean, ones)


def test_packed_runs_the_books_forward_pass_off_the_cpu():
    """On another device (here "meta": shapes without values, where counting the
    tokens cannot run) Packed is the wrapped model's own forward pass."""
    _, twin = book_and_twin()
    batch = ragged_batch().to("meta")
    out = fast.Packed(twin.to("meta"))(
        batch.src, batch.tgt, batch.src_mask, batch.tgt_mask
    )
    assert out.device.type == "meta" and out.shape == (*batch.tgt.shape, 32)
    with pytest.raises((NotImplementedError, RuntimeError)):
        fast.Rows.where(batch.src_mask[:, 0])  # what the packed path would do


def test_packed_refuses_a_model_without_packed_attention_in_one_line():
    book, _ = book_and_twin()
    with pytest.raises(ValueError, match="use_packed_attention") as error:
        fast.Packed(book)
    assert len(str(error.value).splitlines()) == 1
    with pytest.raises(ValueError, match="use_packed_attention"):
        training.models_for_run(book, packed=True)
    assert training.models_for_run(book) == (book, book)  # unpacked: as it is


@pytest.mark.parametrize("mode", ["self", "source", "three inputs"])
def test_packed_attention_equals_the_books_in_block_and_packed_layouts(mode):
    torch.manual_seed(2)
    book = tat.MultiHeadedAttention(4, 32, dropout=0.0)
    with torch.no_grad():
        for linear in book.linears:
            linear.bias.normal_()
    ours = fast.packed_twin(book)
    keep = torch.tensor([[True] * 5 + [False] * 2, [True] * 7])
    mask = keep.unsqueeze(1)  # (batch, 1, 7): source padding
    x, m, v = torch.randn(3, 2, 7, 32).unbind(0)
    key, value = {"self": (x, x), "source": (m, m), "three inputs": (m, v)}[mode]
    query = x
    want = book(query, key, value, mask)
    block = ours(query, key, value, mask)
    rows = fast.Rows.where(keep)
    packed_in = [rows.pack(t) for t in (query, key, value)]
    if mode == "self":
        packed_in = [packed_in[0]] * 3  # the same tensor, as a layer passes it
    elif mode == "source":
        packed_in[2] = packed_in[1]
    packed = ours(*packed_in, fast.PackedMask(mask, rows, rows))
    # Four products of at most d_model = 32 terms (Q, K and V; scores of d_k = 8;
    # weights times 7 values; W^O): 2 R u of the largest size carried, as above.
    reach = 32 + 8 + 7 + 32
    scale = max(t.abs().max().item() for t in (want, query, key, value))
    tol = 2 * reach * 2.0**-24 * scale
    torch.testing.assert_close(block, want, rtol=0, atol=tol)
    torch.testing.assert_close(packed, rows.pack(want), rtol=0, atol=tol)
    with torch.no_grad():
        book.linears[1].weight[0, 0] += 1.0  # shared: the twin moves too
    assert not torch.allclose(ours(query, key, value, mask), want, rtol=0, atol=tol)


def test_a_fast_step_runs_weights_load_into_the_books_plain_model():
    config = settings.RunConfig.from_profile("smoke")
    torch.manual_seed(0)
    run = training.make_run_model(config, 11, 13)
    plain = config.make_model(11, 13)
    plain.load_state_dict(run.state_dict(), strict=True)
    src = torch.randint(4, 11, (2, 5))
    tgt = torch.randint(4, 13, (2, 4))
    masks = tat.padding_mask(src, tat.PAD), tat.subsequent_mask(4)
    with torch.no_grad():
        want = plain.eval()(src, tgt, *masks)
        got = training.models_for_run(run.eval(), packed=True)[1](src, tgt, *masks)
    # As in the run's model test above: a few float32 operations per layer.
    steps = 12 * config.N + 16 * config.N
    tolerance = steps * torch.finfo(torch.float32).eps * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance)


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("in_processes", [False, True], ids=["one", "ddp"])
def test_a_run_picks_the_packed_loss_computation_with_its_fast_step(amp, in_processes):
    model = settings.RunConfig.from_profile("smoke").make_model(11, 11)
    criterion = fast.LabelSmoothing(11, tat.PAD, 0.1)
    packed = training.loss_compute_for_run(
        model.generator, criterion, amp, in_processes, packed=True
    )
    before = training.loss_compute_for_run(
        model.generator, criterion, amp, in_processes
    )
    assert isinstance(packed, fast.PackedLossCompute)
    assert not isinstance(before, fast.PackedLossCompute)
    for made in (packed, before):
        assert isinstance(made, precision.AutocastLossCompute) == (amp is not None)
        assert isinstance(made, distributed.DistributedLossCompute) == in_processes


@pytest.mark.slow
def test_a_run_saved_before_fast_step_existed_resumes_with_it(
    smoke_run, multi30k_dir, tmp_path
):
    last = torch.load(smoke_run.out / "last.pt", weights_only=False)
    del last["config"]["fast_step"]  # as every run before issue 43 saved it
    torch.save(last, tmp_path / "last.pt")
    history = training.train_model(
        None, multi30k_dir, tmp_path, resume=True, changes={"epochs": 3}, quiet=True
    )
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert math.isfinite(history[-1]["val_nll"])
    resumed = torch.load(tmp_path / "last.pt", weights_only=False)
    assert resumed["config"]["fast_step"] is True
