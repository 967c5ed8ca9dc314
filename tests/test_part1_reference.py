"""Tests for the end of Part 1: the same computation as PyTorch's own Transformer.

The book's `copy_weights` and `TORCH_NAMES` move the weights between its Encoder and
Decoder and torch.nn.TransformerEncoder / TransformerDecoder (built by the book's
`torch_stacks`), both ways. These tests check that the two then compute the same
encoder memory and decoder output, pre-norm and post-norm, on a padded batch with
PyTorch's own masks (True = hidden), on torch's Python path (gradients on) and on its
fused fast path (eval mode, no gradients); and, as a control, that one weight changed
by a millionth breaks the equality. The last tests load a real torch.nn.Transformer,
not torch_stacks, into make_model, each layout, with the same control.
"""

import pytest
import torch
from torch import nn

import the_annotated_transformer as tat

PAD = 0
N, D_MODEL, H = 3, 32, 4
D_FF = 2048  # torch's default dim_feedforward, which torch_stacks keeps (as make_model)
DELTA = 1e-6  # the control's change to one weight
LAYOUTS = {"pre-norm": True, "post-norm": False}
DIRECTIONS = {"book-to-torch": True, "torch-to-book": False}
PATHS = ["python", "fused"]

# The tolerance, relative to the size of the compared values. In float64 a sum of n
# terms, added in any order, is off by at most about n * u times the size of its terms
# (u = 2^-53, the unit roundoff; Higham's gamma_n bound). The two sides add the same
# products in different orders (torch's fused in-projection, its attention kernels),
# the longest sums are the feed-forward layer's d_ff terms, and the decoder output has
# passed 5N sub-layers (2 per encoder layer, 3 per decoder layer) whose errors add;
# every LayerNorm brings values back to about unit size. Hence 5N * d_ff * u times
# the largest value compared: 3.4e-12 times about 3 here. The differences measured are
# about 2e-15 (the bound is a worst case; rounding errors mostly cancel), and the
# control's change of DELTA moves the outputs by 4e-8 to 2e-7, far above it.
U = torch.finfo(torch.float64).eps / 2
RELATIVE_TOL = 5 * N * D_FF * U


def padded_batch():
    """Two sources and two targets, the first of each ending in padding."""
    src = torch.tensor([[3, 4, 5, 6, PAD, PAD], [7, 8, 9, 1, 2, 3]])
    tgt = torch.tensor([[1, 5, 6, PAD], [1, 2, 3, 4]])
    return src, tgt


def book_masks(src, tgt):
    """The book's masks (True = may attend): source padding; target padding, future."""
    src_mask = tat.padding_mask(src, PAD)  # (batch, 1, src_len)
    tgt_mask = tat.padding_mask(tgt, PAD) & tat.subsequent_mask(tgt.size(1))
    return src_mask, tgt_mask


def torch_masks(src, tgt):
    """PyTorch's masks (True = hidden), each the negation of one of the book's."""
    src_hidden = ~tat.padding_mask(src, PAD)[:, 0]  # (batch, src_len)
    return src_hidden, {
        "tgt_mask": ~tat.subsequent_mask(tgt.size(1))[0],  # (tgt_len, tgt_len)
        "tgt_key_padding_mask": ~tat.padding_mask(tgt, PAD)[:, 0],  # (batch, tgt_len)
        "memory_key_padding_mask": src_hidden,
    }


def scramble(module, seed):
    """Add noise to every weight, so that no two (norm gains, zero biases) are equal
    and a weight copied to the wrong place cannot go unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def models(norm_first, to_torch):
    """The book's model and torch's stacks, the source side scrambled, then copied."""
    torch.manual_seed(0)
    model = tat.make_model(
        11, 11, N=N, d_model=D_MODEL, d_ff=D_FF, h=H, norm_first=norm_first
    )
    model = model.double().eval()
    encoder, decoder = tat.torch_stacks(norm_first, N=N, d_model=D_MODEL, h=H)
    for ours, theirs in ((model.encoder, encoder), (model.decoder, decoder)):
        scramble(ours if to_torch else theirs, seed=1)
        tat.copy_weights(ours, theirs, to_torch)
    return model, encoder, decoder


def perturb_one_weight(model, encoder, to_torch):
    """Change W^K[1, 2] of the first encoder layer by DELTA on the side copied to."""
    with torch.no_grad():
        if to_torch:  # torch's in_proj_weight holds W^Q, W^K, W^V stacked
            encoder.layers[0].self_attn.in_proj_weight[D_MODEL + 1, 2] += DELTA
        else:
            model.encoder.layers[0].self_attn.linears[1].weight[1, 2] += DELTA


def largest_differences(model, encoder, decoder, path):
    """Memory and decoder output of both sides: (difference, tolerance) for each."""
    src, tgt = padded_batch()
    src_mask, tgt_mask = book_masks(src, tgt)
    src_hidden, hidden = torch_masks(src, tgt)
    with torch.set_grad_enabled(path == "python"):
        x, y = model.src_embed(src), model.tgt_embed(tgt)  # both stacks' input
        memory = model.encoder(x, src_mask)
        out = model.decoder(y, memory, src_mask, tgt_mask)
        memory_t = encoder(x, src_key_padding_mask=src_hidden)
        out_t = decoder(y, memory_t, **hidden)
    return [
        ((ours - theirs).abs().max().item(), RELATIVE_TOL * ours.abs().max().item())
        for ours, theirs in ((memory, memory_t), (out, out_t))
    ]


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


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("to_torch", DIRECTIONS.values(), ids=DIRECTIONS.keys())
@pytest.mark.parametrize("norm_first", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_book_and_torch_stacks_compute_the_same_memory_and_output(
    norm_first, to_torch, path, fast_path_calls
):
    model, encoder, decoder = models(norm_first, to_torch)
    for difference, tolerance in largest_differences(model, encoder, decoder, path):
        assert difference <= tolerance
    # The path the book's note names: one fused call per encoder layer and per
    # decoder self-attention without gradients, none with them.
    expected = {"_transformer_encoder_layer_fwd": N, "_native_multi_head_attention": N}
    assert fast_path_calls == (expected if path == "fused" else {})


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("to_torch", DIRECTIONS.values(), ids=DIRECTIONS.keys())
@pytest.mark.parametrize("norm_first", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_one_weight_changed_by_a_millionth_breaks_the_equality(
    norm_first, to_torch, path
):
    model, encoder, decoder = models(norm_first, to_torch)
    perturb_one_weight(model, encoder, to_torch)
    for difference, tolerance in largest_differences(model, encoder, decoder, path):
        assert difference > tolerance


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensor_fast_path_returns_zeros_at_padding():
    """Why torch_stacks passes enable_nested_tensor=False: with it, a post-norm
    encoder's fast path skips the padded positions and returns zeros there."""
    model, encoder, _ = models(norm_first=False, to_torch=True)
    layer = nn.TransformerEncoderLayer(
        D_MODEL, H, layer_norm_eps=1e-6, batch_first=True
    )
    nested = nn.TransformerEncoder(layer, N, enable_nested_tensor=True).double()
    nested.load_state_dict(encoder.state_dict())
    src, tgt = padded_batch()
    src_mask, _ = book_masks(src, tgt)
    src_hidden, _ = torch_masks(src, tgt)
    with torch.no_grad():
        x = model.src_embed(src)
        memory = model.encoder(x, src_mask)
        memory_t = nested.eval()(x, src_key_padding_mask=src_hidden)
    padding = src_hidden  # (batch, src_len), True at the padded positions
    assert (memory_t[padding] == 0).all() and (memory[padding] != 0).all()
    tolerance = RELATIVE_TOL * memory.abs().max()
    assert (memory - memory_t)[~padding].abs().max() <= tolerance


# ---------------------------------------------------------------------------------
# From a real torch.nn.Transformer into make_model
# ---------------------------------------------------------------------------------


def real_transformer(norm_first):
    """A torch.nn.Transformer in make_model's sizes and layout (batch first, our
    LayerNorm's eps), float64, eval, every weight scrambled (its norms would
    otherwise all be 1 and 0, and its attention biases 0)."""
    torch.manual_seed(2)
    transformer = nn.Transformer(
        D_MODEL,
        H,
        num_encoder_layers=N,
        num_decoder_layers=N,
        dim_feedforward=D_FF,
        batch_first=True,
        norm_first=norm_first,
        layer_norm_eps=1e-6,
        dtype=torch.float64,
    )
    scramble(transformer, seed=3)
    return transformer.eval()


def loaded_from(transformer, norm_first):
    """make_model's model holding the transformer's encoder and decoder, copied in by
    the book's copy_weights: the whole stacks for pre-norm, where both end in a
    LayerNorm; the layers alone for post-norm, whose stacks in the book have no final
    norm to receive torch's."""
    torch.manual_seed(0)
    model = tat.make_model(
        11, 11, N=N, d_model=D_MODEL, d_ff=D_FF, h=H, norm_first=norm_first
    )
    model = model.double().eval()
    stacks = (
        (model.encoder, transformer.encoder),
        (model.decoder, transformer.decoder),
    )
    for ours, theirs in stacks:
        if not norm_first:
            ours, theirs = ours.layers, theirs.layers
        tat.copy_weights(ours, theirs, to_torch=False)
    return model


def differences_from_transformer(model, transformer, torch_norms):
    """Memory and decoder output of make_model's model and of the nn.Transformer it
    was loaded from, on the padded batch (gradients on: torch's Python path):
    (difference, tolerance) for each. torch_norms: apply torch's final norms to ours
    where torch applies them (for post-norm, whose stacks in the book have none)."""
    src, tgt = padded_batch()
    src_mask, tgt_mask = book_masks(src, tgt)
    src_hidden, hidden = torch_masks(src, tgt)
    x, y = model.src_embed(src), model.tgt_embed(tgt)  # both sides' input
    memory_t = transformer.encoder(x, src_key_padding_mask=src_hidden)
    out_t = transformer(x, y, src_key_padding_mask=src_hidden, **hidden)
    memory = model.encoder(x, src_mask)
    if torch_norms:  # the memory torch's decoder reads is normed
        memory = transformer.encoder.norm(memory)
    out = model.decoder(y, memory, src_mask, tgt_mask)
    if torch_norms:
        out = transformer.decoder.norm(out)
    return [
        ((ours - theirs).abs().max().item(), RELATIVE_TOL * ours.abs().max().item())
        for ours, theirs in ((memory, memory_t), (out, out_t))
    ]


# nn.Transformer builds its encoder with nested tensors on, which a pre-norm encoder
# declines with a warning; these tests run torch's Python path, which never uses them.
NESTED_DECLINED = "ignore:enable_nested_tensor is True"


@pytest.mark.filterwarnings(NESTED_DECLINED)
@pytest.mark.parametrize("norm_first", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_make_model_loaded_from_an_nn_transformer_computes_what_it_computes(
    norm_first,
):
    """torch -> ours from a real nn.Transformer, not from torch_stacks.

    nn.Transformer always ends its encoder and its decoder with a LayerNorm, and its
    decoder reads the normed memory. Pre-norm, those are the book's final norms, and
    the two models are the same function. Post-norm, the book (like the paper) ends
    a stack with its last layer's own norm, so nn.Transformer(norm_first=False) is
    not make_model's post-norm model but that model with one more LayerNorm after
    each stack. There we load the layers and apply torch's two final norms (torch's
    own modules, with their scrambled weights) where torch applies them: to our
    memory, before our decoder reads it, and to our decoder's output. Either layout
    then checks every weight copy_weights moved from torch's layers into ours, with
    the file's tolerance (float64, 5N sub-layers of d_ff-term sums; torch's two
    final norms, applied to both sides alike, add sums of only d_model terms).
    """
    transformer = real_transformer(norm_first)
    model = loaded_from(transformer, norm_first)
    for difference, tolerance in differences_from_transformer(
        model, transformer, torch_norms=not norm_first
    ):
        assert difference <= tolerance


@pytest.mark.filterwarnings(NESTED_DECLINED)
@pytest.mark.parametrize("norm_first", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_one_weight_changed_after_loading_an_nn_transformer_breaks_the_equality(
    norm_first,
):
    # The control of the test above: W^K[1, 2] of our first encoder layer moved by
    # DELTA after the copy moves memory and output by 6e-8 to 4e-7 (measured), far
    # above the tolerance of about 1e-11.
    transformer = real_transformer(norm_first)
    model = loaded_from(transformer, norm_first)
    perturb_one_weight(model, None, to_torch=False)
    for difference, tolerance in differences_from_transformer(
        model, transformer, torch_norms=not norm_first
    ):
        assert difference > tolerance


@pytest.mark.filterwarnings(NESTED_DECLINED)
def test_a_post_norm_nn_transformer_is_make_models_with_one_more_norm_per_stack():
    """Why the post-norm case applies torch's final norms: without them, the model
    loaded from a post-norm nn.Transformer misses it by far more than the tolerance
    (about 0.2 in memory and output, measured)."""
    transformer = real_transformer(norm_first=False)
    model = loaded_from(transformer, norm_first=False)
    for difference, tolerance in differences_from_transformer(
        model, transformer, torch_norms=False
    ):
        assert difference > 1e6 * tolerance
