"""The workshop beside the book: everything a long run needs and a reader does not.

- cli.py       the command line of `python -m workshop COMMAND` (__main__.py)
- runs.py      training runs: profiles, checkpoints, resuming, time limits, bf16,
               several processes (DistributedDataParallel)
- multi30k.py  downloading Multi30k and checking its files against their digests
- results.py   evaluate (BLEU with signatures) and reproduce (the README's Results)
- figures.py   the book's diagrams and charts as PNG files
- fast.py      CPU speed tricks: a cheaper dropout and a fused label-smoothing loss

Every module imports the book (the_annotated_transformer) and uses its public names;
the book never imports this package.
"""
