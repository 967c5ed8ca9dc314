"""One writer per run folder: an exclusive lock, held for the whole run.

A run takes `FOLDER/.run.lock` with flock(2) before it writes anything into FOLDER,
and holds it until it ends. A second run into the same folder (two terminals, a
notebook beside the command line, `make multi30k` started twice) is refused in one
line that names the process holding it, instead of mixing its checkpoints with the
first run's. The operating system releases the lock when the process ends, however
it ends (`kill -9` included), so a killed run never blocks its own `--resume`.

The lock file holds the holder's process id, for that message. It is written in
place, never through workshop.files' atomic rename (a new file would be another
lock), and removed by the holder when it lets go. Only the standard library is
used. Where the system has no flock (Windows), the lock does nothing.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; runs there are not guarded
    fcntl = None

LOCK_NAME = ".run.lock"


class FolderInUseError(OSError):
    """A run folder is held by another process; the message names it."""


def _holder_of(fd):
    """The process id written in an open lock file, or None if there is none yet."""
    text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


def _in_use(folder, pid):
    who = f"process {pid}" if pid is not None else "another process"
    return FolderInUseError(
        f"{folder} is in use: {who} is writing a run there. Wait for it to end (or "
        "stop it), then run this again; or give another --out."
    )


def refuse_if_held(folder):
    """Raise FolderInUseError if another process holds `folder`. Reads only: it
    creates nothing, so it can run before the inputs of a run are checked."""
    if fcntl is None:
        return
    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY)
    except OSError:  # no lock file (or no folder): nobody holds it
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(folder, _holder_of(fd)) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def hold_run_folder(folder):
    """Hold the existing folder `folder` for this process while the block runs;
    FolderInUseError, at once, if another process holds it."""
    if fcntl is None:
        yield
        return
    path = Path(folder) / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder_of(fd)
            os.close(fd)
            raise _in_use(folder, pid) from None
        # The previous holder removes the file as it lets go: if it did so between
        # our open and our lock, we hold a file nobody else will see. Try again.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)  # closing the last descriptor releases the lock
