"""A key/value cache for decoding, made once and written in place: the book's
KVCache (Part 4) with its interface (step, reorder, length), for speed.

The book's cache joins each step's keys and values onto the earlier ones
(torch.cat), so step t copies the t - 1 before it, and it runs each layer through
its modules as the model's forward does. DecodingCache keeps a layer's keys and
values in one buffer made for max_len positions: a step's key and value products
write straight into their slot, and attention reads views of the positions held.
The step calls few tensor operations and makes no module calls inside a layer,
because at batch 1 each operation's Python side is a good share of a step (the
bench's "most a cache can gain" row is the floor it is measured against).

Beam search may pass one memory row for each group of k consecutive rows (the k
hypotheses of a sentence): source attention then reads a sentence's keys once for
its k queries, and reorder leaves them in place unless told which sentences stay.
It computes what the book's decoder layers compute, in eval mode, up to float
rounding: tests/test_workshop_kv_cache.py compares its tokens and log-probabilities
with the book's decoding.
"""

from __future__ import annotations

import math

import torch

import the_annotated_transformer as tat


def check_decoder(model):
    """Raise a ValueError unless every decoder layer of `model` is the book's
    DecoderLayer with its attention (or a subclass: the workshop's fused and packed
    ones compute the same function, tests/test_workshop_fast.py checks) and
    feed-forward: the arithmetic this cache repeats."""
    for layer in model.decoder.layers:
        parts = (layer, layer.self_attn, layer.src_attn, layer.feed_forward)
        kinds = (tat.DecoderLayer, *[tat.MultiHeadedAttention] * 2)
        kinds += (tat.PositionwiseFeedForward,)
        if not all(isinstance(p, k) for p, k in zip(parts, kinds, strict=True)):
            names = ", ".join(type(p).__name__ for p in parts)
            raise ValueError(
                f"DecodingCache computes the book's decoder layers; this model has "
                f"{names}: decode it with the book's KVCache."
            )


def norm_function(norm):
    """The norm as a function: the book's LayerNorm as one call of torch's
    layer_norm (what its forward calls, without the module's overhead), any other
    module as itself."""
    if type(norm) is not tat.LayerNorm:
        return norm
    shape, weight, bias, eps = norm.a_2.shape, norm.a_2, norm.b_2, norm.eps
    return lambda x: torch.layer_norm(x, shape, weight, bias, eps)


class LayerWeights:
    """One DecoderLayer's weights as the right operands of products (transposed
    views: nothing is copied), its norms as functions, and the score scale
    1 / sqrt(d_k)."""

    def __init__(self, layer):
        self_attn, src_attn, ff = layer.self_attn, layer.src_attn, layer.feed_forward
        self.h, self.d_k = self_attn.h, self_attn.d_k
        self.scale = 1.0 / math.sqrt(self.d_k)
        self.self_attn = [(lin.weight.t(), lin.bias) for lin in self_attn.linears]
        self.src_attn = [(lin.weight.t(), lin.bias) for lin in src_attn.linears]
        self.ff = [(lin.weight.t(), lin.bias) for lin in (ff.w_1, ff.w_2)]
        self.norms = [norm_function(sub.norm) for sub in layer.sublayer]
        self.norm_first = layer.sublayer[0].norm_first
        self.src_k, self.src_v = src_attn.linears[1:3]


class DecodingCache:
    """The keys and values of the target positions decoded so far, per layer, in
    buffers written in place; the book's KVCache interface.

    DecodingCache(model, max_len), fresh for each batch (it holds the model's
    weights as they are when it is made): pass it to greedy_decode(..., cache=).
    step(model, memory, src_mask, ys) is decode_step for the positions of ys not
    held yet; reorder(rows, sources=None) keeps chosen rows (beam search). memory
    may have one row per group of consecutive rows of ys (beam search's k
    hypotheses of a sentence); `sources` then names the memory rows that stay.
    max_len (None: grow as needed) sizes the buffers. Eval mode only, and no
    gradients: it decodes.
    """

    def __init__(self, model, max_len=None):
        check_decoder(model)
        self.model = model
        with torch.no_grad():
            self.layers = [LayerWeights(layer) for layer in model.decoder.layers]
        self.capacity = max_len or 16
        self.length = 0  # target positions held
        self.rows = 0  # rows of the target (hypotheses)
        self.buffers = self.spares = None  # per layer, flat: the keys and values
        self.views = None  # per layer (keys^T, values) of the buffers, for attention
        self.sources = None  # per layer (keys^T, values, mask bias) of the memory

    # -- the step --------------------------------------------------------------

    def step(self, model, memory, src_mask, ys):
        """decode_step for the prefixes ys, running only positions not held yet:
        (rows, vocab) log-probabilities of the next token."""
        if model is not self.model:
            raise ValueError("a DecodingCache steps the model it was made for.")
        if model.training:
            raise ValueError("a DecodingCache decodes in eval mode: model.eval().")
        if ys.size(1) <= self.length:
            raise ValueError(
                f"ys has {ys.size(1)} positions and the cache holds {self.length}: "
                "a step needs at least one new position."
            )
        with torch.no_grad():  # written in place: no gradients through it
            while self.length < ys.size(1):
                tokens = ys[:, self.length]
                log_probs = self._position(model, memory, src_mask, tokens)
        return log_probs

    def _position(self, model, memory, src_mask, tokens):
        """Run the decoder for one new position of every row: tokens (rows,)."""
        t = self.length
        embed, position = model.tgt_embed
        x = embed(tokens) + position.pe[0, t]  # (rows, d_model)
        if self.buffers is None:
            self._start(x, memory, src_mask)
        elif t == self.capacity:
            self._grow()
        for weights, views, source in zip(
            self.layers, self.views, self.sources, strict=True
        ):
            x = self._layer(weights, x, t, *views, source)
        self.length = t + 1
        return model.generator(model.decoder.norm(x))

    def _layer(self, w, x, t, slots, keys, values, source):
        """One DecoderLayer at position t: x (rows, d_model) -> (rows, d_model)."""
        rows, hd = x.shape
        norm_self, norm_src, norm_ff = w.norms
        (w_q, b_q), (w_k, b_k), (w_v, b_v), (w_o, b_o) = w.self_attn
        # Self-attention: this position's key and value are written into their
        # slots, and its query attends over positions 0..t.
        y = norm_self(x) if w.norm_first else x
        slot = slots[t]  # (2, rows, d_model)
        torch.addmm(b_k, y, w_k, out=slot[0])
        torch.addmm(b_v, y, w_v, out=slot[1])
        q = torch.addmm(b_q, y, w_q).view(rows * w.h, 1, w.d_k)
        scores = torch.baddbmm(self.zero, q, keys[:, :, : t + 1], beta=0, alpha=w.scale)
        heads = torch.bmm(scores.softmax(-1), values[:, : t + 1])  # (rows * h, 1, d_k)
        x = self._residual(w, x, heads.view(rows, hd), w_o, b_o, norm_self)
        # Source attention, over the memory's keys and values, computed once.
        (w_q, b_q), _, _, (w_o, b_o) = w.src_attn
        y = norm_src(x) if w.norm_first else x
        heads = self._attend_to_source(torch.addmm(b_q, y, w_q), source, w)
        x = self._residual(w, x, heads, w_o, b_o, norm_src)
        # Feed-forward.
        (w_1, b_1), (w_2, b_2) = w.ff
        y = norm_ff(x) if w.norm_first else x
        hidden = torch.addmm(b_1, y, w_1).relu_()
        return self._residual(w, x, hidden, w_2, b_2, norm_ff)

    @staticmethod
    def _residual(w, x, inner, weight, bias, norm):
        """x plus the sub-layer's output projection inner @ weight + bias, in the
        layer's layout: pre-norm adds in place, post-norm normalises the sum."""
        if w.norm_first:
            return x.addmm_(inner, weight).add_(bias)
        return norm(torch.addmm(bias, inner, weight).add_(x))

    def _attend_to_source(self, q, source, w):
        """Source attention's heads for queries q (rows, d_model): (rows, d_model)."""
        keys, values, bias = source
        rows, hd = q.shape
        group = rows // (keys.size(0) // w.h)  # hypotheses per memory row
        if group == 1:
            q = q.view(rows * w.h, 1, w.d_k)
        else:  # (sentences * h, group, d_k): a sentence's queries side by side
            q = q.view(-1, group, w.h, w.d_k).transpose(1, 2).reshape(-1, group, w.d_k)
        # The bias hides the source's padding.
        scores = torch.baddbmm(bias, q, keys, alpha=w.scale)
        heads = torch.bmm(scores.softmax(-1), values)
        if group == 1:
            return heads.view(rows, hd)
        return heads.view(-1, w.h, group, w.d_k).transpose(1, 2).reshape(rows, hd)

    # -- buffers ---------------------------------------------------------------

    def _start(self, x, memory, src_mask):
        """At the first step: the buffers for x's rows, and the memory's keys and
        values for source attention."""
        self.rows, memory_rows = x.size(0), memory.size(0)
        if self.rows % memory_rows:
            raise ValueError(
                f"ys has {self.rows} rows and memory {memory_rows}: give the memory "
                "one row for each row of ys, or for each group of as many rows."
            )
        self.buffers = [self._flat(x, self.rows) for _ in self.layers]
        self.spares = [None for _ in self.layers]
        self._view_buffers()
        self.sources = [self._source(w, memory, src_mask) for w in self.layers]
        self.zero = x.new_zeros(1, 1, 1)  # baddbmm's ignored input (beta=0)

    def _flat(self, x, rows):
        """A buffer for the keys and values of `rows` rows of capacity positions."""
        return x.new_empty(self.capacity * 2 * rows * x.size(1))

    def _view_buffers(self):
        """Each layer's views of its buffer: the slots (capacity, 2, rows, d_model)
        a step writes its key and value into, and for attention the keys^T
        (rows * h, d_k, capacity) and values (rows * h, capacity, d_k)."""
        self.views = []
        for w, flat in zip(self.layers, self.buffers, strict=True):
            shape = (self.capacity, 2, self.rows * w.h, w.d_k)
            kv = flat[: math.prod(shape)].view(shape)
            slots = kv.view(self.capacity, 2, self.rows, w.h * w.d_k)
            keys, values = kv[:, 0].permute(1, 2, 0), kv[:, 1].transpose(0, 1)
            self.views.append((slots, keys, values))

    def _source(self, w, memory, src_mask):
        """Source attention's keys^T (rows * h, d_k, n) and values (rows * h, n, d_k)
        of the memory (rows, n, d_model), and the bias (rows * h, 1, n) that adds the
        lowest float to the scores of hidden positions (the book's masked_fill)."""
        rows, n, _ = memory.shape

        def heads(linear):  # (rows * h, n, d_k)
            split = linear(memory).view(rows, n, w.h, w.d_k).transpose(1, 2)
            return split.reshape(rows * w.h, n, w.d_k)

        keys, values = heads(w.src_k), heads(w.src_v)
        hidden = (src_mask == 0).repeat_interleave(w.h, dim=0)  # (rows * h, 1, n)
        bias = torch.zeros(hidden.shape, dtype=keys.dtype, device=keys.device)
        bias = bias.masked_fill(hidden, torch.finfo(keys.dtype).min)
        return keys.transpose(1, 2), values, bias

    def _grow(self):
        """Double the capacity, keeping the positions held."""
        held, old_views = self.length, self.views
        self.capacity *= 2
        for i, (slots, _, _) in enumerate(old_views):
            self.buffers[i] = slots.new_empty(self.capacity * slots[0].numel())
            self.spares[i] = None
        self._view_buffers()
        for (old, _, _), (new, _, _) in zip(old_views, self.views, strict=True):
            new[:held] = old[:held]

    def reorder(self, rows, sources=None):
        """Keep the cached rows `rows` (a tensor of row indices), in that order.

        The memory's keys and values follow `sources` (memory row indices) if
        given; by default they follow `rows` when the memory has one row per
        target row (the book's KVCache), and stay as they are when it has one per
        group of rows (beam search, whose rows stay inside their sentence).
        """
        if self.buffers is None:
            return
        n, held = rows.numel(), self.length
        for i, (slots, _, _) in enumerate(self.views):
            size = self.capacity * 2 * n * slots.size(-1)
            if self.spares[i] is None or self.spares[i].numel() < size:
                self.spares[i] = self.buffers[i].new_empty(size)
            new = self.spares[i][: held * 2 * n * slots.size(-1)]
            new = new.view(held, 2, n, slots.size(-1))
            torch.index_select(slots[:held], 2, rows, out=new)
            self.buffers[i], self.spares[i] = self.spares[i], self.buffers[i]
        memory_rows = self.sources[0][0].size(0) // self.layers[0].h
        if sources is None and memory_rows == self.rows:
            sources = rows
        self.rows = n
        self._view_buffers()
        if sources is not None:
            self.sources = [
                self._select_source(w, source, sources)
                for w, source in zip(self.layers, self.sources, strict=True)
            ]

    @staticmethod
    def _select_source(w, source, sources):
        """A layer's memory keys, values and bias, for the memory rows `sources`."""
        keys, values, bias = source
        n = sources.numel()

        def select(t):  # rows of (memory rows * h, ...) by memory row
            by_row = t.reshape(-1, w.h, *t.shape[1:]).index_select(0, sources)
            return by_row.reshape(n * w.h, *t.shape[1:])

        return (
            select(keys.transpose(1, 2)).transpose(1, 2),
            select(values),
            select(bias),
        )
