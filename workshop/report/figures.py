"""The book's figures as PNG files (rendered offline by vl-convert): its charts, the
four architecture diagrams (tools.diagrams, a checkout's docs asset) and the
attention maps of a trained checkpoint."""

from __future__ import annotations

from pathlib import Path

import the_annotated_transformer as tat
from workshop.errors import UsageError, require
from workshop.files import atomic_write_bytes
from workshop.translate.translation import load_translator

CHARTS = {
    "subsequent_mask": tat.chart_subsequent_mask,
    "positional_encoding": tat.chart_positional_encoding,
    "positional_encoding_base100": lambda: tat.chart_positional_encoding(base=100.0),
    "learning_rate": tat.chart_learning_rate,
    "label_smoothing": tat.chart_label_smoothing,
    "label_smoothing_penalty": tat.chart_penalization,
}

# The attention maps' titles, by kind, and the vocabularies of their queries and keys.
KINDS = {
    "encoder_self_attention": ("Encoder self-attention", "src", "src"),
    "decoder_self_attention": ("Decoder self-attention", "tgt", "tgt"),
    "decoder_source_attention": ("Decoder–source attention", "tgt", "src"),
}


def save_png(figure, path):
    """Write an altair chart, or a diagram's SVG text, as a PNG file, atomically
    (workshop.files: a failure leaves no half-written figure behind); returns the
    path."""
    import vl_convert

    if isinstance(figure, str):
        return atomic_write_bytes(path, vl_convert.svg_to_png(figure, scale=1.5))
    png = vl_convert.vegalite_to_png(figure.to_json(), scale=2)
    return atomic_write_bytes(path, png)


def attention_maps(translator, sentence, layer=0, heads=None, flags=False):
    """The three attention charts of one layer (counted from 0; -1 is the last) for
    `sentence`, keyed by kind: a heat map per head (all by default). flags=True
    names `layer` and `heads` in its messages as the command line does."""
    found = tat.attention_weights(translator, sentence)
    vocabs = {"src": translator.vocab_src, "tgt": translator.vocab_tgt}
    for kind, (_, queries, keys) in KINDS.items():
        layers, *tokens = found[kind]
        found[kind] = (layers, *map(readable, (vocabs[queries], vocabs[keys]), tokens))
    table = tat.attention_table(found)
    n_layers, n_heads = table["layer"].max() + 1, table["head"].max() + 1
    heads = list(range(n_heads)) if heads is None else list(heads)
    names = ("--layer", "--head") if flags else ("layer", "heads")
    ok, back = -n_layers <= layer < n_layers, f"-{n_layers}..-1 from the last"
    require(ok, f"{names[0]} must be in 0..{n_layers - 1} (or {back}), got {layer}.")
    ok = heads and all(0 <= head < n_heads for head in heads)
    require(ok, f"{names[1]} must be in 0..{n_heads - 1}, got {heads}.")
    layer %= n_layers
    table = table[(table["layer"] == layer) & table["head"].isin(heads)]
    charts = {}
    for kind, (name, _, _) in KINDS.items():
        heat_maps = tat.chart_attention(table[table["kind"] == kind])
        title = f"{name}, layer {layer}"
        charts[kind] = heat_maps.facet("head:N", columns=4).properties(title=title)
    return charts


def readable(vocab, tokens):
    """Tokens as a reader would write them: a subword's text ('Ġ', its leading space,
    dropped; a letter written as its UTF-8 bytes, such as 'Ã¼', shown as 'ü'), a
    special or a word as it is."""
    if not isinstance(vocab, tat.SubwordVocab):
        return tokens
    return [vocab.decode([vocab[token]]).strip() or token for token in tokens]


def save_attention_maps(
    checkpoint, sentence, out_dir, layer=0, heads=None, device=None, flags=False
):
    """Write the three attention maps of `sentence` as PNG files; returns the paths.
    `device`: where the checkpoint's model runs (default: the book's default);
    `flags`: as attention_maps'."""
    translator = load_translator(checkpoint, device)
    maps = attention_maps(translator, sentence, layer, heads, flags)
    return [
        save_png(map_, Path(out_dir) / f"{kind}.png") for kind, map_ in maps.items()
    ]


def book_figures():
    """Every figure of the book, by name: a zero-argument builder of an altair chart
    or of a diagram's SVG text. The diagrams are a checkout's (tools.diagrams); an
    installed package has the charts alone."""
    try:
        from tools.diagrams import DIAGRAMS
    except ModuleNotFoundError:
        return dict(CHARTS)
    return {**DIAGRAMS, **CHARTS}


def save_figures(out_dir="images", names=None, *, quiet=False):
    """Render the book's figures to `out_dir`/<name>.png; returns the paths written."""
    figures = book_figures()
    unknown = sorted(set(names or ()) - set(figures))
    if unknown:
        raise UsageError(f"unknown figure(s) {unknown}; choose from {sorted(figures)}.")
    written = []
    for name in names or figures:
        written.append(save_png(figures[name](), Path(out_dir) / f"{name}.png"))
        if not quiet:
            print(f"wrote {written[-1]}")
    return written
