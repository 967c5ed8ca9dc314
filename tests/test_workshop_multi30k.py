"""workshop.multi30k: downloading Multi30k and checking the files' digests.

The download is served from 127.0.0.1 (conftest's multi30k_server), never from the
network. The Multi30k files are found through $ANNOTATED_TRANSFORMER_DATA: without it
these tests are skipped on a laptop, but fail in CI (CI=true).
"""

import gzip
import shutil

import pytest
from conftest import names_in, write_lines_gz

import the_annotated_transformer as tat
from workshop import multi30k, runs
from workshop.multi30k import DataError

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# ---------------------------------------------------------------------------
# Downloading Multi30k (from a local server)


def test_download_fetches_the_six_files_and_verifies_their_digests(
    multi30k_server, multi30k_dir, tmp_path
):
    target = tmp_path / "data"
    paths = multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert sorted(p.name for p in paths) == sorted(multi30k.MULTI30K_SHA256)
    assert names_in(target) == sorted(
        multi30k.MULTI30K_SHA256
    )  # no temporary files left
    for name, digest in multi30k.MULTI30K_SHA256.items():
        assert (target / name).read_bytes() == (multi30k_dir / name).read_bytes()
        assert multi30k.sha256_of(target / name) == digest
    assert sorted(multi30k_server.requested) == sorted(multi30k.MULTI30K_SHA256)


def test_download_again_reuses_verified_files_without_asking_the_server(
    multi30k_server, tmp_path
):
    target = tmp_path / "data"
    multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert len(multi30k_server.requested) == 6
    multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert len(multi30k_server.requested) == 6


def test_download_fetches_again_only_a_local_file_that_fails_its_digest(
    multi30k_server, tmp_path
):
    target = tmp_path / "data"
    multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    damaged = target / "val.de.gz"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    multi30k_server.requested.clear()
    multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert multi30k_server.requested == ["val.de.gz"]
    assert multi30k.sha256_of(damaged) == multi30k.MULTI30K_SHA256["val.de.gz"]


def test_download_with_a_wrong_digest_raises_and_leaves_nothing_for_that_file(
    multi30k_server, tmp_path
):
    served = multi30k_server.folder / "val.en.gz"
    served.write_bytes(b"corrupted" + served.read_bytes()[9:])
    target = tmp_path / "data"
    with pytest.raises(DataError, match=r"val\.en\.gz") as error:
        multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert "SHA-256" in str(error.value)
    assert "val.en.gz" in multi30k_server.requested
    assert not [name for name in names_in(target) if "val.en.gz" in name]


def test_download_of_a_file_the_server_does_not_have_names_the_file(
    multi30k_server, tmp_path
):
    (multi30k_server.folder / "test_2016_flickr.en.gz").unlink()
    target = tmp_path / "data"
    with pytest.raises(DataError, match=r"test_2016_flickr\.en\.gz") as error:
        multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert "404" in str(error.value)
    assert not [n for n in names_in(target) if "test_2016_flickr.en.gz" in n]


# ---------------------------------------------------------------------------
# Reading a split: the workshop's reader checks what the book's reads


READERS = pytest.mark.parametrize(
    "read_split",
    [tat.read_split, multi30k.read_split],
    ids=["book's read_split", "multi30k.read_split"],
)


def test_read_split_of_a_missing_file_names_it_and_says_how_to_download(tmp_path):
    with pytest.raises(DataError, match=r"train\.de\.gz") as error:
        multi30k.read_split(tmp_path, "train")
    assert "download" in str(error.value)


def test_read_split_rejects_a_truncated_copy_of_a_published_file(
    multi30k_dir, tmp_path
):
    whole = (multi30k_dir / "val.de.gz").read_bytes()
    (tmp_path / "val.de.gz").write_bytes(whole[: len(whole) // 2])
    shutil.copyfile(multi30k_dir / "val.en.gz", tmp_path / "val.en.gz")
    with pytest.raises(DataError, match=r"val\.de\.gz"):
        multi30k.read_split(tmp_path, "val")


def recompressed(source, target):
    """Write `source`'s text to `target` as another gzip stream: the same lines,
    other bytes (so another SHA-256)."""
    with gzip.open(source, "rb") as f:
        text = f.read()
    with gzip.GzipFile(target, "wb", compresslevel=1, mtime=12345) as f:
        f.write(text)
    assert target.read_bytes() != source.read_bytes()


def test_only_the_workshop_reader_refuses_a_file_whose_digest_differs(
    multi30k_dir, tmp_path
):
    recompressed(multi30k_dir / "val.de.gz", tmp_path / "val.de.gz")
    shutil.copyfile(multi30k_dir / "val.en.gz", tmp_path / "val.en.gz")
    # The book reads what the file says; the digest is the workshop's check.
    assert tat.read_split(tmp_path, "val") == tat.read_split(multi30k_dir, "val")
    for check in (multi30k.verify_split, multi30k.read_split):
        with pytest.raises(DataError, match="SHA-256") as error:
            check(tmp_path, "val")
        assert "val.de.gz" in str(error.value) and "download" in str(error.value)
    multi30k.verify_split(multi30k_dir, "val")  # the published files pass


def test_verify_split_passes_a_split_without_a_published_digest(tmp_path):
    write_lines_gz(tmp_path / "mine.de.gz", ["Ein Hund."])
    write_lines_gz(tmp_path / "mine.en.gz", ["A dog."])
    multi30k.verify_split(tmp_path, "mine")
    assert multi30k.read_split(tmp_path, "mine") == [("Ein Hund.", "A dog.")]


def test_a_run_checks_the_digests_before_reading_the_data(multi30k_dir, tmp_path):
    recompressed(multi30k_dir / "train.de.gz", tmp_path / "train.de.gz")
    for name in ("train.en.gz", "val.de.gz", "val.en.gz"):
        shutil.copyfile(multi30k_dir / name, tmp_path / name)
    config = runs.RunConfig.from_profile("smoke")
    with pytest.raises(DataError, match=r"train\.de\.gz .*SHA-256"):
        runs.prepare_run_data(config, tmp_path)


@READERS
def test_read_split_reads_an_aligned_split_of_any_name(read_split, tmp_path):
    write_lines_gz(tmp_path / "mine.de.gz", ["Zwei Männer.", "Eine Frau läuft."])
    write_lines_gz(tmp_path / "mine.en.gz", ["Two men.", "A woman runs."])
    assert read_split(tmp_path, "mine") == [
        ("Zwei Männer.", "Two men."),
        ("Eine Frau läuft.", "A woman runs."),
    ]


def test_read_split_rejects_a_damaged_gzip_of_a_split_without_a_digest(tmp_path):
    write_lines_gz(tmp_path / "mine.de.gz", ["Ein Hund."] * 200)
    whole = (tmp_path / "mine.de.gz").read_bytes()
    (tmp_path / "mine.de.gz").write_bytes(whole[: len(whole) // 2])
    write_lines_gz(tmp_path / "mine.en.gz", ["A dog."] * 200)
    with pytest.raises(DataError, match=r"mine\.de\.gz"):
        multi30k.read_split(tmp_path, "mine")


def test_read_split_of_sides_with_different_line_counts_reports_both_counts(tmp_path):
    write_lines_gz(tmp_path / "mine.de.gz", ["Ein Hund.", "Eine Katze.", "Ein Pferd."])
    write_lines_gz(tmp_path / "mine.en.gz", ["A dog.", "A cat."])
    with pytest.raises(DataError, match="line-aligned") as error:
        multi30k.read_split(tmp_path, "mine")
    assert "has 3 lines" in str(error.value)
    assert "has 2" in str(error.value)
