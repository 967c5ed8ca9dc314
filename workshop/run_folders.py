"""A training run's folder: epoch_NNN.pt for each of the newest epochs, last.pt
(what resuming needs) and the vocabularies. A new run never writes into a folder
that holds one; a resumed run continues with its own settings. (One process at a
time writes into a folder: workshop.run_lock.)"""

from __future__ import annotations

from pathlib import Path

from workshop.checkpoints import (
    checkpoint_size,
    epoch_files,
    load_checkpoint,
    save_checkpoint,
    save_vocab,
    without_positional_tables,
)
from workshop.errors import DataError, UsageError
from workshop.files import DiskFullError, megabytes, why_unwritable
from workshop.settings import RESUMABLE, RunConfig

# What last.pt must hold for a run to continue from it: an epoch checkpoint's
# entries, and the optimizer, the schedule and the loop's counters.
RESUME_KEYS = (
    "model",
    "config",
    "epoch",
    "vocab_src",
    "vocab_tgt",
    "optimizer",
    "scheduler",
    "train_state",
    "history",
)


def check_run_folder(out_dir):
    """Raise a UsageError if `out_dir` cannot be a run's folder (it is a file, or
    lies under one), before anything is read or written."""
    reason = why_unwritable(out_dir, folder=True)
    if reason:
        raise UsageError(
            f"--out {out_dir}: {reason}, so it cannot hold a run; name a folder."
        )


def refuse_existing_run(out_dir, advice):
    """Raise a RunExistsError if `out_dir` already holds a training run; `advice`
    ends the message (what the caller can do instead). Epoch files without a
    last.pt (a run killed between its two writes) are no run to resume: the
    message says to move them away."""
    out_dir = Path(out_dir)
    held = [p.name for p in [out_dir / "last.pt", *epoch_files(out_dir)] if p.exists()]
    listed = f"{', '.join(held[:3])}{', ...' if len(held) > 3 else ''}"
    if held and held[0] != "last.pt":
        advice = (
            "without a last.pt it cannot be resumed: move those files away, or give "
            "another --out for a new run."
        )
    if held:
        raise RunExistsError(
            f"{out_dir} already holds a training run ({listed}); {advice}"
        )


class RunExistsError(UsageError):
    """A new run would write into the folder of an earlier one."""


def last_checkpoint(out_dir):
    """The path of the run's last.pt, or a FileNotFoundError that says what to do."""
    path = Path(out_dir) / "last.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"--resume: there is no {path} to continue from. Train without --resume "
            "first, or point --out at an earlier run."
        )
    return path


def check_resumable(checkpoint, path):
    """Raise a DataError that names what a loaded last.pt lacks to be resumed."""
    is_dict = isinstance(checkpoint, dict)
    missing = [k for k in RESUME_KEYS if not is_dict or k not in checkpoint]
    if missing:
        raise DataError(
            f"{path} cannot be resumed: it lacks {', '.join(missing)} (a file written "
            "by `average`, or an epoch_NNN.pt copied over it, holds weights only). "
            "Put back the run's own last.pt, or train anew into another --out."
        )


def last_epoch_seconds(history):
    """How long the run's last epoch trained (0 before the first): what the time
    limit expects the next epoch of a resumed invocation to take."""
    return history[-1]["seconds"] if history else 0.0


def read_last(out_dir):
    """The run's last.pt, read and checked to hold what resuming needs; a
    FileNotFoundError or a DataError says what is wrong. A resume reads it once,
    here, and hands it on."""
    path = last_checkpoint(out_dir)
    checkpoint = load_checkpoint(path)
    check_resumable(checkpoint, path)
    return checkpoint


def resume_config(out_dir, checkpoint=None, **changes):
    """The settings of the run in `out_dir`, with the changes a resumed run may
    make (settings.RESUMABLE): more `epochs`, a `time_limit` for this
    invocation (the run's own is not kept: without one it trains to the end), and
    how many epoch checkpoints it keeps from now on (`keep_checkpoints`). Any
    other change is refused: a resumed run continues the run it resumes. So is a
    resume that would train nothing: the run has finished its epochs, or this
    invocation's time limit is shorter than the run's last epoch, which
    training.out_of_time expects the next one to take. `checkpoint` is the run's
    last.pt as read_last returned it (None: read it here).
    """
    path = Path(out_dir) / "last.pt"
    if checkpoint is None:
        checkpoint = read_last(out_dir)
    try:
        run = RunConfig.from_dict(checkpoint["config"]).to_dict()
    except (ValueError, TypeError) as error:  # a file's problem, not the options'
        raise DataError(
            f"{path} holds settings this code cannot use: {error}"
        ) from None
    changed = {
        k: v for k, v in changes.items() if k not in RESUMABLE and run.get(k) != v
    }
    if changed:
        listed = ", ".join(
            f"{k}={v!r} (the run has {run.get(k)!r})" for k, v in changed.items()
        )
        raise UsageError(
            f"--resume continues {out_dir} with its own settings, and these differ: "
            f"{listed}. Drop those options, or start a new run with another --out."
        )
    config = RunConfig.from_dict(
        {
            **run,
            "time_limit": None,
            **{k: changes[k] for k in RESUMABLE if k in changes},
        }
    )
    done = checkpoint["epoch"] + 1
    if config.epochs <= done:
        raise UsageError(
            f"--resume: {out_dir} has finished its {done} epochs; pass --epochs N "
            f"with N above {done} to train it further."
        )
    epoch_minutes = last_epoch_seconds(checkpoint["history"]) / 60
    if config.time_limit is not None and epoch_minutes > config.time_limit:
        raise UsageError(
            f"--resume: the last epoch of {out_dir} took {epoch_minutes:.3g} minutes, "
            f"more than --time-limit {config.time_limit:g}, so this would start no "
            f"epoch and train nothing. Give a limit above {epoch_minutes:.3g} "
            "minutes, or none to train to the end."
        )
    return config


def save_epoch(out_dir, config, data, module, epoch, progress, record=None):
    """Write a finished epoch into the run's folder: epoch_NNN.pt (the model, its
    settings and vocabularies, and `record`: what the run did, workshop.provenance),
    last.pt (that and `progress`, what resuming needs), the vocabulary files, and
    drop all but the newest keep_checkpoints epochs. Returns what last.pt holds.

    On a full disk: a DiskFullError that says how much the checkpoints need, how
    much is free, and which checkpoint is still whole (the atomic writes leave the
    previous last.pt as it was). An epoch is kept whole or not at all: when its
    last.pt finds no room, its epoch_NNN.pt, written just before, is removed, so
    the folder is as the previous epoch left it (no epoch file without a last.pt
    that a new run would take for a run, and --resume could not continue).
    """
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
    last = checkpoint | progress
    epoch_path = out_dir / f"epoch_{epoch + 1:03d}.pt"
    try:
        save_checkpoint(epoch_path, checkpoint)
        try:
            save_checkpoint(out_dir / "last.pt", last)
        except BaseException:
            epoch_path.unlink(missing_ok=True)
            raise
    except DiskFullError as full:
        raise checkpoints_do_not_fit(out_dir, epoch, checkpoint, last, full) from full
    if config.vocab == "bpe":
        save_vocab(data.vocab_src, out_dir / "bpe.json")
    else:
        save_vocab(data.vocab_src, out_dir / "vocab_src.json")
        save_vocab(data.vocab_tgt, out_dir / "vocab_tgt.json")
    for path in epoch_files(out_dir)[: -config.keep_checkpoints]:
        path.unlink()
    return last


def checkpoints_do_not_fit(out_dir, epoch, checkpoint, last, full):
    """The DiskFullError of epoch `epoch` (0-based), whose checkpoints (`checkpoint`,
    `last`) found no room: where, what they need, what is free, what is intact."""
    sizes = checkpoint_size(checkpoint), checkpoint_size(last)
    name = f"epoch_{epoch + 1:03d}.pt"
    if epoch == 0:
        intact = "no last.pt was written yet: free some space, then train again"
    else:
        intact = (
            f"{out_dir / 'last.pt'} still holds epoch {epoch}, intact: free some "
            "space, then continue from it with --resume"
        )
    free = "" if full.free is None else f", {megabytes(full.free)} free there"
    return DiskFullError(
        f"the disk of {out_dir} is full (writing {Path(full.path).name} stopped"
        f"{free}): epoch {epoch + 1}'s checkpoints need {megabytes(sizes[0])} for "
        f"{name} and {megabytes(sizes[1])} for last.pt. {intact}.",
        full.path,
        full.written,
        full.free,
    )
