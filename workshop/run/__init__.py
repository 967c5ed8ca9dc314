"""A training run: its settings, data, model and loss set up around the book's, the
training loop around the book's run_epoch, checkpoints and the run's folder (held
by one writer), several processes, precision and what a run records."""
