# Every task of the project; `make help` lists them. `make` alone runs the copy task.
# Override on the command line: `make test PYTHON=python3.12 DATA_DIR=/data/m30k`.

PYTHON ?= python3
VENV ?= .venv
DATA_DIR ?= data/multi30k
TEST_JOBS ?= auto
SITE_DIR ?= site
RESULTS_DIR ?= results
IMAGES_DIR ?= images
LAB_PORT ?= 8888

BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
COLAB_VENV := .venv-colab
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings
BOOK := the_annotated_transformer.py
NOTEBOOK := notebooks/the_annotated_transformer.ipynb
ZH_NOTEBOOK := notebooks/the_annotated_transformer.zh.ipynb
LAB_BOOK ?= $(NOTEBOOK)
EXECUTED := $(NOTEBOOK:.ipynb=.executed.ipynb)
ZH_EXECUTED := $(ZH_NOTEBOOK:.ipynb=.executed.ipynb)
CATALOGUE := translations/zh/the_annotated_transformer.po
PYTHON_VERSIONS := 3.11 3.12 3.13

.DEFAULT_GOAL := run
.PHONY: help run setup setup-colab test check lint format data notebook translations sync \
	script execute execute-zh html site lab figures bench multi30k clean FORCE

# Multi30k is found through ANNOTATED_TRANSFORMER_DATA. The targets that read it fetch
# the default folder first; a DATA_DIR you give is used as it is. The tests and the
# bench get it only where it exists (their Multi30k tests skip, or fail under CI=true).
export ANNOTATED_TRANSFORMER_DATA := $(abspath $(DATA_DIR))
WITH_DATA = [ -d "$(DATA_DIR)" ] || unset ANNOTATED_TRANSFORMER_DATA;
NEEDS_DATA := $(if $(filter file,$(origin DATA_DIR)),data)

# The suite's second pass: the numerical tests on the plain (non-AVX) code path of
# PyTorch, MKL and oneDNN. It stops at once unless torch reports that path.
PLAIN_CPU := ATEN_CPU_CAPABILITY=default EXPECT_CPU_CAPABILITY=DEFAULT \
	MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41
PLAIN_LOG := $(VENV)/plain-path-pass.log
PYTEST := $(PY) -m pytest -n $(TEST_JOBS) --dist loadfile

help: ## this list
	@grep -E '^[a-z0-9%-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

$(PY):
	@$(PYTHON) -c 'import sys; v = "%d.%d" % sys.version_info[:2]; sys.exit(None if v in "$(PYTHON_VERSIONS)".split() else f"make: $(PYTHON) is Python {v}; requirements.txt is pinned for $(PYTHON_VERSIONS): name one, e.g. make PYTHON=python3.12")'
	$(PYTHON) -m venv $(VENV)
$(STAMP): requirements.txt | $(PY)
	$(PY) -m pip install -r requirements.txt
	touch $@

setup: $(STAMP) ## .venv with every pin of requirements.txt
run: | $(PY) ## train the copy task on the CPU and print its copies (torch and numpy only)
	$(PY) -c 'import torch, numpy' 2>/dev/null || $(PY) -m pip install $$(grep -E '^(torch|numpy)==' requirements.txt)
	$(PY) $(BOOK)

setup-colab: $(COLAB_VENV)/.installed ## .venv-colab: Colab's versions (pyproject's colab group)
$(COLAB_VENV)/.installed: pyproject.toml
	@test -x $(COLAB_VENV)/bin/python || $(PYTHON) -m venv $(COLAB_VENV)
	$(PYTHON) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["dependency-groups"]["colab"], sep="\n")' >$(COLAB_VENV)/requirements.txt
	$(COLAB_VENV)/bin/python -m pip install -r $(COLAB_VENV)/requirements.txt
	touch $@

data: | $(STAMP) ## fetch Multi30k into DATA_DIR and check each file's SHA-256
	$(PY) -m workshop download --data-dir "$(DATA_DIR)" $(if $(DATA_URL),--base-url $(DATA_URL))

test: $(STAMP) ## the quick tier: every test not marked slow (TEST_JOBS=0: one process)
	$(WITH_DATA) $(PYTEST) -m "not slow" $(PYTEST_ARGS)

check: lint $(STAMP) ## what CI runs: lint, every test, and the plain-path numerical pass
	$(WITH_DATA) $(PLAIN_CPU) OMP_NUM_THREADS=1 $(PY) -m pytest -p no:cacheprovider \
		-m numerical $(PYTEST_ARGS) >$(PLAIN_LOG) 2>&1 & plain=$$!; \
	$(WITH_DATA) $(PYTEST) $(PYTEST_ARGS); first=$$?; wait $$plain; second=$$?; \
	echo "The numerical tests on the plain code path:"; cat $(PLAIN_LOG); \
	[ $$first = 0 ] && [ $$second = 0 ]

lint: $(STAMP) ## ruff (style and the book/workshop boundary), the workflows' schema
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml
format: $(STAMP) ## ruff format, then ruff check --fix
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

notebook: $(STAMP) ## the .py -> both notebooks (English; Chinese from translations/zh)
	$(BIN)/jupytext --to ipynb --output $(NOTEBOOK) $(BOOK)
	$(PY) -m tools.translation ids $(NOTEBOOK)
	$(PY) -m tools.translation build zh $(if $(ALLOW_MISSING),--allow-missing)

translations: $(STAMP) ## the book's prose into translations/zh/*.po (changed cells go fuzzy)
	$(PY) -m tools.translation extract zh
	$(PY) -m tools.translation build zh $(if $(ALLOW_MISSING),--allow-missing)
sync: $(STAMP) ## jupytext --sync: the .py and the notebook level, the newer wins
	$(BIN)/jupytext --sync $(BOOK)
script: $(STAMP) ## the notebook -> the .py
	$(BIN)/jupytext --to py:percent --output $(BOOK) $(NOTEBOOK)

# Rebuilt when the book (or the catalogue) is newer, and always by execute/execute-zh.
$(EXECUTED): $(BOOK)
$(ZH_EXECUTED): $(BOOK) $(CATALOGUE)
$(EXECUTED) $(ZH_EXECUTED): $(if $(filter execute execute-zh,$(MAKECMDGOALS)),FORCE) \
		| $(STAMP) $(NEEDS_DATA)
	$(MAKE) notebook
	$(BIN)/jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=3600 \
		--output $(notdir $@) $(@:.executed.ipynb=.ipynb)

execute: $(EXECUTED) ## run every cell of the book (ANNOTATED_TRANSFORMER_PROFILE, quick)
execute-zh: $(ZH_EXECUTED) ## the same for the Chinese notebook

html: $(EXECUTED) $(ZH_EXECUTED) ## both executed notebooks as offline HTML pages
	$(PY) -m tools.export_html $(EXECUTED)
	$(PY) -m tools.export_html --lang zh $(ZH_EXECUTED)

site: $(STAMP) $(NEEDS_DATA) ## the website in SITE_DIR: the book run, English and Chinese
	$(PY) -m tools.build_site --out $(SITE_DIR)

# Offline (tools/lab/overrides.json), the venv's kernel first; one Ctrl-C stops it.
lab: $(STAMP) $(NEEDS_DATA) ## JupyterLab on the book (LAB_BOOK=the Chinese notebook opens it)
	@mkdir -p $(LAB_SETTINGS) && cp tools/lab/overrides.json $(LAB_SETTINGS)/
	JUPYTER_PATH="$(abspath $(VENV))/share/jupyter$${JUPYTER_PATH:+:$$JUPYTER_PATH}" \
		$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) \
		--ServerApp.root_dir="$(CURDIR)" --ServerApp.answer_yes=True \
		--LabApp.default_url=/lab/tree/$(LAB_BOOK) --LabApp.news_url=None \
		--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate \
		--LabApp.extension_manager=readonly \
		$(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_OPTIONS)

figures: $(STAMP) ## the book's figures into images/
	$(PY) -m workshop figures --out images/
bench: $(STAMP) ## performance figures (a benchmark, never a test)
	$(WITH_DATA) $(PY) -m benchmarks
multi30k: results-multi30k ## train the multi30k profile, average, score: results/multi30k.*

# results-PROFILE: any profile. The log lands only when the run succeeds.
results-%: $(STAMP) $(NEEDS_DATA)
	mkdir -p $(RESULTS_DIR)
	bash -o pipefail -c 'log=$(RESULTS_DIR)/.$*.log.partial; trap "rm -f $$log" EXIT; \
		trap "exit 130" INT TERM HUP; $(PY) -m workshop reproduce --profile $* \
		--data-dir "$(DATA_DIR)" --out runs/$* --results "$(RESULTS_DIR)" \
		--images "$(IMAGES_DIR)" 2>&1 | tee "$$log" && mv "$$log" $(RESULTS_DIR)/$*.log'

clean: ## remove caches, executed notebooks and the site (keeps the venvs)
	find . \( -path ./$(VENV) -o -path ./$(COLAB_VENV) \) -prune -o -name __pycache__ -type d -exec rm -rf {} +
	rm -rf .pytest_cache .ruff_cache notebooks/*.executed.* notebooks/.ipynb_checkpoints \
		$(SITE_DIR) $(SITE_DIR).building $(SITE_DIR).previous
