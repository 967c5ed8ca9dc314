"""The book's four architecture diagrams, drawn as SVG: rounded boxes coloured by
kind of block, labels and arrows, in one small SVG vocabulary (boxes, labels,
arrows, residual paths, stacks). A docs asset: `python -m workshop figures` writes
them as PNG beside the book's charts (rendered offline by vl-convert), and so does
`python -m tools.diagrams [--out images/] [NAME ...]`.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from html import escape
from itertools import pairwise
from pathlib import Path

FONT = "sans-serif"  # generic family: vl-convert renders it offline with its own fonts


INK, MUTED, SKIP, MEMORY = "#222222", "#5f6b76", "#8a949e", "#127a80"


PALETTE = {  # kind of block: (fill, stroke, name in the legend)
    "embedding": ("#efe3f8", "#8e5cc4", "embedding"),
    "attention": ("#fde4cf", "#e07b24", "attention"),
    "feed_forward": ("#d9ecfb", "#2f7fd1", "feed-forward"),
    "norm": ("#fff4c2", "#c9a227", "LayerNorm"),
    "linear": ("#dcf2e3", "#2e9a5a", "linear"),
    "op": ("#eef1f4", "#7b8794", "operation"),
}


BOX_W, GAP, PLUS_R = 210, 24, 10  # block width, gap between blocks, radius of a ⊕


COLUMNS = 200, 580, 390  # the architectures' encoder, decoder and memory: they line up


@dataclass
class Box:
    """Where a block sits: centre x, top y, width and height."""

    cx: float
    y: float
    w: float = BOX_W
    h: float = 40

    left = property(lambda self: self.cx - self.w / 2)
    right = property(lambda self: self.cx + self.w / 2)
    bottom = property(lambda self: self.y + self.h)
    mid = property(lambda self: self.y + self.h / 2)


def _svg(width, height, body):
    """An SVG document: white background and an arrowhead marker per arrow colour."""
    markers = "".join(
        f'<marker id="head{c[1:]}" viewBox="0 0 10 10" refX="9" refY="5" '
        f'markerWidth="7" markerHeight="7" orient="auto">'
        f'<path d="M0,1 L10,5 L0,9 z" fill="{c}"/></marker>'
        for c in (INK, SKIP, MEMORY)
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="{FONT}"><defs>{markers}</defs>'
        f'<rect width="100%" height="100%" fill="white"/>{"".join(body)}</svg>'
    )


def _text(x, y, text, size=13, anchor="middle", colour=INK, bold=False, italic=False):
    """Text centred vertically on y; `_{..}` and `^{..}` mark sub- and superscripts."""

    def script(m):
        shift, small = ("sub" if m[1] == "_" else "super"), size * 0.72
        return f'<tspan baseline-shift="{shift}" font-size="{small:.1f}">{m[2]}</tspan>'

    markup = re.sub(r"([_^])\{(.*?)\}", script, escape(text))
    weight, style = ("bold" if bold else "normal"), ("italic" if italic else "normal")
    return (  # resvg ignores dominant-baseline, so lower the baseline by hand
        f'<text x="{x}" y="{y + size * 0.35:.1f}" font-size="{size}" fill="{colour}" '
        f'text-anchor="{anchor}" font-weight="{weight}" font-style="{style}">'
        f"{markup}</text>"
    )


def _note(x, y, text, anchor="middle", colour=MUTED, size=10.5):
    """A small italic annotation: a shape, a name, a side remark."""
    return _text(x, y, text, size, anchor, colour, italic=True)


def _rect(x, y, w, h, fill, stroke, rx=7, dash=None, width=1.5):
    """A rounded rectangle; `dash` ("5 3") draws its outline dashed."""
    dashes = f' stroke-dasharray="{dash}"' if dash else ""
    return (
        f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="{rx}" fill="{fill}" '
        f'stroke="{stroke}" stroke-width="{width}"{dashes}/>'
    )


def _block(box, title, kind, note=None, dashed=False):
    """A box coloured by its kind, with a title and an optional grey note below it."""
    fill, stroke, _ = PALETTE[kind]
    rect = _rect(
        box.left, box.y, box.w, box.h, fill, stroke, dash="5 3" if dashed else None
    )
    if note is None:
        return rect + _text(box.cx, box.mid, title)
    notes = _text(box.cx, box.mid + 9, note, size=10.5, colour=MUTED)
    return rect + _text(box.cx, box.mid - 7, title) + notes


def _deck(box, title, kind, note=None, copies=3, step=7):
    """A block drawn as a deck of cards: the same computation, several times over."""
    behind = "".join(
        _block(Box(box.cx + i * step, box.y - i * step, box.w, box.h), "", kind)
        for i in range(copies - 1, 0, -1)
    )
    return behind + _block(box, title, kind, note)


def _arrow(*points, colour=INK, dashed=False):
    """A polyline through `points` with an arrowhead at the last one."""
    path = " ".join(f"{x},{y}" for x, y in points)
    dash = ' stroke-dasharray="5 3"' if dashed else ""
    return (
        f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"'
        f'{dash} marker-end="url(#head{colour[1:]})"/>'
    )


def _plus(cx, cy, r=PLUS_R):
    """The ⊕ where a residual connection adds its input back."""
    cross = f"M{cx - r + 4},{cy} H{cx + r - 4} M{cx},{cy - r + 4} V{cy + r - 4}"
    return (
        f'<circle cx="{cx}" cy="{cy}" r="{r}" fill="white" stroke="{INK}" '
        f'stroke-width="1.5"/><path d="{cross}" stroke="{INK}" stroke-width="1.5"/>'
    )


def _inputs(*inputs):
    """Each input's name in bold at the top, with its shape below: (name, x, shape)."""
    return [
        _text(x, 22, name, 16, bold=True) + _text(x, 42, shape, 10.5, colour=MUTED)
        for name, x, shape in inputs
    ]


def _output(cx, y, label, *formulas):
    """An arrow down from y to the output's label, then the formulas it computes."""
    body = [_arrow((cx, y), (cx, y + GAP)), _note(cx, y + GAP + 14, label, size=12)]
    return body + [
        _text(cx, y + GAP + 50 + 24 * i, f, 14) for i, f in enumerate(formulas)
    ]


def _sublayer_block(box, title, mask):
    """A sub-layer's block: attention names its `mask`; with none, the feed-forward."""
    kind = "attention" if mask else "feed_forward"
    note = f"MultiHeadedAttention, {mask}" if mask else "PositionwiseFeedForward"
    return _block(box, title, kind, note)


def _residual(cx, y, to_y, side, to_dx):
    """The residual path: from a dot on the main line at y, out beside the blocks
    (`side` -1 left, 1 right) to to_y, then in to `to_dx` from the centre line."""
    skip_x = cx + side * (BOX_W / 2 + 18)
    return [
        _arrow(
            *[(cx, y), (skip_x, y), (skip_x, to_y)],
            (cx + side * to_dx, to_y),
            colour=SKIP,
        ),
        f'<circle cx="{cx}" cy="{y}" r="2.5" fill="{INK}"/>',
    ]


def _sublayer(cx, y, title, mask, in_label, side):
    """A pre-norm SublayerConnection from y down: x + Dropout(Sublayer(LayerNorm(x)))
    (post-norm: _add_and_norm)."""
    norm, layer = Box(cx, y + GAP, h=28), Box(cx, y + 2 * GAP + 28)
    plus_y = layer.bottom + GAP + PLUS_R
    body = [
        _arrow((cx, y), (cx, norm.y)),
        _block(norm, "LayerNorm", "norm"),
        _arrow((cx, norm.bottom), (cx, layer.y)),
        _sublayer_block(layer, title, mask),
        _arrow((cx, layer.bottom), (cx, plus_y - PLUS_R)),
        *_residual(cx, y + 8, plus_y, side, PLUS_R),
        _plus(cx, plus_y),
    ]
    if in_label:
        body.append(_note(cx + 7, norm.bottom + GAP / 2, in_label, "start", size=11))
    return body, layer, plus_y + PLUS_R


def _stack(cx, name, tokens, side, sublayers):
    """One side of the model, top down: tokens, embeddings, N layers, final LayerNorm.

    `side` (-1 or 1) puts the residual paths and the "×N" left or right of the blocks.
    """
    embed, position = Box(cx, 70), Box(cx, 134)
    body = [
        _text(cx, 18, name, 16, bold=True),
        _note(cx, 42, tokens, size=12),
        _arrow((cx, 52), (cx, embed.y)),
        _block(embed, "Embeddings", "embedding", "lut(x) · √d_{model}"),
        _arrow((cx, embed.bottom), (cx, position.y)),
        _block(position, "PositionalEncoding", "embedding", "x + sinusoids, dropout"),
    ]
    y, layers = position.bottom + 12, []
    for title, mask, in_label in sublayers:
        part, layer, y = _sublayer(cx, y, title, mask, in_label, side)
        body += part
        layers.append(layer)
    bottom = y + 10
    final = Box(cx, bottom + GAP, h=36)
    body += _repeated(cx, position.bottom + 6, bottom, f"{name}Layer", side)
    body += [
        _arrow((cx, y), (cx, final.y)),
        _block(final, "LayerNorm", "norm", f"{name}.norm"),
    ]
    return body, layers, final


def _repeated(cx, top, bottom, name, side):
    """The dashed frame around one layer of a stack, named, with "×N" beside it."""
    left = cx - BOX_W / 2 - (36 if side < 0 else 14)
    inner, outer = cx - side * (BOX_W / 2 + 4), cx + side * (BOX_W / 2 + 56)
    return [
        _rect(left, top, BOX_W + 50, bottom - top, "none", MUTED, 12, "7 4", 1.3),
        _note(inner, top + 12, name, "end" if side < 0 else "start", size=11),
        _text(outer, (top + bottom) / 2, "×N", 20, colour=MUTED, bold=True),
    ]


def _legend(x, y, lines, plus="add the residual"):
    """Some lines (the last one, a formula, in bold), then a swatch naming the colour
    of each kind of block, and what the ⊕ adds."""
    body = [
        _text(x, y + 18 * i, line, 12, "start", bold=i == len(lines) - 1)
        for i, line in enumerate(lines)
    ]
    swatches_y = y + 18 * len(lines) + 16
    for row, (fill, stroke, name) in enumerate(PALETTE.values()):
        row_y = swatches_y + row * 22
        body.append(_rect(x, row_y - 7, 22, 14, fill, stroke, 3, width=1))
        body.append(_text(x + 30, row_y, name, 12, "start"))
    row_y = swatches_y + len(PALETTE) * 22
    body.append(_plus(x + 11, row_y, 8))
    return body + [_text(x + 30, row_y, plus, 12, "start")]


def _memory(start, bus_x, source):
    """The memory's path, from the `start` points along the bus at bus_x, into the
    left of the source-attention block (its keys and values)."""
    start_y = start[-1][1]
    return [
        _arrow(
            *start,
            *[(bus_x, start_y), (bus_x, source.mid), (source.left, source.mid)],
            colour=MEMORY,
        ),
        _note(bus_x - 8, (start_y + source.mid) / 2, "memory", "end", MEMORY, 12),
        _note(bus_x + 32, source.mid - 10, "K, V", "middle", MEMORY, 11),
    ]


def _link(a, b):
    """An arrow from box `a` to box `b` on the same centre line, either way up."""
    if a.y < b.y:
        return _arrow((a.cx, a.bottom), (b.cx, b.y))
    return _arrow((a.cx, a.y), (b.cx, b.bottom))


def _generator(linear, softmax, softmax_title, softmax_note=None):
    """The Generator's frame around its Linear and softmax blocks, one above the
    other (either way up), with an arrow from the Linear to the softmax."""
    top = min(linear.y, softmax.y) - 10
    bottom = max(linear.bottom, softmax.bottom) + 10
    return [
        _rect(linear.left - 14, top, BOX_W + 28, bottom - top, "none", MUTED, 12),
        _note(linear.right + 20, top + 10, "Generator", "start", size=11),
        _block(linear, "Linear", "linear", "d_{model} → vocabulary size"),
        _link(linear, softmax),
        _block(softmax, softmax_title, "op", softmax_note),
    ]


def diagram_architecture():
    """The whole model as our code computes it: pre-norm encoder and decoder stacks."""
    enc_x, dec_x, bus_x = COLUMNS
    encoder_layer = [
        ("Multi-head self-attention", "src_mask", "Q, K, V"),
        ("Feed-forward", None, None),
    ]
    decoder_layer = [
        ("Masked self-attention", "tgt_mask", "Q, K, V"),
        ("Source attention", "src_mask", "Q"),
        ("Feed-forward", None, None),
    ]
    src, tgt = "source tokens (src)", "target tokens, shifted right (tgt)"
    encoder, _, memory = _stack(enc_x, "Encoder", src, -1, encoder_layer)
    decoder, layers, final = _stack(dec_x, "Decoder", tgt, 1, decoder_layer)
    linear = Box(dec_x, final.bottom + GAP + 14, h=36)
    softmax = Box(dec_x, linear.bottom + GAP, h=30)
    bottom = softmax.bottom + 10
    lines = [
        "Each residual block is a pre-norm SublayerConnection:",
        "x + Dropout(Sublayer(LayerNorm(x)))",
    ]
    legend = _legend(enc_x - BOX_W / 2 - 36, memory.bottom + 56, lines)
    body = encoder + decoder + legend
    body += _memory([(memory.right, memory.mid)], bus_x, layers[1])
    body += [_arrow((dec_x, final.bottom), (dec_x, linear.y))]
    body += _generator(linear, softmax, "log-softmax")
    body += _output(dec_x, bottom, "next-token log-probabilities")
    return _svg(760, int(bottom + GAP + 40), body)


def _sine(cx, cy, r=14):
    """The paper's sign for the positional encoding: a wave in a circle."""
    wave = f"M{cx - 9},{cy} Q{cx - 4.5},{cy - 11} {cx},{cy} T{cx + 9},{cy}"
    return (
        f'<circle cx="{cx}" cy="{cy}" r="{r}" fill="white" stroke="{INK}" '
        f'stroke-width="1.5"/><path d="{wave}" fill="none" stroke="{INK}" '
        f'stroke-width="1.5"/>'
    )


def _add_and_norm(cx, y, title, mask, in_label, side, index):
    """A post-norm SublayerConnection from y up: LayerNorm(x + Dropout(Sublayer(x))).

    `index` is its place in the layer's `sublayer` list.
    """
    branch_y = y - 20  # where the residual path leaves the main line
    layer = Box(cx, branch_y - GAP - 40)
    norm = Box(cx, layer.y - GAP - 36, h=36)
    body = [
        _arrow((cx, y), (cx, layer.bottom)),
        _sublayer_block(layer, title, mask),
        _link(layer, norm),
        _block(norm, "Add & Norm", "norm", f"sublayer[{index}]: SublayerConnection"),
        *_residual(cx, branch_y, norm.mid, side, BOX_W / 2),
    ]
    if in_label:  # on the side away from the residual path
        anchor = "start" if side < 0 else "end"
        body.append(_note(cx - side * 7, branch_y - 12, in_label, anchor, size=11))
    return body, layer, norm.y


def _post_norm_stack(cx, name, inputs, tokens, embedding, side, sublayers):
    """One side of the paper's Figure 1, from the bottom (y = 0) up: tokens, their
    embedding, ⊕ the positional encoding, then N post-norm layers (no final norm).

    `side` (-1 or 1) puts the residual paths, the positional encoding and the "×N"
    left or right of the blocks.
    """
    embed = Box(cx, -88 - 40)
    plus_y, wave_x = embed.y - GAP - PLUS_R, cx + side * 58
    outer, inner = ("end", "start") if side < 0 else ("start", "end")
    body = [
        _text(cx, -16, name, 16, bold=True),
        _note(cx, -40, tokens, size=11),
        _text(cx, -58, inputs, 13),
        _arrow((cx, -70), (cx, embed.bottom)),
        _block(embed, embedding, "embedding", "Embeddings: lut(x) · √d_{model}"),
        _arrow((cx, embed.y), (cx, plus_y + PLUS_R)),
        _plus(cx, plus_y),
        _sine(wave_x, plus_y),
        _arrow((wave_x - side * 14, plus_y), (cx + side * PLUS_R, plus_y)),
        _text(wave_x + side * 20, plus_y - 8, "Positional", 13, outer),
        _text(wave_x + side * 20, plus_y + 8, "Encoding", 13, outer),
        _note(cx - side * 16, plus_y - 7, "PositionalEncoding:", inner),
        _note(cx - side * 16, plus_y + 7, "x + sinusoids, dropout", inner),
    ]
    y, layers = plus_y - PLUS_R, []
    for index, (title, mask, in_label) in enumerate(sublayers):
        part, layer, y = _add_and_norm(cx, y, title, mask, in_label, side, index)
        body += part
        layers.append(layer)
    top = y - 26  # room for the layer's name above its last block
    body += _repeated(cx, top, plus_y - PLUS_R - 12, f"{name}Layer", side)
    return body, layers, y, top


def diagram_architecture_post_norm():
    """The paper's Figure 1 as our code computes it with norm_first=False: post-norm
    layers, an Add & Norm after each sub-layer, no final norm; drawn bottom up."""
    enc_x, dec_x, bus_x = COLUMNS
    encoder_layer = [
        ("Multi-Head Attention", "src_mask", "Q, K, V"),
        ("Feed Forward", None, None),
    ]
    decoder_layer = [
        ("Masked Multi-Head Attention", "tgt_mask", "Q, K, V"),
        ("Multi-Head Attention", "src_mask", "Q"),
        ("Feed Forward", None, None),
    ]
    src = "Inputs", "source tokens (src)", "Input Embedding"
    tgt = "Outputs (shifted right)", "target tokens (tgt)", "Output Embedding"
    encoder, _, enc_out, enc_top = _post_norm_stack(
        enc_x, "Encoder", *src, -1, encoder_layer
    )
    decoder, layers, dec_out, dec_top = _post_norm_stack(
        dec_x, "Decoder", *tgt, 1, decoder_layer
    )
    mem_y = enc_top - 36
    linear = Box(dec_x, dec_top - 46 - 36, h=36)
    softmax = Box(dec_x, linear.y - GAP - 40)
    out_y = softmax.y - 10 - GAP - 12
    top = out_y - 24
    lines = [
        "make_model(..., norm_first=False), the paper's layout:",
        "each Add & Norm ends a post-norm SublayerConnection,",
        "LayerNorm(x + Dropout(Sublayer(x)))",
    ]
    body = encoder + decoder
    body += _legend(enc_x - BOX_W / 2 - 36, top + 20, lines, "add")
    body += _memory([(enc_x, enc_out), (enc_x, mem_y)], bus_x, layers[1])
    body += [
        _note(enc_x + 8, enc_top - 16, "Encoder.norm = nn.Identity()", "start"),
        _arrow((dec_x, dec_out), (dec_x, linear.bottom)),
        _note(dec_x - 8, dec_top - 20, "Decoder.norm = nn.Identity()", "end"),
    ]
    body += _generator(linear, softmax, "Softmax", "log-softmax in our code")
    body += [
        _arrow((dec_x, softmax.y - 10), (dec_x, out_y + 12)),
        _text(dec_x, out_y, "Output Probabilities", 14),
    ]
    # drawn upward from y = 0 (the bottom edge): moved down onto the page
    moved = [f'<g transform="translate(0,{-top})">', *body, "</g>"]
    return _svg(760, int(-top), moved)


def diagram_attention():
    """Scaled dot-product attention, softmax(QKᵀ/√d_k)V, one operation per block."""
    cx, q_x, k_x, v_x = 320, 265, 375, 530
    steps = [  # title, note, dashed: a step that does not always apply
        ("MatMul", "Q K^{T}", False),
        ("Scale", "÷ √d_{k}", False),
        ("Mask (optional)", "masked scores → dtype minimum", True),
        ("Softmax over the keys", "masked weights → exactly 0", False),
        ("Dropout", "while training", True),
        ("MatMul", "weights · V", False),
    ]
    boxes = [Box(cx, 80 + i * (40 + GAP), 220) for i in range(len(steps))]
    body = []
    for box, (title, note, dashed) in zip(boxes, steps, strict=True):
        body.append(_block(box, title, "op", note, dashed))
    body += [_arrow((cx, a.bottom), (cx, b.y)) for a, b in pairwise(boxes)]
    first, last = boxes[0], boxes[-1]
    weights_y = last.y - GAP / 2
    body += _inputs(
        ("Q", q_x, "(…, n_{q}, d_{k})"),
        ("K", k_x, "(…, n_{k}, d_{k})"),
        ("V", v_x, "(…, n_{k}, d_{v})"),
    )
    body += [
        _arrow((q_x, 54), (q_x, first.y)),
        _arrow((k_x, 54), (k_x, first.y)),
        _arrow((v_x, 54), (v_x, last.mid), (last.right, last.mid)),
        _note(cx + 8, first.bottom + GAP / 2, "scores (…, n_{q}, n_{k})", "start"),
        _arrow((cx, weights_y), (cx - 170, weights_y), colour=SKIP, dashed=True),
        _note(cx - 176, weights_y - 7, "p_attn,", "end"),
        _note(cx - 176, weights_y + 7, "also returned", "end"),
    ]
    formula = "Attention(Q, K, V) = softmax(Q K^{T} / √d_{k}) V"
    body += _output(cx, last.bottom, "output (…, n_{q}, d_{v})", formula)
    return _svg(620, int(last.bottom + GAP + 72), body)


def diagram_multi_head():
    """Multi-head attention: h heads over projections of Q, K, V, then concatenated."""
    cx = 330
    heads = Box(cx, 190, 440, 48)
    concat = Box(cx, heads.bottom + 40, 240, 44)
    out = Box(cx, concat.bottom + GAP, 240, 44)
    note = "every head at once, each on its own slice"
    body = [_deck(heads, "Scaled dot-product attention", "attention", note)]
    for i, name in enumerate("QKV"):
        x = cx + 160 * (i - 1)
        linear = Box(x, 86, 140, 44)
        body += _inputs((name, x, "(batch, n, d_{model})"))
        body += [
            _deck(linear, f"Linear W^{{{name}}}", "linear", f"linears[{i}]"),
            _arrow((x, 54), (x, linear.y)),
            _arrow((x, linear.bottom), (x, heads.y)),
            _arrow((cx + 120 * (i - 1), heads.bottom), (cx + 60 * (i - 1), concat.y)),
        ]
    body += [
        _note(cx + 168, 150, "split into h heads:", "start"),
        _note(cx + 168, 165, "(batch, h, n, d_{k})", "start"),
        _text(heads.right + 36, heads.mid - 6, "×h", 20, colour=MUTED, bold=True),
        _note(36, heads.mid - 12, "mask", "start", size=11),
        _note(36, heads.mid + 12, "(all heads)", "start"),
        _arrow((30, heads.mid), (heads.left, heads.mid), colour=SKIP, dashed=True),
        _block(concat, "Concat the heads", "op", "(batch, n, h · d_{k})"),
        _arrow((cx, concat.bottom), (cx, out.y)),
        _block(out, "Linear W^{O}", "linear", "linears[3]"),
    ]
    formulas = [
        "head_{i} = Attention(Q W_{i}^{Q}, K W_{i}^{K}, V W_{i}^{V})",
        "MultiHead(Q, K, V) = Concat(head_{1}, …, head_{h}) W^{O}",
    ]
    body += _output(cx, out.bottom, "output (batch, n, d_{model})", *formulas)
    return _svg(660, int(out.bottom + GAP + 96), body)


DIAGRAMS = {
    "architecture": diagram_architecture,
    "architecture_post_norm": diagram_architecture_post_norm,
    "scaled_dot_product_attention": diagram_attention,
    "multi_head_attention": diagram_multi_head,
}


def main(argv=None):
    """Write the diagrams (all, or those named) as PNG files into --out."""
    parser = argparse.ArgumentParser(prog="python -m tools.diagrams")
    parser.add_argument("--out", default="images", help="output folder")
    parser.add_argument("names", nargs="*", help=f"of {', '.join(DIAGRAMS)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(DIAGRAMS))
    if unknown:
        parser.error(f"unknown diagrams {unknown}; choose from {list(DIAGRAMS)}")
    from workshop.report.figures import save_png

    for name in args.names or DIAGRAMS:
        print(f"wrote {save_png(DIAGRAMS[name](), Path(args.out) / f'{name}.png')}")


if __name__ == "__main__":
    main()
