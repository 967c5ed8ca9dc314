"""The workshop beside the book: everything a long run needs and a reader does not.

- cli.py          the command line of `python -m workshop COMMAND` (__main__.py):
                  its arguments (parsed before torch is imported) and how it ends
- commands.py     what each command runs
- errors.py       which failures exit 2, 1 or 130
- settings.py     a run's settings (RunConfig) and the named profiles
- training.py     training runs: the book's loop with a time limit, resuming, bf16
                  and several processes (train_model)
- run_folders.py  what a run's folder holds: epochs kept, last.pt, resuming rules
- run_lock.py     one writer per run folder
- provenance.py   what a run did: its precision, versions, commit and machine
- checkpoints.py  vocabulary and checkpoint files, and averaging checkpoints
- precision.py    bfloat16 where it pays (a measured probe, autocast wrappers)
- distributed.py  several processes (DistributedDataParallel) around the book's loop
- translation.py  translating with a checkpoint (load_translator), one answer per
                  sentence; beam search over a whole batch, n-best lists,
                  sampling, progress
- multi30k.py     downloading Multi30k and checking its files against their digests
- scoring.py      evaluate: a translator's BLEU on a split, with its signatures
- reproduce.py    reproduce: train, average, choose on validation, score the test
                  set once (the README's Results)
- reports.py      a reproduced run's reports: its Results row, Markdown page and
                  training curve
- figures.py      the book's diagrams and charts as PNG files
- flops.py        a training run's useful FLOPs, which a profile's budget spends
- fast.py         speed tricks: a cheaper dropout, fused attention, a fused
                  label-smoothing loss, the packed training step (no work on
                  padding; Q, K, V in one product)
- kv_cache.py     decoding's key/value cache, made once and written in place
                  (DecodingCache)
- files.py        one atomic write for every file the project writes (and what a
                  full disk says)

The modules use the book's (the_annotated_transformer's) public names; cli.py,
errors.py, run_lock.py and files.py need only the standard library, so that the
command line parses before anything imports torch. The book never imports this
package.
"""
