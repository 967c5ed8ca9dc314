"""The book as a library (docs/build_on_it.md): its traps caught where a user's data
enters, its public surface, and saving and loading weights.

Each trap below would otherwise run silently, with wrong results, or fail deep in
attention with a broadcasting message: a forgotten pad, a mask in PyTorch's or an
additive convention, a mask of the wrong shape, a loss whose padding id is not the
batches', the paper's width in the rate of a smaller model. Each is refused in one
line that says what to do; what the 2018/2022 notebook did right keeps working.
"""

import ast
import re
import tomllib
import warnings

import pytest
import torch
from conftest import REPO_ROOT
from tolerance import unit_roundoff

import the_annotated_transformer as tat

V, PAD = 12, 0  # ids 2..11 are digits, 0 pads, 1 starts
SRC = torch.tensor([[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 9, 10]])
BATCH = tat.Batch(SRC, torch.tensor([[1, 3, 5, 0], [1, 2, 4, 6]]), pad=PAD)
TGT, SM, TM = BATCH.tgt, BATCH.src_mask, BATCH.tgt_mask  # the book's masks
GELU = torch.nn.functional.gelu


def model_of(**changes):
    """A small make_model model, seeded, with `changes` to its arguments."""
    torch.manual_seed(0)
    sizes = {"N": 1, "d_model": 32, "d_ff": 64, "h": 2, "dropout": 0.0} | changes
    return tat.make_model(V, V, **sizes).eval()


def additive(mask):
    return torch.zeros(mask.shape).masked_fill(~mask, -torch.inf)


def padded(m, src, tgt=None):
    """Encode (or with `tgt`, run) rows padded with PAD, with the book's masks."""
    src, masks = torch.tensor(src), tat.padding_mask(torch.tensor(src), PAD)
    if tgt is None:
        return m.encode(src, masks)
    tgt = torch.tensor(tgt)
    return m(src, tgt, masks, tat.padding_mask(tgt, PAD) & tat.subsequent_mask(3))


def padding_mismatch(m):
    loss = tat.SimpleLossCompute(m.generator, tat.LabelSmoothing(V, PAD))
    batch = tat.Batch(torch.tensor([[1, 5, 6]]), torch.tensor([[1, 5, 6]]), pad=2)
    tat.run_epoch([batch], m, loss, mode="eval")


# PyTorch's mask of a batch padded in every row leaves every query a key (the
# padding): only the tokens tell.
ALL = torch.tensor([[1, 5, 6, 7, 2, PAD, PAD], [1, 8, 9, 2, PAD, PAD, PAD]])
HIDES = ~tat.padding_mask(ALL, PAD)
ONLY = "shows only id 0 and hides the other tokens: .* True hides"
NO_KEY = r"sees no key, or is additive \(0/-inf\): masks hold 1/True"
FIX = "mask == 0 turns a PyTorch or additive mask into ours"
EMPTY = r"^src_mask hides every token .*\(an empty sentence\?\): give each row a token"
REFUSED = {  # a misuse: (what does it, what the one line must say)
    "PyTorch's mask": (lambda m: m(SRC, TGT, ~SM, ~TM), NO_KEY + ".*True hides"),
    "additive mask": (lambda m: m(SRC, TGT, additive(SM), additive(TM)), FIX),
    "(batch, len, 1)": (lambda m: m(SRC, TGT, SM.transpose(1, 2), TM), "src_mask has"),
    "2-D, batch = h": (lambda m: m.encode(SRC, SM[:, 0]), r"\(2, 6\), not \(2 or 1, 1"),
    "decode's mask": (lambda m: m.decode(None, SM, TGT, TM[..., :2]), "tgt_mask has"),
    "left padding": (lambda m: padded(m, [[3, 4]] * 2, [[PAD, 1, 3]] * 2), "pad at"),
    "greedy": (lambda m: tat.greedy_decode(m, SRC, ~SM, 5, 1), "src_mask leaves"),
    "beam": (lambda m: tat.beam_search(m, SRC, ~SM, 5, 1, 2), "src_mask leaves"),
    "all padded": (lambda m: tat.greedy_decode(m, ALL, HIDES, 5, 1), ONLY),
    "float, padded": (lambda m: tat.greedy_decode(m, ALL, HIDES.float(), 5, 1), ONLY),
    "empty sentence": (lambda m: padded(m, [[1, 5, 6, 2], [PAD] * 4]), EMPTY),
    "rows differ": (lambda m: m(SRC, TGT[:1], SM, TM[:1]), "src has 2 rows, tgt 1"),
    "Batch's differ": (lambda m: tat.Batch(SRC, TGT[:1], pad=PAD), "same number of"),
    "past max_len": (lambda m: model_of(max_len=5).encode(SRC, SM), "max_len=5: make"),
    "mask a list": (lambda m: m.encode(SRC, SM.tolist()), "src_mask must be a tensor"),
    "no batch, encode": (lambda m: m.encode(SRC[0], SM), r"got shape \(6,\); add a"),
    "no batch, forward": (lambda m: m(SRC[0], TGT, SM, TM), r"got shape \(6,\); add"),
    "loss pads otherwise": (padding_mismatch, "padding_idx is 0, the batches' pad 2"),
    "no width": (lambda m: tat.make_optimizer(m.generator), "pass model_size="),
    "h not dividing": (lambda m: tat.MultiHeadedAttention(4, 30), "30 is not divisib"),
    "no heads": (lambda m: tat.MultiHeadedAttention(0, 32), "h must be a positive"),
    "odd d_model": (lambda m: tat.PositionalEncoding(7, 0.1), "d_model=7 is odd"),
    "max_len 0": (lambda m: tat.PositionalEncoding(8, 0, max_len=0), "max_len must"),
}


@pytest.mark.parametrize("call, says", REFUSED.values(), ids=REFUSED)
def test_a_misuse_is_refused_in_one_line_that_says_what_to_do(call, says):
    with pytest.raises((ValueError, TypeError), match=says) as caught:
        call(model_of())
    assert "\n" not in str(caught.value)


def test_the_same_uses_done_right_run_silently_and_alike():
    """The refusals above, corrected; the 2018/2022 notebook's float and integer
    masks, and the fix the messages name, give the book's masks' output."""
    model = model_of()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        padded(model, [[1, PAD, PAD], [1, PAD, PAD]])  # one id shown, one hidden
        padded(model, [[3, 4]] * 2, [[1, 3, PAD], [1, 2, 4]])  # padded at the end
        model_of(max_len=6).encode(SRC, SM)  # exactly max_len
        tat.Batch(SRC, SRC, pad=PAD)  # 2 is a digit here: the pad is given
        tat.Batch(torch.tensor([[1, 5, 2, 2]]), torch.tensor([[1, 5]]))  # 2 at the end
        for decode in (tat.greedy_decode, tat.beam_search):
            assert decode(model, SRC, SM, 5, 1, end_symbol=2).size(0) == 2
        out = model(SRC, TGT, SM, TM)
        for turn in (torch.Tensor.float, torch.Tensor.long, lambda m: ~m == 0):
            assert torch.equal(model(SRC, TGT, turn(SM), turn(TM)), out)
        assert torch.equal(model(SRC, TGT, additive(SM) == 0, additive(TM) == 0), out)
    optimizer, _ = tat.make_optimizer(torch.nn.Linear(3, 3), model_size=3, warmup=10)
    # LambdaLR multiplies base_lr = 1.0 by rate itself: exactly rate.
    assert optimizer.param_groups[0]["lr"] == tat.rate(0, 3, 1.0, 10)


def test_a_batch_whose_pad_is_a_real_token_before_others_warns():
    tgt = torch.tensor([[1, 2, 5, 6]])  # the default pad, 2, before real tokens
    with pytest.warns(UserWarning, match=r"pad=2 comes before a real token in tgt"):
        batch = tat.Batch(torch.tensor([[1, 5]]), tgt)
    assert batch.ntokens == 2  # what it warns of: a token taken for padding


def test_attention_maps_are_each_layers_weights_after_a_forward_pass():
    model = model_of(h=4)
    assert all(w is None for ws in tat.attention_maps(model).values() for w in ws)
    model(SRC, TGT, SM, TM)
    maps = tat.attention_maps(model)
    assert {kind: [tuple(w.shape) for w in ws] for kind, ws in maps.items()} == {
        "encoder_self_attention": [(2, 4, 6, 6)],
        "decoder_self_attention": [(2, 4, 3, 3)],
        "decoder_source_attention": [(2, 4, 3, 6)],
    }
    assert maps["decoder_source_attention"][0] is model.decoder.layers[0].src_attn.attn
    rows = maps["encoder_self_attention"][0].sum(-1)
    # Each query's n = 6 float32 weights sum to 1 within (n + 1) u (the softmax's sum
    # and division) and this sum adds (n - 1) u: 2n = 12 steps from the exact 1.
    atol = 12 * unit_roundoff(torch.float32)
    assert torch.allclose(rows, torch.ones_like(rows), rtol=0, atol=atol)
    assert (maps["encoder_self_attention"][0][0, :, :, 4:] == 0).all()  # padding


def same_weights(model, other):
    ours = tat.without_positional_tables(model.state_dict())
    return all(torch.equal(other.state_dict()[k], w) for k, w in ours.items())


def test_weights_saved_without_positional_tables_load_into_any_max_len(tmp_path):
    model, short = model_of(max_len=5000), model_of(max_len=64)
    torch.save(tat.without_positional_tables(model.state_dict()), tmp_path / "w.pt")
    tables = 2 * 5000 * 32 * 4  # bytes of the two float32 tables left out
    assert (tmp_path / "w.pt").stat().st_size < tables / 4
    state = torch.load(tmp_path / "w.pt", weights_only=True)
    tat.load_weights(short, state)
    assert same_weights(model, short) and short.src_embed[1].pe.shape == (1, 64, 32)
    tat.load_weights(short, model.state_dict())  # with tables, as 2018/2022 saved
    headless = {k: v for k, v in state.items() if "generator" not in k}
    with pytest.raises(RuntimeError, match="Missing key"):
        tat.load_weights(short, headless)


def test_a_saved_model_loads_back_from_its_own_arguments_and_no_others(tmp_path):
    model = model_of(norm_first=False, activation=GELU)
    tat.save_model(model, tmp_path / "m.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt"]  # no .part left
    again = tat.load_model(tmp_path / "m.pt")
    assert again.make_model_args == model.make_model_args and same_weights(model, again)
    assert again.make_model_args["activation"] == "gelu"  # by name: JSON, no code
    saved = torch.load(tmp_path / "m.pt", weights_only=True)  # no pickled objects
    assert not [k for k in saved["weights"] if k.endswith(".pe")]
    short = model_of(norm_first=False, activation=GELU, max_len=9)
    tat.load_model(tmp_path / "m.pt", short)  # its own positional tables' length
    sizes = (
        "^load_model: not the saved model's sizes: h: saved 2, given 4; norm_first: "
    )
    sizes += "saved False, given True; activation: saved 'gelu', given 'relu'.$"
    with pytest.raises(ValueError, match=sizes):  # in one line
        tat.load_model(tmp_path / "m.pt", model_of(h=4))
    torch.save(model_of().state_dict(), tmp_path / "old.pt")  # a plain state dict
    with pytest.warns(UserWarning, match="sizes are unchecked"):
        tat.load_model(tmp_path / "old.pt", model_of(h=4))  # same shapes
    with pytest.raises(ValueError, match="pass model=make_model"):
        tat.load_model(tmp_path / "old.pt")


def test_the_public_names_are_the_library_indexed_documented_and_versioned():
    names = set(tat.__all__)
    assert not [n for n in names if n.startswith(("example_", "chart_", "_"))]
    assert not names & {"show_example", "ChartOutput", "np", "os", "F", "torch"}
    everything = {}
    exec("from the_annotated_transformer import *", everything)
    assert set(everything) - {"__builtins__"} == names
    assert names <= set(re.findall(r"\w+", tat.__doc__))  # the module's index
    things = {name: getattr(tat, name) for name in names}
    bare = [n for n, thing in things.items() if callable(thing) and not thing.__doc__]
    assert bare == []  # every public function and class says what it does
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert tat.__version__ == pyproject["project"]["version"]


def test_importing_the_book_defines_but_runs_nothing():
    """Every top-level statement of the book defines a name, imports, or is an
    example call that does nothing outside the notebook."""
    tree = ast.parse((REPO_ROOT / "the_annotated_transformer.py").read_text("utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            assert ast.unparse(node.value.func) == "show_example", ast.unparse(node)
