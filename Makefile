# The README's commands. `make serve` serves the default model from bankml's own engine
# (--native); `make test` runs the whole suite. Both start from a fresh machine: they create .venv
# and fetch the model; `make test` (and `make serve-p0`) also build llama-server (build 11434).

PYTHON      ?= python3
VENV        := .venv
BIN         := $(VENV)/bin
MODEL       := models/SmolLM2-135M-Instruct.Q4_1.gguf
FORK        := $(MODEL).FORK.json
LISTEN      ?= 127.0.0.1:18093
UPSTREAM    ?= 127.0.0.1:18092
# pytest's own arguments; `PYTEST_ARGS='-n 2 --dist loadfile'` runs two test files at a time
# (pytest-xdist), not the default: on 2 cores it is slower than one file at a time (README)
PYTEST_ARGS ?=

.PHONY: serve serve-p0 test lint bench venv test-deps model llama-source llama-server clean

# llama-server's build runs make itself: it gets its own -j, not a share of this make's
BUILD_ENV   := env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL

$(BIN)/bankml: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# compat mode puts the repository on sys.path, so twistd finds twisted/plugins/bankml_plugin.py
	$(BIN)/pip install -q -e . --config-settings editable_mode=compat
	touch $@

venv: $(BIN)/bankml

# the web page's tests drive Debian's chromium through Playwright (nothing downloaded at run time)
$(VENV)/.test-deps: $(BIN)/bankml setup.cfg
	$(BIN)/pip install -q -e '.[test]' --config-settings editable_mode=compat
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	touch $@

# llama.cpp's own converter (with torch's CPU build) in a separate venv under ~/.cache/bankml, for
# tests/test_convert.py to compare `bankml convert` with byte for byte; never in bankml's .venv;
# and all-MiniLM-L6-v2 (a sentence-transformers BERT directory) for the converter's and the
# encoder's tests
test-deps: $(VENV)/.test-deps llama-source
	scripts/convert-reference-venv.sh >/dev/null
	PYTHON=$(BIN)/python scripts/fetch-minilm.sh >/dev/null

model: $(BIN)/bankml
	PYTHON=$(BIN)/python scripts/fetch-model.sh

# llama.cpp build 11434's source, unpacked once under the cache: the build and the reference
# converter's venv both read it
llama-source:
	scripts/build-llama-server.sh --source >/dev/null

llama-server: llama-source
	$(BUILD_ENV) scripts/build-llama-server.sh

# Native: no llama-server needed. SLOT_DIR=D enables /slots on the engine address.
serve: venv model
	@echo "bankml: the web page: http://$(UPSTREAM)/ (and http://$(LISTEN)/ui), once the model is verified"
	$(BIN)/bankml serve $(MODEL) --fork $(FORK) --native --metrics --listen $(LISTEN) --upstream $(UPSTREAM) \
	    $(if $(SLOT_DIR),--slot-dir $(SLOT_DIR))

# P0: bankml in front of the llama-server (build 11434) it launches and supervises.
serve-p0: venv model
	$(BIN)/bankml serve $(MODEL) --fork $(FORK) --spawn "$$(scripts/build-llama-server.sh)" \
	    --listen $(LISTEN) --upstream $(UPSTREAM)

# the house rules first (seconds with warm caches; docs/checks.md): lint, formatting, types and
# the import layers, then the suite
lint: test-deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# On a fresh machine llama-server's build (minutes of compiling) runs beside the installs, which
# mostly wait on the network and the disk; then the house rules, then the suite.
test:
	$(MAKE) -j2 test-deps model llama-server
	$(MAKE) lint
	BANKML_LLAMA_SERVER="$$(scripts/build-llama-server.sh)" BANKML_MODEL=$(MODEL) \
	    $(BIN)/python -m pytest $(PYTEST_ARGS)

bench: venv model
	$(BIN)/python bench/gateway.py --llama-server "$$(scripts/build-llama-server.sh)" --model $(MODEL)
	$(BIN)/python bench/engine.py --llama-server "$$(scripts/build-llama-server.sh)" --model $(MODEL)
	$(BIN)/python bench/serve.py --llama-server "$$(scripts/build-llama-server.sh)" --model $(MODEL)
	$(BIN)/python bench/parallel.py --llama-server "$$(scripts/build-llama-server.sh)" --model $(MODEL)

clean:
	rm -rf $(VENV) build *.egg-info
