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
from workshop.settings import RESUMABLE, RunConfig


def subword_vocab_from_json(text):
    """The SubwordVocab whose tokenizer `tokenizer.to_str()` wrote as `text`."""
    from tokenizers import Tokenizer

    try:
        return SubwordVocab(Tokenizer.from_str(text))
    except Exception as error:  # tokenizers raises a plain Exception
        raise DataError(f"not a saved SubwordVocab ({error}).") from error


def save_vocab(vocab, path):
    """Write a Vocab (its tokens) or a SubwordVocab (its tokenizer) as JSON."""
    if isinstance(vocab, SubwordVocab):
        atomic_write_text(path, vocab.tokenizer.to_str())
    else:
        itos = {"itos": vocab.get_itos()}
        atomic_write_text(path, json.dumps(itos, ensure_ascii=False))


def load_vocab(path):
    """A vocabulary written by save_vocab, of either kind."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text)
        if isinstance(data, dict) and "itos" in data:
            return Vocab(data["itos"])
        return subword_vocab_from_json(text)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{path} is not a saved vocabulary ({error}).") from error


def save_checkpoint(path, state):
    """torch.save `state` to `path` atomically (workshop.files.atomic_write)."""
    atomic_write(path, lambda f: torch.save(state, f))


class _ByteCounter:
    """A file object that keeps nothing and counts the bytes written to it."""

    def __init__(self):
        self.size = 0

    def write(self, data):
        self.size += len(data)
        return len(data)

    def flush(self):
        pass


def checkpoint_size(state):
    """How many bytes save_checkpoint would write for `state` (nothing is written)."""
    counter = _ByteCounter()
    torch.save(state, counter)
    return counter.size


def epoch_number(path):
    """The epoch of a file named epoch_NNN.pt (None for any other name)."""
    match = re.fullmatch(r"epoch_([0-9]+)\.pt", Path(path).name)
    return None if match is None else int(match.group(1))


def epoch_files(out_dir):
    """A run's `epoch_NNN.pt` files, ordered by their epoch number."""
    found = [(epoch_number(p), p) for p in Path(out_dir).glob("epoch_*.pt")]
    return [path for number, path in sorted(f for f in found if f[0] is not None)]


def is_run_checkpoint_name(path):
    """Whether `path` is named as a training run names its own checkpoints:
    last.pt, or epoch_NNN.pt."""
    return Path(path).name == "last.pt" or epoch_number(path) is not None


def with_positional_tables(state_dict, model):
    """`state_dict` with every `*.pe` table it lacks taken from `model`'s own state
    dict, for model.load_state_dict(..., strict=True): strictness then still catches
    every other missing or unexpected entry."""
    tables = {k: v for k, v in model.state_dict().items() if k.endswith(".pe")}
    return {**tables, **state_dict}


def load_checkpoint(path, map_location="cpu"):
    """Load a checkpoint written by save_checkpoint (tensors and plain data only)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            pruned(path)
            or f"checkpoint {path} not found. Train one with "
            "`python -m workshop train --out DIR`."
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # torch raises several types for a damaged file
        raise DataError(
            f"{path} is not a readable checkpoint: it is damaged, truncated or not "
            f"a file written by `train` (torch.load: {type(error).__name__}). Pass "
            "a .pt written by `train`."
        ) from None


def pruned(path):
    """Why a missing epoch_NNN.pt is missing, when its folder says: pruned (the
    run keeps only its newest epochs, all newer than this one: the message names
    them and how to keep more), or not trained yet (every epoch there is older).
    None when the folder holds no epoch files to tell."""
    number, folder = epoch_number(path), Path(path).parent
    kept = epoch_files(folder)
    if number is None or not kept:
        return None
    oldest, newest = epoch_number(kept[0]), epoch_number(kept[-1])
    if number > newest:
        return (
            f"checkpoint {path} not found: the run in {folder} has trained "
            f"{newest} epochs so far (`train --resume --epochs N` trains more)."
        )
    if number > oldest:
        return None  # between kept ones: removed by hand, not pruned
    listed = kept[0].name if len(kept) == 1 else f"{kept[0].name} to {kept[-1].name}"
    return (
        f"checkpoint {path} was pruned: its run keeps only its newest epoch "
        f"checkpoints ({listed} here; train --keep-checkpoints N keeps N). Use "
        "those: averaging the last epochs is what helps."
    )


def vocabs_from_checkpoint(checkpoint):
    """(vocab_src, vocab_tgt) of a loaded checkpoint; one SubwordVocab for "bpe"."""
    if checkpoint["config"].get("vocab", "word") == "bpe":
        if "bpe" not in checkpoint:
            raise DataError(
                "this checkpoint was trained with vocab='bpe' but holds no subword "
                "vocabulary (no 'bpe' entry); it is incomplete."
            )
        shared = subword_vocab_from_json(checkpoint["bpe"])
        return shared, shared
    return Vocab(checkpoint["vocab_src"]), Vocab(checkpoint["vocab_tgt"])


def model_from_checkpoint(checkpoint, device="cpu", path="the checkpoint"):
    """Rebuild (model, vocab_src, vocab_tgt, config) from a loaded checkpoint."""
    is_dict = isinstance(checkpoint, dict)
    missing = [k for k in ("model", "config") if not is_dict or k not in checkpoint]
    if missing:
        raise DataError(
            f"{path} is not a model checkpoint of this project (it lacks "
            f"{missing}); a bare state dict loads with "
            "model.load_state_dict in Python. Pass a .pt written by `train`."
        )
    try:
        config = RunConfig.from_dict(checkpoint["config"])
    except (ValueError, TypeError) as error:
        raise DataError(
            f"{path} holds settings this code cannot use: {error}"
        ) from None
    vocab_src, vocab_tgt = vocabs_from_checkpoint(checkpoint)
    model = config.make_model(len(vocab_src), len(vocab_tgt))
    try:
        load_weights(model, checkpoint["model"])
    except RuntimeError as error:
        first = str(error).strip().splitlines()[-1].strip()
        raise DataError(
            f"{path}: its weights do not fit the model its settings describe "
            f"({first}). The file is damaged or was edited; use another checkpoint."
        ) from None
    return model.to(device).eval(), vocab_src, vocab_tgt, config


CHECKPOINT_KEYS = ("model", "config", "vocab_src", "vocab_tgt")


def _check_same_run(first_path, first, path, checkpoint):
    """Raise a DataError unless two checkpoints share settings and vocabularies."""
    a, b = first["config"], checkpoint["config"]
    keys = sorted((set(a) | set(b)) - set(RESUMABLE))  # what resuming may change
    differ = [k for k in keys if a.get(k) != b.get(k)]
    if differ:  # in the order the files are named: the first's value, then path's
        listed = ", ".join(f"{k}={a.get(k)!r} vs {b.get(k)!r}" for k in differ)
        raise DataError(
            f"{first_path} and {path} have different settings ({listed}); only "
            "checkpoints of one training run can be averaged."
        )
    for side in ("vocab_src", "vocab_tgt", "bpe"):
        if first.get(side) != checkpoint.get(side):
            raise DataError(
                f"{first_path} and {path} have different {side} vocabularies; only "
                "checkpoints of one training run can be averaged."
            )


def average_checkpoints(paths, out):
    """Average checkpoints of one run into a new checkpoint `out`; returns the model.

    `out` may not be one of `paths`, nor carry a name a run gives its own
    checkpoints (last.pt, epoch_NNN.pt): an average holds no optimizer, so over a
    run's last.pt it would end the run's chance to resume.
    """
    paths, out = [Path(p) for p in paths], Path(out)
    if not paths:
        raise UsageError("average: name at least one checkpoint to average.")
    overwritten = [p for p in paths if p.resolve() == out.resolve()]
    if overwritten or is_run_checkpoint_name(out):
        what = "a name a training run gives its own checkpoints (last.pt, epoch_NNN.pt)"
        if overwritten:
            what = "one of the checkpoints it averages"
        raise UsageError(
            f"average: --out {out} is {what}; an average written there would "
            "replace it, or be taken for a run's own. Write it to another file, e.g. "
            f"--out {out.with_name('averaged.pt')}."
        )
    checkpoints = [load_checkpoint(p) for p in paths]
    for path, checkpoint in zip(paths, checkpoints, strict=True):
        missing = [key for key in CHECKPOINT_KEYS if key not in checkpoint]
        if missing:
            raise DataError(f"{path} is not a model checkpoint (it lacks {missing}).")
        _check_same_run(paths[0], checkpoints[0], path, checkpoint)
    first = checkpoints[0]
    model = model_from_checkpoint(first, path=paths[0])[0]
    states = [with_positional_tables(c["model"], model) for c in checkpoints]
    average(model, states)
    averaged = {
        "model": without_positional_tables(model.state_dict()),
        "config": first["config"],
        "epoch": max(checkpoint.get("epoch", 0) for checkpoint in checkpoints),
        "vocab_src": first["vocab_src"],
        "vocab_tgt": first["vocab_tgt"],
        "averaged_from": [str(path) for path in paths],
    }
    if "bpe" in first:  # a subword run: keep its vocabulary
        averaged["bpe"] = first["bpe"]
    for key in ("precision", "provenance"):  # what the run did (the newest's word)
        if key in checkpoints[-1]:
            averaged[key] = checkpoints[-1][key]
    save_checkpoint(out, averaged)
    return model
