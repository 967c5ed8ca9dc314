"""Speed tricks the book leaves out, which training runs put into the book's
models: a cheaper dropout, fused attention and a fused label-smoothing loss; and the
packed training step (issue 43), which computes only the positions that hold
tokens, projects Q, K and V with one matrix product, and takes the loss from the
generator's scores over those tokens alone. Tests check each against the book's
plain version."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import the_annotated_transformer as tat


class Dropout(nn.Dropout):
    """nn.Dropout, drawing its mask from 16 random bits per element on a CPU.

    nn.Dropout draws one random float per element; on a CPU the generator is then a
    fifth of a small model's training step. This draws 64 random bits at a time and
    cuts them into four 16-bit numbers, one per element: the same coin with p rounded
    to a multiple of 1/65536, for a quarter of the generator's work. On a GPU it is
    nn.Dropout unchanged.
    """

    def forward(self, x):
        if not self.training or not 0.0 < self.p < 1.0 or x.device.type != "cpu":
            return super().forward(x)
        return x * dropout_keep_mask(x, self.p)


def dropout_keep_mask(x, p):
    """A mask like x: 0 with probability p, else 1 / (1 - p) (p in 1/65536 steps)."""
    n = x.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64)
    words.random_(-(2**63), 2**63 - 1)  # uniform over (almost) every int64
    draws = words.view(torch.int16)[:n].view(x.shape)  # uniform in [-32768, 32767]
    dropped = round(p * 65536)  # how many of the 65536 values mean "drop"
    keep = draws >= dropped - 32768
    return keep.to(x.dtype).mul_(65536 / (65536 - dropped))


def use_fast_dropout(model):
    """Replace every nn.Dropout in `model` by this module's Dropout (same p)."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                setattr(module, name, Dropout(child.p, child.inplace))
    return model


class FusedAttention(tat.MultiHeadedAttention):
    """The book's attention layer, with the heads computed by PyTorch's fused
    scaled_dot_product_attention: the same arithmetic in one kernel, without
    materialising the weights (so `.attn` stays None)."""

    def attend(self, query, key, value, mask=None):
        mask = None if mask is None else mask.unsqueeze(1)  # the same for every head
        p = self.dropout.p if self.training else 0.0
        x = F.scaled_dot_product_attention(query, key, value, mask, dropout_p=p)
        x = x.transpose(1, 2).contiguous().view(x.size(0), -1, self.h * self.d_k)
        return self.linears[-1](x)


def fused(attention):
    """A FusedAttention that shares the book layer's projections and dropout (the
    same parameters, so training either trains both)."""
    layer = FusedAttention(
        attention.h, attention.h * attention.d_k, attention.dropout.p
    )
    layer.linears, layer.dropout = attention.linears, attention.dropout
    return layer.train(attention.training)


def use_fused_attention(model):
    """Put a FusedAttention in place of every book MultiHeadedAttention in `model`;
    returns the model (or, for a bare attention layer, its fused twin)."""
    if type(model) is tat.MultiHeadedAttention:
        return fused(model)
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is tat.MultiHeadedAttention:
                setattr(module, name, fused(child))
    return model


class LabelSmoothing(tat.LabelSmoothing):
    """The book's LabelSmoothing, computed without building the target table q.

    q takes two values: `confidence` on the target and `spread` on every other word
    but padding. So sum_c q_c (log q_c - x_c) is -confidence * x_target - spread *
    (the sum of the other non-padding x_c) + sum_c q_c log q_c, and the gradient with
    respect to x is -q, which the backward pass writes once. `spread`, `last_target`
    and `true_dist` are the book's.
    """

    def forward(self, x, target):
        """x: (n, size) log-probabilities; target: (n,) ids. Returns the summed loss."""
        self.last_target = target.detach()
        return _SmoothedKL.apply(x, target, self)


def neg_entropy(crit):
    """sum_c q_c log q_c of one non-padding row: the loss's constant part."""
    value = crit.confidence * math.log(crit.confidence)
    if crit.spread > 0:
        value += (crit.size - 2) * crit.spread * math.log(crit.spread)
    return value


class _SmoothedKL(torch.autograd.Function):
    """LabelSmoothing's summed loss, with the gradient -q written in one pass."""

    @staticmethod
    def forward(ctx, x, target, crit):
        pad = crit.padding_idx
        x_target = x.gather(1, target.unsqueeze(1)).squeeze(1)
        x_others = x.sum(1) - x[:, pad] - x_target
        cross_entropy = -(crit.confidence * x_target + crit.spread * x_others)
        per_row = cross_entropy + neg_entropy(crit)
        ctx.save_for_backward(target)
        ctx.crit, ctx.dtype = crit, x.dtype
        return per_row.masked_fill(target == pad, 0.0).sum()

    @staticmethod
    def backward(ctx, grad):
        (target,) = ctx.saved_tensors
        q = ctx.crit.smoothed_targets(target, ctx.dtype)  # zero rows for padding
        return q.mul_(-grad), None, None


# ---------------------------------------------------------------------------
# The packed training step (issue 43): no work on padding


@dataclass(frozen=True)
class Rows:
    """The positions of a (batch, length) block that hold tokens, in row-major
    order: `index` into the block flattened to batch * length rows, and each one's
    `batch` row and `position`. pack and unpack move a tensor between the block's
    layout (batch, length, ...) and the packed one (tokens, ...)."""

    index: torch.Tensor  # (tokens,)
    batch: torch.Tensor  # (tokens,)
    position: torch.Tensor  # (tokens,)
    shape: tuple  # (batch, length)

    @classmethod
    def where(cls, keep):
        """The Rows of a (batch, length) boolean tensor's True entries."""
        index = keep.flatten().nonzero().squeeze(1)
        length = keep.size(1)
        return cls(index, index // length, index % length, tuple(keep.shape))

    def pack(self, x):
        """(batch, length, ...) -> (tokens, ...)."""
        return x.flatten(0, 1).index_select(0, self.index)

    def unpack(self, x):
        """(tokens, ...) -> (batch, length, ...), zeros where there is no token."""
        block = x.new_zeros(self.shape[0] * self.shape[1], *x.shape[1:])
        return block.index_copy(0, self.index, x).view(*self.shape, *x.shape[1:])


@dataclass(frozen=True)
class PackedMask:
    """What PackedAttention needs in place of the book's mask: the mask itself,
    and the Rows of its queries and of its keys."""

    mask: torch.Tensor  # the book's (batch or 1, q_len or 1, k_len), True: may attend
    queries: Rows
    keys: Rows


class PackedAttention(FusedAttention):
    """FusedAttention that projects Q, K and V with one matrix product in
    self-attention, and K and V with one in source attention: the book's three
    weight matrices side by side, so one pass over the input instead of three.

    Given a PackedMask, its inputs and output are packed, (tokens, d_model): the
    projections run on the tokens alone, are spread into the (batch, h, length,
    d_k) blocks that attention needs (zeros where there is no token, which the mask
    hides), and the output is gathered back to the tokens before W^O. Given the
    book's mask it computes what FusedAttention computes, in the block layout.
    """

    def forward(self, query, key, value, mask=None):
        packed = mask if isinstance(mask, PackedMask) else None
        if packed is None and query.device.type != "cpu":  # see Packed
            return super().forward(query, key, value, mask)
        queries, keys = (packed.queries, packed.keys) if packed else (None, None)
        if query is key and key is value:  # self-attention: one product
            query, key, value = self.project(query, self.linears[:3], queries)
        elif key is value:  # source attention: Q, then K and V in one product
            (query,) = self.project(query, self.linears[:1], queries)
            key, value = self.project(key, self.linears[1:3], keys)
        else:  # three inputs, three products
            (query,) = self.project(query, self.linears[:1], queries)
            (key,) = self.project(key, self.linears[1:2], keys)
            (value,) = self.project(value, self.linears[2:3], keys)
        if packed is None:
            return self.attend(query, key, value, mask)
        mask = packed.mask.unsqueeze(1)  # the same for every head
        p = self.dropout.p if self.training else 0.0
        x = F.scaled_dot_product_attention(query, key, value, mask, dropout_p=p)
        x = x[queries.batch, :, queries.position]  # (tokens, h, d_k)
        return self.linears[-1](x.reshape(-1, self.h * self.d_k))

    def project(self, x, linears, rows=None):
        """The heads of x projected by each of `linears`, as one product: a list of
        (batch, h, length, d_k) tensors. x is (batch, length, d_model), or packed
        (tokens, d_model) with its Rows."""
        weight = torch.cat([linear.weight for linear in linears])
        bias = torch.cat([linear.bias for linear in linears])
        y = F.linear(x, weight, bias)  # (..., len(linears) * d_model)
        if rows is None:  # (batch, length, m * d_model) -> m x (batch, h, length, d_k)
            heads = y.view(*y.shape[:2], len(linears), self.h, self.d_k)
            return heads.permute(2, 0, 3, 1, 4).unbind(0)
        batch, length = rows.shape
        block = y.new_zeros(len(linears), batch, self.h, length, self.d_k)
        tokens = y.view(-1, len(linears), self.h, self.d_k)
        block[:, rows.batch, :, rows.position] = tokens  # zeros elsewhere
        return block.unbind(0)


def use_packed_attention(model):
    """Put a PackedAttention in place of every book MultiHeadedAttention (or
    FusedAttention) in `model`, sharing its projections and dropout; returns the
    model."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) in (tat.MultiHeadedAttention, FusedAttention):
                setattr(module, name, packed_twin(child))
    return model


def packed_twin(attention):
    """A PackedAttention with `attention`'s projections and dropout (the same
    parameters, so training either trains both)."""
    layer = PackedAttention(
        attention.h, attention.h * attention.d_k, attention.dropout.p
    )
    layer.linears, layer.dropout = attention.linears, attention.dropout
    return layer.train(attention.training)


def packs(model):
    """Whether Packed can run `model`: the book's EncoderDecoder whose attention
    layers are all PackedAttention."""
    if not isinstance(model, tat.EncoderDecoder):
        return False
    layers = [m for m in model.modules() if isinstance(m, tat.MultiHeadedAttention)]
    return bool(layers) and all(type(m) is PackedAttention for m in layers)


class Packed(nn.Module):
    """The wrapped model's forward pass computed on its tokens alone.

    The book's model computes every position of its padded blocks, padding
    included; the masks keep padding out of every position that holds a token, so
    that work changes nothing the loss sees (issue 43 counts it as no useful FLOP:
    workshop/flops.py). Here the embeddings are packed to (tokens, d_model), every
    layer norm, feed-forward layer, residual and projection runs on the tokens
    alone, and only attention sees the blocks (PackedAttention). The output is the
    book's at every position that some query may attend to, and 0 at the others.
    The model must pass `packs`. It holds no weights of its own: train and save the
    wrapped model.

    On a GPU it runs the wrapped model's own forward pass, and PackedAttention and
    PackedLossCompute compute as FusedAttention and the book do: there the step is
    bound by kernel launches, not arithmetic, and the packed one (its index
    kernels, and a wait for the device to count the tokens) measured slower (an
    H100: the multi30k profile's step at 0.84x in float32 and 0.94x in bf16, the
    base sizes' at 0.95x).
    """

    def __init__(self, model):
        super().__init__()
        if not packs(model):
            raise ValueError(
                "Packed needs the book's EncoderDecoder with PackedAttention layers "
                "(fast.use_packed_attention)."
            )
        self.model = model

    def forward(self, src, tgt, src_mask, tgt_mask):
        """The book's EncoderDecoder.forward, with its checks, on the tokens."""
        model = self.model
        if src.device.type != "cpu":
            return model(src, tgt, src_mask, tgt_mask)
        pairs = f"src has {src.size(0)} rows, tgt {tgt.size(0)}: one per pair."
        tat.require(src.size(0) == tgt.size(0), pairs)
        tat.check_mask_shape(src_mask, "src_mask", src.size(0), 1, src.size(1))
        tat.check_mask_shape(tgt_mask, "tgt_mask", *tgt.shape, tgt.size(1))
        tat.check_masks(src_mask=src_mask, tgt_mask=tgt_mask)
        # Masks of any dtype, as the book's: True (or 1) where a query may attend.
        src_mask, tgt_mask = src_mask != 0, tgt_mask != 0
        # A position holds a token where some query may attend to it.
        src_rows = Rows.where(src_mask.any(1).expand(src.shape))
        tgt_rows = Rows.where(tgt_mask.any(1).expand(tgt.shape))
        memory = model.encoder(
            src_rows.pack(model.src_embed(src)),
            PackedMask(src_mask, src_rows, src_rows),
        )
        out = model.decoder(
            tgt_rows.pack(model.tgt_embed(tgt)),
            memory,
            PackedMask(src_mask, tgt_rows, src_rows),
            PackedMask(tgt_mask, tgt_rows, tgt_rows),
        )
        return tgt_rows.unpack(out)


class PackedLossCompute(tat.SimpleLossCompute):
    """The book's SimpleLossCompute, on the targets that are not padding and from
    the generator's scores: the generator's projection runs on those rows alone,
    and the label-smoothed loss is taken from its scores (smoothed_cross_entropy)
    instead of from a log-softmax of every row. nll, likewise, is the cross
    entropy of those rows' scores. For the book's Generator and LabelSmoothing
    (or this module's) on a CPU; any other pair, or a GPU (see Packed), is computed
    as the book computes it."""

    def __init__(self, generator, criterion):
        super().__init__(generator, criterion)
        self.fused = type(generator) is tat.Generator and type(criterion) in (
            tat.LabelSmoothing,
            LabelSmoothing,
        )

    def scores(self, x, y):
        """(the generator's scores (tokens, vocab), their targets (tokens,)) of the
        rows of x (batch, seq, d_model) whose target in y is not padding."""
        self.criterion.last_target = y.reshape(-1).detach()  # the book's true_dist
        target = y.reshape(-1)
        rows = (target != self.criterion.padding_idx).nonzero().squeeze(1)
        hidden = x.reshape(-1, x.size(-1)).index_select(0, rows)
        return self.generator.proj(hidden), target.index_select(0, rows)

    def __call__(self, x, y, norm):
        if not self.fused or x.device.type != "cpu":
            return super().__call__(x, y, norm)
        scores, target = self.scores(x, y)
        loss = smoothed_cross_entropy(scores, target, self.criterion)
        return loss.detach(), loss / norm

    def nll(self, x, y):
        if not self.fused or x.device.type != "cpu":
            return super().nll(x, y)
        scores, target = self.scores(x, y)
        return F.cross_entropy(scores, target, reduction="sum")


def smoothed_cross_entropy(scores, target, crit):
    """The book's LabelSmoothing loss `crit` of log_softmax(scores), summed over the
    rows whose target is not crit.padding_idx, computed from the scores: see
    _SmoothedCrossEntropy. scores (n, vocab); target (n,)."""
    return _SmoothedCrossEntropy.apply(scores, target, crit)


class _SmoothedCrossEntropy(torch.autograd.Function):
    """LabelSmoothing(log_softmax(z), target), summed, with its gradient written once.

    With log-probabilities z_c - lse (lse the row's log-sum-exp) and the book's
    target distribution q (confidence on the target, spread on every other word but
    padding, 0 on padding), a row's loss sum_c q_c (log q_c - z_c + lse) is

        sum_c q_c log q_c + lse * sum_c q_c - confidence * z_target
            - spread * (the row's sum of z - z_padding - z_target),

    and its gradient with respect to z is softmax(z) * sum_c q_c - q. The forward
    pass keeps e = exp(z - max z) and its row sums s (lse = max z + log s), and the
    backward pass turns e into the gradient in place: e * sum_c q_c / s, less q
    (spread everywhere, then the two columns that differ). Scores in bfloat16 or
    float16 are read as float32 (as autocast runs the book's log-softmax), and their
    gradient is returned in their own dtype. Rows whose target is padding add 0 and
    get a zero gradient.
    """

    @staticmethod
    def forward(ctx, z, target, crit):
        pad, mass = crit.padding_idx, crit.confidence + crit.spread * (crit.size - 2)
        # Low-precision scores are copied to float32 once: every pass after reads
        # one dtype (a pass over mixed dtypes is several times slower on a CPU).
        x = z.to(torch.promote_types(z.dtype, torch.float32))
        top = x.amax(1, keepdim=True)  # (n, 1)
        x_target = x.gather(1, target.unsqueeze(1)).squeeze(1)
        x_others = x.sum(1) - x[:, pad] - x_target
        e = (x.sub_(top) if x is not z else x - top).exp_()  # exp(z - max z)
        s = e.sum(1)
        lse = top.squeeze(1) + s.log()
        per_row = mass * lse - crit.confidence * x_target - crit.spread * x_others
        per_row = per_row + neg_entropy(crit)
        ctx.save_for_backward(e, s, target)
        ctx.crit, ctx.mass, ctx.dtype = crit, mass, z.dtype
        return per_row.masked_fill(target == pad, 0.0).sum()

    @staticmethod
    def backward(ctx, grad):
        e, s, target = ctx.saved_tensors  # e is spent here: one backward pass only
        crit, pad = ctx.crit, ctx.crit.padding_idx
        g = e.mul_((grad * ctx.mass / s).unsqueeze(1))  # softmax(z) * sum q * grad
        if crit.spread:
            g.sub_(grad * crit.spread)  # every column but two holds spread
            g[:, pad] += grad * crit.spread  # padding's q is 0
        rows = torch.arange(g.size(0), device=g.device)
        g[rows, target] += grad * (crit.spread - crit.confidence)  # confidence's
        padded = (target == pad).nonzero().squeeze(1)
        if padded.numel():
            g.index_fill_(0, padded, 0.0)
        return g.to(ctx.dtype), None, None
