"""Shared test setup: the numerical tests' marker and the check of their second pass,
the run's shared folder, in which `made_once` makes the few expensive things several
test files need (the website, the copy task from a seed) once for all xdist workers,
and the fixtures and helpers tests in more than one file use: Multi30k split files and
a local download server, smoke-profile training runs and their checkpoints, and the
results' stand-ins and runs. Tolerances: tests/tolerance.py."""

import functools
import gzip
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from filelock import FileLock

# The repository root is on sys.path through pyproject.toml's `pythonpath = ["."]`.
import the_annotated_transformer as tat
from workshop import multi30k
from workshop.report import reproduce
from workshop.run import checkpoints, settings, training
from workshop.run.distributed import free_port as free_port  # the tests' free ports too
from workshop.translate import translation

REPO_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------
# The numerical tests, and the pass of `make check` that runs them on another code path

# The modules whose numbers depend on the CPU kernels torch picks: `make check` runs
# them once more (`pytest -m numerical`) on the plain, non-AVX code path.
NUMERICAL_MODULES = {
    "test_part1_model.py",
    "test_part1_reference.py",
    "test_part2_training.py",
    "test_part4_decoding.py",
    "test_pretrained.py",
}

# Set by that pass of `make check`, beside ATEN_CPU_CAPABILITY=default: the capability
# torch must report, or the pass would only repeat the first one.
EXPECT_CAPABILITY_ENV = "EXPECT_CPU_CAPABILITY"


def pytest_collection_modifyitems(config, items):
    for item in items:
        first_pass_only = item.get_closest_marker("first_pass_only")
        if item.path.name in NUMERICAL_MODULES and not first_pass_only:
            item.add_marker(pytest.mark.numerical)


def usable_cores():
    """The cores this process may run on (its affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


SHARED_ENV = "ANNOTATED_TRANSFORMER_TEST_SHARED"


def pytest_configure(config):
    # One folder for the whole run, made by the first process (the xdist controller,
    # or the only process) before any worker starts; the workers inherit its path.
    if SHARED_ENV not in os.environ:
        config.shared_dir = os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="tat-")
    # No network in the tests: the Hugging Face hub is never asked, and its cache is
    # an empty folder (the book's OPUS-MT example then runs its offline check).
    os.environ["HF_HUB_OFFLINE"] = "1"
    config.hub_cache = os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="hf-hub-")
    # In an xdist worker: an equal share of the cores, for torch here and for the
    # processes the tests start (a notebook's kernel, a command, the book's script),
    # so that the workers' threads never outnumber the cores. The exactness tests
    # compare runs made in one worker, on the same number of threads.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        share = max(1, usable_cores() // int(workers))
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = str(share)


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "hub_cache", ""), ignore_errors=True)
    if hasattr(config, "shared_dir"):
        shutil.rmtree(os.environ.pop(SHARED_ENV), ignore_errors=True)


def made_once(name, make):
    """The folder `name`, filled by `make(folder)` once for the whole run however many
    pytest-xdist workers ask for it: the first makes it under a file lock, the others
    wait and find it made (pytest-xdist's recipe for session fixtures)."""
    folder = Path(os.environ[SHARED_ENV]) / name
    with FileLock(f"{folder}.lock"):
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


def pytest_sessionstart(session):
    expected = os.environ.get(EXPECT_CAPABILITY_ENV)
    if not expected:
        return
    actual = torch.backends.cpu.get_cpu_capability()
    if actual.upper() != expected.upper():
        pytest.exit(
            f"${EXPECT_CAPABILITY_ENV} is {expected!r}, but torch reports the CPU "
            f"capability {actual!r} (ATEN_CPU_CAPABILITY="
            f"{os.environ.get('ATEN_CPU_CAPABILITY')!r}): these tests would not run "
            "on the code path they are meant to check.",
            returncode=1,
        )


def run_python(code):
    """Run `code` in a fresh Python process from the repository root."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def loaded_by_importing_the_book(packages):
    """Which of `packages` a fresh `import the_annotated_transformer` loads."""
    code = (
        "import json, sys\n"
        "import the_annotated_transformer\n"
        f"wanted = {sorted(packages)!r}\n"
        "top = {name.split('.')[0] for name in sys.modules}\n"
        "print(json.dumps(sorted(top & set(wanted))))\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def point_data_at(folder, tmp_path, monkeypatch):
    """Leave the data variable unset (folder None), with the notebook's default folder
    empty and its download refused at once (a closed port on this machine, as
    without network), or point the variable at an empty folder."""
    if folder is None:
        monkeypatch.delenv(tat.DATA_ENV, raising=False)
        default = tmp_path / "data" / "multi30k"
        monkeypatch.setattr(tat, "default_data_dir", lambda: default)
        closed = f"http://127.0.0.1:{free_port()}/"  # nothing listens there
        offline = functools.partial(tat.fetch_multi30k, base_url=closed)
        monkeypatch.setattr(tat, "fetch_multi30k", offline)
    else:
        monkeypatch.setenv(tat.DATA_ENV, str(tmp_path))


def skip_or_fail_in_ci(environ, message):
    """Skip the test with `message`, but fail it under CI=true: CI runs every test."""
    if environ.get("CI") == "true":
        pytest.fail(message + " CI must run every test, so this is an error.")
    pytest.skip(message)


def data_dir_or_skip(environ):
    """The data folder named in `environ`; skip without it, but fail in CI."""
    value = environ.get(tat.DATA_ENV)
    if value:
        return Path(value)
    message = (
        f"${tat.DATA_ENV} is not set, so the Multi30k tests cannot find the data. "
        "Point it at a folder holding the six Multi30k files (`make test` does)."
    )
    skip_or_fail_in_ci(environ, message)


@pytest.fixture(scope="session")
def multi30k_dir():
    """The Multi30k folder from $ANNOTATED_TRANSFORMER_DATA (skip; fail in CI)."""
    return data_dir_or_skip(os.environ)


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Run torch on one thread: for the tiny models of the data tests it is faster,
    and it keeps two threads from waiting on each other on a busy shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def built_site(multi30k_dir):
    """The folder `make site` builds, with the smoke profile (two to three minutes,
    once a run): the tests of the executed notebook and of its page share it. It
    uses the project's .venv, as `make site` does; the notebook trains its model in
    memory and writes no run folder."""

    def build(folder):
        result = subprocess.run(
            ["make", "--no-print-directory", "site", f"SITE_DIR={folder / 'site'}"],
            cwd=REPO_ROOT,
            env={
                **os.environ,
                "ANNOTATED_TRANSFORMER_PROFILE": "smoke",
                "DATA_DIR": str(multi30k_dir),
            },
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
        assert result.returncode == 0, (
            f"make site failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )

    return made_once("built_site", build) / "site"


# ---------------------------------------------------------------------------
# Multi30k: the training pairs, split files, a local download server


@pytest.fixture(scope="session")
def train_pairs(multi30k_dir):
    return tat.read_split(multi30k_dir, "train")


def texts_of(pairs):
    """German and English sentences of `pairs`, in the order prepare_data feeds them."""
    return [text for pair in pairs for text in pair]


@pytest.fixture(scope="session")
def tokenizers():
    return tat.load_tokenizers()


@pytest.fixture(scope="session")
def vocabs(train_pairs, tokenizers):
    return tat.build_vocabulary(train_pairs, *tokenizers)


@pytest.fixture(scope="session")
def train_data(multi30k_dir, vocabs):
    """The whole training split, encoded with the training vocabularies."""
    return tat.prepare_data(multi30k_dir, splits=("train",), vocabs=vocabs)


@pytest.fixture(scope="session")
def bpe(train_pairs):
    """The default 8,000-token joint vocabulary, from the whole training split."""
    return tat.SubwordVocab.build(text for pair in train_pairs for text in pair)


def write_lines_gz(path, lines):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def write_split(folder, name, pairs):
    """Write (German, English) pairs as NAME.de.gz and NAME.en.gz in `folder`."""
    for lang, side in (("de", 0), ("en", 1)):
        with gzip.open(Path(folder) / f"{name}.{lang}.gz", "wt", encoding="utf-8") as f:
            f.writelines(pair[side] + "\n" for pair in pairs)


def names_in(folder):
    return sorted(p.name for p in Path(folder).iterdir())


PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY")
PROXY_VARIABLES += ("all_proxy", "ALL_PROXY")


class RecordingHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder and records the name of every file asked for; a file named
    in `server.cut` is announced whole but sent only half, then the connection
    closes (an interrupted download)."""

    def do_GET(self):
        name = self.path.lstrip("/")
        self.server.requested.append(name)
        if name not in self.server.cut:
            return super().do_GET()
        data = (Path(self.directory) / name).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, format, *args):  # keep the test output clean
        pass


@pytest.fixture
def multi30k_server(multi30k_dir, tmp_path, monkeypatch):
    """An HTTP server on 127.0.0.1 serving copies of the six Multi30k files."""
    for name in PROXY_VARIABLES:  # talk to 127.0.0.1 directly, never via a proxy
        monkeypatch.delenv(name, raising=False)
    folder = tmp_path / "served"
    folder.mkdir()
    for name in multi30k.MULTI30K_SHA256:
        shutil.copyfile(multi30k_dir / name, folder / name)
    handler = functools.partial(RecordingHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.requested, server.cut = [], set()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield SimpleNamespace(
            url=f"http://127.0.0.1:{server.server_port}/",
            folder=folder,
            requested=server.requested,
            cut=server.cut,
        )
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# ---------------------------------------------------------------------------
# The copy task, trained once a session


@functools.cache
def trained_copy_task(seed):
    """(model, history, config): the copy task trained with its default settings
    from `seed` (one to two minutes, once a run, however many workers ask). Part 2's
    tests check that it copies; Part 4's decoding tests search with it."""
    config = tat.CopyTaskConfig(seed=seed)

    def train(folder):
        model, history = tat.train_copy_task(config, quiet=True, device="cpu")
        tat.save_model(model, folder / "model.pt")
        (folder / "history.json").write_text(json.dumps(history))

    folder = made_once(f"copy_task_seed_{seed}", train)
    history = json.loads((folder / "history.json").read_text())
    return tat.load_model(folder / "model.pt").eval(), history, config


# ---------------------------------------------------------------------------
# Training runs and their checkpoints


def smoke_config(**overrides):
    """The smoke profile on 300 pairs, small batches, two epochs, in float32 (not
    "auto": the tests' runs compute alike on every machine)."""
    changes = dict(max_train_pairs=300, epochs=2, max_tokens=300, keep_checkpoints=1)
    changes["precision"] = "fp32"
    return settings.RunConfig.from_profile("smoke", **{**changes, **overrides})


@pytest.fixture(scope="session")
def smoke_run(multi30k_dir, tmp_path_factory):
    """A two-epoch smoke-profile run, uninterrupted: (out, history)."""
    out = tmp_path_factory.mktemp("smoke_run")
    history = training.train_model(smoke_config(), multi30k_dir, out, quiet=True)
    return SimpleNamespace(out=out, history=history)


@pytest.fixture(scope="module")
def translator(smoke_run):
    return translation.load_translator(smoke_run.out / "last.pt", device="cpu")


WORDS = ["a", "dog", "runs", "."]


def tiny_checkpoint(path, seed, epoch=0, words=WORDS, **overrides):
    """Save a random smoke-sized model in the format of training's epoch_NNN.pt."""
    config = settings.RunConfig.from_profile("smoke", **overrides)
    vocab = list(tat.SPECIALS) + list(words)
    torch.manual_seed(seed)
    model = tat.make_model(
        len(vocab),
        len(vocab),
        N=config.N,
        d_model=config.d_model,
        d_ff=config.d_ff,
        h=config.h,
        norm_first=config.norm_first,
    )
    state = {
        "model": checkpoints.without_positional_tables(model.state_dict()),
        "config": config.to_dict(),
        "epoch": epoch,
        "vocab_src": vocab,
        "vocab_tgt": vocab,
    }
    checkpoints.save_checkpoint(path, state)
    return state


@pytest.fixture(scope="session")
def trained_checkpoint(smoke_run):
    """last.pt of the smoke run: what the commands and the results tests load."""
    return smoke_run.out / "last.pt"


# ---------------------------------------------------------------------------
# Results: BLEU, attention maps, the whole recipe


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


SENTENCE = "Ein Hund läuft im Schnee und ein Hund schläft."


class EchoTranslator:
    """Stands in for a Translator: answers each source with a fixed sentence."""

    def __init__(self, answers):
        self.answers = answers
        self.calls = []

    def translate(self, sentences, batch_size=64, **options):
        self.calls.append((list(sentences), batch_size, options))
        return [self.answers[s] for s in sentences]


HANDMADE_PAIRS = [
    ("Ein Hund läuft über die Wiese.", "A dog is running across the meadow."),
    ("Zwei Männer spielen Fußball.", "Two men are playing soccer."),
    ("Eine Frau liest ein Buch im Park.", "A woman reads a book in the park."),
]


@pytest.fixture(scope="session")
def mini_split(multi30k_dir, tmp_path_factory):
    """A folder whose split `mini` is the first 20 validation pairs: (folder, pairs)."""
    folder = tmp_path_factory.mktemp("mini")
    pairs = tat.read_split(multi30k_dir, "val")[:20]
    write_split(folder, "mini", pairs)
    return folder, pairs


@pytest.fixture(scope="session")
def reproduced(multi30k_dir, tmp_path_factory):
    """A two-epoch smoke run through reproduce, scored on 20 sentences a split."""
    root = tmp_path_factory.mktemp("reproduce")
    record = reproduce.reproduce(
        "smoke",
        multi30k_dir,
        root / "run",
        root / "results",
        root / "images",
        beam_sizes=(2, 3),
        alphas=(0.6, 1.0),
        limit=20,
        quiet=True,
        overrides={"max_train_pairs": 300, "epochs": 2},
    )
    return root, record
