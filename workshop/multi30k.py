"""Multi30k's files for the command line: downloaded with the book's fetch_multi30k
(its addresses and published digests), and each split checked against its digests
before a run or a score reads it. Every failure is one line that names the file."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import http.client
import urllib.error
import zlib
from pathlib import Path
from urllib.parse import urlsplit

import the_annotated_transformer as tat
from the_annotated_transformer import (
    DATA_ENV,
    MULTI30K_SHA256,
    MULTI30K_URL,
    DigestMismatch,
)
from workshop.errors import DataError, UsageError


def how_to_get_data(data_dir):
    return (
        f"Run `make data` or `python -m workshop download --data-dir {data_dir}`, or "
        f"point --data-dir (or ${DATA_ENV}) at a folder that holds the files."
    )


def sha256_of(path):
    """The SHA-256 hex digest of a file."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_published(path):
    """Whether `path` is a file with its published SHA-256 (by its name)."""
    return path.is_file() and sha256_of(path) == MULTI30K_SHA256[path.name]


def download_multi30k(data_dir=None, *, base_url=MULTI30K_URL, quiet=False, timeout=60):
    """Fetch and verify the six Multi30k files into `data_dir` (the book's default
    folder when None); returns their paths. Files already there with the published
    digest are kept; `timeout` is the seconds to wait for each answer. A failure is
    one DataError naming the file; the folders this call made are removed again if
    they hold nothing."""
    try:
        scheme, host = urlsplit(base_url)[:2]
    except ValueError:
        scheme = host = ""
    if not (scheme == "file" or (scheme in ("http", "https") and host)):
        raise UsageError(
            f"{base_url!r} is not an address to download Multi30k from: give the "
            "http://, https:// or file:// address of a folder with the six files."
        )
    base_url = base_url if base_url.endswith("/") else base_url + "/"
    data_dir = Path(data_dir) if data_dir is not None else tat.default_data_dir()
    created = [p for p in (data_dir, *data_dir.parents) if not p.exists()]
    paths = [data_dir / name for name in MULTI30K_SHA256]
    present = {path.name: is_published(path) for path in paths}
    try:
        tat.fetch_multi30k(data_dir, base_url, timeout=timeout)
    except (DigestMismatch, OSError, http.client.HTTPException) as error:
        why = error.reason if type(error) is urllib.error.URLError else error
        why = why if data_dir.is_dir() else f"{data_dir} is not a folder"
        for folder in created:  # deepest first; a folder that holds files stays
            with contextlib.suppress(OSError):
                folder.rmdir()
        # The files are fetched in order: the first one not there is the one.
        name = next((p.name for p in paths if not is_published(p)), paths[0].name)
        raise DataError(
            f"{name}: could not download it from {base_url} into {data_dir} ({why}); "
            "the files before it are kept. Check the address, the connection and the "
            f"folder, then try again, or give a folder that holds the six files: "
            f"--data-dir DIR or ${DATA_ENV}."
        ) from None
    if not quiet:
        for name, kept in present.items():
            print(f"{name}: {'present' if kept else 'downloaded'} and verified")
        print(f"Multi30k is in {data_dir}")
    return paths


def verify_split(data_dir, split):
    """Raise a DataError that names the file and the fix when a file of `split` is
    missing, differs from the published one (a split without a published digest
    skips that check), is not gzipped UTF-8 text, or when the two sides have
    different numbers of lines."""
    data_dir, lines, how = Path(data_dir), [], how_to_get_data(data_dir)
    for lang in (tat.SRC_LANG, tat.TGT_LANG):
        path = data_dir / f"{split}.{lang}.gz"
        expected = MULTI30K_SHA256.get(path.name)
        if not path.is_file():
            other = (  # a split `download` does not fetch
                f"Put {split}.{tat.SRC_LANG}.gz and {split}.{tat.TGT_LANG}.gz (gzipped "
                f"text, a sentence a line) in {data_dir}."
            )
            raise DataError(f"{path} not found. {how if expected else other}")
        again = f"delete it and download it again. {how}"
        if expected is not None and sha256_of(path) != expected:
            raise DataError(f"{path} is not the published file (its SHA-256): {again}")
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                lines.append(sum(1 for _ in f))
        except (OSError, EOFError, zlib.error, UnicodeDecodeError) as error:
            what = f"is not a readable gzip file of UTF-8 text ({error})"
            raise DataError(f"{path} {what}: {again}") from None
    if lines[0] != lines[1]:
        sides = f"{split}.{tat.SRC_LANG}.gz has {lines[0]} lines but the other has"
        raise DataError(f"{sides} {lines[1]}: the two must be line-aligned. {how}")


def read_split(data_dir, split):
    """The book's read_split, after verify_split has checked the split's files."""
    verify_split(data_dir, split)
    return tat.read_split(data_dir, split)
