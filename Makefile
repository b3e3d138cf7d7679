# Each target creates .venv and installs what it needs, so both work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The pinned torch resolves to the local CPU build on these machines; an unpinned torch would
# pull several GB of CUDA wheels.
TORCH := torch==2.13.0

.PHONY: test test-fast demo bench venv clean deploy-check

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.torch: $(VENV)/bin/activate
	$(PIP) install -q $(TORCH)
	touch $@

$(VENV)/.dev: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[dev]"
	touch $@

$(VENV)/.demo: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[demo]"
	touch $@

$(VENV)/.bench: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[bench]" $(TORCH)
	touch $@

venv: $(VENV)/.dev

test: $(VENV)/.dev
	$(PY) -m pytest -q -p no:cacheprovider tests psg_core --doctest-modules

# The unit tests of psg_core, the wire and the service (about a minute on 2 cores); `make test`
# adds the integration and Ray tests (the `slow` marker, see tests/conftest.py).
test-fast: $(VENV)/.dev
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests psg_core --doctest-modules

demo: $(VENV)/.demo
	$(VENV)/bin/psg-demo

bench: $(VENV)/.bench
	$(PY) -m benchmarks.run

# deploy/ for real: builds the CPU image, runs the CPU compose stack (docker compose v2, or podman +
# podman-compose) through DP steps, a scale-up, a stopped and a killed worker and a frontend
# restart, and tears it down (deploy/deploy_check.py). Not part of `make test`: CI has no container
# engine. Extra options: make deploy-check DEPLOY_CHECK_ARGS="--build-arg NAME=VALUE --keep ..."
deploy-check: $(VENV)/.dev
	$(PY) deploy/deploy_check.py $(DEPLOY_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
