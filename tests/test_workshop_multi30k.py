"""workshop.multi30k: downloading Multi30k and checking the files' digests.

The download is served from 127.0.0.1 (conftest's multi30k_server), never from the
network; a closed port on 127.0.0.1 stands for a machine without network. The
Multi30k files are found through $ANNOTATED_TRANSFORMER_DATA: without them these tests
are skipped on a laptop, but fail in CI (CI=true).
"""

import errno
import gzip
import pathlib
import shutil
import socket

import pytest
from conftest import names_in, write_lines_gz

import the_annotated_transformer as tat
from workshop import multi30k
from workshop.errors import DataError
from workshop.run import run_data, settings

ORDER = list(tat.MULTI30K_SHA256)  # the order the files are fetched in


def download(target, url, **options):
    return multi30k.download_multi30k(target, base_url=url, quiet=True, **options)


def test_download_fetches_the_six_verified_files_then_only_a_damaged_one(
    multi30k_server, multi30k_dir, tmp_path, monkeypatch, capsys
):
    # Each request has its own timeout: setting the process's would fail.
    monkeypatch.setattr(socket, "setdefaulttimeout", None)
    target = tmp_path / "data"
    url = multi30k_server.url.rstrip("/")  # the slash a base address lacks is added
    assert [p.name for p in download(target, url)] == ORDER
    download(target, url)  # all verified: nothing fetched, nothing written
    assert sorted(multi30k_server.requested) == names_in(target) == sorted(ORDER)
    damaged = target / "val.de.gz"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    multi30k.download_multi30k(target, base_url=url)
    assert multi30k_server.requested[6:] == ["val.de.gz"]
    for name in ORDER:
        assert (target / name).read_bytes() == (multi30k_dir / name).read_bytes()
    said = capsys.readouterr().out
    assert "train.en.gz: present and verified\nval.de.gz: downloaded and" in said


@pytest.mark.parametrize(
    ("name", "damage", "why"),
    [
        ("val.en.gz", lambda path, cut: path.write_bytes(b"corrupt"), "SHA-256"),
        ("val.de.gz", lambda path, cut: cut.add(path.name), ""),  # sent half
        ("test_2016_flickr.en.gz", lambda path, cut: path.unlink(), "404"),
    ],
    ids=["wrong digest", "cut off", "not served"],
)
def test_a_failed_download_names_the_file_and_keeps_only_the_verified_ones(
    name, damage, why, multi30k_server, tmp_path
):
    damage(multi30k_server.folder / name, multi30k_server.cut)
    with pytest.raises(DataError, match=f"^{name}: .*{why}.*files before it are kept"):
        download(tmp_path / "data", multi30k_server.url)
    assert names_in(tmp_path / "data") == sorted(ORDER[: ORDER.index(name)])


@pytest.mark.parametrize("listens", [False, True], ids=["offline", "never answers"])
def test_a_download_without_an_answer_is_one_line_and_leaves_no_folder(
    listens, tmp_path
):
    with socket.socket() as server:  # listening, it takes connections, never answers
        server.bind(("127.0.0.1", 0))
        if listens:
            server.listen(8)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/"
        with pytest.raises(DataError) as error:
            download(tmp_path / "new" / "multi30k", url, timeout=0.5)
    message = str(error.value)
    assert message.startswith(f"train.de.gz: could not download it from {url}")
    assert "\n" not in message and f"--data-dir DIR or ${tat.DATA_ENV}" in message
    assert ("(timed out)" in message) == listens and names_in(tmp_path) == []


FULL_DISK = OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("error", [FULL_DISK, RuntimeError("a bug")])
def test_a_failure_while_saving_is_said_as_itself_never_as_a_bad_digest(
    error, multi30k_server, tmp_path, monkeypatch
):
    def fail(self, data):
        raise error

    monkeypatch.setattr(pathlib.Path, "write_bytes", fail)
    # A full disk is a failed download; a bug is none, and is raised as it is.
    with pytest.raises(DataError if error is FULL_DISK else RuntimeError) as found:
        download(tmp_path / "data", multi30k_server.url)
    assert str(error) in str(found.value) and "SHA-256" not in str(found.value)
    assert not list(tmp_path.glob("data/*"))  # nothing half-written


@pytest.mark.parametrize("url", ["notaurl", "ftp://a.org/", "http://", "http://[::1/"])
def test_download_from_no_address_says_what_to_give_and_creates_nothing(url, tmp_path):
    with pytest.raises(ValueError, match="http://, https:// or file:// address"):
        download(tmp_path / "data", url)
    assert names_in(tmp_path) == []


def recompressed(source, target):
    """The same lines as another gzip stream: other bytes, another SHA-256."""
    with gzip.open(source, "rb") as f, gzip.GzipFile(target, "wb", mtime=1) as out:
        out.write(f.read())


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ("train", r"train\.de\.gz not found\. Run `make data`"),
        ("mine", r"mine\.de\.gz not found\. Put mine\.de\.gz and mine\.en\.gz"),
        ("val", r"val\.de\.gz is not the published file \(its SHA-256\)"),
        ("cut", r"cut\.de\.gz is not a readable gzip file"),
        ("lines", "lines.de.gz has 3 lines but the other has 2: .* line-aligned"),
    ],
)
def test_read_split_refuses_a_bad_split_naming_its_file_and_the_fix(
    split, message, multi30k_dir, tmp_path
):
    write_lines_gz(tmp_path / f"{split}.en.gz", ["A dog.", "A cat."])
    write_lines_gz(tmp_path / "lines.de.gz", ["Ein Hund.", "Eine Katze.", "Ein Pferd."])
    (tmp_path / "cut.de.gz").write_bytes(gzip.compress(b"Ein Hund.\n" * 200)[:30])
    if split == "val":  # the published text, recompressed: the book would read it
        recompressed(multi30k_dir / "val.de.gz", tmp_path / "val.de.gz")
        shutil.copyfile(multi30k_dir / "val.en.gz", tmp_path / "val.en.gz")
    with pytest.raises(DataError, match=message):
        multi30k.read_split(tmp_path, split)


def test_a_run_checks_the_digests_before_reading_the_data(multi30k_dir, tmp_path):
    shutil.copytree(multi30k_dir, tmp_path, dirs_exist_ok=True)
    recompressed(multi30k_dir / "train.de.gz", tmp_path / "train.de.gz")
    config = settings.RunConfig.from_profile("smoke")
    with pytest.raises(DataError, match=r"train\.de\.gz .*SHA-256"):
        run_data.prepare_run_data(config, tmp_path)
