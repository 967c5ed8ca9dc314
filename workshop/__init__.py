"""The workshop beside the book: everything a long run needs and a reader does not.

- cli.py, __main__.py  the command line of `python -m workshop COMMAND`: its
                       arguments (parsed before torch is imported) and how it ends
- commands.py          what each command runs
- errors.py            which failures exit 2, 1 or 130
- files.py             one atomic write for every file the project writes
- multi30k.py          downloading Multi30k and checking its files
- run/                 a training run: settings (RunConfig, the profiles), the
                       training loop around the book's run_epoch (train_model),
                       checkpoints and run folders, one writer per folder, several
                       processes, precision, what a run records
- translate/           translation.py: translating with a checkpoint
                       (load_translator) with the book's searches and a sampler,
                       n-best lists, progress; scoring.py: a translator's BLEU
- report/              reproduce.py: the README's Results (train, average, choose
                       on validation, score the test set once); reports.py: their
                       row, page and training curve; figures.py: the book's charts,
                       diagrams and attention maps as PNG

The modules use the book's (the_annotated_transformer's) public names and extend
its classes, never copy them; cli.py, errors.py and files.py need only the standard
library, so that the command line parses before anything imports torch. The book
never imports this package.
"""
