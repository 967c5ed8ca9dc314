"""Multi30k's files: download them, and check them against their published digests."""

from __future__ import annotations

import os
from pathlib import Path

import the_annotated_transformer as tat
from the_annotated_transformer import DATA_ENV


class DataError(ValueError):
    """A data file is missing, damaged or inconsistent; the message says what to do."""


def how_to_get_data(data_dir):
    return (
        f"Download the files with `python the_annotated_transformer.py download "
        f"--data-dir {data_dir}`, or point --data-dir (or ${DATA_ENV}) at a folder "
        "that holds them."
    )


MULTI30K_URL = (
    "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
)


MULTI30K_SHA256 = {
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "test_2016_flickr.de.gz": (
        "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8"
    ),
    "test_2016_flickr.en.gz": (
        "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9"
    ),
}


MULTI30K_SIZES = {"train": 29000, "val": 1014, "test_2016_flickr": 1000}


def sha256_of(path):
    """The SHA-256 hex digest of a file."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_multi30k(data_dir, *, base_url=MULTI30K_URL, quiet=False, timeout=60):
    """Fetch and verify the six Multi30k files into `data_dir`; returns their paths."""
    import http.client
    import urllib.request

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, expected in MULTI30K_SHA256.items():
        target = data_dir / name
        paths.append(target)
        if target.exists() and sha256_of(target) == expected:
            if not quiet:
                print(f"{name}: present and verified")
            continue
        tmp = data_dir / f".{name}.part{os.getpid()}"
        try:
            with urllib.request.urlopen(base_url + name, timeout=timeout) as response:
                announced = response.headers.get("Content-Length")
                with open(tmp, "wb") as out:
                    for chunk in iter(lambda: response.read(1 << 16), b""):
                        out.write(chunk)
            if announced is not None and tmp.stat().st_size != int(announced):
                raise DataError(
                    f"{name}: the connection closed after {tmp.stat().st_size} of "
                    f"{announced} bytes; nothing was saved. Run the download again."
                )
            actual = sha256_of(tmp)
            if actual != expected:
                raise DataError(
                    f"{name}: the downloaded file has SHA-256 {actual}, expected "
                    f"{expected}. The download was damaged or the file changed at "
                    f"{base_url}; nothing was saved. Try again, or fetch the file by "
                    f"hand into {data_dir}."
                )
            os.replace(tmp, target)
        except (OSError, http.client.HTTPException) as error:  # IncompleteRead too
            raise DataError(
                f"{name}: could not download it from {base_url} ({error}). Check the "
                f"connection, or copy the file into {data_dir} by hand."
            ) from error
        finally:
            tmp.unlink(missing_ok=True)
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
