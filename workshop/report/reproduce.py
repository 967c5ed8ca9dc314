"""reproduce: train a profile, average its last epochs, choose the model and the
search on the validation split, score the test set once, and write
results/<profile>.{json,md} and its training curve (workshop.report.reports)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

import the_annotated_transformer as tat
from the_annotated_transformer import count_parameters
from workshop.errors import DataError, require
from workshop.multi30k import read_split
from workshop.report.reports import RESULTS_HEADER, results_row, write_results
from workshop.run.checkpoints import average_checkpoints, epoch_number, load_checkpoint
from workshop.run.provenance import describe_machine, source_commit
from workshop.run.run_folders import epoch_files, refuse_existing_run
from workshop.run.run_lock import hold_run_folder
from workshop.run.settings import RunConfig
from workshop.run.training import train_model
from workshop.translate.scoring import evaluate
from workshop.translate.translation import check_alpha, load_translator, warn

# The folders of the checkout that hold the committed results: a run scored on a
# few sentences (reproduce's `limit`) may not write into them.
CHECKOUT = Path(tat.__file__).resolve().parent
COMMITTED = {CHECKOUT / "results", CHECKOUT / "images"}


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
    counts = (*windows, *beam_sizes, *([] if limit is None else [limit]))
    ok = alphas and beam_sizes and all(type(k) is int and k >= 1 for k in counts)
    require(ok, "windows, beam sizes and limit must be whole numbers >= 1.")
    for alpha in alphas:
        check_alpha(alpha)
    committed = {Path(f).resolve() for f in (results_dir, images_dir) if f} & COMMITTED
    require(
        not (results_dir and limit and committed),
        f"limit={limit} scores only {limit} sentences of each split, "
        f"which is no result to write into {min(committed, default='')}, the "
        "checkout's committed results: name another folder (--results, --images).",
    )
    out_dir, start = Path(out_dir), time.perf_counter()
    if train:
        config = RunConfig.from_profile(profile, **(overrides or {}))
        again = "report on it with --no-train, or give another --out (or delete the "
        refuse_existing_run(out_dir, again + "folder) to train anew.")
        train_model(config, data_dir, out_dir, quiet=quiet, device=device)
    wall = time.perf_counter() - start
    if not (out_dir / "last.pt").is_file():
        why = f"{out_dir} holds no trained run (no last.pt) to report on: drop "
        raise FileNotFoundError(why + "--no-train, or point --out at a trained run.")
    with hold_run_folder(out_dir):  # its averages are written beside its epochs
        searches = (windows, beam_sizes, alphas, quiet, limit, device)
        record = _report(profile, data_dir, out_dir, *searches)
    if train:
        record.update(train_seconds=wall, train_seconds_measured="wall clock")
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
        lacks = f"{out_dir} lacks epoch_{len(history):03d}.pt, the checkpoint of its "
        raise DataError(lacks + "last epoch; the folder is incomplete.")
    candidates = {"last epoch": epochs[-1]}
    if dropped := ", ".join(str(k) for k in sorted(set(windows)) if k > len(epochs)):
        why = f"the run trained only {len(history)} epochs"
        if len(epochs) < len(history):  # the run pruned the older ones
            why = f"{out_dir} holds only its newest {len(epochs)} epoch checkpoints "
            why += f"of {len(history)} (train --keep-checkpoints N keeps N; this "
            why += f"run's is {run['config'].get('keep_checkpoints')})"
        warn(f"averages of the last {dropped} epochs dropped: {why}.")
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
    by_search, settings = {}, {}
    for beam_size, alpha in itertools.product(beam_sizes, alphas):
        # a beam of 1 is greedy decoding, which has no length penalty
        search = dict(alpha=alpha if beam_size > 1 else None, limit=limit, quiet=True)
        score = evaluate(translator, data_dir, "val", beam_size, **search)
        name = f"beam {beam_size}, alpha {alpha:g}"
        by_search[name], settings[name] = score["bleu"], (beam_size, alpha)
        ratio = f"output/reference length {score['length_ratio']:.3f}"
        say(f"validation BLEU, {name}: {score['bleu']:.2f} ({ratio})")
    search = max(by_search, key=by_search.get)
    beam_size, alpha = settings[search]
    say(f"chosen on validation: {chosen}, {search}; now the test set")
    test, scoring = "test_2016_flickr", dict(quiet=quiet, limit=limit)
    greedy = evaluate(translator, data_dir, test, **scoring)
    scoring["alpha"] = alpha if beam_size > 1 else None
    beam = evaluate(translator, data_dir, test, beam_size, **scoring)
    hypotheses = greedy.pop("hypotheses"), beam.pop("hypotheses")
    examples = zip(read_split(data_dir, test)[:5], *hypotheses, strict=False)
    trained, config = run.get("provenance") or None, run["config"]  # as recorded
    machine = (trained or [{}])[-1].get("machine") or describe_machine(device)
    record = dict(profile=profile, config=config, machine=machine, training=trained)
    record.update(parameters=count_parameters(translator.model), limit=limit)
    # The precision the run trained in (its config only asked for one), the torch
    # and commit of the scoring (the training's: `training`).
    record.update(precision=run.get("precision"), torch=str(torch.__version__))
    record.update(source_commit() or {"commit": None, "uncommitted_changes": None})
    seconds = sum(r["seconds"] for r in history)
    record.update(train_seconds=seconds, train_seconds_measured="sum of epochs")
    record.update(epochs=len(history), epochs_planned=config["epochs"])
    record["training_flops"] = sum(r.get("training_flops", 0.0) for r in history)
    record.update(flop_budget=config.get("flop_budget"), history=history)
    record.update(stopped_by_time_limit=run.get("stopped"))  # None: the whole budget
    record.update(val_ppl=history[-1]["val_ppl"], validation_bleu=validation)
    record.update(chosen=chosen, beam_size=beam_size)
    record["validation_bleu_by_beam"] = by_search
    record.update(alpha=alpha, test_greedy=greedy, test_beam=beam)
    record["examples"] = [
        dict(source=de, reference=en, greedy=g, beam=b) for (de, en), g, b in examples
    ]
    return record
