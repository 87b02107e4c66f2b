# Two commands do everything on a fresh machine:
#   make demo   virtualenv, install, train the quickstart recipe, translate, score
#   make test   virtualenv, install, run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# the CPU wheel of torch that lies on these machines; an unpinned torch pulls a multi-GB CUDA build
TORCH  ?= torch==2.13.0
RECIPE ?= recipes/quickstart.yaml
RUN    ?= exp/quickstart
# extra `s2s train` arguments, e.g. make demo TRAIN_ARGS="--set train.max_time=2m"
TRAIN_ARGS ?=

.PHONY: demo test test-all install clean

$(BIN)/s2s: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(BIN)/s2s

install: $(BIN)/s2s

demo: install
	@# the previous demo run is replaced; a directory that is no s2s training run is not
	@if [ -e "$(RUN)" ] && [ ! -f "$(RUN)/train.lock" ] && [ -n "$$(ls -A "$(RUN)" 2>&1)" ]; then \
	  echo "make demo: $(RUN) exists and is not an s2s training run; not replaced (make demo RUN=another/dir)" >&2; \
	  exit 1; fi
	$(BIN)/s2s tokenizer train $(RECIPE)
	$(BIN)/s2s prepare $(RECIPE)
	rm -rf $(RUN)
	$(BIN)/s2s train $(RECIPE) -o $(RUN) $(TRAIN_ARGS)
	@echo "--- translating the first 5 test sentences (English -> German):"
	zcat data/ddtp-en-de/test.en.gz | head -n 5 | $(BIN)/s2s translate -m $(RUN)
	@echo "--- BLEU / chrF / TER on the 1000 test sentences (beam 5):"
	zcat data/ddtp-en-de/test.en.gz | $(BIN)/s2s translate -m $(RUN) > $(RUN)/test.hyp
	zcat data/ddtp-en-de/test.de.gz | $(BIN)/s2s score $(RUN)/test.hyp -

test: install
	$(BIN)/ruff check s2s tests benchmarks
	$(BIN)/python -m pytest -q

# the slow tests too (marked @pytest.mark.slow)
test-all: install
	$(BIN)/python -m pytest -q -m ""

# the virtualenv and what `make demo` wrote (the quickstart recipe's prepared data, its run); other
# experiments in exp/ and prepared/ stay
clean:
	rm -rf $(VENV) .pytest_cache prepared/quickstart
	@if [ -f "$(RUN)/train.lock" ]; then rm -rf "$(RUN)"; fi
