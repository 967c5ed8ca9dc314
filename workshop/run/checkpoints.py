"""The files a run writes and reads back: vocabularies as JSON, checkpoints (written
atomically, loaded with weights_only, saved without the positional tables, which the
model's sizes determine), and the average of a run's checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from the_annotated_transformer import (
    SubwordVocab,
    Vocab,
    average,
    load_weights,
    without_positional_tables,
)
from workshop.errors import DataError, UsageError
from workshop.files import atomic_write, atomic_write_text
from workshop.run.settings import RESUMABLE, RunConfig

CHECKPOINT_KEYS = ("model", "config", "vocab_src", "vocab_tgt")
RUN_FILES = ("vocab_src", "vocab_tgt", "bpe")  # a run's vocabularies, as saved


def save_vocab(vocab, path):
    """Write a Vocab (its tokens) or a SubwordVocab (its tokenizer) as JSON."""
    if isinstance(vocab, SubwordVocab):
        atomic_write_text(path, vocab.tokenizer.to_str())
    else:
        itos = {"itos": vocab.get_itos()}
        atomic_write_text(path, json.dumps(itos, ensure_ascii=False))


def save_checkpoint(path, state):
    """torch.save `state` to `path` atomically (workshop.files.atomic_write)."""
    atomic_write(path, lambda f: torch.save(state, f))


def epoch_number(path):
    """The epoch of a file named epoch_NNN.pt (None for any other name)."""
    match = re.fullmatch(r"epoch_([0-9]+)\.pt", Path(path).name)
    return None if match is None else int(match.group(1))


def epoch_files(out_dir):
    """A run's `epoch_NNN.pt` files, ordered by their epoch number."""
    found = [(epoch_number(p), p) for p in Path(out_dir).glob("epoch_*.pt")]
    return [path for number, path in sorted(f for f in found if f[0] is not None)]


def load_checkpoint(path, map_location="cpu"):
    """Load a checkpoint written by save_checkpoint (tensors and plain data only)."""
    path = Path(path)
    if not path.is_file():
        train = "train one with `python -m workshop train`"
        raise FileNotFoundError(f"checkpoint {path} not found: {train}.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # torch raises several types for a damaged file
        what = f"(torch.load: {type(error).__name__}); pass one written by `train`."
        raise DataError(f"{path} is not a readable checkpoint {what}") from None


def vocabs_from_checkpoint(checkpoint):
    """(vocab_src, vocab_tgt) of a loaded checkpoint; one SubwordVocab for "bpe"."""
    from tokenizers import Tokenizer

    try:  # a missing entry (KeyError) or a damaged one (tokenizers: an Exception)
        if checkpoint["config"].get("vocab", "word") != "bpe":
            return Vocab(checkpoint["vocab_src"]), Vocab(checkpoint["vocab_tgt"])
        shared = SubwordVocab(Tokenizer.from_str(checkpoint["bpe"]))
    except Exception as error:
        raise DataError(
            f"the checkpoint's vocabulary is unreadable ({error!r})."
        ) from None
    return shared, shared


def config_of(checkpoint, path="the checkpoint"):
    """The RunConfig of a loaded checkpoint; a DataError if this code cannot use it."""
    try:
        return RunConfig.from_dict(checkpoint["config"])
    except (ValueError, TypeError) as error:  # a file's problem, not the options'
        raise DataError(
            f"{path} holds settings this code cannot use: {error}"
        ) from None


def model_from_checkpoint(checkpoint, device="cpu", path="the checkpoint"):
    """Rebuild (model, vocab_src, vocab_tgt, config) from a loaded checkpoint."""
    is_dict = isinstance(checkpoint, dict)
    missing = [k for k in ("model", "config") if not is_dict or k not in checkpoint]
    if missing:
        raise DataError(f"{path} lacks {missing}: pass a .pt written by `train`.")
    config = config_of(checkpoint, path)
    vocab_src, vocab_tgt = vocabs_from_checkpoint(checkpoint)
    model = config.make_model(len(vocab_src), len(vocab_tgt))
    try:
        load_weights(model, checkpoint["model"])
    except RuntimeError as error:
        first = str(error).strip().splitlines()[-1].strip()
        message = f"{path}: its weights do not fit its settings ({first})."
        raise DataError(message) from None
    return model.to(device).eval(), vocab_src, vocab_tgt, config


def average_checkpoints(paths, out):
    """Average checkpoints of one run into a new checkpoint `out`; returns the model.

    `out` may not be one of `paths`, nor carry a name a run gives its own
    checkpoints (last.pt, epoch_NNN.pt): an average holds no optimizer, so over a
    run's last.pt it would end the run's chance to resume.
    """
    paths, out = [Path(p) for p in paths], Path(out)
    if not paths:
        raise UsageError("name at least one checkpoint to average.")
    if out.resolve() in [p.resolve() for p in paths] or (
        out.name == "last.pt" or epoch_number(out) is not None
    ):
        raise UsageError(
            f"--out {out} is one of the averaged checkpoints or a name a "
            "run gives its own (last.pt, epoch_NNN.pt); write it to another file, "
            f"e.g. --out {out.with_name('averaged.pt')}."
        )
    checkpoints, models = [load_checkpoint(p) for p in paths], []
    for path, checkpoint in zip(paths, checkpoints, strict=True):
        models.append(model_from_checkpoint(checkpoint, path=path)[0])
        a, b = (config_of(c).to_dict() for c in (checkpoints[0], checkpoint))
        differ = [f"{k}={a[k]!r} vs {b[k]!r}" for k in a if a[k] != b[k]]
        differ = [d for d in differ if d.split("=")[0] not in RESUMABLE]
        sides = [s for s in RUN_FILES if checkpoints[0].get(s) != checkpoint.get(s)]
        differ += [f"{side} vocabularies" for side in sides]
        if differ:
            listed = f"{paths[0]} and {path} have different settings"
            one = "only checkpoints of one training run can be averaged"
            raise DataError(f"{listed} ({', '.join(differ)}); {one}.")
    model = average(models[0], models)
    # The run's settings, vocabularies and record, as the newest checkpoint has them
    kept = ("config", *RUN_FILES, "precision", "provenance")
    averaged = {key: value for key, value in checkpoints[-1].items() if key in kept}
    averaged |= {
        "model": without_positional_tables(model.state_dict()),
        "epoch": max(checkpoint.get("epoch", 0) for checkpoint in checkpoints),
        "averaged_from": [str(path) for path in paths],
    }
    save_checkpoint(out, averaged)
    return model
