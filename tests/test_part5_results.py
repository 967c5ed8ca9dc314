"""Tests for checkpoint averaging (Part 5) and the results: BLEU and attention maps.

They follow the order of the book. The averaging tests and most command-line tests
build their own tiny checkpoints and need no data. The BLEU and attention tests that
run a trained model train a smoke-profile model on 300 Multi30k pairs (a few seconds),
found through $ANNOTATED_TRANSFORMER_DATA: without it they are skipped on a laptop,
but fail in CI (CI=true).
"""

import copy
import gzip
from pathlib import Path

import pytest
import torch
from conftest import point_data_at
from torch import nn

import the_annotated_transformer as tat
from workshop import cli, results, runs

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

WORDS = ["a", "dog", "runs", "."]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SENTENCE = "Ein Hund läuft im Schnee und ein Hund schläft."


# ---------------------------------------------------------------------------
# Shared setup


@pytest.fixture(scope="module")
def trained_checkpoint(multi30k_dir, tmp_path_factory):
    """last.pt of a one-epoch smoke-profile run on 300 training pairs."""
    out = tmp_path_factory.mktemp("smoke")
    config = runs.RunConfig.from_profile("smoke", max_train_pairs=300)
    runs.train_model(config, multi30k_dir, out, quiet=True)
    return out / "last.pt"


@pytest.fixture(scope="module")
def translator(trained_checkpoint):
    return runs.load_translator(trained_checkpoint, device="cpu")


def write_split(folder, name, pairs):
    """Write (German, English) pairs as NAME.de.gz and NAME.en.gz in `folder`."""
    for lang, side in (("de", 0), ("en", 1)):
        with gzip.open(Path(folder) / f"{name}.{lang}.gz", "wt", encoding="utf-8") as f:
            f.writelines(pair[side] + "\n" for pair in pairs)


@pytest.fixture(scope="module")
def mini_split(multi30k_dir, tmp_path_factory):
    """A folder whose split `mini` is the first 20 validation pairs: (folder, pairs)."""
    folder = tmp_path_factory.mktemp("mini")
    pairs = tat.read_split(multi30k_dir, "val")[:20]
    write_split(folder, "mini", pairs)
    return folder, pairs


def tiny_checkpoint(path, seed, epoch=0, words=WORDS, **overrides):
    """Save a random smoke-sized model in the format of training's epoch_NNN.pt."""
    config = runs.RunConfig.from_profile("smoke", **overrides)
    vocab = list(tat.SPECIALS) + list(words)
    torch.manual_seed(seed)
    model = tat.make_model(
        len(vocab),
        len(vocab),
        N=config.N,
        d_model=config.d_model,
        d_ff=config.d_ff,
        h=config.h,
        norm_first=config.norm_first,
    )
    state = {
        "model": runs._weights_only(model.state_dict()),
        "config": config.to_dict(),
        "epoch": epoch,
        "vocab_src": vocab,
        "vocab_tgt": vocab,
    }
    runs.save_checkpoint(path, state)
    return state


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
    for name in sa:
        torch.testing.assert_close(
            mean[name], (sa[name] + sb[name]) / 2, rtol=0, atol=1e-7
        )


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


def test_average_checkpoints_saves_the_mean_in_the_epoch_checkpoint_format(tmp_path):
    first = tiny_checkpoint(tmp_path / "epoch_004.pt", seed=1, epoch=3)
    second = tiny_checkpoint(tmp_path / "epoch_005.pt", seed=2, epoch=4)
    paths = [tmp_path / "epoch_004.pt", tmp_path / "epoch_005.pt"]
    model = runs.average_checkpoints(paths, tmp_path / "average.pt")
    saved = runs.load_checkpoint(tmp_path / "average.pt")
    assert saved["config"] == first["config"] and saved["epoch"] == 4
    assert saved["vocab_src"] == saved["vocab_tgt"] == first["vocab_src"]
    assert set(saved["model"]) == set(first["model"])  # no .pe tables stored
    for name, tensor in saved["model"].items():
        mean = (first["model"][name] + second["model"][name]) / 2
        torch.testing.assert_close(tensor, mean, rtol=0, atol=1e-7)
        assert torch.equal(model.state_dict()[name], tensor), name
    rebuilt, *_ = runs.model_from_checkpoint(saved)
    assert torch.equal(rebuilt.generator.proj.weight, model.generator.proj.weight)
    assert not list(tmp_path.glob(".*tmp*"))  # the atomic write left nothing behind


def test_average_checkpoints_accepts_a_run_resumed_with_more_epochs(tmp_path):
    tiny_checkpoint(tmp_path / "a.pt", seed=1, epochs=3)
    tiny_checkpoint(tmp_path / "b.pt", seed=2, epochs=5)
    runs.average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "m.pt")
    assert (tmp_path / "m.pt").is_file()


def test_average_checkpoints_refuses_checkpoints_with_different_settings(tmp_path):
    tiny_checkpoint(tmp_path / "a.pt", seed=1)
    tiny_checkpoint(tmp_path / "b.pt", seed=2, d_ff=128)
    with pytest.raises(tat.DataError, match=r"d_ff=64 vs 128"):
        runs.average_checkpoints(
            [tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "m.pt"
        )
    assert not (tmp_path / "m.pt").exists()


def test_average_checkpoints_refuses_checkpoints_with_different_vocabularies(tmp_path):
    tiny_checkpoint(tmp_path / "a.pt", seed=1)
    tiny_checkpoint(tmp_path / "b.pt", seed=2, words=["a", "cat", "runs", "."])
    with pytest.raises(tat.DataError, match="vocab_src vocabularies"):
        runs.average_checkpoints(
            [tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "m.pt"
        )


def test_average_command_writes_the_averaged_checkpoint_and_returns_0(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "a.pt", seed=1)
    tiny_checkpoint(tmp_path / "b.pt", seed=2)
    argv = ["average", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]
    assert cli.main([*argv, "--out", str(tmp_path / "m.pt")]) == 0
    assert "averaged 2 checkpoints" in capsys.readouterr().out
    assert set(runs.load_checkpoint(tmp_path / "m.pt")) >= set(runs.CHECKPOINT_KEYS)


def test_average_command_returns_2_naming_a_missing_or_mismatched_checkpoint(
    tmp_path, capsys
):
    tiny_checkpoint(tmp_path / "a.pt", seed=1)
    out = ["--out", str(tmp_path / "m.pt")]
    assert (
        cli.main(["average", str(tmp_path / "a.pt"), str(tmp_path / "x.pt"), *out]) == 2
    )
    assert "x.pt" in capsys.readouterr().err
    tiny_checkpoint(tmp_path / "b.pt", seed=2, h=4)
    assert (
        cli.main(["average", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), *out]) == 2
    )
    assert "h=2 vs 4" in capsys.readouterr().err
    assert not (tmp_path / "m.pt").exists()


# ---------------------------------------------------------------------------
# BLEU


class EchoTranslator:
    """Stands in for a Translator: answers each source with a fixed sentence."""

    def __init__(self, answers):
        self.answers = answers
        self.calls = []

    def translate(self, sentences, batch_size=64, **options):
        self.calls.append((list(sentences), batch_size, options))
        return [self.answers[s] for s in sentences]


HANDMADE_PAIRS = [
    ("Ein Hund läuft über die Wiese.", "A dog is running across the meadow."),
    ("Zwei Männer spielen Fußball.", "Two men are playing soccer."),
    ("Eine Frau liest ein Buch im Park.", "A woman reads a book in the park."),
]


def test_sacrebleu_scores_the_references_against_themselves_as_100(tmp_path, capsys):
    import sacrebleu

    references = [en for _, en in HANDMADE_PAIRS]
    assert sacrebleu.corpus_bleu(references, [references]).score == pytest.approx(100)
    write_split(tmp_path, "handmade", HANDMADE_PAIRS)
    echo = EchoTranslator(dict(HANDMADE_PAIRS))
    result = results.evaluate(echo, tmp_path, "handmade", beam_size=3, batch_size=2)
    beam_3 = {"decode": tat.beam_search, "beam_size": 3, "alpha": 0.6}
    assert echo.calls == [([de for de, _ in HANDMADE_PAIRS], 2, beam_3)]
    assert result["bleu"] == pytest.approx(100)
    assert result["bleu_lowercase_spacy"] == pytest.approx(100)
    assert (result["n"], result["beam_size"], result["split"]) == (3, 3, "handmade")
    printed = capsys.readouterr().out
    assert "BLEU = 100.00" in printed and "nrefs:1|case:mixed" in printed


def test_greedy_evaluation_decodes_with_the_key_value_cache(tmp_path):
    write_split(tmp_path, "handmade", HANDMADE_PAIRS)
    echo = EchoTranslator(dict(HANDMADE_PAIRS))
    results.evaluate(echo, tmp_path, "handmade", quiet=True)
    assert [options for *_, options in echo.calls] == [
        {"decode": tat.cached_greedy_decode}
    ]


def test_bleu_scores_a_translator_and_passes_it_the_options(capsys):
    echo = EchoTranslator(dict(HANDMADE_PAIRS))
    score, signature, hypotheses = tat.bleu(
        echo, HANDMADE_PAIRS, decode=tat.beam_search, beam_size=2
    )
    assert score.score == pytest.approx(100)
    assert hypotheses == [en for _, en in HANDMADE_PAIRS]
    assert "nrefs:1" in str(signature) and "tok:13a" in str(signature)
    sources = [de for de, _ in HANDMADE_PAIRS]
    assert echo.calls == [(sources, 64, {"decode": tat.beam_search, "beam_size": 2})]
    shouting = EchoTranslator({de: en.upper() for de, en in HANDMADE_PAIRS})
    assert tat.bleu(shouting, HANDMADE_PAIRS)[0].score < 10.0  # cased


def test_evaluate_is_cased_but_its_spacy_variant_is_lowercased(tmp_path):
    write_split(tmp_path, "handmade", HANDMADE_PAIRS)
    shouting = EchoTranslator({de: en.upper() for de, en in HANDMADE_PAIRS})
    result = results.evaluate(shouting, tmp_path, "handmade", quiet=True)
    assert result["bleu"] < 10.0
    assert result["bleu_lowercase_spacy"] == pytest.approx(100)
    assert "case:mixed" in result["signature"] and "tok:13a" in result["signature"]
    assert "case:lc" in result["signature_lowercase_spacy"]
    assert "tok:none" in result["signature_lowercase_spacy"]


def test_evaluate_of_a_missing_split_names_the_file(tmp_path):
    with pytest.raises(tat.DataError, match="nosuch.de.gz"):
        results.evaluate(EchoTranslator({}), tmp_path, "nosuch", quiet=True)


def test_evaluate_runs_a_checkpoint_end_to_end_and_prints_the_signature(
    trained_checkpoint, mini_split, tmp_path, capsys
):
    import sacrebleu

    folder, pairs = mini_split
    output = tmp_path / "out" / "mini.hyp.en"
    result = results.evaluate(trained_checkpoint, folder, "mini", output=output)
    printed = capsys.readouterr().out
    assert "nrefs:1" in printed and "tok:13a" in printed
    assert "lowercased BLEU on spaCy tokens" in printed
    lines = output.read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines[:-1]) == len(pairs) == result["n"] == 20
    expected = sacrebleu.corpus_bleu(lines[:-1], [[en for _, en in pairs]]).score
    assert result["bleu"] == pytest.approx(expected)
    assert result["beam_size"] == 1


def test_evaluate_with_beam_size_2_decodes_with_beam_search(
    translator, mini_split, monkeypatch
):
    folder, pairs = mini_split
    calls = []
    beam_search = tat.beam_search

    def counting_beam_search(*args, **kwargs):
        calls.append(kwargs.get("beam_size"))
        return beam_search(*args, **kwargs)

    monkeypatch.setattr(tat, "beam_search", counting_beam_search)
    result = results.evaluate(translator, folder, "mini", beam_size=2, quiet=True)
    assert calls and set(calls) == {2}
    assert result["n"] == len(pairs) and result["beam_size"] == 2
    import sacrebleu

    references = [[en for _, en in pairs]]
    expected = sacrebleu.corpus_bleu(result["hypotheses"], references).score
    assert result["bleu"] == pytest.approx(expected)
    assert result["hypotheses"] == translator.translate(
        [de for de, _ in pairs], **runs.decoding(2)
    )


def test_evaluate_command_returns_0_and_writes_one_line_per_sentence(
    trained_checkpoint, mini_split, tmp_path, capsys
):
    folder, pairs = mini_split
    output = tmp_path / "hyp.en"
    argv = ["evaluate", "--checkpoint", str(trained_checkpoint), "--data-dir"]
    argv += [str(folder), "--split", "mini", "--output", str(output)]
    assert cli.main(argv) == 0
    assert len(output.read_text(encoding="utf-8").splitlines()) == len(pairs)
    printed = capsys.readouterr().out
    assert "mini: 20 sentences translated (greedy)" in printed
    assert "tok:13a" in printed


def test_evaluate_command_with_a_missing_checkpoint_returns_2_naming_it(
    tmp_path, capsys
):
    write_split(tmp_path, "handmade", HANDMADE_PAIRS)
    argv = ["evaluate", "--checkpoint", str(tmp_path / "missing.pt")]
    assert cli.main([*argv, "--data-dir", str(tmp_path), "--split", "handmade"]) == 2
    assert "missing.pt" in capsys.readouterr().err


def test_evaluate_command_without_a_data_folder_says_what_to_pass(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv(tat.DATA_ENV, raising=False)
    assert cli.main(["evaluate", "--checkpoint", str(tmp_path / "c.pt")]) == 2
    assert "--data-dir" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# Attention maps


def chart_axes(chart):
    """(rows in order, columns in order, data rows) of a faceted attention chart."""
    spec = chart.to_dict()
    encoding = spec["spec"]["encoding"]
    assert (encoding["y"]["field"], encoding["x"]["field"]) == ("query", "key")
    (values,) = spec["datasets"].values()
    return encoding["y"]["sort"], encoding["x"]["sort"], values


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
    return tat.attention_maps(translator, SENTENCE, layer=0)


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
    assert {v["head"] for v in values} == {"head 0", "head 1"}
    for total in row_sums(values).values():  # each query's weights sum to 1
        assert total == pytest.approx(1.0, abs=1e-5)


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
        assert total == pytest.approx(1.0, abs=1e-5)


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
        assert total == pytest.approx(1.0, abs=1e-5)


def test_attention_labels_keep_repeated_words_apart_in_sentence_order(expected_tokens):
    source, _ = expected_tokens
    assert source.count("Hund") == 2  # the sentence says "Hund" twice
    weights = torch.full((1, 3, 3), 1 / 3)
    rows, cols, values = chart_axes(
        tat.chart_attention(weights, ["a", "b", "a"], ["a", "b", "a"])
    )
    assert rows == cols == ["0:a", "1:b", "2:a"]
    assert len(values) == 9


def test_attention_maps_of_chosen_heads_and_a_negative_layer(translator):
    charts = tat.attention_maps(translator, SENTENCE, layer=-1, heads=[1])
    spec = charts["decoder_source_attention"].to_dict()
    assert spec["title"] == "Decoder–source attention, layer 0"  # smoke: one layer
    (values,) = spec["datasets"].values()
    assert {v["head"] for v in values} == {"head 1"}


def test_attention_maps_refuse_a_layer_or_head_that_does_not_exist(translator):
    with pytest.raises(ValueError, match="layer must be in 0..0"):
        tat.attention_maps(translator, SENTENCE, layer=1)
    with pytest.raises(ValueError, match="heads must be in 0..1"):
        tat.attention_maps(translator, SENTENCE, heads=[2])


def test_attention_weights_are_those_of_each_greedy_step(translator):
    found = tat.attention_weights(translator, SENTENCE)
    model = translator.model
    src = torch.tensor([translator.encode([SENTENCE])[0]])
    src_mask = tat.padding_mask(src, tat.PAD)
    ids = translator.vocab_tgt(found.target)
    k = min(3, len(ids))  # the decoder as it was at step k: only k inputs
    tat.keep_attention_weights(model)
    try:
        with torch.no_grad():
            memory = model.encode(src, src_mask)
            prefix = torch.tensor([ids[:k]])
            model.decode(memory, src_mask, prefix, tat.subsequent_mask(k))
        layer = model.decoder.layers[0]
        step_self, step_source = layer.self_attn.attn[0], layer.src_attn.attn[0]
    finally:
        tat.keep_attention_weights(model, False)
    close = dict(rtol=0, atol=1e-5)
    torch.testing.assert_close(step_self, found.decoder_self[0][:, :k, :k], **close)
    torch.testing.assert_close(step_source, found.decoder_source[0][:, :k], **close)


def test_attention_weights_restore_the_models_settings(translator):
    model = translator.model
    model.train()
    try:
        tat.attention_weights(translator, SENTENCE)
        assert model.training
        flags = [
            m.keep_attention
            for m in model.modules()
            if isinstance(m, tat.MultiHeadedAttention)
        ]
        assert flags and not any(flags)
    finally:
        model.eval()


def attention_argv(checkpoint, out):
    """The attention command's arguments up to the heads and the sentence."""
    return ["attention", "--checkpoint", str(checkpoint), "--out", str(out)]


def test_attention_command_writes_the_three_maps_as_png(trained_checkpoint, tmp_path):
    argv = attention_argv(trained_checkpoint, tmp_path)
    assert cli.main([*argv, "--head", "0", "--head", "1", SENTENCE]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"{name}.png" for name in sorted(tat.ATTENTION_TITLES)]
    for path in tmp_path.iterdir():
        assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_attention_command_with_a_head_that_does_not_exist_returns_2(
    trained_checkpoint, tmp_path, capsys
):
    argv = attention_argv(trained_checkpoint, tmp_path)
    assert cli.main([*argv, "--head", "5", SENTENCE]) == 2
    assert "heads must be in 0..1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------
# The whole recipe: reproduce (train, average, choose on validation, score test)


@pytest.fixture(scope="module")
def reproduced(multi30k_dir, tmp_path_factory):
    """A two-epoch smoke run through reproduce, scored on 20 sentences a split."""
    root = tmp_path_factory.mktemp("reproduce")
    record = results.reproduce(
        "smoke",
        multi30k_dir,
        root / "run",
        root / "results",
        root / "images",
        alphas=(0.6, 1.0),
        limit=20,
        quiet=True,
        overrides={"max_train_pairs": 300, "epochs": 2},
    )
    return root, record


def test_reproduce_trains_averages_and_chooses_on_validation_only(reproduced):
    root, record = reproduced
    assert record["epochs"] == len(record["history"]) == 2
    assert (root / "run" / "averaged.pt").is_file()
    assert set(record["validation_bleu"]) == {"last epoch", "average of the last 2"}
    assert record["chosen"] == max(
        record["validation_bleu"], key=record["validation_bleu"].get
    )
    by_alpha = record["validation_bleu_by_alpha"]
    assert set(by_alpha) == {"0.6", "1"}
    assert by_alpha[f"{record['alpha']:g}"] == max(by_alpha.values())
    greedy, beam = record["test_greedy"], record["test_beam"]
    assert greedy["split"] == beam["split"] == "test_2016_flickr"
    assert (greedy["beam_size"], beam["beam_size"]) == (1, 4)
    assert beam["alpha"] == record["alpha"]
    assert "tok:13a" in greedy["signature"]
    assert record["epochs_planned"] == 2 and record["stopped_by_time_limit"] is None
    rebuilt = runs.load_translator(root / "run" / "epoch_002.pt")
    assert record["parameters"] == tat.count_parameters(rebuilt.model)
    assert record["train_seconds"] >= sum(r["seconds"] for r in record["history"])


def test_reproduce_writes_the_json_the_table_row_and_the_training_curve(
    reproduced, multi30k_dir
):
    import json

    root, record = reproduced
    saved = json.loads((root / "results" / "smoke.json").read_text())
    assert saved["test_beam"]["bleu"] == pytest.approx(record["test_beam"]["bleu"])
    page = (root / "results" / "smoke.md").read_text()
    assert results.RESULTS_HEADER in page and results.results_row(record) in page
    row = results.results_row(record).strip("|").split("|")
    assert len(row) == 7 and row[0].strip() == "`smoke`"
    assert f"{record['test_greedy']['bleu']:.2f}" in row[5]
    pairs = tat.read_split(multi30k_dir, "test_2016_flickr")[:5]
    assert [(e["source"], e["reference"]) for e in record["examples"]] == pairs
    assert all(e["source"] in page for e in record["examples"])
    curve = root / "images" / "training_curve_smoke.png"
    assert curve.read_bytes().startswith(PNG_SIGNATURE)


def test_reproduce_command_reports_on_an_existing_run(reproduced, capsys):
    root, _ = reproduced
    out = root / "again"
    code = cli.main(
        ["reproduce", "--profile", "smoke", "--out", str(root / "run"), "--no-train"]
        + ["--results", str(out), "--images", str(out), "--limit", "10"]
        + ["--alphas", "0.6", "--data-dir", str(tat.data_dir_from_env())]
    )
    assert code == 0
    assert (out / "smoke.md").is_file() and (out / "training_curve_smoke.png").is_file()
    assert "| `smoke` |" in capsys.readouterr().out


def test_reproduce_rejects_bad_alphas_and_a_run_without_checkpoints(tmp_path, capsys):
    code = cli.main(
        ["reproduce", "--data-dir", str(tmp_path), "--alphas", "0.6,x", "--no-train"]
    )
    assert code == 2 and "--alphas takes numbers" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="no trained run"):
        results.reproduce("smoke", tmp_path, tmp_path / "empty", None, train=False)


def test_reproduce_into_a_folder_holding_a_run_exits_2_and_trains_nothing(
    reproduced, multi30k_dir, capsys
):
    root, _ = reproduced
    before = {p.name: p.stat().st_mtime_ns for p in (root / "run").iterdir()}
    argv = ["reproduce", "--profile", "smoke", "--out", str(root / "run")]
    argv += ["--data-dir", str(multi30k_dir), "--results", str(root / "unused")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a training run" in err[0]
    assert "--no-train" in err[0]
    assert {p.name: p.stat().st_mtime_ns for p in (root / "run").iterdir()} == before
    assert not (root / "unused").exists()


def test_reproduce_reads_the_test_split_only_after_choosing_on_validation(
    reproduced, multi30k_dir, monkeypatch
):
    root, _ = reproduced
    events = []
    read_split, print_ = results.read_split, print

    def recording_read_split(data_dir, split):
        events.append(("read", split))
        return read_split(data_dir, split)

    def recording_print(*args, **kwargs):
        text = " ".join(map(str, args))
        if text.startswith("chosen on validation"):
            events.append(("chose", None))
        print_(*args, **kwargs)

    monkeypatch.setattr(results, "read_split", recording_read_split)
    monkeypatch.setattr(results, "print", recording_print, raising=False)
    results.reproduce("smoke", multi30k_dir, root / "run", None, train=False, limit=5)
    chose = events.index(("chose", None))
    assert {split for _, split in events[:chose]} == {"val"}
    assert ("read", "test_2016_flickr") in events[chose:]


def test_reproduce_writes_its_results_before_printing_the_table(
    reproduced, multi30k_dir, tmp_path, monkeypatch
):
    """A console that cannot print α must not cost the results of a long run."""
    root, _ = reproduced
    print_ = print

    def ascii_console(*args, **kwargs):
        text = " ".join(map(str, args))
        text.encode("ascii")  # raises UnicodeEncodeError, as such a console would
        print_(*args, **kwargs)

    monkeypatch.setattr(results, "print", ascii_console, raising=False)
    with pytest.raises(UnicodeEncodeError):
        results.reproduce(
            "smoke", multi30k_dir, root / "run", tmp_path, None, train=False, limit=5
        )
    assert (tmp_path / "smoke.json").is_file() and (tmp_path / "smoke.md").is_file()


def test_reproduce_command_on_an_ascii_console_still_prints_the_row(reproduced):
    import subprocess
    import sys

    root, _ = reproduced
    out = root / "ascii"
    argv = ["reproduce", "--profile", "smoke", "--out", str(root / "run")]
    argv += ["--no-train", "--results", str(out), "--images", str(out)]
    argv += ["--limit", "5", "--alphas", "0.6", "--data-dir"]
    argv += [str(tat.data_dir_from_env())]
    result = subprocess.run(
        [sys.executable, str(Path(tat.__file__)), *argv],
        capture_output=True,
        env={**__import__("os").environ, "PYTHONIOENCODING": "ascii"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert b"\\u03b1" in result.stdout  # α, escaped
    assert (out / "smoke.json").is_file()


def test_reproduce_ignores_epoch_files_past_the_runs_last_epoch(
    reproduced, multi30k_dir, tmp_path
):
    import shutil

    root, _ = reproduced
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    shutil.copyfile(run / "epoch_001.pt", run / "epoch_020.pt")  # a stray old file
    results.reproduce("smoke", multi30k_dir, run, None, train=False, limit=5)
    averaged = runs.load_checkpoint(run / "averaged.pt")["averaged_from"]
    assert [Path(p).name for p in averaged] == ["epoch_001.pt", "epoch_002.pt"]


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
    tat.notebook_run.cache_clear()  # a model trained by an earlier test is not data
    try:
        assert getattr(tat, example)() is None
    finally:
        tat.notebook_run.cache_clear()
    said = capsys.readouterr().out
    assert tat.DATA_ENV in said and "download --data-dir" in said


@pytest.mark.parametrize("where", ["", "notebooks"])
def test_committed_results_shows_the_runs_page_from_the_repository_or_notebooks(
    where, tmp_path, monkeypatch
):
    from IPython.display import Markdown

    (tmp_path / "results").mkdir()
    page = "| Profile | Parameters |\n|---|---|\n| `mine` | 1 |\n"
    (tmp_path / "results" / "mine.md").write_text(page, encoding="utf-8")
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / where)
    shown = tat.committed_results("mine")
    assert isinstance(shown, Markdown) and shown.data == page


def test_committed_results_of_a_run_not_committed_says_how_to_make_it(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert tat.committed_results("multi30k") is None
    assert "make multi30k" in capsys.readouterr().out
