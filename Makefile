# `make test` and `make demo` work on a bare clone: they create .venv, install the CPU torch wheel first
# (an unpinned torch pulls GBs of CUDA packages), then this package with its test extras.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trainer_ext-installed
PYTEST_ARGS ?=

.PHONY: setup test demo clean

setup: $(STAMP)

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) setup.py
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test]"
	touch $(STAMP)

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

demo: setup
	$(PY) examples/ds_config_demo.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
