"""Tests for checkpoint averaging (Part 5) and the results: BLEU and attention maps.

They follow the order of the book. The averaging tests build their own tiny models
and need no data. The attention tests run a trained model: a smoke-profile model on
300 Multi30k pairs (a few seconds), found through $ANNOTATED_TRANSFORMER_DATA:
without it they are skipped on a laptop, but fail in CI (CI=true). The workshop's
side (averaging checkpoint files, evaluate, reproduce and their commands) is tested
in tests/test_workshop_checkpoints.py, tests/test_workshop_scoring.py,
tests/test_workshop_reproduce.py, tests/test_workshop_reports.py and tests/test_cli.py.
"""

import copy
import functools
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import HANDMADE_PAIRS, SENTENCE, EchoTranslator, point_data_at
from torch import nn

import the_annotated_transformer as tat
from workshop.report import figures
from workshop.translate import translation

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

BOOK = Path(__file__).resolve().parent.parent / "the_annotated_transformer.py"


# ---------------------------------------------------------------------------
# Shared setup


# The smoke run's translator: decoding runs in eval mode, so its attention layers
# keep their weights for the maps.
@pytest.fixture(scope="module")
def translator(trained_checkpoint):
    return translation.load_translator(trained_checkpoint, device="cpu")


def small_model(seed):
    torch.manual_seed(seed)
    return tat.make_model(7, 9, N=1, d_model=16, d_ff=32, h=2)


# ---------------------------------------------------------------------------
# Checkpoint averaging


def test_average_of_k_copies_of_a_model_equals_the_model():
    original = small_model(0)
    copies = [copy.deepcopy(original) for _ in range(3)]
    averaged = tat.average(small_model(1), copies)
    for name, tensor in original.state_dict().items():
        assert torch.equal(averaged.state_dict()[name], tensor), name


def test_average_of_two_models_is_their_element_wise_mean():
    a, b = small_model(1), small_model(2)
    averaged = tat.average(small_model(3), [a, b.state_dict()])  # modules or dicts
    sa, sb, mean = a.state_dict(), b.state_dict(), averaged.state_dict()
    assert not torch.equal(sa["generator.proj.weight"], sb["generator.proj.weight"])
    # average adds in float64, where the sum of two float32 numbers is exact (their
    # exponents lie within 29 bits), halves exactly and rounds once to float32; here
    # float32 rounds the sum once and halves exactly: the same rounding, bit for bit.
    for name in sa:
        assert torch.equal(mean[name], (sa[name] + sb[name]) / 2), name


def test_average_copies_integer_buffers_from_the_first_model():
    norms = [nn.BatchNorm1d(3) for _ in range(3)]
    for i, norm in enumerate(norms[:2]):
        norm.running_mean.fill_(float(i + 1))  # 1 and 2
        norm.num_batches_tracked.fill_(10 * (i + 1))  # 10 and 20
    averaged = tat.average(norms[2], norms[:2])
    assert torch.equal(averaged.running_mean, torch.full((3,), 1.5))
    assert averaged.num_batches_tracked.dtype == torch.long
    assert int(averaged.num_batches_tracked) == 10


def test_average_refuses_no_models_and_models_of_different_shapes():
    with pytest.raises(ValueError, match="at least one"):
        tat.average(small_model(0), [])
    other = tat.make_model(7, 9, N=2, d_model=16, d_ff=32, h=2)
    with pytest.raises(ValueError, match="one architecture"):
        tat.average(small_model(0), [small_model(1), other])


# ---------------------------------------------------------------------------
# BLEU


def test_bleu_scores_a_translator_and_passes_it_the_options(capsys):
    echo = EchoTranslator(dict(HANDMADE_PAIRS))
    score, signature, hypotheses = tat.bleu(
        echo, HANDMADE_PAIRS, decode=tat.beam_search, beam_size=2
    )
    # sacrebleu's float64 100 * exp(mean of four log precisions of 100%): a few
    # roundings, 16u (u = 2^-53) at most.
    assert score.score == pytest.approx(100, rel=16 * 2.0**-53)
    assert hypotheses == [en for _, en in HANDMADE_PAIRS]
    assert "nrefs:1" in str(signature) and "tok:13a" in str(signature)
    sources = [de for de, _ in HANDMADE_PAIRS]
    assert echo.calls == [(sources, 64, {"decode": tat.beam_search, "beam_size": 2})]
    shouting = EchoTranslator({de: en.upper() for de, en in HANDMADE_PAIRS})
    # Cased: only tokens without lower-case letters ("A", ".") match, 2.9 here,
    # where a case-blind BLEU gives 100.
    assert tat.bleu(shouting, HANDMADE_PAIRS)[0].score < 10.0


# ---------------------------------------------------------------------------
# Attention maps


def chart_axes(spec):
    """(rows in order, columns in order, data rows) of an attention chart's spec (a
    faceted one's inner chart). Its axes keep the table's order (sort None), which
    is the order in which labels first come in the data."""
    encoding = spec.get("spec", spec)["encoding"]
    assert (encoding["y"]["field"], encoding["x"]["field"]) == ("query", "key")
    assert encoding["y"]["sort"] is None and encoding["x"]["sort"] is None
    (values,) = spec["datasets"].values()
    rows = list(dict.fromkeys(v["query"] for v in values))
    return rows, list(dict.fromkeys(v["key"] for v in values)), values


# A float32 softmax's n weights sum to 1 within (n + 1) u (its sum of n and the
# division; rounding the exponentials cancels out of the quotients), u = 2^-24; the
# charts keep the float32 values, which row_sums adds in float64: 2u per key bounds it.
SOFTMAX_SUM_ATOL = 2 * 2.0**-24


def labels(tokens):
    return [f"{i}:{token}" for i, token in enumerate(tokens)]


@pytest.fixture(scope="module")
def expected_tokens(translator):
    """The source tokens the model sees and the decoder's inputs, found without
    the attention code: encode, and decode_ids for the greedy output."""
    src_ids = translator.encode([SENTENCE])[0]
    output = translator.vocab_tgt.lookup_tokens(
        tat.decode_ids(translator.model, [src_ids])[0]
    )
    return translator.vocab_src.lookup_tokens(src_ids), ["<s>", *output]


@pytest.fixture(scope="module")
def maps(translator):
    """The workshop's three maps of layer 0 (for the attention command), as specs."""
    charts = figures.attention_maps(translator, SENTENCE, layer=0)
    return {kind: chart.to_dict() for kind, chart in charts.items()}


def row_sums(values):
    sums = {}
    for v in values:
        sums[v["head"], v["query"]] = (
            sums.get((v["head"], v["query"]), 0.0) + v["weight"]
        )
    return sums


def test_encoder_self_attention_chart_has_source_tokens_as_rows_and_columns(
    maps, expected_tokens
):
    source, _ = expected_tokens
    rows, cols, values = chart_axes(maps["encoder_self_attention"])
    assert rows == cols == labels(source)
    assert {v["query"] for v in values} == {v["key"] for v in values} == set(rows)
    assert {v["head"] for v in values} == {0, 1}
    for total in row_sums(values).values():  # each query's weights sum to 1
        assert total == pytest.approx(1.0, abs=SOFTMAX_SUM_ATOL * len(cols))


def test_decoder_self_attention_chart_has_target_tokens_on_both_axes_and_is_causal(
    maps, expected_tokens
):
    _, target = expected_tokens
    rows, cols, values = chart_axes(maps["decoder_self_attention"])
    assert rows == cols == labels(target)
    position = {label: i for i, label in enumerate(rows)}
    for v in values:  # a query never attends to a later key
        if position[v["key"]] > position[v["query"]]:
            assert v["weight"] == 0.0
    for total in row_sums(values).values():
        assert total == pytest.approx(1.0, abs=SOFTMAX_SUM_ATOL * len(cols))


def test_decoder_source_attention_chart_has_target_rows_and_source_columns(
    maps, expected_tokens
):
    source, target = expected_tokens
    rows, cols, values = chart_axes(maps["decoder_source_attention"])
    assert rows == labels(target) and cols == labels(source)
    assert {v["query"] for v in values} == set(rows)
    assert {v["key"] for v in values} == set(cols)
    assert len(values) == 2 * len(rows) * len(cols)  # two heads
    for total in row_sums(values).values():
        assert total == pytest.approx(1.0, abs=SOFTMAX_SUM_ATOL * len(cols))


def test_attention_labels_keep_repeated_words_apart_in_sentence_order(expected_tokens):
    source, _ = expected_tokens
    assert source.count("Hund") == 2  # the sentence says "Hund" twice
    weights = torch.full((1, 3, 3), 1 / 3)
    found = {"encoder_self_attention": ([weights], ["a", "b", "a"], ["a", "b", "a"])}
    table = tat.attention_table(found)
    rows, cols, values = chart_axes(tat.chart_attention(table).to_dict())
    assert rows == cols == ["0:a", "1:b", "2:a"]
    assert len(values) == 9


def test_the_attention_explorer_has_a_menu_for_kind_layer_and_head(translator):
    table = tat.attention_table(tat.attention_weights(translator, SENTENCE))
    spec = tat.chart_attention_explorer(table).to_dict()
    menus = {p["name"]: p for p in spec["params"]}
    assert list(menus) == ["pick_kind", "pick_layer", "pick_head"]
    kinds = ["encoder_self_attention", "decoder_self_attention"]
    assert menus["pick_kind"]["bind"]["options"] == [*kinds, "decoder_source_attention"]
    assert menus["pick_layer"]["bind"]["options"] == [0]  # smoke: one layer
    assert menus["pick_head"]["bind"]["options"] == [0, 1]
    # The first of each is shown first: encoder self-attention, layer 0, head 0.
    assert [m["value"] for m in menus.values()] == ["encoder_self_attention", 0, 0]
    (shown,) = spec["transform"]
    assert shown["filter"] == (
        "datum.kind == pick_kind && datum.layer == pick_layer && "
        "datum.head == pick_head"
    )


def test_attention_maps_of_chosen_heads_and_a_negative_layer(translator):
    charts = figures.attention_maps(translator, SENTENCE, layer=-1, heads=[1])
    spec = charts["decoder_source_attention"].to_dict()
    assert spec["title"] == "Decoder–source attention, layer 0"  # smoke: one layer
    (values,) = spec["datasets"].values()
    assert {v["head"] for v in values} == {1}


def test_attention_maps_refuse_a_layer_or_head_that_does_not_exist(translator):
    with pytest.raises(ValueError, match="layer must be in 0..0"):
        figures.attention_maps(translator, SENTENCE, layer=1)
    with pytest.raises(ValueError, match="heads must be in 0..1"):
        figures.attention_maps(translator, SENTENCE, heads=[2])


def test_the_all_heads_grid_has_a_panel_per_layer_and_head_holding_its_weights(
    translator,
):
    found = tat.attention_weights(translator, SENTENCE)
    table = tat.attention_table(found)
    for kind, (layers, queries, keys) in found.items():
        spec = tat.chart_attention_heads(table, kind).to_dict()
        facet = spec["facet"]
        assert (facet["row"]["field"], facet["column"]["field"]) == ("layer", "head")
        rows, cols, values = chart_axes(spec)
        assert rows == labels(queries) and cols == labels(keys)
        assert {v["kind"] for v in values} == {kind}
        shape = len(layers), *layers[0].shape  # (layers, heads, queries, keys)
        panels = {(v["layer"], v["head"]) for v in values}
        assert panels == {(i, h) for i in range(shape[0]) for h in range(shape[1])}
        assert len(values) == math.prod(shape)  # every weight, once
        weights = torch.stack([w.float() for w in layers])
        for v in values:  # each cell holds its layer's, head's, query's, key's weight
            i, j = (int(v[axis].split(":")[0]) for axis in ("query", "key"))
            assert v["weight"] == weights[v["layer"], v["head"], i, j].item()
        sums = {}
        for v in values:
            key = v["layer"], v["head"], v["query"]
            sums[key] = sums.get(key, 0.0) + v["weight"]
        for total in sums.values():  # each query's weights sum to 1
            assert total == pytest.approx(1.0, abs=SOFTMAX_SUM_ATOL * len(cols))


def test_the_all_heads_example_draws_a_grid_for_each_kind_and_nothing_without_a_model(
    translator, capsys
):
    assert tat.example_attention_heads(None) is None
    assert capsys.readouterr().out == ""
    spec = tat.example_attention_heads(translator, SENTENCE).to_dict()
    titles = [grid["title"] for grid in spec["vconcat"]]
    assert titles == [
        "Encoder self attention",
        "Decoder self attention",
        "Decoder source attention",
    ]


def largest_score_size(model, run):
    """The largest sum_d |q_d k_d| / sqrt(d_k) of a score of any of `model`'s
    attention layers while run() runs: what its scores' rounding scales with."""
    sizes = []

    def keep(layer, inputs):
        q, k = (
            lin(x).view(x.size(0), -1, layer.h, layer.d_k).transpose(1, 2)
            for lin, x in zip(layer.linears, inputs[:2], strict=False)
        )
        products = q.abs() @ k.abs().transpose(-2, -1)
        sizes.append(products.max().item() / math.sqrt(layer.d_k))

    layers = [m for m in model.modules() if isinstance(m, tat.MultiHeadedAttention)]
    hooks = [layer.register_forward_pre_hook(keep) for layer in layers]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return max(sizes)


def test_attention_weights_are_those_of_each_greedy_step(translator):
    found = tat.attention_weights(translator, SENTENCE)
    model = translator.model
    src = torch.tensor([translator.encode([SENTENCE])[0]])
    src_mask = tat.padding_mask(src, tat.PAD)
    decoder_self, target, _ = found["decoder_self_attention"]
    decoder_source = found["decoder_source_attention"][0]
    ids = translator.vocab_tgt(target)
    k = min(3, len(ids))  # the decoder as it was at step k: only k inputs
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        prefix = torch.tensor([ids[:k]])
        causal = tat.subsequent_mask(k)
        step = functools.partial(model.decode, memory, src_mask, prefix, causal)
        size = largest_score_size(model, step)
    layer = model.decoder.layers[0]
    step_self, step_source = layer.self_attn.attn[0], layer.src_attn.attn[0]
    # The step and the whole pass run layer 0 on the same first k rows, in products
    # of other shapes, so their float32 roundings may differ: to first order, as
    # tests/test_part4_decoding.py's float32_tolerance bounds a decoder step, up to
    # eps = 2^-23 of the largest size handled for each of a layer's 16 operations,
    # here the scores' (at most `size`); a softmax turns score errors into relative
    # weight errors of twice them, on weights of at most 1.
    close = dict(rtol=0, atol=2 * 16 * torch.finfo(torch.float32).eps * size)
    torch.testing.assert_close(step_self, decoder_self[0][:, :k, :k], **close)
    torch.testing.assert_close(step_source, decoder_source[0][:, :k], **close)


def test_attention_weights_restore_the_models_settings(translator):
    model = translator.model
    model.train()
    try:
        tat.attention_weights(translator, SENTENCE)
        assert model.training
    finally:
        model.eval()


def test_decoding_keeps_the_weights_and_a_training_step_keeps_none():
    """The two ways of MultiHeadedAttention: eval mode (decoding, the maps) keeps
    every layer's weights in .attn; training mode's fused kernel keeps none."""
    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    layers = [m for m in model.modules() if isinstance(m, tat.MultiHeadedAttention)]
    src = torch.tensor([[1, 4, 5, 6]])
    tat.greedy_decode(model, src, tat.padding_mask(src, 0), 5, 1)
    assert all(m.attn is not None for m in layers)
    for m in layers:
        m.attn = None
    model.train()(src, src, tat.padding_mask(src, 0), tat.subsequent_mask(4))
    assert all(m.attn is None for m in layers)


# ---------------------------------------------------------------------------
# Without data, and the committed results


@pytest.mark.parametrize("folder", [None, "empty"])
@pytest.mark.parametrize(
    "example",
    [
        "example_multi30k",
        "example_subwords",
        "example_results",
        "example_attention_maps",
    ],
)
def test_data_examples_without_data_say_what_is_missing_and_how_to_get_it(
    example, folder, tmp_path, monkeypatch, capsys
):
    """The notebook's Part 3 and later cells still run without Multi30k: they skip."""
    point_data_at(folder, tmp_path, monkeypatch)

    def no_training(*args, **kwargs):
        raise AssertionError(f"{example} trained a model without data")

    monkeypatch.setattr(tat, "train_translator", no_training)
    data_dir = tat.notebook_data_dir()  # the notebook's cells, in order
    translator = tat.example_train_translator(data_dir)
    said = capsys.readouterr().out
    assert tat.DATA_ENV in said and said.count("\n") == 1  # one line
    assert getattr(tat, example)(translator, data_dir) is None
    assert capsys.readouterr().out.count("\n") <= 1  # nothing, or one line more


# ---------------------------------------------------------------------------
# The paper's Table 2, and what the book says about it


def table_2(book):
    """The rows of the book's copy of the paper's Table 2: model -> (BLEU En-De,
    BLEU En-Fr, cost En-De, cost En-Fr)."""
    rows = {}
    for line in book.splitlines():
        cells = [c.strip() for c in line.removeprefix("# ").strip("|").split("|")]
        if len(cells) == 5 and "10^{" in cells[3]:
            costs = [
                float(m.group(1)) * 10 ** int(m.group(2))
                for m in (
                    re.search(r"([\d.]+) \\cdot 10\^\{(\d+)\}", c) for c in cells[3:]
                )
            ]
            rows[cells[0]] = (float(cells[1]), float(cells[2]), *costs)
    return rows


def test_the_papers_costs_follow_from_its_hardware_and_the_books_ratios_from_them():
    """Table 2's costs of the Transformer are training time x 8 GPUs x 9.5 TFLOPS
    (§5.2's times), and the book's sentence about the table holds: the big model
    beat every earlier one in both directions, the base model En-De only, at less
    than half of every earlier En-De model's cost."""
    book = BOOK.read_text(encoding="utf-8")
    rows = table_2(book)
    assert len(rows) == 5
    base, big = rows["Transformer, base"], rows["Transformer, big"]
    per_hour = 3600 * 8 * 9.5e12
    # Costs compared to the two significant digits the paper prints them with.
    assert f"{12 * per_hour:.1e}" == f"{base[2]:.1e}" == f"{base[3]:.1e}"
    assert f"{3.5 * 24 * per_hour:.1e}" == f"{big[2]:.1e}" == f"{big[3]:.1e}"
    earlier = [rows[m] for m in ("GNMT + RL", "ConvS2S", "MoE")]
    assert all(big[0] > r[0] and big[1] > r[1] for r in earlier)  # beat in both
    assert all(base[0] > r[0] for r in earlier) and any(base[1] < r[1] for r in earlier)
    assert all(base[2] < r[2] / 2 for r in earlier)  # a fraction, En-De
    text = book.replace("\n# ", " ")  # prose unwrapped
    assert "the base model on English→German only, at a fraction of their cost" in text


# ---------------------------------------------------------------------------
# The reader's own score, beside what the book says to expect


def test_the_books_expected_scores_are_docs_results():
    """Part 5 tells the reader what to expect: the quick profile's greedy score as
    docs/results.md records the notebook's run of it, and the multi30k recipe's test
    scores from its table; the example prints the same numbers."""
    book = BOOK.read_text(encoding="utf-8").replace("\n# ", " ")  # prose unwrapped
    results = (BOOK.parent / "docs" / "results.md").read_text(encoding="utf-8")
    quick = re.search(r"the notebook's own run of it scores ([\d.]+) greedy", results)
    quick = float(quick.group(1))
    recipe = re.search(r"\| `multi30k` \|.*\| ([\d.]+) \| ([\d.]+) \(beam", results)
    greedy, beam = recipe.groups()
    stated = f"expect **about {round(quick)}** (docs/results.md: {quick:.2f} for"
    assert stated in book
    assert f"**{greedy}** greedy and **{beam}** with beam search" in book
    printed = f"about {round(quick)} with quick; make multi30k: {greedy} greedy, {beam}"
    assert printed in book


def test_the_results_example_prints_the_models_score_beside_the_expectation(
    translator, multi30k_dir, capsys, monkeypatch
):
    monkeypatch.setattr(tat, "PROFILE", "smoke")  # the first 100 test pairs
    assert tat.example_results(None, None) is None
    assert capsys.readouterr().out == ""
    tat.example_results(translator, multi30k_dir)
    said = capsys.readouterr().out.splitlines()
    pairs = tat.read_split(multi30k_dir, "test_2016_flickr")[:100]
    score, signature, _ = tat.bleu(translator, pairs, decode=tat.cached_greedy_decode)
    assert said[0] == f"Your smoke model, test 2016, greedy: {score.score:.2f} BLEU"
    assert said[1].startswith("Expected: about 26 with quick")
    assert said[2] == f"  signature: {signature}"
