"""reproduce: train a profile, average its last epochs, choose the model and the
search on the validation split, score the test set once, and write
results/<profile>.{json,md} and its training curve (workshop.reports)."""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import torch

import the_annotated_transformer as tat
from the_annotated_transformer import check_positive_int, count_parameters
from workshop.checkpoints import average_checkpoints, epoch_number, load_checkpoint
from workshop.errors import DataError, UsageError, checking_input
from workshop.multi30k import read_split
from workshop.provenance import describe_machine, source_commit
from workshop.reports import RESULTS_HEADER, results_row, write_results
from workshop.run_folders import epoch_files, refuse_existing_run
from workshop.run_lock import hold_run_folder
from workshop.scoring import evaluate
from workshop.settings import RunConfig
from workshop.training import train_model
from workshop.translation import check_alpha, load_translator


def _listed(numbers):
    """1, 2 and 3: numbers in words, for a message."""
    words = [str(n) for n in numbers]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


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
        write_results(record, Path(results_dir), images_dir)
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
