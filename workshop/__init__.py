"""The workshop beside the book: everything a long run needs and a reader does not.

- cli.py          the command line of `python -m workshop COMMAND` (__main__.py)
- settings.py     a run's settings (RunConfig) and the named profiles
- training.py     training runs: the book's loop with a time limit, resuming, bf16
                  and several processes (train_model)
- run_folders.py  what a run's folder holds: epochs kept, last.pt, resuming rules
- checkpoints.py  vocabulary and checkpoint files, and averaging checkpoints
- precision.py    bfloat16 where it pays (a measured probe, autocast wrappers)
- processes.py    several processes (DistributedDataParallel) around the book's loop
- translation.py  translating with a checkpoint; beam search over a whole batch
- multi30k.py     downloading Multi30k and checking its files against their digests
- results.py      evaluate (BLEU with signatures) and reproduce (the README's Results)
- figures.py      the book's diagrams and charts as PNG files
- flops.py        a training run's useful FLOPs, which a profile's budget spends
- fast.py         speed tricks: a cheaper dropout, fused attention, a fused
                  label-smoothing loss
- files.py        one atomic write for every file the project writes

Every module imports the book (the_annotated_transformer) and uses its public names;
the book never imports this package.
"""
