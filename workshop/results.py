"""Evaluation with sacreBLEU, and `reproduce`: train a profile, average, choose on
the validation split, score the test set, and write results/<profile>.{json,md}.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

import torch

import the_annotated_transformer as tat
from the_annotated_transformer import (
    check_positive_int,
    count_parameters,
    load_altair,
    load_tokenizers,
    tokenize,
)
from workshop.checkpoints import average_checkpoints, epoch_number, load_checkpoint
from workshop.errors import DataError, UsageError, checking_input
from workshop.figures import save_png
from workshop.files import atomic_write_text, why_unwritable
from workshop.multi30k import read_split
from workshop.provenance import describe_machine, source_commit
from workshop.run_folders import epoch_files, refuse_existing_run
from workshop.run_lock import hold_run_folder
from workshop.settings import RunConfig
from workshop.training import train_model
from workshop.translation import check_alpha, decode_options, load_translator


def _listed(numbers):
    """1, 2 and 3: numbers in words, for a message."""
    words = [str(n) for n in numbers]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _spaced_tokens(texts, tokenizer):
    """Each text as its spaCy tokens joined by single spaces."""
    return [" ".join(tokenize(text, tokenizer)) for text in texts]


def evaluate(
    translator_or_checkpoint,
    data_dir,
    split="test_2016_flickr",
    beam_size=1,
    output=None,
    batch_size=64,
    quiet=False,
    alpha=0.6,
    limit=None,
    device=None,
):
    """Translate a split's German side and score it with sacreBLEU; returns a dict.

    `alpha` is beam search's length-penalty exponent (unused by greedy decoding);
    `limit` scores only the split's first sentences (for quick checks); `device`
    is where a checkpoint's model translates (default: the book's default_device).
    An `output` that cannot be written is refused before anything is translated.
    """
    import sacrebleu

    with checking_input():
        check_positive_int(beam_size=beam_size, batch_size=batch_size)
    options = decode_options(beam_size, alpha)
    reason = None if output is None else why_unwritable(output)
    if reason:
        raise UsageError(
            f"evaluate: the translations cannot be written to {output}: {reason}."
        )
    pairs = read_split(data_dir, split)[:limit]
    if not pairs:
        raise DataError(f"split {split!r} in {data_dir} is empty: nothing to score.")
    translator = translator_or_checkpoint
    if isinstance(translator, str | os.PathLike):
        translator = load_translator(translator, device)
    sources = [de for de, _ in pairs]
    references = [en for _, en in pairs]
    start = time.perf_counter()
    hypotheses = translator.translate(sources, batch_size=batch_size, **options)
    seconds = time.perf_counter() - start
    if output is not None:
        atomic_write_text(output, "".join(line + "\n" for line in hypotheses))
    bleu = sacrebleu.metrics.BLEU()  # 13a tokenisation, cased: the standard
    score = bleu.corpus_score(hypotheses, [references])
    spacy_en = load_tokenizers()[1]
    # Tokenised on purpose: `force` stops sacreBLEU warning that it looks tokenised.
    bleu_lc = sacrebleu.metrics.BLEU(tokenize="none", lowercase=True, force=True)
    score_lc = bleu_lc.corpus_score(
        _spaced_tokens(hypotheses, spacy_en), [_spaced_tokens(references, spacy_en)]
    )
    result = {
        "split": split,
        "n": len(pairs),
        "beam_size": beam_size,
        "alpha": alpha if beam_size > 1 else None,
        "bleu": score.score,
        "signature": str(bleu.get_signature()),
        "precisions": list(score.precisions),
        "brevity_penalty": score.bp,
        "length_ratio": score.sys_len / score.ref_len,  # output words per reference
        "bleu_lowercase_spacy": score_lc.score,
        "signature_lowercase_spacy": str(bleu_lc.get_signature()),
        "seconds": seconds,
        "output": None if output is None else str(output),
        "hypotheses": hypotheses,
    }
    if not quiet:
        _print_evaluation(result, score)
    return result


def _print_evaluation(result, score):
    """Print what `evaluate` measured."""
    decoding = "greedy"
    if result["beam_size"] > 1:
        decoding = f"beam {result['beam_size']}, alpha {result['alpha']:g}"
    print(
        f"{result['split']}: {result['n']} sentences translated ({decoding}) in "
        f"{result['seconds']:.1f} s"
    )
    print(f"sacreBLEU: {score}")
    print(f"signature: {result['signature']}")
    print(
        f"lowercased BLEU on spaCy tokens (for comparison with other Multi30k "
        f"results; not a sacreBLEU score): {result['bleu_lowercase_spacy']:.2f} "
        f"[{result['signature_lowercase_spacy']}]"
    )
    if result["output"] is not None:
        print(f"translations written to {result['output']}")


RESULTS_HEADER = (
    "| Profile | Parameters | Training time | Hardware | Validation perplexity "
    "| Test BLEU, greedy | Test BLEU, beam |\n|---|---|---|---|---|---|---|"
)


# The folders of the checkout that hold the committed results: a run scored on a
# few sentences (reproduce's `limit`) may not write into them.
CHECKOUT = Path(tat.__file__).resolve().parent
COMMITTED = (CHECKOUT / "results", CHECKOUT / "images")


def refuse_committed_folders(limit, *folders):
    """A UsageError if `limit` is set and a folder is the checkout's results/ or
    images/: a score on a few sentences is no result to keep there."""
    if limit is None:
        return
    for folder in folders:
        if folder is not None and Path(folder).resolve() in COMMITTED:
            raise UsageError(
                f"reproduce: limit={limit} scores only {limit} sentences of each "
                f"split, which is no result to write into {folder}, the checkout's "
                "committed results: name another folder (--results DIR, --images DIR)."
            )


def reproduce(
    profile,
    data_dir,
    out_dir,
    results_dir="results",
    images_dir="images",
    *,
    windows=(2, 3, 4, 5),
    beam_sizes=(4, 6),
    alphas=(0.6, 1.0, 1.5, 2.0, 2.5, 3.0),
    train=True,
    quiet=False,
    limit=None,
    overrides=None,
    device=None,
):
    """Train `profile`, average, choose on validation, score the test set; returns
    the record that `results_dir`/<profile>.json holds (None: write no files).

    The model is the last epoch or the average of the last k epochs, for each k in
    `windows`, whichever translates the validation split best (greedy BLEU); then
    every beam size in `beam_sizes` with every α in `alphas` is tried there too.
    `overrides` (a dict) changes fields of the profile; `limit` scores only the first
    sentences of each split (for quick checks: refused into the checkout's results/
    and images/, and recorded); `device` is where it trains and translates.
    """
    with checking_input():
        for k in windows:
            check_positive_int(window=k)
        for k in beam_sizes:
            check_positive_int(beam_size=k)
        for alpha in alphas:
            check_alpha(alpha)
        if limit is not None:
            check_positive_int(limit=limit)
    if not alphas or not beam_sizes:
        raise UsageError("reproduce: give at least one beam size and one alpha.")
    if results_dir is not None:  # else nothing is written, images neither
        refuse_committed_folders(limit, results_dir, images_dir)
    out_dir = Path(out_dir)
    start = time.perf_counter()
    if train:
        config = RunConfig.from_profile(profile, **(overrides or {}))
        refuse_existing_run(
            out_dir,
            "report on it with --no-train, or give another --out (or delete the "
            "folder) to train anew.",
        )
        train_model(config, data_dir, out_dir, quiet=quiet, device=device)
    wall = time.perf_counter() - start
    if not (out_dir / "last.pt").is_file():
        raise FileNotFoundError(
            f"{out_dir} holds no trained run (no last.pt) to report on: drop "
            "--no-train to train it first, or point --out at a trained run."
        )
    with hold_run_folder(out_dir):  # its averages are written beside its epochs
        record = _report(
            profile,
            data_dir,
            out_dir,
            windows,
            beam_sizes,
            alphas,
            quiet,
            limit,
            device,
        )
    record["train_seconds"] = wall if train else record["train_seconds"]
    record["train_seconds_measured"] = "wall clock" if train else "sum of epochs"
    if results_dir is not None:  # written before anything more is printed
        _write_results(record, Path(results_dir), images_dir)
    if not quiet:
        print(RESULTS_HEADER + "\n" + results_row(record))
    return record


def _report(
    profile, data_dir, out_dir, windows, beam_sizes, alphas, quiet, limit, device
):
    """reproduce's report on the run in `out_dir`: average, choose on validation,
    score the test set; returns the record."""
    say = (lambda *args: None) if quiet else print
    run = load_checkpoint(out_dir / "last.pt")  # holds the losses of every epoch
    history = run["history"]
    # This run's epoch files, up to its last epoch, in epoch order.
    epochs = [p for p in epoch_files(out_dir) if epoch_number(p) <= len(history)]
    if not epochs or epoch_number(epochs[-1]) != len(history):
        raise DataError(
            f"{out_dir} lacks epoch_{len(history):03d}.pt, the checkpoint of its "
            "last epoch; the folder is incomplete."
        )
    candidates = {"last epoch": epochs[-1]}
    dropped = sorted({k for k in windows if k > len(epochs)})
    if dropped:
        why = f"the run trained only {len(history)} epochs"
        if len(epochs) < len(history):  # the run pruned the older ones
            why = (
                f"{out_dir} holds only its newest {len(epochs)} epoch checkpoints "
                f"of {len(history)} (train --keep-checkpoints N keeps N; this run's "
                f"is {run['config'].get('keep_checkpoints')})"
            )
        print(
            f"warning: reproduce: averages of the last {_listed(dropped)} epochs "
            f"dropped: {why}.",
            file=sys.stderr,
        )
    for k in sorted({k for k in windows if 1 < k <= len(epochs)}):
        path = out_dir / f"average_last_{k}.pt"
        average_checkpoints(epochs[-k:], path)
        candidates[f"average of the last {k}"] = path
    validation, chosen, translator = {}, None, None
    for name, path in candidates.items():
        candidate = load_translator(path, device)
        score = evaluate(candidate, data_dir, "val", quiet=True, limit=limit)["bleu"]
        validation[name] = score
        say(f"validation BLEU, greedy, {name}: {score:.2f}")
        if chosen is None or score > validation[chosen]:  # the first best is kept
            chosen, translator = name, candidate
    by_search = {}
    for beam_size, alpha in itertools.product(beam_sizes, alphas):
        score = evaluate(
            translator, data_dir, "val", beam_size, quiet=True, alpha=alpha, limit=limit
        )
        by_search[beam_size, alpha] = score["bleu"]
        say(
            f"validation BLEU, beam {beam_size}, alpha {alpha:g}: {score['bleu']:.2f} "
            f"(output/reference length {score['length_ratio']:.3f})"
        )
    beam_size, alpha = max(by_search, key=by_search.get)
    say(
        f"chosen on validation: {chosen}, beam {beam_size}, alpha {alpha:g}; now the "
        "test set"
    )
    test = "test_2016_flickr"
    greedy = evaluate(translator, data_dir, test, quiet=quiet, limit=limit)
    beam = evaluate(
        translator, data_dir, test, beam_size, quiet=quiet, alpha=alpha, limit=limit
    )
    pairs = read_split(data_dir, test)[:5]
    trained = run.get("provenance") or [{}]  # what the run recorded, if it did
    record = {
        "profile": profile,
        "config": run["config"],
        "parameters": count_parameters(translator.model),
        "machine": trained[-1].get("machine") or describe_machine(device),
        # The precision the run trained in (config's bf16 only asked for it).
        "precision": run.get("precision"),
        "training": trained if run.get("provenance") else None,
        "torch": str(torch.__version__),  # of the scoring; the training's: `training`
        **(source_commit() or {"commit": None, "uncommitted_changes": None}),
        "limit": limit,  # None: every sentence of each split was scored
        "train_seconds": sum(r["seconds"] for r in history),
        "train_seconds_measured": "sum of epochs",
        "epochs": len(history),
        "epochs_planned": run["config"]["epochs"],
        "training_flops": sum(r.get("training_flops", 0.0) for r in history),
        "flop_budget": run["config"].get("flop_budget"),
        "stopped_by_time_limit": run.get("stopped"),  # None: the whole budget ran
        "history": history,
        "val_ppl": history[-1]["val_ppl"],
        "validation_bleu": validation,
        "chosen": chosen,
        "validation_bleu_by_beam": {
            f"beam {k}, alpha {a:g}": b for (k, a), b in by_search.items()
        },
        "beam_size": beam_size,
        "alpha": alpha,
        "test_greedy": {k: v for k, v in greedy.items() if k != "hypotheses"},
        "test_beam": {k: v for k, v in beam.items() if k != "hypotheses"},
        "examples": [
            {"source": de, "reference": en, "greedy": g, "beam": b}
            for (de, en), g, b in zip(
                pairs, greedy["hypotheses"], beam["hypotheses"], strict=False
            )
        ],
    }
    return record


def results_row(record):
    """The record as one row of the README's Results table (Markdown)."""
    minutes = record["train_seconds"] / 60
    greedy, beam = record["test_greedy"], record["test_beam"]
    epochs = f"{record['epochs']} epochs"
    if record.get("stopped_by_time_limit"):
        epochs = f"{record['epochs']} of {record['epochs_planned']} epochs (time limit)"
    if record.get("precision"):
        epochs += f" in {record['precision']}"
    scored = ""
    if record.get("limit"):  # a quick check, not a result
        scored = f" (first {record['limit']} sentences only)"
    return (
        f"| `{record['profile']}` | {record['parameters'] / 1e6:.1f} M "
        f"| {minutes:.0f} min, {epochs} | {record['machine']} "
        f"| {record['val_ppl']:.2f} | {greedy['bleu']:.2f}{scored} "
        f"| {beam['bleu']:.2f} (beam {beam['beam_size']}, α {record['alpha']:g})"
        f"{scored} |"
    )


def provenance_line(record):
    """Where the numbers come from: the commit, torch, and a limit if there was one.

    A record written before these fields existed (results/multi30k.json) says that it
    does not know, rather than failing."""
    if "torch" not in record:
        line = "Scored before records named their commit and torch version."
    else:
        commit = record.get("commit")
        where = (
            "outside a git checkout" if commit is None else f"commit `{commit[:12]}`"
        )
        if record.get("uncommitted_changes"):
            where += " with uncommitted changes"
        line = f"Scored from {where} with torch {record['torch']}."
    trained = record.get("training") or []
    versions = sorted({part["torch"] for part in trained})
    if versions:
        line += f" Trained with torch {', '.join(versions)}."
    if record.get("limit"):
        line += (
            f" **Only the first {record['limit']} sentences of each split were "
            "scored**: these are not results to compare."
        )
    return line


def results_markdown(record):
    """The table row, the signatures and five examples, as a Markdown page."""
    greedy, beam = record["test_greedy"], record["test_beam"]
    lines = [
        f"# Results of the `{record['profile']}` profile",
        "",
        RESULTS_HEADER,
        results_row(record),
        "",
        f"Model: {record['chosen']}, chosen on the validation split. sacreBLEU "
        f"signature: `{greedy['signature']}`. Lowercased BLEU on spaCy tokens: "
        f"{greedy['bleu_lowercase_spacy']:.2f} greedy, "
        f"{beam['bleu_lowercase_spacy']:.2f} beam.",
        "",
        provenance_line(record),
        "",
        _speed_line(record["history"]),
        "",
        _flops_line(record),
        "",
        "| German | Reference | Greedy | Beam |",
        "|---|---|---|---|",
    ]
    if record.get("stopped_by_time_limit"):
        lines[5:5] = [
            f"**Shorter than its budget:** {record['stopped_by_time_limit']}",
            "",
        ]
    lines += [
        "| "
        + " | ".join(
            _table_cell(e[k]) for k in ("source", "reference", "greedy", "beam")
        )
        + " |"
        for e in record["examples"]
    ]
    return "\n".join(lines) + "\n"


def _speed_line(history):
    """How fast the epochs trained, and how to work out another machine's time."""
    tokens = sum(r["tokens_per_s"] * r["seconds"] for r in history)
    seconds = sum(r["seconds"] for r in history)
    return (
        f"Training speed: {tokens / seconds:,.0f} target tokens/s over "
        f"{len(history)} epochs ({tokens / 1e6:.2f} M target tokens in "
        f"{seconds / 60:.0f} min, validation and checkpoints not included). A machine "
        f"that trains S target tokens/s needs about {tokens / 60:,.0f} / S minutes."
    )


def _flops_line(record):
    """The training FLOPs the run spent (workshop.flops), and its budget if any."""
    spent, budget = record["training_flops"], record["flop_budget"]
    line = f"Training FLOPs (useful, as workshop/flops.py counts them): {spent:.4e}"
    if budget is None:
        return line + "."
    return line + f", of a budget of {budget:.4e} ({budget:,.0f})."


def _table_cell(text):
    """Text safe inside a Markdown table cell: <unk> shown, not taken for HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def chart_training_curve(history, title=""):
    """Training (label-smoothed) loss and validation NLL per epoch."""
    alt = load_altair()
    import pandas as pd

    frame = pd.DataFrame(
        [
            {"epoch": r["epoch"], "loss per token": r[key], "curve": name}
            for r in history
            for key, name in (
                ("train_loss_smoothed", "training (label-smoothed)"),
                ("val_nll", "validation (negative log-likelihood)"),
            )
        ]
    )
    return (
        alt.Chart(frame, title=title)
        .mark_line(point=True)
        .encode(x="epoch:Q", y="loss per token:Q", color="curve:N")
        .properties(width=420, height=260)
    )


def _write_results(record, results_dir, images_dir):
    """results/<profile>.json and .md, and the training curve in images_dir."""
    import json

    results_dir.mkdir(parents=True, exist_ok=True)
    name = record["profile"]
    atomic_write_text(results_dir / f"{name}.json", json.dumps(record, indent=1))
    atomic_write_text(results_dir / f"{name}.md", results_markdown(record))
    written = [results_dir / f"{name}.json", results_dir / f"{name}.md"]
    if images_dir is not None:
        curve = chart_training_curve(record["history"], f"{name} profile")
        written.append(save_png(curve, Path(images_dir) / f"training_curve_{name}.png"))
    for path in written:
        print(f"wrote {path}")
