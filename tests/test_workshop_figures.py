"""workshop.report.figures: the book's figures (its charts and diagrams) and the
attention maps' labels, written as PNG files."""

import struct
import zlib

import numpy as np
import pytest
from conftest import PNG_SIGNATURE

import the_annotated_transformer as tat
from workshop.report import figures


def png_pixels(path):
    """The pixels of a PNG as vl-convert writes it (8-bit RGBA, each row Sub
    filtered), one packed colour each; every chunk's CRC is checked."""
    data, pos, chunks = path.read_bytes(), len(PNG_SIGNATURE), {}
    assert data.startswith(PNG_SIGNATURE)
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body, crc = data[pos + 4 : pos + 8 + n], data[pos + 8 + n : pos + 12 + n]
        assert zlib.crc32(body).to_bytes(4, "big") == crc, kind
        chunks[kind] = chunks.get(kind, b"") + body[4:]
        pos += 12 + n
    width, height, *form = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert form == [8, 6, 0, 0, 0]  # 8-bit RGBA, not interlaced
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(height, -1)
    assert (rows[:, 0] == 1).all()  # Sub: each byte adds the one a pixel left of it
    rgba = np.cumsum(rows[:, 1:].reshape(height, width, 4), axis=1, dtype=np.uint8)
    return rgba.view(np.uint32)[..., 0]


@pytest.mark.slow
def test_save_figures_writes_every_book_figure_as_a_drawn_png(tmp_path):
    names = figures.book_figures()
    assert len(figures.save_figures(tmp_path, quiet=True)) == len(names)
    for name in names:
        pixels = png_pixels(tmp_path / f"{name}.png")
        colours, counts = np.unique(pixels, return_counts=True)
        # The sparsest charts, the line charts, are 93% background, the maps and
        # diagrams 31% to 82%; a blank picture, or a few stray pixels, is not.
        assert len(colours) >= 8 and counts.max() < 0.995 * pixels.size, name
        assert min(pixels.shape) > 100, name


def test_a_figure_that_fails_to_render_keeps_the_old_png_and_no_temporary(
    tmp_path, monkeypatch
):
    def fail(svg, scale):
        raise OSError("renderer crashed")

    monkeypatch.setattr("vl_convert.svg_to_png", fail)
    path = tmp_path / "chart.png"
    path.write_bytes(PNG_SIGNATURE + b"old")
    with pytest.raises(OSError, match="renderer crashed"):
        figures.save_png("<svg/>", path)
    assert path.read_bytes() == PNG_SIGNATURE + b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["chart.png"]


def test_attention_labels_show_subwords_as_text_and_words_as_they_are():
    """Byte-level BPE writes a leading space as 'Ġ' and 'ü' as its two UTF-8 bytes
    ('Ã¼'); a chart's labels show the text instead."""
    vocab = tat.SubwordVocab.build(["Zwei Hunde laufen über die Straße."] * 20, 300)
    tokens = vocab.lookup_tokens([tat.BOS, *vocab.encode("Hunde über"), tat.EOS])
    assert any("Ġ" in token or "Ã" in token for token in tokens)  # raw: unreadable
    shown = figures.readable(vocab, tokens)
    assert (shown[0], "".join(shown[1:-1]), shown[-1]) == ("<s>", "Hundeüber", "</s>")
    words = ["<s>", "Hunde", "</s>"]
    assert figures.readable(tat.Vocab([*tat.SPECIALS, "Hunde"]), words) == words
