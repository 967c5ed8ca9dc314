"""The failures the command line reports in one line, and the exit status of each.

This module uses only the standard library, so that `python -m workshop` can parse
its arguments and report a failure without importing torch.

- 2: the command line is wrong (argparse's errors, and a ValueError: an option's
  value or a combination of options the command cannot use). Fix the command.
- 1: the command was right but failed while it ran (a DataError: a data file or a
  checkpoint is missing or damaged; an OSError: a file, a folder, a full disk, the
  network; a run folder held by another process; out of memory; anything
  unexpected). Fix what the message names, then run the same command again.
- 130: interrupted (Ctrl-C).
"""

from __future__ import annotations

USAGE, FAILURE, INTERRUPTED = 2, 1, 130


class DataError(ValueError):
    """A data file is missing, damaged or inconsistent; the message says what to do."""


def exit_status(error):
    """The exit status of the command line for `error` (see the module's doc)."""
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(error, ValueError) and not isinstance(error, DataError):
        return USAGE
    return FAILURE


def is_out_of_memory(error):
    """Whether `error` says the device (a GPU, Apple's MPS or the CPU) ran out of
    memory: torch.OutOfMemoryError, or the CPU's and MPS's allocators' RuntimeError."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )
