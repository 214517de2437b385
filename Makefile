# One entry point. `make docs` builds the bilingual site, `make test` runs every test.
# Both create .venv with python3 (3.11+) if it is missing and install the project into it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
SPHINX := $(BIN)/python -m sphinx
SPHINXOPTS ?= -W --keep-going -q

.PHONY: venv docs check-math html-en html-es test test-unit test-notebooks gettext translations-check sync sync-check fuzz clean

venv: $(STAMP)
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[docs,test,tpu]"
	@touch $@

# --- site -----------------------------------------------------------------
docs: $(STAMP)
	$(SPHINX) -b html $(SPHINXOPTS) -d _build/doctrees/en -D language=en . _build/html/en
	$(SPHINX) -b html $(SPHINXOPTS) -d _build/doctrees/es -D language=es . _build/html/es
	$(BIN)/python tools/site.py redirect _build/html
	@echo "Site built: _build/html/index.html (en/ and es/)"

# Opens built pages in a headless Chromium with the network cut off: every formula must be typeset.
check-math: $(STAMP)
	$(BIN)/python tools/site.py check-math _build/html

# Extract messages and merge them into docs/locale/es (then translate the .po files).
gettext: $(STAMP)
	$(BIN)/python tools/i18n.py update

translations-check: $(STAMP)
	$(BIN)/python tools/i18n.py check

# --- notebooks: keep the paired .ipynb (no outputs) in sync with the MyST .md ---
sync: $(STAMP)
	$(BIN)/python tools/site.py sync

sync-check: $(STAMP)
	$(BIN)/python tools/site.py sync-check

# --- tests ----------------------------------------------------------------
# Two workers (this project's CI machines have two cores). Tests, notebooks included, go one at a
# time to whichever worker is free, the longest first (tests/conftest.py); the notebooks share the
# jupyter-cache under a file lock (tests/test_notebooks.py).
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadgroup

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_PARALLEL)

test-unit: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not notebook"

test-notebooks: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m notebook

# --- fuzzing --------------------------------------------------------------
# Random configurations of every kernel family in interpret mode against float64 oracles, forward and
# gradients, plus malformed inputs (tools/fuzz.py), in one process. A failure prints the command that
# reproduces it. Hours at the default; FUZZ_CASES=100 takes about half an hour. A long run splits into
# pieces with identical results: FUZZ_FIRST=K runs cases K..K+FUZZ_CASES-1 (split at multiples of 5, so
# the malformed inputs, one per five cases, add up too); FUZZ_LOG=path appends each family's counts as
# a JSON line.
FUZZ_SEED ?= 0
FUZZ_CASES ?= 1000
FUZZ_FIRST ?= 0
FUZZ_LOG ?=

fuzz: $(STAMP)
	$(BIN)/python tools/fuzz.py --seed $(FUZZ_SEED) --cases $(FUZZ_CASES) --first $(FUZZ_FIRST) $(if $(FUZZ_LOG),--log $(FUZZ_LOG))

clean:
	rm -rf _build
