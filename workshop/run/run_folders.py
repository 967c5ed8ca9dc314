"""A training run's folder: epoch_NNN.pt for each of the newest epochs, last.pt
(what resuming needs) and the vocabularies. A new run never writes into a folder
that holds one; a resumed run continues with its own settings. (One process at a
time writes into a folder: workshop.run.run_lock.)"""

from __future__ import annotations

from pathlib import Path

from workshop.errors import DataError, UsageError
from workshop.files import why_unwritable
from workshop.run.checkpoints import (
    CHECKPOINT_KEYS,
    config_of,
    epoch_files,
    load_checkpoint,
    save_checkpoint,
    save_vocab,
    without_positional_tables,
)
from workshop.run.settings import RESUMABLE, RunConfig

# What last.pt holds for a run to continue from it, besides an epoch checkpoint's.
RESUME_KEYS = (*CHECKPOINT_KEYS, "epoch", "optimizer", "scheduler", "train_state")
RESUME_KEYS += ("history",)


def check_run_folder(out_dir):
    """Raise a UsageError if `out_dir` cannot be a run's folder (it is a file, or
    lies under one), before anything is read or written."""
    reason = why_unwritable(out_dir, folder=True)
    if reason:
        raise UsageError(f"--out {out_dir}: {reason}, so it cannot hold a run.")


def refuse_existing_run(out_dir, advice):
    """Raise a UsageError if `out_dir` already holds a training run; `advice` ends
    the message (what the caller can do instead)."""
    held = ["last.pt"] * (Path(out_dir) / "last.pt").exists()
    held += [path.name for path in epoch_files(out_dir)]
    if held and held[0] != "last.pt":  # killed between an epoch's two writes
        advice = "it has no last.pt to resume: move those files away, or give "
        advice += "another --out for a new run."
    if held:
        listed = ", ".join(held[:3]) + ", ..." * (len(held) > 3)
        raise UsageError(f"{out_dir} already holds a training run ({listed}); {advice}")


def last_checkpoint(out_dir):
    """The path of the run's last.pt, or a FileNotFoundError that says what to do."""
    path = Path(out_dir) / "last.pt"
    if not path.is_file():
        what = "train without --resume first, or give the --out of a run"
        raise FileNotFoundError(f"--resume: no {path} to continue from; {what}.")
    return path


def read_last(out_dir):
    """The run's last.pt, read once and checked to hold what resuming needs."""
    path = last_checkpoint(out_dir)
    checkpoint = load_checkpoint(path)
    is_dict = isinstance(checkpoint, dict)
    missing = [k for k in RESUME_KEYS if not is_dict or k not in checkpoint]
    if missing:
        what = "put back the run's own (an average holds weights only)"
        raise DataError(f"{path} cannot be resumed: it lacks {missing}; {what}.")
    return checkpoint


def resume_config(out_dir, checkpoint=None, **changes):
    """The settings of the run in `out_dir` (`checkpoint`: its last.pt, read here
    when None), with the changes a resumed run may make (settings.RESUMABLE; its
    time limit is this invocation's own, none unless given). Any other change is
    refused, and so is a resume that would train nothing: the run has finished its
    epochs, or the time limit is shorter than the run's last epoch."""
    checkpoint = read_last(out_dir) if checkpoint is None else checkpoint
    run = config_of(checkpoint, Path(out_dir) / "last.pt").to_dict()
    changed = [k for k, v in changes.items() if k not in RESUMABLE and run.get(k) != v]
    if changed:
        listed = [f"{k}={changes[k]!r} (the run has {run.get(k)!r})" for k in changed]
        what = "drop those options, or give another --out for a new run"
        raise UsageError(
            f"--resume keeps the run's settings: {', '.join(listed)}; {what}."
        )
    kept = {k: changes[k] for k in RESUMABLE if k in changes}
    config = RunConfig.from_dict(run | {"time_limit": None} | kept)
    done, history = checkpoint["epoch"] + 1, checkpoint["history"]
    if config.epochs <= done:
        more = f"pass --epochs N with N above {done} to train it further"
        raise UsageError(f"--resume: {out_dir} has finished its {done} epochs; {more}.")
    minutes = history[-1]["seconds"] / 60 if history else 0.0
    if config.time_limit is not None and minutes > config.time_limit:
        limit = f"--time-limit {config.time_limit:g} is below the last epoch's"
        nothing = "it would start no epoch and train nothing"
        raise UsageError(f"{limit} {minutes:.3g} minutes: {nothing}.")
    return config


def save_epoch(out_dir, config, data, module, epoch, progress, record=None):
    """Write a finished epoch into the run's folder: epoch_NNN.pt (the model, its
    settings and vocabularies, and `record`, workshop.run.provenance), last.pt
    (that and `progress`, what resuming needs) and the vocabulary files, and drop
    all but the newest keep_checkpoints epochs. Returns what last.pt holds. An
    epoch is kept whole or not at all: when last.pt cannot be written (a full
    disk), the epoch_NNN.pt written just before is removed."""
    checkpoint = {
        "model": without_positional_tables(module.state_dict()),
        "config": config.to_dict(),
        "epoch": epoch,
        "vocab_src": data.vocab_src.get_itos(),
        "vocab_tgt": data.vocab_tgt.get_itos(),
        **(record or {}),
    }
    if config.vocab == "bpe":
        checkpoint["bpe"] = data.vocab_src.tokenizer.to_str()
    last, epoch_path = checkpoint | progress, out_dir / f"epoch_{epoch + 1:03d}.pt"
    save_checkpoint(epoch_path, checkpoint)
    try:
        save_checkpoint(out_dir / "last.pt", last)
    except BaseException:
        epoch_path.unlink(missing_ok=True)
        raise
    if config.vocab == "bpe":
        save_vocab(data.vocab_src, out_dir / "bpe.json")
    else:
        save_vocab(data.vocab_src, out_dir / "vocab_src.json")
        save_vocab(data.vocab_tgt, out_dir / "vocab_tgt.json")
    for path in epoch_files(out_dir)[: -config.keep_checkpoints]:
        path.unlink()
    return last
