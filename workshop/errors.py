"""The failures the command line reports in one line, and the exit status of each.

This module uses only the standard library, so that `python -m workshop` can parse
its arguments and report a failure without importing torch.

- 2: the command line cannot work: argparse's errors, and a UsageError (an option's
  value, or a combination of options, the command cannot use). Fix the command.
- 1: the command was right but failed while it ran: a DataError (a data file or a
  checkpoint is missing or damaged), an OSError (a file, a folder, a full disk, the
  network, a run folder held by another process), out of memory, a required
  package this Python lacks (run outside the project's environment); and anything
  unexpected, a plain ValueError included (torch raises them deep inside a run),
  which the command line asks to be reported. Fix what the message names, then run
  the same command again.
- 130: interrupted (Ctrl-C).

The rule for ValueErrors: only a UsageError is the user's to fix. The workshop
raises one wherever it checks what a user passed (a UsageError is a ValueError, so
callers of the library catch it as one). The book's own checks (its `require`,
check_positive_int) raise plain ValueErrors; where the workshop hands them what a
user typed, it calls them inside `checking_input()`, which makes their ValueError a
UsageError. Any other ValueError is unexpected.
"""

from __future__ import annotations

import contextlib


class UsageError(ValueError):
    """What the user passed (an option, an argument of the library) cannot work;
    the message says what to pass instead."""


class DataError(ValueError):
    """A data file is missing, damaged or inconsistent; the message says what to do."""


def require(ok, message):
    """Raise a UsageError(message) unless `ok`: what the caller passed cannot work."""
    if not ok:
        raise UsageError(message)


@contextlib.contextmanager
def checking_input():
    """Within it, a ValueError raised by a check of what the user passed (the
    book's `require`) is raised again as a UsageError with the same message."""
    try:
        yield
    except (UsageError, DataError):
        raise
    except ValueError as error:
        raise UsageError(str(error)) from error


def exit_status(error):
    """The exit status of the command line for `error` (see the module's doc)."""
    if isinstance(error, KeyboardInterrupt):
        return 130
    return 2 if isinstance(error, UsageError) else 1


def is_expected(error):
    """Whether `error`'s message alone says what went wrong and what to do (a
    UsageError, a DataError, an OSError); anything else is reported with its type
    and a request to report it."""
    return isinstance(error, UsageError | DataError | OSError)


def is_out_of_memory(error):
    """Whether `error` says the device (a GPU, Apple's MPS or the CPU) ran out of
    memory: torch.OutOfMemoryError, or the CPU's and MPS's allocators' RuntimeError."""
    memory = isinstance(error, MemoryError) or "OutOfMemory" in type(error).__name__
    text = str(error) * isinstance(error, RuntimeError)
    return memory or "out of memory" in text or "can't allocate memory" in text
