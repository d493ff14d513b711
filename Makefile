# tandem: `make serve` sets up and serves the built-in tiny models; `make test` sets up and tests.
PYTHON ?= python3
VENV   ?= .venv
# GPU nodes: make setup EXTRAS=gpu,test
EXTRAS ?= cpu,test
# Pinned versions (constraints/lock.sh, `make lock`, writes them): a fresh install resolves these.
CONSTRAINTS ?= constraints/$(if $(findstring gpu,$(EXTRAS)),gpu,cpu).txt
BIN    := $(VENV)/bin
# Installs go through uv (pinned; ~10x pip's speed on a fresh machine, the same pinned versions).
# uv reads no pip configuration: pip's configured find-links (where a machine keeps a wheel such as
# torch's CPU build) are passed on. uv writes no bytecode unless asked (pip does): without it every
# process (a gateway, a Ray actor, vLLM's engine core and worker) compiles vllm, torch and
# transformers from source at import, ~30 s each on this machine (PYTHONDONTWRITEBYTECODE is set
# here, so nothing is ever cached): --compile-bytecode compiles them once, at install.
UV_VERSION := 0.13.10
PIP_LINKS  := $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
UV     := $(BIN)/uv pip install -q --compile-bytecode $(foreach d,$(PIP_LINKS),--find-links $(d))
# instructor pins a jiter the newest openai cannot use: its own venv, where its test looks for it.
INSTRUCTOR_VENV := .venv-instructor

.PHONY: setup instructor models prometheus serve test unit bench clean lock

setup: $(VENV)/.installed

$(BIN)/uv:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv==$(UV_VERSION)

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) | $(BIN)/uv
	$(UV) --python $(BIN)/python -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	@# vllm pulls CUDA builds of these from PyPI; they break `import transformers` on CPU.
	$(BIN)/uv pip uninstall -q --python $(BIN)/python torchvision torchaudio torchcodec 2>/dev/null || true
	@# tandem's own modules (an editable install: uv compiles none of them) once, not in every process.
	$(BIN)/python -m compileall -q -j 0 tandem_core workers diffusion_plugin gateway tandem_tools tests
	touch $@

instructor: $(INSTRUCTOR_VENV)/.installed

$(INSTRUCTOR_VENV)/.installed: constraints/instructor.txt | $(BIN)/uv
	$(PYTHON) -m venv $(INSTRUCTOR_VENV)
	$(UV) --python $(INSTRUCTOR_VENV)/bin/python -r constraints/instructor.txt
	touch $@

models: setup
	$(BIN)/tandem build-tiny-models

serve: models
	$(BIN)/tandem serve $(ARGS)

# The metrics tests run a real Prometheus (Debian package).
prometheus:
	@command -v prometheus >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; }

# One process by default. UNIT_WORKERS="-n 2 --dist loadgroup" runs the unit tests on two workers
# (nearly all of them one thread: 853 s of wall time on a fresh inductor cache), but one of two
# fresh-clone runs failed 8 tests of test_batches.py there (a fake gateway's connection closed
# mid-body: two workers' servers on one port is the suspect, not yet checked): not CI's default
# until that is fixed. PARALLEL="-n 2 --dist loadgroup" does the same for the integration tests,
# measured no faster on this 2-core box (docs/testing.md).
UNIT_WORKERS ?=
PARALLEL ?=

test: models prometheus instructor
	$(BIN)/ruff check tandem_core workers diffusion_plugin gateway tandem_tools tests deploy
	$(BIN)/python -m pytest tests/unit $(UNIT_WORKERS) $(PYTEST_ARGS)
	$(BIN)/python -m pytest tests/integration tests/gpu $(PARALLEL) $(PYTEST_ARGS)

unit: setup
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

bench: models
	$(BIN)/tandem bench $(ARGS)

# Re-resolve every dependency afresh and rewrite constraints/ (then commit them and `make clean test`).
lock:
	PYTHON=$(PYTHON) constraints/lock.sh

clean:
	rm -rf $(VENV) $(INSTRUCTOR_VENV) models .pytest_cache
