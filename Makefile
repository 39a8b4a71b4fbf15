# One venv in the project root; every target installs first (a no-op when nothing changed).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
SYSPY ?= python3

.PHONY: install fetch serve test test-fast lint generate docker-test
PROMPT ?= Explain speculative decoding in two sentences.
TARGET ?= smollm2-135m-instruct
# Test processes: two share a 2-core CI machine best (see tests/conftest.py); more each load the models again.
TEST_WORKERS ?= 2

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(SYSPY) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned to the CPU wheel on this machine's disk; unpinned pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,dev,bench]'
	# TGI's client pins huggingface-hub<1.0, which transformers 5 cannot use; what it imports (requests,
	# aiohttp, pydantic) is in the test extra, so it goes in without its pins.
	$(PY) -m pip install -q --no-deps text-generation==0.7.0
	touch $(STAMP)

fetch: install
	$(VENV)/bin/specserve models fetch $(TARGET)

serve: fetch
	$(VENV)/bin/specserve serve

generate: fetch
	$(VENV)/bin/specserve generate "$(PROMPT)" --compare

test: fetch
	$(VENV)/bin/ruff check app tests docker tools
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The fast loop: every test that runs without the real pretrained target (tiny models, toy tokenizers; the
# `slow` marker, tests/conftest.py), in under two minutes.
test-fast: install
	$(VENV)/bin/ruff check app tests docker tools
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

lint: install
	$(VENV)/bin/ruff check app tests docker tools
	$(VENV)/bin/ruff format --check app tests docker tools

# The image and the compose stack built and run for real (docker/ci/test.sh: as root, with Debian's packages
# and PyPI; no Docker Hub needed). No venv needed either.
docker-test:
	bash docker/ci/test.sh
