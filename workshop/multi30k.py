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


def download_multi30k(data_dir=None, *, base_url=MULTI30K_URL, quiet=False):
    """Fetch and verify the six Multi30k files into `data_dir` (the book's default
    folder when None); returns their paths. A file already there with the published
    digest is kept; any other is downloaded again."""
    from torch.hub import download_url_to_file

    data_dir = Path(data_dir) if data_dir is not None else tat.default_data_dir()
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, expected in MULTI30K_SHA256.items():
        target = data_dir / name
        paths.append(target)
        if target.is_file() and sha256_of(target) == expected:
            if not quiet:
                print(f"{name}: present and verified")
            continue
        try:  # a temporary file beside the target, moved into place once verified
            download_url_to_file(base_url + name, str(target), expected, False)
        except RuntimeError as error:  # torch.hub's message for a wrong digest
            raise DataError(
                f"{name}: the file downloaded from {base_url} is not the published "
                f"one (its SHA-256 differs: {error}); nothing was saved. Try again "
                f"later, or copy the files into {data_dir} by hand."
            ) from None
        except (OSError, http.client.HTTPException) as error:  # URLError is OSError
            if hasattr(error, "code"):  # an HTTP error: the server answered, with no
                reason = f"HTTP {error.code}: {error.reason}"  # file for us
            else:  # no answer: the network, the name or the connection failed
                reason = getattr(error, "reason", None) or error
            raise DataError(
                f"{name}: could not download it from {base_url} ({reason}). Check "
                f"the connection, or name a folder that holds the files: --data-dir, "
                f"${DATA_ENV}, or make's DATA_DIR."
            ) from None
        if not quiet:
            print(f"{name}: downloaded and verified")
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
