"""Multi30k's files: download them, and check them against their published digests.

The file names, their SHA-256 digests and the address come from the book
(`MULTI30K_SHA256`, `MULTI30K_URL`), which fetches them itself in the notebook; this
module adds what the command line needs: a report per file, a check of files already
there, and one clear line when something goes wrong.
"""

from __future__ import annotations

import http.client
from pathlib import Path

import the_annotated_transformer as tat
from the_annotated_transformer import DATA_ENV, MULTI30K_SHA256, MULTI30K_URL

__all__ = [
    "MULTI30K_SHA256",
    "MULTI30K_SIZES",
    "MULTI30K_URL",
    "DataError",
    "download_multi30k",
    "read_split",
    "verify_split",
]


class DataError(ValueError):
    """A data file is missing, damaged or inconsistent; the message says what to do."""


def how_to_get_data(data_dir):
    return (
        f"Run `make data` or `python -m workshop download --data-dir {data_dir}`, or "
        f"point --data-dir (or ${DATA_ENV}) at a folder that holds the files."
    )


MULTI30K_SIZES = {"train": 29000, "val": 1014, "test_2016_flickr": 1000}


def sha256_of(path):
    """The SHA-256 hex digest of a file."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# What every download error ends with: where else the files can come from.
ELSEWHERE = (
    f"give a folder that holds the six files instead: --data-dir DIR or "
    f"${DATA_ENV} (for make: DATA_DIR=DIR)"
)


def checked_base_url(base_url):
    """`base_url` ending in a slash, or a DataError when it is no address to fetch
    from (http, https or file)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(base_url)
    except ValueError:
        parts = None
    remote = parts is not None and parts.scheme in ("http", "https") and parts.netloc
    if not (remote or (parts is not None and parts.scheme == "file")):
        raise DataError(
            f"{base_url!r} is not an address to download Multi30k from: give the "
            f"http://, https:// or file:// address of the folder that holds the six "
            f"files (the default is {MULTI30K_URL})."
        )
    return base_url if base_url.endswith("/") else base_url + "/"


def _download_failure(name, base_url, error):
    """The one-line DataError for a file that could not be downloaded."""
    if isinstance(error, RuntimeError):  # torch.hub's message for a wrong digest
        return DataError(
            f"{name}: the file downloaded from {base_url} is not the published one "
            f"(its SHA-256 differs: {error}): the download was cut short, or the "
            f"file there changed; nothing was saved. Try again, or {ELSEWHERE}."
        )
    if hasattr(error, "code"):  # an HTTP error: the server answered, without the file
        reason = f"HTTP {error.code}: {error.reason}"
    else:  # no answer: the network, the name or the connection failed
        reason = getattr(error, "reason", None) or str(error) or type(error).__name__
    return DataError(
        f"{name}: could not download it from {base_url} ({reason}); nothing was "
        f"saved. Check the connection, or {ELSEWHERE}."
    )


def _cannot_hold(data_dir, error):
    """The DataError for a folder that cannot be made, or written to."""
    reason = error.strerror or error
    if isinstance(error, FileExistsError):
        reason = "it is a file, not a folder"
    return DataError(
        f"{data_dir} cannot hold the Multi30k files ({reason}): name another folder "
        f"with --data-dir DIR or ${DATA_ENV}."
    )


def download_multi30k(data_dir=None, *, base_url=MULTI30K_URL, quiet=False):
    """Fetch and verify the six Multi30k files into `data_dir` (the book's default
    folder when None); returns their paths. A file already there with the published
    digest is kept (a read-only folder that holds them all is fine); any other is
    downloaded again, through torch.hub's download, which checks the digest before
    the file takes its name.

    Any failure is one DataError line that names the file; what was downloaded
    halfway is removed, and so are the folders this call created if they hold
    nothing (the files verified before the failure stay).
    """
    import shutil
    import socket
    import tempfile

    from torch.hub import download_url_to_file

    base_url = checked_base_url(base_url)
    data_dir = Path(data_dir) if data_dir is not None else tat.default_data_dir()
    created = [p for p in (data_dir, *data_dir.parents) if not p.exists()]
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _cannot_hold(data_dir, error) from None
    # Each file is fetched into a private folder beside the targets and moved into
    # place once verified, so that no half-written file can be left among them,
    # whatever fails (torch.hub removes its own temporary file on most failures,
    # not all: a malformed address, say). A silent server ends the wait at last.
    scratch, timeout = None, socket.getdefaulttimeout()
    socket.setdefaulttimeout(60)
    paths = []
    try:
        for name, expected in MULTI30K_SHA256.items():
            target = data_dir / name
            paths.append(target)
            present = target.is_file()
            if present and sha256_of(target) == expected:
                if not quiet:
                    print(f"{name}: present and verified")
                continue
            if scratch is None:
                try:
                    scratch = Path(tempfile.mkdtemp(prefix=".download-", dir=data_dir))
                except OSError as error:
                    raise _cannot_hold(data_dir, error) from None
            try:
                download_url_to_file(
                    base_url + name, str(scratch / name), expected, progress=False
                )
            except (OSError, ValueError, RuntimeError, http.client.HTTPException) as e:
                raise _download_failure(name, base_url, e) from None  # URLError too
            (scratch / name).replace(target)
            if not quiet:
                again = " again (the copy here had another SHA-256)" if present else ""
                print(f"{name}: downloaded{again} and verified")
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        for folder in created:  # deepest first; a folder that holds files stays
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    finally:
        socket.setdefaulttimeout(timeout)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if not quiet:
        print(f"Multi30k is in {data_dir}")
    return paths


def verify_split(data_dir, split):
    """Raise a DataError that names the file and the fix when a file of `split` is
    missing, differs from the published one (splits without a published digest,
    such as other test sets, skip that check), is not gzipped UTF-8 text, or when
    the two sides have different numbers of lines."""
    import gzip
    import zlib

    data_dir, lines = Path(data_dir), []
    for lang in (tat.SRC_LANG, tat.TGT_LANG):
        path = data_dir / f"{split}.{lang}.gz"
        if not path.is_file():
            raise DataError(f"{path} not found. {how_to_get_data(data_dir)}")
        expected = MULTI30K_SHA256.get(path.name)
        if expected is not None and sha256_of(path) != expected:
            raise DataError(
                f"{path} is damaged or truncated (its SHA-256 differs from the "
                f"published one). Delete it and download it again. "
                f"{how_to_get_data(data_dir)}"
            )
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                lines.append(sum(1 for _ in f))
        except (OSError, EOFError, zlib.error, UnicodeDecodeError) as error:
            raise DataError(
                f"{path} is not a readable gzip file of UTF-8 text ({error}). "
                f"Delete it and download it again. {how_to_get_data(data_dir)}"
            ) from error
    if lines[0] != lines[1]:
        raise DataError(
            f"{split}: {split}.{tat.SRC_LANG}.gz has {lines[0]} lines but "
            f"{split}.{tat.TGT_LANG}.gz has {lines[1]}; the two sides must be "
            f"line-aligned. Replace them with matching files. "
            f"{how_to_get_data(data_dir)}"
        )


def read_split(data_dir, split):
    """The book's read_split, after verify_split has checked the split's files."""
    verify_split(data_dir, split)
    return tat.read_split(data_dir, split)
