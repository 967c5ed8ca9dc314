"""Tests for Part 5 of the book: BLEU, the paper's Table 2, the reader's score and
attention maps.

The attention tests run the smoke-profile model on 300 Multi30k pairs (conftest's
`translator`), found through $ANNOTATED_TRANSFORMER_DATA: without it they are
skipped on a laptop, but fail in CI (CI=true). The workshop's side (evaluate,
reproduce, the attention command) is tested in tests/test_workshop_*.py and
tests/test_workshop_cli.py.
"""

import functools
import re
from pathlib import Path

import pytest
import torch
from conftest import HANDMADE_PAIRS, SENTENCE, EchoTranslator
from tolerance import rounding_tolerance

import the_annotated_transformer as tat
from workshop.report import figures

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

BOOK = Path(__file__).resolve().parent.parent / "the_annotated_transformer.py"


def test_bleu_scores_a_translator_cased_and_passes_it_the_options():
    echo = EchoTranslator(dict(HANDMADE_PAIRS))
    options = {"decode": tat.beam_search, "beam_size": 2}
    score, signature, hypotheses = tat.bleu(echo, HANDMADE_PAIRS, **options)
    # 100 * exp(the mean of four log precisions of 1): under 8 float64 roundings.
    tolerance = rounding_tolerance(8, 100, torch.double)
    assert score.score == pytest.approx(100, abs=tolerance)
    assert hypotheses == [en for _, en in HANDMADE_PAIRS]
    assert "nrefs:1" in str(signature) and "tok:13a" in str(signature)
    assert echo.calls == [([de for de, _ in HANDMADE_PAIRS], 64, options)]
    shouting = EchoTranslator({de: en.upper() for de, en in HANDMADE_PAIRS})
    # Cased: only tokens without lower-case letters ("A", ".") match: 2.9 here.
    assert tat.bleu(shouting, HANDMADE_PAIRS)[0].score < 10.0


# ---------------------------------------------------------------------------
# The paper's Table 2, and the reader's own score beside what the book expects


def test_the_papers_costs_follow_from_its_hardware_and_the_books_ratios_from_them():
    """Table 2's costs of the Transformer are training time x 8 GPUs x 9.5 TFLOPS
    (§5.2's times), and the book's sentence about the table holds: the big model
    beat every earlier one in both directions, the base model En-De only, at less
    than half of every earlier En-De model's cost."""
    book = BOOK.read_text(encoding="utf-8")
    rows = {}  # model -> (BLEU En-De, BLEU En-Fr, cost En-De, cost En-Fr)
    for line in book.splitlines():
        cells = [c.strip() for c in line.removeprefix("# ").strip("|").split("|")]
        if len(cells) == 5 and "10^{" in cells[3]:
            costs = [re.search(r"([\d.]+) \\cdot 10\^\{(\d+)\}", c) for c in cells[3:]]
            costs = [float(m[1]) * 10 ** int(m[2]) for m in costs]
            rows[cells[0]] = (float(cells[1]), float(cells[2]), *costs)
    base, big = rows.pop("Transformer, base"), rows.pop("Transformer, big")
    per_hour = 3600 * 8 * 9.5e12  # compared to the paper's two significant digits
    assert f"{12 * per_hour:.1e}" == f"{base[2]:.1e}" == f"{base[3]:.1e}"
    assert f"{3.5 * 24 * per_hour:.1e}" == f"{big[2]:.1e}" == f"{big[3]:.1e}"
    earlier = list(rows.values())
    assert len(earlier) == 3 and all(big[0] > r[0] and big[1] > r[1] for r in earlier)
    assert all(base[0] > r[0] for r in earlier) and any(base[1] < r[1] for r in earlier)
    assert all(base[2] < r[2] / 2 for r in earlier)  # a fraction, En-De
    text = book.replace("\n# ", " ")  # prose unwrapped
    assert "the base model on English→German only, at a fraction of their cost" in text


def test_the_books_expected_scores_are_docs_results():
    """Part 5 tells the reader what to expect: the quick profile's greedy score as
    docs/results.md records the notebook's run of it, and the multi30k recipe's test
    scores from its table; the example prints the same numbers."""
    book = BOOK.read_text(encoding="utf-8").replace("\n# ", " ")  # prose unwrapped
    results = (BOOK.parent / "docs" / "results.md").read_text(encoding="utf-8")
    quick = float(re.search(r"own run of it scores ([\d.]+) greedy", results)[1])
    recipe = re.search(r"\| `multi30k` \|.*\| ([\d.]+) \| ([\d.]+) \(beam", results)
    greedy, beam, about = *recipe.groups(), f"about {round(quick)}"
    assert f"expect **{about}** (docs/results.md: {quick:.2f} for" in book
    assert f"**{greedy}** greedy and **{beam}** with beam search" in book
    assert f"{about} with quick; make multi30k: {greedy} greedy, {beam}" in book


def test_the_results_example_prints_the_models_score_beside_the_expectation(
    translator, multi30k_dir, capsys, monkeypatch
):
    monkeypatch.setattr(tat, "PROFILE", "smoke")  # the first 100 test pairs
    tat.example_results(translator, multi30k_dir)
    said = capsys.readouterr().out.splitlines()
    pairs = tat.read_split(multi30k_dir, "test_2016_flickr")[:100]
    score, signature, _ = tat.bleu(translator, pairs, decode=tat.cached_greedy_decode)
    assert said[0] == f"Your smoke model, test 2016, greedy: {score.score:.2f} BLEU"
    assert said[1].startswith("Expected: about 26 with quick")
    assert said[2] == f"  signature: {signature}"


# ---------------------------------------------------------------------------
# Attention maps


def chart_axes(spec):
    """(rows in order, columns in order, data rows) of an attention chart's spec (a
    faceted one's inner chart). Its axes keep the table's order (sort None), which
    is the order in which labels first come in the data."""
    x, y = (spec.get("spec", spec)["encoding"][axis] for axis in "xy")
    fields = (y["field"], x["field"], y["sort"], x["sort"])
    assert fields == ("query", "key", None, None)
    (values,) = spec["datasets"].values()
    rows, cols = (list(dict.fromkeys(v[a] for v in values)) for a in ("query", "key"))
    return rows, cols, values


def labels(tokens):
    return [f"{i}:{token}" for i, token in enumerate(tokens)]


def test_the_all_heads_grids_hold_every_weight_under_its_tokens(translator):
    """The source tokens and the greedy output are found here without the attention
    code (labels keep the sentence's two "Hund" apart); each cell holds its layer's,
    head's, query's and key's weight, each query's weights sum to 1, and none goes
    to a later position in the decoder's self-attention."""
    src_ids = translator.encode([SENTENCE])[0]
    output = tat.decode_ids(translator.model, [src_ids])[0]
    assert len(set(src_ids)) < len(src_ids)  # a repeated word, the labels tell apart
    source = labels(translator.vocab_src.lookup_tokens(src_ids))
    target = labels(["<s>", *translator.vocab_tgt.lookup_tokens(output)])
    expected = [(source, source), (target, target), (target, source)]
    found = tat.attention_weights(translator, SENTENCE)
    table = tat.attention_table(found)
    grids = tat.example_attention_heads(translator, SENTENCE).to_dict()["vconcat"]
    for grid, kind, axes in zip(grids, found, expected, strict=True):
        assert grid["title"] == kind.replace("_", " ").capitalize()
        spec = tat.chart_attention_heads(table, kind).to_dict()
        facets = [spec["facet"][facet]["field"] for facet in ("row", "column")]
        assert facets == ["layer", "head"]
        rows, cols, values = chart_axes(spec)
        assert (rows, cols) == axes and {v["kind"] for v in values} == {kind}
        weights = torch.stack([w.float() for w in found[kind][0]])  # layer, head, q, k
        assert len(values) == weights.numel()
        for v in values:
            i, j = (int(v[axis].split(":")[0]) for axis in ("query", "key"))
            assert v["weight"] == weights[v["layer"], v["head"], i, j].item()
            assert v["weight"] == 0.0 or kind != "decoder_self_attention" or j <= i
        sums = weights.double().sum(-1)  # a float32 softmax: n + 1 roundings of 1
        tolerance = rounding_tolerance(len(cols) + 1, 1.0)
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=tolerance, rtol=0)


def test_attention_maps_of_chosen_heads_and_a_negative_layer(translator):
    charts = figures.attention_maps(translator, SENTENCE, layer=-1, heads=[1])
    source = translator.vocab_src.lookup_tokens(translator.encode([SENTENCE])[0])
    spec = charts["decoder_source_attention"].to_dict()
    assert spec["title"] == "Decoder–source attention, layer 0"  # smoke: one layer
    _, cols, values = chart_axes(spec)
    assert cols == labels(source) and {v["head"] for v in values} == {1}


def test_the_attention_explorer_has_a_menu_for_kind_layer_and_head(translator):
    spec = tat.example_attention_maps(translator, SENTENCE).to_dict()
    menus = {p["name"]: p for p in spec["params"]}
    names = ("kind", "layer", "head")
    options = [menus[f"pick_{name}"]["bind"]["options"] for name in names]
    kinds = ["encoder_self_attention", "decoder_self_attention"]
    assert options == [[*kinds, "decoder_source_attention"], [0], [0, 1]]  # smoke
    assert [m["value"] for m in menus.values()] == [kinds[0], 0, 0]  # the first shown
    (shown,) = spec["transform"]
    assert all(f"datum.{name} == pick_{name}" in shown["filter"] for name in names)


def largest_score_size(model, run):
    """The largest sum_d |q_d k_d| / sqrt(d_k) of a score of any of `model`'s
    attention layers while run() runs: what its scores' rounding scales with."""
    sizes = []

    def keep(layer, inputs):
        if isinstance(layer, tat.MultiHeadedAttention):
            pairs = zip(layer.linears[:2], inputs[:2], strict=True)
            q, k = (layer.heads(linear, x).abs() for linear, x in pairs)
            sizes.append((q @ k.transpose(-2, -1)).max().item() / layer.d_k**0.5)

    with torch.nn.modules.module.register_module_forward_pre_hook(keep):
        run()
    return max(sizes)


def test_attention_weights_are_each_greedy_steps_and_keep_the_mode(translator):
    model = translator.model.train()
    try:
        found = tat.attention_weights(translator, SENTENCE)
        assert model.training  # the mode it found, restored
    finally:
        model.eval()
    src = torch.tensor([translator.encode([SENTENCE])[0]])
    src_mask = tat.padding_mask(src, tat.PAD)
    decoder_self, target, _ = found["decoder_self_attention"]
    source = found["decoder_source_attention"][0]
    k = min(3, len(target))  # the decoder as it was at step k: only k inputs
    prefix = torch.tensor([translator.vocab_tgt(target)[:k]])
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        step = functools.partial(model.decode, memory, src_mask, prefix)
        size = largest_score_size(model, lambda: step(tat.subsequent_mask(k)))
    layer = model.decoder.layers[0]
    # The step and the whole pass run layer 0 on the same first k rows, in products
    # of other shapes: up to 16 float32 roundings (a decoder layer's operations) of
    # scores of at most `size`, which a softmax turns into twice that in the weights.
    close = dict(rtol=0, atol=2 * rounding_tolerance(16, size))
    attn = layer.self_attn.attn[0]
    torch.testing.assert_close(attn, decoder_self[0][:, :k, :k], **close)
    torch.testing.assert_close(layer.src_attn.attn[0], source[0][:, :k], **close)


def test_a_training_step_keeps_no_attention_weights():
    """Training mode's fused kernel keeps none in .attn (decoding, in eval mode,
    keeps every layer's: the test above reads them)."""
    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2).train()
    src = torch.tensor([[1, 4, 5, 6]])
    model(src, src, tat.padding_mask(src, 0), tat.subsequent_mask(4))
    layers = [m for m in model.modules() if isinstance(m, tat.MultiHeadedAttention)]
    assert layers and all(m.attn is None for m in layers)
