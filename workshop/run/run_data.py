"""A run's data: Multi30k checked against its published digests, then the book's
prepare_data with the run's vocabularies (the book's word ones, or one joint
subword vocabulary) and each pair cut to the run's max_len."""

from __future__ import annotations

import torch

import the_annotated_transformer as tat
from workshop import multi30k


def check_run_data(config, data_dir):
    """Check the settings, and the train and val files against their published
    digests."""
    config.validate()
    for split in ("train", "val"):
        multi30k.verify_split(data_dir, split)


def build_vocabs(config, data_dir):
    """The run's (vocab_src, vocab_tgt), built from the training split: one joint
    subword vocabulary when vocab is "bpe", the book's word ones else."""
    train = tat.read_split(data_dir, "train")[: config.max_train_pairs]
    if config.vocab == "bpe":
        texts = (text for pair in train for text in pair)
        shared = tat.SubwordVocab.build(texts, config.bpe_vocab_size)
        return shared, shared
    spacy_de, spacy_en = tat.load_tokenizers()
    return tat.build_vocabulary(train, spacy_de, spacy_en, config.min_freq)


def prepare_run_data(config, data_dir, vocabs=None, check=True):
    """The book's prepare_data for a run, with `vocabs` (None: built here), the
    files checked against their published digests first (check=False: the caller
    did)."""
    if check:
        check_run_data(config, data_dir)
    if vocabs is None and config.vocab == "bpe":  # the book's builds word ones
        vocabs = build_vocabs(config, data_dir)
    return tat.prepare_data(
        data_dir,
        max_len=config.max_len,
        min_freq=config.min_freq,
        max_train_pairs=config.max_train_pairs,
        vocabs=vocabs,
    )


def data_for_run(job, vocabs):
    """The data of the run `job` describes, with `vocabs` (None: built here),
    said in one line."""
    say, device = job.say, job.device
    say(f"reading and tokenizing Multi30k from {job.data_dir} ...")
    data = prepare_run_data(job.config, job.data_dir, vocabs, check=False)
    say(
        f"vocabularies: {len(data.vocab_src)} German, {len(data.vocab_tgt)} English "
        f"tokens; {len(data.splits['train'])} training pairs; device {device}"
        + (f" ({torch.get_num_threads()} thread(s))" if device.type == "cpu" else "")
        + (f" in each of {job.world_size} processes" if job.distributed else "")
    )
    return data
