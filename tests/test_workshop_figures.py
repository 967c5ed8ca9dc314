"""workshop.report.figures: the book's charts, its diagrams (tools/diagrams.py) and
attention maps, written as PNG files."""

import struct
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import PNG_SIGNATURE

import the_annotated_transformer as tat
from tools import diagrams
from workshop import cli
from workshop.report import figures

CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}  # PNG colour type -> samples per pixel


def png_chunks(data):
    """Yield (type, payload) of every chunk, checking each chunk's CRC."""
    pos = len(PNG_SIGNATURE)
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        payload = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + payload) == crc, f"bad CRC in {kind!r} chunk"
        yield kind, payload
        pos += 12 + length


def unfilter_row(kind, row, prior, bpp):
    """Undo one PNG scanline filter (types 0-4); rows are uint8 arrays."""
    if kind == 0:
        return row
    if kind == 2:
        return row + prior  # uint8 arithmetic wraps modulo 256
    if kind == 1:  # Sub: a running sum along each channel
        by_pixel = row.reshape(-1, bpp).astype(np.int64)
        return (np.cumsum(by_pixel, axis=0) % 256).astype(np.uint8).reshape(-1)
    out = row.astype(np.int64)
    up = prior.astype(np.int64)
    for i in range(len(out)):  # Average and Paeth: one byte at a time
        left = out[i - bpp] if i >= bpp else 0
        if kind == 3:
            out[i] = (out[i] + (left + up[i]) // 2) % 256
        else:
            upper_left = up[i - bpp] if i >= bpp else 0
            p = left + up[i] - upper_left
            pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - upper_left)
            pred = left if pa <= pb and pa <= pc else up[i] if pb <= pc else upper_left
            out[i] = (out[i] + pred) % 256
    return out.astype(np.uint8)


def decode_png(path):
    """Pixels of an 8-bit, non-interlaced PNG as a (height, width, channels) array."""
    data = Path(path).read_bytes()
    assert data[:8] == PNG_SIGNATURE, "not a PNG file"
    chunks = list(png_chunks(data))
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height, depth, colour, _, _, interlace = struct.unpack(
        ">IIBBBBB", chunks[0][1]
    )
    assert depth == 8 and colour in CHANNELS and interlace == 0
    bpp = CHANNELS[colour]
    raw = zlib.decompress(b"".join(p for kind, p in chunks if kind == b"IDAT"))
    stride = 1 + width * bpp
    assert len(raw) == height * stride
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(height, stride)
    pixels = np.zeros((height, width * bpp), dtype=np.uint8)
    prior = np.zeros(width * bpp, dtype=np.uint8)
    for y in range(height):
        prior = pixels[y] = unfilter_row(int(rows[y, 0]), rows[y, 1:], prior, bpp)
    return pixels.reshape(height, width, bpp)


def assert_not_blank(pixels, name):
    """A drawn chart has many colours and no single colour covering everything."""
    weights = 256 ** np.arange(pixels.shape[-1], dtype=np.int64)
    packed = (pixels.astype(np.int64) * weights).sum(axis=-1).ravel()  # one int each
    colours, counts = np.unique(packed, return_counts=True)
    assert len(colours) >= 8, f"{name}: only {len(colours)} colours"
    background_share = counts.max() / len(packed)
    # The sparsest charts, the line charts, are 93% background (measured), the maps
    # and diagrams 31% to 82%; a blank picture, or one of a few stray pixels, is
    # all but 0.5% of it one colour.
    assert background_share < 0.995, f"{name}: {background_share:.1%} one colour"


@pytest.fixture(scope="module")
def figures_dir(tmp_path_factory):
    """Every chart of the book, written once through `main`."""
    out = tmp_path_factory.mktemp("figures")
    assert cli.main(["figures", "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_figures_command_writes_one_png_per_book_chart(figures_dir):
    names = set(figures.book_figures())
    assert set(figures.CHARTS) | set(diagrams.DIAGRAMS) == names
    assert len(names) >= 10
    assert "architecture_post_norm" in names  # the paper's Figure 1 layout
    assert {p.name for p in figures_dir.iterdir()} == {f"{n}.png" for n in names}


@pytest.mark.slow
def test_every_figure_is_a_valid_non_blank_png(figures_dir):
    for name in figures.book_figures():
        path = figures_dir / f"{name}.png"
        assert path.stat().st_size > 5_000, name
        pixels = decode_png(path)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100, name
        assert_not_blank(pixels, name)


def svg_texts(svg):
    """Every text of a diagram's SVG as (x, y, text), in document order."""
    return [
        (float(t.get("x")), float(t.get("y")), "".join(t.itertext()))
        for t in ET.fromstring(svg).iter()
        if t.tag.endswith("text")
    ]


def test_diagrams_are_svg_with_the_blocks_they_explain():
    expected = {
        "architecture": ["Encoder", "Decoder", "Source attention", "Generator"],
        "architecture_post_norm": [
            "Inputs",
            "Outputs (shifted right)",
            "Positional",
            "Masked Multi-Head Attention",
            "Add & Norm",
            "Generator",
            "Output Probabilities",
        ],
        "scaled_dot_product_attention": ["MatMul", "Scale", "Softmax over the keys"],
        "multi_head_attention": ["Concat the heads", "Scaled dot-product attention"],
    }
    for name, draw in diagrams.DIAGRAMS.items():
        text = " ".join(label for _, _, label in svg_texts(draw()))  # well-formed
        for label in expected[name]:
            assert label in text, (name, label)


BLOCKS = {  # the titles of the blocks a stack is made of, in both diagrams
    *("LayerNorm", "Add & Norm", "Linear", "Softmax", "log-softmax"),
    *("Multi-head self-attention", "Masked self-attention", "Source attention"),
    *("Multi-Head Attention", "Masked Multi-Head Attention"),
    *("Feed-forward", "Feed Forward"),
}


def blocks_in_column(svg, heading):
    """The block titles centred under (or over) a column's heading, top down."""
    texts = svg_texts(svg)
    column = next(x for x, _, label in texts if label == heading)
    found = sorted((y, label) for x, y, label in texts if x == column)
    return [label for _, label in found if label in BLOCKS]


def test_post_norm_diagram_follows_each_sub_layer_with_add_and_norm():
    """The paper's Figure 1 layout, bottom up: every sub-layer followed by one Add &
    Norm (2 in the encoder, 3 in the decoder), no LayerNorm block of its own and no
    final one after a stack; Linear and Softmax on top of the decoder."""
    svg = diagrams.diagram_architecture_post_norm()
    encoder = ["Multi-Head Attention", "Add & Norm", "Feed Forward", "Add & Norm"]
    decoder = [
        *("Masked Multi-Head Attention", "Add & Norm"),
        *("Multi-Head Attention", "Add & Norm"),
        *("Feed Forward", "Add & Norm"),
        *("Linear", "Softmax"),
    ]
    assert blocks_in_column(svg, "Encoder")[::-1] == encoder
    assert blocks_in_column(svg, "Decoder")[::-1] == decoder
    labels = [label for _, _, label in svg_texts(svg)]
    assert "Encoder.norm = nn.Identity()" in labels
    assert "Decoder.norm = nn.Identity()" in labels


def test_pre_norm_diagram_puts_layer_norm_before_each_sub_layer_and_at_the_end():
    """Our layout, drawn by the same code, top down: a LayerNorm before every
    sub-layer and one more ending each stack (Encoder.norm, Decoder.norm)."""
    svg = diagrams.diagram_architecture()
    encoder = [
        *("LayerNorm", "Multi-head self-attention"),
        *("LayerNorm", "Feed-forward", "LayerNorm"),
    ]
    decoder = [
        *("LayerNorm", "Masked self-attention"),
        *("LayerNorm", "Source attention"),
        *("LayerNorm", "Feed-forward", "LayerNorm"),
        *("Linear", "log-softmax"),
    ]
    assert blocks_in_column(svg, "Encoder") == encoder
    assert blocks_in_column(svg, "Decoder") == decoder


def test_the_diagrams_tool_writes_the_diagrams_it_is_asked_for(tmp_path, capsys):
    diagrams.main(["--out", str(tmp_path), "multi_head_attention"])
    assert [p.name for p in tmp_path.iterdir()] == ["multi_head_attention.png"]
    assert_not_blank(decode_png(tmp_path / "multi_head_attention.png"), "multi-head")
    with pytest.raises(SystemExit) as refused:
        diagrams.main(["--out", str(tmp_path), "no_such_diagram"])
    assert refused.value.code == 2 and "no_such_diagram" in capsys.readouterr().err


def test_a_uniform_image_counts_as_blank():
    """The check above can fail: a one-colour image does not pass it."""
    with pytest.raises(AssertionError, match="colours"):
        assert_not_blank(np.full((50, 50, 4), 255, dtype=np.uint8), "white")


def test_a_figure_that_fails_to_render_keeps_the_old_png_and_no_temporary(
    tmp_path, monkeypatch
):
    path = tmp_path / "chart.png"
    path.write_bytes(PNG_SIGNATURE + b"old")

    import vl_convert

    def fail(svg, scale):
        raise OSError("renderer crashed")

    monkeypatch.setattr(vl_convert, "svg_to_png", fail)
    with pytest.raises(OSError, match="renderer crashed"):
        figures.save_png("<svg/>", path)
    assert path.read_bytes() == PNG_SIGNATURE + b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chart.png"]


def test_attention_labels_show_subwords_as_text_and_words_as_they_are():
    """Byte-level BPE writes a leading space as 'Ġ' and 'ü' as its two UTF-8 bytes
    ('Ã¼'); a chart's labels show the text instead."""
    texts = ["Zwei Hunde laufen über die Straße."] * 20
    vocab = tat.SubwordVocab.build(texts, vocab_size=300)
    ids = [tat.BOS, *vocab.encode("Hunde über"), tat.EOS]
    tokens = vocab.lookup_tokens(ids)
    assert any("Ġ" in token or "Ã" in token for token in tokens)  # raw: unreadable
    shown = figures.readable(vocab, tokens)
    assert (shown[0], shown[-1]) == ("<s>", "</s>")
    assert "".join(shown[1:-1]) == "Hundeüber"  # however the words were cut
    words = ["<s>", "Hunde", "</s>"]
    assert figures.readable(tat.Vocab([*tat.SPECIALS, "Hunde"]), words) is words
