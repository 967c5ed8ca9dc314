"""Writing files so that a crash never leaves half of one behind.

Every file the project writes (checkpoints, vocabularies, results, figures, the
site's page) goes through `atomic_write`: the bytes go to a temporary file with a
unique name in the same folder, are flushed to disk, and the temporary file is then
renamed over the target, and the folder flushed too. A reader sees the old file or
the new one, never a mixture; a write that fails leaves the old file as it was and
no temporary file behind.

This module uses only the standard library, so the tools in tools/ can load it by
its path without importing the rest of the workshop.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _fsync_folder(folder):
    """Flush a folder's entries (the rename) to disk, where the system allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open a folder; its rename is durable enough
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path, write):
    """Write `path` atomically: `write(f)` writes its bytes to a binary file object.

    Returns the path. The folder is created if need be.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    return path


def atomic_write_bytes(path, data):
    """Write `data` (bytes) to `path` atomically; returns the path."""
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path, text):
    """Write `text` to `path` as UTF-8, atomically; returns the path."""
    return atomic_write_bytes(path, text.encode("utf-8"))
