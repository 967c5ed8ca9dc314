"""A reproduced run's reports: its row of the README's Results table, its Markdown
page (results_markdown), its training curve, and the files that hold them
(write_results)."""

from __future__ import annotations

import json
from pathlib import Path

from the_annotated_transformer import load_altair
from workshop.files import atomic_write_text
from workshop.report.figures import save_png

RESULTS_HEADER = (
    "| Profile | Parameters | Training time | Hardware | Validation perplexity "
    "| Test BLEU, greedy | Test BLEU, beam |\n|---|---|---|---|---|---|---|"
)


def results_row(record):
    """The record as one row of the README's Results table (Markdown)."""
    greedy, beam = record["test_greedy"], record["test_beam"]
    epochs = f"{record['epochs']} epochs"
    if record.get("stopped_by_time_limit"):
        epochs = f"{record['epochs']} of {record['epochs_planned']} epochs (time limit)"
    epochs += f" in {record['precision']}" if record.get("precision") else ""
    scored = f" (first {record['limit']} sentences only)" if record.get("limit") else ""
    return (
        f"| `{record['profile']}` | {record['parameters'] / 1e6:.1f} M "
        f"| {record['train_seconds'] / 60:.0f} min, {epochs} | {record['machine']} "
        f"| {record['val_ppl']:.2f} | {greedy['bleu']:.2f}{scored} "
        f"| {beam['bleu']:.2f} (beam {beam['beam_size']}, α {record['alpha']:g})"
        f"{scored} |"
    )


def provenance_line(record):
    """Where the numbers come from: the commit, torch, and a limit if there was one.
    A record older than these fields (results/multi30k.json) says it does not know."""
    line = "Scored before records named their commit and torch version."
    if "torch" in record:
        commit = record.get("commit")
        where = f"commit `{commit[:12]}`" if commit else "outside a git checkout"
        where += " with uncommitted changes" * bool(record.get("uncommitted_changes"))
        line = f"Scored from {where} with torch {record['torch']}."
    if versions := sorted({part["torch"] for part in record.get("training") or []}):
        line += f" Trained with torch {', '.join(versions)}."
    if limit := record.get("limit"):
        line += f" **Only the first {limit} sentences of each split were scored**: "
        line += "these are not results to compare."
    return line


def results_markdown(record):
    """The table row, the signatures and five examples, as a Markdown page."""
    greedy, beam = record["test_greedy"], record["test_beam"]
    stopped = record.get("stopped_by_time_limit")
    lowercased = f"{greedy['bleu_lowercase_spacy']:.2f} greedy, "
    lowercased += f"{beam['bleu_lowercase_spacy']:.2f} beam"
    chosen = f"Model: {record['chosen']}, chosen on the validation split. sacreBLEU "
    chosen += f"signature: `{greedy['signature']}`. Lowercased BLEU on spaCy tokens: "
    lines = [f"# Results of the `{record['profile']}` profile", "", RESULTS_HEADER]
    lines += [results_row(record), ""]
    lines += [f"**Shorter than its budget:** {stopped}", ""] if stopped else []
    lines += [f"{chosen}{lowercased}.", "", provenance_line(record), ""]
    lines += [_speed_line(record["history"]), "", _flops_line(record), ""]
    lines += ["| German | Reference | Greedy | Beam |", "|---|---|---|---|"]
    for e in record["examples"]:  # <unk> shown in a cell, not taken for HTML
        cells = (e[k] for k in ("source", "reference", "greedy", "beam"))
        lines.append("| " + " | ".join(map(_table_cell, cells)) + " |")
    return "\n".join(lines) + "\n"


def _table_cell(text):
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _speed_line(history):
    """How fast the epochs trained, and how to work out another machine's time."""
    tokens = sum(r["tokens_per_s"] * r["seconds"] for r in history)
    seconds = sum(r["seconds"] for r in history)
    line = f"Training speed: {tokens / seconds:,.0f} target tokens/s over "
    line += f"{len(history)} epochs ({tokens / 1e6:.2f} M target tokens in "
    line += f"{seconds / 60:.0f} min, validation and checkpoints not included). A "
    line += "machine that trains S target tokens/s needs about "
    return line + f"{tokens / 60:,.0f} / S minutes."


def _flops_line(record):
    """The training FLOPs the run spent (workshop.run.flops), and its budget if any."""
    spent, budget = record["training_flops"], record["flop_budget"]
    budget = "" if budget is None else f", of a budget of {budget:.4e} ({budget:,.0f})"
    counted = "useful, as workshop/run/flops.py counts them"
    return f"Training FLOPs ({counted}): {spent:.4e}{budget}."


def chart_training_curve(history, title=""):
    """Training (label-smoothed) loss and validation NLL per epoch."""
    alt = load_altair()
    names = dict(train_loss_smoothed="training (label-smoothed)")
    names["val_nll"] = "validation (negative log-likelihood)"
    rows = [{"epoch": r["epoch"], **{names[k]: r[k] for k in names}} for r in history]
    return (
        alt.Chart(alt.Data(values=rows), title=title)
        .transform_fold(list(names.values()), as_=["curve", "loss per token"])
        .mark_line(point=True)
        .encode(x="epoch:Q", y="loss per token:Q", color="curve:N")
        .properties(width=420, height=260)
    )


def write_results(record, results_dir, images_dir):
    """results/<profile>.json and .md, and the training curve in images_dir."""
    name, page = record["profile"], results_markdown(record)
    paths = [
        atomic_write_text(results_dir / f"{name}.json", json.dumps(record, indent=1))
    ]
    paths.append(atomic_write_text(results_dir / f"{name}.md", page))
    if images_dir is not None:
        curve = chart_training_curve(record["history"], f"{name} profile")
        paths.append(save_png(curve, Path(images_dir) / f"training_curve_{name}.png"))
    print("\n".join(f"wrote {path}" for path in paths))
