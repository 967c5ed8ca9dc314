"""A reproduced run's reports: its row of the README's Results table, its Markdown
page (results_markdown), its training curve, and the files that hold them
(write_results)."""

from __future__ import annotations

import json
from pathlib import Path

from the_annotated_transformer import load_altair
from workshop.figures import save_png
from workshop.files import atomic_write_text

RESULTS_HEADER = (
    "| Profile | Parameters | Training time | Hardware | Validation perplexity "
    "| Test BLEU, greedy | Test BLEU, beam |\n|---|---|---|---|---|---|---|"
)


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


def write_results(record, results_dir, images_dir):
    """results/<profile>.json and .md, and the training curve in images_dir."""
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
