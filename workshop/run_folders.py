"""A training run's folder: epoch_NNN.pt for each of the newest epochs, last.pt
(what resuming needs) and the vocabularies. A new run never writes into a folder
that holds one; a resumed run continues with its own settings."""

from __future__ import annotations

from pathlib import Path

from workshop.checkpoints import (
    load_checkpoint,
    save_checkpoint,
    save_vocab,
    without_positional_tables,
)
from workshop.multi30k import DataError
from workshop.settings import RunConfig


def epoch_files(out_dir):
    """A run's `epoch_NNN.pt` files, ordered by their epoch number."""
    found = []
    for path in Path(out_dir).glob("epoch_*.pt"):
        number = path.stem.removeprefix("epoch_")
        if number.isdigit():
            found.append((int(number), path))
    return [path for _, path in sorted(found)]


def refuse_existing_run(out_dir, advice):
    """Raise a RunExistsError if `out_dir` already holds a training run; `advice`
    ends the message (what the caller can do instead)."""
    out_dir = Path(out_dir)
    held = [p.name for p in [out_dir / "last.pt", *epoch_files(out_dir)] if p.exists()]
    if held:
        raise RunExistsError(
            f"{out_dir} already holds a training run ({', '.join(held[:3])}"
            f"{', ...' if len(held) > 3 else ''}); {advice}"
        )


class RunExistsError(ValueError):
    """A new run would write into the folder of an earlier one."""


def resume_config(out_dir, **changes):
    """The settings of the run in `out_dir`, with more `epochs` if asked for.

    Any other change is refused: a resumed run continues the run it resumes.
    """
    path = Path(out_dir) / "last.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"--resume: there is no {path} to continue from. Train without --resume "
            "first, or point --out at an earlier run."
        )
    checkpoint = load_checkpoint(path)
    if not isinstance(checkpoint, dict) or "config" not in checkpoint:
        raise DataError(
            f"{path} holds no training settings: it is not a run's last.pt."
        )
    run = RunConfig.from_dict(checkpoint["config"]).to_dict()
    changed = {k: v for k, v in changes.items() if k != "epochs" and run.get(k) != v}
    if changed:
        listed = ", ".join(
            f"{k}={v!r} (the run has {run.get(k)!r})" for k, v in changed.items()
        )
        raise ValueError(
            f"--resume continues {out_dir} with its own settings, and these differ: "
            f"{listed}. Drop those options, or start a new run with another --out."
        )
    done = checkpoint.get("epoch", -1) + 1
    epochs = changes.get("epochs", run["epochs"])
    if epochs <= done:
        raise ValueError(
            f"--resume: {out_dir} has finished its {done} epochs; pass --epochs N "
            f"with N above {done} to train it further."
        )
    return RunConfig.from_dict({**run, "epochs": epochs})


def save_epoch(out_dir, config, data, module, epoch, progress):
    """Write a finished epoch into the run's folder: epoch_NNN.pt (the model, its
    settings and vocabularies), last.pt (that and `progress`, what resuming needs),
    the vocabulary files, and drop all but the newest keep_checkpoints epochs.
    Returns what last.pt holds."""
    checkpoint = {
        "model": without_positional_tables(module.state_dict()),
        "config": config.to_dict(),
        "epoch": epoch,
        "vocab_src": data.vocab_src.get_itos(),
        "vocab_tgt": data.vocab_tgt.get_itos(),
    }
    if config.vocab == "bpe":
        checkpoint["bpe"] = data.vocab_src.tokenizer.to_str()
    save_checkpoint(out_dir / f"epoch_{epoch + 1:03d}.pt", checkpoint)
    last = checkpoint | progress
    save_checkpoint(out_dir / "last.pt", last)
    if config.vocab == "bpe":
        save_vocab(data.vocab_src, out_dir / "bpe.json")
    else:
        save_vocab(data.vocab_src, out_dir / "vocab_src.json")
        save_vocab(data.vocab_tgt, out_dir / "vocab_tgt.json")
    for path in epoch_files(out_dir)[: -config.keep_checkpoints]:
        path.unlink()
    return last
