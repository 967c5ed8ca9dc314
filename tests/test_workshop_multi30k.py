"""workshop.multi30k: downloading Multi30k and checking the files' digests.

The download is served from 127.0.0.1 (conftest's multi30k_server), never from the
network; a closed port on 127.0.0.1 stands for a machine without network. The
Multi30k files are found through $ANNOTATED_TRANSFORMER_DATA: without them these tests
are skipped on a laptop, but fail in CI (CI=true).
"""

import errno
import functools
import gzip
import pathlib
import shutil
import socket
import urllib.request

import pytest
from conftest import free_port, names_in, write_lines_gz

import the_annotated_transformer as tat
from workshop import cli, multi30k
from workshop.errors import DataError
from workshop.run import run_data, settings

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


def test_download_replaces_a_file_whose_digest_differs_and_says_so(
    multi30k_server, multi30k_dir, tmp_path, capsys
):
    target = tmp_path / "data"
    target.mkdir()
    for name in multi30k.MULTI30K_SHA256:
        shutil.copyfile(multi30k_dir / name, target / name)
    (target / "train.en.gz").write_bytes(b"not the published file")
    multi30k.download_multi30k(target, base_url=multi30k_server.url)
    assert multi30k_server.requested == ["train.en.gz"]
    assert (
        multi30k.sha256_of(target / "train.en.gz")
        == (multi30k.MULTI30K_SHA256["train.en.gz"])
    )
    said = capsys.readouterr().out.splitlines()
    assert "train.de.gz: present and verified" in said
    assert "train.en.gz: downloaded and verified" in said
    assert names_in(target) == sorted(multi30k.MULTI30K_SHA256)


def test_download_into_a_complete_folder_fetches_and_writes_nothing(
    multi30k_dir, monkeypatch, capsys
):
    # Every file there and verified: nothing is fetched and nothing is written (so a
    # shared, read-only copy is fine), even without network.
    def no_download(*args, **kwargs):
        raise AssertionError("downloaded a verified file")

    monkeypatch.setattr(urllib.request, "urlopen", no_download)
    closed = f"http://127.0.0.1:{free_port()}/"
    before = names_in(multi30k_dir)
    multi30k.download_multi30k(multi30k_dir, base_url=closed)
    assert capsys.readouterr().out.count("present and verified") == 6
    assert names_in(multi30k_dir) == before


def test_download_without_network_names_the_file_and_leaves_no_folder_behind(
    tmp_path,
):
    closed = f"http://127.0.0.1:{free_port()}/"  # nothing listens: as if offline
    target = tmp_path / "new" / "multi30k"
    with pytest.raises(DataError) as error:
        multi30k.download_multi30k(target, base_url=closed, quiet=True)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("train.de.gz: could not download it from " + closed)
    assert "--data-dir DIR" in message and f"${tat.DATA_ENV}" in message
    assert names_in(tmp_path) == []  # the folders it made are gone again


def test_download_cut_off_keeps_the_verified_files_and_nothing_partial(
    multi30k_server, tmp_path
):
    multi30k_server.cut.add("val.de.gz")
    target = tmp_path / "data"
    # Cut short, the file fails to arrive or fails its digest: either way, one error.
    with pytest.raises(DataError, match=r"^val\.de\.gz: .*files before it are kept"):
        multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert names_in(target) == ["train.de.gz", "train.en.gz"]  # verified, kept


@pytest.mark.parametrize(
    "base_url", ["notaurl", "ftp://example.org/", "http://", "http://[::1/"]
)
def test_download_from_no_address_says_what_to_give_and_creates_nothing(
    base_url, tmp_path
):
    target = tmp_path / "data"
    with pytest.raises(ValueError, match="is not an address to download") as error:
        multi30k.download_multi30k(target, base_url=base_url, quiet=True)
    assert "http://, https:// or file://" in str(error.value)
    assert not target.exists()


def test_download_adds_the_slash_a_base_address_lacks(multi30k_server, tmp_path):
    url = multi30k_server.url.rstrip("/")
    multi30k.download_multi30k(tmp_path / "data", base_url=url, quiet=True)
    assert names_in(tmp_path / "data") == sorted(multi30k.MULTI30K_SHA256)


@pytest.mark.parametrize("where", ["a file", "inside a file"])
def test_download_into_a_file_says_the_folder_cannot_hold_the_files(where, tmp_path):
    (tmp_path / "afile").write_text("")
    target = tmp_path / "afile" if where == "a file" else tmp_path / "afile" / "sub"
    with pytest.raises(DataError, match=f"into {target} .*is not a folder") as error:
        multi30k.download_multi30k(target, quiet=True)
    assert "--data-dir DIR" in str(error.value) and "\n" not in str(error.value)
    assert names_in(tmp_path) == ["afile"]


# ---------------------------------------------------------------------------
# The book's own download (the notebook's), from the same local server


def test_the_books_fetch_downloads_the_six_files_and_checks_each_digest(
    multi30k_server, multi30k_dir, tmp_path
):
    target = tmp_path / "multi30k"
    assert tat.fetch_multi30k(target, base_url=multi30k_server.url) == target
    assert names_in(target) == sorted(tat.MULTI30K_SHA256)  # nothing half-written
    for name, digest in tat.MULTI30K_SHA256.items():
        assert multi30k.sha256_of(target / name) == digest
        assert (target / name).read_bytes() == (multi30k_dir / name).read_bytes()
    tat.fetch_multi30k(target, base_url=multi30k_server.url)  # present: not fetched
    assert len(multi30k_server.requested) == 6


def test_the_books_fetch_refuses_a_file_whose_digest_differs(multi30k_server, tmp_path):
    served = multi30k_server.folder / "val.en.gz"
    served.write_bytes(served.read_bytes()[:-50])  # not the published file
    target = tmp_path / "multi30k"
    with pytest.raises(tat.DigestMismatch, match="val.en.gz .* another SHA-256"):
        tat.fetch_multi30k(target, base_url=multi30k_server.url)
    assert "val.en.gz" in multi30k_server.requested
    assert names_in(target) == ["train.de.gz", "train.en.gz", "val.de.gz"]


def test_the_books_fetch_fetches_again_a_present_file_that_is_damaged(
    multi30k_server, multi30k_dir, tmp_path
):
    target = tmp_path / "multi30k"
    tat.fetch_multi30k(target, base_url=multi30k_server.url)
    damaged = target / "val.de.gz"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    multi30k_server.requested.clear()
    tat.fetch_multi30k(target, base_url=multi30k_server.url)
    assert multi30k_server.requested == ["val.de.gz"]  # the others, re-hashed, kept
    assert damaged.read_bytes() == (multi30k_dir / "val.de.gz").read_bytes()


def test_the_download_sets_no_process_wide_socket_timeout(
    multi30k_server, tmp_path, monkeypatch
):
    """Each request has its own timeout; the process's other sockets keep theirs."""

    def refuse(timeout):
        raise AssertionError(f"socket.setdefaulttimeout({timeout}) was called")

    monkeypatch.setattr(socket, "setdefaulttimeout", refuse)
    target = tmp_path / "data"
    multi30k.download_multi30k(target, base_url=multi30k_server.url, quiet=True)
    assert names_in(target) == sorted(multi30k.MULTI30K_SHA256)


@pytest.fixture
def silent_server():
    """The address of a server on 127.0.0.1 that takes connections (the system
    queues them) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/"


def test_a_server_that_never_answers_is_a_timeout_naming_the_file(
    silent_server, tmp_path, capsys
):
    target = tmp_path / "data"
    argv = ["download", "--data-dir", str(target), "--base-url", silent_server]
    assert cli.main([*argv, "--timeout", "0.5"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        f"error: train.de.gz: could not download it from {silent_server}"
    )
    assert "timed out" in line
    assert not target.exists()


def test_a_full_disk_while_saving_a_file_is_said_as_such(
    multi30k_server, tmp_path, monkeypatch, capsys
):
    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_bytes", full)
    target = tmp_path / "data"
    argv = ["download", "--data-dir", str(target), "--base-url", multi30k_server.url]
    assert cli.main(argv) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        f"error: train.de.gz: could not download it from {multi30k_server.url}"
    )
    assert f"into {target} ([Errno 28] No space left on device)" in line
    assert "SHA-256" not in line
    assert names_in(tmp_path) == ["served"]  # nothing half-written, no folder made


def test_a_failure_that_is_no_download_error_is_not_read_as_a_bad_digest(
    multi30k_server, tmp_path, monkeypatch, capsys
):
    def bug(*args, **kwargs):
        raise RuntimeError("a bug in the downloader")

    monkeypatch.setattr(urllib.request, "urlopen", bug)
    argv = ["download", "--data-dir", str(tmp_path / "d"), "--base-url"]
    assert cli.main([*argv, multi30k_server.url]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "RuntimeError: a bug in the downloader" in line and "report it" in line
    assert "SHA-256" not in line


def test_the_notebook_without_data_or_network_says_so_in_one_line(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv(tat.DATA_ENV, raising=False)
    default = tmp_path / "data" / "multi30k"
    monkeypatch.setattr(tat, "default_data_dir", lambda: default)
    closed = f"http://127.0.0.1:{free_port()}/"  # nothing listens: as if offline
    monkeypatch.setattr(
        tat, "fetch_multi30k", functools.partial(tat.fetch_multi30k, base_url=closed)
    )
    assert tat.notebook_data_dir() is None
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and said.endswith("Skipping.\n")
    assert str(default) in said and tat.DATA_ENV in said
    assert not list(default.iterdir())  # nothing fetched, nothing half-written


def test_the_digests_are_the_books():
    # One table: the workshop checks what the book fetches.
    assert multi30k.MULTI30K_SHA256 is tat.MULTI30K_SHA256
    assert multi30k.MULTI30K_URL == tat.MULTI30K_URL
    assert sorted(multi30k.MULTI30K_SHA256) == sorted(
        f"{split}.{lang}.gz"
        for split in ("train", "val", "test_2016_flickr")
        for lang in ("de", "en")
    )


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
    config = settings.RunConfig.from_profile("smoke")
    with pytest.raises(DataError, match=r"train\.de\.gz .*SHA-256"):
        run_data.prepare_run_data(config, tmp_path)


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
