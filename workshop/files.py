"""Writing files so that a crash never leaves half of one behind.

Every file the project writes (checkpoints, vocabularies, results, figures, the
site's page) goes through `atomic_write`: the bytes go to a temporary file with a
unique name in the same folder, are flushed to disk, and the temporary file is then
renamed over the target. A reader sees the old file or
the new one, never a mixture; a write that fails leaves the old file as it was and
no temporary file behind. A write that finds the disk full raises DiskFullError,
which says where and how much space is free, even when the OSError of the full disk
reached it wrapped in another error (torch's writer wraps it in a RuntimeError).

This module uses only the standard library, so the tools in tools/ can load it by
its path without importing the rest of the workshop.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # the device is full; the user's quota is


class DiskFullError(OSError):
    """A write that found no space left on its device. `path` is the file that was
    being written, `written` how many of its bytes reached the disk, and `free` how
    many bytes are free there now."""

    def __init__(self, message, path, written, free):
        super().__init__(message)
        self.errno, self.path = errno.ENOSPC, path
        self.written, self.free = written, free


def megabytes(n):
    """A number of bytes for a message: "3.2 MB"."""
    return f"{n / 1e6:.1f} MB"


def no_space_left(error, depth=0):
    """Whether `error`, or an error it was raised from or during, says the disk
    is full."""
    if error is None or depth > 20:
        return False
    full = isinstance(error, OSError) and error.errno in NO_SPACE
    return full or no_space_left(error.__cause__ or error.__context__, depth + 1)


def atomic_write(path, write):
    """Write `path` atomically: `write(f)` writes its bytes to a binary file object.

    Returns the path. The folder is created if need be.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = file_mode(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)  # mkstemp's 0600 would hide the file from everyone else
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        written = os.stat(tmp).st_size if os.path.exists(tmp) else 0
        Path(tmp).unlink(missing_ok=True)
        if no_space_left(error):
            raise disk_full(path, written) from error
        raise
    return path


def file_mode(path):
    """The mode `open(path, "w")` would leave: the replaced file's, else 0666 less
    the umask."""
    with contextlib.suppress(FileNotFoundError):
        return stat.S_IMODE(os.stat(path).st_mode)
    umask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(umask)
    return 0o666 & ~umask


def disk_full(path, written):
    """The DiskFullError of a write of `path` that stopped after `written` bytes."""
    free = room = None
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(path.parent).free
        room = f", {megabytes(free)} free there"
    done = f"{megabytes(written)} of {path.name} written{room or ''}"
    message = f"no space left on the device of {path.parent} ({done}): {path} is as "
    message += "it was before. Free some space, then run the command again."
    return DiskFullError(message, path, written, free)


def why_unwritable(path, folder=False):
    """Why `path` cannot be written, as a file (or, folder=True, as a folder that
    holds files), as a phrase for a message; None when nothing says it cannot.

    Checked before any work, so that a long command does not fail at its end: the
    path may not be a folder where a file is meant (or a file where a folder is),
    the nearest part of it that exists must be a folder, and one this user may
    write in. Folders that do not exist yet are made when it is written.
    """
    path = Path(path).absolute()
    if path.is_dir() != folder and path.exists():
        return f"{path} is a {'file' if folder else 'folder'}"
    existing = path if path.is_dir() else next(p for p in path.parents if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is a folder this user may not write in"
    return None


def atomic_write_bytes(path, data):
    """Write `data` (bytes) to `path` atomically; returns the path."""
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path, text):
    """Write `text` to `path` as UTF-8, atomically; returns the path."""
    return atomic_write_bytes(path, text.encode("utf-8"))
