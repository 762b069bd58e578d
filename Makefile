# derivgen: `make demo` runs the main job, `make test` the test suite.
# Both create .venv and install what they need on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.derivgen-installed

.PHONY: demo test test-full install pdflatex generate check clean fuzz lint format

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# timm (its layer classes, for the importer's tests) comes without its dependencies: it requires
# torchvision, and PyPI's torchvision wheels link CUDA libtorch, which the pinned CPU torch lacks;
# tests/importer/timm_layers.py loads timm's layer files without timm's package __init__.
# setuptools tells every editable install of a package with a package-dir mapping (templates/
# is installed as derivgen.templates) to beware of same-named folders, as a UserWarning that pip
# forwards (BuildBackendWarning); it is information, not a fault, so the install leaves it out
$(STAMP): pyproject.toml | $(BIN)/python
	PYTHONWARNINGS=ignore::UserWarning $(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps 'timm==1.0.31'
	touch $@

install: $(STAMP)

# pdflatex compiles the standalone derivations; install it when absent and possible.
pdflatex:
	@if ! command -v pdflatex >/dev/null 2>&1; then \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo -n"; \
	  echo "installing texlive-latex-base for pdflatex"; \
	  ($$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq texlive-latex-base >/dev/null) \
	    || echo "warning: could not install texlive-latex-base; LaTeX compile tests will skip (and fail under CI=true)"; \
	fi

demo: $(STAMP)
	@echo "== the catalogue"
	@$(BIN)/derivgen list
	@echo
	@echo "== layer norm, derived step by step"
	@$(BIN)/derivgen derive layernorm --format text --no-prove
	@echo "== every layer: closed form, reductions, proof at N = 2..6"
	@$(BIN)/derivgen prove
	@echo
	@echo "== regenerate NumPy and C into generated/"
	@$(BIN)/derivgen generate
	@echo
	@echo "== build the C, cross-check every layer x backend x dtype (spec + finite differences, other backend, PyTorch, proof)"
	@$(BIN)/derivgen check
	@echo
	@echo "== PyTorch: models trained with torch.nn norms and after derivgen.torch.convert"
	@$(BIN)/python -m derivgen.tools.demo

# ruff: lint and format (configured in pyproject.toml; generated/ is template output and excluded)
lint: $(STAMP)
	$(BIN)/ruff check derivgen tests
	$(BIN)/ruff format --check derivgen tests

format: $(STAMP)
	$(BIN)/ruff check --fix derivgen tests
	$(BIN)/ruff format derivgen tests

# two pytest workers: most tests are one single-threaded process (SymPy, compiles), so two
# fill a 2-core machine; the spec fuzzer's corpus runs its own two workers inside one of them
# make test is the quick tier: every test, with each corpus (fuzz seeds run by a backend, the
# regression specs' second-order proofs) cut to a sample that has every feature of the whole;
# make test-full runs the corpora whole (the tests marked `full` too)
# --durations: the slowest tests are listed at the end, to see where the time goes
TEST_WORKERS ?= 2
test: $(STAMP) pdflatex lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not full" --durations=25

test-full: $(STAMP) pdflatex lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# the spec fuzzer's larger corpus (the test suite runs seeds 0-27, 100000 and 100008, 300000-300039
# and 300085, and judges the run-time means of 200000-200047 too); SEEDS=a-b, BLOCK_SEEDS=a-b (the block family: seeds
# from 100000 have block statistics), SHAPE_SEEDS=a-b (the shape family: seeds from 200000 have
# a Taylor softmax, a per-row scale or a mixture of two kinds' normalizations), TENSOR_SEEDS=a-b
# (the tensor family: seeds from 300000 have tensor inputs, a core value, outputs beside y), JOBS=n,
# PROOF_WORK units of exact arithmetic per proof size (the test suite's 500000) before 80-digit numbers take over. Every spec
# is also judged on its run-time means (a count above the brute-force minimum fails it); every
# range runs, whatever the ones before found, and the target fails if any spec did
SEEDS ?= 28-1199
BLOCK_SEEDS ?= 100001-100199
SHAPE_SEEDS ?= 200000-200199
TENSOR_SEEDS ?= 300040-300199
JOBS  ?= 2
PROOF_WORK ?= 500000
fuzz: $(STAMP)
	@status=0; for seeds in $(SEEDS) $(BLOCK_SEEDS) $(SHAPE_SEEDS) $(TENSOR_SEEDS); do \
	  $(BIN)/python tests/specfuzz.py --seeds $$seeds --jobs $(JOBS) --proof-work $(PROOF_WORK) --progress || status=1; \
	done; exit $$status

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
