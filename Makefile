# The two commands a newcomer needs: `make serve` and `make test`.
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
PACKAGES := foundation server semcache backends harness
# pytest-xdist workers; --dist loadscope keeps each module (and its module fixtures) on one.
WORKERS ?= 2
XDIST := $(if $(filter-out 0 1,$(WORKERS)),-n $(WORKERS) --dist loadscope)

.PHONY: install serve test test-fast lint format backends-up screenshots image image-test

install:
	@bash scripts/install.sh

## Start the embedded default: vLLM (SmolLM2) + the gateway on http://127.0.0.1:8080
serve: install
	$(BIN)/semcache serve $(if $(CONFIG),--config $(CONFIG)) $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT))

backends-up: install
	$(BIN)/semcache backends up $(if $(CONFIG),--config $(CONFIG))

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy $(PACKAGES)

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

## Everything: lint, types and the whole suite (real vLLM, real Redis). CI runs this.
## Failures are summed up last, one wide line each (the end of the log is what CI shows).
## The system services install (apt) meanwhile: they wait on the network and dpkg, not on
## the CPU that the venv install and mypy use. Their log is printed once they are in.
test:
	@mkdir -p .data && bash scripts/test-services.sh > .data/test-services.log 2>&1 & services=$$!; \
	$(MAKE) --no-print-directory lint; lint=$$?; \
	wait $$services; installed=$$?; cat .data/test-services.log; \
	[ $$lint -eq 0 ] && [ $$installed -eq 0 ]
	COLUMNS=$${COLUMNS:-400} $(BIN)/pytest $(XDIST) -rfEs --durations=20 $(PYTEST_ARGS)

## The fast set only (no vLLM, no Redis server).
test-fast: install
	$(BIN)/pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

## Screenshots of every dashboard page (docs/images/dashboard/), from Debian's chromium.
screenshots: install
	@bash scripts/chromium.sh install
	$(BIN)/python scripts/dashboard_screenshots.py $(if $(VLLM_URL),--vllm-url $(VLLM_URL) --served-model $(SERVED_MODEL))

## The OCI image (podman, from Debian's packages and PyPI's wheels, no registry): prints its size.
## GPU=1: the CUDA vLLM build. docs/deploy.md.
image: install
	@bash scripts/image.sh $(if $(GPU),--gpu)

## The image run as operators run it (podman run, the compose topology): opt-in, minutes.
image-test: image
	@bash scripts/image.sh services
	SEMCACHE_IMAGE_TESTS=1 $(BIN)/pytest -m slow -s -rA tests/deploy/test_image.py
