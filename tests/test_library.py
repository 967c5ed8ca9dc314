"""The book as a library (docs/build_on_it.md): its traps caught where a user's data
enters, its contracts in help(), its public surface, and saving and loading weights.

Each trap below would otherwise run silently, with wrong results:
a forgotten pad, a mask in PyTorch's or an additive convention, a mask of the wrong
shape, a loss whose padding id is not the batches', the paper's width in the rate of
a smaller model.
"""

import ast
import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch

import the_annotated_transformer as tat

REPO_ROOT = Path(__file__).resolve().parent.parent
V, PAD = 12, 0  # ids 2..11 are digits, 0 pads, 1 starts


def digit_batch(pad=None, seed=0):
    """Ten digits after a start symbol, and the same reversed; pad=None forgets
    to pass one (Batch's default, 2, is then a digit)."""
    g = torch.Generator().manual_seed(seed)
    digits = torch.randint(2, V, (4, 10), generator=g)
    start = torch.ones(4, 1, dtype=torch.long)
    src, tgt = torch.cat([start, digits], 1), torch.cat([start, digits.flip(1)], 1)
    return tat.Batch(src, tgt) if pad is None else tat.Batch(src, tgt, pad=pad)


def small_model(h=4):
    torch.manual_seed(0)
    return tat.make_model(V, V, N=1, d_model=32, d_ff=64, h=h, dropout=0.0).eval()


# ---------------------------------------------------------------------------
# A forgotten pad, and a loss that pads with another id


def test_a_batch_whose_pad_is_a_real_token_before_others_warns_in_one_line():
    with pytest.warns(
        UserWarning, match=r"pad=2 comes before a real token in (src|tgt)"
    ):
        batch = digit_batch()  # the digit 0 is id 2: the default pad
    assert batch.ntokens < 40  # what the warning is about: digits taken for padding


def test_a_batch_with_its_own_pad_or_padding_at_the_end_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        digit_batch(pad=PAD)  # the pad given: no digit is padding
        src = torch.tensor([[1, 5, 6, 2, 2], [1, 5, 6, 7, 8]])  # pad=2 at the end
        tat.Batch(src, src)
    assert digit_batch(pad=PAD).ntokens == 40


def test_run_epoch_refuses_a_loss_whose_padding_id_is_not_the_batches():
    model = small_model()
    loss = tat.SimpleLossCompute(model.generator, tat.LabelSmoothing(V, PAD))
    with pytest.warns(UserWarning):
        batch = digit_batch()  # pad forgotten: 2
    with pytest.raises(ValueError, match=r"padding_idx is 0, the batches' pad 2: give"):
        tat.run_epoch([batch], model, loss, mode="eval")
    tat.run_epoch([digit_batch(pad=PAD)], model, loss, mode="eval")  # agreeing: runs


# ---------------------------------------------------------------------------
# Masks in another convention, or of another shape


@pytest.fixture
def masks():
    """A padded batch's masks in the book's convention (True: may attend)."""
    src = torch.tensor([[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 9, 10]])
    tgt = torch.tensor([[1, 3, 5, 0], [1, 2, 4, 6]])
    return tat.Batch(src, tgt, pad=PAD)


def pytorch_convention(batch):
    return ~batch.src_mask, ~batch.tgt_mask  # True hides, as nn.Transformer's


def additive(batch):
    src = torch.zeros(batch.src_mask.shape).masked_fill(~batch.src_mask, -torch.inf)
    tgt = torch.zeros(batch.tgt_mask.shape).masked_fill(~batch.tgt_mask, -torch.inf)
    return src, tgt


def batch_len_1(batch):
    return batch.src_mask.transpose(1, 2), batch.tgt_mask  # (batch, len, 1)


def two_d(batch):
    return batch.src_mask[:, 0], batch.tgt_mask  # (batch, len): batch = 2 = heads


@pytest.mark.parametrize(
    "wrong, says",
    [
        (pytorch_convention, "sees no key"),
        (additive, "sees no key, or is additive"),
        (batch_len_1, "src_mask has shape"),
        (two_d, r"src_mask has shape \(2, 6\), not \(2 or 1, 1, 6\)"),
    ],
    ids=["PyTorch's convention", "additive", "(batch, len, 1)", "2-D"],
)
def test_a_mask_the_model_would_misread_is_refused_in_one_line(masks, wrong, says):
    """Each of these ran without an error before, with outputs up to 2.9 apart from
    the right ones (a 2-D mask broadcast when the batch size equals the heads)."""
    model = small_model(h=2)  # two heads, as the batch has two sentences
    src_mask, tgt_mask = wrong(masks)
    with pytest.raises(ValueError, match=says) as caught:
        model(masks.src, masks.tgt, src_mask, tgt_mask)
    message = str(caught.value)
    assert "\n" not in message and "1/True where a query may attend" in message
    assert "PyTorch" in message  # the opposite convention is named


@pytest.mark.parametrize("wrong", [pytorch_convention, additive])
def test_the_fix_the_message_names_turns_such_masks_into_the_books(masks, wrong):
    """The message's mask == 0 gives back the book's masks, and the same output."""
    model = small_model()
    src_mask, tgt_mask = wrong(masks)
    out = model(masks.src, masks.tgt, src_mask == 0, tgt_mask == 0)
    assert torch.equal(out, model(masks.src, masks.tgt, masks.src_mask, masks.tgt_mask))


def test_a_target_row_that_starts_with_padding_is_refused_with_the_true_cause():
    """Left padding leaves the first query of the row no key (padding & look-ahead):
    the message names it and the fix, not an inverted mask alone; the same row
    padded at the end runs."""
    model = small_model()
    src = torch.tensor([[3, 4, 5], [6, 7, 8]])
    src_mask = tat.padding_mask(src, PAD)
    for tgt, fails in (
        ([[PAD, 1, 3], [1, 2, 4]], True),
        ([[1, 3, PAD], [1, 2, 4]], False),
    ):
        tgt = torch.tensor(tgt)
        tgt_mask = tat.padding_mask(tgt, PAD) & tat.subsequent_mask(3)
        if not fails:
            model(src, tgt, src_mask, tgt_mask)
            continue
        with pytest.raises(ValueError) as caught:
            model(src, tgt, src_mask, tgt_mask)
        message = str(caught.value)
        assert "tgt_mask leaves a query that sees no key" in message
        assert "a target row must not start with padding: pad at the end" in message
        assert "mask == 0 turns a PyTorch or additive mask into ours" in message


@pytest.mark.parametrize("dtype", [torch.bool, torch.float, torch.long])
def test_masks_of_the_books_convention_in_any_dtype_pass(masks, dtype):
    """The 2018/2022 notebook's float and integer masks keep working."""
    model = small_model()
    src_mask, tgt_mask = masks.src_mask.to(dtype), masks.tgt_mask.to(dtype)
    out = model(masks.src, masks.tgt, src_mask, tgt_mask)
    reference = model(masks.src, masks.tgt, masks.src_mask, masks.tgt_mask)
    assert torch.equal(out, reference)


def test_a_wrong_shape_is_named_at_encode_and_decode_too(masks):
    model = small_model()
    with pytest.raises(ValueError, match="src_mask has shape"):
        model.encode(masks.src, masks.src_mask[:, 0])
    memory = model.encode(masks.src, masks.src_mask)
    with pytest.raises(ValueError, match="tgt_mask has shape"):
        model.decode(memory, masks.src_mask, masks.tgt, masks.tgt_mask[:, :, :2])


def test_mask_checks_cost_decoding_no_extra_wait_for_the_device(masks):
    """encode reads src_mask's check once from the device; decode, which decoding
    calls once per step, checks shapes only (no read); forward reads the tgt_mask
    check once more, besides encode's."""
    model = small_model()
    reads = []
    original = torch.Tensor.tolist

    def counting(self):
        reads.append(1)
        return original(self)

    torch.Tensor.tolist = counting
    try:
        memory = model.encode(masks.src, masks.src_mask)
        assert reads == [1]
        model.decode(memory, masks.src_mask, masks.tgt, masks.tgt_mask)
        assert reads == [1]
        model(masks.src, masks.tgt, masks.src_mask, masks.tgt_mask)
        assert reads == [1, 1, 1]
    finally:
        torch.Tensor.tolist = original


@pytest.mark.parametrize("decode", [tat.greedy_decode, tat.beam_search])
def test_decoding_refuses_a_source_mask_in_pytorchs_convention(masks, decode):
    """The 2018/2022 notebook's inference path: greedy_decode(model, src, src_mask,
    ...) with PyTorch's mask ran silently, its memory up to 1.9 away from the right
    one. encode checks the source mask's contents, so every decoder refuses it."""
    model = small_model()
    pytorch_src_mask, _ = pytorch_convention(masks)
    with pytest.raises(ValueError, match="src_mask leaves a query that sees no key"):
        decode(model, masks.src, pytorch_src_mask, 5, 1, end_symbol=2)
    ids = decode(model, masks.src, masks.src_mask, 5, 1, end_symbol=2)
    assert ids.size(0) == masks.src.size(0)  # the book's own mask decodes


def test_pytorchs_mask_on_a_batch_padded_in_every_row_is_refused_naming_it():
    """Every row padded: PyTorch's mask leaves every query a key (the padding), so
    only the tokens tell: it shows one id and hides the varied ones."""
    model = small_model()
    src = torch.tensor([[1, 5, 6, 7, 2, PAD, PAD], [1, 8, 9, 2, PAD, PAD, PAD]])
    right = tat.padding_mask(src, PAD)
    for wrong in (~right, (~right).float()):
        with pytest.raises(ValueError) as caught:
            tat.greedy_decode(model, src, wrong, 5, 1)
        message = str(caught.value)
        assert f"shows only id {PAD} and hides the other tokens" in message
        assert "PyTorch's nn.Transformer: True hides" in message and "\n" not in message
    tat.greedy_decode(model, src, right, 5, 1)  # the book's own mask decodes


def test_an_empty_sentence_gets_its_own_message_without_the_pytorch_hint():
    model = small_model()
    src = torch.tensor([[1, 5, 6, 2], [PAD, PAD, PAD, PAD]])
    with pytest.raises(ValueError) as caught:
        model.encode(src, tat.padding_mask(src, PAD))
    message = str(caught.value)
    assert "empty sentence" in message and "such as </s>" in message
    assert "PyTorch" not in message and "mask == 0" not in message


def test_rows_of_one_token_and_padding_pass_though_one_id_is_shown():
    """One shown id is no sign of PyTorch's convention when one id is hidden too."""
    model = small_model()
    src = torch.tensor([[1, PAD, PAD], [1, PAD, PAD]])
    model.encode(src, tat.padding_mask(src, PAD))


def test_a_source_and_target_of_different_batch_sizes_are_refused_in_one_line(masks):
    """They failed 21 frames deep in attention with a broadcasting message."""
    model = small_model()
    with pytest.raises(ValueError, match="src has 2 rows, tgt 1: one per pair"):
        model(masks.src, masks.tgt[:1], masks.src_mask, masks.tgt_mask[:1])
    with pytest.raises(ValueError, match="src and tgt need the same number of rows"):
        tat.Batch(masks.src, masks.tgt[:1], pad=PAD)


def test_a_sequence_longer_than_max_len_names_make_models_max_len():
    """It failed 12 frames deep with a broadcasting message about sizes."""
    torch.manual_seed(0)
    model = tat.make_model(V, V, N=1, d_model=32, d_ff=64, h=4, max_len=8).eval()
    src = torch.ones(1, 9, dtype=torch.long)
    mask = torch.ones(1, 1, 9, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"9 positions, more than max_len=8: make_mo"):
        model.encode(src, mask)
    model.encode(src[:, :8], mask[..., :8])  # exactly max_len: fine


def test_a_mask_that_is_not_a_tensor_is_named(masks):
    model = small_model()
    with pytest.raises(TypeError, match="src_mask must be a tensor"):
        model.encode(masks.src, masks.src_mask.tolist())


# ---------------------------------------------------------------------------
# The learning rate for the model's own width


def test_make_optimizer_on_a_model_that_is_not_the_books_asks_for_its_width():
    with pytest.raises(ValueError, match="pass model_size="):
        tat.make_optimizer(torch.nn.Linear(3, 3))
    optimizer, _ = tat.make_optimizer(torch.nn.Linear(3, 3), model_size=3, warmup=10)
    # LambdaLR multiplies base_lr = 1.0 by rate itself: exactly rate.
    assert optimizer.param_groups[0]["lr"] == tat.rate(0, 3, 1.0, 10)


# ---------------------------------------------------------------------------
# Attention maps of any model


def test_attention_maps_are_each_layers_weights_after_a_forward_pass(masks):
    model = small_model()
    assert all(w is None for ws in tat.attention_maps(model).values() for w in ws)
    model(masks.src, masks.tgt, masks.src_mask, masks.tgt_mask)
    maps = tat.attention_maps(model)
    shapes = {kind: [tuple(w.shape) for w in ws] for kind, ws in maps.items()}
    assert shapes == {
        "encoder_self_attention": [(2, 4, 6, 6)],
        "decoder_self_attention": [(2, 4, 3, 3)],
        "decoder_source_attention": [(2, 4, 3, 6)],
    }
    assert maps["decoder_source_attention"][0] is model.decoder.layers[0].src_attn.attn
    rows = maps["encoder_self_attention"][0].sum(-1)
    # Each query's n = 6 float32 weights sum to 1 within (n + 1) u (the softmax's sum
    # and division) and this sum adds (n - 1) u: 2n u, u = 2^-24.
    assert torch.allclose(rows, torch.ones_like(rows), rtol=0, atol=12 * 2.0**-24)
    assert (maps["encoder_self_attention"][0][0, :, :, 4:] == 0).all()  # padding


# ---------------------------------------------------------------------------
# Saving and loading weights


def test_weights_saved_without_positional_tables_load_into_any_max_len(tmp_path):
    torch.manual_seed(0)
    model = tat.make_model(V, V, N=1, d_model=32, d_ff=64, h=4, max_len=5000)
    state = tat.without_positional_tables(model.state_dict())
    assert not [k for k in state if k.endswith(".pe")]
    torch.save(state, tmp_path / "w.pt")
    tables = 2 * 5000 * 32 * 4  # bytes of the two float32 tables left out
    assert (tmp_path / "w.pt").stat().st_size < tables / 4
    short = tat.make_model(V, V, N=1, d_model=32, d_ff=64, h=4, max_len=64)
    tat.load_weights(short, torch.load(tmp_path / "w.pt", weights_only=True))
    for name, weight in state.items():
        assert torch.equal(short.state_dict()[name], weight), name
    assert short.src_embed[1].pe.shape == (1, 64, 32)  # its own table kept
    # A state dict with its tables (as the 2018/2022 notebook saved them) loads too.
    tat.load_weights(short, model.state_dict())
    with pytest.raises(RuntimeError, match="Missing key"):
        tat.load_weights(
            short, {k: v for k, v in state.items() if "generator" not in k}
        )


def model_of(**changes):
    """A small make_model model, seeded, with `changes` to its arguments."""
    torch.manual_seed(0)
    sizes = {"N": 1, "d_model": 32, "d_ff": 64, "h": 4} | changes
    return tat.make_model(V, V, **sizes)


def test_a_saved_model_loads_back_built_from_its_own_arguments(tmp_path):
    model = model_of(dropout=0.0, norm_first=False, activation=torch.nn.functional.gelu)
    tat.save_model(model, tmp_path / "m.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]  # no .part left
    again = tat.load_model(tmp_path / "m.pt")
    assert again.make_model_args == model.make_model_args
    assert again.make_model_args["activation"] == "gelu"  # by name: JSON, no code
    for name, weight in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], weight), name
    saved = torch.load(tmp_path / "m.pt", weights_only=True)  # no pickled objects
    assert not [k for k in saved["weights"] if k.endswith(".pe")]


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(h=8), "h: saved 4, given 8"),
        (dict(norm_first=False), "norm_first: saved True, given False"),
        (dict(activation=torch.nn.functional.silu), "activation: saved 'relu', given"),
    ],
)
def test_a_saved_model_is_refused_by_a_model_of_other_sizes_naming_them(
    tmp_path, changes, named
):
    tat.save_model(model_of(), tmp_path / "m.pt")
    with pytest.raises(ValueError, match=named) as error:
        tat.load_model(tmp_path / "m.pt", model_of(**changes))
    assert "\n" not in str(error.value)
    # the positional tables' length is each model's own
    tat.load_model(tmp_path / "m.pt", model_of(max_len=64))


def test_a_plain_state_dict_loads_only_into_a_given_model_with_a_warning(tmp_path):
    torch.save(model_of().state_dict(), tmp_path / "old.pt")
    with pytest.warns(UserWarning, match="sizes are unchecked"):
        tat.load_model(tmp_path / "old.pt", model_of(h=8))  # same shapes
    with pytest.raises(ValueError, match="pass model=make_model"):
        tat.load_model(tmp_path / "old.pt")


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: tat.MultiHeadedAttention(4, 30), "d_model=30 is not divisible by h=4"),
        (lambda: tat.MultiHeadedAttention(0, 32), "h must be a positive integer"),
        (lambda: tat.PositionalEncoding(7, 0.1), "d_model=7 is odd"),
        (lambda: tat.PositionalEncoding(8, 0.1, max_len=0), "max_len must be"),
    ],
)
def test_a_constructor_refuses_what_its_forward_would_trip_on(make, words):
    with pytest.raises(ValueError, match=words):
        make()


@pytest.mark.parametrize("call", ["encode", "forward"])
def test_a_sentence_without_a_batch_dimension_is_refused_saying_how_to_add_it(call):
    model, ids = model_of(), torch.tensor([1, 2, 3])
    mask = torch.ones(1, 1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"\(batch, seq\), got shape \(3,\); add"):
        if call == "encode":
            model.encode(ids, mask)
        else:
            model(ids, ids.unsqueeze(0), mask, tat.subsequent_mask(3))


def test_the_version_is_the_packages():
    import tomllib

    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert tat.__version__ == pyproject["project"]["version"]


# ---------------------------------------------------------------------------
# The public surface and its contracts


def test_all_lists_the_library_and_leaves_out_examples_and_charts():
    names = set(tat.__all__)
    assert all(hasattr(tat, name) for name in names)
    assert not [n for n in names if n.startswith(("example_", "chart_", "_"))]
    assert not names & {"show_example", "ChartOutput", "np", "os", "F", "torch"}
    everything = {}
    exec("from the_annotated_transformer import *", everything)
    assert set(everything) - {"__builtins__"} == names


def test_the_module_docstring_indexes_every_public_name():
    words = set(re.findall(r"\w+", tat.__doc__))
    assert set(tat.__all__) <= words


def test_every_public_function_and_class_says_what_it_does():
    for name in tat.__all__:
        thing = getattr(tat, name)
        if inspect.isfunction(thing) or inspect.isclass(thing):
            assert inspect.getdoc(thing), f"{name} has no docstring"


@pytest.mark.parametrize(
    "name, words",
    [
        ("Batch", ["pad=2", "src_mask", "tgt_y", "ntokens", "may attend"]),
        ("run_epoch", ["train+log", "eval", "accum_iter", "padding"]),
        ("make_optimizer", ["d_model", "warmup", "scheduler.step()"]),
        (
            "MultiHeadedAttention",
            [".attn", "(batch, h, q_len, k_len)", "attention_maps"],
        ),
        ("EncoderDecoder", ["(batch, src_len)", "True", "may attend"]),
        ("make_model", ["embedding_init", "norm_first", "max_len"]),
        ("attention", ["mask", "1/True", "(..., q_len, k_len)"]),
    ],
)
def test_help_gives_the_contract_a_user_needs(name, words):
    doc = inspect.getdoc(getattr(tat, name))
    for word in words:
        assert word in doc, f"help({name}) does not say {word!r}"


def test_the_readmes_build_on_it_names_are_public():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Build on it", 1)[1].split("\n## ", 1)[0]
    pattern = r"from the_annotated_transformer import \(([^)]*)\)"
    named = {n.strip() for m in re.findall(pattern, section) for n in m.split(",")}
    named.discard("")
    assert named and named <= set(tat.__all__)


def test_importing_the_book_defines_but_runs_nothing():
    """Every top-level statement of the book defines a name, imports, or is an
    example call that does nothing outside the notebook."""
    tree = ast.parse((REPO_ROOT / "the_annotated_transformer.py").read_text("utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            assert ast.unparse(node.value.func) == "show_example", ast.unparse(node)
