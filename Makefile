# Two commands on a fresh machine:  `make demo`  and  `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tilert-installed
MODEL  ?= models/tiny-deepseek-v3
PORT   ?= 8000

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/bootstrap.sh
	@./scripts/bootstrap.sh
	@touch $(STAMP)

$(MODEL)/config.json: | $(STAMP)
	@TQDM_DISABLE=1 $(VENV)/bin/tilert tiny-model --arch deepseek_v3 --out $(MODEL) --seed 0 >/dev/null
	@echo "tilert: built the tiny model $(MODEL)"

# The whole stack on this machine (stock vLLM prefill, the TileRT decode node, the router), one greedy answer
# through the TileRT pool and from vLLM alone, each with its time to first token and per-user speed, then serving
# until Ctrl-C. `make demo NATIVE=1` adds the native vLLM decode pool (vLLM's MultiConnector + NixlConnector).
demo: $(STAMP) $(MODEL)/config.json
	@$(PY) -m tilert.demo --model $(MODEL) --port $(PORT) $(if $(NATIVE),--native)

# mypy runs beside the tests (on a fresh clone its cache is cold and it keeps one core busy a while, when the tests leave
# much of the second idle); its report follows the tests' and either failing fails the target.
test: $(STAMP)
	$(VENV)/bin/ruff check tilert tests
	$(VENV)/bin/ruff format --check tilert tests benchmarks
	@typed=$$(mktemp); $(VENV)/bin/mypy tilert >"$$typed" 2>&1 & mypy=$$!; \
	echo "$(PY) -m pytest -q -ra  (and $(VENV)/bin/mypy tilert beside it)"; \
	$(PY) -m pytest -q -ra; tests=$$?; \
	wait $$mypy; types=$$?; echo "$(VENV)/bin/mypy tilert"; cat "$$typed"; rm -f "$$typed"; \
	[ $$tests -eq 0 ] && [ $$types -eq 0 ]

clean:
	rm -rf $(VENV) models .pytest_cache
