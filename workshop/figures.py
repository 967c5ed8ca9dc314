"""The book's figures as PNG files: its charts, the three diagrams (drawn here as
SVG: rounded boxes coloured by kind of block, labels and arrows; rendered offline by
vl-convert) and attention maps of a trained checkpoint.

Just over 400 lines, and one module on purpose: most of it is the three diagrams'
layouts, which share one small SVG vocabulary (boxes, labels, arrows) defined here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html import escape
from itertools import pairwise
from pathlib import Path

from the_annotated_transformer import (
    SubwordVocab,
    attention_table,
    attention_weights,
    chart_attention,
    chart_label_smoothing,
    chart_learning_rate,
    chart_penalization,
    chart_positional_encoding,
    chart_subsequent_mask,
    require,
)
from workshop.files import atomic_write_bytes
from workshop.translation import load_translator


def save_png(figure, path):
    """Write an altair chart, or a diagram's SVG text, as a PNG file; returns the path.

    It is written atomically (workshop.files), so a failure never leaves a
    half-written figure, or a temporary file, behind.
    """
    if isinstance(figure, str):
        png = svg_png(figure)  # svg_png: see Figures, at the end
    else:
        import vl_convert

        png = vl_convert.vegalite_to_png(figure.to_json(), scale=2)
    return atomic_write_bytes(path, png)


KINDS = {
    "encoder_self_attention": "Encoder self-attention",
    "decoder_self_attention": "Decoder self-attention",
    "decoder_source_attention": "Decoder–source attention",
}


def attention_maps(translator, sentence, layer=0, heads=None):
    """The three attention charts of one layer (counted from 0; -1 is the last) for
    `sentence`, keyed by kind: a heat map per head (all by default)."""
    found = attention_weights(translator, sentence)
    vocabs = {"source": translator.vocab_src, "target": translator.vocab_tgt}
    sides = {
        "encoder_self_attention": ("source", "source"),
        "decoder_self_attention": ("target", "target"),
        "decoder_source_attention": ("target", "source"),
    }
    for kind, (queries, keys) in sides.items():
        layers, query_tokens, key_tokens = found[kind]
        found[kind] = (
            layers,
            readable(vocabs[queries], query_tokens),
            readable(vocabs[keys], key_tokens),
        )
    table = attention_table(found)
    n_layers, n_heads = table["layer"].max() + 1, table["head"].max() + 1
    heads = list(range(n_heads)) if heads is None else list(heads)
    in_range = -n_layers <= layer < n_layers
    require(in_range, f"layer must be in 0..{n_layers - 1}, got {layer}.")
    valid = heads and all(0 <= head < n_heads for head in heads)
    require(valid, f"heads must be in 0..{n_heads - 1}, got {heads}.")
    layer %= n_layers
    charts = {}
    for kind, name in KINDS.items():
        chosen = table[(table["kind"] == kind) & (table["layer"] == layer)]
        heat_maps = chart_attention(chosen[chosen["head"].isin(heads)])
        title = f"{name}, layer {layer}"
        charts[kind] = heat_maps.facet("head:N", columns=4).properties(title=title)
    return charts


def readable(vocab, tokens):
    """Tokens as a reader would write them: a subword's text ('Ġ', its leading space,
    dropped; a letter written as its UTF-8 bytes, such as 'Ã¼', shown as 'ü'), a
    special or a word as it is."""
    if not isinstance(vocab, SubwordVocab):
        return tokens
    return [vocab.decode([vocab[token]]).strip() or token for token in tokens]


def save_attention_maps(
    checkpoint, sentence, out_dir, layer=0, heads=None, device=None
):
    """Write the three attention maps of `sentence` as PNG files; returns the paths.
    `device`: where the checkpoint's model runs (default: the book's default)."""
    translator = load_translator(checkpoint, device, fused=False)
    out_dir = Path(out_dir)
    maps = attention_maps(translator, sentence, layer, heads)
    return [save_png(chart, out_dir / f"{name}.png") for name, chart in maps.items()]


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


def _sublayer(cx, y, title, mask, in_label, side):
    """A pre-norm SublayerConnection from y down: x + Dropout(Sublayer(LayerNorm(x))).

    An attention sub-layer names its `mask`; with no mask it is the feed-forward one.
    """
    kind = "attention" if mask else "feed_forward"
    note = f"MultiHeadedAttention, {mask}" if mask else "PositionwiseFeedForward"
    norm, layer = Box(cx, y + GAP, h=28), Box(cx, y + 2 * GAP + 28)
    plus_y, skip_x = layer.bottom + GAP + PLUS_R, cx + side * (BOX_W / 2 + 18)
    body = [
        _arrow((cx, y), (cx, norm.y)),
        _block(norm, "LayerNorm", "norm"),
        _arrow((cx, norm.bottom), (cx, layer.y)),
        _block(layer, title, kind, note),
        _arrow((cx, layer.bottom), (cx, plus_y - PLUS_R)),
        _arrow(  # the residual path runs beside the blocks
            *[(cx, y + 8), (skip_x, y + 8), (skip_x, plus_y)],
            (cx + side * PLUS_R, plus_y),
            colour=SKIP,
        ),
        f'<circle cx="{cx}" cy="{y + 8}" r="2.5" fill="{INK}"/>',
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
    top, bottom = position.bottom + 6, y + 10
    left = cx - BOX_W / 2 - (36 if side < 0 else 14)
    inner, outer = cx - side * (BOX_W / 2 + 4), cx + side * (BOX_W / 2 + 56)
    final = Box(cx, bottom + GAP, h=36)
    body += [
        _rect(left, top, BOX_W + 50, bottom - top, "none", MUTED, 12, "7 4", 1.3),
        _note(inner, top + 12, f"{name}Layer", "end" if side < 0 else "start", size=11),
        _text(outer, (top + bottom) / 2, "×N", 20, colour=MUTED, bold=True),
        _arrow((cx, y), (cx, final.y)),
        _block(final, "LayerNorm", "norm", f"{name}.norm"),
    ]
    return body, layers, final


def _legend(x, y):
    """The residual formula, then a swatch naming the colour of each kind of block."""
    body = [
        _text(
            x, y, "Each residual block is a pre-norm SublayerConnection:", 12, "start"
        ),
        _text(x, y + 18, "x + Dropout(Sublayer(LayerNorm(x)))", 12, "start", bold=True),
    ]
    for row, (fill, stroke, name) in enumerate(PALETTE.values()):
        row_y = y + 52 + row * 22
        body.append(_rect(x, row_y - 7, 22, 14, fill, stroke, 3, width=1))
        body.append(_text(x + 30, row_y, name, 12, "start"))
    row_y = y + 52 + len(PALETTE) * 22
    body.append(_plus(x + 11, row_y, 8))
    return body + [_text(x + 30, row_y, "add the residual", 12, "start")]


def diagram_architecture():
    """The whole model as our code computes it: pre-norm encoder and decoder stacks."""
    enc_x, dec_x, bus_x = 200, 580, 390
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
    source, mem_y = layers[1], memory.mid  # the memory feeds source attention's K, V
    linear = Box(dec_x, final.bottom + GAP + 14, h=36)
    softmax = Box(dec_x, linear.bottom + GAP, h=30)
    top, bottom = linear.y - 10, softmax.bottom + 10
    body = encoder + decoder + _legend(enc_x - BOX_W / 2 - 36, memory.bottom + 56)
    body += [
        _arrow(
            *[(memory.right, mem_y), (bus_x, mem_y), (bus_x, source.mid)],
            (source.left, source.mid),
            colour=MEMORY,
        ),
        _note(bus_x - 8, (mem_y + source.mid) / 2, "memory", "end", MEMORY, 12),
        _note(bus_x + 32, source.mid - 10, "K, V", "middle", MEMORY, 11),
        _arrow((dec_x, final.bottom), (dec_x, linear.y)),
        _rect(linear.left - 14, top, BOX_W + 28, bottom - top, "none", MUTED, 12),
        _note(linear.right + 20, top + 10, "Generator", "start", size=11),
        _block(linear, "Linear", "linear", "d_{model} → vocabulary size"),
        _arrow((dec_x, linear.bottom), (dec_x, softmax.y)),
        _block(softmax, "log-softmax", "op"),
    ]
    body += _output(dec_x, bottom, "next-token log-probabilities")
    return _svg(760, int(bottom + GAP + 40), body)


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


def svg_png(svg, scale=1.5):
    """Render SVG text to PNG bytes, offline, with vl-convert."""
    import vl_convert

    return vl_convert.svg_to_png(svg, scale=scale)


def book_diagrams():
    """The name and a zero-argument builder (returning SVG text) of every diagram."""
    return {
        "architecture": diagram_architecture,
        "scaled_dot_product_attention": diagram_attention,
        "multi_head_attention": diagram_multi_head,
    }


def book_charts():
    """The name and a zero-argument builder of every chart in the book."""
    return {
        "subsequent_mask": chart_subsequent_mask,
        "positional_encoding": chart_positional_encoding,
        "positional_encoding_base100": lambda: chart_positional_encoding(base=100.0),
        "learning_rate": chart_learning_rate,
        "label_smoothing": chart_label_smoothing,
        "label_smoothing_penalty": chart_penalization,
    }


def save_figures(out_dir="images", names=None, *, quiet=False):
    """Render the book's charts to `out_dir`/<name>.png; returns the paths written."""
    out_dir = Path(out_dir)
    charts = {**book_diagrams(), **book_charts()}
    unknown = sorted(set(names or ()) - set(charts))
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}; choose from {sorted(charts)}.")
    written = []
    for name in names or charts:
        path = save_png(charts[name](), out_dir / f"{name}.png")
        written.append(path)
        if not quiet:
            print(f"wrote {path}")
    return written
