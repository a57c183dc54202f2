# Two commands on a fresh machine:  `make demo`  and  `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tilert-installed
MODEL  ?= models/tiny-deepseek-v3
PORT   ?= 8000

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/bootstrap.sh
	./scripts/bootstrap.sh
	touch $(STAMP)

$(MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/tilert tiny-model --arch deepseek_v3 --out $(MODEL) --seed 0

# The whole stack on this machine with both decode pools (stock vLLM prefill under MultiConnector, the TileRT
# decode node, a native vLLM decode instance, router), one streamed chat answer through each pool with the
# OpenAI client, then serving on until Ctrl-C.
demo: $(STAMP) $(MODEL)/config.json
	$(PY) -m tilert.demo --model $(MODEL) --port $(PORT) --native

test: $(STAMP)
	$(VENV)/bin/ruff check tilert tests
	$(VENV)/bin/ruff format --check tilert tests benchmarks
	$(VENV)/bin/mypy tilert
	$(PY) -m pytest -q -ra

clean:
	rm -rf $(VENV) models .pytest_cache
