"""One writer per run folder: a run holds `FOLDER/.run.lock` (a `filelock` lock) from
before it writes anything into FOLDER until it ends. A second run into the same
folder (two terminals, a notebook beside the command line, `make multi30k` started
twice) is refused in one line that names the folder, instead of mixing its
checkpoints with the first run's. The operating system lets go of the lock when the
process ends, however it ends (`kill -9` included), so a killed run never blocks its
own `--resume`."""

from __future__ import annotations

import contextlib
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_NAME = ".run.lock"


class FolderInUseError(OSError):
    """A run folder is held by another process; the message names it."""


@contextlib.contextmanager
def hold_run_folder(folder):
    """Hold the existing folder `folder` for this process while the block runs;
    FolderInUseError, at once, if another process holds it."""
    path = Path(folder) / LOCK_NAME
    lock = FileLock(path, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        what = f"{folder} is in use: another process is writing a run there ({path})"
        raise FolderInUseError(
            f"{what}: wait for it to end, or give another --out."
        ) from None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # gone before the lock: none can hold it
            path.unlink()
        lock.release()


def refuse_if_held(folder):
    """Raise FolderInUseError if another process holds `folder`. Where no run
    holds it or was killed holding it, it creates nothing, so it can run before the
    inputs of a run are checked."""
    if (Path(folder) / LOCK_NAME).exists():
        with hold_run_folder(folder):
            pass
