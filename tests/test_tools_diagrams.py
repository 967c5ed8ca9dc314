"""tools/diagrams.py: the architecture diagrams draw the layouts the book builds, in
order, bottom up or top down, and the tool refuses a diagram it does not know."""

import xml.etree.ElementTree as ET

import pytest

from tools import diagrams

BLOCKS = {  # the titles of the blocks a stack is made of, in both diagrams
    *("LayerNorm", "Add & Norm", "Linear", "Softmax", "log-softmax", "Feed-forward"),
    *("Multi-head self-attention", "Masked self-attention", "Source attention"),
    *("Multi-Head Attention", "Masked Multi-Head Attention", "Feed Forward"),
}


def blocks_in_column(svg, heading):
    """The block titles centred under (or over) a column's heading, top down."""
    texts = [
        (float(t.get("x")), float(t.get("y")), "".join(t.itertext()))
        for t in ET.fromstring(svg).iter()
        if t.tag.endswith("text")
    ]
    column = next(x for x, _, label in texts if label == heading)
    return [
        label
        for x, _, label in sorted(texts, key=lambda t: t[1])
        if x == column and label in BLOCKS
    ]


def test_post_norm_diagram_follows_each_sub_layer_with_add_and_norm():
    """The paper's Figure 1, bottom up: each sub-layer followed by one Add & Norm,
    no LayerNorm of its own and none ending a stack; Linear and Softmax on top."""
    svg = diagrams.diagram_architecture_post_norm()
    sub = [("Multi-Head Attention", "Add & Norm"), ("Feed Forward", "Add & Norm")]
    encoder = [block for pair in sub for block in pair]
    decoder = [
        "Masked Multi-Head Attention",
        "Add & Norm",
        *encoder,
        "Linear",
        "Softmax",
    ]
    assert blocks_in_column(svg, "Encoder")[::-1] == encoder
    assert blocks_in_column(svg, "Decoder")[::-1] == decoder


def test_pre_norm_diagram_puts_layer_norm_before_each_sub_layer_and_at_the_end():
    """The book's layout, top down: a LayerNorm before every sub-layer and one more
    ending each stack (Encoder.norm, Decoder.norm)."""
    svg = diagrams.diagram_architecture()
    encoder = ["LayerNorm", "Multi-head self-attention", "LayerNorm", "Feed-forward"]
    decoder = ["LayerNorm", "Masked self-attention", "LayerNorm", "Source attention"]
    decoder += ["LayerNorm", "Feed-forward", "LayerNorm", "Linear", "log-softmax"]
    assert blocks_in_column(svg, "Encoder") == [*encoder, "LayerNorm"]
    assert blocks_in_column(svg, "Decoder") == decoder


def test_the_tool_refuses_a_diagram_it_does_not_know(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        diagrams.main(["--out", str(tmp_path), "no_such_diagram"])
    assert refused.value.code == 2 and "no_such_diagram" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
