"""Multi30k's files: download them, and check them against their published digests.

The file names, their SHA-256 digests, the address and the one downloader come
from the book (`MULTI30K_SHA256`, `MULTI30K_URL`, `fetch_multi30k`), which the
notebook uses itself; this module adds what the command line needs: a report per
file, and one clear line, naming the file, for what actually went wrong (no
network, no answer in time, an HTTP error, a file that is not the published one,
a folder that cannot hold the files or a full disk).
"""

from __future__ import annotations

import http.client
import ssl
import urllib.error
from pathlib import Path

import the_annotated_transformer as tat
from the_annotated_transformer import (
    DATA_ENV,
    MULTI30K_SHA256,
    MULTI30K_URL,
    DigestMismatch,
)
from workshop.errors import DataError, UsageError

__all__ = [
    "MULTI30K_SHA256",
    "MULTI30K_SIZES",
    "MULTI30K_URL",
    "DataError",
    "download_multi30k",
    "read_split",
    "verify_split",
]


def how_to_get_data(data_dir):
    return (
        f"Run `make data` or `python -m workshop download --data-dir {data_dir}`, or "
        f"point --data-dir (or ${DATA_ENV}) at a folder that holds the files."
    )


def how_to_get_other_split(data_dir, split):
    """What to do for a split that `make data` does not fetch: put its two files
    there; and which splits the folder holds."""
    src, tgt = f".{tat.SRC_LANG}.gz", f".{tat.TGT_LANG}.gz"
    there = sorted(
        p.name.removesuffix(src)
        for p in Path(data_dir).glob(f"*{src}")
        if p.with_name(p.name.removesuffix(src) + tgt).is_file()
    )
    fetched = sorted({name.split(".")[0] for name in MULTI30K_SHA256})
    return (
        f"`make data` and `download` fetch only {', '.join(fetched)}: for {split}, put "
        f"{split}{src} and {split}{tgt} (gzipped text, one sentence a line) in "
        f"{data_dir}. Splits there: {', '.join(there) or 'none'}."
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


def is_published(path):
    """Whether `path` is a file with its published SHA-256 (by its name)."""
    return path.is_file() and sha256_of(path) == MULTI30K_SHA256[path.name]


# What every download error ends with: where else the files can come from.
ELSEWHERE = (
    f"give a folder that holds the six files instead: --data-dir DIR or "
    f"${DATA_ENV} (for make: DATA_DIR=DIR)"
)

# The errors of the network's side of a download, as urllib and http.client raise
# them; any other OSError comes from writing the file.
NETWORK_ERRORS = (
    urllib.error.URLError,
    TimeoutError,
    ConnectionError,
    ssl.SSLError,
    http.client.HTTPException,
)


def checked_base_url(base_url):
    """`base_url` ending in a slash, or a UsageError when it is no
    address to fetch from (http, https or file)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(base_url)
    except ValueError:
        parts = None
    remote = parts is not None and parts.scheme in ("http", "https") and parts.netloc
    if not (remote or (parts is not None and parts.scheme == "file")):
        raise UsageError(
            f"{base_url!r} is not an address to download Multi30k from: give the "
            f"http://, https:// or file:// address of the folder that holds the six "
            f"files (the default is {MULTI30K_URL})."
        )
    return base_url if base_url.endswith("/") else base_url + "/"


def _download_failure(name, base_url, data_dir, timeout, error):
    """The one-line DataError for `name`, which could not be fetched into
    `data_dir`: what went wrong, from the error's kind."""
    reason = getattr(error, "reason", None)
    if isinstance(error, DigestMismatch):
        what = (
            f"the file downloaded from {base_url} is not the published one (its "
            "SHA-256 differs): the download was cut short, or the file there changed"
        )
    elif isinstance(error, urllib.error.HTTPError):
        what = f"{base_url} answered HTTP {error.code} ({error.reason})"
    elif isinstance(error, TimeoutError) or isinstance(reason, TimeoutError):
        what = f"no answer from {base_url} within {timeout:g} s"
    elif isinstance(error, NETWORK_ERRORS):
        why = reason or str(error) or type(error).__name__
        what = f"could not download it from {base_url} ({why})"
    else:  # any other OSError: writing it (the folder, its permissions, the disk)
        why = getattr(error, "strerror", None) or error
        return DataError(
            f"{name}: could not save it in {data_dir} ({why}); the files saved "
            f"before it are kept. Free some space, or {ELSEWHERE}."
        )
    return DataError(
        f"{name}: {what}; nothing was saved. Check the connection and try again, "
        f"or {ELSEWHERE}."
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


def download_multi30k(data_dir=None, *, base_url=MULTI30K_URL, quiet=False, timeout=60):
    """Fetch and verify the six Multi30k files into `data_dir` (the book's default
    folder when None) with the book's fetch_multi30k; returns their paths. A file
    already there with the published digest is kept (a read-only folder that holds
    them all is fine); any other is downloaded again. `timeout`: seconds to wait
    for each answer of the server.

    Any failure is one DataError line that names the file and says what went
    wrong; nothing half-written is left, and the folders this call created are
    removed again if they hold nothing (the files verified before the failure stay).
    """
    base_url = checked_base_url(base_url)
    data_dir = Path(data_dir) if data_dir is not None else tat.default_data_dir()
    created = [p for p in (data_dir, *data_dir.parents) if not p.exists()]
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _cannot_hold(data_dir, error) from None
    paths = [data_dir / name for name in MULTI30K_SHA256]
    before = {path.name: (path.is_file(), is_published(path)) for path in paths}
    try:
        tat.fetch_multi30k(data_dir, base_url, timeout=timeout)
    except BaseException as error:
        for folder in created:  # deepest first; a folder that holds files stays
            try:
                folder.rmdir()
            except OSError:
                break
        if not isinstance(error, (DigestMismatch, OSError, *NETWORK_ERRORS)):
            raise  # Ctrl-C, or a bug: as it is
        # The files are fetched in order: the first one not there is the one.
        name = next((p.name for p in paths if not is_published(p)), paths[0].name)
        raise _download_failure(name, base_url, data_dir, timeout, error) from None
    if not quiet:
        for name, (present, published) in before.items():
            if published:
                print(f"{name}: present and verified")
            elif present:
                print(
                    f"{name}: downloaded again (the copy here had another SHA-256) "
                    "and verified"
                )
            else:
                print(f"{name}: downloaded and verified")
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
        if not path.is_file() and path.name not in MULTI30K_SHA256:
            raise DataError(
                f"{path} not found. {how_to_get_other_split(data_dir, split)}"
            )
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
