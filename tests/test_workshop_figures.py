"""workshop.figures: the book's charts and diagrams, written as PNG files."""

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import PNG_SIGNATURE

import the_annotated_transformer as tat
from workshop import cli, figures

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
    assert background_share < 0.995, f"{name}: {background_share:.1%} one colour"


@pytest.fixture(scope="module")
def figures_dir(tmp_path_factory):
    """Every chart of the book, written once through `main`."""
    out = tmp_path_factory.mktemp("figures")
    assert cli.main(["figures", "--out", str(out)]) == 0
    return out


def test_figures_command_writes_one_png_per_book_chart(figures_dir):
    names = set(figures.book_charts()) | set(figures.book_diagrams())
    assert len(names) >= 9
    assert {p.name for p in figures_dir.iterdir()} == {f"{n}.png" for n in names}


def test_every_figure_is_a_valid_non_blank_png(figures_dir):
    for name in [*figures.book_charts(), *figures.book_diagrams()]:
        path = figures_dir / f"{name}.png"
        assert path.stat().st_size > 5_000, name
        pixels = decode_png(path)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100, name
        assert_not_blank(pixels, name)


def test_diagrams_are_svg_with_the_blocks_they_explain():
    import xml.etree.ElementTree as ET

    expected = {
        "architecture": ["Encoder", "Decoder", "Source attention", "Generator"],
        "scaled_dot_product_attention": ["MatMul", "Scale", "Softmax over the keys"],
        "multi_head_attention": ["Concat the heads", "Scaled dot-product attention"],
    }
    for name, draw in figures.book_diagrams().items():
        svg = draw()
        root = ET.fromstring(svg)  # well-formed XML
        text = " ".join(
            "".join(t.itertext()) for t in root.iter() if t.tag.endswith("text")
        )
        for label in expected[name]:
            assert label in text, (name, label)


def test_a_uniform_image_counts_as_blank():
    """The check above can fail: a one-colour image does not pass it."""
    with pytest.raises(AssertionError, match="colours"):
        assert_not_blank(np.full((50, 50, 4), 255, dtype=np.uint8), "white")


def test_a_figure_that_fails_to_render_keeps_the_old_png_and_no_temporary(
    tmp_path, monkeypatch
):
    path = tmp_path / "chart.png"
    path.write_bytes(PNG_SIGNATURE + b"old")

    def fail(svg):
        raise OSError("renderer crashed")

    monkeypatch.setattr(figures, "svg_png", fail)
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
