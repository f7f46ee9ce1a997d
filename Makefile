# `make test` and `make demo` work on a bare clone: they create .venv, install the CPU torch wheel first
# (an unpinned torch pulls GBs of CUDA packages), then this package with its test extras.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trainer_ext-installed
PYTEST_ARGS ?=
# `make test` runs two test files at a time (pytest-xdist, a file per worker, in tests/support/order.py's order): a
# launched process spends much of its time starting up on one core, so two streams fill the 2 cores CI has.
# TEST_JOBS=0: serial.
TEST_JOBS ?= 2

.PHONY: setup test test-fast test-without-libraries test-oldest test-newest mutate demo clean gpu-setup gpu-test gpu-bench gpu-check

setup: $(STAMP)

# Each virtual environment here (.venv, .venv-oldest, .venv-newest): created, with pip upgraded.
%/bin/python:
	python3 -m venv $*
	$@ -m pip install --quiet --upgrade pip

# Every release pinned to what the suite last passed on (constraints/tested.txt): a new upstream release cannot break a
# fresh clone or CI overnight. `make test-newest` tries the newest releases setup.py admits.
$(STAMP): $(PY) setup.py constraints/tested.txt
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test]" -c constraints/tested.txt
	$(PY) -m pip install --quiet --no-deps --upgrade --target .qlora-site bitsandbytes -c constraints/tested.txt
	touch $(STAMP)

test: setup
	$(PY) -m pytest tests -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The unit subset (no process started, no model package, no GPU, no DeepSpeed op compiled); the markers are in
# pytest.ini and tests/support/markers.py fails a test that starts a process without being marked `launch`. In a
# shuffled order (test files, and the tests in each), so no test leans on another having run first: the header says
# the seed; PYTEST_ARGS="--random-order-seed=N" repeats that order, PYTEST_ARGS="--random-order-bucket=none" keeps
# the files' own.
test-fast: setup
	$(PY) -m pytest tests -m "not launch and not cuda" --random-order-bucket=module $(PYTEST_ARGS)

# Mutation testing (mutmut) of the modules behind the promises against the unit tests, each module's score, and the
# survivors neither killed nor listed as equivalent in docs/mutation.md (scripts/mutate.py). Not in .ci/run.
mutate: setup
	$(PY) scripts/mutate.py

# The unit subset as on a machine without DeepSpeed, FairScale and the MiniLM package (hidden by
# tests/scripts/without_libraries/sitecustomize.py): the markers must deselect what needs them, cleanly (~2 min).
test-without-libraries: setup
	PYTHONPATH=tests/scripts/without_libraries $(PY) -m pytest tests \
		-m "not launch and not cuda and not deepspeed and not fairscale and not model_package" $(PYTEST_ARGS)

# The lowest versions setup.py admits (constraints/oldest.txt) in their own .venv-oldest, and the smoke subset marked
# `oldest` in tests/: one DDP, one ZeRO-2, one `simple` and two resume runs, plus the unit tests that catch a Trainer
# method ExtTrainer overrides being renamed. setup.py's ranges are what this passes on. Not in .ci/run: ~11 min from a
# fresh clone on 2 busy cores (install 2.5, DeepSpeed's op build 4.5, tests 4), ~5 min once .venv-oldest exists.
OLDEST_VENV ?= .venv-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.trainer_ext-installed

$(OLDEST_STAMP): $(OLDEST_PY) setup.py constraints/oldest.txt
	$(OLDEST_PY) -c "import torch" 2>/dev/null || $(OLDEST_PY) -m pip install torch==2.13.0
	$(OLDEST_PY) -m pip install -e ".[test-core]" -c constraints/oldest.txt
	touch $(OLDEST_STAMP)

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -m pytest tests -m oldest $(PYTEST_ARGS)

# The newest releases setup.py admits (no constraints file), in their own .venv-newest, and the whole suite as CI runs
# it (~35 min on 2 cores, plus ~5 min of installs): what a user's fresh `pip install trainer_ext` gets. Green: refresh
# constraints/tested.txt from it (docs/versions.md). Not in .ci/run. TEST_NEWEST_ARGS="-m oldest" for the smoke subset.
# torch too is the newest (a CUDA wheel from PyPI, ~3 GB with its libraries); where pip's own configuration caps it
# (this project's build machines: /etc/xdg/pip), PIP_CONFIG_FILE=/dev/null make test-newest lifts the cap.
NEWEST_VENV ?= .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
TEST_NEWEST_ARGS ?= -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

test-newest: $(NEWEST_PY)
	$(NEWEST_PY) -m pip install --upgrade --upgrade-strategy eager -e ".[test]" torch datasets
	$(NEWEST_PY) -m pip list --format freeze | grep -iE "^(transformers|accelerate|datasets|deepspeed|peft|trl|optuna)=="
	$(NEWEST_PY) -m pytest tests $(TEST_NEWEST_ARGS) $(PYTEST_ARGS)

# The main job: fine-tune the pretrained MiniLM with DeepSpeed ZeRO-2 on 2 ranks (CPU ranks if no GPU).
DEMO_OUT ?= output/demo
demo: setup
	$(VENV)/bin/deepspeed --num_gpus 2 examples/run_glue.py --deepspeed ds_configs/zero2_minimal.json \
		--output_dir $(DEMO_OUT) --do_train --do_eval --evaluate_before_training --num_train_epochs 2 \
		--per_device_train_batch_size 16 --learning_rate 5e-5 --warmup_ratio 0.1 --max_seq_length 64 \
		--logging_steps 10 --save_strategy no --report_to none

# On a machine with a CUDA GPU: its own python with a CUDA build of torch (never .venv, which holds the CPU wheel).
# deepspeed, fairscale and datasets come from .whl/ when it exists (wheels built for that machine's python, for a machine
# without internet; `pip wheel --no-deps deepspeed fairscale` builds the two that ship as sources), else from pip.
# `gpu-test` runs every CUDA-only test (~4 min with PYTEST_ARGS="-n 8" on one H100), `gpu-bench` benchmarks/gpu.py (under 10 min, writes benchmarks/results/gpu.md); `gpu-check` runs both.
GPU_PY ?= python3
GPU_SITE ?= /tmp/trainer_ext-gpu-site
GPU_ENV = PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} PATH=$(GPU_SITE)/bin:$$PATH PYTHONUNBUFFERED=1

gpu-setup:
	@$(GPU_PY) scripts/gpu_preflight.py || exit 2
	@if $(GPU_ENV) $(GPU_PY) -c "import deepspeed, fairscale, datasets" 2>/dev/null; then echo "deepspeed, fairscale, datasets: installed"; \
	elif [ -d .whl ]; then $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) .whl/*.whl; \
	else $(GPU_PY) -m pip install -q "deepspeed>=0.19,<0.20" "fairscale==0.4.13" "datasets>=3.0"; fi

gpu-test: gpu-setup
	$(GPU_ENV) $(GPU_PY) -m pytest tests -m cuda -ra $(PYTEST_ARGS)

gpu-bench: gpu-setup
	$(GPU_ENV) $(GPU_PY) benchmarks/gpu.py $(BENCH_ARGS)

gpu-check: gpu-test gpu-bench

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(NEWEST_VENV) build *.egg-info .pytest_cache mutants .qlora-site
