"""Tests for the end of Part 1: the same computation as PyTorch's own Transformer.

The book's `copy_weights` and `TORCH_NAMES` move the weights between its Encoder and
Decoder and torch.nn.TransformerEncoder / TransformerDecoder (built by the book's
`torch_stacks`), both ways, and from a real torch.nn.Transformer into make_model's
model. The two sides must then compute the same encoder memory and decoder output,
pre-norm and post-norm, on a padded batch with PyTorch's own masks (True = hidden),
on torch's Python path (gradients on) and on its fused fast path (eval mode, no
gradients); and, as a control, one weight changed by a millionth must break the
equality.
"""

import pytest
import torch
from tolerance import rounding_tolerance
from torch import nn

import the_annotated_transformer as tat

# nn.Transformer builds its encoder with nested tensors on, which a pre-norm encoder
# declines with a warning; its tests run torch's Python path, which never uses them.
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")

PAD = 0
N, D_MODEL, H = 2, 32, 4
D_FF = 2048  # torch's default dim_feedforward, which torch_stacks keeps (as make_model)
DELTA = 1e-6  # the control's change to one weight
# Each side's values pass 5N sub-layers (2 per encoder layer, 3 per decoder layer),
# whose errors add; the longest sums are the feed-forward layer's d_ff terms, and
# every LayerNorm brings values back to about unit size: 5N * d_ff steps in float64,
# of the size of the largest value compared (about 1e-11 here). The two sides differ
# by about 2e-15 (measured), and the control's DELTA moves them by 4e-8 or more.
STEPS = 5 * N * D_FF


def scramble(module, seed):
    """Add noise to every weight, so that no two (norm gains, zero biases) are equal
    and a weight copied to the wrong place cannot go unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def copied(norm_first, source):
    """(the book's model, torch's encoder and decoder, the final norms to apply to
    ours), the side copied from scrambled, then copied by copy_weights. Source
    "nn.Transformer": a real one, copied into ours. It ends both stacks with a
    LayerNorm (its decoder reads the normed memory): pre-norm, those are the book's
    final norms; post-norm, the book's stacks (like the paper's) end with their last
    layer's own norm, so only the layers are copied, and torch's two final norms are
    applied to ours where torch applies them."""
    torch.manual_seed(0)
    sizes = dict(N=N, d_model=D_MODEL, d_ff=D_FF, h=H, norm_first=norm_first)
    model = tat.make_model(11, 11, **sizes).double().eval()
    if source == "nn.Transformer":
        layout = dict(batch_first=True, norm_first=norm_first, layer_norm_eps=1e-6)
        real = nn.Transformer(D_MODEL, H, N, N, D_FF, **layout, dtype=torch.float64)
        stacks = real.eval().encoder, real.decoder
    else:
        stacks = tat.torch_stacks(norm_first, N=N, d_model=D_MODEL, h=H)
    to_torch = source == "book-to-torch"
    pairs = list(zip((model.encoder, model.decoder), stacks, strict=True))
    norms = [nn.Identity(), nn.Identity()]
    if source == "nn.Transformer" and not norm_first:
        pairs = [(ours.layers, theirs.layers) for ours, theirs in pairs]
        norms = [theirs.norm for theirs in stacks]
    for ours, theirs in ((model.encoder, stacks[0]), (model.decoder, stacks[1])):
        scramble(ours if to_torch else theirs, seed=1)
    for ours, theirs in pairs:
        tat.copy_weights(ours, theirs, to_torch)
    return model, *stacks, norms


def gaps(model, encoder, decoder, norms, path):
    """Memory and decoder output of both sides, on a padded batch: (difference,
    tolerance) for each."""
    src = torch.tensor([[3, 4, 5, 6, PAD, PAD], [7, 8, 9, 1, 2, 3]])
    tgt = torch.tensor([[1, 5, 6, PAD], [1, 2, 3, 4]])
    src_mask, tgt_pad = tat.padding_mask(src, PAD), tat.padding_mask(tgt, PAD)
    src_hidden = ~src_mask[:, 0]  # torch's masks: True hides
    hidden = dict(
        tgt_mask=~tat.subsequent_mask(4)[0], memory_key_padding_mask=src_hidden
    )
    hidden["tgt_key_padding_mask"] = ~tgt_pad[:, 0]
    with torch.set_grad_enabled(path == "python"):
        x, y = model.src_embed(src), model.tgt_embed(tgt)  # both sides' input
        memory_t = encoder(x, src_key_padding_mask=src_hidden)
        out_t = decoder(y, memory_t, **hidden)
        memory = norms[0](model.encoder(x, src_mask))
        tgt_mask = tgt_pad & tat.subsequent_mask(4)
        out = norms[1](model.decoder(y, memory, src_mask, tgt_mask))
    return [
        ((ours - theirs).abs().max().item(), tolerance_of(ours))
        for ours, theirs in ((memory, memory_t), (out, out_t))
    ]


def tolerance_of(values):
    return rounding_tolerance(STEPS, values.abs().max().item(), torch.float64)


@pytest.fixture
def fast_path_calls(monkeypatch):
    """Count the calls of torch's fused encoder layer and fused self-attention."""
    calls = {}
    for name in ("_transformer_encoder_layer_fwd", "_native_multi_head_attention"):
        kernel = getattr(torch, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(torch, name, counted)
    return calls


CASES = {
    f"{layout}-{source}-{path}": (norm_first, source, path)
    for layout, norm_first in (("pre-norm", True), ("post-norm", False))
    for source in ("book-to-torch", "torch-to-book", "nn.Transformer")
    for path in ("python", "fused")
    # nn.Transformer's encoder would take nested tensors there, zero at padding
    if (source, path) != ("nn.Transformer", "fused")
}


@pytest.mark.parametrize("case", CASES)
def test_the_book_and_pytorch_compute_the_same_until_one_weight_moves_a_millionth(
    case, fast_path_calls
):
    norm_first, source, path = CASES[case]
    model, encoder, decoder, norms = copied(norm_first, source)
    for difference, tolerance in gaps(model, encoder, decoder, norms, path):
        assert difference <= tolerance
    # The path the book's note names: one fused call per encoder layer and per
    # decoder self-attention without gradients, none with them.
    expected = {"_transformer_encoder_layer_fwd": N, "_native_multi_head_attention": N}
    assert fast_path_calls == (expected if path == "fused" else {})
    with torch.no_grad():  # W^K[1, 2] of the first encoder layer, on the side copied to
        if source == "book-to-torch":  # in_proj_weight holds W^Q, W^K, W^V stacked
            encoder.layers[0].self_attn.in_proj_weight[D_MODEL + 1, 2] += DELTA
        else:
            model.encoder.layers[0].self_attn.linears[1].weight[1, 2] += DELTA
    for difference, tolerance in gaps(model, encoder, decoder, norms, path):
        assert difference > tolerance
