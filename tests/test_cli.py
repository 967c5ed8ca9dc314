"""The command line: `python the_annotated_transformer.py COMMAND ...`."""

import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import the_annotated_transformer as tat
from workshop import cli, figures, runs

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "the_annotated_transformer.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}  # PNG colour type -> samples per pixel


def run_script(*args, timeout=120):
    """Run the book as a script; returns the CompletedProcess (text mode)."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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


def test_figures_command_with_an_unknown_name_exits_2_and_writes_nothing(
    tmp_path, capsys
):
    out = tmp_path / "figures"
    assert cli.main(["figures", "--out", str(out), "no_such_chart"]) == 2
    err = capsys.readouterr().err
    assert "no_such_chart" in err and "unknown" in err
    assert "learning_rate" in err  # it lists the names to choose from
    assert not out.exists() or not any(out.iterdir())


def assert_one_line_error(result, *expected):
    """Exit status 2, nothing but one line on stderr, naming each of `expected`."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "error" in lines[0] and "Traceback" not in result.stderr
    for text in expected:
        assert text in lines[0], lines[0]


@pytest.mark.parametrize(
    "argv, option",
    [
        (["copy", "--epochs", "0"], "--epochs"),
        (
            ["train", "--data-dir", "d", "--out", "o", "--max-tokens", "0"],
            "--max-tokens",
        ),
        (
            ["train", "--data-dir", "d", "--out", "o", "--accum-iter", "0"],
            "--accum-iter",
        ),
        (["train", "--data-dir", "d", "--out", "o", "--nprocs", "0"], "--nprocs"),
        (["train", "--data-dir", "d", "--out", "o", "--epochs", "-3"], "--epochs"),
        (["evaluate", "--checkpoint", "c.pt", "--batch-size", "0"], "--batch-size"),
        (["evaluate", "--checkpoint", "c.pt", "--beam", "0"], "--beam"),
        (["reproduce", "--beam", "0"], "--beam"),
    ],
)
def test_a_count_below_one_exits_2_with_one_line_naming_the_option(argv, option):
    assert_one_line_error(run_script(*argv), option, "at least 1")


def test_more_processes_than_this_machine_has_exits_2_saying_how_many_it_has(
    tmp_path,
):
    argv = ["train", "--data-dir", str(tmp_path), "--out", str(tmp_path / "run")]
    result = run_script(*argv, "--nprocs", "100000")
    assert_one_line_error(result, "--nprocs 100000", "at most")
    assert not (tmp_path / "run").exists()


def tiny_checkpoint():
    """A checkpoint as `train` writes it, of a tiny untrained model (no data)."""
    config = runs.RunConfig.from_profile("smoke")
    itos = [*tat.SPECIALS, "ein", "hund", "a", "dog"]
    torch.manual_seed(0)
    model = config.make_model(len(itos), len(itos))
    return {
        "model": runs._weights_only(model.state_dict()),
        "config": config.to_dict(),
        "vocab_src": itos,
        "vocab_tgt": itos,
        "epoch": 0,
    }


def test_translate_with_a_checkpoint_of_the_right_form_prints_a_line(tmp_path):
    """The control for the damaged checkpoints below: the intact one translates."""
    path = tmp_path / "tiny.pt"
    torch.save(tiny_checkpoint(), path)
    result = run_script("translate", "--checkpoint", str(path), "ein hund")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1


def no_config(checkpoint):
    del checkpoint["config"]
    return checkpoint


def wrong_shape(checkpoint):
    checkpoint["model"]["generator.proj.weight"] = torch.zeros(3, 32)
    return checkpoint


@pytest.mark.parametrize(
    "damage, expected",
    [
        (no_config, "lacks ['config']"),
        (wrong_shape, "generator.proj.weight"),
        (lambda checkpoint: checkpoint["model"], "lacks"),  # a bare state dict
        (None, "not a readable checkpoint"),  # not a torch file at all
    ],
)
def test_translate_with_a_damaged_checkpoint_exits_2_with_one_line_naming_it(
    damage, expected, tmp_path
):
    path = tmp_path / "damaged.pt"
    if damage is None:
        path.write_text("these are not the weights you are looking for")
    else:
        torch.save(damage(tiny_checkpoint()), path)
    result = run_script("translate", "--checkpoint", str(path), "ein hund")
    assert_one_line_error(result, "damaged.pt", expected)


def test_translate_with_no_sentences_and_empty_input_exits_2_saying_what_to_pass(
    tmp_path,
):
    path = tmp_path / "tiny.pt"
    torch.save(tiny_checkpoint(), path)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "translate", "--checkpoint", str(path)],
        cwd=REPO_ROOT,
        input="\n  \n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(result, "no sentences given")


def test_an_unexpected_failure_is_one_line_that_says_how_to_see_the_traceback(
    monkeypatch, capsys
):
    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "_run_command", broken)
    assert cli.main(["figures"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "KeyError" in err[0]
    assert "ANNOTATED_TRANSFORMER_DEBUG=1" in err[0]
    monkeypatch.setenv("ANNOTATED_TRANSFORMER_DEBUG", "1")
    with pytest.raises(KeyError):
        cli.main(["figures"])


def test_help_lists_the_copy_and_figures_commands():
    result = run_script("--help")
    assert result.returncode == 0
    assert "copy" in result.stdout and "figures" in result.stdout


@pytest.mark.slow
def test_copy_command_trains_and_reports_an_exact_copy():
    result = run_script("copy", "--quiet", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exact copy: yes" in result.stdout
