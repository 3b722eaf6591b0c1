# One Makefile for humans and CI.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The status page's browser tests drive Debian's Chromium (never a browser download); installed
# when missing, with the package lists refreshed only if the first try fails. Root, or sudo.
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_INSTALL := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends

.PHONY: test lint typecheck layers unit run bench clean flags-doc lock

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,bench,bench-peers]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/ruff check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

layers: $(STAMP)
	$(BIN)/lint-imports

$(CHROMIUM):
	$(APT_INSTALL) chromium || { $(SUDO) apt-get update -q && $(APT_INSTALL) chromium; }

unit: $(STAMP) $(CHROMIUM)
	$(BIN)/pytest -q

test: lint typecheck layers unit

# docs/flags.md from the flag table (src/endpoint_picker/flags); a unit test fails while stale
flags-doc: $(STAMP)
	$(BIN)/python -m endpoint_picker.flags > docs/flags.md

# requirements.lock, what the image installs: pyproject.toml's runtime dependencies and build
# backend, pinned with every file's hash (pip-tools in a throwaway virtualenv, PyPI only)
lock:
	rm -rf .lock-venv && $(PY) -m venv .lock-venv
	.lock-venv/bin/pip install -q pip-tools==7.6.2
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null .lock-venv/bin/pip-compile --quiet \
		--generate-hashes --strip-extras --allow-unsafe --build-deps-for wheel \
		--index-url https://pypi.org/simple --no-emit-index-url --no-emit-find-links \
		-o requirements.lock pyproject.toml
	rm -rf .lock-venv

run: $(STAMP)
	$(BIN)/python -m endpoint_picker.devrun

bench: $(STAMP)
	for f in benchmarks/bench_*.py; do $(BIN)/python $$f || exit 1; done  # `epp bench soak` (30 min) runs on its own

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
