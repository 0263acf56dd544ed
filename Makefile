# Set-up is idempotent: the virtual environment is (re)built when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test fetch bench lint

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,vllm,speculators,trl,ray]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP)

fetch: $(STAMP)
	$(PY) -m draft_align fetch all

demo: fetch
	$(PY) -m draft_align cotrain recipes/smollm2_cotrain.yaml

test: fetch
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check draft_align tests benchmarks

bench: fetch
	$(PY) benchmarks/warmstart.py
	$(PY) benchmarks/drift.py
	$(PY) benchmarks/drift.py --name vllm --oracle-at "" --overhead-reps 0 rl.engine=vllm rl.lr=5e-4 rl.prompts_per_step=6
	$(PY) benchmarks/vllm_engine.py
	$(PY) benchmarks/vllm_sampling.py
	$(PY) benchmarks/draft_variants.py --eagle-draft checkpoints/smollm2-bench-ttt --drifted checkpoints/smollm2-drift/policy_merged/v0020 --warm-s 600 --adapt-s 180
